"""A model, not a measurement: the copy engine and the compute stream of a 4096-token
prefill of the 8B-shaped model under a GPU budget, run on the copy plan that
``codegen.nn.offload`` makes (its placement, ring, spans, waits and frees), with rates
and per-kernel costs taken from the traces in ``benchmarks/RESULTS.md``. It separates what
the plan's structure costs (the ring filling under resident stretches and under the
forward's tail, copies arriving late) from what each extra GEMM piece and each wait for a
copy costs the GPU (the spacing between kernels the traces found), and asks, on the CPU,
what a change of copy size, ring or wait cost would give before a GPU is spent on it.
It is a lower bound, not a forecast: it came out 1-3% short of every measured prefill
(``benchmarks/RESULTS.md``, "A model of the two engines").

The model: the copy engine runs the plan's spans in order, lap after lap, each at
``--copy-gbps`` once the readers it waits for (``Span.waits``) have run. The compute
stream runs a layer's Linears in the forward's order, with the layer's other kernels
between them (``--attention-ms`` before o_proj, ``--other-ms`` spread over the rest), a
resident Linear's GEMM at the GPU-resident rate (``--gemm-ms`` for every decoder Linear),
and a streamed one's pieces, each after its span's copy. Each stream wait (once a span)
adds ``--wait-us`` after the later of the copy and the kernel before, each GEMM piece
beyond one a Linear ``--piece-us``; the tail (the final norm and lm_head, all positions'
logits) takes ``--tail-ms`` and reads nothing streamed. The copies run at one rate
throughout (no slowdown under GEMMs) and the kernels never idle but where the model says.
Printed per budget: the modelled forward (the second of three laps), its copy floor, the
GPU-resident forward's kernels (the same model with nothing streamed), and the ratio to
the larger, with the structure alone (no per-kernel costs) beside it.

    python -m benchmarks.probes.budget_model [--budgets 0,25,50,75] [--copy-mib 32,64]
                                             [--staging-mib 0,416] [--wait-us 21,5]

Defaults: an H100's kernel times from the GPU-resident model's traced 4096-token prefill
(its GEMMs 80.3 ms, of which lm_head about 5.6; its other kernels 46.3 ms: so 74.7 ms of
decoder GEMMs, 1.44 ms of other kernels a layer, of which attention about 0.7, a 5.7 ms
tail; 126.6 ms of kernels, against 128.7 ms for the forward), copies at 55.2 GB/s (the
50% row's copy floor), a wait 21 µs and an extra GEMM piece 6.6 µs (the gaps the traces
found after a wait and between a call's pieces).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Any

import torch

from benchmarks.common import budget_of
from codegen.nn.offload import default_copy_bytes, default_staging
from codegen.nn.plan import ALIGN, Layout, Resident, StreamPlan, place, plan_stream, round_up

MIB = 2**20
# The 8B-shaped model's decoder Linears, in the order a layer calls them.
SHAPES = (("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096),
          ("o_proj", 4096, 4096), ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096),
          ("down_proj", 4096, 14336))


@dataclasses.dataclass(frozen=True)
class Rates:
    copy_gbps: float = 55.2  # the copy floor's rate
    gemm_ms: float = 74.7  # the GPU-resident forward's decoder GEMMs, all layers
    attention_ms: float = 0.7  # a layer's attention kernels, before o_proj
    other_ms: float = 0.74  # a layer's other kernels (norms, rope, activation)
    tail_ms: float = 5.7  # the final norm and lm_head over every position
    wait_us: float = 21.0  # a stream wait for a copy, after the later of it and the kernel
    piece_us: float = 6.6  # each GEMM piece beyond a Linear's first
    wait_per_call: bool = False  # a call waits once, for its last span, before its first


def linears(layers: int = 32) -> list[Resident]:
    return [Resident(f"model.layers.{i}.{name}", torch.bfloat16, out, inp, False)
            for i in range(layers) for name, out, inp in SHAPES]


def offload_plan(lins: list[Resident], percent: int, staging: int | None,
                 copy_bytes: int | None) -> tuple[StreamPlan, frozenset[int]]:
    """The copy plan ``codegen.nn.offload`` makes for ``lins`` under ``percent`` of their
    bytes as ``gpu_budget`` (0: the default staging alone), as ``benchmarks.common``
    sizes the budget rows."""
    if staging and not percent:  # a staging of its own and no budget: everything streamed
        kept, ring = frozenset(), staging
    else:
        kept, ring = place(lins, budget_of(lins, percent), staging, default_staging(lins))
    streamed = [lay for i, lay in enumerate(lins) if i not in kept]
    layouts, at = [], 0
    for lay in streamed:
        layouts.append(Layout(lay.name, lay.dtype, lay.out_features, lay.in_features, at, None))
        at = round_up(at + lay.weight_bytes, ALIGN)
    # offload's copy size: four copies in the ring, two in a staging given without a budget
    copy = copy_bytes or default_copy_bytes(ring, max(lay.row_bytes for lay in layouts),
                                            2 if staging and not percent else 4)
    return plan_stream(layouts, list(range(len(layouts))), ring, copy, 0), kept


def simulate(lins: list[Resident], plan: StreamPlan, kept: frozenset[int], rates: Rates,
             laps: int = 3, record: dict[str, Any] | None = None) -> float:
    """The modelled milliseconds of the middle forward of ``laps`` back to back (the
    steady state). ``record``, where given, receives each copy's (start, end) by (span,
    lap) as ``copies``, each GEMM piece's (start, end) by the (span, lap) it reads as
    ``reads``, and when each (span, lap)'s last reader ended as ``freed``."""
    per_byte = rates.gemm_ms / sum(lay.weight_bytes for lay in lins)
    copy_ms = 1e-6 / rates.copy_gbps  # per byte
    n = len(plan.spans)
    streamed = iter(plan.calls)
    calls = {}  # Linear index in ``lins`` -> its call
    for i in range(len(lins)):
        if i not in kept:
            calls[i] = next(streamed)
    freed: dict[tuple[int, int], float] = {}  # (span, lap) -> when its last reader ended
    copied: list[float] = []  # the end of each copy, lap * n + span

    def copy_end(index: int) -> float:
        while len(copied) <= index:
            lap, j = divmod(len(copied), n)
            start = copied[-1] if copied else 0.0
            for k, d in plan.spans[j].waits:
                if lap + d < 0:
                    continue  # a lap before the first: nothing to wait for
                if (k, lap + d) not in freed:
                    raise ValueError(
                        f"budget_model: the copy of span {j} (lap {lap}) waits for the "
                        f"reads of span {k} (lap {lap + d}), which come after it in the "
                        "forward: this plan cannot run so (the streamer raises too)")
                start = max(start, freed[(k, lap + d)])
            copied.append(start + plan.spans[j].nbytes * copy_ms)
            if record is not None:
                record.setdefault("copies", {})[(j, lap)] = (start, copied[-1])
        return copied[index]

    clock, begin, end = 0.0, 0.0, 0.0
    per_layer = len(SHAPES)
    for lap in range(laps):
        if lap == laps // 2:
            begin = clock
        waited = -1
        for i, lay in enumerate(lins):
            name = SHAPES[i % per_layer][0]
            clock += (rates.attention_ms if name == "o_proj" else
                      rates.other_ms / (per_layer - 1))
            gemm = lay.weight_bytes * per_byte
            if i in kept:
                clock += gemm
                continue
            call = calls[i]
            if rates.wait_per_call:  # one wait, for the call's last span, before its first
                index = lap * n + call.pieces[-1].span
                if index > waited:
                    clock = max(clock, copy_end(index)) + rates.wait_us / 1e3
                    waited = index
            for p, piece in enumerate(call.pieces):
                index = lap * n + piece.span
                if index > waited:  # a stream waits once for a span (and those before it)
                    clock = max(clock, copy_end(index)) + rates.wait_us / 1e3
                    waited = index
                if p:
                    clock += rates.piece_us / 1e3
                began = clock
                clock += gemm * (piece.rows[1] - piece.rows[0]) / lay.out_features
                if record is not None:
                    record.setdefault("reads", {}).setdefault((piece.span, lap), []).append(
                        (began, clock))
                for j in piece.frees:
                    freed[(j, lap)] = clock
        clock += rates.tail_ms
        if lap == laps // 2:
            end = clock
    if record is not None:
        record["freed"] = freed
    return end - begin


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.budget_model")
    parser.add_argument("--budgets", default="0,25,50,75")
    parser.add_argument("--copy-mib", default="0", help="copy sizes (0: offload's)")
    parser.add_argument("--staging-mib", default="0", help="stagings (0: the budget's)")
    parser.add_argument("--wait-us", default=str(Rates.wait_us))
    parser.add_argument("--piece-us", type=float, default=Rates.piece_us)
    parser.add_argument("--copy-gbps", type=float, default=Rates.copy_gbps)
    parser.add_argument("--gemm-ms", type=float, default=Rates.gemm_ms)
    parser.add_argument("--attention-ms", type=float, default=Rates.attention_ms)
    parser.add_argument("--other-ms", type=float, default=Rates.other_ms)
    parser.add_argument("--tail-ms", type=float, default=Rates.tail_ms)
    parser.add_argument("--wait-per-call", action="store_true",
                        help="each call waits once, for its last span, before its first GEMM")
    args = parser.parse_args()
    lins = linears()
    base = Rates(copy_gbps=args.copy_gbps, gemm_ms=args.gemm_ms,
                 attention_ms=args.attention_ms, other_ms=args.other_ms,
                 tail_ms=args.tail_ms, piece_us=args.piece_us,
                 wait_per_call=args.wait_per_call)
    gpu = base.gemm_ms + len(lins) // len(SHAPES) * (base.attention_ms + base.other_ms) + (
        base.tail_ms)
    print("budget  copy  ring   pieces waits   floor    GPU  structure  modelled  ratio")
    for percent, copy_mib, staging_mib in itertools.product(
            *([int(v) for v in arg.split(",")]
              for arg in (args.budgets, args.copy_mib, args.staging_mib))):
        plan, kept = offload_plan(lins, percent, staging_mib * MIB or None,
                                  copy_mib * MIB or None)
        floor = plan.streamed_bytes / (args.copy_gbps * 1e6)
        bare = simulate(lins, plan, kept, dataclasses.replace(base, wait_us=0.0, piece_us=0.0))
        pieces = sum(len(c.pieces) for c in plan.calls)
        for wait in (float(w) for w in args.wait_us.split(",")):
            got = simulate(lins, plan, kept, dataclasses.replace(base, wait_us=wait))
            print(f"{percent:>5}% {plan.copy_bytes / MIB:>4.0f} {plan.ring_bytes / MIB:>5.0f}  "
                  f"{pieces:>6} {wait:>5.0f}µs {floor:>7.2f} {gpu:>6.2f} {bare:>9.2f} "
                  f"{got:>9.2f}  {got / max(floor, gpu):.3f}x")

if __name__ == "__main__":
    main()
