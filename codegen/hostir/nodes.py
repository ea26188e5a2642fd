"""The host IR's vocabulary: values (streams, tensors), nodes, the program, and
``verify`` (the invariants every pass keeps)."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..errors import InternalError
from ..frontend import ops
from ..frontend.ir import DEVICES, DTYPE_NAMES, Expr, ParallelType

MAIN_STREAM = "main_stream"

# ---------------------------------------------------------------------------- values


@dataclasses.dataclass(frozen=True)
class Stream:
    """A worker stream of the thread's lease: ``Stream(i % pool)`` or ``Stream(i)``, or
    of the lease's second set of workers, ``Stream(4 + i % 4)`` (``base`` = the pool:
    a loop whose copies run ahead under the loop before it, see ``assign_streams``)."""

    index: str
    pool: int | None = None
    base: int = 0

    def __str__(self) -> str:
        return f"Stream({self.position_str()})"

    def position_str(self) -> str:
        """``i % 4``, ``i`` or ``4 + i % 4``: which stream of the lease."""
        k = f"{self.index} % {self.pool}" if self.pool else self.index
        return f"{self.base} + {k}" if self.base else k

    def slot_str(self) -> str:
        """``i % 4`` or ``i``: which staging slot of the loop's stage (the base apart)."""
        return f"{self.index} % {self.pool}" if self.pool else self.index

    def position(self, env: Mapping[str, int]) -> int:
        """The stream's position in the lease for the loop index in ``env``."""
        return self.base + self.slot(env)

    def slot(self, env: Mapping[str, int]) -> int:
        k = env[self.index]
        return k % self.pool if self.pool else k


@dataclasses.dataclass(frozen=True)
class CopyStream:
    """The one stream that queues a stream loop's host-to-device copies
    (``lower(..., copy_stream=True)``, see ``queue_copies_in``): position ``pool`` of the
    pool, after every worker a loop can use, so it is never one of them."""

    pool: int

    def __str__(self) -> str:
        return "CopyStream"

    def position_str(self) -> str:
        return str(self.pool)

    def position(self, env: Mapping[str, int]) -> int:
        return self.pool


# The lease position of the ring stream: after the workers, the copy stream and the second
# set of workers (2 * the most workers a pool has: lowering.MAX_POOL_SIZE, kMaxWorkers).
RING_POSITION = 64


@dataclasses.dataclass(frozen=True)
class RingStream:
    """The stream that queues the copies into the thread's staging ring
    (``lower(..., staging="ring")``, see ``stage_in_ring``). One per thread and device
    (the lease's), shared by every program that stages in the ring, and never forked from
    the caller's stream: its copies queue behind the previous call's, and run under that
    call's last GEMMs."""

    def __str__(self) -> str:
        return "RingStream"

    def position_str(self) -> str:
        return str(RING_POSITION)

    def position(self, env: Mapping[str, int]) -> int:
        return RING_POSITION


# A worker stream, the copy stream, the ring stream, or the named value of GetCurrentStream.
StreamRef = Stream | CopyStream | RingStream | str


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[Expr, ...]
    device: str = "cuda"  # "cuda": the op's GPU; "cpu": host memory (see ir.DEVICES)

    def type_str(self) -> str:
        return f"{DTYPE_NAMES[self.dtype]}[{', '.join(map(str, self.shape))}]"

    def placement_str(self) -> str:
        """`` device=cpu`` for host tensors, nothing for the GPU (the default)."""
        return "" if self.device == "cuda" else f" device={self.device}"


# ---------------------------------------------------------------------------- nodes


class Node:
    # The fields that hold tensor names (what ``_renamed`` rewrites).
    tensor_fields: ClassVar[tuple[str, ...]] = ()

    def children(self) -> list[Node]:
        return []

    def writes(self) -> list[str]:
        """Tensor values (already allocated, or views) whose elements this node writes."""
        return []

    def uses(self) -> list[str]:
        """Tensor values this node reads."""
        return []

    def defines(self) -> list[str]:
        """Tensor values this node defines."""
        return []

    def renamed(self, mapping: Mapping[str, str]) -> Node:
        """This node (a new one if anything changed) with tensor names replaced."""
        changes = {f: mapping[v] for f in self.tensor_fields
                   if (v := getattr(self, f)) in mapping}
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore


@dataclasses.dataclass(eq=False)
class Allocate(Node):
    """A new tensor on ``out.device``; ``pinned`` host memory (page-locked, so copies to
    and from the GPU run asynchronously on a stream) for host outputs; ``zeroed``: filled
    with zeros on the current stream (the start of a sum that slices accumulate into)."""

    out: TensorInfo
    pinned: bool = False
    zeroed: bool = False

    def defines(self) -> list[str]:
        return [self.out.name]

    def writes(self) -> list[str]:
        return [self.out.name] if self.zeroed else []

    def __str__(self) -> str:
        where = f", device={self.out.device}" if self.out.device != "cuda" else ""
        pinned = ", pinned=True" if self.pinned else ""
        zeroed = ", zeroed=True" if self.zeroed else ""
        return f"{self.out.name} = Allocate({self.out.type_str()}{where}{pinned}{zeroed})"


@dataclasses.dataclass(eq=False)
class Deallocate(Node):
    tensor: str
    tensor_fields: ClassVar[tuple[str, ...]] = ("tensor",)

    def uses(self) -> list[str]:
        return [self.tensor]

    def __str__(self) -> str:
        return f"Deallocate({self.tensor})"


@dataclasses.dataclass(eq=False)
class GetCurrentStream(Node):
    out: str = MAIN_STREAM

    def __str__(self) -> str:
        return f"{self.out} = GetCurrentStream()"


@dataclasses.dataclass(eq=False)
class SetCurrentStream(Node):
    stream: StreamRef

    def __str__(self) -> str:
        return f"SetCurrentStream({self.stream})"


@dataclasses.dataclass(eq=False)
class Synchronize(Node):
    """The current stream waits for ``stream`` (an event wait; the host never blocks)."""

    stream: StreamRef

    def __str__(self) -> str:
        return f"Synchronize({self.stream})"


@dataclasses.dataclass(eq=False)
class ForLoop(Node):
    index: str
    start: Expr
    stop: Expr
    body: list[Node]
    parallel: ParallelType = ParallelType.Serial

    def children(self) -> list[Node]:
        return self.body

    def __str__(self) -> str:
        tag = " [Stream]" if self.parallel is ParallelType.Stream else ""
        return f"for {self.index} in range({self.start}, {self.stop}){tag}:"


@dataclasses.dataclass(eq=False)
class ShardByStream(Node):
    """``out`` = slice ``index`` of ``tensor`` along ``axis``: elements
    ``[index*chunk, min((index+1)*chunk, n))``, clamped to n (so it may be empty)."""

    out: str
    tensor: str
    axis: int
    index: str
    chunk: Expr
    tensor_fields: ClassVar[tuple[str, ...]] = ("out", "tensor")

    def uses(self) -> list[str]:
        return [self.tensor]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        return (f"{self.out} = ShardByStream({self.tensor}, axis={self.axis}, "
                f"index={self.index}, chunk={self.chunk})")


@dataclasses.dataclass(frozen=True)
class Apply:
    """An op applied to values: ``op`` names an ``ops.OpDef``; each argument is a tensor
    value's name, a nested Apply (fused: computed in the same kernel, or in a GEMM's
    epilogue, never stored), or None (an absent optional operand); ``attrs`` are
    (name, value) pairs in the definition's order. Prints as the host IR spells it:
    ``Mul(Silu(T3_i), T4_i)``."""

    op: str
    args: tuple[Apply | str | None, ...]
    attrs: tuple[tuple[str, object], ...] = ()

    @property
    def defn(self) -> ops.OpDef:
        return ops.get(self.op)

    def leaves(self) -> list[str]:
        """The tensor values read, in order of first appearance."""
        out: dict[str, None] = {}
        for a in self.args:
            if isinstance(a, Apply):
                out.update(dict.fromkeys(a.leaves()))
            elif a is not None:
                out[a] = None
        return list(out)

    def renamed(self, mapping: Mapping[str, str]) -> Apply:
        args = tuple(a.renamed(mapping) if isinstance(a, Apply)
                     else mapping.get(a, a) if a is not None else None for a in self.args)
        return dataclasses.replace(self, args=args)

    def operands(self) -> dict[str, Apply | str]:
        """The arguments by the definition's operand names (absent optional ones left out)."""
        return {n: a for n, a in zip(self.defn.operands, self.args) if a is not None}

    def rank(self, ranks: Mapping[str, int]) -> int:
        """The rank of the result, from the ranks of the values read (``ranks``)."""
        groups = self.defn.axes(self._arg_ranks(ranks), dict(self.attrs))
        return sum(not g.reduction for g in groups)

    def _arg_ranks(self, ranks: Mapping[str, int]) -> dict[str, int]:
        return {n: a.rank(ranks) if isinstance(a, Apply) else ranks[a]
                for n, a in self.operands().items()}

    def read_axes(self, ranks: Mapping[str, int], axes: tuple[int | None, ...] | None = None
                  ) -> list[tuple[str, tuple[int | None, ...]]]:
        """Each value read (once per place it is read), with the axis of the result each
        of its axes runs along, through the axis roles of the ops on the way (None: along
        none of them, as a grouped dequantize's scale groups). ``Add(Dequantize(q, s), b)``
        of a ``[n, k]`` result reads q along ``(0, 1)``, s ``[n]`` along ``(0,)`` and a
        bias b ``[k]`` along ``(1,)``. ``axes`` maps this op's result axes (default: the
        identity)."""
        arg_ranks = self._arg_ranks(ranks)
        groups = [g for g in self.defn.axes(arg_ranks, dict(self.attrs)) if not g.reduction]
        if axes is None:
            axes = tuple(range(len(groups)))
        found: list[tuple[str, tuple[int | None, ...]]] = []
        for name, arg in self.operands().items():
            along: list[int | None] = [None] * arg_ranks[name]
            for g in groups:
                for member, d in g.members:
                    if member == name:
                        along[d] = axes[g.output_axis()]
            found += (arg.read_axes(ranks, tuple(along)) if isinstance(arg, Apply)
                      else [(arg, tuple(along))])
        return found

    def parts(self) -> list[str]:
        """The printed arguments: values, then ``name=value`` attributes."""
        return [str(a) for a in self.args if a is not None] + \
            [f"{k}={ops.attr_str(v)}" for k, v in self.attrs]

    def __str__(self) -> str:
        return f"{self.defn.node}({', '.join(self.parts())})"


@dataclasses.dataclass(eq=False, init=False)
class Compute(Node):
    """``out`` (already allocated, possibly a slice) = ``expr``, queued on the current
    stream: a GEMM (``Matmul(T0, T1_i, out=T2_i)``), a GEMM with its epilogue
    (``Gelu(Linear(T0, T1_i, T2_i), approximate=tanh, out=T3_i)``: cuBLASLt applies the
    activation before rounding), or a pointwise expression computed by one kernel
    (``Mul(Silu(T3_i), T4_i, out=T5_i)``). The node's class is named for the op at the
    root of ``expr`` (``Matmul``, ``Linear``, ``Silu``, ... see ``node_class``), so
    ``isinstance(n, hostir.Matmul)`` reads as the dump does.

    ``accumulate``: the GEMM adds its product onto ``out`` instead of overwriting it
    (``Matmul(T0_i, T1_s, out=T2, accumulate=True)``: a contraction split over the slices
    of a stream loop, ``out`` zeroed by its Allocate).

    Built either from an expression, ``Compute.of(expr, out)``, or as one op applied to
    values, ``Matmul("T2_i", "T0", "T1_i")`` (out first, then the operands in the
    definition's order, attributes by keyword)."""

    out: str
    expr: Apply
    accumulate: bool
    defn: ClassVar[ops.OpDef | None] = None  # the root op of the class's nodes

    def __init__(self, out: str, *args: str | None, expr: Apply | None = None,
                 accumulate: bool = False, **attrs: object) -> None:
        if expr is None:
            if self.defn is None:
                raise InternalError("Compute needs expr= or a node class of one op")
            names = self.defn.attrs
            if set(attrs) - set(names):
                raise InternalError(f"{self.defn.node}: unknown attributes {sorted(attrs)}")
            expr = Apply(self.defn.name, args, tuple((k, attrs[k]) for k in names if k in attrs))
        if accumulate and (not expr.defn.is_gemm or not expr.defn.accumulates or
                           "bias" in expr.operands()):
            raise InternalError(f"{expr}: only a GEMM without bias accumulates, and not "
                                "a row sum")
        self.out, self.expr, self.accumulate = out, expr, accumulate

    @staticmethod
    def of(expr: Apply, out: str, accumulate: bool = False) -> Compute:
        return NODE_CLASSES[expr.op](out, expr=expr, accumulate=accumulate)

    def __getattr__(self, name: str) -> str | Apply | None:
        """The root op's operands by name (``node.a``, ``node.bias``: None if absent)."""
        expr = self.__dict__.get("expr")
        if expr is not None and name in expr.defn.operands:
            return expr.operands().get(name)
        raise AttributeError(name)

    def uses(self) -> list[str]:
        return [*self.expr.leaves(), self.out]

    def reads(self) -> list[str]:
        return [*self.expr.leaves(), *([self.out] if self.accumulate else [])]

    def writes(self) -> list[str]:
        return [self.out]

    def renamed(self, mapping: Mapping[str, str]) -> Compute:
        return Compute.of(self.expr.renamed(mapping), mapping.get(self.out, self.out),
                          self.accumulate)

    @property
    def gemm(self) -> Apply | None:
        """The GEMM this node runs (at the root, or under its epilogue), or None."""
        e = self.expr
        if e.defn.is_pointwise and len(e.args) == 1 and isinstance(e.args[0], Apply):
            e = e.args[0]
        return e if e.defn.is_gemm else None

    @property
    def epilogue(self) -> Apply | None:
        """The pointwise op applied in the GEMM's epilogue, or None."""
        return self.expr if self.gemm is not None and self.expr.defn.is_pointwise else None

    def __str__(self) -> str:
        acc = ["accumulate=True"] if self.accumulate else []
        return f"{self.expr.defn.node}({', '.join([*self.expr.parts(), f'out={self.out}', *acc])})"


def node_class(defn: ops.OpDef) -> type[Compute]:
    """The Compute subclass of nodes whose root op is ``defn``, named as it prints."""
    doc = f"``out`` = {defn.node}(...) (see Compute and codegen.frontend.ops.{defn.name.upper()})."
    return type(defn.node, (Compute,), {"defn": defn, "__doc__": doc, "__module__": __name__})


NODE_CLASSES: dict[str, type[Compute]] = {name: node_class(d) for name, d in ops.OPS.items()}
Matmul = NODE_CLASSES["matmul"]
Linear = NODE_CLASSES["linear"]


@dataclasses.dataclass(eq=False)
class Copy(Node):
    """``out`` (already allocated, possibly a slice) = ``src``, same shape, any two devices
    (host <-> GPU), queued on the current stream. From or to pinned host memory it is
    asynchronous for the host; a strided slice (a column block of a row-major matrix) is
    one 2-D copy."""

    src: str
    out: str
    tensor_fields: ClassVar[tuple[str, ...]] = ("src", "out")

    def uses(self) -> list[str]:
        return [self.src, self.out]

    def writes(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        return f"Copy({self.src}, out={self.out})"


@dataclasses.dataclass(eq=False)
class StagingSlot(Node):
    """``out`` = the staging slot of stream ``slot`` in ``stage``, shaped like ``like``.

    ``stage`` is a GPU tensor ``[slots, *chunk_shape]`` allocated before a stream loop
    with one slot per worker stream (``stream_count``), so the GPU holds at most that
    many slices of a host operand, never the whole of it. ``out`` is slot ``slot``'s
    first ``like.numel()`` elements viewed contiguously (row-major) with ``like``'s shape,
    so a ragged last slice is a dense block too.

    Reuse is safe by stream order alone: ``slot`` is the iteration's worker stream
    (``worker_stream``, the same value ``assign_streams`` switches to; ``verify`` checks
    it), so slot k is only touched by the iterations on ``Stream(k)``, in loop order; the
    copy of iteration i + pool into slot k is queued on ``Stream(k)`` behind the GEMM and
    the copies of iteration i that used it. No event, no host wait. (With a copy stream,
    ``queue_copies_in``, the copy into slot k first waits for ``Stream(k)``.)
    """

    out: str
    stage: str
    slot: Stream
    like: str
    tensor_fields: ClassVar[tuple[str, ...]] = ("out", "stage", "like")

    def uses(self) -> list[str]:
        return [self.stage, self.like]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        return (f"{self.out} = StagingSlot({self.stage}, slot={self.slot.slot_str()}, "
                f"like={self.like})")


@dataclasses.dataclass(eq=False)
class RingSlot(Node):
    """``out`` = GPU memory of the thread's staging ring, shaped (dense) like ``like``,
    taken on the current stream (the ring stream), which first waits for the event that
    the last reader of those bytes recorded (``ReleaseRingSlot``), in this call or an
    earlier one of any program that stages in the ring. The ring grows to hold at least
    ``slots`` such slices (the loop's streams, and one more that the next copy fills
    while they compute); it holds nothing from one call to the next but those events.
    (``slots`` counts slices, not iterations: a loop that copies two slices an iteration
    runs its copies about half as many iterations ahead of its GEMMs, enough where the
    copies are the slower part.)

    ``out.shape`` is the loop's slice shape (a ragged last slice takes its first
    elements, as a ``StagingSlot`` does)."""

    out: TensorInfo
    like: str
    slots: int
    tensor_fields: ClassVar[tuple[str, ...]] = ("like",)

    def uses(self) -> list[str]:
        return [self.like]

    def defines(self) -> list[str]:
        return [self.out.name]

    def renamed(self, mapping: Mapping[str, str]) -> Node:
        return dataclasses.replace(
            self, out=dataclasses.replace(self.out, name=mapping.get(self.out.name, self.out.name)),
            like=mapping.get(self.like, self.like))

    def __str__(self) -> str:
        return f"{self.out.name} = RingSlot(like={self.like}, slots={self.slots})"


@dataclasses.dataclass(eq=False)
class ReleaseRingSlot(Node):
    """The bytes of ring slot ``slot`` are free for the next ``RingSlot`` once the current
    stream has run what is queued on it so far (its last reader): an event, recorded."""

    slot: str
    tensor_fields: ClassVar[tuple[str, ...]] = ("slot",)

    def uses(self) -> list[str]:
        return [self.slot]

    def __str__(self) -> str:
        return f"ReleaseRingSlot({self.slot})"


@dataclasses.dataclass(eq=False)
class StreamSynchronize(Node):
    """The host waits until ``stream`` has finished everything queued on it (unlike
    ``Synchronize``, which only orders two streams). Ends a program with host outputs,
    so that they are complete when it returns."""

    stream: StreamRef

    def __str__(self) -> str:
        return f"StreamSynchronize({self.stream})"


@dataclasses.dataclass(frozen=True)
class Event:
    """Event ``slot`` of an event array made by ``CreateEvents``: ``T1_free[i % 4]``.
    Recorded on one stream, waited for on another: the waiting stream is then ordered
    after exactly the work queued before the record, not after everything its stream
    got later (what ``Synchronize`` waits for)."""

    name: str
    slot: Stream | int  # which event of the array: the staging slot it guards, or a fixed one

    def position_str(self) -> str:
        return str(self.slot) if isinstance(self.slot, int) else self.slot.slot_str()

    def position(self, env: Mapping[str, int]) -> int:
        return self.slot if isinstance(self.slot, int) else self.slot.slot(env)

    def __str__(self) -> str:
        return f"{self.name}[{self.position_str()}]"


@dataclasses.dataclass(eq=False)
class CreateEvents(Node):
    """``name`` = ``count`` events, none recorded yet in this call (waiting for an event
    not yet recorded waits for nothing)."""

    name: str
    count: Expr

    def defines(self) -> list[str]:
        return [self.name]

    def __str__(self) -> str:
        return f"{self.name} = CreateEvents({self.count})"


@dataclasses.dataclass(eq=False)
class RecordEvent(Node):
    """``event`` marks the work queued on the current stream so far."""

    event: Event

    def __str__(self) -> str:
        return f"RecordEvent({self.event})"


@dataclasses.dataclass(eq=False)
class WaitEvent(Node):
    """The current stream waits for the last record of ``event`` in this call (nothing if
    it was not recorded yet); the host never blocks."""

    event: Event

    def __str__(self) -> str:
        return f"WaitEvent({self.event})"


# ---------------------------------------------------------------------------- program


@dataclasses.dataclass(frozen=True)
class Constraint:
    """Two extents an op needs equal, that the input checks do not already tie."""

    lhs: Expr
    rhs: Expr
    what: str  # e.g. "matmul T2: T0 axis 1 and T1 axis 0"


# Where a program's streamed host slices land on the GPU: "slots", staging allocated per call
# with one slot per worker stream (StagingSlot); "ring", the thread's staging ring, whose
# copies run ahead of the caller's stream and across calls (RingSlot, stage_in_ring).
STAGINGS = ("slots", "ring")

# What a program's GEMMs call: "cublaslt", cached cuBLASLt plans on the worker streams (the
# default), or "cublas", one cublasGemmEx per GEMM.
GEMM_LIBRARIES = ("cublaslt", "cublas")


@dataclasses.dataclass(frozen=True)
class StreamedMatmul:
    """A loop of one matmul ``out = a @ host`` that streams ``host [k, n]`` (row-major, in
    host memory) by ``slices`` blocks of ``column_block`` columns, and could stream it by
    blocks of rows instead (``passes.split_contractions``)."""

    out: str
    a: str
    host: str
    m: Expr
    k: Expr
    n: Expr
    slices: Expr
    column_block: Expr
    dtype: torch.dtype
    out_dtype: torch.dtype

    def extents(self) -> tuple[Expr, ...]:
        return (self.m, self.k, self.n, self.slices, self.column_block)

    def __str__(self) -> str:
        return (f"{self.out} = {self.a}[{self.m}, {self.k}] @ {self.host}[{self.k}, {self.n}] "
                f"in {self.slices} slices")


@dataclasses.dataclass(frozen=True)
class ContractionChoice:
    """What a program lowered with ``split_contraction="auto"`` weighs between streaming
    its host operands by blocks of columns and by blocks of rows: the loops that could
    change, and, where every extent they weigh is a constant, ``codegen.transforms.cost``'s
    estimates of both (``estimate``, as printed). The choice itself is made by the cost
    model, at lowering or per call (``codegen.dispatch``); the host IR only records it."""

    matmuls: tuple[StreamedMatmul, ...]
    estimate: str = ""  # "columns 6.73 ms, rows 8.63 ms estimated" where known()

    def known(self) -> bool:
        """Whether every extent the choice weighs is a constant."""
        return not any(list(e.symbols()) for mm in self.matmuls for e in mm.extents())

    def __str__(self) -> str:
        return "; ".join(map(str, self.matmuls))


@dataclasses.dataclass(frozen=True)
class Options:
    """How a program was lowered, as one value (``lower``'s options, validated there)."""

    pool_size: int = 4
    gemm_sm_count: int = 0  # SMs each GEMM may use (cuBLASLt's SM_COUNT_TARGET); 0 = all
    gemm_library: str = "cublaslt"  # one of GEMM_LIBRARIES
    copy_stream: bool = False  # host-to-device copies on one stream (queue_copies_in)
    staging: str = "slots"  # one of STAGINGS: where streamed host slices land on the GPU
    split_contraction: bool = False  # column blocks of host operands streamed as row blocks


@dataclasses.dataclass(eq=False)
class HostProgram:
    name: str
    inputs: list[TensorInfo]
    outputs: list[str]
    body: list[Node]
    constraints: list[Constraint] = dataclasses.field(default_factory=list)
    options: Options = dataclasses.field(default_factory=Options)
    # split_contraction="auto": what the choice weighs, and the program that streams by rows
    # where the choice is left to the call (this one streams by columns); where the lowering
    # knew every extent, the choice it made, and no alternative.
    choice: ContractionChoice | None = None
    alternative: HostProgram | None = None
    # The user's fusion this program was lowered from, for its backward (codegen.runtime.autograd);
    # None for a program with no backward (a backward itself). Not part of the program:
    # its nodes say everything it runs, so the digest and equality leave it out.
    source: Any = dataclasses.field(default=None, compare=False, repr=False,
                                    metadata={"digest": False})

    # The options, read as the program's own (``program.pool_size``); set through
    # ``options``.
    @property
    def pool_size(self) -> int:
        return self.options.pool_size

    @property
    def gemm_sm_count(self) -> int:
        return self.options.gemm_sm_count

    @property
    def gemm_library(self) -> str:
        return self.options.gemm_library

    @property
    def copy_stream(self) -> bool:
        return self.options.copy_stream

    @property
    def staging(self) -> str:
        return self.options.staging

    @property
    def split_contraction(self) -> bool:
        return self.options.split_contraction

    def nodes(self) -> Iterator[Node]:
        """Every node in program order, loop bodies included (pre-order)."""

        def walk(nodes: list[Node]) -> Iterator[Node]:
            for n in nodes:
                yield n
                yield from walk(n.children())

        yield from walk(self.body)

    def replace(self, **changes: object) -> HostProgram:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def allocations(self) -> dict[str, TensorInfo]:
        return {n.out.name: n.out for n in self.nodes() if isinstance(n, Allocate)}

    def signature(self) -> str:
        args = ", ".join(f"{t.name}: {t.type_str()}{t.placement_str()}" for t in self.inputs)
        options = [f"gemm_sm_count={self.gemm_sm_count}"] if self.gemm_sm_count else []
        if self.gemm_library != "cublaslt":
            options.append(f"gemm_library={self.gemm_library}")
        if self.copy_stream and self.staging == "slots":  # a ring implies its copy stream
            options.append("copy_stream")
        if self.staging != "slots":
            options.append(f"staging={self.staging}")
        if self.choice is not None:
            options.append("split_contraction=auto")
        elif self.split_contraction:
            options.append("split_contraction")
        shown = f" [{', '.join(options)}]" if options else ""
        return f"HostProgram {self.name}({args}) -> ({', '.join(self.outputs)}){shown}:"

    def __str__(self) -> str:
        lines = [self.signature()]
        lines += [f"  # {line}" for line in self.choice_lines()]

        def emit(nodes: list[Node], depth: int) -> None:
            for n in nodes:
                lines.append("  " * depth + str(n))
                emit(n.children(), depth + 1)

        emit(self.body, 1)
        lines.append(f"  return {', '.join(self.outputs)}")
        if self.alternative is not None:
            lines.append(str(self.alternative.replace(choice=None)))
        return "\n".join(lines)

    def choice_lines(self) -> list[str]:
        """``choice_str`` wrapped for a comment (none without a choice)."""
        return textwrap.wrap(self.choice_str(), 92) if self.choice is not None else []

    def choice_str(self) -> str:
        """What ``split_contraction="auto"`` chose, or how the call chooses."""
        assert self.choice is not None
        hosts = ", ".join(dict.fromkeys(mm.host for mm in self.choice.matmuls))
        if self.alternative is not None and self.choice.known():
            how = (f"{hosts} streamed by blocks of rows (its alternative; "
                   f"{self.choice.estimate}), or of columns (this program) where "
                   f"{hosts} is not row-major")
        elif self.alternative is not None:
            how = (f"{hosts} streamed by blocks of columns (this program) or of rows (its "
                   f"alternative), whichever codegen.transforms.cost estimates faster for the "
                   f"call's extents")
        else:
            made = "rows" if self.split_contraction else "columns"
            how = f"{hosts} streamed by blocks of {made}: {self.choice.estimate}"
        return f"split_contraction=auto: {self.choice}; {how}"


class _FreshNames:
    """Names no value of ``program`` has: ``base``, else ``base2``, ``base3``, ..."""

    def __init__(self, program: HostProgram) -> None:
        self.taken = {t.name for t in program.inputs} | set(program.outputs)
        self.taken |= {d for n in program.nodes() for d in n.defines()}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}{k}"
        self.taken.add(name)
        return name


# ---------------------------------------------------------------------------- verify


def verify(program: HostProgram) -> HostProgram:
    """Checks the invariants every pass must keep: each tensor is defined before it is
    used, defined once per scope, and stream nodes name a stream that exists."""
    has_main = False

    def check(nodes: list[Node], scope: set[str], in_loop: bool) -> set[str]:
        """Returns what is defined after ``nodes``."""
        nonlocal has_main
        local = set(scope)
        for n in nodes:
            for u in n.uses():
                if u not in local:
                    raise InternalError(f"{n}: uses {u} before it is defined\n{program}")
            for d in n.defines():
                if d in local:
                    raise InternalError(f"{n}: redefines {d}\n{program}")
                local.add(d)
            if isinstance(n, GetCurrentStream):
                has_main = True
            if isinstance(n, Compute) and n.gemm is not None and \
                    any(isinstance(a, Apply) for a in n.gemm.args):
                raise InternalError(f"{n}: a GEMM's operands must be values\n{program}")
            if isinstance(n, (SetCurrentStream, Synchronize, StreamSynchronize)):
                s = n.stream
                if isinstance(s, str) and not has_main:
                    raise InternalError(f"{n}: {s} is not defined\n{program}")
                if isinstance(s, Stream) and not in_loop:
                    raise InternalError(f"{n}: worker stream outside a loop\n{program}")
            if isinstance(n, ForLoop):
                check(n.body, local, True)
            if isinstance(n, Deallocate):
                local.discard(n.tensor)
            if isinstance(n, ReleaseRingSlot):  # its bytes may hold the next slice
                local.discard(n.slot)
        return local

    defined = check(program.body, {t.name for t in program.inputs}, False)
    for o in program.outputs:
        if o not in defined:
            raise InternalError(f"output {o} is not defined at the end\n{program}")
    _verify_residency(program)
    return program


def _verify_residency(program: HostProgram) -> None:
    """Devices are known; a staging slot is used inside a stream loop and is the slot of
    the stream that the loop runs on (once streams are assigned)."""
    for t in [*program.inputs, *program.allocations().values()]:
        if t.device not in DEVICES:
            raise InternalError(f"{t.name}: unknown device {t.device!r}\n{program}")
    in_loops: set[int] = set()
    for loop in program.nodes():
        if not isinstance(loop, ForLoop):
            continue
        streams = [n.stream for n in loop.body
                   if isinstance(n, SetCurrentStream) and isinstance(n.stream, Stream)]
        for n in loop.body:
            if isinstance(n, StagingSlot):
                in_loops.add(id(n))
                if loop.parallel is not ParallelType.Stream or n.slot.index != loop.index:
                    raise InternalError(f"{n}: not indexed by a stream loop\n{program}")
                if streams and dataclasses.replace(streams[0], base=0) != n.slot:
                    raise InternalError(f"{n}: slot differs from the loop's stream "
                                        f"{streams[0]}\n{program}")
    stray = [n for n in program.nodes() if isinstance(n, StagingSlot) and id(n) not in in_loops]
    if stray:
        raise InternalError(f"{stray[0]}: staging slot outside a loop\n{program}")
