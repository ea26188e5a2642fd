"""A Llama MLP whose weights live in pinned host memory, against its copy floor.

    python -m benchmarks.mlp_offload [--out benchmarks/results] [--rounds N]

``codegen.examples.llama_mlp(weights="cpu")`` at h = 4096, i = 14336, bf16 (352 MB of
weights), m = 512 and 4096 tokens, S = 2 / 4 / 8 / 16 slices, as one program with a copy
stream (``copy_stream=True``: the copies of the down loop queue behind those of the
gate/up loop and run under its GEMMs), without one (each loop's copies on its
workers, after the previous loop's join), and staged in the thread's staging ring
(``staging="ring"``: the copies also run ahead across calls, so call j + 1's first
slices copy under call j's last GEMMs), beside:

- copy: the three weights copied alone from pinned memory, back to back on one stream
  (the copy floor: nothing that reads them can finish sooner);
- three ops: one compiled op per Linear (each streams its own weight in S slices), the
  SiLU-and-multiply in torch between them, with per-call staging (each op's copies wait
  for the op before it) and with the ring (``ring``: each op's copies run under the op
  before it, as ``codegen.nn.offload`` runs a model's Linears);
- prefetch: a hand-written Python prefetch: each weight copied whole into its own GPU
  buffer on a side stream while the previous GEMM runs (holds all three on the GPU).

Interleaved rounds after a warm-up; each ratio is the median of per-round ratios to the
copy floor. Writes mlp_offload.json (rows: tokens, slices, variant, op_ms, copy_floor_ms,
ratio) to --out and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import codegen as cg
from benchmarks.common import RESULTS, bind, interleaved, per_round_ratios
from codegen import examples

HIDDEN, INTER = 4096, 14336


def host_linear(slices: int, name: str, staging: str = "slots") -> cg.CompiledOp:
    """One Linear whose weight [n, k] is in host memory, streamed by row blocks."""
    return cg.compile(examples.offload_linear(torch.bfloat16, slices, name=name),
                      copy_stream=True, staging=staging)


class Prefetch:
    """Hand-written layer prefetch: the next weight is copied on a side stream into its own
    GPU buffer while the current GEMM runs; the compute stream waits for each copy."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.host = weights
        self.gpu = [torch.empty_like(w, device="cuda") for w in weights]
        self.side = torch.cuda.Stream()
        self.done = [torch.cuda.Event() for _ in weights]

    def copy(self, k: int) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.gpu[k].copy_(self.host[k], non_blocking=True)
            self.done[k].record()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.copy(0)
        self.copy(1)  # queued behind the first on the side stream
        torch.cuda.current_stream().wait_event(self.done[0])
        gate = F.linear(x, self.gpu[0])
        self.copy(2)
        torch.cuda.current_stream().wait_event(self.done[1])
        act = F.silu(gate) * F.linear(x, self.gpu[1])
        torch.cuda.current_stream().wait_event(self.done[2])
        return F.linear(act, self.gpu[2])


def copy_floor(weights: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    for w, b in zip(weights, buffers):
        b.copy_(w, non_blocking=True)


def rows_for(tokens: int, slices: list[int], rounds: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(INTER, HIDDEN, generator=g).mul_(0.02).bfloat16().pin_memory(),
               torch.randn(INTER, HIDDEN, generator=g).mul_(0.02).bfloat16().pin_memory(),
               torch.randn(HIDDEN, INTER, generator=g).mul_(0.02).bfloat16().pin_memory()]
    x = torch.randn(tokens, HIDDEN, device="cuda").mul_(0.5).bfloat16()
    ref = F.linear(F.silu(F.linear(x, weights[0].cuda())) * F.linear(x, weights[1].cuda()),
                   weights[2].cuda()).float()
    buffers = [torch.empty_like(w, device="cuda") for w in weights]
    variants: dict[str, Any] = {"copy": bind(copy_floor, weights, buffers)}
    prefetch = Prefetch(weights)
    variants["prefetch"] = bind(prefetch, x)
    for s in slices:
        for suffix, options in (("", {}), (" cs", {"copy_stream": True}),
                                (" ring", {"staging": "ring"})):
            op = cg.compile(examples.llama_mlp(torch.bfloat16, s, "cpu",
                                               name=f"mlp_offload_s{s}"), **options)
            err = ((op(x, *weights).float() - ref).norm() / ref.norm()).item()
            if err > 2e-2:
                raise SystemExit(f"llama_mlp S={s} {options}: relative error {err:.2e}")
            variants[f"op S={s}{suffix}"] = bind(op, x, *weights)
        for staging in ("slots", "ring"):
            up = host_linear(s, f"mlp_offload_up_s{s}", staging)
            down = host_linear(s, f"mlp_offload_down_s{s}", staging)

            def three(up: cg.CompiledOp = up, down: cg.CompiledOp = down) -> torch.Tensor:
                return down(F.silu(up(x, weights[0])) * up(x, weights[1]), weights[2])

            variants[f"three ops S={s}{' ring' if staging == 'ring' else ''}"] = three
    times = interleaved(variants, rounds)
    floor = statistics.median(times["copy"])
    rows = []
    for k, t in times.items():
        ratios = per_round_ratios(t, times["copy"])
        slices_of = int(k.split("S=")[1].split()[0]) if "S=" in k else None
        rows.append({"tokens": tokens, "slices": slices_of, "variant": k,
                     "op_ms": statistics.median(t), "copy_floor_ms": floor,
                     "ratio": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mlp_offload", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--slices", default="2,4,8,16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mlp_offload: needs a CUDA GPU", file=sys.stderr)
        return 1
    slices = [int(s) for s in args.slices.split(",")]
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows += rows_for(tokens, slices, args.rounds)
    print(f"{'tokens':>7} {'variant':20}{'ms':>8}{'/ copy floor':>14}{'range':>16}")
    for r in rows:
        lo, hi = r["ratio_range"]
        print(f"{r['tokens']:7} {r['variant']:20}{r['op_ms']:8.3f}{r['ratio']:14.3f}"
              f"{lo:8.3f}-{hi:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "h": HIDDEN, "i": INTER, "rows": rows}
    (args.out / "mlp_offload.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
