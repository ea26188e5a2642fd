"""One GEMM vs the Python stream loop vs the generated op, in one run on one GPU.

    PYTHONPATH=. python3 benchmarks/bench_matmul.py [--out benchmarks/results] [--quick]

For each shape (m x n x k) and S slices of the output rows: (a) one torch.matmul,
(b) the hand-written Python stream loop (benchmarks/python_loop.py), (c) the generated op.
CUDA-event timing, warm-up, median of many repetitions, fresh random data per shape.
Host time per call is measured while the GPU is kept busy (a long sleep kernel first),
so the host never waits. Also: cold build and warm (cached, new process) load times.
Writes a table to stdout, results.json and speed.png to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from python_loop import PythonStreamLoop  # noqa: E402

import codegen as cg  # noqa: E402
from codegen import examples  # noqa: E402
from codegen.timing import cuda_time_ms  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (1024, 1024, 1024),
          (16384, 8192, 1024), (256, 4096, 4096)]
SLICES = (1, 2, 4, 8)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32/tf32": torch.float32}


def host_us_per_call(fn, calls: int = 25) -> float:
    """Host microseconds per call while the GPU is busy, so launches never block."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU time queued ahead of the calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


_ops: dict[tuple[str, int], cg.CompiledOp] = {}


def generated(dtype_name: str, slices: int) -> cg.CompiledOp:
    """One program per (dtype, S): its extents are symbolic, so new shapes reuse it."""
    key = (dtype_name, slices)
    if key not in _ops:
        name = f"bench_{dtype_name.split('/')[0]}_s{slices}"
        _ops[key] = cg.compile(examples.matmul_rows(DTYPES[dtype_name], slices, name))
    return _ops[key]


def measure(m: int, n: int, k: int, dtype_name: str, reps: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    flops = 2 * m * n * k
    t_gemm = cuda_time_ms(lambda: torch.matmul(a, b), reps=reps)
    ref = torch.matmul(a.float(), b.float())
    rows = []
    for s in SLICES:
        loop, op = PythonStreamLoop(s), generated(dtype_name, s)
        err = ((op(a, b).float() - ref).norm() / ref.norm()).item()
        t_loop = cuda_time_ms(lambda loop=loop: loop(a, b), reps=reps)
        t_op = cuda_time_ms(lambda op=op: op(a, b), reps=reps)
        rows.append({
            "shape": [m, n, k], "dtype": dtype_name, "slices": s,
            "gemm_ms": t_gemm, "loop_ms": t_loop, "op_ms": t_op,
            "gemm_tflops": flops / t_gemm / 1e9, "op_tflops": flops / t_op / 1e9,
            "loop_ratio": t_loop / t_gemm, "op_ratio": t_op / t_gemm, "op_rel_err": err,
            "loop_host_us": host_us_per_call(lambda loop=loop: loop(a, b)),
            "op_host_us": host_us_per_call(lambda op=op: op(a, b)),
        })
    return rows


BUILD_SNIPPET = """
import time, torch
t = time.perf_counter()
import codegen as cg
from codegen import examples
op = cg.compile(examples.matmul_rows(torch.bfloat16, 4, "bench_build_probe"))
print(time.perf_counter() - t)
"""


def build_times() -> dict[str, float]:
    """Cold build (empty cache) and warm load (cached, new process) of one program;
    each includes importing codegen, lowering and rendering, not `import torch`."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CODEGEN_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
        run = lambda: float(subprocess.run(  # noqa: E731
            [sys.executable, "-c", BUILD_SNIPPET], env=env, capture_output=True, text=True,
            check=True).stdout.strip().splitlines()[-1])
        cold = run()
        warm = min(run() for _ in range(3))
    return {"cold_build_s": cold, "warm_load_s": warm}


def table(rows: list[dict]) -> str:
    head = (f"{'shape m x n x k':>20} {'dtype':>9} {'S':>2} {'GEMM ms':>8} {'loop ms':>8} "
            f"{'op ms':>8} {'op TF/s':>8} {'loop/GEMM':>9} {'op/GEMM':>8} "
            f"{'loop host us':>12} {'op host us':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        lines.append(
            f"{shape:>20} {r['dtype']:>9} {r['slices']:>2} {r['gemm_ms']:8.3f} "
            f"{r['loop_ms']:8.3f} {r['op_ms']:8.3f} {r['op_tflops']:8.1f} "
            f"{r['loop_ratio']:9.3f} {r['op_ratio']:8.3f} {r['loop_host_us']:12.1f} "
            f"{r['op_host_us']:10.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = [r for r in rows if r["dtype"] == "bf16"]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in bf16))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.4), sharey=True)
    for ax, shape in zip(axes, shapes):
        rs = [r for r in bf16 if tuple(r["shape"]) == shape]
        xs = [r["slices"] for r in rs]
        ax.plot(xs, [r["loop_ratio"] for r in rs], "o-", label="Python stream loop")
        ax.plot(xs, [r["op_ratio"] for r in rs], "s-", label="generated op")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title("x".join(map(str, shape)), fontsize=9)
        ax.set_xlabel("slices S")
    axes[0].set_ylabel("time / one torch.matmul (bf16)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="two shapes, few repetitions")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_matmul: needs a CUDA GPU")
        return 1
    shapes = SHAPES[:1] + SHAPES[2:3] if args.quick else SHAPES
    reps = 10 if args.quick else args.reps
    rows = []
    for m, n, k in shapes:
        rows += measure(m, n, k, "bf16", reps)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 rows are TF32
    for name in ("fp16", "fp32/tf32"):
        rows += measure(*shapes[0], name, reps)
    builds = build_times()
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": "PYTHONPATH=. python3 benchmarks/bench_matmul.py" + (" --quick" * args.quick),
        **builds,
    }
    print(table(rows))
    print(f"\ncold build {builds['cold_build_s']:.2f} s, warm load (new process) "
          f"{builds['warm_load_s']:.3f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "table.txt").write_text(json.dumps(meta, indent=1) + "\n\n" + table(rows) + "\n")
    plot(rows, args.out / "speed.png")
    print(f"wrote {args.out}/results.json, table.txt, speed.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
