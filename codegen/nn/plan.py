"""The copy plan of an offloaded model: which bytes of the arena each forward copies, in
which copies, into which bytes of the GPU staging, and which GEMM reads them.

A forward is one *lap* over the plan. Its copies are *spans*: contiguous ranges of the
arena of about ``copy_bytes``, cut at row boundaries of the weights and running across
Linear boundaries (a Linear's weight, the next one's, ... as the arena lays them out in
the order the forward reads them), each copied whole into the staging ring. Every bias
travels in one *bias block* per forward into a buffer of its own. A Linear's GEMM runs as
*pieces*, one per span its weight's rows lie in: piece ``p`` computes
``y[:, r0:r1] = x @ W[r0:r1].T (+ b[r0:r1])`` and waits only for its span's copy.

Where a span goes in the ring is fixed (every lap starts at the same place, chosen so
that the next lap's first copies overwrite bytes read a wrap before the lap's end), so a
lap reads the same ring bytes each time and a CUDA graph can capture one. A span's copy waits
for the last readers of the spans that last held its ring bytes (each byte's last
occupant; an earlier one's readers were waited for by a later one's copy): ``Span.waits``
lists them as (span, lap offset), offset 0 for a span earlier in the same lap, -1 for one
of the previous lap. ``Piece.frees`` says which spans a piece is the
last reader of in its lap. Printed, the plan reads as the host IR of one lap
(:func:`StreamPlan.__str__`).

Pure data and arithmetic: nothing here touches a tensor or a GPU (``streamer.py`` runs
the plan).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..transforms.cost import COPY_BYTES_PER_MS, GEMM_FLOPS_PER_MS, HBM_BYTES_PER_MS
from . import quantize

ALIGN = 256  # bytes: where each tensor of the arena starts, and each span in the ring

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(what: str, value: object) -> int:
    """``value`` as a number of bytes: an int, or a string such as ``"6GiB"``, ``"512MiB"``,
    ``"6GB"`` or ``"1.5 GiB"``; ``what`` names the argument in the error."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected bytes as an int or a string such as '512MiB', got "
                        f"{value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        unit = found.group(2).lower() if found else None
        if not found or unit not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r} as a size; expected a number of "
                             "bytes with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), "
                             "e.g. '512MiB' or '6GB'")
        n = int(float(found.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"{what}: expected bytes as an int or a string such as '512MiB', got "
                        f"{type(value).__name__}")
    if n < 0:
        raise ValueError(f"{what}: expected a size >= 0 bytes, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``n`` bytes in the binary unit that fits: ``512 B``, ``3.0 KiB``, ``208.0 MiB``..."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _natural(name: str) -> list[object]:
    """``name``'s sort key with its numbers as numbers (layers.2 before layers.10)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def arena_row_bytes(quant: str | None, in_features: int, dtype: torch.dtype) -> int:
    """Bytes of one weight row in the arena: its values, or (quantized) its quantized
    values and their scales."""
    if quant is not None:
        return quantize.row_bytes(quant, in_features, dtype)
    return in_features * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one offloaded Linear's tensors lie in the arena (bytes from its start)."""

    name: str
    dtype: torch.dtype
    out_features: int
    in_features: int
    weight_offset: int
    bias_offset: int | None  # in the arena's bias block; None: no bias
    quant: str | None = None  # "fp8", "int4": rows of quantized values and their scales

    @property
    def row_bytes(self) -> int:
        """Bytes of one weight row in the arena (and the staging)."""
        return arena_row_bytes(self.quant, self.in_features, self.dtype)

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.row_bytes

    @property
    def bias_bytes(self) -> int:
        return 0 if self.bias_offset is None else self.out_features * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.weight_bytes + self.bias_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        return self.weight_bytes


@dataclasses.dataclass(frozen=True)
class Resident:
    """An offloadable Linear that a GPU budget keeps on the GPU (not streamed)."""

    name: str
    dtype: torch.dtype
    out_features: int
    in_features: int
    bias: bool
    quant: str | None = None  # how it is streamed where it is (resident: as it is)

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    @property
    def streamed_row_bytes(self) -> int:
        """Bytes of a weight row in the arena, where it is streamed."""
        return arena_row_bytes(self.quant, self.in_features, self.dtype)

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes of the weight in the arena, where it is streamed."""
        return self.out_features * self.streamed_row_bytes

    @property
    def nbytes(self) -> int:
        return self.weight_bytes + (self.out_features * self.dtype.itemsize if self.bias else 0)


@dataclasses.dataclass(frozen=True)
class Span:
    """One copy of a lap: ``nbytes`` of the arena from ``arena_begin`` to the ring at
    ``ring_begin`` (to the bias buffer at ``arena_begin`` for the bias block), after the
    last readers of ``waits`` have finished."""

    index: int
    arena_begin: int
    nbytes: int
    ring_begin: int | None  # None: the bias block
    waits: tuple[tuple[int, int], ...]

    @property
    def is_bias_block(self) -> bool:
        return self.ring_begin is None

    def target(self) -> str:
        if self.ring_begin is None:
            return f"biases[{self.arena_begin}:{self.arena_begin + self.nbytes}]"
        return f"ring[{self.ring_begin}:{self.ring_begin + self.nbytes}]"


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of a Linear's weight, read from span ``span`` at ``ring_offset``; the
    last reader in its lap of the spans ``frees``."""

    rows: tuple[int, int]
    span: int
    ring_offset: int
    frees: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """The ``position``-th Linear call of a forward: Linear ``linear`` (an index of
    ``StreamPlan.layouts``), its pieces, and the bias block's span if it has a bias."""

    position: int
    linear: int
    pieces: tuple[Piece, ...]
    bias_span: int | None


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """The copies and GEMM pieces of one forward (see the module docstring)."""

    layouts: tuple[Layout, ...]
    calls: tuple[Call, ...]
    spans: tuple[Span, ...]
    ring_bytes: int
    bias_bytes: int
    copy_bytes: int
    # Under a GPU budget: the offloadable Linears kept on the GPU, and the budget.
    resident: tuple[Resident, ...] = ()
    budget: int | None = None
    copy_gbps: float = 0.0  # measured at offload time; 0: the data sheet's rate
    # The step the default ring is sized for (``offload(..., optimize_for=)``).
    optimize_for: str = "decode"

    @property
    def order(self) -> tuple[int, ...]:
        """The Linears in the order a forward calls them."""
        return tuple(c.linear for c in self.calls)

    @property
    def bytes_per_lap(self) -> int:
        return sum(s.nbytes for s in self.spans)

    @property
    def staging_bytes(self) -> int:
        """GPU bytes the plan stages in: the ring and the bias buffer."""
        return self.ring_bytes + self.bias_bytes

    @property
    def streamed(self) -> tuple[Layout, ...]:
        """The Linears whose weights each forward copies."""
        return self.layouts

    @property
    def streamed_bytes(self) -> int:
        return sum(lay.nbytes for lay in self.layouts)

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self.resident)

    @property
    def gpu_bytes(self) -> int:
        """What a budget bounds: the resident Linears' weights and biases, and the
        staging."""
        return self.resident_bytes + self.staging_bytes

    def expected_ms(self, tokens: int = 1) -> float:
        """The expected milliseconds of the offloadable Linears in a forward of ``tokens``
        rows: the longer of the streamed bytes' copies (at the measured rate) and the GEMMs
        of every offloadable Linear, resident or streamed, as the cost model estimates them
        on a GPU-resident model (each the longer of its FLOPs and its weight's HBM
        reads). Decode (a few tokens) is bound by the copies; a long prefill may be bound
        by the GEMMs, where streaming costs little."""
        rate = self.copy_gbps * 1e6 if self.copy_gbps else COPY_BYTES_PER_MS
        copies = self.streamed_bytes / rate
        gemms = 0.0
        for lay in (*self.layouts, *self.resident):
            flops = 2 * tokens * lay.out_features * lay.in_features
            gemms += max(flops / GEMM_FLOPS_PER_MS.get(lay.dtype, GEMM_FLOPS_PER_MS[
                torch.float32]), lay.weight_bytes / HBM_BYTES_PER_MS)
        return max(copies, gemms)

    def placement(self) -> str:
        """Which offloadable Linears are resident and which streamed, their bytes, and the
        expected time of a decode step and of a 4096-token prefill."""
        rate = self.copy_gbps or COPY_BYTES_PER_MS / 1e6
        budget = "no GPU budget" if self.budget is None else (
            f"gpu_budget {format_bytes(self.budget)}")
        if self.optimize_for != "decode":
            budget += f", optimized for {self.optimize_for}"
        lines = [f"placement ({budget}): resident {format_bytes(self.resident_bytes)} in "
                 f"{len(self.resident)} Linears + staging {format_bytes(self.staging_bytes)} "
                 f"= {format_bytes(self.gpu_bytes)} on the GPU; streamed "
                 f"{format_bytes(self.streamed_bytes)} in {len(self.layouts)} Linears a "
                 f"forward",
                 f"expected (offloadable Linears, copies at {rate:.1f} GB/s): decode step "
                 f"{self.expected_ms(1):.2f} ms, prefill of 4096 tokens "
                 f"{self.expected_ms(4096):.2f} ms"]
        rows = sorted([(r.name, "resident", r) for r in self.resident]
                      + [(lay.name, "streamed", lay) for lay in self.layouts],
                      key=lambda row: _natural(row[0]))
        for name, where, lay in rows:
            lines.append(f"  {where:8}  {name}: [{lay.out_features}, {lay.in_features}] "
                         f"{format_bytes(lay.nbytes)}")
        return "\n".join(lines)

    def summary(self) -> str:
        n = len(self.spans)
        mean = self.bytes_per_lap / n if n else 0
        return (f"{len(self.calls)} Linear calls, {format_bytes(self.bytes_per_lap)} in {n} "
                f"copies a forward (mean {format_bytes(mean)}, target "
                f"{format_bytes(self.copy_bytes)}); staging: ring "
                f"{format_bytes(self.ring_bytes)} + biases {format_bytes(self.bias_bytes)}")

    def __str__(self) -> str:
        """The plan as host IR: each span's copy on the copy stream, after the events of
        the readers it waits for; then each Linear call's pieces on the caller's stream.
        At run time a copy is queued as soon as its waits have been recorded (the next
        lap's first spans under this lap's last pieces)."""
        lines = [f"StreamPlan({self.summary()})"]
        if self.budget is not None or self.resident:
            lines.append(self.placement())
        lines.append("copies (Stream(copy)):")
        for s in self.spans:
            waits = ", ".join(f"freed[{k}]" + ("" if d == 0 else "@lap-1") for k, d in s.waits)
            lines.append(f"  span {s.index}: WaitEvent({waits}); Copy(arena[{s.arena_begin}:"
                         f"{s.arena_begin + s.nbytes}], out={s.target()}); "
                         f"RecordEvent(copied[{s.index}])")
        lines.append("calls (the caller's stream):")
        for call in self.calls:
            lay = self.layouts[call.linear]
            quant = f", streamed as {lay.quant}" if lay.quant else ""
            lines.append(f"  {lay.name}: [{lay.out_features}, {lay.in_features}] "
                         f"{str(lay.dtype).removeprefix('torch.')}{quant}")
            for piece in call.pieces:
                r0, r1 = piece.rows
                waits = [piece.span] + ([call.bias_span] if call.bias_span is not None else [])
                end = piece.ring_offset + (r1 - r0) * lay.row_bytes
                bias = ""
                if lay.bias_offset is not None:
                    at = lay.bias_offset + r0 * lay.dtype.itemsize
                    bias = f", biases[{at}:{at + (r1 - r0) * lay.dtype.itemsize}]"
                frees = "".join(f"; RecordEvent(freed[{j}])" for j in piece.frees)
                weight = (f"ring[{piece.ring_offset}:{end}] as [{r1 - r0}, "
                          f"{lay.in_features}]")
                if lay.quant is not None:  # values and scales of each row, dequantized
                    weight = f"Dequantize({weight} {lay.quant})"
                lines.append(f"    WaitEvent({', '.join(f'copied[{j}]' for j in waits)}); "
                             f"Linear(x, {weight}{bias}, out=y[:, {r0}:{r1}]){frees}")
        return "\n".join(lines)


# Rows of a GEMM piece come in multiples of this (but a weight's last piece): the piece
# writes y[:, r0:r1], whose first element is then 256-byte aligned, as the fast Hopper
# GEMMs (TMA) need; at an unaligned column cuBLAS falls back to kernels several times
# slower (measured: a 4096-token prefill's GEMMs took 3x as long).
ROW_GRANULE = 128


def row_granule(row_bytes: int, copy_bytes: int) -> int:
    """Rows a piece holds a multiple of: ``ROW_GRANULE``, or fewer (8, 1) where a copy
    cannot hold that many rows (tiny models)."""
    for granule in (ROW_GRANULE, 8):
        if granule * row_bytes <= copy_bytes:
            return granule
    return 1


def _place(spans: list[tuple[int, int]], bias_span: int | None, ring_bytes: int,
           start: int) -> tuple[list[int | None], int]:
    """Ring places of a lap that starts at ``start``: each span at the next bytes that keep
    its arena alignment (mod ALIGN), wrapping to the ring's start when it does not fit;
    and where the lap's last span ends."""
    ring_at: list[int | None] = []
    head = start
    for j, (begin, nbytes) in enumerate(spans):
        if j == bias_span:
            ring_at.append(None)
            continue
        phase = begin % ALIGN
        at = round_up(max(head - phase, 0), ALIGN) + phase
        if at + nbytes > ring_bytes:
            at = phase
        ring_at.append(at)
        head = at + nbytes
    return ring_at, head


def _ring_places(spans: list[tuple[int, int]], bias_span: int | None,
                 ring_bytes: int) -> list[int | None]:
    """Where each span goes, the same every lap. A lap that wraps the ring starts where
    its own last wrap has ended (as close after it as a 64th of the ring allows): the next
    lap's first copies then overwrite bytes read a wrap earlier, not the last spans of the
    lap, whose GEMMs run after the last copy (a lap started at the ring's start made the
    copy engine wait for them at every forward's end)."""
    best, best_gap = 0, None
    for k in range(64):
        start = round_up(ring_bytes * k // 64, ALIGN)
        _, end = _place(spans, bias_span, ring_bytes, start)
        if end <= start and (best_gap is None or start - end < best_gap):
            best, best_gap = start, start - end
    return _place(spans, bias_span, ring_bytes, best)[0]


def plan_stream(layouts: list[Layout] | tuple[Layout, ...], order: list[int] | tuple[int, ...],
                ring_bytes: int, copy_bytes: int, bias_bytes: int,
                whole_weights: bool = False) -> StreamPlan:
    """The plan of a forward that calls ``layouts[i]`` for ``i`` in ``order``, with a ring
    of ``ring_bytes`` and copies of about ``copy_bytes``; ``bias_bytes``: the bias block's
    size (the arena's first bytes), copied whole each forward.

    Spans: the rows of the weights in call order, packed while they are adjacent in the
    arena and the span stays within ``copy_bytes``, cut at multiples of ``row_granule``
    rows; a weight that starts with less than an eighth of a span left starts a new span
    instead (no sliver GEMMs). A span holds at least one row, so ``copy_bytes`` below a
    row's bytes is raised to it. ``whole_weights=True`` starts a new span wherever a weight
    does not fit whole in what is left of the open one, so that only weights larger than
    a copy are cut: fewer GEMM pieces (the 8B-shaped model in fp8: 320 a forward instead
    of 417), more and smaller copies. Measured against packing (H100, interleaved): a
    4096-token fp8 prefill 0.986x, a one-token fp8 forward 1.018x; bf16 at a 50% budget
    no different. Decode steps are what an offloaded model mostly runs, so packing is the
    default."""
    layouts = tuple(layouts)
    widest = max((lay.row_bytes for lay in layouts), default=0)
    copy_bytes = max(copy_bytes, widest, 1)
    if ring_bytes < copy_bytes + ALIGN:
        raise ValueError(f"codegen.nn.offload: a staging ring of {format_bytes(ring_bytes)} "
                         f"cannot hold one copy of {format_bytes(copy_bytes)} (the widest "
                         f"weight row is {format_bytes(widest)}); give staging at least "
                         f"{copy_bytes + ALIGN} bytes")
    spans: list[tuple[int, int]] = []  # (arena_begin, nbytes)
    bias_span = None
    if bias_bytes:
        bias_span = 0
        spans.append((0, bias_bytes))
    open_begin = open_end = -1
    calls_pieces: list[list[tuple[tuple[int, int], int, int]]] = []  # (rows, span, offset)

    def close() -> None:
        nonlocal open_begin, open_end
        if open_begin >= 0:
            spans.append((open_begin, open_end - open_begin))
        open_begin = open_end = -1

    for i in order:
        lay = layouts[i]
        pieces = []
        r = 0
        granule = row_granule(lay.row_bytes, copy_bytes)
        while r < lay.out_features and lay.row_bytes > 0:
            start = lay.weight_offset + r * lay.row_bytes
            adjacent = open_begin >= 0 and start in (open_end, round_up(open_end, ALIGN))
            room = copy_bytes - (start - open_begin) if adjacent else 0
            least = granule * lay.row_bytes
            if r == 0:
                least = lay.weight_bytes if whole_weights else max(least, copy_bytes // 8)
            if room < least:
                close()
                open_begin, room = start, copy_bytes
            rest = lay.out_features - r
            rows = (rest if rest * lay.row_bytes <= room
                    else room // lay.row_bytes // granule * granule)
            open_end = start + rows * lay.row_bytes
            pieces.append(((r, r + rows), len(spans), start - open_begin))
            r += rows
        calls_pieces.append(pieces)
    close()
    ring_at = _ring_places(spans, bias_span, ring_bytes)
    # Waits: the last occupants of each byte of a span's ring bytes before its copy, in
    # the steady state (the second of two laps: the first lap's end is every lap's).
    # Earlier occupants need no wait: the copy of each later one waited for them.
    owners: list[tuple[int, int, int, int]] = []  # (lo, hi, span, lap)
    found: dict[int, set[tuple[int, int]]] = {}
    for lap in (0, 1):
        for j, (_, nbytes) in enumerate(spans):
            at = ring_at[j]
            if at is None:
                continue
            lo, hi = at, at + nbytes
            if lap == 1:
                found[j] = {(k, lap_k - 1) for a, b, k, lap_k in owners if a < hi and lo < b}
            kept = []
            for a, b, k, lap_k in owners:
                if a < lo:
                    kept.append((a, min(b, lo), k, lap_k))
                if b > hi:
                    kept.append((max(a, hi), b, k, lap_k))
            owners = [*kept, (lo, hi, j, lap)]
    made = []
    for j, (begin, nbytes) in enumerate(spans):
        waits = ((j, -1),) if ring_at[j] is None else tuple(sorted(found[j]))
        made.append(Span(j, begin, nbytes, ring_at[j], waits))
    # The last reader of each span in a lap.
    last: dict[int, tuple[int, int]] = {}
    reads_bias = [bias_span is not None and layouts[i].bias_offset is not None and bool(p)
                  for i, p in zip(order, calls_pieces)]
    for c, pieces in enumerate(calls_pieces):
        for p, (_, span, _) in enumerate(pieces):
            last[span] = (c, p)
        if reads_bias[c]:
            last[bias_span] = (c, len(pieces) - 1)  # type: ignore[index]
    calls = []
    for c, pieces in enumerate(calls_pieces):
        made_pieces = []
        for p, (rows, span, offset) in enumerate(pieces):
            frees = tuple(sorted(j for j, at in last.items() if at == (c, p)))
            made_pieces.append(Piece(rows, span, ring_at[span] + offset, frees))  # type: ignore[operator]
        calls.append(Call(c, order[c], tuple(made_pieces),
                          bias_span if reads_bias[c] else None))
    return StreamPlan(layouts, tuple(calls), tuple(made), ring_bytes, bias_bytes, copy_bytes)


def least_staging(linears: list[Resident] | tuple[Resident, ...]) -> int:
    """The least GPU memory that streaming every one of ``linears`` needs, as the caching
    allocator hands it out: a ring holding one copy of the widest weight row, and the
    bias buffer."""
    return _allocated(least_ring(linears)) + _allocated(_bias_block(linears))


def least_ring(linears: list[Resident] | tuple[Resident, ...]) -> int:
    """The smallest ring a copy plan of ``linears`` takes: one copy of the widest row."""
    return max((lay.streamed_row_bytes for lay in linears), default=0) + ALIGN


def _bias_block(linears: list[Resident] | tuple[Resident, ...]) -> int:
    """The bias block of the arena that streams ``linears``: each bias at a multiple of
    ALIGN."""
    return sum(round_up(lay.nbytes - lay.weight_bytes, ALIGN) for lay in linears)


# The caching allocator hands out multiples of this: what each GPU tensor costs.
_ALLOCATOR_ROUNDING = 512


def _allocated(nbytes: int) -> int:
    """GPU bytes a tensor of ``nbytes`` takes from the caching allocator."""
    return round_up(nbytes, _ALLOCATOR_ROUNDING)


def _resident_cost(lay: Resident) -> int:
    """GPU bytes a resident Linear takes: its weight and its bias, each a tensor."""
    bias = lay.nbytes - lay.weight_bytes
    return _allocated(lay.weight_bytes) + (_allocated(bias) if bias else 0)


def place(linears: list[Resident] | tuple[Resident, ...], budget: int, staging: int | None,
          default_staging: int) -> tuple[frozenset[int], int]:
    """Which of ``linears`` (the offloadable ones, in the order the arena lays them out:
    registration order, the forward's where they agree) stay on the GPU under ``budget``
    bytes, and the ring's bytes.

    Before: every Linear streamed. After: the indices of those kept resident, and a ring
    of ``staging`` bytes (default: ``default_staging``, sized by the caller for the step
    the plan is for, or what the budget leaves for it).
    Every GPU tensor is counted as the caching allocator hands it out (in multiples of
    512 bytes), and every bias in the bias buffer, resident or not, so the resident
    weights and biases, the ring and the bias buffer stay within ``budget`` whatever the
    split.

    What it optimizes: the bytes streamed a forward, least for the staging (a decode step
    takes as long as its copies), and their spread: the resident weights are picked at
    even intervals of the forward's bytes (error diffusion, Linear by Linear), so every
    stretch of the forward streams about the same share of its bytes, and the copy engine
    keeps running under the GEMMs of the resident Linears between the streamed ones
    (what a long prefill needs). The forward's ends stay streamed where the budget
    allows (they are kept only where every other Linear that fits already is): its
    lead-in, the Linears that a full ring holds at its start, and its last Linear. Between
    the forward's last streamed read and the next forward's first, the copy engine can
    only fill the ring; a resident Linear at either end lengthens that stretch. A budget
    that holds every Linear keeps them all, with no staging; one below ``least_staging``
    is refused with that minimum, and so is a ``staging`` below the least ring or beyond
    what the budget holds."""
    cost = [_resident_cost(lay) for lay in linears]
    if budget >= sum(cost):
        return frozenset(range(len(linears))), 0
    least = least_staging(linears)
    if budget < least:
        raise ValueError(
            f"codegen.nn.offload: gpu_budget of {budget} bytes ({format_bytes(budget)}) is "
            f"below the least staging that streaming these weights needs: {least} bytes "
            f"({format_bytes(least)}: one copy of the widest weight row, and the biases); "
            f"give gpu_budget >= {least}")
    biases = _allocated(_bias_block(linears))
    smallest = least_ring(linears)
    if staging is None:
        ring = max(min(default_staging, (budget - biases) // _ALLOCATOR_ROUNDING
                       * _ALLOCATOR_ROUNDING), smallest)
    elif staging < smallest:
        raise ValueError(
            f"codegen.nn.offload: staging={staging} bytes cannot hold one copy of the widest "
            f"streamed weight row; give staging >= {smallest} bytes, or leave it to the "
            "budget")
    elif _allocated(staging) + biases > budget:
        raise ValueError(
            f"codegen.nn.offload: staging={staging} bytes ({format_bytes(staging)}) and the "
            f"biases ({format_bytes(biases)}) exceed gpu_budget={budget} bytes "
            f"({format_bytes(budget)}); give a smaller staging, or leave it to the budget")
    else:
        ring = staging
    capacity = budget - _allocated(ring) - biases
    ends = {*range(_lead_in(linears, ring)), len(cost) - 1}
    middle = [i for i in range(len(cost)) if i not in ends]
    share = capacity / max(sum(cost[i] for i in middle), 1)
    kept: set[int] = set()
    used, credit = 0, 0.0
    for i in middle:
        credit += share * cost[i]
        if credit >= cost[i] and used + cost[i] <= capacity:
            kept.add(i)
            used += cost[i]
            credit -= cost[i]
    # What the rounding left: the first that still fit, the forward's ends last.
    for i in [*middle, *sorted(ends)]:
        if i not in kept and used + cost[i] <= capacity:
            kept.add(i)
            used += cost[i]
    return frozenset(kept), ring


def _lead_in(linears: list[Resident] | tuple[Resident, ...], ring: int) -> int:
    """How many of ``linears`` (in forward order) a full ring holds: those whose weights
    start within its first ``ring`` bytes. A forward begins with the ring full of them (the
    last forward queued their copies), and the copy engine waits until the first of them
    has been read; a resident Linear before them only lengthens that wait."""
    at = 0
    for i, lay in enumerate(linears):
        if at >= ring:
            return i
        at += lay.streamed_weight_bytes
    return len(linears)
