"""Fusion passes: from a scheduled Fusion to the segments and allocations of a host program.

Each pass is a small function; its docstring says what holds before and after it. They
run on a clone of the user's fusion (see ``lowering.lower``), so editing loop domains in
place is fine here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import hostir as hir
from ..errors import ScheduleError
from ..frontend.ir import (
    Const,
    Fusion,
    Op,
    ParallelType,
    TensorView,
    mul_extents,
)
from ..frontend.schedule import (
    StreamSplit,
    chain_chunk,
    consumers,
    replay_stream_split,
    split_on,
    splits,
    stream_group,
    stream_split,
)
from . import cost

# ---------------------------------------------------------------------------- passes

FusionPass = Callable[[Fusion], Fusion]


def validate_schedule(fusion: Fusion) -> Fusion:
    """Before: any user schedule. After: every tensor has at most one stream axis, in its
    loop domain, on an iteration axis, reachable from a logical axis by outer parts of
    splits (so each slice is a contiguous range)."""
    for tv in fusion.tensors:
        seen_ids = list(tv.logical)
        for split in splits(tv):
            seen_ids += [split.outer, split.inner]
        streams = [i for i in dict.fromkeys(seen_ids) if i.is_stream]
        if len(streams) > 1:
            raise ScheduleError(
                f"{tv.name} has {len(streams)} stream axes ({', '.join(map(str, streams))}); "
                "a tensor can have only one"
            )
        for s in streams:
            if s not in tv.loop:
                raise ScheduleError(
                    f"{tv.name}: stream axis {s} is not in the loop domain "
                    f"{tv.loop_str()} (it was split after being parallelized)"
                )
            if s.is_reduction:
                raise ScheduleError(
                    f"{tv.name}: stream axis {s} is a reduction axis; split-K across "
                    "streams is not implemented"
                )
        stream_split(tv)  # raises for an inner-split stream axis
    return fusion


def propagate_stream_sharding(fusion: Fusion) -> Fusion:
    """Spreads each stream split to the tensors that share its dimension, through the ops'
    iteration groups, producer to consumer and back (breadth first, definition order).

    Before: the user scheduled some tensors (usually one output).
    After: every op output reachable through iteration groups from a scheduled tensor, and
    not scheduled itself, has the same split chain on its mapped axis, marked Stream.
    Reductions (a matmul's k) never carry a stream split: a producer split on what its
    consumer contracts stays with the producer.
    A fusion input is never allocated, only viewed: each loop that reads it slices it the
    way that loop's op is split. So a split passes *through* an input the user did not
    schedule (on to the input's other consumers), and two consumers may read one input
    split differently (``a @ w1`` by rows and ``a @ w2`` by columns are two loops). Such an
    input shows a split in its loop domain only where every op reads it that one way. A
    split the user put on an input stays a requirement (``check_stream_consistency``).
    """
    inputs = {id(tv) for tv in fusion.inputs}
    queue: list[tuple[TensorView, StreamSplit]] = [
        (tv, split) for tv in fusion.tensors if (split := stream_split(tv)) is not None
    ]
    passed: set[int] = set()  # unscheduled inputs a split already went through
    while queue:
        src, split = queue.pop(0)
        for op in fusion.ops:
            operands = op.operands()
            for group in op.iteration_groups():
                if not any(operands[n] is src and a == split.axis for n, a in group):
                    continue
                for n, a in group:
                    dst = operands[n]
                    if dst is src or dst.stream_id() is not None or id(dst) in passed:
                        continue
                    if id(dst) in inputs:
                        passed.add(id(dst))
                        queue.append((dst, split_on(dst, a, split.chain)))
                        continue
                    replay_stream_split(dst, a, split)
                    queue.append((dst, stream_split(dst)))
    for tv in fusion.inputs:
        if id(tv) in passed and (split := _uniform_read(fusion, tv)) is not None:
            replay_stream_split(tv, split.axis, split)
    return fusion


def _uniform_read(fusion: Fusion, tv: TensorView) -> StreamSplit | None:
    """The split every op that reads ``tv`` slices it by (same axis, same chain), or None
    when some op reads it whole or the ops slice it in different ways."""
    reads: set[tuple[int, tuple[tuple[bool, int], ...]] | None] = set()
    for op, name in consumers(fusion, tv):
        out_split, axes = stream_split(op.out), dict(stream_group(op))
        reads.add(None if out_split is None or name not in axes
                  else (axes[name], out_split.chain))
    if len(reads) != 1 or None in reads:
        return None
    ((axis, chain),) = reads
    if [i for i in tv.logical if not i.is_reduction][axis] not in tv.loop:
        return None  # the user split that axis (without a stream): leave their schedule
    return split_on(tv, axis, chain)


def check_stream_consistency(fusion: Fusion) -> Fusion:
    """Before: propagated schedules. After: every stream split on a fusion input (only the
    user puts one there: propagation passes through inputs) is honoured by each op that
    reads it (the op loops over the same dimension with the same splits); otherwise raises
    ScheduleError. Intermediates need no check: a consumer that loops differently reads the
    producer's whole result."""
    for tv in fusion.inputs:
        split = stream_split(tv)
        if split is None:
            continue
        for op, name in consumers(fusion, tv):
            out_split = stream_split(op.out)
            group = stream_group(op)
            if out_split is None or (name, split.axis) not in group:
                loop = (f"loops over {op.out.name} {out_split.describe()}" if out_split
                        else "is not stream-parallel")
                raise ScheduleError(
                    f"conflicting stream splits: {tv.name} {split.describe()} is on streams "
                    f"but {op.defn.name} {op.out.name} {loop}, which does not slice "
                    f"{tv.name} along axis {split.axis}; remove one of the two schedules"
                )
            if out_split.chain != split.chain:
                raise ScheduleError(
                    f"conflicting stream splits: {tv.name} {split.describe()} but "
                    f"{op.defn.name} {op.out.name} {out_split.describe()}; the same "
                    "dimension must be split the same way"
                )
    return fusion


def check_grouped_axes(fusion: Fusion) -> Fusion:
    """Before: propagated schedules. After: no op whose operand indexes its last axis by
    groups (``OpDef.groups``: a grouped dequantize, whose scale has one value per group of
    a row) has that axis split on streams; otherwise raises ScheduleError. Such an op is
    split along its other axes (a dequantized weight by rows)."""
    for op in fusion.ops:
        g = op.defn.groups(op.attrs) if op.defn.groups is not None else None
        split = stream_split(op.out)
        if g is not None and split is not None and split.axis == op.out.ndim - 1:
            grouped = ", ".join(f"{n}={t.name}" for n, t in op.args.items())
            raise ScheduleError(
                f"{op.defn.name} {op.out.name} (group_size={g}): axis {split.axis} is split "
                f"on streams ({split.describe()}), but its operands ({grouped}) index that "
                f"axis by groups of {g}; split it along another axis (rows, axis 0)")
    return fusion


def move_stream_to_front(fusion: Fusion) -> Fusion:
    """Before: a stream IterDomain anywhere in a loop domain. After: at position 0, other
    axes in their order (the host loop is the outermost loop)."""
    for tv in fusion.tensors:
        sid = tv.stream_id()
        if sid is not None:
            tv.reorder({tv.loop.index(sid): 0})
    return fusion


FUSION_PASSES: tuple[FusionPass, ...] = (
    validate_schedule,
    propagate_stream_sharding,
    check_stream_consistency,
    check_grouped_axes,
    move_stream_to_front,
)

# ---------------------------------------------------------------------------- segments


@dataclasses.dataclass
class Segment:
    """Consecutive ops that run in one host loop over stream slices (or in none)."""

    ops: list[Op]
    split: StreamSplit | None
    # (op position in ops, operand name) -> the axis sliced in the loop
    sliced: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    # positions of the ops whose contraction is split over the loop: each slice adds its
    # product onto the whole output
    accumulate: set[int] = dataclasses.field(default_factory=set)


def segment(fusion: Fusion) -> list[Segment]:
    """Groups ops into loops. Before: stream axes in front. After: a list of segments in
    definition order. An op joins the current segment when its output is split the same
    way and every operand produced earlier in the segment is read slice by slice along
    the axis it was produced on ("inlinable"); otherwise it starts a new segment, and its
    operands produced before are complete (allocated whole) when its loop starts.

    One more kind of op joins a loop: a GEMM whose contraction runs along the loop's
    split and that reads a host input there (``dX = dY @ w`` of a Linear split by output
    features, ``w`` in host memory). Its slices then stream in like the loop's other host
    operands, and each slice adds its product onto the whole output
    (``accumulate``); the alternative, one GEMM after the loop, would copy the host
    operand whole."""
    segments: list[Segment] = []
    for op in fusion.ops:
        split, slices = stream_split(op.out), dict(stream_group(op))
        cur = segments[-1] if segments else None
        if cur is not None and split is not None and cur.split is not None:
            produced = {s_op.out: s_i for s_i, s_op in enumerate(cur.ops)}
            same = (split.chain, split.count) == (cur.split.chain, cur.split.count)
            inlinable = same and all(
                p not in cur.accumulate and slices.get(name) == cur.sliced[(p, "out")]
                for name, t in op.operands().items() if (p := produced.get(t)) is not None
            )
            if inlinable:
                cur.ops.append(op)
                cur.sliced.update({(len(cur.ops) - 1, n): a for n, a in slices.items()})
                continue
        if cur is not None and split is None and cur.split is not None:
            contracted = _contraction_in_loop(fusion, op, cur)
            if contracted is not None:
                cur.ops.append(op)
                cur.sliced.update({(len(cur.ops) - 1, n): a for n, a in contracted.items()})
                cur.accumulate.add(len(cur.ops) - 1)
                continue
        segments.append(Segment([op], split, {(0, n): a for n, a in slices.items()}))
    return segments


def _contraction_in_loop(fusion: Fusion, op: Op, cur: Segment) -> dict[str, int] | None:
    """The operand axes ``op`` (an unsplit GEMM) would slice to join ``cur`` as a sum
    over the loop's slices, or None: every operand of one of its contractions is read in
    ``cur`` slice by slice along that axis already (an input another op of the loop
    slices so, or a result the loop produces sliced so), or is a host input contracted
    along its first axis (it then streams in by blocks of rows: dense copies), and at
    least one is each. A bias would be added once per slice: an op with one does not
    join, and neither does an op whose output is in host memory. Each slice's sum is
    rounded to the output's dtype: an fp16 output does not join either (a partial sum may
    overflow where the whole one fits); a bf16 one does (fp32's range; a few roundings
    more than one GEMM's)."""
    if not op.defn.is_gemm or "bias" in op.operands() or op.out.device != "cuda" or \
            op.out.dtype == torch.float16:
        return None
    inputs = {id(t) for t in fusion.inputs}
    in_loop: set[tuple[int, int]] = set()  # (tensor id, axis) read or made sliced in cur
    for (i, name), axis in cur.sliced.items():
        if i not in cur.accumulate:
            t = cur.ops[i].out if name == "out" else cur.ops[i].operands()[name]
            in_loop.add((id(t), axis))
    operands = op.operands()
    for group in op.axes():
        if not group.reduction:
            continue
        members = {n: a for n, a in group.inputs()}
        tied = [n for n, a in members.items() if (id(operands[n]), a) in in_loop]
        host = [n for n, a in members.items() if id(operands[n]) in inputs
                and operands[n].device == "cpu" and n not in tied and a == 0]
        if tied and host and len(tied) + len(host) == len(members):
            return members
    return None


def split_contractions(fusion: Fusion, segments: list[Segment]) -> list[Segment]:
    """Streams a host operand by dense blocks instead of strided ones: a loop of one
    2-D matmul that slices its host input ``b [k, n]`` (row-major) by columns, reading
    ``a`` whole, is turned into a loop over blocks of the contraction ``k``, each slice
    adding ``a[:, k_i] @ b[k_i, :]`` onto the whole output (``lower(...,
    split_contraction=True)``). A column block of a row-major matrix is a 2-D copy of
    short rows; a block of rows is one dense copy.

    Before:  for i [Stream]: T1_i = ShardByStream(T1, axis=1); T2_i = ShardByStream(T2,
             axis=1); Matmul(T0, T1_i, out=T2_i)
    After:   T2 = Allocate(..., zeroed=True)
             for i [Stream]: T0_i = ShardByStream(T0, axis=1); T1_i = ShardByStream(T1,
             axis=0); Matmul(T0_i, T1_i, out=T2, accumulate=True)
    Same slice count (the split's chain applied to ``k``), same staging bytes per slot;
    each slice also reads and writes the whole output, and a bf16 output is rounded once
    per slice instead of once. An fp16 output keeps its column slices (a partial sum may
    overflow fp16 where the whole one fits)."""
    rows = contraction_candidates(fusion, segments)
    return [rows.get(i, seg) for i, seg in enumerate(segments)]


def contraction_candidates(fusion: Fusion, segments: list[Segment]) -> dict[int, Segment]:
    """The loops ``split_contractions`` would change, by position in ``segments``, each
    with the loop that would replace it."""
    inputs = {id(t) for t in fusion.inputs}
    found: dict[int, Segment] = {}
    for i, seg in enumerate(segments):
        if seg.split is None or len(seg.ops) != 1 or seg.accumulate:
            continue
        op = seg.ops[0]
        a, b = op.operands().get("a"), op.operands().get("b")
        if (op.defn.name == "matmul" and a is not None and b is not None
                and a.ndim == 2 and b.ndim == 2 and id(b) in inputs and b.device == "cpu"
                and seg.sliced.get((0, "b")) == 1 and (0, "a") not in seg.sliced
                and op.out.device == "cuda" and op.out.dtype != torch.float16):
            split = split_on(a, 1, seg.split.chain)
            found[i] = Segment([op], split, {(0, "a"): 1, (0, "b"): 0}, {0})
    return found


def contraction_choice(fusion: Fusion, segments: list[Segment]) -> hir.ContractionChoice | None:
    """What ``lower(..., split_contraction="auto")`` weighs: the extents of each loop
    ``split_contractions`` could change (None if there is none)."""
    matmuls = []
    for i in contraction_candidates(fusion, segments):
        seg = segments[i]
        op = seg.ops[0]
        a, b = op.operands()["a"], op.operands()["b"]
        assert seg.split is not None
        matmuls.append(hir.StreamedMatmul(op.out.name, a.name, b.name, a.shape[0], a.shape[1],
                                          b.shape[1], seg.split.count, seg.split.chunk,
                                          b.dtype, op.out.dtype))
    if not matmuls:
        return None
    choice = hir.ContractionChoice(tuple(matmuls))
    return dataclasses.replace(choice, estimate=cost.estimate_str(choice, {})) \
        if choice.known() else choice


@dataclasses.dataclass
class AllocationPlan:
    """Which op outputs are allocated (whole) before each segment, and which
    intermediates are freed after it."""

    allocate_before: list[list[TensorView]]
    free_after: list[list[TensorView]]


def plan_allocations(fusion: Fusion, segments: list[Segment]) -> AllocationPlan:
    """Every op output is allocated whole before the segment that computes it, and loop
    iterations write their slices of it in place (a per-slice view, no copy). Outputs are
    returned; an intermediate is freed after the last segment that reads it.

    Whole allocation costs the intermediate's full size even when it lives inside one
    loop; allocating per slice would save memory but adds an allocator call per slice on
    the hot path, and with the pool's streams running concurrently the slices are live
    at the same time anyway.
    """
    last_read: dict[int, int] = {}
    for si, seg in enumerate(segments):
        for op in seg.ops:
            for t in op.inputs():
                last_read[id(t)] = si
    allocate_before = [[op.out for op in seg.ops] for seg in segments]
    free_after: list[list[TensorView]] = [[] for _ in segments]
    for seg_ops in allocate_before:
        for t in seg_ops:
            if t not in fusion.outputs and id(t) in last_read:
                free_after[last_read[id(t)]].append(t)
    return AllocationPlan(allocate_before, free_after)


# ---------------------------------------------------------------------------- host IR


def _compute_node(op: Op, names: dict[str, str], accumulate: bool = False) -> hir.Node:
    """The host-IR node of ``op``, its operands and output named by ``names``."""
    args = tuple(names.get(n) for n in op.defn.operands)
    attrs = tuple((k, op.attrs[k]) for k in op.defn.attrs)
    return hir.Compute.of(hir.Apply(op.defn.name, args, attrs), names["out"], accumulate)


def _constraints(fusion: Fusion) -> list[hir.Constraint]:
    """Extents that ops need equal but that are different expressions."""
    out: list[hir.Constraint] = []
    for op in fusion.ops:
        operands = op.operands()
        for group in op.axes():
            members = list(group.inputs())
            if not members:
                continue
            n0, a0 = members[0]
            e0 = operands[n0].shape[a0]
            for n, a in members[1:]:
                e = operands[n].shape[a]
                if e != e0:
                    what = (f"{op.defn.name} {op.out.name}: {n0}={operands[n0].name} axis "
                            f"{a0} and {n}={operands[n].name} axis {a}")
                    out.append(hir.Constraint(e0, e, what))
        out += _ties(op)
    return out


def _ties(op: Op) -> list[hir.Constraint]:
    """The extents ``op.defn.ties`` relates (a grouped dequantize's K is its scale's
    groups times group_size), where they are different expressions."""
    if op.defn.ties is None:
        return []
    operands, out = op.operands(), []
    for (n, a), (m, b), factor in op.defn.ties(operands, op.attrs):
        lhs = operands[n].shape[a]
        rhs = mul_extents(operands[m].shape[b], Const(factor))
        if lhs != rhs:
            what = (f"{op.defn.name} {op.out.name}: {n}={operands[n].name} axis {a} and "
                    f"{m}={operands[m].name} axis {b} times {factor}")
            out.append(hir.Constraint(lhs, rhs, what))
    return out


def _info(tv: TensorView) -> hir.TensorInfo:
    """With the residency of an input or output; ``hir.stage_host_tensors`` moves host
    tensors through the GPU."""
    return hir.TensorInfo(tv.name, tv.dtype, tuple(tv.shape), tv.device)


def build_host_program(
    fusion: Fusion, segments: list[Segment], plan: AllocationPlan, pool_size: int
) -> hir.HostProgram:
    """Segments -> host IR: allocations, a stream ForLoop per looped segment with a
    ShardByStream view for each sliced operand, compute nodes, deallocations. Streams
    and synchronization are added by the host-IR passes."""
    body: list[hir.Node] = []
    tensor_names = {t.name for t in fusion.tensors}
    for si, seg in enumerate(segments):
        sums = {id(seg.ops[k].out) for k in seg.accumulate}
        body += [hir.Allocate(_info(t), zeroed=id(t) in sums) for t in plan.allocate_before[si]]
        if seg.split is None:
            for op in seg.ops:
                body.append(_compute_node(op, {n: t.name for n, t in op.operands().items()}))
        else:
            loop_body: list[hir.Node] = []
            views: dict[tuple[str, int], str] = {}
            for oi, op in enumerate(seg.ops):
                names: dict[str, str] = {}
                for n, t in op.operands().items():
                    axis = seg.sliced.get((oi, n))
                    if axis is None:
                        names[n] = t.name
                        continue
                    if (t.name, axis) not in views:
                        view = _fresh_view_name(t.name, axis, tensor_names | set(views.values()))
                        views[(t.name, axis)] = view
                        # In t's own extent: operands tied by a constraint may spell
                        # one size differently.
                        chunk = chain_chunk(t.shape[axis], seg.split.chain)
                        loop_body.append(hir.ShardByStream(view, t.name, axis, "i", chunk))
                    names[n] = views[(t.name, axis)]
                loop_body.append(_compute_node(op, names, oi in seg.accumulate))
            body.append(hir.ForLoop("i", Const(0), seg.split.count, loop_body,
                                    ParallelType.Stream))
        body += [hir.Deallocate(t.name) for t in plan.free_after[si]]
    return hir.HostProgram(
        name=fusion.name,
        inputs=[_info(t) for t in fusion.inputs],
        outputs=[t.name for t in fusion.outputs],
        body=body,
        constraints=_constraints(fusion),
        options=hir.Options(pool_size=pool_size),
    )


def _fresh_view_name(tensor: str, axis: int, taken: set[str]) -> str:
    """``T0_i`` (the slice of T0 in loop i), unless a tensor or another view of this loop
    is named so already: then ``T0_i1`` (by axis), then ``T0_i1_2``, ``T0_i1_3``, ..."""
    for name in (f"{tensor}_i", f"{tensor}_i{axis}"):
        if name not in taken:
            return name
    n = 2
    while f"{tensor}_i{axis}_{n}" in taken:
        n += 1
    return f"{tensor}_i{axis}_{n}"


# ---------------------------------------------------------------------------- the pass list


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What lowering a scheduled fusion has made so far: its loops (``segments``), the
    contraction choice of ``split_contraction="auto"``, the allocation plan and, last,
    the host program. Each of ``LOWERING_PASSES`` fills in one more field."""

    fusion: Fusion
    pool_size: int
    split_contraction: bool | str
    segments: tuple[Segment, ...] = ()
    choice: hir.ContractionChoice | None = None
    plan: AllocationPlan | None = None
    program: hir.HostProgram | None = None


def segment_loops(state: Lowering) -> Lowering:
    """Before: the fusion's ops, stream axes in front. After: its loops (``segment``)."""
    return dataclasses.replace(state, segments=tuple(segment(state.fusion)))


def weigh_contractions(state: Lowering) -> Lowering:
    """``split_contraction="auto"``: records what the choice weighs (``contraction_choice``);
    this program keeps its column blocks (the driver lowers the row loop as its
    alternative where the choice is not settled). Before: ``split_contraction`` True,
    False or "auto". After: True or False, and the choice where it was "auto"."""
    if state.split_contraction != "auto":
        return state
    choice = contraction_choice(state.fusion, list(state.segments))
    return dataclasses.replace(state, choice=choice, split_contraction=False)


def split_contraction_loops(state: Lowering) -> Lowering:
    """With ``split_contraction=True``: the loops that stream a host operand by column
    blocks stream it by row blocks instead (``split_contractions``); else nothing."""
    if not state.split_contraction:
        return state
    return dataclasses.replace(
        state, segments=tuple(split_contractions(state.fusion, list(state.segments))))


def plan_buffers(state: Lowering) -> Lowering:
    """Before: the loops. After: what each allocates before it and frees after it
    (``plan_allocations``)."""
    return dataclasses.replace(state, plan=plan_allocations(state.fusion, list(state.segments)))


def lower_to_host_ir(state: Lowering) -> Lowering:
    """Before: the loops and their allocations. After: the host program
    (``build_host_program``), verified; streams and synchronization come from the host-IR
    passes."""
    assert state.plan is not None
    program = build_host_program(state.fusion, list(state.segments), state.plan,
                                 state.pool_size)
    return dataclasses.replace(state, program=hir.verify(program))


LoweringPass = Callable[[Lowering], Lowering]
LOWERING_PASSES: tuple[LoweringPass, ...] = (
    segment_loops,
    weigh_contractions,
    split_contraction_loops,
    plan_buffers,
    lower_to_host_ir,
)
