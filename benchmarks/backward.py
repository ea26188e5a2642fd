"""Forward + backward of compiled ops against torch autograd of the same math.

GPU-resident bf16: ``matmul_rows`` and ``linear_bias`` at 8192^3 and ``llama_mlp`` (h 4096,
i 14336, m 4096), S = 1 / 4 / 8 slices, each step ``out = op(*inputs);
out.backward(grad)``, interleaved with torch's after a warm-up; then the offloaded
``llama_mlp`` (weights in pinned host memory) training step against its copy floor (the
three weights copied in twice and their gradients out once, each alone). Rows go to
``benchmarks/results/backward.json``: ``case, slices, time_ms, torch_ms`` (and
``ratio``); the offloaded row has ``copy_floor_ms`` instead of ``torch_ms``.

    python -m benchmarks.backward [--rounds 7] [--slices 1,4,8] [--cases ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import codegen as cg
from benchmarks.common import interleaved
from codegen import examples

RESULTS = Path(__file__).resolve().parent / "results" / "backward.json"


def _linear_bias(dtype: torch.dtype, slices: int, name: str) -> cg.Fusion:
    with cg.Fusion(name) as f:
        x = cg.input(["m", "k"], dtype, name="x")
        w = cg.input(["n", "k"], dtype, name="w")
        b = cg.input(["n"], dtype, name="bias")
        out = cg.linear(x, w, b)
        cg.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    return f


def _llama(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> Any:
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


CASES: dict[str, tuple[Any, Any, list[tuple[int, ...]]]] = {
    "matmul_rows": (lambda d, s, n: examples.matmul_rows(d, s, name=n), torch.matmul,
                    [(8192, 8192), (8192, 8192)]),
    "linear_bias": (_linear_bias, F.linear, [(8192, 8192), (8192, 8192), (8192,)]),
    "llama_mlp": (lambda d, s, n: examples.llama_mlp(d, s, name=n), _llama,
                  [(4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]),
}


def step(fn: Any, leaves: list[torch.Tensor], grad: torch.Tensor) -> Any:
    """One training step of ``fn``: forward, backward into fresh gradients."""

    def run() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)

    return run


def gpu_rows(cases: list[str], slices: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        make, ref, shapes = CASES[case]
        g = torch.Generator(device="cuda").manual_seed(0)
        leaves = [torch.randn(*s, device="cuda", generator=g).mul_(0.02).bfloat16()
                  .requires_grad_() for s in shapes]
        grad = torch.randn(*ref(*leaves).shape, device="cuda", generator=g).bfloat16()
        variants = {"torch": step(ref, leaves, grad)}
        for s in slices:
            op = cg.compile(make(torch.bfloat16, s, f"bench_bwd_{case}_s{s}"))
            variants[f"S={s}"] = step(op, leaves, grad)
        times = interleaved(variants, rounds)
        torch_ms = statistics.median(times["torch"])
        for s in slices:
            ms = statistics.median(times[f"S={s}"])
            rows.append({"case": case, "slices": s, "time_ms": round(ms, 3),
                         "torch_ms": round(torch_ms, 3), "ratio": round(ms / torch_ms, 3)})
            print(f"{case:12s} S={s:<2d} {ms:8.3f} ms  torch {torch_ms:8.3f} ms  "
                  f"ratio {ms / torch_ms:.3f}", flush=True)
    return rows


def offload_row(slices: int, rounds: int, tokens: int = 512) -> dict[str, Any]:
    """The offloaded llama_mlp training step against its copy floor."""
    h, i = 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, h, device="cuda", generator=g).mul_(0.1).bfloat16().requires_grad_()
    ws = [torch.randn(*s, generator=torch.Generator().manual_seed(k)).mul_(0.02).bfloat16()
          .pin_memory().requires_grad_() for k, s in enumerate([(i, h), (i, h), (h, i)])]
    grad = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    op = cg.compile(examples.llama_mlp(torch.bfloat16, slices, weights="cpu",
                                       name=f"bench_bwd_offload_s{slices}"))
    dev = [torch.empty_like(w, device="cuda") for w in ws]
    host = [torch.empty_like(w).pin_memory() for w in ws]

    def copies() -> None:  # weights in twice, gradients out once
        for _ in range(2):
            for d, w in zip(dev, ws):
                d.copy_(w.detach(), non_blocking=True)
        for hst, d in zip(host, dev):
            hst.copy_(d, non_blocking=True)

    times = interleaved({"copy": copies, "op": step(op, [x, *ws], grad)}, rounds)
    floor, ms = statistics.median(times["copy"]), statistics.median(times["op"])
    print(f"offloaded llama_mlp training step, {tokens} tokens, S={slices}: {ms:.2f} ms, "
          f"copy floor {floor:.2f} ms, ratio {ms / floor:.3f}", flush=True)
    return {"case": "llama_mlp_offloaded", "slices": slices, "tokens": tokens,
            "time_ms": round(ms, 3), "copy_floor_ms": round(floor, 3),
            "ratio": round(ms / floor, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--slices", default="1,4,8")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--offload-slices", type=int, default=8)
    parser.add_argument("--skip-offload", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS.parent)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.backward needs a CUDA GPU")
    slices = [int(s) for s in args.slices.split(",")]
    rows = gpu_rows(args.cases.split(","), slices, args.rounds)
    if not args.skip_offload:
        rows.append(offload_row(args.offload_slices, args.rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backward.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
