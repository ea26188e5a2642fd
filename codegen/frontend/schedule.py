"""Reading a TensorView's schedule: where its stream split is, and replaying it on another.

What the fusion passes, the tensor-parallel analysis and the gradient derivation read of
a schedule (the splits from the logical domain down to the loop domain), apart from the
passes that change it.
"""

from __future__ import annotations

import dataclasses

from ..errors import InternalError, ScheduleError
from .ir import (
    Const,
    Expr,
    Fusion,
    Op,
    ParallelType,
    Split,
    TensorView,
    ceil_div,
    mul_extents,
)


@dataclasses.dataclass(frozen=True)
class StreamSplit:
    """How a tensor's shape axis is cut into stream slices.

    ``chain`` lists the splits from the logical axis down to the stream IterDomain as
    (inner_split, factor); slice i covers ``[i*chunk, min((i+1)*chunk, n))`` and there
    are ``count`` slices (the last may be short or empty).
    """

    axis: int
    chain: tuple[tuple[bool, int], ...]
    count: Expr
    chunk: Expr

    def describe(self) -> str:
        splits = ", ".join(f"{'split' if inner else 'outer_split'}({f})"
                           for inner, f in self.chain) or "no split"
        return f"axis {self.axis} [{splits}]"


def splits(tv: TensorView) -> list[Split]:
    """Every split of ``tv``'s schedule, found from the loop domain up."""
    found: dict[int, Split] = {}  # keyed by the split input's id
    todo = list(tv.loop)
    while todo:
        i = todo.pop()
        if i.definition is not None and id(i.definition.input) not in found:
            found[id(i.definition.input)] = i.definition
            todo.append(i.definition.input)
    return list(found.values())


def stream_split(tv: TensorView) -> StreamSplit | None:
    """The stream split of ``tv``, found anywhere in its loop domain, or None."""
    sid = tv.stream_id()
    if sid is None:
        return None
    chain: list[tuple[bool, int]] = []
    node = sid
    while node.definition is not None:
        split = node.definition
        if node is split.inner:
            raise ScheduleError(
                f"{tv.name}: the stream axis {sid} is the inner part of a split of "
                f"{split.input}; its slices would not be contiguous ranges. Parallelize "
                "the outer part instead (outer_split(axis, S) gives S slices)"
            )
        chain.append((split.inner_split, split.factor))
        node = split.input
    if node not in tv.logical:
        raise InternalError(f"{tv.name}: stream axis {sid} does not come from the logical domain")
    axis = [i for i in tv.logical if not i.is_reduction].index(node)
    chain.reverse()
    return StreamSplit(axis, tuple(chain), sid.extent, chain_chunk(node.extent, tuple(chain)))


def replay_stream_split(tv: TensorView, axis: int, split: StreamSplit) -> None:
    """Applies ``split``'s chain to ``tv``'s shape axis ``axis`` and marks it Stream."""
    node = [i for i in tv.logical if not i.is_reduction][axis]
    if node not in tv.loop:  # the splits below only ever split what they just made
        raise ScheduleError(
            f"cannot propagate the stream split {split.describe()} to {tv.name} axis {axis}: "
            f"that axis was already split by the schedule {tv.loop_str()}"
        )
    for inner_split, factor in split.chain:
        pos = tv.loop.index(node)
        tv._split(pos, factor, inner_split)
        node = tv.loop[pos]
    node.parallelize(ParallelType.Stream)


def stream_group(op: Op) -> list[tuple[str, int]]:
    """The (operand, axis) pairs that index the same dimension as the output's stream
    axis; empty if the output is not stream-parallel."""
    split = stream_split(op.out)
    if split is None:
        return []
    for group in op.iteration_groups():
        if ("out", split.axis) in group:
            return list(group)
    raise InternalError(f"{op}: stream axis {split.axis} is in no iteration group")


def consumers(fusion: Fusion, tv: TensorView) -> list[tuple[Op, str]]:
    return [(op, name) for op in fusion.ops for name, t in op.operands().items()
            if t is tv and name != "out"]


def chain_extents(extent: Expr, chain: tuple[tuple[bool, int], ...]) -> tuple[Expr, Expr]:
    """(count, chunk) of ``chain`` applied to an axis of ``extent``: the extent of the last
    split's outer part, and the elements of the axis one index of it covers (the product of
    the inner extents along the chain)."""
    chunk: Expr = Const(1)
    for inner_split, factor in chain:
        outer, inner = ((ceil_div(extent, Const(factor)), Const(factor)) if inner_split
                        else (Const(factor), ceil_div(extent, Const(factor))))
        chunk, extent = mul_extents(chunk, inner), outer
    return extent, chunk


def chain_chunk(extent: Expr, chain: tuple[tuple[bool, int], ...]) -> Expr:
    return chain_extents(extent, chain)[1]


def split_on(tv: TensorView, axis: int, chain: tuple[tuple[bool, int], ...]) -> StreamSplit:
    """The StreamSplit ``chain`` would give ``tv``'s shape axis ``axis``, without applying it."""
    return StreamSplit(axis, chain, *chain_extents(tv.shape[axis], chain))
