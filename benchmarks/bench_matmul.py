"""One GEMM vs the Python stream loop vs the generated op vs its CUDA-graph replay, interleaved.

    python -m benchmarks.bench_matmul             # the table (~4-5 min on an H200)
    python -m benchmarks.bench_matmul --quick     # smoke run (about a minute)
    python -m benchmarks.bench_matmul --dry-run   # the plan; no GPU needed

Cases: bf16 matmul at the shapes below, fp16 and fp32 (TF32) matmul at 8192³, and
linear+bias (x @ w.T + bias) bf16 at 8192³; output rows in S = 1, 2, 4, 8 stream slices.
Variants of a case: "gemm" (one torch.matmul; F.linear for linear+bias) and per S "loop"
(the Python stream loop, benchmarks.common.PythonStreamLoop), "op" (cg.compile of the
program: cached cuBLASLt plans, the default), "gemmex" (the same program compiled with
gemm_library="cublas": one cublasGemmEx per slice, a bias by a second GEMM) and "graph"
(torch.cuda.CUDAGraph capturing one op call with static inputs and output, replayed).

Method. The H200 power-caps within about a second of sustained GEMMs and then drifts by a
few percent from block to block, so whatever is timed first wins by up to 13%
(the power-capping note in benchmarks/RESULTS.md). Per case:
1. a warm-up of at least --warmup-s seconds of the case's GEMM;
2. --rounds rounds; each round times every variant once, in an order rotated by one each
   round; a variant's block is one untimed lead-in call, then `reps` calls between two CUDA
   events, the device synchronized before the block; `reps` is chosen per variant from a
   short estimate so that a block lasts about --block-ms;
3. per variant, `*_ms` is the median of its per-round times; each ratio is the MEDIAN OF
   THE PER-ROUND RATIOS (both terms timed in the same round), with `*_iqr` [q1, q3] and
   `*_range` [min, max] of those ratios;
4. host µs per call of every variant (`*_host_us`; `gemm_host_us` is one torch.matmul's):
   10 back-to-back Python calls, wall time until the last returns, while a sleep kernel
   queued ahead keeps the GPU busy (launches are only queued, never waited for); a sample
   after every (rounds / 10)-th round, the median of the samples. Spread over the run
   because the host's speed drifts: one torch.matmul took 15 to 37 µs within one process.
`meta.launch_floor_us`: host µs of one cublasLtMatmul launch with cached descriptors and
algorithm, from a C++ loop (benchmarks.launch_floor), measured in the same run, after the cases.
Programs are built before timing, in parallel subprocesses sharing CODEGEN_CACHE_DIR.
Writes results.json, table.txt and speed.png to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import codegen as cg
from benchmarks import launch_floor
from benchmarks.common import (
    REPO,
    RESULTS,
    Block,
    PythonStreamLinear,
    PythonStreamLoop,
    estimate_ms,
    host_sample,
    parse_ints,
    parse_shape,
    ratio_fields,
    reps_for,
    rotated,
    run_rounds,
    spread,
    warm_up,
)
from codegen import examples
from codegen.nn import capture_graph

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32/tf32": torch.float32}
KINDS = ("matmul", "linear+bias")
SLICES = (1, 2, 4, 8)
MATMUL_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048),
                 (1024, 1024, 1024), (16384, 8192, 1024), (256, 4096, 4096))
CUBE = (8192, 8192, 8192)

# Fields every results.json row has (the first seven as in the first benchmark).
ROW_FIELDS = (
    "shape", "dtype", "slices", "gemm_ms", "loop_ms", "op_ms", "op_host_us",
    "kind", "graph_ms", "gemm_host_us", "loop_host_us", "graph_host_us",
    "gemm_tflops", "op_tflops",
    "loop_ratio", "loop_ratio_iqr", "loop_ratio_range",
    "op_ratio", "op_ratio_iqr", "op_ratio_range",
    "graph_ratio", "graph_ratio_iqr", "graph_ratio_range",
    "op_loop_ratio", "op_loop_ratio_iqr", "op_loop_ratio_range",
    "op_rel_err", "graph_rel_err", "loop_rel_err", "rounds", "reps",
    "op_host_us_iqr", "gemm_host_us_iqr", "host_samples", "op_host_us_per_extra_slice",
    "gemmex_ms", "gemmex_host_us", "gemmex_ratio", "gemmex_ratio_iqr", "gemmex_ratio_range",
    "op_gemmex_ratio", "op_gemmex_ratio_iqr", "op_gemmex_ratio_range", "gemmex_rel_err",
)
HOST_US_METHOD = ("wall time of 10 back-to-back Python calls until the last returns, the GPU "
                  "kept busy by a sleep kernel queued ahead (launches never wait); one "
                  "sample per variant after every (rounds / host_samples)-th round; median")
TIMING_METHOD = ("interleaved: per case, warm-up >= warmup_s of GEMMs, then `rounds` rounds, "
                 "each timing every variant once in an order rotated by one per round; a "
                 "block = 1 untimed lead-in call + reps calls between CUDA events, device "
                 "synchronized before it; *_ms = median of per-round times; ratios = median "
                 "of per-round ratios, *_iqr [q1, q3] and *_range [min, max] of them")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: ``matmul`` is [m, k] @ [k, n]; ``linear+bias`` is F.linear(x [m, k],
    w [n, k], bias [n]). Output rows go to the stream slices."""

    kind: str
    dtype: str
    shape: tuple[int, int, int]  # m, n, k

    @property
    def label(self) -> str:
        return f"{self.kind} {self.dtype} {'x'.join(map(str, self.shape))}"

    @property
    def tags(self) -> set[str]:
        """Words that select this case in --shapes: its dtype and kind, short forms too."""
        return {self.dtype, self.dtype.split("/")[0], self.kind, self.kind.split("+")[0]}

    @property
    def flops(self) -> int:
        m, n, k = self.shape
        return 2 * m * n * k


CASES: tuple[Case, ...] = (
    *(Case("matmul", "bf16", s) for s in MATMUL_SHAPES),
    Case("matmul", "fp16", CUBE),
    Case("matmul", "fp32/tf32", CUBE),
    Case("linear+bias", "bf16", CUBE),
)
QUICK_CASES = (Case("matmul", "bf16", CUBE), Case("matmul", "bf16", (2048, 2048, 2048)),
               Case("linear+bias", "bf16", CUBE))
QUICK_SLICES = (1, 4)


@dataclasses.dataclass(frozen=True)
class Config:
    rounds: int = 70
    block_ms: float = 15.0
    min_reps: int = 3
    max_reps: int = 200
    warmup_s: float = 1.0
    host_samples: int = 10  # host-time samples per variant, spread over the rounds


QUICK_CONFIG = Config(rounds=8, block_ms=5.0, host_samples=4)


# ---------------------------------------------------------------------------- selection


def select_cases(cases: Sequence[Case], spec: str) -> list[Case]:
    """The cases that ``spec`` names: comma-separated tokens, each ``TAG``, ``SHAPE`` or
    ``TAG:SHAPE`` (TAG: bf16, fp16, fp32, matmul, linear; SHAPE: N for N³ or MxNxK); a case
    is kept if any token matches it, in the order of ``cases``.

    >>> [c.label for c in select_cases(CASES, "linear,fp16:8192")]
    ['matmul fp16 8192x8192x8192', 'linear+bias bf16 8192x8192x8192']
    """
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not tokens:
        raise ValueError("--shapes: empty; expected e.g. 8192,2048 or linear or "
                         "bf16:16384x8192x1024")

    def matches(case: Case, token: str) -> bool:
        for part in token.split(":"):
            if part.lower() in case.tags:
                continue
            if part[:1].isdigit() and parse_shape(part) == case.shape:
                continue
            return False
        return True

    for token in tokens:
        for part in token.split(":"):
            if not part[:1].isdigit() and not any(part.lower() in c.tags for c in cases):
                raise ValueError(f"--shapes: unknown word {part!r} in {token!r}; use bf16, "
                                 "fp16, fp32, matmul, linear or a shape (N or MxNxK)")
        if not any(matches(c, token) for c in cases):
            raise ValueError(f"--shapes: {token!r} matches no case; cases are: "
                             + "; ".join(c.label for c in cases))
    return [c for c in cases if any(matches(c, t) for t in tokens)]


# ---------------------------------------------------------------------------- programs


def program_name(kind: str, dtype: str, slices: int) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    tag = {"matmul": "mm", "linear+bias": "linb"}[kind]
    return f"bench_{tag}_{dtype.split('/')[0]}_s{slices}"


def linear_rows(dtype: torch.dtype, slices: int, name: str) -> cg.Fusion:
    """x [m, k] @ w[n, k].T + bias[n], rows of the output in ``slices`` stream slices."""
    with cg.Fusion(name) as fusion:
        x = cg.input(["m", "k"], dtype)
        w = cg.input(["n", "k"], dtype)
        bias = cg.input(["n"], dtype)
        out = cg.linear(x, w, bias)
        cg.output(out)
    out.outer_split(0, slices)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    return fusion


def make_fusion(kind: str, dtype: str, slices: int) -> cg.Fusion:
    """The program of one (kind, dtype, S); extents are symbolic, so shapes share it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    name = program_name(kind, dtype, slices)
    if kind == "matmul":
        return examples.matmul_rows(DTYPES[dtype], slices, name)
    return linear_rows(DTYPES[dtype], slices, name)


Spec = tuple[str, str, int, str]  # kind, dtype, slices, gemm_library
LIBRARIES = {"op": "cublaslt", "gemmex": "cublas"}  # variant -> gemm_library

_PREBUILD = """
import json, sys
import codegen as cg
from benchmarks import bench_matmul as bm
for kind, dtype, slices, library in json.loads(sys.argv[1]):
    cg.compile(bm.make_fusion(kind, dtype, slices), gemm_library=library)
"""


def prebuild(specs: Sequence[Spec], jobs: int) -> list[str]:
    """Builds the programs into the cache in up to ``jobs`` parallel subprocesses (the
    cache is safe to share). Returns one message per failed subprocess; the caller's own
    cg.compile then builds those again and raises the real error."""
    chunks = [list(specs[i::jobs]) for i in range(jobs) if specs[i::jobs]]
    # The children import codegen and benchmarks from this checkout, wherever they start.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}

    def run(chunk: list[Spec]) -> str | None:
        done = subprocess.run([sys.executable, "-c", _PREBUILD, json.dumps(chunk)],
                              capture_output=True, text=True, env=env)
        if done.returncode == 0:
            return None
        return f"prebuild of {chunk} failed:\n{done.stderr[-2000:]}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(chunks))) as pool:
        return [msg for msg in pool.map(run, chunks) if msg]


# ---------------------------------------------------------------------------- one case


def make_inputs(case: Case) -> list[torch.Tensor]:
    m, n, k = case.shape
    dt = DTYPES[case.dtype]
    shapes = ([(m, k), (k, n)] if case.kind == "matmul" else [(m, k), (n, k), (n,)])
    return [torch.randn(s, device="cuda", dtype=dt) for s in shapes]


def reference(case: Case, inputs: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The one-call torch baseline of a case: torch.matmul, or F.linear with bias."""
    if case.kind == "matmul":
        a, b = inputs
        return lambda: torch.matmul(a, b)
    x, w, bias = inputs
    return lambda: torch.nn.functional.linear(x, w, bias)


def python_loop(case: Case, slices: int) -> Callable[..., torch.Tensor]:
    return PythonStreamLoop(slices) if case.kind == "matmul" else PythonStreamLinear(slices)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def summarize(case: Case, slices: int, times: dict[str, list[float]],
              host_samples: dict[str, list[float]], errors: dict[str, float],
              reps: dict[str, int]) -> dict[str, Any]:
    """The results.json row of (case, S) from per-round times (ms, one list per variant,
    index = round), host µs samples per call and errors against the fp32 reference."""
    med = statistics.median
    host = {v: med(samples) for v, samples in host_samples.items()}
    op_host, gemm_host = (spread(host_samples[v]) for v in (f"op/s{slices}", "gemm"))
    g, lp, op, gr, gx = (times[v] for v in ("gemm", f"loop/s{slices}", f"op/s{slices}",
                                             f"graph/s{slices}", f"gemmex/s{slices}"))
    row: dict[str, Any] = {
        "shape": list(case.shape), "dtype": case.dtype, "slices": slices,
        "gemm_ms": med(g), "loop_ms": med(lp), "op_ms": med(op),
        "op_host_us": host[f"op/s{slices}"],
        "kind": case.kind, "graph_ms": med(gr),
        "gemm_host_us": host["gemm"], "loop_host_us": host[f"loop/s{slices}"],
        "graph_host_us": host[f"graph/s{slices}"],
        "op_host_us_iqr": [op_host["q1"], op_host["q3"]],
        "gemm_host_us_iqr": [gemm_host["q1"], gemm_host["q3"]],
        "host_samples": len(host_samples["gemm"]),
        "gemm_tflops": case.flops / med(g) / 1e9, "op_tflops": case.flops / med(op) / 1e9,
        **ratio_fields("loop_ratio", lp, g),
        **ratio_fields("op_ratio", op, g),
        **ratio_fields("graph_ratio", gr, g),
        **ratio_fields("op_loop_ratio", op, lp),
        "op_rel_err": errors[f"op/s{slices}"], "graph_rel_err": errors[f"graph/s{slices}"],
        "loop_rel_err": errors[f"loop/s{slices}"],
        # The host-cost target compares this with meta.launch_floor_us (needs S = 1 in the run)
        "op_host_us_per_extra_slice": (
            (host[f"op/s{slices}"] - host["op/s1"]) / (slices - 1)
            if slices > 1 and "op/s1" in host else None),
        "gemmex_ms": med(gx), "gemmex_host_us": host[f"gemmex/s{slices}"],
        **ratio_fields("gemmex_ratio", gx, g),
        **ratio_fields("op_gemmex_ratio", op, gx),
        "gemmex_rel_err": errors[f"gemmex/s{slices}"],
        "rounds": len(g),
        "reps": {v.split("/")[0]: reps[v] for v in ("gemm", f"loop/s{slices}", f"op/s{slices}",
                                                    f"graph/s{slices}", f"gemmex/s{slices}")},
    }
    missing = [f for f in ROW_FIELDS if f not in row]
    assert not missing, missing
    return row


def run_case(case: Case, slices: Sequence[int], ops: dict[Spec, cg.CompiledOp],
             cfg: Config, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Sets up, checks, host-times, warms up and times one case interleaved; its rows."""
    inputs = make_inputs(case)
    gemm = reference(case, inputs)
    ref = reference(case, [x.float() for x in inputs])()
    variants: dict[str, Callable[[], Any]] = {"gemm": gemm}
    errors: dict[str, float] = {}
    keep: list[Any] = []  # graphs and their static outputs live until the case ends
    for s in slices:
        loop = python_loop(case, s)
        variants[f"loop/s{s}"] = lambda loop=loop: loop(*inputs)
        for v, library in LIBRARIES.items():
            op = ops[(case.kind, case.dtype, s, library)]
            variants[f"{v}/s{s}"] = lambda op=op: op(*inputs)
            errors[f"{v}/s{s}"] = rel_err(variants[f"{v}/s{s}"](), ref)
        graph, static_out = capture_graph(variants[f"op/s{s}"])
        keep.append((graph, static_out))
        variants[f"graph/s{s}"] = graph.replay
        errors[f"loop/s{s}"] = rel_err(variants[f"loop/s{s}"](), ref)
        static_out.zero_()
        graph.replay()
        errors[f"graph/s{s}"] = rel_err(static_out, ref)
    bad = {v: e for v, e in errors.items() if not e < 2e-2}
    if bad:
        log(f"WARNING {case.label}: relative error against fp32 above 2e-2: {bad}")
    del ref
    reps = {v: reps_for(estimate_ms(fn), cfg.block_ms, cfg.min_reps, cfg.max_reps)
            for v, fn in variants.items()}
    warm_up(gemm, cfg.warmup_s)
    blocks = {v: Block(fn, reps[v]) for v, fn in variants.items()}
    names = list(variants)
    # Host samples are spread over the rounds too: on the H200 machine one torch.matmul's
    # host time moved between 15 and 37 us within one process (cold start, CPU clocks,
    # neighbours), so a burst measured at one moment misleads.
    host_samples: dict[str, list[float]] = {v: [] for v in names}
    every = max(1, cfg.rounds // cfg.host_samples)

    def sample_host(r: int) -> None:
        if r % every == every - 1:
            for v in rotated(names, r):
                host_samples[v].append(host_sample(variants[v]))

    times = run_rounds(blocks, cfg.rounds, sync_each=True, after_round=sample_host)
    del keep
    return [summarize(case, s, times, host_samples, errors, reps) for s in slices]


# ---------------------------------------------------------------------------- output


def _r(row: dict[str, Any], name: str) -> str:
    q1, q3 = row[f"{name}_iqr"]
    return f"{row[name]:6.3f} [{q1:5.3f},{q3:5.3f}]"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The printed table: medians, ratios as median [q1,q3] of per-round ratios."""
    ratio_w = len(_r({"x": 1.0, "x_iqr": [1.0, 1.0]}, "x"))
    head = (f"{'case':>28} {'S':>2} {'GEMM ms':>8} {'loop ms':>8} {'op ms':>8} "
            f"{'graph ms':>8} {'op TF/s':>7} {'loop/GEMM':>{ratio_w}} {'op/GEMM':>{ratio_w}} "
            f"{'graph/GEMM':>{ratio_w}} {'op/loop':>{ratio_w}} {'op/gemmex':>{ratio_w}} "
            f"{'host us: GEMM':>13} {'loop':>6} {'op':>6} {'gemmex':>6} {'graph':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = f"{r['kind']} {r['dtype']} {'x'.join(map(str, r['shape']))}"
        lines.append(
            f"{label:>28} {r['slices']:>2} {r['gemm_ms']:8.3f} {r['loop_ms']:8.3f} "
            f"{r['op_ms']:8.3f} {r['graph_ms']:8.3f} {r['op_tflops']:7.1f} "
            f"{_r(r, 'loop_ratio')} {_r(r, 'op_ratio')} {_r(r, 'graph_ratio')} "
            f"{_r(r, 'op_loop_ratio')} {_r(r, 'op_gemmex_ratio')} {r['gemm_host_us']:13.1f} "
            f"{r['loop_host_us']:6.1f} {r['op_host_us']:6.1f} {r['gemmex_host_us']:6.1f} "
            f"{r['graph_host_us']:6.1f}")
    lines.append("GEMM = one torch.matmul (F.linear for linear+bias); op = cuBLASLt plans, "
                 "gemmex = the op built with gemm_library='cublas'; ratios: median [q1,q3] "
                 "of per-round ratios; times: median over rounds")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """speed.png: bf16 ratios to one GEMM per case; False if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = [r for r in rows if r["dtype"] == "bf16"]
    cases = list(dict.fromkeys((r["kind"], tuple(r["shape"])) for r in bf16))
    if not cases:
        return False
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.4), sharey=True,
                             squeeze=False)
    for ax, (kind, shape) in zip(axes[0], cases):
        rs = [r for r in bf16 if (r["kind"], tuple(r["shape"])) == (kind, shape)]
        xs = [r["slices"] for r in rs]
        for key, style, label in (("loop_ratio", "o-", "Python stream loop"),
                                  ("op_ratio", "s-", "generated op"),
                                  ("graph_ratio", "^-", "op, CUDA-graph replay")):
            lo = [r[key] - r[f"{key}_iqr"][0] for r in rs]
            hi = [r[f"{key}_iqr"][1] - r[key] for r in rs]
            ax.errorbar(xs, [r[key] for r in rs], yerr=[lo, hi], fmt=style, label=label,
                        capsize=2)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(("linear+bias " if kind != "matmul" else "") + "x".join(map(str, shape)),
                     fontsize=9)
        ax.set_xlabel("slices S")
    axes[0][0].set_ylabel("time / one GEMM (bf16), median [IQR]")
    axes[0][0].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def estimate_s(cases: Sequence[Case], slices: Sequence[int], cfg: Config) -> float:
    """A rough GPU-side duration of the timed part (builds and start-up not included):
    per case the warm-up, host timing (about 0.3 s per variant) and the rounds (about
    1.3 blocks per variant and round, lead-in calls and synchronization included)."""
    variants = 1 + 4 * len(slices)
    per_case = cfg.warmup_s + 0.3 * variants + cfg.rounds * variants * cfg.block_ms * 1.3e-3
    return len(cases) * per_case


def plan_text(cases: Sequence[Case], slices: Sequence[int], cfg: Config) -> str:
    lines = [f"{len(cases)} cases x S in {list(slices)}: {1 + 4 * len(slices)} variants per "
             f"round (gemm, and loop/op/gemmex/graph per S)",
             f"rounds {cfg.rounds}, block ~{cfg.block_ms} ms (reps {cfg.min_reps}.."
             f"{cfg.max_reps}), warm-up {cfg.warmup_s} s per case",
             f"timed part about {estimate_s(cases, slices, cfg):.0f} s, plus builds "
             "and start-up"]
    lines += [f"  {c.label}" for c in cases]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_matmul", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="folder for results.json, table.txt, speed.png")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: three cases, S in (1, 4), 8 rounds of 5 ms blocks")
    p.add_argument("--shapes", help="comma-separated cases: TAG, SHAPE or TAG:SHAPE; TAG in "
                   "bf16, fp16, fp32, matmul, linear; SHAPE N (N³) or MxNxK. "
                   "E.g. 8192 or bf16:2048,linear")
    p.add_argument("--slices", help="comma-separated slice counts (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, help=f"rounds per case (default {Config.rounds})")
    p.add_argument("--block-ms", type=float,
                   help=f"GPU time per variant per round (default {Config.block_ms})")
    p.add_argument("--min-reps", type=int, default=Config.min_reps)
    p.add_argument("--max-reps", type=int, default=Config.max_reps)
    p.add_argument("--warmup-s", type=float, default=Config.warmup_s,
                   help="warm-up of GEMMs per case, seconds (>= 1 for honest numbers)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel build processes")
    p.add_argument("--no-floor", action="store_true", help="skip the launch-floor probe")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> tuple[list[Case], tuple[int, ...], Config]:
    """Cases, slice counts and config from the arguments (--quick sets defaults; explicit
    options win)."""
    base = QUICK_CONFIG if args.quick else Config()
    cases = list(QUICK_CASES if args.quick else CASES)
    if args.shapes:
        cases = select_cases(CASES, args.shapes)
    slices = parse_ints(args.slices, "--slices") if args.slices else (
        QUICK_SLICES if args.quick else SLICES)
    cfg = Config(rounds=args.rounds or base.rounds, block_ms=args.block_ms or base.block_ms,
                 min_reps=args.min_reps, max_reps=args.max_reps, warmup_s=args.warmup_s,
                 host_samples=base.host_samples)
    if cfg.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {cfg.rounds}")
    reps_for(1.0, cfg.block_ms, cfg.min_reps, cfg.max_reps)  # validates the reps range
    return cases, slices, cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cases, slices, cfg = resolve(args)
    except ValueError as e:
        print(f"bench_matmul: {e}", file=sys.stderr)
        return 2
    print(plan_text(cases, slices, cfg), flush=True)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("bench_matmul: needs a CUDA GPU (--dry-run shows the plan without one)",
              file=sys.stderr)
        return 1
    start = time.perf_counter()
    specs: list[Spec] = sorted({(c.kind, c.dtype, s, library) for c in cases for s in slices
                                for library in LIBRARIES.values()})
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        building = pool.submit(prebuild, specs, max(1, min(args.jobs, len(specs))))
        floor: dict[str, Any] = {}
        if not args.no_floor:
            try:
                launch_floor.build()
            except launch_floor.ProbeUnavailable as e:
                floor = {"launch_floor_us": None, "launch_floor_skipped": str(e)}
        for msg in building.result():
            print(msg, file=sys.stderr)
    ops = {spec: cg.compile(make_fusion(*spec[:3]), gemm_library=spec[3]) for spec in specs}
    build_s = time.perf_counter() - start
    print(f"built and loaded {len(ops)} programs and the probe in {build_s:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    for case in cases:
        t = time.perf_counter()
        torch.backends.cuda.matmul.allow_tf32 = case.dtype == "fp32/tf32"  # fp32 rows: TF32
        try:
            rows += run_case(case, slices, ops, cfg)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.cuda.empty_cache()
        print(f"{case.label}: {time.perf_counter() - t:.1f} s", flush=True)
    if args.no_floor:
        floor = {"launch_floor_us": None, "launch_floor_skipped": "--no-floor"}
    elif not floor:
        floor = launch_floor.measure()
        print(f"launch floor: {floor['launch_floor_us']:.2f} us per cublasLtMatmul launch",
              flush=True)
    command = "python -m benchmarks.bench_matmul" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": command,
        "launch_floor_us": floor["launch_floor_us"],
        "launch_floor": {k: v for k, v in floor.items() if k != "launch_floor_us"},
        **dataclasses.asdict(cfg),
        "timing": TIMING_METHOD,
        "host_us_method": HOST_US_METHOD,
        "build_s": build_s,
        "wall_s": time.perf_counter() - start,
    }
    text = table(rows)
    print(text)
    print(f"launch floor {floor['launch_floor_us']} us; wall {meta['wall_s']:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "table.txt").write_text(json.dumps(meta, indent=1) + "\n\n" + text + "\n")
    wrote = ["results.json", "table.txt"]
    if not args.no_plot and plot(rows, args.out / "speed.png"):
        wrote.append("speed.png")
    print(f"wrote {', '.join(wrote)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
