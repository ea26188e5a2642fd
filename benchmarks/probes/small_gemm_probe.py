"""Why a split 2048^3 GEMM replayed from a CUDA graph is slower than one GEMM (target
<= 1.3x): GPU time only, no host cost.

    python -m benchmarks.probes.small_gemm_probe [--size 2048] [--rounds 30]

Interleaved (order rotated per round, after a warm-up), each variant a CUDA graph of one
call, replayed in blocks: one GEMM; the op at S = 2 and 4 with every GEMM on all SMs and
with an SM budget (``gemm_sm_count``) of 1/S of the GPU, so that S slices can share it;
and the S GEMMs of the op in sequence on one stream (``pool_size=1``). Then one replay
of each op under the profiler: the kernel each slice ran, its duration and whether the
slices overlapped (the union of their spans against their sum).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import codegen as cg
from benchmarks.common import Block, ratio_fields, run_rounds, warm_up
from codegen import examples
from codegen.nn import capture_graph
from codegen.tools.timeline import profile_gpu


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.small_gemm_probe", description=__doc__)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("small_gemm_probe: needs a CUDA GPU", file=sys.stderr)
        return 1
    n = args.size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ops = {}
    for s in (2, 4):
        ops[f"S={s}"] = cg.compile(examples.matmul_rows(torch.bfloat16, s))
        ops[f"S={s} sm={sms // s}"] = cg.compile(examples.matmul_rows(torch.bfloat16, s),
                                                 gemm_sm_count=sms // s)
        ops[f"S={s} one stream"] = cg.compile(examples.matmul_rows(torch.bfloat16, s),
                                              pool_size=1)
    variants = {"gemm": lambda: torch.matmul(a, b)}
    variants |= {name: (lambda op=op: op(a, b)) for name, op in ops.items()}
    graphs = {name: capture_graph(fn) for name, fn in variants.items()}
    ref = torch.matmul(a.float(), b.float())
    for name, (graph, out) in graphs.items():
        graph.replay()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)
    reps = 50
    blocks = {name: Block(graph.replay, reps) for name, (graph, _) in graphs.items()}
    warm_up(lambda: [g.replay() for g, _ in graphs.values()], 1.5, batch=5)
    names = list(blocks)
    times = run_rounds(blocks, args.rounds)
    print(f"{n}^3 bf16, CUDA-graph replay, {args.rounds} interleaved rounds of {reps}; "
          f"{sms} SMs")
    print(f"{'variant':<18} {'us':>8} {'/ GEMM':>7} {'IQR':>13}")
    for v in names:
        f = ratio_fields("r", times[v], times["gemm"])
        print(f"{v:<18} {statistics.median(times[v]) * 1e3:8.1f} {f['r']:7.3f} "
              f"{f['r_iqr'][0]:6.3f}-{f['r_iqr'][1]:.3f}")
    for name, (graph, _) in graphs.items():
        events = [e for e in profile_gpu(graph.replay, warmup=3) if e.kind == "kernel"]
        span = max(e.end_us for e in events) - min(e.start_us for e in events)
        busy = sum(e.duration_us for e in events)
        kernels = ", ".join(f"{e.duration_us:.1f}" for e in events)
        print(f"{name:<18} span {span:6.1f} us, kernels sum {busy:6.1f} us [{kernels}]  "
              f"{events[0].name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
