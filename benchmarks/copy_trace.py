"""One traced call of the weight-streaming op: when each slice's copy and GEMM ran, on
which stream, and at what bandwidth each copy moved. The question it answers: why do
2-D slices of a row-major w fall behind dense (1-D) slices of w^T under the GEMMs
(README, "Measured on the H200", P4)?

    PYTHONPATH=. python3 benchmarks/copy_trace.py [--m 12288] [--slices 4,8]

For k = n = 8192 bf16 and each S, it profiles one call (after warm-up) of
``examples.stream_weights`` with w row-major (one cudaMemcpy2DAsync per slice) and with
w column-major (one cudaMemcpyAsync per slice) and prints every copy and GEMM with its
start and end (µs from the first event), its stream and, for copies, GB/s.

What it showed on the H200 (m = 12288, README "Measured on the H200"): the copies ran
back to back in slice order, each slice's GEMM under the next slice's copy, for both
layouts; the 2-D copies moved 49 GB/s with 4 KiB rows (S = 4) and 37 GB/s with 2 KiB
rows (S = 8), the 1-D ones 52-55 GB/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_copy import DTYPE, K, N, op_for  # noqa: E402

import codegen as cg  # noqa: E402
from codegen.timeline import COPIES, profile_gpu  # noqa: E402


def trace(op: cg.CompiledOp, x: torch.Tensor, w: torch.Tensor) -> str:
    events = [e for e in profile_gpu(lambda: op(x, w), warmup=3) if e.kind != "memset"]
    t0 = events[0].start_us
    streams = {s: k for k, s in enumerate(sorted({e.stream for e in events}))}
    lines = [f"  {'what':<6} {'stream':>6} {'start':>8} {'end':>8} {'us':>7} {'GB/s':>6}"]
    for e in events:
        rate = f"{e.nbytes / e.duration_us / 1e3:6.1f}" if e.kind in COPIES else ""
        what = e.kind if e.kind in COPIES else "gemm"
        lines.append(f"  {what:<6} {streams[e.stream]:>6} {e.start_us - t0:8.1f} "
                     f"{e.end_us - t0:8.1f} {e.duration_us:7.1f} {rate}")
    lines.append(f"  total {events[-1].end_us - t0:.1f} us")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, default=12288)
    parser.add_argument("--slices", default="4,8")
    args = parser.parse_args()
    x = torch.randn(args.m, K, device="cuda", dtype=DTYPE)
    w_rows = torch.randn(K, N, dtype=DTYPE).pin_memory()
    w_cols = torch.randn(N, K, dtype=DTYPE).pin_memory().t()
    for s in (int(v) for v in args.slices.split(",")):
        op = op_for(s)
        for name, w in (("2-D (row-major w)", w_rows), ("1-D (column-major w)", w_cols)):
            print(f"S={s} m={args.m} {name}:\n{trace(op, x, w)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
