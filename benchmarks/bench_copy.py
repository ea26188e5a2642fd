"""Weight streaming from pinned host memory: the generated op against its floor, the
hand-written Python pipeline and copy-then-GEMM, on one GPU.

    python -m benchmarks.bench_copy [--out benchmarks/results] [--rounds N]

The program is ``codegen.examples.stream_weights``: out [m, n] = x [m, k] (GPU) @ w [k, n]
(bf16, pinned host memory), the columns of w streamed in S slices, each copied (one
cudaMemcpy2DAsync) into a staging slot on its worker stream, then multiplied there.
For k = n = 8192 (128 MiB of weights) and three m, tuned at run time so that the GEMM
alone takes about as long as the copy alone (balanced), a quarter of it (copy-bound) and
three times it (GEMM-bound), and S = 1, 2, 4, 8, 16, it reports per row:

- op / max(C, G): the op's time over the larger of copy alone (C: one 128 MiB pinned
  host-to-device copy) and GEMM alone (G: x @ w with w already on the GPU);
- floor / max = 1 + 1/S: the pipeline cannot beat max(C, G) * (1 + 1/S) (the first
  slice's copy and the last slice's GEMM stand alone), and op / floor;
- cs / floor: the same program lowered with ``copy_stream=True`` (every copy on one copy
  stream, in slice order; ``hostir.queue_copies_in``), and cs / op per round in the JSON;
- sk / floor: the same program lowered with ``split_contraction=True`` (and the copy
  stream): w streamed by blocks of rows (dense copies), each slice adding its product
  onto the whole output (``passes.split_contractions``);
- auto / floor: lowered with ``split_contraction="auto"`` (and the copy stream): each call
  runs the loop ``codegen.transforms.cost`` estimates faster for its m (``auto_loop`` in the JSON);
- the same op reading a column-major w (w^T stored contiguous, as nn.Linear keeps it):
  each slice is one 1-D copy instead of a 2-D one; and (col_cs) that op with the copy
  stream;
- the hand-written Python pipeline (``benchmarks.common.PythonCopyPipeline``): w pre-split once into
  contiguous pinned column blocks, each copied into its stream's staging buffer and
  multiplied on stream i % 4;
- copy-then-GEMM: one copy of the whole w, then one GEMM, on one stream.

Timing: CUDA events around a block of calls per variant (one untimed call first); the
variants of a shape run interleaved in rounds (order rotated each round) after a warm-up
of at least one second, and each ratio is the median over rounds of the per-round ratio
(the H200 power-caps within a second of sustained GEMMs: whatever runs first would win).
Host microseconds per op call are measured with the GPU kept busy. The timing code and
the baseline are in ``benchmarks.common``.
Writes copy.json to --out and prints a table; about 2 minutes on an H200 (builds
included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import codegen as cg
from benchmarks.common import (
    POOL,
    RESULTS,
    PythonCopyPipeline,
    balanced_m,
    estimate_ms,
    host_sample,
    interleaved,
    median_ratio,
)
from codegen import examples

K = N = 8192
DTYPE = torch.bfloat16
SLICES = (1, 2, 4, 8, 16)


_ops: dict[tuple[int, bool, bool | str], cg.CompiledOp] = {}


def op_for(slices: int, copy_stream: bool = False,
           split_contraction: bool | str = False) -> cg.CompiledOp:
    """One program per S (extents are symbolic): the tests' stream_weights programs, with
    the copies on the slices' streams or (``copy_stream``) on one copy stream, w's
    columns streamed or (``split_contraction``) its rows, or (``"auto"``) either."""
    key = (slices, copy_stream, split_contraction)
    if key not in _ops:
        _ops[key] = cg.compile(examples.stream_weights(DTYPE, slices), pool_size=POOL,
                               copy_stream=copy_stream, split_contraction=split_contraction)
    return _ops[key]


def auto_loop(slices: int, x: torch.Tensor, w: torch.Tensor) -> str:
    """Which loop the ``split_contraction="auto"`` op runs for these inputs."""
    op = op_for(slices, copy_stream=True, split_contraction="auto")
    return "rows" if op.pick([x, w]).host_ir.split_contraction else "columns"


def measure_shape(label: str, m: int, w_host: torch.Tensor, w_host_t: torch.Tensor,
                  w_dev: torch.Tensor, pipelines: dict[int, PythonCopyPipeline],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    x = torch.randn(m, K, device="cuda", dtype=DTYPE)
    out = torch.empty(m, N, device="cuda", dtype=DTYPE)
    ref = torch.matmul(x.float(), w_dev.float())
    w_col = w_host_t.t()  # [K, N], column-major: each column block is contiguous

    def copy_then_gemm() -> None:
        w_dev.copy_(w_host, non_blocking=True)
        torch.matmul(x, w_dev, out=out)

    variants: dict[str, Callable[[], Any]] = {
        "copy": lambda: w_dev.copy_(w_host, non_blocking=True),
        "gemm": lambda: torch.matmul(x, w_dev, out=out),
        "copy_then_gemm": copy_then_gemm,
    }
    errors: dict[str, float] = {}
    for s in SLICES:
        op, op_cs, pipeline = op_for(s), op_for(s, copy_stream=True), pipelines[s]
        op_sk = op_for(s, copy_stream=True, split_contraction=True)
        op_auto = op_for(s, copy_stream=True, split_contraction="auto")
        variants[f"op_auto/s{s}"] = lambda op=op_auto: op(x, w_host)
        variants[f"op/s{s}"] = lambda op=op: op(x, w_host)
        variants[f"op_cs/s{s}"] = lambda op=op_cs: op(x, w_host)
        variants[f"op_sk/s{s}"] = lambda op=op_sk: op(x, w_host)
        variants[f"op_col/s{s}"] = lambda op=op: op(x, w_col)
        variants[f"op_col_cs/s{s}"] = lambda op=op_cs: op(x, w_col)
        variants[f"python/s{s}"] = lambda p=pipeline: p(x)
        for v in ("op", "op_cs", "op_sk", "op_auto", "op_col", "op_col_cs", "python"):
            y = variants[f"{v}/s{s}"]().float()
            errors[f"{v}/s{s}"] = ((y - ref).norm() / ref.norm()).item()
    del ref
    bad = {v: e for v, e in errors.items() if not e < 2e-2}
    if bad:
        print(f"WARNING {label}: relative error against fp32 above 2e-2: {bad}")
    estimate_call_ms = estimate_ms(variants["copy_then_gemm"], 2)
    host = {s: host_sample(lambda s=s: op_for(s)(x, w_host), calls=5,
                                      busy_ms=20 + 5 * estimate_call_ms)
            for s in SLICES}
    t = interleaved(variants, args.rounds, block_ms=args.block_ms, min_reps=2, max_reps=20,
                    warmup_s=args.warmup_s, per_variant_reps=True)
    bound = [max(c, g) for c, g in zip(t["copy"], t["gemm"])]
    med = statistics.median
    rows = []
    for s in SLICES:
        floor = 1 + 1 / s
        rows.append({
            "shape": label, "m": m, "k": K, "n": N, "dtype": "bf16", "slices": s,
            "copy_ms": med(t["copy"]), "gemm_ms": med(t["gemm"]),
            "copy_GBps": K * N * 2 / med(t["copy"]) / 1e6,
            "gemm_tflops": 2 * m * K * N / med(t["gemm"]) / 1e9,
            "op_ms": med(t[f"op/s{s}"]), "op_col_ms": med(t[f"op_col/s{s}"]),
            "python_ms": med(t[f"python/s{s}"]), "copy_then_gemm_ms": med(t["copy_then_gemm"]),
            "op_ratio": median_ratio(t[f"op/s{s}"], bound),
            "floor_ratio": floor,
            "op_floor_ratio": median_ratio(t[f"op/s{s}"], bound) / floor,
            "op_cs_ms": med(t[f"op_cs/s{s}"]),
            "op_cs_floor_ratio": median_ratio(t[f"op_cs/s{s}"], bound) / floor,
            "op_cs_op_ratio": median_ratio(t[f"op_cs/s{s}"], t[f"op/s{s}"]),
            "op_sk_ms": med(t[f"op_sk/s{s}"]),
            "op_sk_floor_ratio": median_ratio(t[f"op_sk/s{s}"], bound) / floor,
            "op_auto_ms": med(t[f"op_auto/s{s}"]),
            "op_auto_floor_ratio": median_ratio(t[f"op_auto/s{s}"], bound) / floor,
            "auto_loop": auto_loop(s, x, w_host),
            "op_col_ratio": median_ratio(t[f"op_col/s{s}"], bound),
            "op_col_cs_floor_ratio": median_ratio(t[f"op_col_cs/s{s}"], bound) / floor,
            "op_col_floor_ratio": median_ratio(t[f"op_col/s{s}"], bound) / floor,
            "python_ratio": median_ratio(t[f"python/s{s}"], bound),
            "op_python_ratio": median_ratio(t[f"op/s{s}"], t[f"python/s{s}"]),
            "copy_then_gemm_ratio": median_ratio(t["copy_then_gemm"], bound),
            "op_host_us": host[s],
            "rel_err": {v.split("/")[0]: errors[v] for v in errors if v.endswith(f"/s{s}")},
            "rounds": args.rounds,
        })
    return rows


NVTX_COST = r"""
#include "codegen/nvtx.h"
#include <chrono>
#include <cstdio>
int main() {
  const int n = 10000000;
  volatile long long sink = 0;
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      const codegen_rt::Range r("stream_weights", "i", i, "Copy(T1_i, out=T1_s)");
      sink = sink + i;
    }
    auto t1 = std::chrono::steady_clock::now();
    const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
    if (ns < best) best = ns;
  }
  std::printf("%.2f\n", best);
}
"""


def nvtx_range_ns() -> float | None:
    """Host nanoseconds of one codegen NVTX range with no tool attached (best of 5)."""
    from codegen.backend.renderer import include_dir
    from codegen.jit import cuda_home

    home = cuda_home()
    if home is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "nvtx_cost.cpp", Path(tmp) / "nvtx_cost"
        src.write_text(NVTX_COST)
        build = subprocess.run(["c++", "-std=c++17", "-O1", f"-I{include_dir()}",
                                f"-isystem{home}/include", str(src), "-o", str(exe)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return None
        run = subprocess.run([str(exe)], capture_output=True, text=True)
        return float(run.stdout.strip()) if run.returncode == 0 else None


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'shape':>10} {'m':>6} {'S':>3} {'copy ms':>8} {'GEMM ms':>8} {'op ms':>8} "
            f"{'op/max':>7} {'floor':>6} {'op/floor':>8} {'cs/floor':>8} {'sk/floor':>8} "
            f"{'auto/floor':>10} {'op(w^T)':>8} {'w^T/floor':>9} {'w^T cs':>7} "
            f"{'python':>7} {'copy+GEMM':>9} {'host us':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shape']:>10} {r['m']:>6} {r['slices']:>3} {r['copy_ms']:8.3f} "
            f"{r['gemm_ms']:8.3f} {r['op_ms']:8.3f} {r['op_ratio']:7.3f} "
            f"{r['floor_ratio']:6.3f} {r['op_floor_ratio']:8.3f} "
            f"{r['op_cs_floor_ratio']:8.3f} {r['op_sk_floor_ratio']:8.3f} "
            f"{r['op_auto_floor_ratio']:6.3f} {r['auto_loop'][0]:>3} {r['op_col_ratio']:8.3f} "
            f"{r['op_col_floor_ratio']:9.3f} {r['op_col_cs_floor_ratio']:7.3f} "
            f"{r['python_ratio']:7.3f} {r['copy_then_gemm_ratio']:9.3f} "
            f"{r['op_host_us']:8.1f}")
    lines.append("ratios: time / max(copy alone, GEMM alone), median of per-round ratios; "
                 "floor = 1 + 1/S; cs: the op with copy_stream=True; sk: with "
                 "split_contraction=True too; auto: with split_contraction='auto' "
                 "(c: it ran columns, r: rows); w^T: a column-major w (dense slices), "
                 "w^T cs: with the copy stream, both / floor")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_copy", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block-ms", type=float, default=15.0,
                        help="GPU time of one timed block of calls")
    parser.add_argument("--warmup-s", type=float, default=1.5)
    parser.add_argument("--shapes", default="balanced,copy-bound,gemm-bound")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_copy: needs a CUDA GPU")
        return 1
    start = time.perf_counter()
    for s in SLICES:
        op_for(s)
        op_for(s, copy_stream=True)
        op_for(s, copy_stream=True, split_contraction=True)
        op_for(s, copy_stream=True, split_contraction="auto")
    build_s = time.perf_counter() - start
    w_host = torch.randn(K, N, dtype=DTYPE).pin_memory()
    w_host_t = w_host.t().contiguous().pin_memory()
    w_dev = w_host.to("cuda")
    pipelines = {s: PythonCopyPipeline(w_host, s) for s in SLICES}
    m_bal, copy0, gemm0 = balanced_m(w_host, w_dev)
    shapes = {"balanced": m_bal, "copy-bound": max(256, m_bal // 4 // 256 * 256),
              "gemm-bound": 3 * m_bal}
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(["python -m benchmarks.bench_copy", *sys.argv[1:]]),
        "tuning": {"copy_ms": copy0, "gemm_ms_m8192": gemm0, "m_balanced": m_bal},
        "build_s": build_s,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for label in args.shapes.split(","):  # copy.json after each shape: a cut run keeps some
        rows += measure_shape(label, shapes[label], w_host, w_host_t, w_dev, pipelines, args)
        print(table(rows[-len(SLICES):]), flush=True)
        meta["seconds"] = time.perf_counter() - start
        (args.out / "copy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    meta["nvtx_range_ns_no_tool"] = nvtx_range_ns()
    meta["seconds"] = time.perf_counter() - start
    (args.out / "copy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print()
    print(table(rows))
    print(f"\nNVTX range with no tool attached: {meta['nvtx_range_ns_no_tool']} ns; "
          f"total {meta['seconds']:.0f} s")
    print(f"wrote {args.out / 'copy.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
