"""A Llama-3-8B-shaped model offloaded under GPU memory budgets.

    python -m benchmarks.offload_budget [--budgets 0,25,50,75] [--tokens 512,4096,1]
                                        [--generate N] [--last-logits] [--rounds N]
                                        [--layers N]
                                        [--variants codegen,accelerate,prefetch,gpu,copy]
                                        [--quantize fp8,int4] [--staging MiB,...]
                                        [--prefill-plan]
                                        [--out DIR] [--dry-run]

32 layers, h 4096, i 14336, 32 heads, 8 kv heads, vocab 128256, bf16, random weights built
from the config on the GPU (no download). The decoder layers' Linears are the offloadable
weights (13.0 GiB); embeddings, norms and lm_head stay on the GPU. A budget of p% gives
the offloadable weights p% of their bytes (0%: the default staging alone, nothing
resident). Rows, each model its own (offloading changes a model in place), all alive at
once and timed interleaved:

- codegen_p<p>: ``codegen.nn.offload(model, filter=<decoder Linears>, gpu_budget=B)``;
- accelerate_p<p> (25 and 50 by default): accelerate's ``infer_auto_device_map`` with
  ``max_memory`` giving the GPU the same B plus the rest of the model, and
  ``dispatch_model`` (what ``device_map="auto"`` does): the layers that do not fit run
  from pageable host memory through its hooks;
- prefetch: the hand-written layer prefetch of ``offload_llama`` (every weight streamed);
- prefetch_per_forward (named in ``--variants``): the same without the copy across
  forwards (``LayerPrefetch(model, wrap=False)``): each forward waits for its first
  layer's copy;
- gpu: the model with every weight on the GPU;
- copy_p<p>: the weights codegen_p<p> streams copied alone, whole, back to back from its
  pinned arena on one stream (the floor of that budget);
- with ``--quantize fp8,int4``: codegen_p<p>_<kind> (``quantize=<kind>``, at each budget of
  ``--quantize-budgets``, default 0) and copy_p<p>_<kind>, the floor of its quantized
  bytes, and dequant_p<p>_<kind>, the GPU time of dequantizing every weight that row
  streams once (from its arena rows put on the GPU); ``prefetch_over`` is the prefetch's
  (bf16) ms over the row's;
- with ``--staging MiB,...``: each codegen row again (and its floor) with
  ``offload(..., staging=MiB)``, named ``..._s<MiB>`` (a quantized one with its own
  dequant row: it may stream other weights);
- with ``--prefill-plan``: each codegen row again (and its floor) with
  ``offload(..., optimize_for="prefill")`` (a ring of a whole layer where the budget
  allows), named ``..._prefill``; at 0%, with no budget (the 0% budget is the decode
  plan's ring).

Steps: prefills of ``--tokens`` tokens (1: the decode step of ``offload_llama``, one token
after a 512-token prompt with a ``DynamicCache``), each prefill returning every position's
logits (lm_head over all tokens: at 4096 tokens about 7 ms of GEMM after the last streamed
weight), with ``--last-logits`` again returning the last position's only (``prefill_last``,
as ``generate``'s prefill runs it), and with ``--generate N`` greedy
``generate`` of N tokens (tokens/s). Ratios are medians of per-round ratios;
``vs_floor`` is ms over max(copy_p<p>, gpu) of the same round, the target's measure (for
a quantized row: over max(its copy floor, gpu + its dequant row)).

Memory, per codegen row: ``budget_mib``; ``held_mib``, what offload() keeps on the GPU
beyond the rest of the model (the resident Linears, the ring and the bias buffer, read
from ``torch.cuda.memory_allocated``); ``offload_peak_mib``, the peak of offload() itself
above the rest of the model; ``forward_extra_mib``, a forward's peak above the one of the
GPU-resident model's same forward (activations are the same: what the streaming
allocates); ``pinned_over_streamed``: the arena's bytes over the streamed bytes.

Writes offload_budget.json to --out and prints the table and each budget's placement.
Needs a CUDA GPU and about 70 GB of GPU memory for the default rows (``--dry-run`` does
not: it prints each budget's placement, computed on the meta device).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import codegen.nn
from benchmarks.common import (
    RESULTS,
    ROW,
    Block,
    arena_copies,
    bind,
    budget_and_staging,
    budget_bytes,
    build,
    config_8b,
    generate_ms,
    is_decoder_linear,
    median_ratio,
    offloadable,
    peak_mib,
    rotated,
)
from benchmarks.offload_llama import DECODE_PROMPT, DecodeStep, LayerPrefetch, forward
from codegen.nn.offload import _resident, default_staging
from codegen.nn.plan import format_bytes, place
from codegen.nn.quantize import dequantizer

SEED = 0
DEFAULT_BUDGETS = (0, 25, 50, 75)
ACCELERATE_BUDGETS = (25, 50)


def rest_bytes(model: Any) -> int:
    """GPU bytes of what is not an offloadable Linear's weight or bias."""
    skip = {id(t) for _, m in offloadable(model) for t in (m.weight, m.bias) if t is not None}
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
               if id(t) not in skip)


# ---------------------------------------------------------------------------- variants


class Built:
    """A row's model (None for a copy floor) or call, and what was measured setting it up."""

    def __init__(self, name: str, model: Any = None, call: Callable[[], Any] | None = None,
                 keep: Any = None, **facts: Any) -> None:
        self.name, self.model, self.call, self.keep, self.facts = name, model, call, keep, facts


FROM_GPU = False  # --offload-from-gpu: offload the model where it was built (faster set-up)


def codegen_row(config: Any, percent: int, quantize: str | None = None,
                staging_mib: int | None = None, optimize_for: str = "decode") -> Built:
    """The model offloaded from host memory (where a model that does not fit is), so that
    offload()'s own peak is what it puts on the GPU: the rest of the model, the resident
    Linears and the staging. With ``FROM_GPU``, from the GPU it was built on: the held
    bytes are the same, offload()'s peak is not measured (it holds the originals until
    it has succeeded)."""
    model = build(config) if FROM_GPU else build(config).cpu()
    rest = rest_bytes(model)
    budget, staging = budget_and_staging(model, percent, staging_mib,
                                         optimize_for == "prefill")
    gc.collect()
    torch.cuda.synchronize()
    weights = sum(t.numel() * t.element_size() for _, m in offloadable(model)
                  for t in (m.weight, m.bias) if t is not None)
    # What the rest of the model will take, on top of what is allocated now.
    base = (torch.cuda.memory_allocated() - weights if FROM_GPU
            else torch.cuda.memory_allocated() + rest)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    codegen.nn.offload(model, filter=is_decoder_linear, gpu_budget=budget, quantize=quantize,
                       staging=staging, optimize_for=optimize_for)
    offload_s = time.perf_counter() - started
    torch.cuda.synchronize()
    gc.collect()
    plan = codegen.nn.offload_plan(model)
    arena = codegen.nn.arena(model)
    facts = {
        "budget_percent": percent, "budget_mib": budget and budget / 2**20,
        "resident_linears": len(plan.resident), "streamed_linears": len(plan.streamed),
        "resident_mib": plan.resident_bytes / 2**20, "streamed_mib": plan.streamed_bytes / 2**20,
        "staging_mib": plan.staging_bytes / 2**20,
        "held_mib": (torch.cuda.memory_allocated() - base) / 2**20,
        "offload_peak_mib": (None if FROM_GPU
                             else (torch.cuda.max_memory_allocated() - base) / 2**20),
        "pinned_over_streamed": arena.nbytes / max(plan.streamed_bytes, 1),
        "expected_decode_ms": plan.expected_ms(1), "expected_prefill4096_ms":
        plan.expected_ms(4096), "rest_mib": rest / 2**20, "offload_s": offload_s}
    print(plan.placement().splitlines()[0]
          + (f"  [{format_bytes(budget)} budget]" if budget else ""))
    suffix = ((f"_{quantize}" if quantize else "") + (f"_s{staging_mib}" if staging_mib else "")
              + (f"_{optimize_for}" if optimize_for != "decode" else ""))
    return Built(f"codegen_p{percent}{suffix}", model, **facts)


def copy_row(source: Built) -> Built:
    """The weights ``source`` streams, copied alone from its arena, whole, back to back."""
    plan = codegen.nn.offload_plan(source.model)
    return Built(source.name.replace("codegen", "copy"), call=arena_copies(source.model),
                 streamed_mib=plan.streamed_bytes / 2**20)


def dequant_row(source: Built) -> Built:
    """The dequantization of every weight ``source`` streams, once: the GPU time its
    forwards add to the GPU-resident model's (the prefill target's measure). The kernels'
    time depends on a weight's shape, not its values: each shape's first weight is put on
    the GPU at set-up, and dequantized once for each weight of that shape."""
    plan = codegen.nn.offload_plan(source.model)
    arena = codegen.nn.arena(source.model).storage
    by_shape: dict[tuple[int, ...], Callable[[], torch.Tensor]] = {}
    runs = []
    for lay in plan.layouts:
        if lay.quant is None:  # a weight the format cannot take streams as it is
            continue
        shape = (lay.out_features, lay.in_features, lay.row_bytes)
        if shape not in by_shape:
            raw = arena[lay.weight_offset:lay.weight_offset + lay.weight_bytes].to("cuda")
            by_shape[shape] = dequantizer(raw.view(lay.out_features, lay.row_bytes),
                                          lay.quant, lay.in_features, lay.dtype)
        runs.append(by_shape[shape])

    def call() -> None:
        for run in runs:
            run()

    return Built(source.name.replace("codegen", "dequant"), call=call, keep=by_shape,
                 weights=len(runs), shapes=len(by_shape))


def accelerate_row(config: Any, percent: int) -> Built:
    import accelerate

    model = build(config)
    budget = budget_bytes(model, percent) + rest_bytes(model)
    model.cpu()  # dispatch_model reads the weights it offloads from host memory
    gc.collect()
    device_map = accelerate.infer_auto_device_map(
        model, max_memory={0: budget, "cpu": 2**40},
        no_split_module_classes=["LlamaDecoderLayer"])
    model = accelerate.dispatch_model(model, device_map=device_map)
    on_gpu = sum(1 for d in device_map.values() if d == 0)
    return Built(f"accelerate_p{percent}", model, budget_percent=percent,
                 budget_mib=budget / 2**20, modules_on_gpu=on_gpu,
                 modules_on_cpu=len(device_map) - on_gpu)


PREFETCHES = ("prefetch", "prefetch_per_forward")  # LayerPrefetch rows: every weight streamed
VARIANTS = ("codegen", "copy", "gpu", "accelerate", *PREFETCHES)  # what --variants names


def make(name: str, config: Any, built: dict[str, Built]) -> Built:
    if name == "gpu":
        return Built(name, build(config))
    if name in PREFETCHES:
        model = build(config)
        return Built(name, model, keep=LayerPrefetch(model, wrap=name == "prefetch"))
    found = re.fullmatch(ROW, name)
    kind, percent, quantize, staging, plan_for = found.groups() if found else (None,) * 5
    if kind == "codegen":
        return codegen_row(config, int(percent), quantize, staging and int(staging),
                           plan_for or "decode")
    if kind == "accelerate":
        return accelerate_row(config, int(percent))
    if kind == "copy":
        return copy_row(built[name.replace("copy", "codegen", 1)])
    if kind == "dequant":
        return dequant_row(built[name.replace("dequant", "codegen", 1)])
    raise ValueError(f"unknown row {name!r}")


# ---------------------------------------------------------------------------- timing


def timed(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """ms per call, one value per round: two warm-up calls each, then ``rounds`` rounds of
    one block per row in a rotated order (``_call_ms``: a lead-in call, then one timed
    call, three where a call takes under 50 ms), the device synchronized before each
    block."""
    reps = {}
    for v, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        reps[v] = 3 if _call_ms(fn) < 50 else 1
    times: dict[str, list[float]] = {v: [] for v in calls}
    for r in range(rounds):
        for v in rotated(list(calls), r):
            times[v].append(_call_ms(calls[v], reps[v]))
    return times


def rows_of(step: str, tokens: int, times: dict[str, list[float]],
            built: dict[str, Built]) -> list[dict[str, Any]]:
    """One row per variant: median ms, and for a budget's rows the median per-round ratio
    to max(its copy floor, the GPU-resident model) and to accelerate's at that budget."""
    rows = []
    for v, t in times.items():
        found = re.fullmatch(ROW, v)
        percent = found.group(2) if found else "0" if v in PREFETCHES else None
        suffix = v[found.end(2):] if found else ""  # the row's format, staging and plan
        floor = times.get(f"copy_p{percent}{suffix}") if percent is not None else None
        gpu = times.get("gpu")
        dequant = times.get(f"dequant_p{percent}{suffix}") if suffix else None
        if gpu and dequant:  # a quantized row's GPU-resident bound: + its dequantization
            gpu = [g + d for g, d in zip(gpu, dequant)]
        accel = (times.get(f"accelerate_p{percent}")  # bf16 rows: at the same budget
                 if percent is not None and not (found and found.group(3)) else None)
        prefetch = times.get("prefetch")
        bound = ([max(f, g) for f, g in zip(floor, gpu)] if floor and gpu else floor)
        rows.append({"step": step, "tokens": tokens, "variant": v, "ms": statistics.median(t),
                     "vs_floor": (median_ratio(t, bound)
                                  if bound and not v.startswith("dequant") else None),
                     "prefetch_over": median_ratio(prefetch, t) if prefetch else None,
                     "accelerate_over": median_ratio(accel, t) if accel else None,
                     "rounds": len(t), **{k: x for k, x in built[v].facts.items()
                                          if not isinstance(x, float) or k.endswith("mib")}})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any) -> str:
        return f"{x:9.3f}" if isinstance(x, float) else f"{'-':>9}"

    lines = [f"{'step':9}{'tokens':>7} {'variant':20}{'ms':>10}{'tok/s':>9}{'vs floor':>9}"
             f"{'accel/x':>9}{'pref/x':>9}"]
    for r in rows:
        lines.append(f"{r['step']:9}{r['tokens']:7} {r['variant']:20}{r['ms']:10.2f}"
                     f"{f(r.get('tokens_per_s'))}{f(r['vs_floor'])}{f(r['accelerate_over'])}"
                     f"{f(r['prefetch_over'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload_budget",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                        help="percent of the offloadable bytes, comma-separated")
    parser.add_argument("--accelerate-budgets", default=",".join(map(str, ACCELERATE_BUDGETS)))
    parser.add_argument("--tokens", default="512,4096,1")
    parser.add_argument("--generate", type=int, default=0, metavar="N")
    parser.add_argument("--last-logits", action="store_true",
                        help="each prefill again with only the last position's logits "
                             "(logits_to_keep=1, as generate's prefill runs it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--variants", default="codegen,accelerate,prefetch,gpu,copy")
    parser.add_argument("--quantize", default="", help="fp8, int4 or both, comma-separated")
    parser.add_argument("--quantize-budgets", default="0")
    parser.add_argument("--staging", default="", metavar="MiB,...",
                        help="each codegen row again with offload(staging=) of each size")
    parser.add_argument("--prefill-plan", action="store_true",
                        help="each codegen row again with offload(optimize_for='prefill')")
    parser.add_argument("--offload-from-gpu", action="store_true",
                        help="offload each model from the GPU it is built on (a faster "
                             "set-up; offload()'s own peak is then not measured)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        args.accelerate_budgets = [int(b) for b in args.accelerate_budgets.split(",")
                                   if b.strip()]
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        args.quantize_budgets = [int(b) for b in args.quantize_budgets.split(",") if b.strip()]
        args.staging = [int(b) for b in args.staging.split(",") if b.strip()]
    except ValueError:
        parser.error("--budgets, --accelerate-budgets, --tokens, --staging: comma-separated "
                     "integers")
    if any(not 0 <= b < 100 for b in args.budgets + args.accelerate_budgets):
        parser.error("budgets: percents in [0, 100)")
    if any(mib <= 0 for mib in args.staging):
        parser.error("--staging: sizes in MiB, each above 0")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(VARIANTS)}")
    args.quantize = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if any(q not in ("fp8", "int4") for q in args.quantize):
        parser.error("--quantize: fp8, int4 or both")
    return args


def row_names(args: argparse.Namespace) -> list[str]:
    """The rows, in set-up order: the GPU-resident model, codegen's budgets (with their
    copy floors right after), the prefetches, accelerate's budgets."""
    names = []
    if "gpu" in args.variants:
        names.append("gpu")
    for p in args.budgets:
        if "codegen" in args.variants or "copy" in args.variants:
            names.append(f"codegen_p{p}")
        if "copy" in args.variants:
            names.append(f"copy_p{p}")
    for kind in args.quantize:
        for p in args.quantize_budgets:
            names += [f"codegen_p{p}_{kind}", f"copy_p{p}_{kind}", f"dequant_p{p}_{kind}"]
    def again(suffix: str) -> list[str]:
        """The codegen rows (and their floors) again, named with ``suffix``."""
        rows = [f"{kind}_p{p}{suffix}" for p in args.budgets for kind in ("codegen", "copy")]
        return rows + [f"{kind}_p{p}_{q}{suffix}" for q in args.quantize
                       for p in args.quantize_budgets for kind in ("codegen", "copy", "dequant")]

    for mib in args.staging:  # the same rows again with that staging
        names += again(f"_s{mib}")
    if args.prefill_plan:  # the same rows again, planned for prefill
        names += again("_prefill")
    names += [v for v in PREFETCHES if v in args.variants]
    if "accelerate" in args.variants and importlib.util.find_spec("accelerate") is not None:
        names += [f"accelerate_p{p}" for p in args.accelerate_budgets]
    return names


def dry_run(args: argparse.Namespace) -> int:
    """Each budget's placement, from the model on the meta device."""
    config = config_8b(args.layers)
    model = build(config, device="meta")
    linears = [_resident(n, m) for n, m in offloadable(model)]
    total = sum(lay.nbytes for lay in linears)
    print(f"offloadable: {len(linears)} Linears, {format_bytes(total)}; rest of the model "
          f"{format_bytes(rest_bytes(model))}; rows: {', '.join(row_names(args))}")
    for plan_for in ("decode", "prefill") if args.prefill_plan else ("decode",):
        for p in args.budgets:  # the budget each row gives offload()
            budget, _ = budget_and_staging(model, p, None, plan_for == "prefill")
            if budget is None:  # every weight streamed, through the plan's default ring
                label, kept, ring = "no budget", frozenset(), default_staging(linears, plan_for)
            else:
                label = f"budget {format_bytes(budget)}"
                kept, ring = place(linears, budget, None, default_staging(linears, plan_for))
            resident = sum(linears[i].nbytes for i in kept)
            print(f"{p:3}%, for {plan_for}: {label}: {len(kept)} "
                  f"resident ({format_bytes(resident)}), ring {format_bytes(ring)}, streamed "
                  f"{format_bytes(total - resident)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import transformers

    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("offload_budget: needs a CUDA GPU (--dry-run does not)", file=sys.stderr)
        return 1
    global FROM_GPU
    FROM_GPU = args.offload_from_gpu
    config = config_8b(args.layers)
    notes: list[str] = []
    built: dict[str, Built] = {}
    started = time.perf_counter()
    for name in row_names(args):
        try:
            built[name] = make(name, config, built)
            facts = ", ".join(f"{k} {x:.1f}" if isinstance(x, float) else f"{k} {x}"
                              for k, x in built[name].facts.items())
            print(f"set up {name} ({time.perf_counter() - started:.0f} s): {facts}", flush=True)
        except Exception as e:  # the other rows are still worth the GPU time
            traceback.print_exc()
            notes.append(f"FAILED: {name} could not be set up: {type(e).__name__}: {e}")
    gc.collect()
    torch.manual_seed(SEED + 1)
    prompt = torch.randint(0, config.vocab_size, (1, DECODE_PROMPT), device="cuda")
    token = torch.randint(0, config.vocab_size, (1, 1), device="cuda")
    models = {v: b for v, b in built.items() if b.model is not None}
    if "gpu" in models:  # values: every model's logits against the GPU-resident model's
        reference = forward(models["gpu"].model, prompt[:, :64]).float()
        for b in models.values():
            logits = forward(b.model, prompt[:, :64]).float()
            b.facts["logits_error"] = ((logits - reference).abs().max()
                                       / reference.abs().max()).item()
    rows: list[dict[str, Any]] = []

    def save() -> None:
        """offload_budget.json as far as the run got (written after each step)."""
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload_budget.json").write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "layers": args.layers, "notes": notes, "rows": rows,
            "setup": {v: b.facts for v, b in built.items()},
            "placements": {v: codegen.nn.offload_plan(b.model).placement()
                           for v, b in built.items() if v.startswith("codegen")}},
            indent=1, default=str) + "\n")

    save()
    steps = [(t, "decode" if t == 1 else "prefill") for t in args.tokens]
    if args.last_logits:
        steps += [(t, "prefill_last") for t in args.tokens if t > 1]
    for tokens, step in steps:
        try:
            if step == "decode":
                calls = {v: b.call or DecodeStep(b.model, prompt, token)
                         for v, b in built.items()}
            else:
                torch.manual_seed(SEED + tokens)
                ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
                keep = 1 if step == "prefill_last" else 0
                calls = {v: b.call or bind(forward, b.model, ids, keep)
                         for v, b in built.items()}
            times = timed(calls, args.rounds)
            step_rows = rows_of(step, tokens, times, built)
            peaks = {v: peak_mib(calls[v]) for v in models}
            for r in step_rows:
                if r["variant"] in peaks and "gpu" in peaks:
                    r["forward_extra_mib"] = peaks[r["variant"]] - peaks["gpu"]
            rows += step_rows
            print(table(step_rows), flush=True)
            save()
        except Exception as e:  # keep the other steps' rows
            traceback.print_exc()
            notes.append(f"FAILED: the {tokens}-token step: {type(e).__name__}: {e}")
    if args.generate:
        try:
            times = {v: [] for v in models}
            for v in models:  # warm-up: torch's attention once at each length timed
                generate_ms(models[v].model, prompt, args.generate + 1)
            for r in range(max(1, args.rounds - 1)):
                for v in rotated(list(models), r):
                    one = generate_ms(models[v].model, prompt, 1)
                    times[v].append((generate_ms(models[v].model, prompt, args.generate + 1)
                                     - one) / args.generate)
            for v in [v for v in built if v.startswith(("copy", "dequant"))]:
                times[v] = [statistics.median(_call_ms(built[v].call) for _ in range(3))]
                times[v] *= len(next(iter(times.values())))
            gen_rows = rows_of("generate", args.generate, times, built)
            for r in gen_rows:
                r["tokens_per_s"] = 1e3 / r["ms"]
            rows += gen_rows
            print(table(gen_rows), flush=True)
        except Exception as e:
            traceback.print_exc()
            notes.append(f"FAILED: the generate step: {type(e).__name__}: {e}")
    print(table(rows))
    for v, b in built.items():
        if v.startswith("codegen"):
            print(f"{v}: " + ", ".join(f"{k} {x:.1f}" if isinstance(x, float) else f"{k} {x}"
                                       for k, x in b.facts.items()))
    for n in notes:
        print(n)
    save()
    return 1 if any(n.startswith("FAILED") for n in notes) else 0


def _call_ms(fn: Callable[[], Any], reps: int = 1) -> float:
    """ms per call of ``reps`` calls queued right behind an untimed lead-in call (a
    ``Block``), from a synchronized device: each timed call starts as in a loop of calls,
    the copies an offloaded forward queues at its end for the next one (into its staging)
    overlapping the previous call. Timed from an idle device instead, a call would find
    up to its whole staging copied before its start event, untimed: up to 10 ms of copies
    with a 512 MiB staging."""
    block = Block(fn, reps)
    torch.cuda.synchronize()
    block.run()
    torch.cuda.synchronize()
    return block.ms()


if __name__ == "__main__":
    sys.exit(main())
