"""Which kernels and copies ran on which stream, when: the torch profiler's trace, drawn
per stream; for programs with host copies or collectives, how much of their time the
GEMMs hid (measured from the trace) beside what the schedule allows (planned,
``planned_hidden``).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import NoGPUError
from ..frontend.ir import Const


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    """One GPU activity: a kernel, a collective's kernel (NCCL), or (``kind``
    "HtoD"/"DtoH") a copy."""

    name: str
    stream: int
    start_us: float
    duration_us: float
    kind: str = "kernel"  # "kernel" | "collective" | "HtoD" | "DtoH" | "memset" | "other copy"
    nbytes: int = 0  # copies

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


HOST_COPIES = ("HtoD", "DtoH")
COPIES = (*HOST_COPIES, "other copy")  # drawn hatched
# What the GEMMs can hide: host copies and collectives.
TRANSFERS = (*HOST_COPIES, "collective")


def _kernel_kind(name: str) -> str:
    """NCCL's kernels (``ncclDevKernel_AllGather_RING_LL``, ...) are a collective's."""
    return "collective" if name.lower().startswith("nccl") else "kernel"


def _copy_kind(name: str) -> str:
    for kind in HOST_COPIES:
        if kind in name:
            return kind
    return "other copy"


def profile_gpu(fn: Callable[[], object], warmup: int = 2) -> list[KernelEvent]:
    """Runs ``fn`` under the torch profiler (after ``warmup`` calls); returns its GPU
    kernels and copies, sorted by start time."""
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
    kinds = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "memset"}
    events = []
    for e in trace.get("traceEvents", []):
        args = e.get("args", {})
        if e.get("cat") not in kinds or "stream" not in args:
            continue
        kind = kinds[e["cat"]]
        if kind == "copy":
            kind = _copy_kind(e["name"])
        elif kind == "kernel":
            kind = _kernel_kind(e["name"])
        events.append(KernelEvent(e["name"], int(args["stream"]), float(e["ts"]),
                                  float(e["dur"]), kind, int(args.get("bytes", 0))))
    return sorted(events, key=lambda e: e.start_us)


def profile_kernels(fn: Callable[[], object], warmup: int = 2) -> list[KernelEvent]:
    """Runs ``fn`` under the torch profiler; returns its GPU kernels (collectives',
    memsets and copies excluded), sorted by start time."""
    return [e for e in profile_gpu(fn, warmup) if e.kind == "kernel"]


# ---------------------------------------------------------------------------- overlap


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) intervals merged where they overlap or touch, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """How much of [start, end) the disjoint ``intervals`` (a ``union``) cover."""
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in intervals)


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Transfer time (host copies, collectives) hidden under GEMM kernels in one traced
    call."""

    copies: dict[str, tuple[int, int, float]]  # kind -> (count, bytes, busy µs)
    gemm_us: float  # time during which at least one GEMM kernel ran
    gemms: int
    copy_us: float  # sum of the transfers' durations
    hidden_us: float  # sum over transfers of their time under some GEMM kernel

    @property
    def measured(self) -> float:
        return self.hidden_us / self.copy_us if self.copy_us else 0.0


def measure_overlap(events: list[KernelEvent]) -> Overlap:
    """Sum over transfers (host copies, collectives' kernels) of the time each spent while
    some GEMM kernel ran, over their total time. Every other kernel of a codegen op is a
    GEMM (cuBLAS), so kernels stand for GEMMs; memsets (empty reductions) do not."""
    gemms = [e for e in events if e.kind == "kernel"]
    gemm_time = union([(e.start_us, e.end_us) for e in gemms])
    copies = [e for e in events if e.kind in TRANSFERS]
    per_kind: dict[str, tuple[int, int, float]] = {}
    for e in copies:
        count, nbytes, busy = per_kind.get(e.kind, (0, 0, 0.0))
        per_kind[e.kind] = (count + 1, nbytes + e.nbytes, busy + e.duration_us)
    return Overlap(per_kind, sum(e - s for s, e in gemm_time), len(gemms),
                   sum(e.duration_us for e in copies),
                   sum(covered(e.start_us, e.end_us, gemm_time) for e in copies))


def planned_hidden(copy_us: dict[str, float], gemm_us: float, slices: int,
                   streams: int) -> float:
    """The fraction of the copy time that the schedule lets GEMMs hide.

    Model: slice i runs ``copy in_i -> GEMM_i -> copy out_i`` on stream i % streams;
    GEMM slices run one at a time (each fills the GPU), and the copies of one direction
    one at a time (one copy engine per direction), with per-slice times c = C / S
    (``copy_us[kind]`` = C, the total of a direction) and g = G / S (``gemm_us`` = G).
    With two or more streams, copy in_j (j >= 1) runs while GEMM_{j-1} does and is
    hidden for min(c, g): all of it when c <= g, the GEMM's length when c > g (then the
    copies are the bottleneck and the GEMMs wait for them). Nothing hides the first
    slice's copy in (no GEMM has started) or the last slice's copy out (none is left).
    So each direction hides (S - 1) * min(c, g) of its S * c:

        planned = sum_dir (S - 1) * min(C_dir / S, G / S) / sum_dir C_dir

    which is (S - 1) / S when copy ~ GEMM, and (S - 1) / S * G / C when the copies
    dominate. One stream (or one slice) hides nothing. It is an upper bound under the
    model: stream order can only delay copies (copy in_{j+streams} queues behind GEMM_j
    and copy out_j of the same stream, which the model's steady state already allows
    for streams >= 2), and contention (copies slowing GEMMs) is not modelled.
    """
    total = sum(copy_us.values())
    if total <= 0 or slices <= 1 or streams <= 1:
        return 0.0
    g = gemm_us / slices
    hidden = sum((slices - 1) * min(c / slices, g) for c in copy_us.values())
    return hidden / total


def overlap_report(events: list[KernelEvent], slices: int, streams: int) -> str:
    """Lines that say how much transfer time (host copies, collectives) the GEMMs hid in
    one traced call: measured from the trace, beside ``planned_hidden`` from the same
    trace's transfer and GEMM times (a sliced collective is a pipeline of one direction,
    like a host copy: before its GEMM for an all-gather, after it for a reduce-scatter).
    An NCCL kernel's duration includes the time it waits for the other ranks, so a
    collective launched early that idles under a GEMM counts as hidden: the measured
    collective share can exceed the planned one, and is an upper bound on the overlap."""
    o = measure_overlap(events)
    if not o.copies:
        return "no host copies or collectives in this program"
    planned = planned_hidden({k: busy for k, (_, _, busy) in o.copies.items()}, o.gemm_us,
                             slices, streams)
    lines = []
    for kind, (count, nbytes, busy) in sorted(o.copies.items()):
        if kind == "collective":
            lines.append(f"  collectives: {count} kernels, {busy / 1e3:.3f} ms busy")
            continue
        rate = nbytes / busy / 1e3 if busy else 0.0
        lines.append(f"  {kind}: {count} copies, {nbytes / 2**20:.1f} MiB, {busy / 1e3:.3f} ms "
                     f"busy ({rate:.1f} GB/s)")
    lines.append(f"  GEMM kernels: {o.gemms}, {o.gemm_us / 1e3:.3f} ms busy")
    what = " and ".join(w for w, kinds in (("copy", HOST_COPIES),
                                            ("collective", ("collective",)))
                        if any(k in o.copies for k in kinds))
    lines.append(f"  {what} time hidden under GEMMs: measured {100 * o.measured:.1f} %, "
                 f"planned {100 * planned:.1f} % ({slices} slices on {streams} streams; "
                 "see codegen.tools.timeline.planned_hidden)")
    return "\n".join(lines)


def plot_kernels(events: list[KernelEvent], out: Path, title: str) -> Path:
    """A Gantt chart: one row per stream, one bar per kernel; copies hatched ``///``,
    collectives ``xx``, both in a lighter shade."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({e.stream for e in events})
    t0 = min(e.start_us for e in events)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(streams)))
    for row, s in enumerate(streams):
        for kinds, hatch in ((("kernel",), None), (COPIES, "///"),
                             (("collective",), "xx")):
            bars = [((e.start_us - t0) / 1000, e.duration_us / 1000) for e in events
                    if e.stream == s and e.kind in kinds]
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=f"C{row % 10}",
                               edgecolor="black", linewidth=0.5, alpha=0.45 if hatch else 1.0,
                               hatch=hatch)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("time (ms) from the first kernel")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def draw_timeline(example: str, out: Path, size: int = 4096, copy_stream: bool = False,
                  split_contraction: bool | str = False) -> tuple[Path, str]:
    """Compiles a bundled example (with ``copy_stream`` and ``split_contraction``, see
    ``lower``), runs it at ``size`` on the GPU under the profiler and draws its kernels and
    copies per stream into ``out`` (PNG). Returns the path and, for a program with host
    copies, the overlap report (else "")."""
    from ..jit import compile
    from .examples import example as get_example

    if not torch.cuda.is_available():
        raise NoGPUError("timeline: needs a CUDA GPU (the profiler traces GPU kernels)")
    ex = get_example(example)
    fusion = ex.make()
    shapes = _scaled_shapes(fusion, ex.shapes, size)
    dtype = fusion.inputs[0].dtype
    # Host inputs pinned, as they must be for the copies to overlap.
    inputs = [torch.randn(s, device="cuda", dtype=dtype) if d == "cuda"
              else torch.randn(s, dtype=dtype).pin_memory()
              for s, d in zip(shapes, ex.devices("cuda"))]
    op = compile(fusion, copy_stream=copy_stream, split_contraction=split_contraction)
    op = op.pick(inputs)  # split_contraction="auto": the loop these inputs run
    events = profile_gpu(lambda: op(*inputs))
    events = [e for e in events if e.kind != "memset"]
    dims = " x ".join(str(list(s)) for s in shapes)
    n_streams = len({e.stream for e in events})
    n_copies = sum(e.kind in COPIES for e in events)
    n_collectives = sum(e.kind == "collective" for e in events)
    extras = (f", {n_copies} copies (hatched)" if n_copies else "") + (
        f", {n_collectives} collectives (crossed)" if n_collectives else "")
    path = plot_kernels(events, out, f"{op.name.split('::')[1]}  {dims}  "
                                     f"({len(events) - n_copies - n_collectives} kernels"
                                     f"{extras} on {n_streams} streams)")
    report = ""
    if n_copies or n_collectives:
        slices, streams = _slices_and_streams(op.host_ir, shapes)
        report = overlap_report(events, slices, streams)
    return path, report


def _slices_and_streams(program: object, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """Trip count of the (first) stream loop at these input shapes, and the number of
    worker streams it uses."""
    from .. import hostir as hir
    from ..frontend.ir import ParallelType

    assert isinstance(program, hir.HostProgram)
    index = {t.name: k for k, t in enumerate(program.inputs)}
    env = {str(c.value): shapes[index[c.tensor]][c.axis] for c in hir.dim_checks(program)
           if c.kind == "bind"}
    for n in program.nodes():
        if isinstance(n, hir.ForLoop) and n.parallel is ParallelType.Stream:
            slices = n.stop.evaluate(env)
            return slices, min(slices, program.pool_size)
    return 1, 1


def _scaled_shapes(fusion: object, shapes: tuple[tuple[int, ...], ...],
                   size: int) -> list[tuple[int, ...]]:
    """Every symbolic extent becomes ``size`` (fixed extents stay)."""
    out = []
    for t, s in zip(fusion.inputs, shapes):  # type: ignore[attr-defined]
        out.append(tuple(d if isinstance(e, Const) else size for d, e in zip(s, t.shape)))
    return out
