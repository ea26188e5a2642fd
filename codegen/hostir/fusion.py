"""Pointwise fusion: a chain of elementwise ops into one kernel, or into its GEMM's
epilogue (``fuse_pointwise``)."""

from __future__ import annotations

import dataclasses

from ..frontend import ops
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


def _users(program: HostProgram, t: str) -> tuple[str, list[Node]] | None:
    """What is read of intermediate ``t`` (``t``, or its one slice view) and the nodes
    that write or read it (its Allocate, view and Deallocate aside); None where ``t`` has
    several views."""
    views = [n for n in program.nodes() if isinstance(n, ShardByStream) and n.tensor == t]
    if len(views) > 1:
        return None
    value = views[0].out if views else t
    return value, [n for n in program.nodes() if not isinstance(n, (ForLoop, Deallocate))
                   and (t in n.uses() or value in n.uses()) and n not in views]


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
    if (found := _users(program, t)) is None:
        return None
    value, users = found
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


def _alone(e: Apply) -> bool:
    """Whether ``e``'s op is a kernel of its own: an op whose operand indexes its last
    axis by groups (``OpDef.groups``: a grouped dequantize) iterates a shape no other op
    has, ``[.., K / g, g]``."""
    return e.defn.groups is not None and e.defn.groups(dict(e.attrs)) is not None


def _one_way(program: HostProgram, e: Apply) -> bool:
    """Whether one kernel can compute ``e``: it reads each value along one set of axes
    (``Apply.read_axes``). A value read both as a dequantize's per-row scale ``[n]``
    (along the rows) and as a bias (along the columns) would need two views of it."""
    ranks = {v: len(t.shape) for v, t in value_infos(program).items()}
    ways: dict[str, set[tuple[int | None, ...]]] = {}
    for v, axes in e.read_axes(ranks):
        ways.setdefault(v, set()).add(axes)
    return all(len(w) == 1 for w in ways.values())


def _count(e: Apply, value: str) -> int:
    return sum(_count(a, value) if isinstance(a, Apply) else a == value for a in e.args)


def _fused(f: _Fusion, program: HostProgram) -> Compute | None:
    """The one node computing ``f.consumer`` with ``f.producer``'s expression in place of
    ``f.value``, or None where the two cannot be one node:

    - a pointwise producer inlines into a pure pointwise consumer's kernel (never into a
      GEMM's operands: a dequantized weight is stored before its GEMM reads it); a cast
      producer stays where it stores (it rounds), and a cast consumer takes a producer
      only if the producer's result is already in the expression's compute dtype (no
      rounding of it is lost); an op that is a kernel of its own (``_alone``: a grouped
      dequantize) fuses with nothing, and the fused kernel must read each value one way
      (``_one_way``);
    - a GEMM takes a one-operand consumer as its epilogue where cuBLASLt has one for it
      (and the program's GEMMs use cuBLASLt)."""
    c, p = f.consumer.expr, f.producer.expr
    if not c.defn.is_pointwise or f.consumer.gemm is not None or \
            f.producer.epilogue is not None:
        return None
    if p.defn.is_pointwise and p.defn is not ops.CAST:
        if _alone(c) or _alone(p):
            return None
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
        fused = inline(c)
        return Compute.of(fused, f.consumer.out) if _one_way(program, fused) else None
    epilogue = c.defn.epilogue(dict(c.attrs)) if c.defn.epilogue else None
    if p.defn.is_gemm and p.defn.epilogues and epilogue and c.args == (f.value,) and \
            program.gemm_library == "cublaslt":
        return Compute.of(dataclasses.replace(c, args=(p,)), f.consumer.out)
    return None


def _recomputed(program: HostProgram, t: str) -> tuple[Compute, dict[int, Compute]] | None:
    """Whether intermediate ``t`` can be recomputed inside each of its readers instead of
    stored: its producer and its readers as they would become (by node id), or None.

    ``t`` (or its one slice view) is a GPU allocation, not an output, written by one
    pointwise Compute of one operand (``silu(T4_i)``: not a cast, which rounds) and read
    by two or more pure pointwise Computes after it in the same body (one reader is
    ``_fusable``'s case). Nothing between the producer and its last reader writes or
    frees the operand, so each reader reads the operand where it read ``t``: no more
    bytes (same dtype and shape), and ``t`` is never written."""
    if (found := _users(program, t)) is None:
        return None
    value, users = found
    if len(users) < 3 or not all(isinstance(u, Compute) for u in users):
        return None
    producer, *readers = users
    assert isinstance(producer, Compute)
    p = producer.expr
    if producer.out != value or not p.defn.is_pointwise or p.defn is ops.CAST or \
            producer.epilogue is not None or len(p.leaves()) != 1 or producer.accumulate:
        return None
    roots = view_roots(program)
    (operand,) = p.leaves()  # a pointwise op other than a cast keeps its operand's dtype
    body = next((b for b in [program.body] + [n.body for n in program.nodes()
                                               if isinstance(n, ForLoop)]
                 if all(any(u is n for n in b) for u in users)), None)
    if body is None:
        return None
    ids = [id(n) for n in body]
    first, last = ids.index(id(producer)), max(ids.index(id(u)) for u in readers)
    between = [m for n in body[first + 1:last] for m in _with_children(n)]
    touched = {roots.get(v, v) for n in between
               for v in (n.uses() if isinstance(n, Deallocate) else n.writes())}
    if roots.get(operand, operand) in touched:  # overwritten or freed before a reader
        return None
    fused: dict[int, Compute] = {}
    for r in readers:
        assert isinstance(r, Compute)
        c = r.expr
        if not c.defn.is_pointwise or c.defn is ops.CAST or r.gemm is not None or \
                r.accumulate or value in r.writes() or _alone(c):
            return None

        def inline(e: Apply) -> Apply:
            return dataclasses.replace(e, args=tuple(
                p if a == value else inline(a) if isinstance(a, Apply) else a for a in e.args))
        if not _one_way(program, inline(c)):
            return None
        fused[id(r)] = Compute.of(inline(c), r.out)
    return producer, fused


def _with_children(n: Node) -> list[Node]:
    return [n, *(m for c in n.children() for m in _with_children(c))]


def _recompute(nodes: list[Node], t: str, producer: Compute,
               fused: dict[int, Compute]) -> list[Node]:
    """``nodes`` without ``producer`` and intermediate ``t`` (its Allocate, view and
    Deallocate), each reader replaced by its node in ``fused``."""
    out: list[Node] = []
    for n in nodes:
        if n is producer or (isinstance(n, ShardByStream) and n.tensor == t) or \
                (isinstance(n, Allocate) and n.out.name == t) or \
                (isinstance(n, Deallocate) and n.tensor == t):
            continue
        if isinstance(n, ForLoop):
            n = dataclasses.replace(n, body=_recompute(n.body, t, producer, fused))
        out.append(fused.get(id(n), n))
    return out


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
    The intermediate's Allocate, view and Deallocate go with it. A one-operand
    pointwise result read by several pointwise nodes is recomputed in each of them
    (``_recomputed``): each reads the operand instead, no more bytes than before.

    Before:  Silu(T4_i, out=T9_i); Mul(T9_i, T6_i, out=T10_i); Mul(g_i, T9_i, out=T11_i)
    After:   Mul(Silu(T4_i), T6_i, out=T10_i); Mul(g_i, Silu(T4_i), out=T11_i)
    Values are as before up to rounding: the fused node rounds once, where the two nodes
    rounded the intermediate to its dtype (as Inductor's fusion does).
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
                if (again := _recomputed(program, t)) is not None:
                    program = program.replace(body=_recompute(program.body, t, *again))
                    changed = True
                    break
                continue
            found.fused = _fused(found, program)
            if found.fused is None or (found.at_producer and found.fused.gemm is None):
                continue  # a kernel reads the consumer's other inputs: the consumer's place
            program = program.replace(body=_fuse(program.body, t, found))
            changed = True
            break
    return program


def _sum_of_gemms(program: HostProgram, t: str, add: Compute) -> str | None:
    """How GEMMs alone make ``t``, read by ``add`` and nothing else: ``"whole"`` (one GEMM
    at the top level writes it), ``"sum"`` (a zeroed allocation that GEMMs accumulate
    into, all in one loop body), or None."""
    if t in program.outputs:
        return None
    allocs = [n for n in program.body if isinstance(n, Allocate) and n.out.name == t]
    others = [n for n in program.nodes() if t in n.uses() and n is not add and
              not isinstance(n, (Allocate, Deallocate))]
    if len(allocs) != 1 or allocs[0].out.device != "cuda" or not others:
        return None
    if not all(isinstance(n, Compute) and n.out == t and n.epilogue is None and
               n.expr.defn.is_gemm and n.expr.defn.accumulates and
               "bias" not in n.expr.operands() for n in others):
        return None
    if not allocs[0].zeroed:
        top = any(n is others[0] for n in program.body)
        return "whole" if len(others) == 1 and not others[0].accumulate and top else None
    loops = [n for n in program.nodes() if isinstance(n, ForLoop)
             and all(any(w is m for m in n.body) for w in others)]
    ok = loops and all(isinstance(n, Compute) and n.accumulate for n in others)
    return "sum" if ok else None


def accumulate_sums(program: HostProgram) -> HostProgram:
    """Adds two GEMM results by accumulating one GEMM onto the other's output, instead of
    storing both and adding them (the sum of two input gradients: ``dX`` of ``x`` read by
    two GEMMs).

    Before:  T14 = Allocate(bfloat16[m, h]); Matmul(g6, w_up, out=T14)
             T17 = Allocate(bfloat16[m, h]); Matmul(g4, w_gate, out=T17)
             grad_x = Allocate(bfloat16[m, h]); Add(T14, T17, out=grad_x)
             Deallocate(T14); Deallocate(T17)
    After:   grad_x = Allocate(bfloat16[m, h]); Matmul(g6, w_up, out=grad_x)
             Matmul(g4, w_gate, out=grad_x, accumulate=True)
    Both terms are whole GEMMs on the program's stream (the second accumulates onto the
    first), or both are sums over the slices of one stream loop (one zeroed allocation
    that every slice's GEMMs accumulate into; ``order_accumulation`` orders them as one
    sum). Values: the second product is added in the GEMM's fp32 accumulator and rounded
    once, where the Add rounded each product first."""
    changed = True
    while changed:
        changed = False
        for add in program.body:
            if not (isinstance(add, Compute) and add.expr.defn is ops.ADD and
                    not add.accumulate and all(isinstance(a, str) for a in add.expr.args)):
                continue
            a, b = add.expr.args
            infos, c = program.allocations(), add.out
            if a == b or c not in infos or infos[c].device != "cuda" or any(
                    infos.get(v) is None or infos[v].type_str() != infos[c].type_str()
                    for v in (a, b)):
                continue
            kinds = {_sum_of_gemms(program, v, add) for v in (a, b)}
            if len(kinds) != 1 or None in kinds or \
                    [n for n in program.nodes() if c in n.writes()] != [add]:
                continue
            program = program.replace(body=_summed(program.body, a, b, add,
                                                   zeroed=kinds == {"sum"}))
            changed = True
            break
    return program


def _summed(body: list[Node], a: str, b: str, add: Compute, zeroed: bool) -> list[Node]:
    """``body`` with ``a`` and ``b``'s GEMMs writing ``add.out`` (all but the first
    accumulating) and allocated where ``a`` or ``b`` first was, ``add`` and the two
    intermediates gone."""
    c = add.out
    alloc = next(n for n in body if isinstance(n, Allocate) and n.out.name == c)
    seen = {"allocate": False, "gemm": False}

    def walk(nodes: list[Node]) -> list[Node]:
        out: list[Node] = []
        for n in nodes:
            if n is add or n is alloc or isinstance(n, Deallocate) and n.tensor in (a, b):
                continue
            if isinstance(n, Allocate) and n.out.name in (a, b):
                if not seen["allocate"]:
                    out.append(dataclasses.replace(alloc, zeroed=zeroed))
                seen["allocate"] = True
                continue
            if isinstance(n, ForLoop):
                n = dataclasses.replace(n, body=walk(n.body))
            elif isinstance(n, Compute) and n.out in (a, b):
                n = Compute.of(n.expr, c, accumulate=zeroed or seen["gemm"])
                seen["gemm"] = True
            out.append(n)
        return out

    return walk(body)
