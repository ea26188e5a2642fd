"""Where does a training step of the offloaded ``llama_mlp`` spend its time?

One step is ``op(x, w_gate, w_up, w_down).backward(grad)`` with the three weights in pinned
host memory (h 4096, i 14336, bf16, 512 tokens, S = 8): the saving forward streams the
weights in, the backward streams them in again (for dX) and the gradients out. This probe
times the step and its two halves with CUDA events, measures the host time of each half
(the backward ends with a host wait: its outputs are in host memory), and prints the
profiler's table of the CUDA kernels and memcpys of one step with their total time, so the
gap to the copy floor can be assigned to copies, GEMMs, kernels or idle time.

    python -m benchmarks.probes.train_offload_trace [--tokens 512] [--slices 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import codegen as cg
from codegen import examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--slices", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_offload_trace needs a CUDA GPU")
    h, i = 4096, 14336
    x = torch.randn(args.tokens, h, device="cuda").mul_(0.1).bfloat16().requires_grad_()
    ws = [torch.randn(*s).mul_(0.02).bfloat16().pin_memory().requires_grad_()
          for s in [(i, h), (i, h), (h, i)]]
    grad = torch.randn(args.tokens, h, device="cuda").bfloat16()
    op = cg.compile(examples.llama_mlp(torch.bfloat16, args.slices, weights="cpu",
                                       name=f"probe_train_offload_s{args.slices}"))

    def step() -> tuple[float, float]:
        for t in (x, *ws):
            t.grad = None
        t0 = time.perf_counter()
        y = op(x, *ws)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for _ in range(3):
        for t in (x, *ws):
            t.grad = None
        events[0].record()
        t0 = time.perf_counter()
        y = op(x, *ws)
        events[1].record()
        t1 = time.perf_counter()
        y.backward(grad)
        events[2].record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"step: forward {events[0].elapsed_time(events[1]):.2f} ms GPU "
              f"({(t1 - t0) * 1e3:.2f} ms host), backward "
              f"{events[1].elapsed_time(events[2]):.2f} ms GPU ({(t2 - t1) * 1e3:.2f} ms host)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18,
                                    max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
