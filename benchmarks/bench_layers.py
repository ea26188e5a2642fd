"""Layers as one program: the Llama and GPT MLPs against eager torch, and the host cost of
an elementwise op per slice, on one GPU.

    python -m benchmarks.bench_layers [--out benchmarks/results] [--rounds N] [--skip-mlp]

MLPs (bf16, GPU-resident weights): ``codegen.examples.llama_mlp`` at m = 4096, h = 4096,
i = 14336 and ``gpt_mlp`` at i = 16384, S = 1 / 2 / 4 stream slices of the intermediate
axis, each beside the eager module transformers runs (``F.linear``, ``F.silu``, ``*``;
``F.linear`` with biases and ``F.gelu(approximate="tanh")``), timed interleaved in rounds
after a warm-up (the H200 power-caps: whatever runs first wins), reporting the median of
per-round op / eager ratios and the peak device memory of one call of each, above what
the inputs hold.

Host cost: ``mul(silu(a), b)`` (one fused kernel a slice) on [8, 64 S] bf16 slices, S = 4,
8, 16, 32 (pool 4: the same fork and join at every S), host microseconds per call with
the GPU kept busy; the slope over S is the cost of one elementwise op on one slice (its
stream switch, three views and the launch).

Writes layers.json to --out and prints the tables.
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
from benchmarks.common import RESULTS, bind, host_sample, interleaved, peak_mib, ratio_fields
from codegen import examples


def llama_eager(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def gpt_eager(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
              b2: torch.Tensor) -> torch.Tensor:
    """A GPT-2 MLP: c_proj(gelu_new(c_fc(x)))."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def mlp_rows(rounds: int, slices: list[int]) -> list[dict[str, Any]]:
    m, h = 4096, 4096
    cases = [("llama_mlp", examples.llama_mlp, llama_eager, 14336),
             ("gpt_mlp", examples.gpt_mlp, gpt_eager, 16384)]
    rows = []
    for name, make, eager, i in cases:
        g = torch.Generator(device="cuda").manual_seed(0)

        def rand(*shape: int, g: torch.Generator = g) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", generator=g).mul_(0.02).bfloat16()

        xs = ([rand(m, h), rand(i, h), rand(i, h), rand(h, i)] if name == "llama_mlp"
              else [rand(m, h), rand(i, h), rand(i), rand(h, i), rand(h)])
        ops = {s: cg.compile(make(torch.bfloat16, s, name=f"bench_{name}_s{s}")) for s in slices}
        ref = eager(*xs).float()
        variants: dict[str, Any] = {"eager": bind(eager, *xs)}
        for s, op in ops.items():
            err = ((op(*xs).float() - ref).norm() / ref.norm()).item()
            if err > 2e-2:
                raise SystemExit(f"{name} S={s}: relative error {err:.2e} against eager")
            variants[f"S={s}"] = bind(op, *xs)
        times = interleaved(variants, rounds)
        peaks = {k: peak_mib(v) for k, v in variants.items()}
        for s in ops:
            k = f"S={s}"
            rows.append({
                "case": name, "m": m, "h": h, "i": i, "slices": s,
                "op_ms": statistics.median(times[k]),
                "eager_ms": statistics.median(times["eager"]),
                **ratio_fields("op_eager", times[k], times["eager"]),
                "op_peak_mib": peaks[k], "eager_peak_mib": peaks["eager"],
            })
    return rows


def host_rows(slices: list[int]) -> dict[str, Any]:
    per_s = {}
    for s in slices:
        with cg.Fusion(f"bench_swiglu_host_s{s}") as fusion:
            a = cg.input(["m", "n"], torch.bfloat16)
            b = cg.input(["m", "n"], torch.bfloat16)
            out = cg.mul(cg.silu(a), b)
            cg.output(out)
        out.outer_split(1, s)
        out.axis(1).parallelize(cg.ParallelType.Stream)
        op = cg.compile(fusion)
        x = torch.randn(8, 64 * s, device="cuda").bfloat16()
        y = torch.randn(8, 64 * s, device="cuda").bfloat16()
        op(x, y)
        samples = [host_sample(bind(op, x, y), calls=20) for _ in range(25)]
        per_s[s] = statistics.median(samples)
    xs = list(per_s)
    ys = [per_s[s] for s in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"host_us_by_slices": per_s, "per_slice_us": slope, "fixed_us": my - slope * mx}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_layers", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--slices", default="1,2,4")
    parser.add_argument("--skip-mlp", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layers: needs a CUDA GPU", file=sys.stderr)
        return 1
    slices = [int(s) for s in args.slices.split(",")]
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": host_rows([4, 8, 16, 32]),
    }
    host = result["host"]
    print("host us per call of mul(silu(a), b), by slices: "
          + ", ".join(f"S={s}: {v:.1f}" for s, v in host["host_us_by_slices"].items())
          + f"; per slice {host['per_slice_us']:.2f} us, fixed {host['fixed_us']:.1f} us")
    if not args.skip_mlp:
        result["mlp"] = mlp_rows(args.rounds, slices)
        print(f"{'case':10}{'S':>3}{'op ms':>9}{'eager ms':>10}{'op/eager':>10}"
              f"{'q1':>7}{'q3':>7}{'peak MiB':>10}{'eager MiB':>11}")
        for r in result["mlp"]:
            print(f"{r['case']:10}{r['slices']:>3}{r['op_ms']:9.3f}{r['eager_ms']:10.3f}"
                  f"{r['op_eager']:10.3f}{r['op_eager_iqr'][0]:7.3f}{r['op_eager_iqr'][1]:7.3f}"
                  f"{r['op_peak_mib']:10.0f}{r['eager_peak_mib']:11.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layers.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
