"""Which kernels ran on which stream, when: the torch profiler's trace, drawn per stream."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .ir import Const


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    name: str
    stream: int
    start_us: float
    duration_us: float


def profile_kernels(fn: Callable[[], object], warmup: int = 2) -> list[KernelEvent]:
    """Runs ``fn`` under the torch profiler; returns its GPU kernels (memsets and copies
    excluded), sorted by start time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = [
        KernelEvent(e["name"], int(e["args"]["stream"]), float(e["ts"]), float(e["dur"]))
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "stream" in e.get("args", {})
    ]
    return sorted(events, key=lambda e: e.start_us)


def plot_kernels(events: list[KernelEvent], out: Path, title: str) -> Path:
    """A Gantt chart: one row per stream, one bar per kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({e.stream for e in events})
    t0 = min(e.start_us for e in events)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(streams)))
    for row, s in enumerate(streams):
        bars = [((e.start_us - t0) / 1000, e.duration_us / 1000) for e in events if e.stream == s]
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=f"C{row % 10}", edgecolor="black",
                       linewidth=0.5)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("time (ms) from the first kernel")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def draw_timeline(example: str, out: Path, size: int = 4096) -> Path:
    """Compiles a bundled example, runs it at ``size`` on the GPU under the profiler and
    draws its kernels per stream into ``out`` (PNG)."""
    from .build import compile
    from .examples import example as get_example

    if not torch.cuda.is_available():
        raise RuntimeError("timeline: needs a CUDA GPU (the profiler traces GPU kernels)")
    ex = get_example(example)
    fusion = ex.make()
    op = compile(fusion)
    shapes = _scaled_shapes(fusion, ex.shapes, size)
    dtype = fusion.inputs[0].dtype
    inputs = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
    events = profile_kernels(lambda: op(*inputs))
    dims = " x ".join(str(list(s)) for s in shapes)
    n_streams = len({e.stream for e in events})
    return plot_kernels(events, out, f"{op.name.split('::')[1]}  {dims}  "
                                     f"({len(events)} kernels on {n_streams} streams)")


def _scaled_shapes(fusion: object, shapes: tuple[tuple[int, ...], ...],
                   size: int) -> list[tuple[int, ...]]:
    """Every symbolic extent becomes ``size`` (fixed extents stay)."""
    out = []
    for t, s in zip(fusion.inputs, shapes):  # type: ignore[attr-defined]
        out.append(tuple(d if isinstance(e, Const) else size for d, e in zip(s, t.shape)))
    return out
