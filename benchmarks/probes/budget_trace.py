"""Where do the copy engine and the compute stream wait in a long prefill of the 8B-shaped
model under a GPU budget?

For each ``--configs`` entry (``p<percent>`` of the offloadable bytes as ``gpu_budget``,
then optionally ``_fp8`` / ``_int4``, ``_s<MiB>`` of staging and ``_prefill``
(``optimize_for="prefill"``), as ``offload_budget`` names its rows, and ``_c<MiB>``, the
copy size; ``gpu``: the model not offloaded, every
weight on the GPU, to compare with) the model is offloaded and three prefills
of ``--tokens`` run back to back under the profiler. A marker kernel on the compute stream
opens each forward and another its tail (the final norm and lm_head), and the attention
kernels count the decoder layers, so every idle stretch of either engine is placed: before
layer 0 (head), in the layers, or in the tail. Printed per config: the forward's GPU time
untraced and the report's copy floor, and the host's time per forward (three queued back
to back: the GPU's time where something in a forward waits for the GPU, as it did on an
H100 with transformers 5); then, for the middle traced forward, each engine's busy and
idle time by part, and the longest idle stretches with the layer they fell in. The compute
stream's idle time is split into waits for a copy (a copy ended inside the stretch) and
spacing between kernels (none did: events, waits and launches), and the spacing by when
the host queued the kernel after each stretch (``launched``). Before the trace, the calls
in a forward that synchronize with the GPU (torch's sync debug mode), by source line.

``--conditions`` times the prefill under each named condition, interleaved over
``--rounds`` (the order rotated each round, medians printed, then each condition's logits
against ``as_is``'s: the share that is finite and the largest difference): ``as_is``;
``no_wait_probes``, without the timing events around each wait for a copy (the report's
``exposed_copy_ms``); ``wait_per_piece``, the caller's stream waiting for its span at
every GEMM piece (a quantized prefill's every dequantization: each run, or with
``+dequant_pieces`` each piece), as the streamer did before it waited once for each span
a forward;
``merged``, every call's pieces merged into a GEMM per run back to back in the ring, as
a call of few rows runs; ``gemm_per_piece``, a quantized call of many rows dequantizing
each piece into rows of its own and running a GEMM on them (instead of one GEMM per
scratch weight); ``dequant_pieces``, each piece of a scratch dequantized after its own
copy (instead of each run of pieces back to back in the ring at once, after the run's
last copy: one wait and one kernel a piece);
for timing only, what the ordering costs: ``unordered``, no waits between the streams at
all, ``unordered_reads``, no waits of the GEMMs for their copies, ``unordered_copies``, no
waits of the copies for the reads of the bytes they overwrite (the logits are wrong);
``whole_weights``, the copy plan with spans that hold whole
weights where they fit (``plan_stream(..., whole_weights=True)``: only weights larger than
a copy are cut, so fewer GEMM pieces, against spans packed to the copy size across
weights).
``--trace`` names the conditions the traced prefills run under (``as_is``; each traced
and broken down in turn). With ``--tokens 4096,1`` each config is timed at each token
count (a one-token forward streams as a decode step does); the trace is of the first.

    python -m benchmarks.probes.budget_trace [--layers 32] [--tokens 4096,1]
                                             [--configs p50,p0_fp8,p0_fp8_s208_c64]
                                             [--conditions as_is,no_wait_probes] [--rounds 4]
                                             [--trace as_is,unordered_copies]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import gc
import math
import re
import statistics
import time
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import codegen.nn
import codegen.nn.streamer as streamer_module
from benchmarks.common import ROW, budget_and_staging, build, config_8b, is_decoder_linear
from codegen.nn.plan import plan_stream
from codegen.nn.streamer import MERGED_ROWS

MARK_CYCLES = 1000  # the marker kernel's spin: about a microsecond
IDLE_US = 3.0  # gaps shorter than this are launch spacing, not waiting


def offloaded(config: str, layers: int) -> torch.nn.Module:
    """The 8B-shaped model (``layers`` decoder layers) offloaded as ``config`` names it
    (``gpu``: not offloaded, every weight on the GPU)."""
    if config == "gpu":
        return build(config_8b(layers))
    row, _, copy_mib = config.partition("_c")
    match = re.fullmatch(ROW, f"codegen_{row}")
    if not match or (copy_mib and not copy_mib.isdigit()):
        raise SystemExit(f"budget_trace: config {config!r} is not p<percent>[_fp8|_int4]"
                         "[_s<MiB>][_prefill][_c<MiB>]")
    percent, quantize, staging_mib, plan_for = int(match[2]), match[3], match[4], match[5]
    model = build(config_8b(layers))
    budget, staging = budget_and_staging(model, percent, staging_mib and int(staging_mib),
                                         plan_for == "prefill")
    return codegen.nn.offload(model, filter=is_decoder_linear, gpu_budget=budget,
                              quantize=quantize, staging=staging,
                              optimize_for=plan_for or "decode",
                              copy_size=int(copy_mib) * 2**20 if copy_mib else None)


CONDITIONS = ("as_is", "no_wait_probes", "wait_per_piece", "whole_weights", "merged",
              "gemm_per_piece", "dequant_pieces", "unordered", "unordered_copies",
              "unordered_reads")


def condition(model: torch.nn.Module, name: str) -> None:
    """Puts the offloaded model's streamer in condition ``name`` (see the docstring;
    conditions joined by ``+`` apply together)."""
    names = name.split("+")
    streamer = model._codegen_offload.streamer
    plans = streamer.__dict__.setdefault("probe_plans", {"packed": streamer.plan})
    if "whole" not in plans:
        plan = plans["packed"]
        plans["whole"] = dataclasses.replace(
            plan_stream(plan.layouts, plan.order, plan.ring_bytes, plan.copy_bytes,
                        plan.bias_bytes, whole_weights=True),
            resident=plan.resident, budget=plan.budget, copy_gbps=plan.copy_gbps)
    plan = plans["whole" if "whole_weights" in names else "packed"]
    if streamer.plan is not plan:  # as a new call order is learnt: the copies start over
        streamer._restart(streamer.backend.current())
        streamer._set_plan(plan)
    streamer.probe_waits = "no_wait_probes" not in names
    streamer.scratch_gemms = "gemm_per_piece" not in names
    streamer.dequant_runs = "dequant_pieces" not in names
    streamer.__dict__.pop("_await_copies", None)
    streamer.backend.__dict__.pop("wait", None)
    streamer_module.MERGED_ROWS = 1 << 30 if "merged" in names else MERGED_ROWS
    # Timing only: reads race their copies (or copies the reads they overwrite), so the
    # values are wrong.
    if "unordered" in names or "unordered_reads" in names:
        def queued(stream: object, spans: list[int]) -> None:  # queued, not waited for
            if streamer.issued <= streamer.lap * len(streamer.plan.spans) + max(spans):
                streamer._pump()
        streamer._await_copies = queued
    if "unordered" in names or "unordered_copies" in names:
        wait, copies = type(streamer.backend).wait, streamer.backend.copy_stream
        streamer.backend.wait = lambda stream, event: (
            None if stream is copies else wait(streamer.backend, stream, event))
    if "wait_per_piece" in names:
        await_copies = type(streamer)._await_copies

        def each(stream: object, spans: object) -> None:
            streamer.waited = None  # nothing waited for yet: every piece waits
            await_copies(streamer, stream, spans)
        streamer._await_copies = each


def timed(model: torch.nn.Module, ids: torch.Tensor, forwards: int = 3) -> float:
    """GPU ms per forward of ``forwards`` prefills queued back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(forwards):
        model(ids, use_cache=False)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / forwards


def compare(model: torch.nn.Module, ids: torch.Tensor, names: list[str], rounds: int) -> None:
    """Each condition's prefill, interleaved over ``rounds`` (order rotated); then, per
    condition, its logits against ``as_is``'s (a timing-only condition reads wrong bytes:
    where they make non-finite values, the GEMMs' timing may be the data's, not the
    ordering's)."""
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            condition(model, name)
            model(ids, use_cache=False)  # the lead-in: the next forward's first spans queued
            results[name].append(timed(model, ids))
    checks, reference = {}, None
    for name in ["as_is"] + [n for n in names if n != "as_is"]:
        condition(model, name)
        model(ids, use_cache=False)
        logits = model(ids, use_cache=False).logits.float()
        reference = logits if reference is None else reference  # as_is's
        checks[name] = (torch.isfinite(logits).float().mean().item(),
                        (logits - reference).abs().max().item())
        del logits
    condition(model, "as_is")
    base = statistics.median(results[names[0]])
    print(f"  interleaved, {rounds} rounds: " + "; ".join(
        f"{n} {statistics.median(v):.2f} ms ({statistics.median(v) / base:.3f}x)"
        for n, v in results.items()))
    print("  logits: " + "; ".join(f"{n} {finite:.1%} finite, max |diff| {diff:.3g}"
                                   for n, (finite, diff) in checks.items()))


def mark() -> None:
    torch.cuda._sleep(MARK_CYCLES)


def idle(events: list, start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end) in which none of ``events`` (sorted by start) ran."""
    out, at = [], start
    for e in events:
        s, t = e.time_range.start, e.time_range.end
        if t <= at or s >= end:
            continue
        if s - at > IDLE_US:
            out.append((at, s))
        at = max(at, t)
    if end - at > IDLE_US:
        out.append((at, end))
    return out


def stretches(gaps: list[tuple[float, float]]) -> str:
    """``gaps``' count and total and mean length."""
    total = sum(b - a for a, b in gaps)
    return (f"{len(gaps)} stretches, {total / 1e3:.2f} ms"
            + (f" (mean {total / len(gaps):.1f} µs)" if gaps else ""))


def part(t: float, tail: float, attention: list[float]) -> str:
    """Where time ``t`` falls in a forward whose tail starts at ``tail`` and whose
    attention kernels start at ``attention``."""
    if t >= tail:
        return "tail"
    layer = sum(a <= t for a in attention) - 1
    return "head" if layer < 0 else f"layer {layer}"


def synchronizing_calls(model: torch.nn.Module, ids: torch.Tensor) -> str:
    """The calls in one forward that make the host wait for the GPU (torch's sync debug
    mode), by source line. (How far ahead of the GPU the host queues is ``launched``'s.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(ids, use_cache=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    lines = collections.Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message).lower())
    return (f"synchronizing calls a forward: {sum(lines.values())}"
            + (" (" + ", ".join(f"{k} x{v}" for k, v in lines.most_common(4)) + ")"
               if lines else ""))


def launched(prof: Any, stream: int, spacing: set[tuple[float, float]]) -> str:
    """The compute stream's spacing between kernels (``spacing``: its idle stretches in
    which no copy ended) split by when the host queued the kernel after each: *host late*
    where its launch returned after the stream ran dry (the host was behind the GPU),
    otherwise by what the host queued on any stream between the two kernels' launches: a
    stream wait, an event record, or nothing."""
    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns()
    launch: dict[int, tuple[float, float]] = {}
    calls: list[tuple[float, str]] = []
    kernels: dict[float, tuple[int, str]] = {}
    for e in results.events():
        name, on_gpu = e.name(), e.device_type() == torch.autograd.DeviceType.CUDA
        if not on_gpu and e.correlation_id() and name.startswith("cu"):  # a CUDA API call
            at = ((e.start_ns() - t0) / 1e3, (e.start_ns() + e.duration_ns() - t0) / 1e3)
            launch[e.correlation_id()] = at
            calls.append((at[0], name))
        elif on_gpu and "Memcpy" not in name and "Memset" not in name:
            kernels[round((e.start_ns() - t0) / 1e3, 1)] = (e.correlation_id(), e.name())
    if not launch:
        return "    launches: the trace has no host-side CUDA calls"
    calls.sort()
    starts = sorted(kernels)
    split: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    after: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lead: dict[str, list[float]] = collections.defaultdict(list)
    for a, b in sorted(spacing):
        i = bisect.bisect_left(starts, round(b, 1) - 0.15)
        if i == len(starts) or abs(starts[i] - b) > 0.5:
            split["kernel not matched"].append((a, b))
            continue
        correlation, name = kernels[starts[i]]
        prior = kernels[starts[i - 1]][0] if i else None
        mine, before = launch.get(correlation), launch.get(prior) if prior else None
        if mine is None:
            kind = "launch not traced"
        elif mine[1] > a:
            kind = "host late"
        else:
            lo = before[0] if before else mine[0] - 50.0
            between = [n for t, n in calls[bisect.bisect_right(calls, (lo, "")):
                                           bisect.bisect_left(calls, (mine[0], ""))]]
            kind = ("after a stream wait" if any("WaitEvent" in n for n in between) else
                    "after an event record" if any("EventRecord" in n for n in between)
                    else "queued back to back")
        split[kind].append((a, b))
        after[kind][name[:40]] += 1
        if mine is not None:
            lead[kind].append(a - mine[1])
    return "\n".join(
        f"    spacing {kind}: {stretches(g)}; the launch returned a median "
        f"{statistics.median(lead[kind]) if lead[kind] else math.nan:.1f} µs before the "
        "stream ran dry; before " + ", ".join(
            f"{n} x{c}" for n, c in after[kind].most_common(3))
        for kind, g in sorted(split.items(), key=lambda kv: -sum(b - a for a, b in kv[1])))


def trace(model: torch.nn.Module, ids: torch.Tensor, label: str) -> None:
    """Three prefills of ``ids`` under the profiler; the middle one's idle time by engine
    and part of the forward (see the module docstring), headed by ``label``."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(ids, use_cache=False)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    copies = [e for e in events if "HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    marks = [e.time_range.start for e in kernels if "sleep" in e.name.lower()
             or "spin" in e.name.lower()]
    if len(marks) < 6:
        print(f"  {len(marks)} marker kernels found, expected 6: no breakdown")
        return
    # The middle forward: from its opening marker to the next forward's.
    begin, tail, finish = marks[2], marks[3], marks[4]
    attention = [e.time_range.start for e in kernels if "sdpa" in e.name.lower()
                 or "flash" in e.name.lower() or "attention" in e.name.lower()]
    attention = [t for t in attention if begin <= t < tail]

    streams: dict[int, int] = {}
    for e in kernels:
        streams[e.thread] = streams.get(e.thread, 0) + 1
    compute = max(streams, key=streams.get)  # type: ignore[arg-type]
    engines = {"copy engine": copies,
               "compute stream": [e for e in kernels if e.thread == compute]}
    print(f"  traced middle forward{label and f' ({label})'}: {(finish - begin) / 1e3:.2f} ms, "
          f"{len(attention)} attention kernels")
    for name, evs in engines.items():
        gaps = idle(evs, begin, finish)
        by = {"head": 0.0, "layers": 0.0, "tail": 0.0}
        for a, b in gaps:
            where = part(a, tail, attention)
            by["layers" if where.startswith("layer") else where] += (b - a) / 1e3
        busy = (finish - begin) / 1e3 - sum(by.values())
        print(f"  {name}: busy {busy:.2f} ms, idle " + ", ".join(
            f"{k} {v:.2f}" for k, v in by.items()) + " ms")
        if name == "compute stream":
            kinds = {"GEMMs": 0.0, "dequantization": 0.0, "other": 0.0}
            count = {k: 0 for k in kinds}
            for e in evs:
                if begin <= e.time_range.start < finish:
                    low = e.name.lower()
                    kind = ("dequantization" if "_rows" in low else "GEMMs" if any(
                        k in low for k in ("nvjet", "gemm", "cutlass")) else "other")
                    kinds[kind] += e.time_range.elapsed_us() / 1e3
                    count[kind] += 1
            print("    kernels: " + ", ".join(f"{k} {v:.2f} ms ({count[k]})"
                                              for k, v in kinds.items()))
            ends = sorted(e.time_range.end for e in copies)
            waited = [(a, b) for a, b in gaps
                      if bisect.bisect_right(ends, b) > bisect.bisect_left(ends, a)]
            spacing = [g for g in gaps if g not in waited]
            print("    of which waiting for a copy: " + stretches(waited)
                  + "; spacing between kernels: " + stretches(spacing))
            print(launched(prof, compute, set(spacing)))
        for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:6]:
            after = next((e.name[:48] for e in kernels if e.time_range.start >= b), "")
            print(f"    {b - a:7.0f} µs idle in {part(a, tail, attention)}, then {after}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.budget_trace")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", default="4096", help="token counts, comma-separated")
    parser.add_argument("--configs", default="p50,p0_fp8,p25")
    parser.add_argument("--conditions", default="",
                        help=f"comma-separated, of {', '.join(CONDITIONS)}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trace", default="as_is",
                        help="the conditions to trace a prefill under, comma-separated")
    args = parser.parse_args()
    names = [n for n in args.conditions.split(",") if n]
    traced = [n for n in args.trace.split(",") if n]
    if unknown := [p for n in names + traced for p in n.split("+") if p not in CONDITIONS]:
        raise SystemExit(f"budget_trace: unknown conditions {unknown}; known: {CONDITIONS}")
    if not torch.cuda.is_available():
        raise SystemExit("budget_trace needs a CUDA GPU")
    counts = [int(t) for t in args.tokens.split(",")]
    ids = torch.randint(0, 32000, (1, counts[0]), device="cuda")
    for config in args.configs.split(","):
        model = offloaded(config, args.layers)
        hooks = [model.register_forward_pre_hook(lambda *a: mark()),
                 model.model.norm.register_forward_pre_hook(lambda *a: mark())]
        with torch.no_grad():
            for _ in range(2):
                model(ids, use_cache=False)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            host = time.perf_counter()
            for _ in range(3):
                model(ids, use_cache=False)
            host_ms = (time.perf_counter() - host) * 1e3 / 3
            end.record()
            torch.cuda.synchronize()
            forward_ms = start.elapsed_time(end) / 3
            if config == "gpu":
                print(f"{config}, {counts[0]} tokens: forward {forward_ms:.2f} ms untraced; "
                      f"host {host_ms:.2f} ms a forward")
            else:
                report = codegen.nn.report(model)
                plan = codegen.nn.offload_plan(model)
                print(f"{config}, {counts[0]} tokens: forward {forward_ms:.2f} ms untraced, "
                      f"copy floor {report.copy_floor_ms:.2f} ms "
                      f"({forward_ms / report.copy_floor_ms:.3f}x); host {host_ms:.2f} ms a "
                      f"forward; resident {plan.resident_bytes / 2**20:.0f} MiB, streamed "
                      f"{plan.streamed_bytes / 2**20:.0f} MiB, staging "
                      f"{plan.staging_bytes / 2**20:.0f} MiB")
            print("  " + synchronizing_calls(model, ids))
            if names and config != "gpu":
                compare(model, ids, names, args.rounds)
                for tokens in counts[1:]:
                    more = torch.randint(0, 32000, (1, tokens), device="cuda")
                    model(more, use_cache=False)
                    print(f"  {tokens} tokens:", end="")
                    compare(model, more, names, args.rounds)
                model(ids, use_cache=False)
            for name in traced if config != "gpu" else [""]:
                if name:
                    condition(model, name)
                    model(ids, use_cache=False)  # the lead-in
                trace(model, ids, name)
            if config != "gpu":
                condition(model, "as_is")
        for h in hooks:
            h.remove()
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
