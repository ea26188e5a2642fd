"""Pointwise fusion: a chain of elementwise ops into one kernel, or into its GEMM's
epilogue (``fuse_pointwise``)."""

from __future__ import annotations

import dataclasses

from .. import ops
from .cleanup import view_roots
from .nodes import (
    Allocate,
    Apply,
    Compute,
    Deallocate,
    ForLoop,
    HostProgram,
    Node,
    RingSlot,
    ShardByStream,
    TensorInfo,
)


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
