"""One traced call of the weight-streaming op: when each slice's copy and GEMM ran, on
which stream, and at what bandwidth each copy moved. The question it answers: why do
2-D slices of a row-major w fall behind dense (1-D) slices of w^T under the GEMMs
(benchmarks.bench_copy)?

    python -m benchmarks.probes.copy_trace [--m 12288] [--slices 4,8] [--calls N]

For k = n = 8192 bf16 and each S, it profiles one call (after warm-up) of
``examples.stream_weights`` with w row-major (one cudaMemcpy2DAsync per slice) and with
w column-major (one cudaMemcpyAsync per slice) and prints every copy and GEMM with its
start and end (µs from the first event), its stream and, for copies, GB/s.

With ``--calls N`` (N > 1) it profiles N back-to-back calls instead, as the benchmark
runs them, of the op (both layouts), the hand-written Python pipeline, copy alone and
copy-then-GEMM, and prints one line per call: its period (from its first copy to the
next call's), the copy engine's busy time and rate, GEMM time not under a copy, and the
time in which neither ran (idle). A period longer than one call's, traced alone, shows
where a sustained loop loses time (``sustained``). On the H200 (``results/
copy_sustained.txt``) a call of the op at S = 16 lost its time to copies moving 51 GB/s
against 55 GB/s alone; the last GEMM and the idle time stayed within the floor.

What it showed on the H200 (m = 12288, ``results/copy_trace.txt``): the copies ran back to
back in slice order, each slice's GEMM under the next slice's copy, for both layouts; the
2-D copies moved 49 GB/s with 4 KiB rows (S = 4) and 37 GB/s with 2 KiB rows (S = 8), the
1-D ones 52-55 GB/s.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

import codegen as cg
from benchmarks.common import POOL, PythonCopyPipeline
from codegen import examples
from codegen.tools.timeline import COPIES, KernelEvent, covered, profile_gpu, union

K = N = 8192  # w [K, N] bf16: 128 MiB, as benchmarks.bench_copy streams it
DTYPE = torch.bfloat16


@functools.cache
def op_for(slices: int) -> cg.CompiledOp:
    """The weight-streaming op of benchmarks.bench_copy at S = ``slices``."""
    return cg.compile(examples.stream_weights(DTYPE, slices), pool_size=POOL)


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


def sustained(fn: Callable[[], object], copies_per_call: int, calls: int) -> str:
    """One line per call of ``calls`` back-to-back calls of ``fn`` (traced together after
    a warm-up): a call runs from its first host-to-device copy to the next call's."""
    events: list[KernelEvent] = profile_gpu(lambda: [fn() for _ in range(calls)], warmup=3)
    copies = [e for e in events if e.kind == "HtoD"]
    if len(copies) != calls * copies_per_call:
        raise RuntimeError(f"sustained: traced {len(copies)} host-to-device copies, expected "
                           f"{calls} calls x {copies_per_call}")
    work = [e for e in events if e.kind != "memset"]
    # A call's copies all start after the previous call's (each call joins its streams
    # into the caller's before the next forks), so the k-th copy by start time opens a call.
    starts = [copies[c * copies_per_call].start_us for c in range(calls)]
    starts.append(max(e.end_us for e in work))
    copy_union = union([(e.start_us, e.end_us) for e in copies])
    gemm_union = union([(e.start_us, e.end_us) for e in work if e.kind not in COPIES])
    busy_union = union(copy_union + gemm_union)
    lines = [f"  {'call':>4} {'period':>8} {'copy':>8} {'GB/s':>6} {'GEMM':>8} "
             f"{'exposed':>8} {'idle':>7} {'memsets':>7}"]
    for c in range(calls):
        a, b = starts[c], starts[c + 1]
        mine = [e for e in copies if a <= e.start_us < b]
        copy_us = covered(a, b, copy_union)
        nbytes = sum(e.nbytes for e in mine)
        gemm_us = covered(a, b, gemm_union)
        both = sum(covered(max(s, a), min(e, b), copy_union) for s, e in gemm_union
                   if max(s, a) < min(e, b))
        exposed = gemm_us - both
        idle = (b - a) - covered(a, b, busy_union)
        memsets = sum(1 for e in events if e.kind == "memset" and a <= e.start_us < b)
        rate = nbytes / copy_us / 1e3 if copy_us > 0 else 0.0
        lines.append(f"  {c:>4} {b - a:8.1f} {copy_us:8.1f} {rate:6.1f} "
                     f"{gemm_us:8.1f} {exposed:8.1f} {idle:7.1f} {memsets:>7}")
    lines.append("  (us; exposed: GEMM time with no copy running; idle: neither running; "
                 "the last call ends at its last kernel)")
    return "\n".join(lines)


def sustained_all(m: int, slices: list[int], calls: int) -> None:
    """``sustained`` for the op (2-D and 1-D slices), the Python pipeline, copy alone and
    copy-then-GEMM, as benchmarks.bench_copy times them."""
    x = torch.randn(m, K, device="cuda", dtype=DTYPE)
    w_rows = torch.randn(K, N, dtype=DTYPE).pin_memory()
    w_cols = w_rows.t().contiguous().pin_memory().t()
    w_dev = w_rows.to("cuda")
    out = torch.empty(m, N, device="cuda", dtype=DTYPE)

    def copy_then_gemm() -> None:
        w_dev.copy_(w_rows, non_blocking=True)
        torch.matmul(x, w_dev, out=out)

    runs: list[tuple[str, Callable[[], object], int]] = [
        ("copy alone", lambda: w_dev.copy_(w_rows, non_blocking=True), 1),
        ("copy then GEMM", copy_then_gemm, 1)]
    for s in slices:
        op, pipeline = op_for(s), PythonCopyPipeline(w_rows, s)
        runs += [(f"op S={s} 1-D (column-major w)", lambda op=op: op(x, w_cols), s),
                 (f"op S={s} 2-D (row-major w)", lambda op=op: op(x, w_rows), s),
                 (f"python S={s}", lambda p=pipeline: p(x), s)]
    for name, fn, per_call in runs:
        print(f"{name}, m={m}, {calls} calls back to back:\n"
              f"{sustained(fn, per_call, calls)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.copy_trace", description=__doc__)
    parser.add_argument("--m", type=int, default=12288)
    parser.add_argument("--slices", default="4,8")
    parser.add_argument("--calls", type=int, default=1,
                        help="trace this many calls back to back (see the docstring)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("copy_trace: needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.calls > 1:
        sustained_all(args.m, [int(v) for v in args.slices.split(",")], args.calls)
        return 0
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
