"""Host IR: the host program that loops over stream slices, and the passes over it.

Instructions are verbs (``SetCurrentStream``, ``Synchronize``), values are nouns (a tensor
name, ``Stream(i % 4)``, the caller's stream ``main_stream``). ``str(program)`` is the one
official dump: one node per line, loop bodies indented; the C++ renderer puts each of these
lines above the statements it emits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from . import ops
from .errors import InternalError
from .ir import DEVICES, DTYPE_NAMES, Const, Expr, ParallelType, minimum

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
        if accumulate and (not expr.defn.is_gemm or "bias" in expr.operands()):
            raise InternalError(f"{expr}: only a GEMM without bias accumulates")
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
    doc = f"``out`` = {defn.node}(...) (see Compute and codegen.ops.{defn.name.upper()})."
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


@dataclasses.dataclass(eq=False)
class HostProgram:
    name: str
    inputs: list[TensorInfo]
    outputs: list[str]
    body: list[Node]
    constraints: list[Constraint] = dataclasses.field(default_factory=list)
    pool_size: int = 4
    gemm_sm_count: int = 0  # SMs each GEMM may use (cuBLASLt's SM_COUNT_TARGET); 0 = all
    gemm_library: str = "cublaslt"  # one of GEMM_LIBRARIES
    copy_stream: bool = False  # host-to-device copies on one stream (queue_copies_in)
    staging: str = "slots"  # one of STAGINGS: where streamed host slices land on the GPU
    split_contraction: bool = False  # column blocks of host operands streamed as row blocks
    # The user's fusion this program was lowered from, for its backward (codegen.autograd);
    # None for a program with no backward (a backward itself). Not part of the program:
    # its nodes say everything it runs, so the digest and equality leave it out.
    source: Any = dataclasses.field(default=None, compare=False, repr=False,
                                    metadata={"digest": False})

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
        if self.split_contraction:
            options.append("split_contraction")
        shown = f" [{', '.join(options)}]" if options else ""
        return f"HostProgram {self.name}({args}) -> ({', '.join(self.outputs)}){shown}:"

    def __str__(self) -> str:
        lines = [self.signature()]

        def emit(nodes: list[Node], depth: int) -> None:
            for n in nodes:
                lines.append("  " * depth + str(n))
                emit(n.children(), depth + 1)

        emit(self.body, 1)
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)


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


# ---------------------------------------------------------------------------- passes

HostPass = Callable[[HostProgram], HostProgram]


def _map_stream_loops(
    program: HostProgram, fn: Callable[[ForLoop], list[Node]]
) -> HostProgram:
    body: list[Node] = []
    for n in program.body:
        if isinstance(n, ForLoop) and n.parallel is ParallelType.Stream:
            body.extend(fn(n))
        else:
            body.append(n)
    return program.replace(body=body)


def worker_stream(loop: ForLoop, pool: int) -> Stream:
    """The worker stream of an iteration of a stream loop: ``Stream(i % pool)``, or
    ``Stream(i)`` when the loop never has more iterations than the pool. The one rule
    for both ``assign_streams`` and the staging slots (``StagingSlot``)."""
    fits = isinstance(loop.stop, Const) and loop.stop.value <= pool
    return Stream(loop.index, None if fits else pool)


def stream_count(loop: ForLoop, pool: int) -> Expr:
    """How many worker streams (and staging slots) a stream loop uses."""
    return minimum(loop.stop, Const(pool))


def on_caller_stream(loop: ForLoop, pool: int) -> bool:
    """Whether a stream loop runs on one stream only (one slice, or ``pool_size=1``):
    then its iterations stay on the caller's stream, which orders them as a worker
    would, without the events and stream switches of a fork and a join."""
    count = stream_count(loop, pool)
    return pool <= 1 or (isinstance(count, Const) and count.value <= 1)


def assign_streams(program: HostProgram) -> HostProgram:
    """Puts each stream loop's iteration on a worker stream from a bounded pool.

    Before:  for i in range(0, 8) [Stream]:  Matmul(...)
    After:   for i in range(0, 8) [Stream]:  SetCurrentStream(Stream(i % 4)); Matmul(...)
    (``Stream(i)`` when the loop never has more iterations than the pool; a loop that
    would use one stream keeps the caller's, ``on_caller_stream``.)
    Without a copy stream, a loop that copies host slices in right after another stream
    loop takes the lease's second set of workers, ``Stream(4 + i % 4)``, so that its
    copies can run under the loop before it (``run_copies_ahead``).
    """
    pool = program.pool_size
    previous_base: int | None = None  # the set of the last stream loop on workers

    def assign(loop: ForLoop) -> list[Node]:
        nonlocal previous_base
        if on_caller_stream(loop, pool):
            previous_base = None
            return [loop]
        ahead = not program.copy_stream and previous_base == 0 and bool(_copies_in(loop.body))
        worker = dataclasses.replace(worker_stream(loop, pool), base=pool if ahead else 0)
        previous_base = worker.base
        body = [SetCurrentStream(worker), *loop.body]
        return [dataclasses.replace(loop, body=body)]

    return _map_stream_loops(program, assign)


def order_accumulation(program: HostProgram) -> HostProgram:
    """Orders the slices of a contraction split over a stream loop: a GEMM that adds its
    slice's product onto ``out`` (``accumulate=True``) runs after the previous slice's,
    which another worker queued.

    Before:  for i in range(0, 8) [Stream]:
               SetCurrentStream(Stream(i % 4)); ...
               Matmul(T0_i, T1_s, out=T2, accumulate=True)
    After:   T2_sum = CreateEvents(1)
             for i in range(0, 8) [Stream]:
               SetCurrentStream(Stream(i % 4)); ...
               WaitEvent(T2_sum[0])
               Matmul(T0_i, T1_s, out=T2, accumulate=True)
               RecordEvent(T2_sum[0])
    One event per sum: slice i's GEMM waits for the last record, slice i - 1's GEMM (the
    first waits for nothing), and for nothing else its worker queued (the copies of the
    next slices, a copy out) so those keep running under the sum. A loop on the caller's
    stream (``on_caller_stream``) is in order already and is left alone."""
    pool = program.pool_size

    def order(loop: ForLoop) -> list[Node]:
        sums = [n for n in loop.body if isinstance(n, Compute) and n.accumulate]
        if not sums or on_caller_stream(loop, pool):
            return [loop]
        made: list[Node] = []
        body: list[Node] = []
        for n in loop.body:
            if any(n is c for c in sums):
                event = Event(f"{n.out}_sum", 0)
                made.append(CreateEvents(event.name, Const(1)))
                body += [WaitEvent(event), n, RecordEvent(event)]
            else:
                body.append(n)
        return [*made, dataclasses.replace(loop, body=body)]

    return _map_stream_loops(program, order)


def _loop_worker(loop: ForLoop) -> Stream | None:
    first = loop.body[0] if loop.body else None
    if isinstance(first, SetCurrentStream) and isinstance(first.stream, Stream):
        return first.stream
    return None


def _runs_ahead(n: Node) -> bool:
    """A stream loop on the lease's second set of workers (``assign_streams``)."""
    worker = _loop_worker(n) if isinstance(n, ForLoop) else None
    return worker is not None and worker.base > 0


def run_copies_ahead(program: HostProgram) -> HostProgram:
    """Lets a loop on the second set of workers copy its host slices in while the loop
    before it still runs: its copies go first in each iteration, and only then does the
    worker wait for the caller's stream (which has joined the loop before); its staging
    is allocated before the loop before, and its fork comes before that loop's fork
    (``insert_fork_join``), so nothing orders its first copies after the loop before.

    Before:  for i ... [Stream]: (loop 1)
             ...; T3_stage = Allocate(...)
             for i ... [Stream]: SetCurrentStream(Stream(4 + i % 4))
               T3_i = ShardByStream(...); T3_s = StagingSlot(...); Copy(T3_i, out=T3_s)
               Linear(T2, T3_s, out=T4_i)
    After:   T3_stage = Allocate(...); for i ... [Stream]: (loop 1)
             ...
             for i ... [Stream]: SetCurrentStream(Stream(4 + i % 4))
               T3_i = ...; T3_s = ...; Copy(T3_i, out=T3_s)
               Synchronize(main_stream)
               Linear(T2, T3_s, out=T4_i)
    Waiting for the caller's stream in every iteration (not once per worker) costs an
    event wait per slice and keeps the loop body free of conditions; the runtime
    records the caller's event once.
    """
    if not any(_runs_ahead(n) for n in program.body):
        return program
    body: list[Node] = []
    hoist: dict[int, list[Node]] = {}  # position of a loop -> allocations to put before it
    last_loop: int | None = None
    for n in program.body:
        if isinstance(n, ForLoop) and n.parallel is ParallelType.Stream:
            if _runs_ahead(n) and last_loop is not None:
                own = {sl.stage for sl in n.body if isinstance(sl, StagingSlot)}
                moved = [a for a in body[last_loop + 1:]
                         if isinstance(a, Allocate) and a.out.name in own]
                body = [a for a in body if not any(a is m for m in moved)]
                hoist.setdefault(last_loop, []).extend(moved)
                copies = _copies_in(n.body)
                rest = [c for c in n.body[1:] if not any(c is m for m in copies)]
                n = dataclasses.replace(n, body=[n.body[0], *copies,
                                                 Synchronize(MAIN_STREAM), *rest])
            last_loop = len(body)
        body.append(n)
    out: list[Node] = [GetCurrentStream(MAIN_STREAM)]  # the stream the loop waits for
    for k, n in enumerate(body):
        out += hoist.get(k, [])
        out.append(n)
    return program.replace(body=out)


def insert_fork_join(program: HostProgram) -> HostProgram:
    """Orders the worker streams against the caller's stream, outside the compute loop.

    Before:  for i in range(0, S) [Stream]: ...
    After:   main_stream = GetCurrentStream()
             for j in range(0, min(S, pool)): SetCurrentStream(Stream(j)); Synchronize(main_stream)
             for i in range(0, S) [Stream]: ...
             SetCurrentStream(main_stream)
             for j in range(0, min(S, pool)): Synchronize(Stream(j))
    Synchronizing inside the compute loop would serialize the slices; here each worker
    waits once for the caller's prior work (fork) and the caller waits once for each
    worker (join), so the caller can consume the outputs on its own stream. A loop on
    the caller's stream (``on_caller_stream``) needs neither. The copy stream
    (``queue_copies_in``) is forked with the first loop that queues copies on it and
    joined with the last (``hoist_staging``), so it runs ahead across loops. The ring
    stream (``stage_in_ring``) is joined the same way but never forked: its copies read
    only host inputs (complete when the op is called), into ring bytes whose last readers
    it waits for by event.
    """
    pool = program.pool_size
    used = False
    copy_loops = [program.body[k] for k in _copy_stream_loops(program)]
    loops = [n for n in program.body if isinstance(n, ForLoop)
             and n.parallel is ParallelType.Stream and not on_caller_stream(n, pool)]

    def workers(loop: ForLoop) -> Stream:
        worker = _loop_worker(loop)
        return Stream("j", None, worker.base if worker else 0)

    def fork(loop: ForLoop) -> list[Node]:
        return [ForLoop("j", Const(0), stream_count(loop, pool),
                        [SetCurrentStream(workers(loop)), Synchronize(MAIN_STREAM)])]

    def fork_join(loop: ForLoop) -> list[Node]:
        nonlocal used
        if on_caller_stream(loop, pool):
            return [loop]
        used = True
        n_streams = stream_count(loop, pool)
        forks: list[Node] = [] if _runs_ahead(loop) else fork(loop)
        after = loops[loops.index(loop) + 1] if loop is not loops[-1] else None
        if after is not None and _runs_ahead(after):
            forks = fork(after) + forks  # before this loop: its copies run under this one
        join: list[Node] = [ForLoop("j", Const(0), n_streams, [Synchronize(workers(loop))])]
        if copy_loops and loop is copy_loops[0] and program.staging != "ring":
            forks += [SetCurrentStream(CopyStream(pool)), Synchronize(MAIN_STREAM)]
        if copy_loops and loop is copy_loops[-1]:
            join.append(Synchronize(RingStream() if program.staging == "ring"
                                    else CopyStream(pool)))
        return [*forks, loop, SetCurrentStream(MAIN_STREAM), *join]

    out = _map_stream_loops(program, fork_join)
    if used and not any(isinstance(n, GetCurrentStream) for n in out.body):
        out = out.replace(body=[GetCurrentStream(MAIN_STREAM), *out.body])
    return out


def view_roots(program: HostProgram) -> dict[str, str]:
    """Each view (a slice, a staging slot, an unflattened block) -> the tensor it views."""
    root: dict[str, str] = {}
    for n in program.nodes():
        if isinstance(n, (Allocate, RingSlot)) or not n.defines() or not n.uses():
            continue
        viewed = n.uses()[0]
        for d in n.defines():
            root[d] = root.get(viewed, viewed)
    return root


def _live_values(program: HostProgram) -> set[str]:
    """The tensors whose values the program's outputs depend on: the outputs, what each
    compute node or copy that writes a live tensor reads, and what every other node
    uses (communications, views and stream nodes are kept as they are)."""
    root = view_roots(program)
    live = set(program.outputs)
    nodes = [n for n in program.nodes() if not isinstance(n, (ForLoop, Deallocate))]
    while True:
        before = len(live)
        for n in nodes:
            if isinstance(n, (Compute, Copy)):
                if any(root.get(w, w) in live for w in n.writes()):
                    live.update(v for r in n.uses() for v in (r, root.get(r, r)))
            elif not isinstance(n, (ShardByStream, StagingSlot, RingSlot, Allocate)):
                live.update(v for u in n.uses() for v in (u, root.get(u, u)))
        if len(live) == before:
            return live


def remove_dead_code(program: HostProgram) -> HostProgram:
    """Drops compute nodes and copies whose results no output depends on, then views and
    allocations that nothing reads (and their Deallocate).

    Before:  T3 = Allocate(...); Matmul(T0, T1, out=T3)   # T3 never read, not an output
             T4_i = ShardByStream(T4, ...)                  # T4_i never used
    After:   (gone)
    Repeated until nothing changes (a view dropped can leave its tensor unread).
    """
    while True:
        smaller = _remove_dead_code_once(program)
        if len(list(smaller.nodes())) == len(list(program.nodes())):
            return smaller
        program = smaller


def _remove_dead_code_once(program: HostProgram) -> HostProgram:
    live_values = _live_values(program)
    root = view_roots(program)

    def dead_write(n: Node) -> bool:
        return isinstance(n, (Compute, Copy)) and \
            not any(root.get(w, w) in live_values for w in n.writes())

    def used_names(nodes: list[Node]) -> set[str]:
        names: set[str] = set()
        for n in nodes:
            if not isinstance(n, Deallocate) and not dead_write(n):
                names.update(n.uses())
            names |= used_names(n.children())
        return names

    live = used_names(program.body) | set(program.outputs)

    def keep(nodes: list[Node], scope: set[str]) -> list[Node]:
        """``scope``: the names read by live nodes where ``nodes`` can be seen. A loop's
        views are its own (``T0_i`` in two loops are two values): each loop judges them
        by what its own body reads."""
        kept: list[Node] = []
        for n in nodes:
            views = (ShardByStream, StagingSlot, RingSlot, Allocate)
            if dead_write(n):
                continue
            if isinstance(n, views) and not set(n.defines()) & scope:
                continue
            if isinstance(n, Deallocate) and n.tensor not in live:
                continue
            if isinstance(n, ForLoop):
                n = dataclasses.replace(n, body=keep(n.body, used_names(n.body)))
                if not n.body:  # a loop left with nothing to do goes too
                    continue
            kept.append(n)
        return kept

    return program.replace(body=keep(program.body, live))


@dataclasses.dataclass
class _Fusion:
    """A producer and its one consumer that can be one node (``_fusable``, ``_fused``)."""

    producer: Compute
    consumer: Compute
    value: str  # what the consumer reads of the producer's result
    at_producer: bool  # the fused node takes the producer's place (else the consumer's)
    fused: Compute | None = None
    allocate: Allocate | None = None  # the consumer's output, then allocated before it


def _fusable(program: HostProgram, t: str) -> _Fusion | None:
    """Whether intermediate ``t`` can be computed inside its one reader, or None.

    ``t`` is a GPU allocation that is not an output; one Compute writes it (or its one
    slice view) and one Compute after it, in the same body, reads that value once and
    nothing else does. The fused node can take the consumer's place if nothing between
    the two frees what the producer reads; else the producer's (``at_producer``) if the
    consumer reads nothing else and writes a value defined before the producer, or
    allocated between the two (that Allocate moves before the fused node): an epilogue of
    a GEMM whose input is freed right after it."""
    bodies = [program.body] + [n.body for n in program.nodes() if isinstance(n, ForLoop)]
    views = [n for n in program.nodes() if isinstance(n, ShardByStream) and n.tensor == t]
    if len(views) > 1:
        return None
    value = views[0].out if views else t
    users = [n for n in program.nodes() if not isinstance(n, (ForLoop, Deallocate))
             and (t in n.uses() or value in n.uses()) and n not in views]
    if len(users) != 2 or not all(isinstance(u, Compute) for u in users):
        return None
    producer, consumer = users
    assert isinstance(producer, Compute) and isinstance(consumer, Compute)
    if producer.out != value or value in producer.reads() or _count(consumer.expr, value) != 1:
        return None
    for body in bodies:
        ids = [id(n) for n in body]
        if id(producer) in ids and id(consumer) in ids:
            p, c = ids.index(id(producer)), ids.index(id(consumer))
            if p >= c:
                return None
            freed = {n.tensor for n in body[p:c] if isinstance(n, Deallocate)}
            if not freed & set(producer.reads()):
                return _Fusion(producer, consumer, value, at_producer=False)
            between = [n for n in body[p:c] if consumer.out in n.defines()]
            allocate = between[0] if between and isinstance(between[0], Allocate) else None
            if consumer.reads() == [value] and (not between or allocate is not None):
                return _Fusion(producer, consumer, value, at_producer=True, allocate=allocate)
            return None
    return None


def _count(e: Apply, value: str) -> int:
    return sum(_count(a, value) if isinstance(a, Apply) else a == value for a in e.args)


def _fused(f: _Fusion, program: HostProgram) -> Compute | None:
    """The one node computing ``f.consumer`` with ``f.producer``'s expression in place of
    ``f.value``, or None where the two cannot be one node:

    - a pointwise producer inlines into a pure pointwise consumer's kernel (never into a
      GEMM's operands); a cast producer stays where it stores (it rounds), and a cast
      consumer takes a producer only if the producer's result is already in the
      expression's compute dtype (no rounding of it is lost);
    - a GEMM takes a one-operand consumer as its epilogue where cuBLASLt has one for it
      (and the program's GEMMs use cuBLASLt)."""
    c, p = f.consumer.expr, f.producer.expr
    if not c.defn.is_pointwise or f.consumer.gemm is not None or \
            f.producer.epilogue is not None:
        return None
    if p.defn.is_pointwise and p.defn is not ops.CAST:
        if c.defn is ops.CAST:
            infos = value_infos(program)
            compute = ops.compute_dtype([infos[v].dtype for v in
                                         [*f.consumer.uses(), *f.producer.uses()]])
            if infos[f.value].dtype != compute:
                return None

        def inline(e: Apply) -> Apply:
            return dataclasses.replace(e, args=tuple(
                p if a == f.value else inline(a) if isinstance(a, Apply) else a
                for a in e.args))
        return Compute.of(inline(c), f.consumer.out)
    epilogue = c.defn.epilogue(dict(c.attrs)) if c.defn.epilogue else None
    if p.defn.is_gemm and p.defn.epilogues and epilogue and c.args == (f.value,) and \
            program.gemm_library == "cublaslt":
        return Compute.of(dataclasses.replace(c, args=(p,)), f.consumer.out)
    return None


def value_infos(program: HostProgram) -> dict[str, TensorInfo]:
    """Each tensor value -> the tensor it is or views (``view_roots``), as declared: so a
    slice has its tensor's dtype and device, a staging slot its stage's (the GPU)."""
    infos = {t.name: t for t in program.inputs} | program.allocations()
    infos |= {n.out.name: n.out for n in program.nodes() if isinstance(n, RingSlot)}
    return infos | {v: infos[r] for v, r in view_roots(program).items() if r in infos}


def _fuse(nodes: list[Node], t: str, f: _Fusion) -> list[Node]:
    """``nodes`` with the fused node in the consumer's (or the producer's) place, the other
    one gone, and intermediate ``t`` (its Allocate, view and Deallocate) gone."""
    out: list[Node] = []
    drop = f.consumer if f.at_producer else f.producer
    keep = f.producer if f.at_producer else f.consumer
    for n in nodes:
        if n is drop or n is f.allocate or (isinstance(n, ShardByStream) and n.tensor == t) \
                or (isinstance(n, Allocate) and n.out.name == t) or \
                (isinstance(n, Deallocate) and n.tensor == t):
            continue
        if isinstance(n, ForLoop):
            n = dataclasses.replace(n, body=_fuse(n.body, t, f))
        if n is keep and f.allocate is not None:
            out.append(f.allocate)  # the fused node writes it where the producer was
        out.append(f.fused if n is keep else n)  # type: ignore[arg-type]
    return out


def fuse_pointwise(program: HostProgram) -> HostProgram:
    """Computes an intermediate inside the one node that reads it, so that it is never
    stored: a chain of pointwise ops becomes one kernel, and an activation after a GEMM
    becomes the GEMM's cuBLASLt epilogue (``_fused`` says which pairs fuse).

    Before:  T4 = Allocate(bfloat16[m, i]); for i ...: T4_i = ShardByStream(T4, ...)
             Silu(T2_i, out=T4_i); Mul(T4_i, T3_i, out=T5_i); ...; Deallocate(T4)
    After:   for i ...: Mul(Silu(T2_i), T3_i, out=T5_i)
    The intermediate's Allocate, view and Deallocate go with it. Values are as before up
    to rounding: the fused node rounds once, where the two nodes rounded the
    intermediate to its dtype (as Inductor's fusion does).
    """
    outputs = set(program.outputs)
    changed = True
    while changed:
        changed = False
        for t, info in program.allocations().items():
            if t in outputs or info.device != "cuda":
                continue
            found = _fusable(program, t)
            if found is None:
                continue
            found.fused = _fused(found, program)
            if found.fused is None or (found.at_producer and found.fused.gemm is None):
                continue  # a kernel reads the consumer's other inputs: the consumer's place
            program = program.replace(body=_fuse(program.body, t, found))
            changed = True
            break
    return program


# ---------------------------------------------------------------------------- host-resident


def _renamed(node: Node, mapping: Mapping[str, str]) -> Node:
    """``node`` (a new one if anything changed) with tensor names replaced by ``mapping``."""
    if isinstance(node, ForLoop):
        return dataclasses.replace(node, body=[_renamed(n, mapping) for n in node.body])
    if isinstance(node, Allocate):
        new = mapping.get(node.out.name)
        return dataclasses.replace(node, out=dataclasses.replace(node.out, name=new)) \
            if new else node
    return node.renamed(mapping)


def _uses(node: Node, name: str) -> bool:
    return name in node.uses() or any(_uses(c, name) for c in node.children())


class _FreshNames:
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


def _is_stream_loop(n: Node) -> bool:
    return isinstance(n, ForLoop) and n.parallel is ParallelType.Stream


def _sliced_only(body: list[Node], name: str, written: bool) -> bool:
    """Every use of ``name`` is a ShardByStream in a stream loop; with ``written``, each
    such view is also written in its loop (it is an op output computed slice by slice)."""
    for top in body:
        if not _uses(top, name):
            continue
        if not _is_stream_loop(top):
            return False
        assert isinstance(top, ForLoop)
        for n in top.body:
            if isinstance(n, ShardByStream) and n.tensor == name:
                if written and not any(n.out in m.writes() for m in top.body):
                    return False
            elif _uses(n, name):
                return False
    return True


def _stage_loop(loop: ForLoop, info: TensorInfo, read: bool, pool: int, fresh: _FreshNames,
                ) -> tuple[list[Node], ForLoop, list[Node]]:
    """Stages the slices of host tensor ``info`` in one stream loop: returns the staging
    allocations (before the loop), the new loop, and the deallocations (after it).

    Before:  T1_i = ShardByStream(T1, ...); Matmul(T0, T1_i, out=T2_i)
    After:   T1_i = ShardByStream(T1, ...); T1_s = StagingSlot(T1_stage, slot=i % 4,
             like=T1_i); Copy(T1_i, out=T1_s); Matmul(T0, T1_s, out=T2_i)
    A ``read`` (input) slice is copied in right after its view; an output slice is
    computed into its slot and copied out right after the node that writes it.
    """
    allocs: list[Node] = []
    body: list[Node] = []
    mapping: dict[str, str] = {}  # host view -> its slot, in the nodes after the view
    copy_out: dict[str, str] = {}  # slot -> host view
    stream = worker_stream(loop, pool)
    for n in loop.body:
        n = _renamed(n, mapping)
        body.append(n)
        if isinstance(n, ShardByStream) and n.tensor == info.name:
            stage = fresh(f"{info.name}_stage")
            chunk_shape = tuple(n.chunk if a == n.axis else e for a, e in enumerate(info.shape))
            allocs.append(Allocate(TensorInfo(stage, info.dtype,
                                              (stream_count(loop, pool), *chunk_shape))))
            slot = fresh(f"{info.name}_s")
            body.append(StagingSlot(slot, stage, stream, like=n.out))
            mapping[n.out] = slot
            if read:
                body.append(Copy(n.out, out=slot))
            else:
                copy_out[slot] = n.out
        for w in n.writes():
            if w in copy_out:
                body.append(Copy(w, out=copy_out.pop(w)))
    if copy_out:
        raise InternalError(f"{loop}: host slices {sorted(copy_out.values())} never written")
    deallocs: list[Node] = [Deallocate(a.out.name) for a in allocs if isinstance(a, Allocate)]
    return allocs, dataclasses.replace(loop, body=body), deallocs


def _stage_sliced(body: list[Node], info: TensorInfo, read: bool, pool: int,
                  fresh: _FreshNames) -> list[Node]:
    out: list[Node] = []
    for n in body:
        if isinstance(n, ForLoop) and _uses(n, info.name):
            allocs, loop, deallocs = _stage_loop(n, info, read, pool, fresh)
            out += [*allocs, loop, *deallocs]
        else:
            out.append(n)
    return out


def _copy_whole(body: list[Node], info: TensorInfo, read: bool, fresh: _FreshNames,
                ) -> list[Node]:
    """A host tensor read whole (or an output also read by other ops, or computed
    outside a loop) lives whole on the GPU as ``<name>_dev``: an input is copied in once
    before its first use, an output copied out once after the node that computes it."""
    dev = fresh(f"{info.name}_dev")
    body = [_renamed(n, {info.name: dev}) for n in body]
    users = [k for k, n in enumerate(body) if _uses(n, dev)]  # an output's first: its op
    out: list[Node] = []
    for k, n in enumerate(body):
        if read and k == users[0]:
            out += [Allocate(dataclasses.replace(info, name=dev, device="cuda")),
                    Copy(info.name, out=dev)]
        if not read and isinstance(n, Allocate) and n.out.name == dev:
            out += [Allocate(dataclasses.replace(n.out, device="cuda")),
                    Allocate(info, pinned=True)]
            continue
        out.append(n)
        if not read and k == users[0]:
            out.append(Copy(dev, out=info.name))
        if k == users[-1]:
            out.append(Deallocate(dev))
    return out


def stage_host_tensors(program: HostProgram) -> HostProgram:
    """Moves host-resident inputs and outputs through the GPU, slice by slice.

    Before: compute nodes read host inputs and write host outputs (``device=cpu``) as if
    they were on the GPU. After: every tensor a compute node touches is on the GPU.
    A host tensor that only stream loops use, slice by slice, goes through a staging
    tensor with one slot per worker stream (``_stage_loop``); anything else is copied
    whole once (``_copy_whole``). Host outputs are allocated in pinned memory.

        for i in range(0, 8) [Stream]:
          T1_i = ShardByStream(T1, axis=1, index=i, chunk=ceilDiv(n, 8))
          T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i)
          Copy(T1_i, out=T1_s)
          Matmul(T0, T1_s, out=T2_i)
    """
    pool = program.pool_size
    allocs = program.allocations()
    host = [(t, True) for t in program.inputs if t.device == "cpu"]
    host += [(allocs[o], False) for o in program.outputs if allocs[o].device == "cpu"]
    if not host:
        return program
    fresh = _FreshNames(program)
    body = list(program.body)
    for info, read in host:
        if not any(_uses(n, info.name) for n in body):
            continue
        if _sliced_only(body, info.name, written=not read):
            body = _stage_sliced(body, info, read, pool, fresh)
            if not read:
                body = [Allocate(n.out, pinned=True)
                        if isinstance(n, Allocate) and n.out.name == info.name else n
                        for n in body]
        else:
            body = _copy_whole(body, info, read, fresh)
    return program.replace(body=body)


def synchronize_host_outputs(program: HostProgram) -> HostProgram:
    """Makes host outputs complete when the program returns.

    Before:  ...; return T2             (T2 = Allocate(..., device=cpu, pinned=True))
    After:   ...; StreamSynchronize(main_stream); return T2
    The copies out were queued on worker streams that the caller's stream joined, so
    waiting for the caller's stream waits for them; only programs with host outputs
    block the host.
    """
    allocs = program.allocations()
    if not any(allocs[o].device == "cpu" for o in program.outputs if o in allocs):
        return program
    body = list(program.body)
    if not any(isinstance(n, GetCurrentStream) for n in body):
        body.insert(0, GetCurrentStream(MAIN_STREAM))
    return program.replace(body=[*body, StreamSynchronize(MAIN_STREAM)])


def _copies_in(body: list[Node]) -> list[Node]:
    """The nodes of a stream loop's body that copy host slices into staging slots: each
    ``Copy(T_i, out=T_s)`` with ``T_s = StagingSlot(..., like=T_i)``, and the views that
    define ``T_i`` and ``T_s``, in body order."""
    slots = {n.out: n for n in body if isinstance(n, StagingSlot)}
    copies = [n for n in body
              if isinstance(n, Copy) and n.out in slots and slots[n.out].like == n.src]
    views = {c.src for c in copies} | {c.out for c in copies}
    return [n for n in body if any(n is c for c in copies) or set(n.defines()) & views]


def queue_copies_in(program: HostProgram) -> HostProgram:
    """With ``copy_stream``, queues each stream loop's host-to-device copies on one copy
    stream, in slice order, instead of on the slices' worker streams.

    Before:  SetCurrentStream(Stream(i % 4)); T1_i = ShardByStream(T1, ...)
             T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i); Copy(T1_i, out=T1_s)
             Matmul(T0, T1_s, ...)
    After:   SetCurrentStream(CopyStream); WaitEvent(T1_stage_free[i % 4])
             T1_i = ...; T1_s = ...; Copy(T1_i, out=T1_s)
             SetCurrentStream(Stream(i % 4)); Synchronize(CopyStream)
             Matmul(T0, T1_s, ...); RecordEvent(T1_stage_free[i % 4])
    A slot reused by a later slice first waits for the event its last reader recorded
    (the GEMM of slice i - 4 that read it: not the rest of that worker's queue, such as
    the next GEMM of its slice or a copy out); where every slice has its own slot
    (``Stream(i)``) there is nothing to wait for. The worker then waits for the copy
    stream, whose last work is this slice's copy. The copies leave the host in order,
    one at a time, so the first one ends after its own bytes instead of sharing the bus
    with the copies of the other workers; copies out (host outputs) stay on the
    workers. The events are made with the staging (``CreateEvents`` after its
    Allocate). A loop on the caller's stream (``on_caller_stream``) is left alone.
    """
    if not program.copy_stream:
        return program
    pool = program.pool_size
    copier = CopyStream(pool)
    created: dict[str, CreateEvents] = {}  # stage -> its events

    def queue(loop: ForLoop) -> list[Node]:
        moved = _copies_in(loop.body)
        if not moved or on_caller_stream(loop, pool):
            return [loop]
        first = loop.body[0]
        if not (isinstance(first, SetCurrentStream) and isinstance(first.stream, Stream)):
            raise InternalError(f"{loop}: streams are not assigned\n{program}")
        worker = first.stream
        rest = [n for n in loop.body[1:] if not any(n is m for m in moved)]
        waits: list[Node] = []
        if worker.pool:  # slots are reused: Stream(i % pool)
            for slot in (n for n in moved if isinstance(n, StagingSlot)):
                event = Event(f"{slot.stage}_free", slot.slot)
                created[slot.stage] = CreateEvents(event.name, stream_count(loop, pool))
                waits.append(WaitEvent(event))
                readers = [k for k, n in enumerate(rest) if _reads(n, slot.out, rest)]
                if not readers:
                    raise InternalError(f"{slot}: nothing reads the slot\n{program}")
                rest.insert(readers[-1] + 1, RecordEvent(event))
        body = [SetCurrentStream(copier), *waits, *moved,
                SetCurrentStream(worker), Synchronize(copier), *rest]
        return [dataclasses.replace(loop, body=body)]

    out = _map_stream_loops(program, queue)
    if not created:
        return out
    body: list[Node] = []
    for n in out.body:
        body.append(n)
        if isinstance(n, Allocate) and n.out.name in created:
            body.append(created[n.out.name])
    return out.replace(body=body)


def _copy_stream_loops(program: HostProgram) -> list[int]:
    """Positions in the program's body of the stream loops that use the copy stream."""
    return [k for k, n in enumerate(program.body) if isinstance(n, ForLoop) and any(
        isinstance(c, SetCurrentStream) and isinstance(c.stream, (CopyStream, RingStream))
        for c in n.body)]


def hoist_staging(program: HostProgram) -> HostProgram:
    """With a copy stream, allocates every staging tensor (and its events) before the
    first loop and frees it after the last, so the copy stream is forked once, before
    the first loop, and joined once, after the last (``insert_fork_join``): the copies of
    loop l + 1 then queue right behind those of loop l and run under loop l's GEMMs,
    where a fork per loop would start them only after loop l had finished.

    Before:  T1_stage = Allocate(...); for ...: (copies into T1_stage); Deallocate(T1_stage)
             T3_stage = Allocate(...); for ...: (copies into T3_stage); Deallocate(T3_stage)
    After:   T1_stage = Allocate(...); T3_stage = Allocate(...)
             for ...: ...; for ...: ...
             Deallocate(T1_stage); Deallocate(T3_stage)
    Staging lives on the caller's stream's pool, allocated before the copy stream's fork,
    so the caching allocator's rule (a block is used on another stream only after its
    allocation) holds; freed after the final join. GPU memory for the staging of all
    loops is held at once (the slots, never a whole host tensor).
    """
    loops = _copy_stream_loops(program)
    if len(loops) < 2:
        return program
    stages = {n.stage for k in loops for n in program.body[k].body  # type: ignore[attr-defined]
              if isinstance(n, StagingSlot)}

    def hoisted(n: Node) -> bool:
        return (isinstance(n, Allocate) and n.out.name in stages) or \
            (isinstance(n, CreateEvents) and n.name.removesuffix("_free") in stages)

    def freed(n: Node) -> bool:
        return isinstance(n, Deallocate) and n.tensor in stages

    first, last = program.body[loops[0]], program.body[loops[-1]]
    head = [n for n in program.body if hoisted(n)]
    tail = [n for n in program.body if freed(n)]
    body: list[Node] = []
    for n in program.body:
        if hoisted(n) or freed(n):
            continue
        if n is first:
            body += head
        body.append(n)
        if n is last:
            body += tail
    return program.replace(body=body)


def _reads(n: Node, slot: str, body: list[Node]) -> bool:
    """Whether ``n`` (a node of a loop ``body``, with what it nests) uses staging slot
    ``slot`` or a view of it, other than the node that takes the slot and the Copy that
    fills it: the rule that places the event after a slot's last reader (RecordEvent in
    ``queue_copies_in``, ReleaseRingSlot in ``stage_in_ring``)."""
    if (isinstance(n, (StagingSlot, RingSlot)) and slot in n.defines()) or \
            (isinstance(n, Copy) and n.out == slot):
        return False
    aliases = {slot}
    for m in body:  # views of the slot defined in the loop body (a view's first use)
        if m.defines() and m.uses() and m.uses()[0] in aliases:
            aliases.update(m.defines())

    def uses(m: Node) -> set[str]:
        return set(m.uses()).union(*(uses(c) for c in m.children()))

    return bool(uses(n) & aliases) and not (set(n.defines()) & aliases)


def stage_in_ring(program: HostProgram) -> HostProgram:
    """With ``staging="ring"``, the copy stream's slices land in the thread's staging ring
    instead of per-call staging, and its copies are not ordered after the caller's stream:
    the copies of this call queue right behind the previous call's (of any program that
    stages in the ring) and run under its last GEMMs, where a fork would hold them until
    the previous call had finished.

    Before:  T1_stage = Allocate(...); T1_stage_free = CreateEvents(4)
             for i ... [Stream]: SetCurrentStream(CopyStream); WaitEvent(T1_stage_free[i % 4])
               T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i); Copy(T1_i, out=T1_s)
               SetCurrentStream(Stream(i % 4)); Synchronize(CopyStream)
               Matmul(T0, T1_s, ...); RecordEvent(T1_stage_free[i % 4])
    After:   for i ... [Stream]: SetCurrentStream(RingStream)
               T1_s = RingSlot(like=T1_i, slots=5); Copy(T1_i, out=T1_s)
               SetCurrentStream(Stream(i % 4)); Synchronize(RingStream)
               Matmul(T0, T1_s, ...); ReleaseRingSlot(T1_s)
    The slot's event moves into the ring (recorded by ``ReleaseRingSlot`` after the last
    reader, waited for by the ``RingSlot`` that reuses the bytes, in any later call).
    Without the fork, nothing orders the copies after work queued on the caller's stream:
    a ring program's host inputs must be complete when it is called (written by the host,
    or by a copy the host has waited for; codegen's own host outputs are complete when
    their op returns). ``insert_fork_join`` then joins the ring stream but does not fork
    it.
    """
    if program.staging != "ring":
        return program
    infos = program.allocations()
    loops = set(_copy_stream_loops(program))  # a loop on the caller's stream keeps its slots
    stages = {n.stage for k in loops for n in _copies_in(program.body[k].children())
              if isinstance(n, StagingSlot)}  # copies in; a host output keeps its slots
    events = {f"{s}_free" for s in stages}

    def staged(n: Node) -> bool:
        return (isinstance(n, Allocate) and n.out.name in stages) or \
            (isinstance(n, Deallocate) and n.tensor in stages) or \
            (isinstance(n, CreateEvents) and n.name in events) or \
            (isinstance(n, (WaitEvent, RecordEvent)) and n.event.name in events)

    def ring(stream: StreamRef) -> StreamRef:
        return RingStream() if isinstance(stream, CopyStream) else stream

    def body_of(loop: ForLoop) -> list[Node]:
        count = stream_count(loop, program.pool_size)
        ring_slots = (count.value if isinstance(count, Const) else program.pool_size) + 1
        body: list[Node] = []
        slots: list[str] = []
        for n in loop.body:
            if staged(n):
                continue
            if isinstance(n, StagingSlot) and n.stage in stages:
                stage = infos[n.stage]
                out = TensorInfo(n.out, stage.dtype, stage.shape[1:], stage.device)
                body.append(RingSlot(out, n.like, ring_slots))
                slots.append(n.out)
            elif isinstance(n, (SetCurrentStream, Synchronize)):
                body.append(dataclasses.replace(n, stream=ring(n.stream)))
            else:
                body.append(n)
        for slot in slots:
            readers = [k for k, n in enumerate(body) if _reads(n, slot, body)]
            if not readers:
                raise InternalError(f"{slot}: nothing reads the ring slot\n{program}")
            body.insert(readers[-1] + 1, ReleaseRingSlot(slot))
        return body

    body = [dataclasses.replace(n, body=body_of(n)) if k in loops else n
            for k, n in enumerate(program.body) if not staged(n)]
    return program.replace(body=body)


HOSTIR_PASSES: tuple[HostPass, ...] = (
    remove_dead_code,
    fuse_pointwise,
    stage_host_tensors,
    assign_streams,
    order_accumulation,
    queue_copies_in,
    hoist_staging,
    stage_in_ring,
    run_copies_ahead,
    insert_fork_join,
    synchronize_host_outputs,
)


# ---------------------------------------------------------------------------- input checks


@dataclasses.dataclass(frozen=True)
class DimCheck:
    """One check of an input size, in order: ``fixed`` compares with a constant, ``bind``
    names a symbol from the size (its first use), ``same`` compares with a bound symbol."""

    tensor: str
    axis: int
    kind: str  # "fixed" | "bind" | "same"
    value: Expr


def dim_checks(program: HostProgram) -> list[DimCheck]:
    """The size checks of the inputs, shared by the evaluator and the generated C++."""
    bound: set[str] = set()
    checks: list[DimCheck] = []
    for t in program.inputs:
        for axis, e in enumerate(t.shape):
            if isinstance(e, Const):
                checks.append(DimCheck(t.name, axis, "fixed", e))
            else:
                name = str(e)
                checks.append(DimCheck(t.name, axis, "same" if name in bound else "bind", e))
                bound.add(name)
    return checks
