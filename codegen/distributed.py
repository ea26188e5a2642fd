"""Tensor parallelism: device meshes, sharding analysis, and the lowering of communications.

The model is nvFuser's. A fusion is defined on the *global* (unsharded) tensors; each
tensor lives on a :class:`~codegen.ir.DeviceMesh` of D ranks, and an axis cut by
``outer_split(axis, D)`` whose outer part is parallelized on ``ParallelType.DIDx`` is
sharded: rank r holds block r, and the op's argument (or result) on rank r is that local
block. Where an op needs unsharded what its producer has sharded, the lowering inserts a
communication; where the op's contraction is sharded (each rank holds a partial sum) and
its output is sharded, a reduce-scatter:

    x [m, k]:   x.outer_split(0, D); x.axis(0).parallelize(DIDx)     x_local [m/D, k]
    out = x @ w with out's rows not sharded                          -> AllGather(x)
    x [m, k], w [k, n] both sharded on k, out's rows sharded         -> ReduceScatter(out)

Stream slices of a sharded axis cut each rank's block: ``out.outer_split(0, D)`` then
``out.outer_split(1, S)`` with Stream on the S axis makes slice i take piece i of every
rank's block, which is exactly what one all-gather (or reduce-scatter) of piece i of every
rank's local block moves. So the communication is sliced into the stream loop: slice i
communicates on its stream while the GEMM of slice i-1 runs on another.

This module holds the analysis (:func:`analyze`), the host-IR nodes of communication
(``Communication``, ``Wait``; named as nvFuser's host IR names them) and the views they
need (``Unflatten``, ``CheckDivisible``), the lowering of a distributed fusion to a host
program (:func:`build_host_program`, called by ``lowering.lower``), and the evaluator's
handlers of these nodes with torch.distributed (:class:`CommunicationEvaluator`).

Supported for now: one 2-D matmul ``out = a @ b`` of two fusion inputs, on a 1-D mesh;
all-gather of a's rows and reduce-scatter of out's rows, each sliced into the stream loop
when the rows carry the stream split (slices must divide each rank's block: checked when
called), or whole before/after the GEMM otherwise (the stream loop, if any, then slices
columns). Anything else is a ScheduleError that says so.

``print(cg.lower(examples.allgather_matmul(torch.float32, 4, 2)))``::

    HostProgram allgather_matmul(x: float32[m_local, k], w: float32[k, n_local]) -> (T2):
      main_stream = GetCurrentStream()
      CheckDivisible(x, axis=0, by=4)
      T2 = Allocate(float32[2 * m_local, n_local])
      x_gathered = Allocate(float32[8, ceilDiv(m_local, 4), k])
      T2_blocks = Unflatten(T2, axis=0, sizes=(2, m_local))
      for j in range(0, 4):
        SetCurrentStream(Stream(j))
        Synchronize(main_stream)
      for i in range(0, 4) [Stream]:
        SetCurrentStream(Stream(i))
        x_i = ShardByStream(x, axis=0, index=i, chunk=ceilDiv(m_local, 4))
        x_gathered_i = ShardByStream(x_gathered, axis=0, index=i, chunk=2)
        comm_i = Communication(AllGather, input=x_i, output=x_gathered_i, team=(0, 1), group=pg)
        Wait(comm_i)
        T2_blocks_i = ShardByStream(T2_blocks, axis=1, index=i, chunk=ceilDiv(m_local, 4))
        Matmul(x_gathered_i, w, out=T2_blocks_i)
      SetCurrentStream(main_stream)
      for j in range(0, 4):
        Synchronize(Stream(j))
      Deallocate(x_gathered)
      return T2

Staging: the gathered rows (all-gather) and the partial sums (reduce-scatter) get one
whole buffer ``[S*D, chunk, ...]``, slice i owning the contiguous ``[D, chunk, ...]`` at
rows ``i*D ..``, which is the layout a collective reads or writes (stacked rank blocks).
A per-stream slot reused every ``pool`` slices would save memory when S > pool, but the
reuse is then only safe because NCCL orders a collective after the current stream's
earlier work; a copy-engine ring backend (peers writing into our slot) would also need a
remote "slot free" signal. The whole buffer is what the no-overlap version allocates
anyway, and leaves that seam open.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

from . import hostir as hir
from . import ops, passes
from .errors import InternalError, ScheduleError
from .ir import (
    DTYPE_NAMES,
    Const,
    DeviceMesh,
    Expr,
    Fusion,
    IterDomain,
    Mul,
    Op,
    ParallelType,
    Split,
    Sym,
    TensorView,
    ceil_div,
    mul_extents,
)

DIDx = ParallelType.DIDx
Stream = ParallelType.Stream
GROUP = "pg"  # the process group the program is called with (the default group otherwise)

# ---------------------------------------------------------------------------- host-IR nodes


class CommunicationType(enum.Enum):
    AllGather = "AllGather"
    ReduceScatter = "ReduceScatter"


@dataclasses.dataclass(eq=False)
class Communication(hir.Node):
    """Posts a collective over ``team`` on the current stream's side; ``out`` names its
    handle, for :class:`Wait`. Nothing waits for it here (no host block).

    AllGather: ``output`` holds the team's ``input``s stacked along the leading axis, in
    rank order (``[D, *input.shape]`` or ``[D * rows, ...]``). ReduceScatter: ``input``
    is D stacked blocks, ``output`` the sum over ranks of block ``rank``. ``output`` is
    contiguous; ``input`` is made contiguous if it is not (torch's contract)."""

    out: str
    kind: CommunicationType
    input: str
    output: str
    team: tuple[int, ...]
    group: str = GROUP

    def uses(self) -> list[str]:
        return [self.input, self.output]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        team = "(" + ", ".join(map(str, self.team)) + (",)" if len(self.team) == 1 else ")")
        return (f"{self.out} = Communication({self.kind.value}, input={self.input}, "
                f"output={self.output}, team={team}, group={self.group})")


@dataclasses.dataclass(eq=False)
class Wait(hir.Node):
    """The current stream waits for the communication ``communication`` (no host block
    with NCCL; gloo, on the CPU, blocks the host)."""

    communication: str

    def uses(self) -> list[str]:
        return [self.communication]

    def __str__(self) -> str:
        return f"Wait({self.communication})"


@dataclasses.dataclass(eq=False)
class Unflatten(hir.Node):
    """``out`` = ``tensor`` with axis ``axis`` viewed as ``sizes`` (outer, inner), as
    ``torch.unflatten``: always a view, whatever the strides."""

    out: str
    tensor: str
    axis: int
    sizes: tuple[Expr, Expr]

    def uses(self) -> list[str]:
        return [self.tensor]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        sizes = ", ".join(map(str, self.sizes))
        return f"{self.out} = Unflatten({self.tensor}, axis={self.axis}, sizes=({sizes}))"


@dataclasses.dataclass(eq=False)
class CheckDivisible(hir.Node):
    """Raises ValueError naming the argument unless ``tensor``'s size on ``axis`` is a
    multiple of ``divisor`` (``reason`` says why: world size, stream slices)."""

    tensor: str
    axis: int
    divisor: int
    reason: str

    def uses(self) -> list[str]:
        return [self.tensor]

    def __str__(self) -> str:
        return f"CheckDivisible({self.tensor}, axis={self.axis}, by={self.divisor})"


# ---------------------------------------------------------------------------- analysis


@dataclasses.dataclass(frozen=True)
class AxisLayout:
    """How one logical axis of a tensor is spread over ranks and stream slices.

    ``sharded``: cut into D blocks by ``outer_split(axis, D)`` + DIDx; rank r holds block
    r. ``slices``: the number of stream slices, or None. ``per_block``: slice i takes
    piece i of each of the D blocks (of the local block, when sharded); otherwise slice i
    is the i-th contiguous piece of the whole axis."""

    sharded: bool = False
    slices: int | None = None
    per_block: bool = False


@dataclasses.dataclass(frozen=True)
class CommunicationPlan:
    kind: CommunicationType
    operand: str  # "a" (its rows are all-gathered) or "out" (its rows are reduce-scattered)
    sliced: bool  # in the stream loop, one collective per slice


@dataclasses.dataclass
class Plan:
    """What :func:`analyze` found: the mesh, the op, the layout of each (operand, axis),
    the communication and the stream slicing."""

    mesh: DeviceMesh
    op: Op
    layouts: dict[tuple[str, int], AxisLayout]
    communication: CommunicationPlan | None
    stream_group: int | None  # index in op.iteration_groups() of the group on streams
    slices: int | None


def is_distributed(fusion: Fusion) -> bool:
    """Whether any tensor of ``fusion`` has a device mesh or a DIDx axis."""
    return any(tv.mesh is not None or any(i.parallel_type is DIDx for i in _all_ids(tv))
               for tv in fusion.tensors)


def _all_ids(tv: TensorView) -> list[IterDomain]:
    ids = list(tv.logical)
    for split in _children(tv).values():
        ids += [split.outer, split.inner]
    return list(dict.fromkeys(ids))


def _children(tv: TensorView) -> dict[int, Split]:
    """Splits of ``tv``'s schedule keyed by the id of the IterDomain they split."""
    return {id(s.input): s for s in passes.splits(tv)}


def _mesh(fusion: Fusion) -> DeviceMesh:
    """The one mesh of the fusion; tensors without one take it (as nvFuser propagates)."""
    meshes = {tv.mesh for tv in fusion.tensors if tv.mesh is not None}
    if len(meshes) > 1:
        found = ", ".join(f"{tv.name} on {tv.mesh}" for tv in fusion.tensors if tv.mesh)
        raise ScheduleError(f"Fusion {fusion.name}: all tensors must be on one DeviceMesh, "
                            f"found {found}")
    if not meshes:
        tv = next(tv for tv in fusion.tensors if any(i.parallel_type is DIDx
                                                     for i in _all_ids(tv)))
        raise ScheduleError(f"{tv.name} has a DIDx axis but no device mesh; call "
                            f"{tv.name}.set_device_mesh(cg.DeviceMesh(world_size)) (on every "
                            "tensor of the fusion)")
    (mesh,) = meshes
    for tv in fusion.tensors:
        tv.mesh = mesh
    return mesh


_FORMS = ("outer_split(a, D) with DIDx on the outer part (sharded: rank r holds block r), "
          "then optionally outer_split(a + 1, S) with Stream on the outer part (slice i takes "
          "piece i of every block); or outer_split(a, S) with Stream on the outer part (slice "
          "i is the i-th piece of the whole axis)")


def _axis_layout(tv: TensorView, pos: int, mesh: DeviceMesh) -> AxisLayout:
    """Parses the schedule of ``tv``'s logical axis ``pos`` (see AxisLayout)."""
    root, children, d = tv.logical[pos], _children(tv), mesh.size

    def unsupported(why: str) -> ScheduleError:
        return ScheduleError(
            f"{tv.name} axis {pos} ({root}): {why}. A distributed fusion supports, on an axis "
            f"a: {_FORMS}; {tv.name}'s loop domain is {tv.loop_str()}")

    def outer_split_of(node: IterDomain) -> Split | None:
        split = children.get(id(node))
        if split is not None and split.inner_split:
            raise unsupported(f"split({pos}, {split.factor}) is an inner split; use "
                              "outer_split")
        return split

    def stream_slices(node: IterDomain) -> int | None:
        """S if ``node`` is cut by outer_split(S) with Stream on the outer part."""
        if node.parallel_type is not ParallelType.Serial:
            raise unsupported(f"{node.parallel_type.name} on the inner part of a split")
        split = outer_split_of(node)
        if split is None:
            return None
        if not split.outer.is_stream or split.inner.parallel_type is not ParallelType.Serial:
            raise unsupported("a block is split, but not into stream slices")
        if children.get(id(split.outer)) or children.get(id(split.inner)):
            raise unsupported("a stream slice is split again")
        return split.factor

    split = outer_split_of(root)
    if split is None:
        if root.parallel_type is DIDx:
            raise unsupported(f"DIDx on an axis that is not split; shard it with "
                              f"{tv.name}.outer_split({pos}, {d}) and parallelize the outer "
                              "part, so that the argument is the local block")
        if root.is_stream:
            raise unsupported("Stream on an axis that is not split")
        return AxisLayout()
    outer, inner = split.outer, split.inner
    if children.get(id(outer)):
        raise unsupported("the outer part of a split is split again")
    if outer.parallel_type is DIDx:
        if split.factor != d:
            raise unsupported(f"DIDx on outer_split({pos}, {split.factor}) but the mesh has "
                              f"{d} ranks; split by {d}")
        slices = stream_slices(inner)
        return AxisLayout(True, slices, slices is not None)
    if outer.is_stream:
        if inner.parallel_type is not ParallelType.Serial or children.get(id(inner)):
            raise unsupported("the inner part of a stream split is split or parallelized")
        return AxisLayout(False, split.factor, False)
    slices = stream_slices(inner)
    if slices is None:
        return AxisLayout()  # a serial split alone changes nothing
    if split.factor != d:
        raise unsupported(f"stream slices of the inner part of outer_split({pos}, "
                          f"{split.factor}): to cut each rank's block the outer split must "
                          f"be by the world size {d}")
    return AxisLayout(False, slices, True)


def _check_tensor(tv: TensorView) -> None:
    """At most one DIDx iteration axis and one Stream axis, both in the loop domain."""
    ids = _all_ids(tv)
    for ptype in (DIDx, Stream):
        found = [i for i in ids if i.parallel_type is ptype]
        iteration = [i for i in found if not i.is_reduction]
        if len(iteration) > 1:
            raise ScheduleError(f"{tv.name} has {len(iteration)} {ptype.name} axes "
                                f"({', '.join(map(str, iteration))}); a tensor can have only "
                                "one (the mesh is 1-D)")
        for i in found:
            if i not in tv.loop:
                raise ScheduleError(f"{tv.name}: {ptype.name} axis {i} is not in the loop "
                                    f"domain {tv.loop_str()} (it was split after being "
                                    "parallelized)")


def _single_matmul(fusion: Fusion) -> Op:
    op = fusion.ops[0] if len(fusion.ops) == 1 else None
    if (op is None or op.defn is not ops.MATMUL or (op.a.ndim, op.b.ndim) != (2, 2)
            or op.a not in fusion.inputs or op.b not in fusion.inputs
            or fusion.outputs != [op.out]):
        found = "; ".join(map(str, fusion.ops)) or "no ops"
        raise ScheduleError(
            f"distributed Fusion {fusion.name}: one 2-D matmul of two fusion inputs, whose "
            f"result is the only output, is supported for now; found {found}")
    return op


def analyze(fusion: Fusion) -> Plan:
    """Before: a fusion with a DeviceMesh or DIDx axes (edited in place: every tensor gets
    the mesh). After: its Plan, or a ScheduleError naming the tensor and axis for what
    is unsupported or inconsistent."""
    dtypes = {t.dtype for t in fusion.tensors}
    if len(dtypes) > 1:
        found = ", ".join(f"{t.name} is {DTYPE_NAMES[t.dtype]}" for t in fusion.tensors)
        raise ScheduleError(f"Fusion {fusion.name}: one dtype per program is supported, "
                            f"found {found}")
    mesh = _mesh(fusion)
    op = _single_matmul(fusion)
    for tv in fusion.tensors:
        if tv.device != "cuda":
            raise ScheduleError(f"{tv.name} is device={tv.device!r}: host-resident tensors in a "
                                "distributed fusion are not implemented")
    for tv in fusion.tensors:
        _check_tensor(tv)
    operands = op.operands()
    layouts = {(n, a): _axis_layout(t, a, mesh)
               for n, t in operands.items() for a in range(len(t.logical))}
    iteration = op.iteration_groups()
    (contraction,) = [g.members for g in op.axes() if g.reduction]
    out = op.out.name

    def where(member: tuple[str, int]) -> str:
        return f"{operands[member[0]].name} axis {member[1]}"

    # Contraction: sharded in both operands (partial sums) or in neither.
    ins = [m for m in contraction if m[0] != "out"]
    sharded_k = {m: layouts[m].sharded for m in ins}
    if len(set(sharded_k.values())) > 1:
        yes = next(m for m, s in sharded_k.items() if s)
        no = next(m for m, s in sharded_k.items() if not s)
        raise ScheduleError(
            f"matmul {out}: the contraction is sharded in {where(yes)} but not in {where(no)}; "
            "shard both (each rank multiplies its block and the partial sums are reduced) "
            "or neither")
    partial = all(sharded_k.values())
    if layouts[contraction[-1]].sharded and not partial:
        raise ScheduleError(f"matmul {out}: its reduction axis is DIDx but the operands' "
                            f"contraction ({', '.join(map(where, ins))}) is not sharded")

    # Iteration groups: where a producer and the output disagree, a communication.
    plans: list[CommunicationPlan] = []
    for group in iteration:
        producer, consumer = group[0], group[-1]
        p_sh, o_sh = layouts[producer].sharded, layouts[consumer].sharded
        if p_sh and not o_sh:
            if consumer[1] != 0:
                raise ScheduleError(
                    f"matmul {out}: {where(producer)} is sharded but {where(consumer)} is "
                    "not: an all-gather along a non-leading axis is not implemented; shard "
                    f"{out}'s columns too (a column-parallel matmul needs no communication)")
            plans.append(CommunicationPlan(CommunicationType.AllGather, producer[0], False))
        elif o_sh and not p_sh:
            if not partial:
                raise ScheduleError(
                    f"matmul {out}: {where(consumer)} is sharded but {where(producer)} is not, "
                    "and nothing is reduced: each rank would slice its own block of "
                    f"{operands[producer[0]].name}, which is not implemented; shard "
                    f"{where(producer)} the same way")
            if consumer[1] != 0:
                raise ScheduleError(
                    f"matmul {out}: a reduce-scatter along {where(consumer)} (not the leading "
                    f"axis) is not implemented; shard {out}'s rows instead")
            plans.append(CommunicationPlan(CommunicationType.ReduceScatter, "out", False))
        elif p_sh and o_sh and partial:
            raise ScheduleError(f"matmul {out}: partial sums of sharded {where(consumer)} need "
                                "an all-reduce, which is not implemented")
    if partial and not plans:
        raise ScheduleError(
            f"matmul {out}: the contraction is sharded, so each rank holds a partial sum, "
            f"and {out} is not sharded: that needs an all-reduce, which is not implemented; "
            f"shard {out}'s rows for a reduce-scatter ({out}.outer_split(0, {mesh.size}); "
            f"{out}.axis(0).parallelize(ParallelType.DIDx))")
    if len(plans) > 1:
        raise ScheduleError(f"matmul {out}: needs {len(plans)} communications "
                            f"({', '.join(p.kind.value for p in plans)}); one is supported")
    plan = plans[0] if plans else None

    # Streams: one iteration group; members agree; the others follow.
    if any(layouts[m].slices for m in contraction):
        m = next(m for m in contraction if layouts[m].slices)
        raise ScheduleError(f"{where(m)} is on streams but it is contracted by matmul {out}: "
                            "split-K across streams is not implemented")
    on_streams = [gi for gi, g in enumerate(iteration) if any(layouts[m].slices for m in g)]
    if len(on_streams) > 1:
        raise ScheduleError(f"matmul {out}: both its rows and its columns are on streams; "
                            "one stream axis per op is supported")
    stream_group = on_streams[0] if on_streams else None
    slices = None
    if stream_group is not None:
        group = iteration[stream_group]
        scheduled = [m for m in group if layouts[m].slices]
        forms = {(layouts[m].slices, layouts[m].per_block) for m in scheduled}
        if len(forms) > 1:
            found = ", ".join(f"{where(m)} in {layouts[m].slices} slices "
                              f"{'per rank block' if layouts[m].per_block else 'of the axis'}"
                              for m in scheduled)
            raise ScheduleError(f"conflicting stream splits in matmul {out}: {found}; the "
                                "same dimension must be split the same way")
        ((slices, per_block),) = forms
        src = scheduled[0]
        for m in group:
            lay = layouts[m]
            if lay.sharded and not per_block:
                raise ScheduleError(
                    f"{where(m)} is sharded over {mesh.size} ranks, but {where(src)} is cut "
                    f"into {slices} stream slices of the whole axis; a slice must take a piece "
                    f"of every rank's block: split that axis of "
                    f"{operands[src[0]].name} by the world size first (outer_split(a, "
                    f"{mesh.size})), then the inner part into the stream slices "
                    f"(outer_split(a + 1, {slices}) and Stream on its outer part)")
            if per_block and not lay.sharded and m[1] != 0:
                raise ScheduleError(f"{where(m)}: stream slices of every rank's block along a "
                                    "non-leading axis are not implemented")
            layouts[m] = AxisLayout(lay.sharded, slices, per_block)
        if plan is not None:
            # Both communications move rows (group 0): on streams, they are sliced.
            if plan.kind is CommunicationType.ReduceScatter and stream_group != 0:
                raise ScheduleError(
                    f"matmul {out}: a reduce-scatter of {out}'s rows with its columns on "
                    "streams is not implemented; put the stream split on the rows (each "
                    "rank's block: outer_split(0, D), then outer_split(1, S))")
            plan = dataclasses.replace(plan, sliced=stream_group == 0)
    return Plan(mesh, op, layouts, plan, stream_group, slices)


# ---------------------------------------------------------------------------- extents


class _Extents:
    """Local extents of the program, in symbols the inputs bind.

    A sharded input axis of global extent ``m`` has the local extent ``m_local`` (bound
    from the argument), and ``m`` is ``D * m_local`` wherever the global size is meant.
    Exact divisions of other extents (a sharded output axis, slices per block) are
    ``ceilDiv`` with a divisibility check recorded for the program's start."""

    def __init__(self, fusion: Fusion, plan: Plan) -> None:
        self.d = plan.mesh.size
        self.local: dict[str, str] = {}  # global symbol -> local symbol
        self.checks: dict[Expr, list[tuple[int, str]]] = {}
        self.why: dict[Expr, tuple[Expr, int, str]] = {}  # ceilDiv(x, q) -> (x, q, why)
        # Fresh against tensor names too: a tensor and an extent may share a name (the C++
        # keeps them apart, see renderer._Names), but a dump that reads both is clearer.
        used = set(fusion.symbols()) | {t.name for t in fusion.tensors}
        operands = plan.op.operands()
        sharded_inputs = [(n, a) for (n, a), lay in plan.layouts.items()
                          if lay.sharded and n != "out"]
        for n, a in sharded_inputs:
            tv = operands[n]
            e = tv.logical[a].extent
            if isinstance(e, Const):
                if e.value % self.d:
                    raise ScheduleError(f"{tv.name} axis {a} has the fixed size {e.value}, "
                                        f"which the world size {self.d} does not divide")
            elif isinstance(e, Sym) and e.name not in self.local:
                name = f"{e.name}_local"
                while name in used:
                    name += "_"
                used.add(name)
                self.local[e.name] = name
        for (n, a), lay in plan.layouts.items():
            e = operands[n].logical[a].extent
            if n != "out" and not lay.sharded and isinstance(e, Sym) and e.name in self.local:
                raise ScheduleError(
                    f"{operands[n].name} axis {a} ({e.name}) is not sharded, but the same "
                    f"extent {e.name} is sharded elsewhere; a named extent must be sharded "
                    "in every input or in none (give them different names)")

    def global_(self, e: Expr) -> Expr:
        if isinstance(e, Sym) and e.name in self.local:
            return mul_extents(Const(self.d), Sym(self.local[e.name]))
        return e

    def exact_div(self, e: Expr, q: int, why: str) -> Expr:
        """``e / q``, exact: at lower time for constants, else checked when called."""
        if q == 1:
            return e
        if isinstance(e, Const):
            if e.value % q:
                raise ScheduleError(f"a fixed size {e.value} must be divisible by {q} ({why})")
            return Const(e.value // q)
        if isinstance(e, Mul) and isinstance(e.lhs, Const) and e.lhs.value % q == 0:
            return mul_extents(Const(e.lhs.value // q), e.rhs)
        base, divisor = e, q
        if e in self.why:  # ceilDiv(x, p) / q = ceilDiv(x, p * q), exact
            base, p, first = self.why[e]
            divisor, why = p * q, f"{first} x {why}"
        out = ceil_div(base, Const(divisor))
        self.why[out] = (base, divisor, why)
        self.checks.setdefault(base, []).append((divisor, why))
        return out

    def local_of(self, tv: TensorView, axis: int, lay: AxisLayout) -> Expr:
        g = self.global_(tv.logical[axis].extent)
        return self.exact_div(g, self.d, f"world size {self.d}") if lay.sharded else g

    def check_nodes(self, inputs: list[hir.TensorInfo]) -> list[hir.Node]:
        """One CheckDivisible per recorded extent and divisor (weaker ones dropped), on
        the first input axis whose size is that extent."""
        nodes: list[hir.Node] = []
        for base, reqs in self.checks.items():
            where = next(((t.name, a) for t in inputs for a, e in enumerate(t.shape)
                          if e == base), None)
            if where is None:
                raise InternalError(f"no input axis has the extent {base} to check")
            whys: dict[int, str] = {}
            for divisor, why in reqs:
                whys.setdefault(divisor, why)
            for divisor, why in whys.items():
                if not any(d % divisor == 0 for d in whys if d != divisor):
                    nodes.append(CheckDivisible(where[0], where[1], divisor, why))
        return nodes


# ---------------------------------------------------------------------------- host IR


class _Builder:
    """Collects the nodes of a distributed host program: before the loop, in it, after."""

    def __init__(self, fusion: Fusion, plan: Plan, extents: _Extents) -> None:
        self.plan, self.x = plan, extents
        self.d = plan.mesh.size
        self.taken = {t.name for t in fusion.tensors}
        self.pre: list[hir.Node] = []
        self.loop: list[hir.Node] = []
        self.post: list[hir.Node] = []

    def fresh(self, base: str) -> str:
        while base in self.taken:
            base += "_"
        self.taken.add(base)
        return base

    def slice_of(self, name: str, axis: int, lay: AxisLayout, extent: Expr) -> str:
        """The view of ``name`` (local ``extent`` on ``axis``) that slice i reads or writes."""
        if lay.slices is None:
            return name
        if lay.per_block and not lay.sharded:  # [.., D, block, ..]: piece i of every block
            block = self.x.exact_div(extent, self.d, f"world size {self.d}")
            view = self.fresh(f"{name}_blocks")
            self.pre.append(Unflatten(view, name, axis, (Const(self.d), block)))
            name, axis, extent = view, axis + 1, block
        if lay.per_block:
            chunk = self.x.exact_div(extent, lay.slices, f"{lay.slices} stream slices")
        else:
            chunk = ceil_div(extent, Const(lay.slices))  # ragged last slice allowed
        view = self.fresh(f"{name}_i")
        self.loop.append(hir.ShardByStream(view, name, axis, "i", chunk))
        return view

    def communicate(self, kind: CommunicationType, src: str, dst: str, sliced: bool) -> None:
        work = self.fresh("comm_i" if sliced else "comm")
        nodes = [Communication(work, kind, src, dst, self.plan.mesh.ranks), Wait(work)]
        (self.loop if sliced else self.pre).extend(nodes)


def build_host_program(fusion: Fusion, pool_size: int) -> hir.HostProgram:
    """Before: a distributed fusion (``is_distributed``). After: its host program, before
    the host-IR passes (streams and fork/join are theirs). Tensors are local: inputs and
    output are this rank's blocks; staging buffers hold gathered rows or partial sums."""
    plan = analyze(fusion)
    ext = _Extents(fusion, plan)
    b = _Builder(fusion, plan, ext)
    op, lay, comm = plan.op, plan.layouts, plan.communication
    operands = op.operands()
    local = {(n, a): ext.local_of(t, a, lay[(n, a)])
             for n, t in operands.items() for a in range(t.ndim)}

    def info(n: str) -> hir.TensorInfo:
        t = operands[n]
        return hir.TensorInfo(t.name, t.dtype, tuple(local[(n, a)] for a in range(t.ndim)))

    dtype = op.out.dtype
    inputs = [info("a"), info("b")]
    out = op.out.name
    b.pre.append(hir.Allocate(info("out")))
    names = {n: t.name for n, t in operands.items()}

    if comm is not None and comm.kind is CommunicationType.AllGather:
        a = names["a"]
        gathered = b.fresh(f"{a}_gathered")
        if comm.sliced:  # slice i gathers piece i of every rank's rows: [D, chunk, k]
            s = plan.slices
            assert s is not None
            chunk = ext.exact_div(local[("a", 0)], s, f"{s} stream slices")
            b.pre.append(hir.Allocate(hir.TensorInfo(
                gathered, dtype, (Const(s * b.d), chunk, local[("a", 1)]))))
            a_i = b.slice_of(a, 0, lay[("a", 0)], local[("a", 0)])
            names["a"] = b.fresh(f"{gathered}_i")
            b.loop.append(hir.ShardByStream(names["a"], gathered, 0, "i", Const(b.d)))
            b.communicate(CommunicationType.AllGather, a_i, names["a"], sliced=True)
        else:  # gathered whole before the loop: [D * rows, k]
            rows = ext.global_(op.a.logical[0].extent)
            b.pre.append(hir.Allocate(hir.TensorInfo(gathered, dtype, (rows, local[("a", 1)]))))
            b.communicate(CommunicationType.AllGather, a, gathered, sliced=False)
            names["a"] = gathered
            local[("a", 0)] = rows
            lay[("a", 0)] = lay[("out", 0)]
        b.post.append(hir.Deallocate(gathered))

    partial = None
    if comm is not None and comm.kind is CommunicationType.ReduceScatter:
        partial = b.fresh(f"{out}_partial")
        if comm.sliced:  # slice i: [D, chunk, n] partial sums, reduce-scattered to [chunk, n]
            s = plan.slices
            assert s is not None
            chunk = ext.exact_div(local[("out", 0)], s, f"{s} stream slices")
            b.pre.append(hir.Allocate(hir.TensorInfo(
                partial, dtype, (Const(s * b.d), chunk, local[("out", 1)]))))
        else:
            rows = ext.global_(op.out.logical[0].extent)
            b.pre.append(hir.Allocate(hir.TensorInfo(partial, dtype, (rows, local[("out", 1)]))))
        b.post.append(hir.Deallocate(partial))

    views = {n: names[n] for n in ("a", "b")}
    for n in ("a", "b"):
        if not (comm and comm.sliced and comm.operand == n):  # the gathered slice is its view
            for axis in range(operands[n].ndim):
                views[n] = b.slice_of(views[n], axis, lay[(n, axis)], local[(n, axis)])
    if partial is not None and comm is not None and comm.sliced:
        views["out"] = b.fresh(f"{partial}_i")
        b.loop.append(hir.ShardByStream(views["out"], partial, 0, "i", Const(b.d)))
    elif partial is not None:
        views["out"] = partial
    else:
        views["out"] = out
        for axis in range(op.out.ndim):
            views["out"] = b.slice_of(views["out"], axis, lay[("out", axis)],
                                      local[("out", axis)])
    matmul = hir.Matmul(views["out"], views["a"], views["b"])
    (b.loop if plan.slices else b.pre).append(matmul)

    if partial is not None and comm is not None:
        if comm.sliced:
            out_i = b.slice_of(out, 0, lay[("out", 0)], local[("out", 0)])
            b.communicate(CommunicationType.ReduceScatter, views["out"], out_i, sliced=True)
        else:
            b.communicate(CommunicationType.ReduceScatter, partial, out, sliced=False)

    body = ext.check_nodes(inputs) + b.pre
    if plan.slices:
        body.append(hir.ForLoop("i", Const(0), Const(plan.slices), b.loop, Stream))
    body += b.post
    return hir.HostProgram(name=fusion.name, inputs=inputs, outputs=[out], body=body,
                           constraints=_constraints(plan, local), pool_size=pool_size)


def _constraints(plan: Plan, local: dict[tuple[str, int], Expr]) -> list[hir.Constraint]:
    """Local extents the contraction needs equal that are different expressions."""
    operands = plan.op.operands()
    out: list[hir.Constraint] = []
    for group in plan.op.axes():
        members = list(group.inputs())
        for m in members[1:]:
            if local[m] != local[members[0]]:
                (n0, a0), (n, a) = members[0], m
                what = (f"matmul {plan.op.out.name}: {n0}={operands[n0].name} axis {a0} and "
                        f"{n}={operands[n].name} axis {a}")
                out.append(hir.Constraint(local[members[0]], local[m], what))
    return out


# ---------------------------------------------------------------------------- evaluation


def communications(program: hir.HostProgram) -> list[Communication]:
    return [n for n in program.nodes() if isinstance(n, Communication)]


def verify_waits(program: hir.HostProgram) -> hir.HostProgram:
    """Checks that every Communication is waited for, in its own block, before the next
    one is posted. The compiled op's Wait is ``_c10d_functional::wait_tensor``, which
    waits for every collective registered on the output's storage: were two slices
    posted before either waited, the first Wait would take both and the second would
    order nothing."""

    def check(nodes: list[hir.Node]) -> None:
        pending: Communication | None = None
        for n in nodes:
            if isinstance(n, Communication):
                if pending is not None:
                    raise InternalError(f"{n}: posted before {pending.out} was waited for\n"
                                        f"{program}")
                pending = n
            elif isinstance(n, Wait):
                if pending is None or n.communication != pending.out:
                    raise InternalError(f"{n}: waits for no pending communication of this "
                                        f"block\n{program}")
                pending = None
            check(n.children())
        if pending is not None:
            raise InternalError(f"{pending}: never waited for in its block\n{program}")

    check(program.body)
    return program


def resolve_group(program: hir.HostProgram, group: object | None) -> object | None:
    """The process group ``program`` communicates over: ``group``, or the default one.
    None if it does not communicate. Raises RuntimeError if torch.distributed is not
    initialized, ValueError if the group's size is not the program's world size."""
    comms = communications(program)
    if not comms:
        return None
    size = len(comms[0].team)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{program.name}: communicates over {size} ranks, but torch.distributed is not "
            f"initialized; call torch.distributed.init_process_group(backend, rank=..., "
            f"world_size={size}) first (gloo for CPU tensors, nccl for CUDA tensors)")
    pg = group if group is not None else dist.group.WORLD
    found = dist.get_world_size(pg)
    if found != size:
        raise ValueError(
            f"{program.name}: built for world size {size} (DeviceMesh({size})), but the "
            f"process group has {found} ranks; lower it again with world size {found}, or "
            f"pass group= a group of {size} ranks")
    if dist.get_rank(pg) < 0:
        raise ValueError(f"{program.name}: this process is not a member of the given group")
    return pg


class CommunicationEvaluator:
    """The evaluator's handlers of this module's nodes (mixed into its interpreter, which
    provides ``program``, ``env``, ``values`` and ``group``)."""

    program: hir.HostProgram
    env: dict[str, int]
    values: dict[str, torch.Tensor]
    group: object | None

    def CheckDivisible(self, n: CheckDivisible) -> None:
        size = self.values[n.tensor].shape[n.axis]
        if size % n.divisor:
            raise ValueError(
                f"{self.program.name}: argument {n.tensor} axis {n.axis} must have a size "
                f"divisible by {n.divisor} ({n.reason}), got {size} (shape "
                f"{list(self.values[n.tensor].shape)})")

    def Unflatten(self, n: Unflatten) -> None:
        sizes = [e.evaluate(self.env) for e in n.sizes]
        self.values[n.out] = self.values[n.tensor].unflatten(n.axis, sizes)

    def Communication(self, n: Communication) -> None:
        import torch.distributed as dist

        src, dst = self.values[n.input], self.values[n.output]
        if not dst.is_contiguous():
            raise InternalError(f"{n}: the output {n.output} is not contiguous")
        src = src.contiguous()  # the collectives need dense inputs; a copy only if not
        # gloo takes only the concatenated form of the D blocks ([D * rows, ..]; NCCL also
        # the stacked [D, rows, ..]), so stacked blocks are flattened (a view).
        if n.kind is CommunicationType.AllGather:
            if dst.dim() == src.dim() + 1:
                dst = dst.flatten(0, 1)
            # all_gather_into_tensor under its torch >= 2.14 name, where there is one
            gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            work = gather(dst, src, group=self.group, async_op=True)
        else:
            if src.dim() == dst.dim() + 1:
                src = src.flatten(0, 1)
            scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            work = scatter(dst, src, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.values[n.out] = work  # type: ignore[assignment]

    def Wait(self, n: Wait) -> None:
        self.values[n.communication].wait()  # type: ignore[attr-defined]


__all__: Sequence[str] = (
    "AxisLayout", "CheckDivisible", "Communication", "CommunicationEvaluator",
    "CommunicationType", "Plan", "Unflatten", "Wait", "analyze", "build_host_program",
    "is_distributed", "resolve_group",
)
