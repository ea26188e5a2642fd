"""Where does forward + backward of the GPU-resident ``llama_mlp`` spend its GPU time, at
each slice count against torch autograd?

One step is ``op(x, w_gate, w_up, w_down).backward(grad)`` (h 4096, i 14336, m 4096,
bf16), as ``benchmarks.backward`` times it. For torch and for each S this probe prints:
the step's time (CUDA events, median of 5 after a warm-up), then from one profiled step
the kernels' summed time split into GEMMs and the rest, the time the GPU had at least one
kernel running (the union of their intervals), the idle time inside the step, and the
kernels that took the most time. A step slower than torch's by more than its kernels are
is losing to idle time or to kernels running side by side on several streams.

    python -m benchmarks.probes.backward_kernels [--slices 1,4,8] [--top 6]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import codegen as cg
from benchmarks.common import parse_ints
from codegen import examples

GEMM_WORDS = ("gemm", "sm90", "cutlass", "xmma", "matmul")


def llama(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def kernel_summary(run: Callable[[], None], top: int) -> str:
    """The profiled kernels of one call of ``run``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    first, last = spans[0][0], max(e for _, e in spans)
    by_name: dict[str, float] = defaultdict(float)
    gemm = other = 0.0
    for k in kernels:
        us = k.time_range.end - k.time_range.start
        by_name[k.name[:70]] += us
        if any(w in k.name.lower() for w in GEMM_WORDS):
            gemm += us
        else:
            other += us
    lines = [f"  {len(kernels)} kernels: GEMMs {gemm / 1e3:.3f} ms, others {other / 1e3:.3f} ms; "
             f"GPU busy {busy / 1e3:.3f} of {(last - first) / 1e3:.3f} ms "
             f"(idle {(last - first - busy) / 1e3:.3f} ms)"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {us / 1e3:7.3f} ms  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", default="1,4,8")
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("backward_kernels needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    leaves = [torch.randn(*s, device="cuda", generator=g).mul_(0.02).bfloat16().requires_grad_()
              for s in shapes]
    grad = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    fns: dict[str, Callable[..., torch.Tensor]] = {"torch": llama}
    for s in parse_ints(args.slices, "--slices"):
        fns[f"S={s}"] = cg.compile(examples.llama_mlp(torch.bfloat16, s,
                                                      name=f"probe_bwd_kernels_s{s}"))
    for name, fn in fns.items():
        def run(fn: Callable[..., torch.Tensor] = fn) -> None:
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(grad)

        for _ in range(3):
            run()
        times = []
        for _ in range(5):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        print(f"{name}: {statistics.median(times):.3f} ms a step", flush=True)
        print(kernel_summary(run, args.top), flush=True)


if __name__ == "__main__":
    main()
