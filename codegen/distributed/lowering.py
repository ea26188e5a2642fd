"""The lowering of a distributed fusion to a host program: the local extents of sharded
axes, and the loop that slices each communication with its GEMM
(``build_host_program``, called by ``lowering.lower``)."""

from __future__ import annotations

from .. import hostir as hir
from ..errors import InternalError, ScheduleError
from ..frontend.ir import Const, Expr, Fusion, Mul, Sym, TensorView, ceil_div, mul_extents
from .analysis import AxisLayout, Plan, analyze
from .nodes import CheckDivisible, Communication, CommunicationType, Stream, Unflatten, Wait

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
                           constraints=_constraints(plan, local),
                           options=hir.Options(pool_size=pool_size))


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
