"""Runs a :class:`~codegen.nn.plan.StreamPlan`: the copies of an offloaded model's weights
on a copy stream, into the staging ring, ahead of the GEMM pieces that read them.

The host drives it, call by call, as the forward runs. Each Linear call waits (on the GPU)
for the copies of its pieces' spans (a wait orders the caller's stream after every copy
queued before it too, so a stream waits at most once a forward for any span, and a run of
spans once, for its last), queues its pieces (a call of few input rows, such as
a decode step's, one GEMM per run of pieces back to back in the ring: its GEMMs are too
short to gain from starting early, and each costs the host; a quantized call of more
rows, each run of pieces back to back in the ring dequantized into its rows of a
scratch weight, and one GEMM per scratch), records the events that free the spans it
read last (a scratch's runs right after their dequantization), then queues every copy
whose waits have all been recorded: the copy stream runs as far ahead as the ring
allows, across Linears and, at the end of a forward, into the first spans of the next
one. A copy never waits for an event that has not been recorded yet (its record is what
lets the host queue the copy), so every wait refers to the right use of the ring's
bytes.

What is not the plan's forward runs unplanned, each weight copied whole on the caller's
stream: a call out of the learnt order (the plan is learnt again from the forward that
ended), a call from a second thread while a forward runs, a call outside a forward of the
root module, a call that needs gradients (the offloaded Linear takes its compiled,
differentiable program instead). Starting over (``_restart``) orders the copy stream
after everything the caller's stream has queued and copies the next forward from its
first span: after a forward that did not end as planned, when a weight was written in
place between forwards (its ``_version`` counter moved), around CUDA-graph capture.

A captured forward reads the spans the eager forward before it queued (the capture
begins on an idle GPU: ``torch.cuda.graph`` synchronizes) and queues the first spans of
the next forward itself, so graph replays stream back to back with the same plan; the
copy stream is joined into the capturing stream at the forward's end. Once a model has
been captured, eager forwards join their copies into the caller's stream at their end
too, so that a replay after them finds the first spans in place.

On the CPU (``device="cpu"``, the tests) the same plan runs with CPU tensors: copies are
done when queued, and a log of the two streams' events (vector clocks) checks every read
and write of the staging against the plan's ordering (:class:`OrderCheck`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InternalError
from . import cudart
from .plan import StreamPlan, plan_stream
from .quantize import dequantizer, unpack_rows

# A call whose input has at most this many rows (a decode step, a small batch) runs its
# pieces merged (``Streamer._merged``): fewer GEMMs and waits to queue.
MERGED_ROWS = 64
# A quantized call of more rows dequantizes its pieces into rows of a scratch weight of at
# most this many bytes, and no more than the larger of its input's and output's
# (activation-sized, from the caching allocator), and runs one GEMM per scratch
# (``Streamer._dequantized``).
SCRATCH_BYTES = 128 * 2**20


def _gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None,
          r0: int, r1: int) -> torch.Tensor:
    """``F.linear(x, w, b)``: the whole output where ``out`` is None, else its columns
    ``r0:r1`` of ``out``."""
    if out is None:
        return F.linear(x, w, b)
    if b is None:
        return torch.mm(x, w.t(), out=out[:, r0:r1])  # type: ignore[index]
    return torch.addmm(b, x, w.t(), out=out[:, r0:r1])  # type: ignore[index]


def _raw(stream: Any) -> int | None:
    """``stream`` as a dequantizer takes it: the raw handle the CUDA backend gives while
    its device is the current one (``_CudaBackend.current``), else None."""
    return stream if isinstance(stream, int) else None


class OrderCheck:
    """Happens-before over the host backend's two streams (vector clocks, as CUDA orders
    streams with events): raises :class:`InternalError` where a read of staging bytes is
    not ordered after the write it reads, or a write not after the reads of the data it
    overwrites."""

    def __init__(self) -> None:
        self.clock: dict[str, dict[str, int]] = {"current": {}, "copy": {}}
        # buffer -> list of (lo, hi, write stamp, reads since that write)
        self.regions: dict[str, list[tuple[int, int, tuple[str, int], list[tuple[str, int]]]]] = {}

    def _tick(self, stream: str) -> tuple[str, int]:
        c = self.clock[stream]
        c[stream] = c.get(stream, 0) + 1
        return stream, c[stream]

    def _before(self, stamp: tuple[str, int], stream: str) -> bool:
        return self.clock[stream].get(stamp[0], 0) >= stamp[1]

    def record(self, stream: str) -> dict[str, int]:
        return dict(self.clock[stream])

    def wait(self, stream: str, snapshot: dict[str, int] | None) -> None:
        c = self.clock[stream]
        for s, n in (snapshot or {}).items():
            c[s] = max(c.get(s, 0), n)

    def access(self, stream: str, buffer: str, lo: int, hi: int, write: bool) -> None:
        stamp = self._tick(stream)
        regions = self.regions.setdefault(buffer, [])
        for r_lo, r_hi, written, reads in regions:
            if r_lo < hi and lo < r_hi:
                if not self._before(written, stream):
                    raise InternalError(f"staging order: {'write' if write else 'read'} of "
                                        f"{buffer}[{lo}:{hi}] on {stream} is not ordered after "
                                        f"the copy into [{r_lo}:{r_hi}] ({written}) (bug)")
                if write and not all(self._before(r, stream) for r in reads):
                    raise InternalError(f"staging order: the copy into {buffer}[{lo}:{hi}] is "
                                        f"not ordered after the reads of [{r_lo}:{r_hi}] (bug)")
        if write:
            kept = []
            for r_lo, r_hi, written, reads in regions:
                if r_lo < lo:
                    kept.append((r_lo, min(r_hi, lo), written, reads))
                if r_hi > hi:
                    kept.append((max(r_lo, hi), r_hi, written, reads))
            kept.append((lo, hi, stamp, []))
            self.regions[buffer] = kept
        else:
            for r_lo, r_hi, _, reads in regions:
                if r_lo < hi and lo < r_hi:
                    reads.append(stamp)


class _HostEvent:
    snapshot: dict[str, int] | None = None


class _HostBackend:
    """The CPU's streams: work runs when queued; events and waits go to an OrderCheck."""

    capturing = staticmethod(lambda: False)

    def __init__(self) -> None:
        self.check = OrderCheck()
        self.copy_stream = "copy"

    def enter(self) -> None:
        pass

    def current(self) -> str:
        return "current"

    @staticmethod
    def key(stream: str) -> Any:
        return stream

    def event(self, timing: bool = False) -> _HostEvent:
        return _HostEvent()

    def record(self, event: _HostEvent, stream: str) -> None:
        event.snapshot = self.check.record(stream)

    def wait(self, stream: str, event: _HostEvent) -> None:
        self.check.wait(stream, event.snapshot)

    def order(self, later: str, earlier: str) -> None:
        self.check.wait(later, self.check.record(earlier))

    def after_all(self, later: str, streams: Sequence[str]) -> None:
        """``later`` after everything ``streams`` have queued."""
        for stream in streams:
            self.order(later, stream)

    def copying(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, buffer: str, lo: int) -> None:
        self.check.access("copy", buffer, lo, lo + dst.numel(), write=True)
        dst.copy_(src)

    def read(self, stream: str, buffer: str, lo: int, hi: int) -> None:
        self.check.access(stream, buffer, lo, hi, write=False)


class _CudaBackend:
    """CUDA streams and events; the copy stream is the streamer's own. While the
    streamer's device is the current one (``enter``, at each forward's start), events,
    waits and copies are made directly on the CUDA runtime (:mod:`.cudart`), and streams
    are passed as raw handles; otherwise, or where that runtime is not found, through
    torch's wrappers. Both act on the same events and streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.copy_stream = torch.cuda.Stream(device)
        self.copy_handle = self.copy_stream.cuda_stream
        self.runtime = cudart.runtime()
        self.raw: cudart.Runtime | None = None  # the runtime, while the calls go to it
        self.scratch = self.event()  # ``order``'s event in raw mode

    def enter(self) -> None:
        """Chooses raw calls or torch's for the forward that begins."""
        self.raw = self.runtime if torch.cuda.current_device() == self.index else None

    def capturing(self) -> bool:
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    def current(self) -> Any:
        if self.raw is not None:
            return torch._C._cuda_getCurrentRawStream(self.index)
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def _handle(stream: Any) -> int:
        return stream if isinstance(stream, int) else stream.cuda_stream

    key = _handle  # what tells two streams apart, raw handle or torch's

    def event(self, timing: bool = False) -> torch.cuda.Event:
        """A new event, recorded once (torch creates its CUDA event at its first record:
        now, not first inside a capture, and with a handle for raw calls)."""
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.copy_stream)
        return event

    def record(self, event: torch.cuda.Event, stream: Any) -> None:
        if self.raw is not None:
            self.raw.record(event.cuda_event, self._handle(stream))
        else:
            event.record(stream)

    def wait(self, stream: Any, event: torch.cuda.Event) -> None:
        if self.raw is not None:
            self.raw.wait(self._handle(stream), event.cuda_event)
        else:
            stream.wait_event(event)

    def order(self, later: Any, earlier: Any) -> None:
        if self.raw is not None:  # a wait reads the event's last record when it is queued
            self.raw.record(self.scratch.cuda_event, self._handle(earlier))
            self.raw.wait(self._handle(later), self.scratch.cuda_event)
        else:
            later.wait_stream(earlier)

    def after_all(self, later: Any, streams: Sequence[Any]) -> None:
        """``later`` after everything ``streams`` have queued: the device synchronized
        (a rare path; ``streams`` may be raw handles of streams since released). Inside a
        capture, nothing: the capture began on an idle device."""
        if streams and not self.capturing():
            torch.cuda.synchronize(self.device)

    def copying(self) -> contextlib.AbstractContextManager[None]:
        """The copy stream current, for ``copy`` (raw copies name their stream)."""
        if self.raw is not None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.copy_stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, buffer: str, lo: int) -> None:
        """Bytes ``src`` (pinned host) into ``dst`` (device), on the copy stream."""
        if self.raw is not None:
            self.raw.copy(dst.data_ptr(), src.data_ptr(), dst.numel(), self.copy_handle)
        else:
            dst.copy_(src, non_blocking=True)

    def read(self, stream: Any, buffer: str, lo: int, hi: int) -> None:
        pass


@dataclasses.dataclass
class ForwardCopies:
    """What one forward's Linear calls read: copies (spans, or whole weights where a call
    ran unplanned) and their bytes, and the probes that time how long the caller's stream
    waited for copies (pairs of timing events around each wait; GPU, eager only)."""

    copies: int = 0
    bytes: int = 0
    planned_calls: int = 0
    unplanned_calls: int = 0
    restart: str | None = None  # why the copy stream started over at this forward's start
    read: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # (lap, span)
    probes: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)

    def exposed_ms(self) -> float:
        """Milliseconds the caller's stream spent waiting for copies (synchronizes)."""
        if not self.probes:
            return 0.0
        self.probes[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.probes)


class Streamer:
    """Streams an arena's weights to ``device`` by ``plan`` (see the module docstring).
    ``weights[i]``: the (weight, bias) Parameters of ``plan.layouts[i]``, whose
    ``_version`` counters tell a weight written in place between forwards."""

    def __init__(self, plan: StreamPlan, arena: torch.Tensor, device: torch.device,
                 weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.device = device
        self.arena = arena
        self.weights = list(weights)
        self.backend: _HostBackend | _CudaBackend = (
            _CudaBackend(device) if device.type == "cuda" else _HostBackend())
        self.ring = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device)
        self.biases = torch.empty(plan.bias_bytes, dtype=torch.uint8, device=device)
        if isinstance(self.backend, _CudaBackend):  # freed only once the copies into them ran
            for t in (self.ring, self.biases):
                t.record_stream(self.backend.copy_stream)
        self.readers: dict[Any, Any] = {}  # the streams that read the staging, by key
        self.active: int | None = None  # the thread whose forward runs the plan
        self.graphs = False  # a forward was captured: eager forwards join their copies
        self.last_captured = False
        self.capturing = False
        self.versions = self._versions()
        self.probe_sets: list[list[Any]] = [[], []]
        self.probe_waits = True  # time each wait for a copy (the report's exposed_copy_ms)
        self.scratch_gemms = True  # quantized calls of many rows: ``_dequantized``
        self.dequant_runs = True  # ... by runs of pieces, not piece by piece (``_scratches``)
        self.forwards = 0
        self.probe_used = 0
        self.now: ForwardCopies | None = None
        self._set_plan(plan)

    # -------------------------------------------------------------------- the plan
    def _set_plan(self, plan: StreamPlan) -> None:
        n = len(plan.spans)
        self.plan = plan
        self.copied = [self.backend.event() for _ in range(n)]
        self.freed = [self.backend.event() for _ in range(n)]
        self.freed_lap = [-1] * n
        self.lap = 0  # the lap the next call reads
        self.cursor = 0  # the next call's position in the plan
        self.issued = 0  # spans queued, over every lap (lap * n + span)
        self.settled = 0  # spans queued before this one need no wait for their copy
        self.waited: tuple[Any, int] | None = None  # (stream, index): see _await_copies
        self.skip_before = 0  # frees recorded in laps before this one need no wait
        self.off_plan = False  # this forward left the plan: its other calls run unplanned
        self.observed: list[int] = []
        # Views made once (each costs microseconds of host time a call): every span's
        # destination and source, every GEMM's weight (or its dequantizer) and bias in the
        # staging, by piece and by merged run of pieces (``_merged``); a prefill's scratch
        # runs as its calls first need them (``_scratches``).
        self.span_views = []
        for span in plan.spans:
            dst, lo = ((self.biases, span.arena_begin) if span.is_bias_block
                       else (self.ring, span.ring_begin))
            self.span_views.append((dst[lo:lo + span.nbytes],  # type: ignore[operator]
                                    self.arena[span.arena_begin:span.arena_begin + span.nbytes],
                                    "biases" if span.is_bias_block else "ring", lo))
        self.piece_groups = [self._pieces(call) for call in plan.calls]
        self.merged_groups = [self._merged(call, groups)
                              for call, groups in zip(plan.calls, self.piece_groups)]
        self.scratch_plans: dict[tuple[Any, ...], Any] = {}  # by ``_scratches``

    def _pieces(self, call: Any) -> list[tuple[Any, ...]]:
        """A call's GEMMs, one per piece; each: (its spans, weight rows (a view, or a
        quantized weight's dequantizer), bias rows, ring bytes lo:hi, bias bytes lo:hi,
        rows r0:r1, the spans it frees)."""
        return [self._group(call, [piece]) for piece in call.pieces]

    def _merged(self, call: Any, pieces: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A call's GEMMs, one per run of pieces that lie back to back in the ring (a run
        of one keeps its piece's group). A run never needs its own frees before its GEMM:
        a piece frees only its span (and the bias block, which has no ring bytes), and a
        copy waits only for spans whose ring bytes it overwrites, which back-to-back spans
        do not share (``_await_copies`` raises if a plan ever broke this)."""
        return self._run_groups(call, pieces, self._runs(call, range(len(call.pieces))))

    def _run_groups(self, call: Any, pieces: list[tuple[Any, ...]],
                    runs: list[list[int]]) -> list[tuple[Any, ...]]:
        """One group (``_group``) per run of ``call``'s pieces; a run of one keeps its
        piece's group from ``pieces``."""
        return [pieces[run[0]] if len(run) == 1
                else self._group(call, [call.pieces[k] for k in run]) for run in runs]

    def _runs(self, call: Any, ks: Sequence[int]) -> list[list[int]]:
        """The pieces ``ks`` of ``call`` (consecutive indices) cut into runs that lie back
        to back in the ring."""
        lay = self.plan.layouts[call.linear]
        runs: list[list[int]] = []
        for k in ks:
            piece = call.pieces[k]
            if runs:
                last = call.pieces[runs[-1][-1]]
                if piece.ring_offset == last.ring_offset + (
                        last.rows[1] - last.rows[0]) * lay.row_bytes:
                    runs[-1].append(k)
                    continue
            runs.append([k])
        return runs

    def _group(self, call: Any, run: list[Any]) -> tuple[Any, ...]:
        """One GEMM over the rows of ``run`` (pieces back to back in the ring)."""
        lay = self.plan.layouts[call.linear]
        r0, r1 = run[0].rows[0], run[-1].rows[1]
        lo, hi = run[0].ring_offset, run[0].ring_offset + (r1 - r0) * lay.row_bytes
        if lay.quant is None:
            w = self.ring[lo:hi].view(lay.dtype).view(r1 - r0, lay.in_features)
        else:  # the rows' values and scales, dequantized at each call
            w = dequantizer(self.ring[lo:hi].view(r1 - r0, lay.row_bytes), lay.quant,
                            lay.in_features, lay.dtype)
        b, b_lo, b_hi = None, 0, 0
        if lay.bias_offset is not None:
            b_lo = lay.bias_offset + r0 * lay.dtype.itemsize
            b_hi = b_lo + (r1 - r0) * lay.dtype.itemsize
            b = self.biases[b_lo:b_hi].view(lay.dtype)
        spans = tuple(p.span for p in run)
        frees = tuple(j for p in run for j in p.frees)
        return (spans, w, b, lo, hi, b_lo, b_hi, r0, r1, frees)

    def relearn(self, order: list[int]) -> None:
        """Plans the forward that calls ``order`` (the Linears' indices) from now on."""
        plan = dataclasses.replace(
            plan_stream(self.plan.layouts, order, self.plan.ring_bytes, self.plan.copy_bytes,
                        self.plan.bias_bytes),
            resident=self.plan.resident, budget=self.plan.budget, copy_gbps=self.plan.copy_gbps,
            optimize_for=self.plan.optimize_for)
        self._restart(self.backend.current())
        self._set_plan(plan)
        self._pump()

    def _versions(self) -> int:
        return sum(t._version for pair in self.weights for t in pair if t is not None)

    def _restart(self, stream: Any) -> None:
        """Drops what is queued for reads that will not come: the copy stream waits for
        everything ``stream`` and every other stream that read the staging since the last
        restart have queued (their reads may still run), and the next call reads a new
        lap, copied from its first span."""
        key = self.backend.key(stream)
        self.backend.after_all(self.backend.copy_stream,
                               [s for k, s in self.readers.items() if k != key])
        self.readers = {}
        self.backend.order(self.backend.copy_stream, stream)
        n = max(len(self.plan.spans), 1)
        self.lap = self.issued // n + 1
        self.issued = self.settled = self.lap * n
        self.freed_lap = [self.lap - 1] * len(self.plan.spans)
        self.skip_before = self.lap
        self.cursor = 0

    # -------------------------------------------------------------------- copies
    def _pump(self) -> None:
        """Queues every copy whose waits have all been recorded, in plan order, up to the
        end of the next lap."""
        ready = self._ready()
        if ready:
            with self.backend.copying():  # one switch of the current stream for the batch
                for j, lap in ready:
                    for k, d in self.plan.spans[j].waits:
                        if lap + d >= self.skip_before:
                            self.backend.wait(self.backend.copy_stream, self.freed[k])
                    self.backend.copy(*self.span_views[j])
                    self.backend.record(self.copied[j], self.backend.copy_stream)

    def _ready(self) -> list[tuple[int, int]]:
        """The copies ``_pump`` queues now, as (span, lap), counted as queued."""
        n = len(self.plan.spans)
        ready = []
        while self.issued < (self.lap + 2) * n:
            lap, j = divmod(self.issued, n)
            if any(self.freed_lap[k] < lap + d for k, d in self.plan.spans[j].waits):
                break
            ready.append((j, lap))
            self.issued += 1
        return ready

    def _await_copies(self, stream: Any, spans: Sequence[int]) -> None:
        """The caller's stream waits for the copies of ``spans`` of this lap (queued
        first), timed. The copy stream runs its copies in the order they were queued, so a
        wait for one copy orders ``stream`` after every copy queued before it too: the
        stream waits once, for the last queued of ``spans``, and a span it has waited past
        (``waited``: the stream and the first index it has not, this forward) needs no
        wait of its own, as a second piece of the same span, or the bias block, finds."""
        n = len(self.plan.spans)
        key = self.backend.key(stream)
        past = self.waited[1] if self.waited is not None and self.waited[0] == key else 0
        last = -1
        for j in spans:
            index = self.lap * n + j
            if self.issued <= index:
                self._pump()
            if self.issued <= index:
                raise InternalError(f"codegen.nn.offload: span {j} of lap {self.lap} cannot be "
                                    "copied before the call that reads it (a plan whose waits "
                                    "need a later reader; bug)")
            if index >= max(self.settled, past):
                last = max(last, index)
        if last < 0:
            return
        self.waited = (key, max(last + 1, past))
        probe = self.probe_waits and self.now is not None and not self.capturing and isinstance(
            self.backend, _CudaBackend)
        if probe:
            before = self._probe_event()
            self.backend.record(before, stream)
        self.backend.wait(stream, self.copied[last % n])  # the others were queued before it
        if probe:
            after = self._probe_event()
            self.backend.record(after, stream)
            self.now.probes.append((before, after))  # type: ignore[union-attr]

    def _probe_event(self) -> Any:
        """A timing event of this forward's set (two sets, alternating by forward: the
        report reads the last forward that ended while the next one records)."""
        pool = self.probe_sets[self.forwards % 2]
        if self.probe_used == len(pool):
            pool.append(self.backend.event(timing=True))
        self.probe_used += 1
        return pool[self.probe_used - 1]

    # -------------------------------------------------------------------- forwards
    def begin(self) -> bool:
        """The root module's forward starts; whether this thread's calls run the plan."""
        me = threading.get_ident()
        if self.active is not None and self.active != me:
            return False  # another thread's forward runs the plan; this one runs unplanned
        self.backend.enter()
        stream = self.backend.current()
        capturing = self.backend.capturing()
        versions = self._versions()
        restart = self._stale(me, versions)
        self.active = me
        self.versions = versions
        if capturing:
            self.graphs = True
            self.backend.order(self.backend.copy_stream, stream)  # the copies join the capture
            if restart is not None:
                self._restart(stream)
            else:  # the capture begins on an idle GPU: what was queued before has run
                self.settled = self.issued
                self.skip_before = self.lap
        elif restart is not None:
            self._restart(stream)
        self.capturing = capturing
        self.waited = None  # a forward's waits order only its own stream's later work
        self.off_plan = False
        self.observed = []
        self.forwards += 1
        self.probe_used = 0
        self.now = ForwardCopies(restart=restart)
        self._pump()
        return True

    def _stale(self, me: int, versions: int) -> str | None:
        """Why a forward that begins now cannot read what is queued (the copy stream
        starts over), or None where it can."""
        if self.active == me:
            return "the last forward did not end (it raised, or this one began inside it)"
        if self.off_plan or self.cursor != 0:
            return "the last forward left the copy plan"
        if versions != self.versions:
            return "a weight was written in place"
        if self.last_captured:
            return "the last forward was captured in a CUDA graph"
        return None

    def end(self) -> ForwardCopies | None:
        """The root module's forward ended (in this thread); what its calls read."""
        if self.active != threading.get_ident():
            return None
        self.active = None
        stream = self.backend.current()
        if not self.capturing and (self.off_plan or self.cursor != 0) and self.observed:
            self.relearn(self.observed)
        if self.capturing or self.graphs:
            self.backend.order(stream, self.backend.copy_stream)
        self.last_captured = self.capturing
        now, self.now = self.now, None
        return now

    def call(self, linear: int, x: torch.Tensor) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)`` of Linear ``linear`` (x 2-D on the device) by the
        plan, or None where this call is not the plan's next (the caller runs it
        unplanned)."""
        if self.active != threading.get_ident():
            return None
        self.observed.append(linear)
        calls = self.plan.calls
        if self.off_plan or self.cursor >= len(calls) or calls[self.cursor].linear != linear:
            self.off_plan = True
            return None
        call = calls[self.cursor]
        lay = self.plan.layouts[linear]
        stream = self.backend.current()
        self.readers.setdefault(self.backend.key(stream), stream)
        if not call.pieces:  # no weight bytes: the caller's unplanned call is as cheap
            self._advance()
            return None
        if call.bias_span is not None:
            self._await_copies(stream, (call.bias_span,))
        if (lay.quant is not None and x.shape[0] > MERGED_ROWS and self.scratch_gemms
                and lay.in_features * lay.dtype.itemsize % 16 == 0):
            out = self._dequantized(call, x, stream)
        else:
            out = self._by_pieces(call, x, stream)
        if self.now is not None:
            self.now.planned_calls += 1
        self._advance()
        return out

    def _by_pieces(self, call: Any, x: torch.Tensor, stream: Any) -> torch.Tensor:
        """A call's GEMMs on its pieces where they lie in the ring: one per piece, or, for
        few rows (a decode step), one per merged run of pieces, for the host's sake (the
        GEMMs are too short to gain from starting before the run's last copy)."""
        lay = self.plan.layouts[call.linear]
        groups = (self.merged_groups if x.shape[0] <= MERGED_ROWS
                  else self.piece_groups)[self.cursor]
        out = None if len(groups) == 1 else x.new_empty(x.shape[0], lay.out_features)
        for spans, w, b, lo, hi, b_lo, b_hi, r0, r1, frees in groups:
            self._await_copies(stream, spans)
            self.backend.read(stream, "ring", lo, hi)
            if b is not None:
                self.backend.read(stream, "biases", b_lo, b_hi)
            if lay.quant is not None:  # the rows dequantized (their dequantizer)
                w = w(stream=_raw(stream))
            y = _gemm(x, w, b, out, r0, r1)
            self._release(stream, call, spans, frees)
        return y if out is None else out

    def _dequantized(self, call: Any, x: torch.Tensor, stream: Any) -> torch.Tensor:
        """A quantized call of many rows (a prefill): each run of pieces back to back in
        the ring (with ``dequant_runs`` off, each piece), once its copies are in,
        dequantized into its rows of a scratch weight, its spans freed right after that
        (the dequantization is their only reader, so the copies behind them start before
        the GEMM); then one GEMM per scratch, the GEMM the model makes with its weight on
        the GPU. A scratch holds whole pieces, at most ``SCRATCH_BYTES`` and the larger of
        the call's input and output bytes (one piece where that is less), so a weight
        larger than that runs as several GEMMs, each into its output columns."""
        lay = self.plan.layouts[call.linear]
        cap = min(SCRATCH_BYTES, x.shape[0] * max(lay.in_features, lay.out_features)
                  * lay.dtype.itemsize)
        scratches = self._scratches(call, cap)
        out = None if len(scratches) == 1 else x.new_empty(x.shape[0], lay.out_features)
        biases: list[int] = []  # the bias block, freed after the GEMMs that read it
        for c0, c1, runs in scratches:
            scratch = torch.empty(c1 - c0, lay.in_features, dtype=lay.dtype, device=x.device)
            for spans, w, _, lo, hi, _, _, r0, r1, frees in runs:
                self._await_copies(stream, spans)
                self.backend.read(stream, "ring", lo, hi)
                w(scratch[r0 - c0:r1 - c0], stream=_raw(stream))
                biases += [j for j in frees if self.plan.spans[j].is_bias_block]
                self._release(stream, call, spans,
                              [j for j in frees if not self.plan.spans[j].is_bias_block])
            b = None
            if lay.bias_offset is not None:
                b_lo = lay.bias_offset + c0 * lay.dtype.itemsize
                b_hi = b_lo + (c1 - c0) * lay.dtype.itemsize
                self.backend.read(stream, "biases", b_lo, b_hi)
                b = self.biases[b_lo:b_hi].view(lay.dtype)
            y = _gemm(x, scratch, b, out, c0, c1)
        if biases:
            self._free(stream, biases)
            self._pump()
        return y if out is None else out

    def _scratches(self, call: Any, cap: int) -> list[tuple[int, int, list[tuple[Any, ...]]]]:
        """The scratch weights of a quantized call (the plan's current one) whose scratch
        holds at most ``cap`` bytes: each (rows c0:c1, its dequantizations). The pieces go
        greedily into scratches of whole pieces; with ``dequant_runs`` (the default), a
        scratch's pieces back to back in the ring dequantize as one run (one wait and one
        kernel; safe for the reason ``_merged`` gives), else one by one. A run's spans are
        freed after its dequantization, not the scratch's: a weight larger than the ring
        needs its first runs freed before the copies of its last. The runs' views are made
        once per way of cutting the call (they cost the host microseconds each; the ways
        are bounded by the plan, not by the row counts seen)."""
        lay = self.plan.layouts[call.linear]
        row = lay.in_features * lay.dtype.itemsize
        chunks: list[list[int]] = []
        for k, piece in enumerate(call.pieces):
            if chunks and (piece.rows[1] - call.pieces[chunks[-1][0]].rows[0]) * row <= cap:
                chunks[-1].append(k)
            else:
                chunks.append([k])
        key = (self.cursor, tuple(chunk[0] for chunk in chunks), self.dequant_runs)
        if key not in self.scratch_plans:
            scratches = []
            for chunk in chunks:
                runs = self._run_groups(call, self.piece_groups[self.cursor],
                                        self._runs(call, chunk) if self.dequant_runs
                                        else [[k] for k in chunk])
                scratches.append((runs[0][7], runs[-1][8], runs))
            self.scratch_plans[key] = scratches
        return self.scratch_plans[key]

    def _release(self, stream: Any, call: Any, spans: Sequence[int],
                 frees: Sequence[int]) -> None:
        """A piece's reads are queued: frees the spans it read last, counts what it read in
        the forward's record, and queues the copies that may now follow."""
        self._free(stream, frees)
        if self.now is not None:
            for j in (*spans, call.bias_span):
                if j is not None and (self.lap, j) not in self.now.read:
                    self.now.read.add((self.lap, j))
                    self.now.copies += 1
                    self.now.bytes += self.plan.spans[j].nbytes
        self._pump()

    def _free(self, stream: Any, spans: Sequence[int]) -> None:
        """``spans``' last reads of this lap are queued on ``stream``: the copies that
        overwrite their ring bytes may follow."""
        for j in spans:
            self.backend.record(self.freed[j], stream)
            self.freed_lap[j] = self.lap

    def _advance(self) -> None:
        """The plan's next call; after the last one, the next lap's."""
        self.cursor += 1
        if self.cursor == len(self.plan.calls):
            self.lap += 1
            self.cursor = 0
            self._pump()

    def unplanned(self, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, linear: int | None = None) -> torch.Tensor:
        """A call off the plan: its weight (and bias) copied whole on the caller's stream;
        a quantized one (Linear ``linear`` of the plan) as its arena rows, dequantized
        there."""
        lay = self.plan.layouts[linear] if linear is not None else None
        if lay is not None and lay.quant is not None:
            weight = self.arena[lay.weight_offset:lay.weight_offset + lay.weight_bytes].view(
                lay.out_features, lay.row_bytes)
        if self.now is not None and self.active == threading.get_ident():
            self.now.unplanned_calls += 1
            for t in (weight, bias):
                if t is not None and t.numel():
                    self.now.copies += 1
                    self.now.bytes += t.numel() * t.element_size()
        if self.device.type != "cpu":
            weight = weight.to(self.device, non_blocking=True)
            bias = bias.to(self.device, non_blocking=True) if bias is not None else None
        if lay is not None and lay.quant is not None:
            weight = unpack_rows(weight, lay.quant, lay.in_features, lay.dtype)
        return F.linear(x, weight, bias)
