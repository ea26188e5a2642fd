"""The sharding analysis: which axes of which tensors are sharded on the mesh, and what
each op then needs communicated (``analyze``)."""

from __future__ import annotations

import dataclasses

from ..errors import ScheduleError
from ..frontend import ops
from ..frontend.ir import (
    DTYPE_NAMES,
    DeviceMesh,
    Fusion,
    IterDomain,
    Op,
    ParallelType,
    Split,
    TensorView,
)
from ..frontend.schedule import splits
from .nodes import CommunicationType, DIDx, Stream

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
    return {id(s.input): s for s in splits(tv)}


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
