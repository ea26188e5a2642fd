"""Tensor-parallel overlap: all-gather + GEMM and GEMM + reduce-scatter,
the compiled op with its collective sliced into the stream loop, against the same GEMM
with no communication, the collective then one GEMM, and PyTorch's async-TP where it runs.

    python -m benchmarks.bench_overlap --world-size 2          # spawns 2 ranks
    torchrun --nproc-per-node 2 -m benchmarks.bench_overlap    # or torchrun
    python -m benchmarks.bench_overlap --dry-run               # the plan, no GPU

Per pattern, shape and slice count S, every rank times the variants interleaved (rounds
after a warm-up, the order rotated per round, a barrier before each block so all ranks run
the same variant at once); a round's time of a variant is the slowest rank's (all-reduce
MAX), and each field is the median over rounds: ``overlap_ms`` (the op), ``local_gemm_ms``
(this rank's GEMM alone: what a perfect overlap would cost), ``no_overlap_ms`` (the whole
collective, then one GEMM), ``async_tp_ms`` (``torch.ops.symm_mem.fused_*``, None where it
does not run). Ratios are medians of per-round ratios. Rows go to
``benchmarks/results/overlap_multi_gpu.json``. On one GPU it runs with world size 1, a
smoke test of the code path (the collective is a copy; nothing to overlap).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), in spawned processes too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    Block,
    estimate_ms,
    parse_ints,
    ratio_fields,
    reps_for,
    rotated,
    warm_up,
)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
PATTERNS = ("allgather_matmul", "matmul_reduce_scatter")


def cases(world_size: int, tokens: tuple[int, ...], k: int, n_total: int,
          slices: tuple[int, ...] | None) -> list[dict[str, Any]]:
    """The (pattern, global shape, S) cases: m tokens x k @ k x n_total, sharded over
    ``world_size`` ranks (n_total / D columns per rank for the all-gather, k / D rows of w
    for the reduce-scatter); S = 1, D, 2D, 4D unless given."""
    counts = slices or tuple(sorted({1, world_size, 2 * world_size, 4 * world_size}))
    out = []
    for pattern in PATTERNS:
        for m in tokens:
            for s in counts:
                if m % (world_size * s):
                    continue  # each rank's block must split evenly into the slices
                out.append({"pattern": pattern, "world_size": world_size,
                            "shape": [m, k, n_total], "slices": s})
    return out


def local_shapes(case: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's (x, w) shapes for ``case``."""
    m, k, n = case["shape"]
    d = case["world_size"]
    if case["pattern"] == "allgather_matmul":
        return (m // d, k), (k, n // d)
    return (m, k // d), (k // d, n)


def _rank_main(rank: int, world_size: int, args: argparse.Namespace, store: str) -> None:
    os.environ.update(MULTICAST_OFF)
    import torch
    import torch.distributed as dist

    import codegen as cg
    from codegen import examples

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=300)
    if store:  # spawned by main()
        dist.init_process_group("nccl", store=dist.FileStore(store, world_size), rank=rank,
                                world_size=world_size, device_id=device, timeout=timeout)
    else:  # torchrun: env:// rendezvous
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    dtype = torch.bfloat16
    rows = []
    for case in cases(world_size, args.tokens, args.k, args.n, args.slices):
        (xm, xk), (wk, wn) = local_shapes(case)
        x = torch.randn(xm, xk, device=device, dtype=dtype)
        w = torch.randn(wk, wn, device=device, dtype=dtype)
        make = getattr(examples, case["pattern"])
        op = cg.compile(make(dtype, case["slices"], world_size,
                             name=f"bench_{case['pattern']}_{case['slices']}"))
        variants = _variants(case["pattern"] == "allgather_matmul", op, x, w, world_size)
        funcs = tuple(variants.values())
        warm_up(functools.partial(_call_all, funcs), args.warmup_s)
        blocks = {name: Block(f, reps_for(estimate_ms(f), args.block_ms, 3, 100))
                  for name, f in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in rotated(list(variants), r):
                dist.barrier()
                blocks[name].run()
                torch.cuda.synchronize()
                t = torch.tensor([blocks[name].ms()], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[name].append(t.item())
        row = summarize(case, times)
        if args.trace:
            row["trace"] = _trace(variants["overlap"], op.host_ir.pool_size, case, args.out,
                                  rank)
        rows.append(row)
        if rank == 0:
            print(_line(row), flush=True)
    if rank == 0:
        out = Path(args.out) / "overlap_multi_gpu.json"
        meta = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                "world_size": world_size, "rounds": args.rounds, "dtype": "bfloat16",
                "command": " ".join(["python -m benchmarks.bench_overlap", *sys.argv[1:]]),
                "multicast": "off"}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()


def _call_all(funcs: tuple[Any, ...]) -> None:
    for f in funcs:
        f()


def _variants(ag: bool, op: Any, x: Any, w: Any, world_size: int) -> dict[str, Any]:
    """The timed variants of one case: the op, this rank's GEMM alone, the collective then
    one GEMM, and async-TP where it runs."""
    import torch
    import torch.distributed as dist

    gathered = x.new_empty(x.shape[0] * world_size, x.shape[1])
    partial = x.new_empty(x.shape[0], w.shape[1])
    scattered = x.new_empty(x.shape[0] // world_size, w.shape[1])

    def local_gemm() -> Any:
        return (gathered if ag else x) @ w

    def no_overlap() -> Any:
        if ag:
            dist.all_gather_into_tensor(gathered, x)
            return gathered @ w
        torch.matmul(x, w, out=partial)
        dist.reduce_scatter_tensor(scattered, partial)
        return scattered

    variants = {"overlap": lambda: op(x, w), "local_gemm": local_gemm,
                "no_overlap": no_overlap}
    async_tp = _async_tp(ag, x, w, dist)
    if async_tp is not None:
        variants["async_tp"] = async_tp
    return variants


def _async_tp(ag: bool, x: Any, w: Any, dist: Any) -> Any:
    """PyTorch's async-TP fused op for the pattern, or None where it does not run."""
    import torch

    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        group = dist.group.WORLD
        enable_symm_mem_for_group(group.group_name)
        if ag:
            def fn() -> Any:
                return torch.ops.symm_mem.fused_all_gather_matmul(
                    x, [w], gather_dim=0, group_name=group.group_name)[1][0]
        else:
            def fn() -> Any:
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    x, w, "sum", scatter_dim=0, group_name=group.group_name)
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as e:  # noqa: BLE001 - reported, the column stays empty
        print(f"async-TP does not run here: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _trace(call: Any, pool: int, case: dict[str, Any], out: str, rank: int) -> str:
    """Profiles one call of the op on every rank (the collectives need them all); rank 0
    draws its streams (collectives crossed) and prints how much collective time the GEMMs
    hid, measured beside planned (codegen.tools.timeline). Returns that report."""
    from codegen.tools.timeline import overlap_report, plot_kernels, profile_gpu

    events = [e for e in profile_gpu(call) if e.kind != "memset"]
    report = overlap_report(events, case["slices"], min(case["slices"], pool))
    if rank == 0:
        name = f"overlap_trace_{case['pattern']}_{case['shape'][0]}_s{case['slices']}.png"
        plot_kernels(events, Path(out) / name, f"{case['pattern']} D={case['world_size']} "
                     f"{'x'.join(map(str, case['shape']))} S={case['slices']}, rank 0")
        print(report, flush=True)
    return report


def summarize(case: dict[str, Any], times: dict[str, list[float]]) -> dict[str, Any]:
    """The row of one case from per-round times (ms) of its variants: medians and the
    median per-round ratios of the op to each baseline (async_tp may be missing)."""
    row: dict[str, Any] = dict(case)
    for name in ("overlap", "local_gemm", "no_overlap", "async_tp"):
        row[f"{name}_ms"] = statistics.median(times[name]) if name in times else None
    for base in ("local_gemm", "no_overlap", "async_tp"):
        if base in times:
            row.update(ratio_fields(f"overlap_{base}_ratio", times["overlap"], times[base]))
    return row


def _line(row: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return f"{v:8.3f}" if v is not None else "       -"

    return (f"{row['pattern']:22} D={row['world_size']} {'x'.join(map(str, row['shape'])):>16} "
            f"S={row['slices']:<3} op {ms(row['overlap_ms'])} local {ms(row['local_gemm_ms'])} "
            f"no-overlap {ms(row['no_overlap_ms'])} async-TP {ms(row['async_tp_ms'])} "
            f"op/local {row['overlap_local_gemm_ratio']:.3f} "
            f"op/no-overlap {row['overlap_no_overlap_ratio']:.3f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=0,
                   help="ranks to spawn (default: torchrun's WORLD_SIZE, else all GPUs)")
    p.add_argument("--tokens", type=lambda t: parse_ints(t, "tokens"), default=(8192, 1024),
                   help="m values, comma-separated (default 8192,1024)")
    p.add_argument("-k", type=int, default=8192)
    p.add_argument("-n", type=int, default=28672, help="global n (split over ranks)")
    p.add_argument("--slices", type=lambda t: parse_ints(t, "slices"), default=None)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--block-ms", type=float, default=10.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--trace", action="store_true",
                   help="also profile one op call per case: rank 0 draws its streams to "
                        "overlap_trace_*.png and prints the collective time hidden")
    p.add_argument("--dry-run", action="store_true", help="print the cases; no GPU needed")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.update(MULTICAST_OFF)
    if args.dry_run:
        d = args.world_size or int(os.environ.get("WORLD_SIZE", "2"))
        for case in cases(d, args.tokens, args.k, args.n, args.slices):
            print(case["pattern"], case["world_size"], case["shape"], case["slices"],
                  local_shapes(case))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_overlap: needs CUDA GPUs (use --dry-run to see the cases)",
              file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # under torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "")
        return 0
    world = args.world_size or torch.cuda.device_count()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, (world, args, os.path.join(tmp, "store")), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
