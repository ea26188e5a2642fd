"""Where does the copy engine wait in a forward of the offloaded 4-layer Llama?

Traces three forwards back to back (prefills of ``--tokens``) of the model offloaded with
each ``--configs`` entry (``default``, ``staging=<size>``, ``copy=<size>``, or both
joined by ``+``) with the profiler and takes the host-to-device copies in start order:
their total time, the copy-engine time between the first and the last, the idle gaps
between consecutive copies (total, count over 20 µs) and the largest ones with the
kernels that started in them; then, untraced, the GPU time of a forward, the host time
to queue one, and the report's time the compute waited for copies. The time beyond the
copy floor is then either copies waiting (gaps) or compute after the last copy.

    python -m benchmarks.probes.offload_copy_gaps [--tokens 4096] [--configs default,...]
                                                  [--generate N]

With ``--generate N`` it times greedy ``generate`` of N tokens after a 512-token prompt
instead, per token, with the host time of each forward (wall clock from the model's
forward pre-hook to its hook) and the last forward's report.
"""

from __future__ import annotations

import argparse
import collections
import gc
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import codegen.nn
from benchmarks.common import (
    build,
    generate_ms,
    is_decoder_linear,
    llama_config,
    python_profile,
)


def offloaded(config: str) -> torch.nn.Module:
    """The benchmark's model offloaded with ``config``'s keywords."""
    kwargs = {}
    for part in config.split("+"):
        if part != "default":
            key, value = part.split("=")
            kwargs[{"staging": "staging", "copy": "copy_size"}[key]] = value
    return codegen.nn.offload(build(llama_config()), filter=is_decoder_linear, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.offload_copy_gaps")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--configs", default="default,staging=1700MiB,copy=64MiB")
    parser.add_argument("--generate", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_copy_gaps needs a CUDA GPU")
    if args.generate:
        for config in args.configs.split(","):
            generate(offloaded(config), config, args.generate)
        return
    ids = torch.randint(0, 32000, (1, args.tokens), device="cuda")
    for config in args.configs.split(","):
        model = offloaded(config)
        with torch.no_grad():
            for _ in range(2):
                model(ids, use_cache=False)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(ids, use_cache=False)
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, use_cache=False)
            host_ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
        r = codegen.nn.report(model)
        copies = sorted((e for e in prof.events() if "HtoD" in e.name),
                        key=lambda e: e.time_range.start)
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                          and "Memcpy" not in e.name), key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in copies)
        span = copies[-1].time_range.end - copies[0].time_range.start
        gaps = []
        for a, b in zip(copies, copies[1:]):
            gap = b.time_range.start - a.time_range.end
            if gap > 0:
                gaps.append((gap, a, b))
        print(f"{config}, {args.tokens} tokens: forward {r.forward_ms:.2f} ms (floor "
              f"{r.copy_floor_ms:.2f}), host queues it in {host_ms:.2f} ms, compute waited "
              f"{r.exposed_copy_ms:.2f} ms for copies; {r.copies} copies, staging "
              f"{r.staging_bytes / 2**20:.0f} MiB")
        print(f"  traced: {len(copies)} copies, busy {busy / 1e3:.2f} ms over a span of "
              f"{span / 1e3:.2f} ms; gaps {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in "
              f"total, {sum(g > 20 for g, _, _ in gaps)} over 20 µs")
        for gap, a, b in sorted(gaps, key=lambda g: -g[0])[:8]:
            between = [k.name[:50] for k in kernels
                       if a.time_range.end <= k.time_range.start < b.time_range.start][:3]
            print(f"  {gap:7.0f} µs after a copy of {a.time_range.elapsed_us():.0f} µs; "
                  f"kernels starting then: {between}")
        del model
        torch.cuda.empty_cache()


def conditions(model: torch.nn.Module, prompt: torch.Tensor, host: list[float],
               n: int, rounds: int = 4) -> None:
    """Greedy generate's ms per token (``n`` tokens over 1) and host per forward under
    each condition, interleaved over ``rounds``: as is; without the timing events around
    each wait for a copy; with Python's garbage collector off; with every object alive
    before the run frozen (``gc.freeze``: the collections then scan only what the run
    makes); without an attention mask (transformers then builds none). Each garbage
    collection's pause in the timed generates is recorded (``gc.callbacks``)."""
    streamer = model._codegen_offload.streamer
    collections_ms: dict[str, list[tuple[int, float]]] = {}  # condition -> (generation, ms)
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:  # gc.callbacks: each collection's pause
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and current:
            collections_ms.setdefault(current[0], []).append(
                (info["generation"], (time.perf_counter() - started[0]) * 1e3))
    current: list[str] = []

    def run(name: str) -> tuple[float, list[float]]:
        mask = name != "no mask"
        streamer.probe_waits = name != "no wait probes"
        if name == "gc off":
            gc.disable()
        if name == "gc frozen":  # every object alive now out of the collections' reach
            gc.freeze()
        try:
            one = generate_ms(model, prompt, 1, mask)
            host.clear()
            current[:] = [name]
            ms = (generate_ms(model, prompt, n + 1, mask) - one) / n
            current.clear()
            return ms, list(host)
        finally:
            current.clear()
            gc.enable()
            gc.unfreeze()
            streamer.probe_waits = True

    gc.callbacks.append(on_gc)

    names = ["as is", "no wait probes", "gc off", "gc frozen", "no mask"]
    results: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in names}
    order: list[tuple[str, float]] = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(run(name))
            order.append((name, results[name][-1][0]))
    gc.callbacks.remove(on_gc)
    for name in names:
        ms = sorted(m for m, _ in results[name])
        hosts = [h * 1e3 for _, hs in results[name] for h in hs[2:]]
        pauses = collections_ms.get(name, [])
        print(f"  condition {name:15}: {ms[len(ms) // 2]:.2f} ms per token (of "
              f"{', '.join(f'{m:.1f}' for m in ms)}); host per decode forward median "
              f"{sorted(hosts)[len(hosts) // 2]:.1f} ms, max {max(hosts):.1f} ms; "
              f"{len(pauses)} garbage collections in the timed generates, by generation "
              f"{[sum(1 for g, _ in pauses if g == k) for k in range(3)]}, the longest "
              f"{max((t for _, t in pauses), default=0):.1f} ms, "
              f"{sum(t for _, t in pauses):.1f} ms in all")
    print(f"  rounds in order: {[(k, round(m, 1)) for k, m in order]}")


def generate(model: torch.nn.Module, config: str, n: int) -> None:
    """Greedy generate of ``n`` tokens after a 512-token prompt: ms per token, the host
    time of each forward, the last forward's report, and the copy engine's gaps."""
    prompt = torch.randint(0, 32000, (1, 512), device="cuda")
    host: list[float] = []
    model.register_forward_pre_hook(lambda *a: host.append(time.perf_counter()))
    model.register_forward_hook(lambda *a: host.append(time.perf_counter() - host.pop()))

    def run(tokens: int) -> float:
        return generate_ms(model, prompt, tokens)

    run(2)
    # The first generate of n + 1 tokens (every length past the warm-up's new), profiled:
    # where its host time goes, and each forward's.
    host.clear()
    first, table = python_profile(lambda: run(n + 1), rows=14)
    print(f"  first generate of {n + 1} tokens: {first:.1f} ms; host per forward "
          f"{', '.join(f'{h * 1e3:.1f}' for h in host)} ms")
    print(table)
    host.clear()
    again = run(n + 1)
    print(f"  the same again: {again:.1f} ms; host per forward "
          f"{', '.join(f'{h * 1e3:.1f}' for h in host)} ms")
    conditions(model, prompt, host, n)
    # Where generate synchronizes the host with the GPU: a synchronizing call inside a
    # forward holds the host until the GPU gets there, and the copies past the ring's
    # first spans, which the host queues, wait for it (torch's sync debug mode warns at
    # each such call; counted by the Python line that made it).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(4)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print(f"  synchronizing calls in generate(4): {sum(where.values())}, by line: "
          + ", ".join(f"{k} x{c}" for k, c in where.most_common(12)))
    # Where in a forward the host's time goes: before the first decoder layer, the layers
    # and lm_head, after lm_head (each a wall-clock stamp from a hook).
    stamps: list[float] = []
    handles = [model.register_forward_pre_hook(lambda *a: stamps.append(time.perf_counter())),
               model.model.layers[0].register_forward_pre_hook(
                   lambda *a: stamps.append(time.perf_counter())),
               model.lm_head.register_forward_hook(
                   lambda *a: stamps.append(time.perf_counter())),
               model.register_forward_hook(lambda *a: stamps.append(time.perf_counter()))]
    run(n + 1)
    for h in handles:
        h.remove()
    phases = [[(b - a) * 1e3 for a, b in zip(stamps[k:k + 4], stamps[k + 1:k + 4])]
              for k in range(0, len(stamps) - 3, 4)]
    print("  host phases per forward (before layer 0, layers and lm_head, after), ms: "
          + "; ".join(", ".join(f"{x:.1f}" for x in f) for f in phases))
    one = run(1)
    host.clear()
    per_token = (run(n + 1) - one) / n
    r = codegen.nn.report(model)
    print(f"{config}, generate {n}: {per_token:.2f} ms per token; host per forward "
          f"{', '.join(f'{h * 1e3:.1f}' for h in host)} ms; last forward: {r.line()}; "
          f"unplanned calls {r.unplanned_calls}")
    # The same forwards without generate: offload_llama's decode step, back to back.
    import transformers

    cache = transformers.DynamicCache()
    token = prompt[:, -1:]
    with torch.no_grad():
        model(prompt, use_cache=True, past_key_values=cache)

    def step() -> None:  # one token on the prompt's cache, which then drops it again
        with torch.no_grad():
            model(token, use_cache=True, past_key_values=cache)
        cache.crop(-1)

    step()
    host.clear()
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    print(f"  decode step, back to back: host per forward "
          f"{', '.join(f'{h * 1e3:.1f}' for h in host)} ms")
    host.clear()
    for _ in range(6):
        step()
        torch.cuda.synchronize()
    print(f"  decode step, synchronized after each: host per forward "
          f"{', '.join(f'{h * 1e3:.1f}' for h in host)} ms")
    # Each forward's report (reading it synchronizes, as generate does at every token).
    reports: list[codegen.nn.Report] = []
    hook = model.register_forward_hook(lambda *a: reports.append(codegen.nn.report(model)))
    run(4)
    hook.remove()
    for k, f in enumerate(reports):
        print(f"  forward {k}: {f.forward_ms:.2f} ms, floor {f.copy_floor_ms:.2f} ms, "
              f"waited {f.exposed_copy_ms:.2f} ms for copies, {f.copies} copies, "
              f"{f.unplanned_calls} unplanned calls, restart: {f.restart}")
    # Where the host's time goes in Python (the torch profiler sees only torch's ops and
    # CUDA calls): the functions that took longest, themselves and with what they call.
    print(python_profile(lambda: run(4), rows=25, orders=("tottime", "cumulative"))[1])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        run(4)
    # Where the host waits: the CPU ops and runtime calls that took longest, with the
    # Python frames that called them.
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                    max_name_column_width=50))
    table = prof.key_averages(group_by_stack_n=8).table(sort_by="self_cpu_time_total",
                                                        row_limit=4, max_name_column_width=40,
                                                        max_src_column_width=90)
    print("\n".join(table.splitlines()[:60]))
    copies = sorted((e for e in prof.events() if "HtoD" in e.name),
                    key=lambda e: e.time_range.start)
    gaps = sorted((b.time_range.start - a.time_range.end for a, b in zip(copies, copies[1:])),
                  reverse=True)
    print(f"  traced generate(4): {len(copies)} copies, busy "
          f"{sum(e.time_range.elapsed_us() for e in copies) / 1e3:.2f} ms over "
          f"{(copies[-1].time_range.end - copies[0].time_range.start) / 1e3:.2f} ms; "
          f"largest gaps {[round(g) for g in gaps[:8]]} µs")


if __name__ == "__main__":
    main()
