"""Do the GEMM slices slow the host-to-device copies that run under them, and does an SM
budget for the GEMMs give the copies their bandwidth back?

    python -m benchmarks.probes.copy_contention [--rounds 7] [--sm 0,120,100] [--parts 1,2,3,4]

A sustained trace of the weight-streaming op (``copy_trace --calls``) showed where a
balanced call loses time against its floor: the copies move 50-53 GB/s under the GEMMs,
against 55 GB/s alone. This asks why, in four parts, for k = n = 8192 bf16:

1. **Copy rate under a load.** 128 MiB of pinned memory copied to the GPU as 16 1-D
   copies of 8 MiB on one stream, back to back, timed by CUDA events on that stream,
   (each to its own place, or into 4 reused slots as the op's copies go) while another
   stream runs a load that outlasts them: nothing; a sleep kernel (one
   SM, no memory traffic); the op's GEMM slice (x [m, k] @ a column-major [k, n/16]
   slot, through a one-slice program built with ``gemm_sm_count`` = each of ``--sm``);
   the Python pipeline's (torch.matmul with a row-major slot). GB/s, median of rounds.
2. **The op with an SM budget.** The op at S = 8 and 16 (1-D slices) built with each
   ``gemm_sm_count``, interleaved with the Python pipeline, copy alone and GEMM alone on
   the balanced shape: time / (max(copy, GEMM) * (1 + 1/S)), the pipeline's floor.
3. **One copy stream.** The op and the Python pipeline against the same pipeline with
   every copy on one copy stream (``common.PythonCopyStreamPipeline``), at S = 4, 8,
   16, interleaved; then ``--calls`` calls of the latter traced back to back.
4. **Which pinned buffer.** Copy alone and the op at S = 16 reading one w call after
   call, against four in turn.

What it showed on the H200 (``results/copy_contention.txt``):
the copies kept 53.5-54.1 GB/s under every load, into new places or reused slots; an SM
budget made the op slower; one copy stream was not reliably better (its traced copies
moved 51-52.5 GB/s, like theirs; ahead at S = 16 by 1-6% in two runs, not at S <= 8);
the buffer read made no difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

import codegen as cg
from benchmarks.common import (
    CYCLES_PER_MS,
    POOL,
    PythonCopyPipeline,
    PythonCopyStreamPipeline,
    balanced_m,
    estimate_ms,
    interleaved,
    median_ratio,
    rotated,
)
from benchmarks.probes.copy_trace import DTYPE, K, N, op_for, sustained
from codegen import examples

COPIES = 16  # chunks of the 128 MiB copy in part 1


def copy_rate_under(load: Callable[[], None] | None, w_host: torch.Tensor,
                    dst: torch.Tensor, slots: int = COPIES) -> float:
    """GB/s of COPIES back-to-back 1-D copies of w_host into dst on a copy stream, while
    ``load`` (queued first, on its own stream) runs; copy i goes to dst's chunk
    i % ``slots`` (COPIES: each to its own place, as in a whole-tensor copy; fewer: into
    reused staging slots, as the op's copies do)."""
    copy_stream, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    src, chunks = w_host.view(-1).chunk(COPIES), dst.view(-1).chunk(COPIES)
    out = [chunks[i % slots] for i in range(COPIES)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if load is not None:
        with torch.cuda.stream(load_stream):
            load()
    with torch.cuda.stream(copy_stream):
        start.record()
        for s, d in zip(src, out):
            d.copy_(s, non_blocking=True)
        end.record()
    torch.cuda.synchronize()
    return w_host.numel() * w_host.element_size() / start.elapsed_time(end) / 1e6


def part1(w_host: torch.Tensor, m: int, sms: list[int], rounds: int) -> None:
    x = torch.randn(m, K, device="cuda", dtype=DTYPE)
    chunk = N // COPIES
    slot_col = torch.randn(chunk, K, device="cuda", dtype=DTYPE).t()  # [K, chunk], col-major
    slot_row = torch.randn(K, chunk, device="cuda", dtype=DTYPE)
    out = torch.empty(m, N, device="cuda", dtype=DTYPE)
    dst = torch.empty(K, N, device="cuda", dtype=DTYPE)
    copy_ms = K * N * 2 / 55e6  # about: 55 GB/s
    loads: dict[str, Callable[[], None] | None] = {"nothing": None}
    loads["sleep kernel"] = lambda: torch.cuda._sleep(int(2 * copy_ms * CYCLES_PER_MS))

    def repeat(fn: Callable[[], object]) -> Callable[[], None]:
        """``fn`` called often enough to outlast the copies twice over."""
        calls = max(1, round(2 * copy_ms / estimate_ms(fn, 5)))

        def load() -> None:
            for _ in range(calls):
                fn()
        return load

    loads["torch.matmul, row-major slot"] = repeat(
        lambda: torch.matmul(x, slot_row, out=out[:, :chunk]))
    for sm in sms:
        op = cg.compile(examples._split_matmul(f"slice_gemm_sm{sm}", DTYPE, 1, 1),
                        pool_size=1, gemm_sm_count=sm)
        loads[f"op GEMM, col-major slot, sm={sm or 'all'}"] = repeat(
            lambda op=op: op(x, slot_col))
    names = [(v, slots) for v in loads for slots in (COPIES, POOL)]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in names}
    for r in range(rounds):
        for v, slots in rotated(names, r):
            rates[v, slots].append(copy_rate_under(loads[v], w_host, dst, slots))
    print(f"Part 1: GB/s of {COPIES} back-to-back 1-D host-to-device copies (128 MiB) "
          f"under a load on another stream, m = {m}, median of {rounds} rounds; into "
          f"{COPIES} places, or {POOL} reused slots")
    for v, slots in names:
        r = rates[v, slots]
        print(f"  {v:>40}  {slots:>2} {statistics.median(r):6.1f}  "
              f"(min {min(r):.1f}, max {max(r):.1f})")


def _balanced(w_host: torch.Tensor, w_dev: torch.Tensor, m: int,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Callable[[], object]]]:
    """x [m, K] on the GPU, w stored column-major in pinned memory (dense slices), the
    fp32 reference x @ w, and the two variants every floor needs: copy alone, GEMM alone."""
    x = torch.randn(m, K, device="cuda", dtype=DTYPE)
    out = torch.empty(m, N, device="cuda", dtype=DTYPE)
    w_col = w_host.t().contiguous().pin_memory().t()
    variants: dict[str, Callable[[], object]] = {
        "copy": lambda: w_dev.copy_(w_host, non_blocking=True),
        "gemm": lambda: torch.matmul(x, w_dev, out=out),
    }
    return x, w_col, torch.matmul(x, w_dev).float(), variants


def _check(what: str, y: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((y.float() - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        print(f"WARNING {what}: relative error {err:.3g} against fp32")


def _interleaved(variants: dict[str, Callable[[], object]], rounds: int,
                 warmup_s: float) -> dict[str, list[float]]:
    """Per-round ms of each variant, timed as benchmarks.bench_copy times its variants."""
    return interleaved(variants, rounds, block_ms=15.0, min_reps=2, max_reps=20,
                       warmup_s=warmup_s, per_variant_reps=True)


def _time_against_floor(title: str, variants: dict[str, Callable[[], object]],
                        rounds: int) -> None:
    """Times ``variants`` interleaved and prints each one (named ``what/s<S>...``) over
    its floor max(copy, GEMM) * (1 + 1/S)."""
    t = _interleaved(variants, rounds, 1.5)
    bound = [max(c, g) for c, g in zip(t["copy"], t["gemm"])]
    print(f"\n{title}: copy {statistics.median(t['copy']):.3f} ms, GEMM "
          f"{statistics.median(t['gemm']):.3f} ms; time / (max(copy, GEMM) * (1 + 1/S)), "
          f"median of {rounds} rounds")
    for v in variants:
        if v in ("copy", "gemm"):
            continue
        s = int(v.split("/")[1][1:])
        print(f"  {v:>16}  {statistics.median(t[v]):7.3f} ms  "
              f"{median_ratio(t[v], bound) / (1 + 1 / s):6.3f}")


def part2(w_host: torch.Tensor, w_dev: torch.Tensor, m: int, sms: list[int],
          rounds: int) -> None:
    """The op at S = 8 and 16 with each GEMM SM budget, against the Python pipeline."""
    x, w_col, ref, variants = _balanced(w_host, w_dev, m)
    for s in (8, 16):
        pipeline = PythonCopyPipeline(w_host, s)
        variants[f"python/s{s}"] = lambda p=pipeline: p(x)
        for sm in sms:
            op = cg.compile(examples.stream_weights(DTYPE, s, name=f"stream_weights_sm{sm}"),
                            pool_size=POOL, gemm_sm_count=sm)
            _check(f"op S={s} sm={sm}", op(x, w_col), ref)
            variants[f"op/s{s}/sm{sm}"] = lambda op=op: op(x, w_col)
    _time_against_floor(f"Part 2: balanced m = {m}", variants, rounds)


def part3(w_host: torch.Tensor, w_dev: torch.Tensor, m: int, rounds: int,
          calls: int) -> None:
    """The op and the Python pipeline against the Python pipeline with one copy stream."""
    x, w_col, ref, variants = _balanced(w_host, w_dev, m)
    for s in (4, 8, 16):
        op = op_for(s)
        plain, streamed = PythonCopyPipeline(w_host, s), PythonCopyStreamPipeline(w_host, s)
        _check(f"copy-stream pipeline S={s}", streamed(x), ref)
        variants[f"op/s{s}"] = lambda op=op: op(x, w_col)
        variants[f"python/s{s}"] = lambda p=plain: p(x)
        variants[f"copy-stream/s{s}"] = lambda p=streamed: p(x)
    _time_against_floor(f"Part 3: balanced m = {m}", variants, rounds)
    for s in (8, 16):
        print(f"copy-stream S={s}, {calls} calls back to back:\n"
              f"{sustained(variants[f'copy-stream/s{s}'], s, calls)}", flush=True)


def part4(w_host: torch.Tensor, m: int, rounds: int, buffers: int = 4) -> None:
    """One pinned buffer read call after call, against ``buffers`` of them in turn (as a
    model whose layers' weights stream in one after another reads them): copy alone and
    the op at S = 16, interleaved. A difference is the host side's (address translation
    of pinned pages), not the GPU's."""
    x = torch.randn(m, K, device="cuda", dtype=DTYPE)
    w_dev = torch.empty(K, N, device="cuda", dtype=DTYPE)
    rows = [w_host] + [torch.randn(K, N, dtype=DTYPE).pin_memory() for _ in range(buffers - 1)]
    cols = [w.t().contiguous().pin_memory().t() for w in rows]
    op = op_for(16)
    turn = {"copy": 0, "op": 0}

    def next_of(what: str, ws: list[torch.Tensor]) -> torch.Tensor:
        turn[what] = (turn[what] + 1) % len(ws)
        return ws[turn[what]]

    variants: dict[str, Callable[[], object]] = {
        "copy, one buffer": lambda: w_dev.copy_(rows[0], non_blocking=True),
        f"copy, {buffers} in turn": lambda: w_dev.copy_(next_of("copy", rows),
                                                        non_blocking=True),
        "op S=16, one w": lambda: op(x, cols[0]),
        f"op S=16, {buffers} in turn": lambda: op(x, next_of("op", cols)),
    }
    t = _interleaved(variants, rounds, 1.0)
    print(f"\nPart 4: one pinned buffer against {buffers} in turn, m = {m}, median of "
          f"{rounds} rounds")
    for v in variants:
        print(f"  {v:>22}  {statistics.median(t[v]):7.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.copy_contention", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--calls", type=int, default=5, help="calls traced in part 3")
    parser.add_argument("--sm", default="0,120,100",
                        help="gemm_sm_count values (0 = all SMs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("copy_contention: needs a CUDA GPU")
        return 1
    sms = [int(v) for v in args.sm.split(",")]
    w_host = torch.randn(K, N, dtype=DTYPE).pin_memory()
    w_dev = w_host.to("cuda")
    m, _, _ = balanced_m(w_host, w_dev)
    parts = args.parts.split(",")
    if "1" in parts:
        part1(w_host, m, sms, args.rounds)
    if "2" in parts:
        part2(w_host, w_dev, m, sms, args.rounds)
    if "3" in parts:
        part3(w_host, w_dev, m, args.rounds, args.calls)
    if "4" in parts:
        part4(w_host, m, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
