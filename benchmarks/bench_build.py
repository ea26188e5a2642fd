"""Build and load times of new programs, measured in fresh processes.

    python -m benchmarks.bench_build [--programs 3] [--warm-runs 3] [--out DIR]

Every measurement is a new process (``sys.executable -c ...``) and all of them share one
CODEGEN_CACHE_DIR, a new empty temporary folder (deleted afterwards unless --keep):
(a) first program: the first cg.compile into the fresh cache (one-time setup, if any, is
    paid here);
(b) cold build: --programs new programs, each built in its own process (bf16 matmul_rows
    with other slice counts, so the op names and sources differ); their median;
(c) warm load: a new process calls cg.compile on the program of (a), already built;
    --warm-runs times; their median.
For each process: compile_s, cg.compile alone (lower, render if needed, build or load),
timed inside the child; import_s, `import torch` and `import codegen` inside the child;
wall_s, the child's whole wall time seen from this process (interpreter start and
`import torch` included); build_ninja, whether the op's cache folder holds the build.ninja
of torch.utils.cpp_extension (meta.build_path says how the programs were built). Targets:
first <= 20 s, cold median <= 3.0 s, warm load <= 0.05 s. Needs no GPU. Prints a table
and writes build.json to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MARK = "BENCH_BUILD_RESULT "
# Slice counts of the programs: the first program, then the new ones of (b).
SLICE_COUNTS = (4, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13)
TARGETS = {"first_program_s": 20.0, "cold_build_median_s": 3.0, "warm_load_median_s": 0.05}

CHILD = """
import time
t0 = time.perf_counter()
import json
import torch
import codegen as cg
from codegen import examples, jit
t1 = time.perf_counter()
fusion = examples.matmul_rows(torch.{dtype}, {slices}, {name!r})
t2 = time.perf_counter()
op = cg.compile(fusion)
t3 = time.perf_counter()
print({mark!r} + json.dumps({{"import_s": t1 - t0, "compile_s": t3 - t2, "op": op.name,
                            "build_path": jit.cache.BUILD_PATH,
                            "build_ninja": (op.library.parent / "build.ninja").is_file()}}),
      flush=True)
"""


def program(index: int) -> tuple[str, int, str]:
    """(dtype, slices, fusion name) of program ``index``: 0 is the first program, 1.. the
    new programs of the cold-build measurement, each with its own slice count."""
    if not 0 <= index < len(SLICE_COUNTS):
        raise ValueError(f"program {index}: at most {len(SLICE_COUNTS) - 1} new programs")
    return "bfloat16", SLICE_COUNTS[index], f"bench_build_{index}"


def child_code(index: int) -> str:
    dtype, slices, name = program(index)
    return CHILD.format(dtype=dtype, slices=slices, name=name, mark=MARK)


def parse_child(stdout: str) -> dict[str, Any]:
    """The result a child printed (its last line that starts with MARK)."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise RuntimeError(f"bench_build: the child printed no result line; its output:\n"
                           f"{stdout[-2000:]}")
    return json.loads(lines[-1][len(MARK):])


def run_child(index: int, cache: Path) -> dict[str, Any]:
    """Runs program ``index``'s cg.compile in a new process; its timings."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CODEGEN_CACHE_DIR": str(cache), "PYTHONPATH": pythonpath}
    env.pop("CODEGEN_REBUILD", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", child_code(index)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"bench_build: program {index} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    result = parse_child(done.stdout)
    dtype, slices, _ = program(index)
    return {**result, "wall_s": wall, "slices": slices, "dtype": dtype}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians and target checks from {"first": r, "cold": [r...], "warm": [r...]}."""
    med = statistics.median
    summary = {
        "first_program_s": results["first"]["compile_s"],
        "first_program_wall_s": results["first"]["wall_s"],
        "cold_build_median_s": med(r["compile_s"] for r in results["cold"]),
        "cold_build_wall_median_s": med(r["wall_s"] for r in results["cold"]),
        "warm_load_median_s": med(r["compile_s"] for r in results["warm"]),
        "warm_wall_median_s": med(r["wall_s"] for r in results["warm"]),
        "import_median_s": med(r["import_s"] for r in results["warm"]),
    }
    summary["targets"] = {f"{k} <= {v:g}": summary[k] <= v for k, v in TARGETS.items()}
    return summary


def build_path(results: dict[str, Any]) -> str:
    """How the first and the cold-built programs were built: the builder's BUILD_PATH
    where every one of them has its build.ninja, else what was seen."""
    built = [results["first"], *results["cold"]]
    path = " / ".join(sorted({r.get("build_path", "?") for r in built}))
    ninja = [bool(r.get("build_ninja")) for r in built]
    if all(ninja):
        return path
    return f"{path} (build.ninja in {sum(ninja)} of {len(ninja)} cache folders)"


def table(results: dict[str, Any], summary: dict[str, Any]) -> str:
    head = f"{'measurement':<40} {'cg.compile s':>12} {'child wall s':>12} {'import s':>9}"
    lines = [head, "-" * len(head)]

    def line(label: str, r: dict[str, Any]) -> None:
        lines.append(f"{label:<40} {r['compile_s']:12.3f} {r['wall_s']:12.2f} "
                     f"{r['import_s']:9.2f}")

    line("first program (fresh cache)", results["first"])
    for r in results["cold"]:
        line(f"  new program S={r['slices']}", r)
    lines.append(f"{'cold build, new program (median)':<40} "
                 f"{summary['cold_build_median_s']:12.3f} "
                 f"{summary['cold_build_wall_median_s']:12.2f}")
    for i, r in enumerate(results["warm"]):
        line(f"  warm load, run {i + 1}", r)
    lines.append(f"{'warm load, new process (median)':<40} "
                 f"{summary['warm_load_median_s']:12.3f} {summary['warm_wall_median_s']:12.2f} "
                 f"{summary['import_median_s']:9.2f}")
    lines.append("targets: " + ", ".join(
        f"{k}: {'met' if ok else 'MISSED'}" for k, ok in summary["targets"].items()))
    return "\n".join(lines)


def plan_text(programs: int, warm_runs: int) -> str:
    first = program(0)
    news = [program(i) for i in range(1, programs + 1)]
    return "\n".join([
        "each step is a new process; one fresh CODEGEN_CACHE_DIR for all",
        f"(a) first program: matmul_rows {first[0]} S={first[1]} ({first[2]})",
        f"(b) cold build of {programs} new programs: "
        + ", ".join(f"S={s} ({n})" for _, s, n in news),
        f"(c) warm load of the first program in a new process, {warm_runs} times",
    ])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_build", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                   help="folder for build.json")
    p.add_argument("--programs", type=int, default=3, help="new programs for the cold build")
    p.add_argument("--warm-runs", type=int, default=3, help="warm-load processes")
    p.add_argument("--keep", action="store_true", help="keep the temporary cache folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not 1 <= args.programs < len(SLICE_COUNTS) or args.warm_runs < 1:
        print(f"bench_build: need 1 <= --programs <= {len(SLICE_COUNTS) - 1} and "
              f"--warm-runs >= 1, got {args.programs} and {args.warm_runs}", file=sys.stderr)
        return 2
    print(plan_text(args.programs, args.warm_runs), flush=True)
    if args.dry_run:
        return 0
    cache = Path(tempfile.mkdtemp(prefix="codegen-bench-build-"))
    load_start = os.getloadavg()
    try:
        results: dict[str, Any] = {"first": run_child(0, cache)}
        print(f"first program: {results['first']['compile_s']:.2f} s", flush=True)
        results["cold"] = []
        for i in range(1, args.programs + 1):
            results["cold"].append(run_child(i, cache))
            print(f"new program {i}: {results['cold'][-1]['compile_s']:.2f} s", flush=True)
        results["warm"] = [run_child(0, cache) for _ in range(args.warm_runs)]
    finally:
        if args.keep:
            print(f"cache kept: {cache}")
        else:
            shutil.rmtree(cache, ignore_errors=True)
    summary = summarize(results)
    import torch

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python -m benchmarks.bench_build" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "build_path": build_path(results),
    }
    text = table(results, summary)
    print(text)
    print(f"build path: {meta['build_path']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "build.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, **results}, indent=1))
    print(f"wrote {args.out / 'build.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
