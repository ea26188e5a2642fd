"""Reverse mode: the backward of a program is host programs, derived from its fusion.

``derive(fusion, wanted)`` builds, from the user's (scheduled) fusion, two fusions:

- the **saving forward**: the fusion with the intermediates the backward reads added as
  outputs after the user's. Only GEMM results are saved; a pointwise result the backward
  needs is recomputed there from what it is computed from (a kernel over data the backward
  reads anyway, cheaper than keeping it). Where nothing is saved, it is the forward itself.
- the **backward**: inputs are the forward values it reads (the forward's inputs, then the
  saved intermediates) and the gradients of the forward's outputs (``grad_<output>``);
  outputs are the gradients of the wanted inputs, in host memory for an input declared in
  host memory. Each op contributes its ``OpDef.vjp`` (codegen.frontend.ops); gradients of a value
  read twice are added. The split follows the forward: a gradient (or a recomputed value)
  is split like the forward tensor it belongs to, and the usual propagation spreads that
  to the rest, so ``x @ w`` split by output columns gives ``dW`` split by columns
  (``x.T @ dY_i``, per slice) and ``dX = dY @ w.T`` contracts the split axis whole, after
  the loop.

The autograd bridge (``codegen.runtime.autograd``) runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InternalError, ScheduleError
from ..frontend import grad_ops, ir, ops
from ..frontend.ir import Const, Fusion, Sym, TensorView
from ..frontend.schedule import StreamSplit, replay_stream_split, stream_split
from .lowering import schedule


@dataclasses.dataclass(frozen=True)
class Gradient:
    """The saving forward and the backward of one fusion, for one set of wanted inputs.

    ``saved_inputs`` are the indices of the forward inputs the backward reads (its first
    inputs, in this order), then come the saved intermediates (``saved_outputs``: their
    positions among the saving forward's outputs, the user's own outputs first), then the
    output gradients. ``grads`` says, per forward input, where its
    gradient is: ``("output", k)`` the backward's output k, ``("grad", j)`` the gradient
    of forward output j itself (``a + b`` passes it through), ``("zeros",)`` nothing
    depends on it, ``None`` not wanted."""

    forward: Fusion | None  # None: the forward itself saves everything (nothing extra)
    backward: Fusion | None  # None: no wanted gradient needs a program
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    grads: tuple[tuple[Any, ...] | None, ...]

    @property
    def n_saved(self) -> int:
        return len(self.saved_outputs)


def _spec(t: TensorView) -> list[int | str]:
    """``t``'s shape as ``cg.input`` takes it (named extents by name)."""
    spec: list[int | str] = []
    for e in t.shape:
        if isinstance(e, Const):
            spec.append(e.value)
        elif isinstance(e, Sym):
            spec.append(e.name)
        else:
            raise InternalError(f"{t.name}: extent {e} is neither fixed nor named")
    return spec


def _needs(fusion: Fusion, wanted: Sequence[bool]) -> set[int]:
    """The tensors (by id) whose gradient a wanted input's gradient depends on: the
    wanted inputs and every op result computed from one."""
    needs = {id(t) for t, w in zip(fusion.inputs, wanted) if w}
    for op in fusion.ops:
        if any(id(t) in needs for t in op.inputs()):
            needs.add(id(op.out))
    return needs


def derive(fusion: Fusion, wanted: Sequence[bool]) -> Gradient:
    """The saving forward and the backward of ``fusion`` (the user's, as scheduled) for
    the inputs ``wanted`` (one bool per input). Raises ScheduleError where an op on the
    way has no backward, naming it."""
    work = schedule(fusion)  # the propagated splits: the backward follows them
    if len(wanted) != len(work.inputs):
        raise InternalError(f"{fusion.name}: {len(wanted)} flags for {len(work.inputs)} inputs")
    for t, w in zip(work.inputs, wanted):
        if w and not t.dtype.is_floating_point:
            raise ScheduleError(f"{fusion.name}: input {t.name} is {t.dtype}: no gradient")
    needs = _needs(work, wanted)
    split_of: dict[int, StreamSplit] = {}  # backward tensor id -> forward's split
    primal: dict[int, TensorView] = {}  # forward tensor id -> its value in the backward
    saved: list[TensorView] = []  # forward intermediates the backward reads

    def value(t: TensorView) -> TensorView:
        """Forward tensor ``t`` in the backward: an input (a forward input, or a saved
        GEMM result), or a pointwise result recomputed from those."""
        if id(t) in primal:
            return primal[id(t)]
        op = t.definition
        if op is None or op.defn.is_gemm:
            v = ir.input(_spec(t), t.dtype, name=t.name, device=t.device if op is None
                         else "cuda")
            if op is not None:
                saved.append(t)
        else:
            v = ir._define(op.defn, dict(op.attrs),
                           **{n: value(a) for n, a in op.args.items()})
            _follow(v, t)
        primal[id(t)] = v
        return v

    def _follow(v: TensorView, t: TensorView) -> None:
        if (split := stream_split(t)) is not None:
            split_of[id(v)] = split

    grads: dict[int, TensorView] = {}
    bwd = Fusion(f"{fusion.name}_backward")
    # the forward's names, kept for the saved tensors declared later: no op takes them
    bwd._reserved = {t.name for t in work.tensors}
    with bwd:
        for out in work.outputs:
            grads[id(out)] = ir.input(_spec(out), out.dtype, name=f"grad_{out.name}",
                                      device=out.device)
        for op in reversed(work.ops):
            dy = grads.get(id(op.out))
            if dy is None or id(op.out) not in needs:
                continue
            if op.defn.vjp is None:
                raise ScheduleError(f"{fusion.name}: {op.defn.name} ({op.out.name}) has no "
                                    "backward")
            lazy = _Lazy(op.args, value)
            for name, g in op.defn.vjp(dy, lazy, dict(op.attrs), grad_ops.BUILDER).items():
                t = op.args.get(name)
                if t is None or id(t) not in needs:
                    continue
                if isinstance(g, ops.NoGradient):
                    raise g.error(t.name)
                if g.definition is not None:
                    _follow(g, t)
                old = grads.get(id(t))
                grads[id(t)] = g if old is None else ir.add(old, g)
                if old is not None:
                    _follow(grads[id(t)], t)
        outcome: list[tuple[Any, ...] | None] = []
        produced: dict[int, int] = {}
        grad_inputs = {id(grads[id(o)]): j for j, o in enumerate(work.outputs)}
        for t, w in zip(work.inputs, wanted):
            g = grads.get(id(t))
            if not w:
                outcome.append(None)
            elif g is None:
                outcome.append(("zeros",))
            elif g.definition is None:
                outcome.append(("grad", grad_inputs[id(g)]))
            elif id(g) in produced:
                outcome.append(("output", produced[id(g)]))
            else:
                produced[id(g)] = len(bwd.outputs)
                ir.output(g, device=t.device)
                outcome.append(("output", produced[id(g)]))
    taken = {t.name for t in bwd.tensors}
    for t in work.tensors:  # a gradient is named for its tensor, where that name is free
        g = grads.get(id(t))
        if g is not None and g.definition is not None and f"grad_{t.name}" not in taken:
            g.name = f"grad_{t.name}"
            taken.add(g.name)
    for v in bwd.tensors:
        split = split_of.get(id(v))
        if split is not None and v.definition is not None and v.stream_id() is None:
            replay_stream_split(v, split.axis, split)
    _prune(bwd)
    _loops_first(bwd)
    # The backward's inputs, in order: forward inputs it reads, saved results, gradients.
    names = {t.name for t in bwd.inputs}
    saved_inputs = tuple(k for k, t in enumerate(work.inputs) if t.name in names)
    saved = [t for t in saved if t.name in names]
    grad_names = [f"grad_{o.name}" for o in work.outputs]
    order = [work.inputs[k].name for k in saved_inputs] + [t.name for t in saved] + grad_names
    by_name = {t.name: t for t in bwd.inputs}
    bwd.inputs = [by_name[n] if n in by_name else _unused_grad(bwd, work, n) for n in order]
    forward, saved_outputs = _saving_forward(fusion, [t.name for t in saved])
    return Gradient(forward=forward, backward=bwd if bwd.outputs else None,
                    saved_inputs=saved_inputs, saved_outputs=saved_outputs,
                    grads=tuple(outcome))


class _Lazy(dict):  # type: ignore[type-arg]
    """An op's operands as backward values, each made (declared, or recomputed) only when
    a rule reads it: a gradient nobody wants then costs no saved tensor."""

    def __init__(self, args: dict[str, TensorView], value: Callable[[TensorView], Any]):
        super().__init__()
        self._args, self._value = args, value

    def __missing__(self, name: str) -> TensorView:
        v = self[name] = self._value(self._args[name])
        return v

    def __contains__(self, name: object) -> bool:
        return name in self._args


def _unused_grad(bwd: Fusion, work: Fusion, name: str) -> TensorView:
    """An output gradient the backward does not read (it was pruned): declared again so
    the backward's signature stays (saved..., every output's gradient)."""
    out = next(o for o in work.outputs if f"grad_{o.name}" == name)
    token = ir._current.set(bwd)
    try:
        t = ir.input(_spec(out), out.dtype, name=name, device=out.device)
    finally:
        ir._current.reset(token)
    bwd.inputs.remove(t)
    return t


def _prune(fusion: Fusion) -> None:
    """Drops the ops and inputs no output depends on (rules give every operand's
    gradient; only the wanted ones are outputs)."""
    live = {id(t) for t in fusion.outputs}
    kept: list[ir.Op] = []
    for op in reversed(fusion.ops):
        if id(op.out) in live:
            kept.append(op)
            live |= {id(t) for t in op.inputs()}
    fusion.ops = kept[::-1]
    fusion.inputs = [t for t in fusion.inputs if id(t) in live]


def _loops_first(fusion: Fusion) -> None:
    """Orders the ops so that the stream-split ones come first wherever their inputs
    allow: reverse mode emits each gradient's contraction over the split axis (an unsplit
    GEMM) between the split ops, which would cut one loop into several. Before: the ops
    in a valid order. After: a valid order (a topological one), split ops as early as
    their inputs allow, then the unsplit ones that read a host input (the input gradient
    of a host weight, which joins the loop before it and streams that weight: see
    ``passes.segment``), the relative order kept otherwise."""
    split = {op.out.name for op in schedule(fusion).ops if op.out.stream_id() is not None}
    host = {id(t) for t in fusion.inputs if t.device == "cpu"}
    done = {id(t) for t in fusion.inputs}
    todo, order = list(fusion.ops), []
    while todo:
        ready = [op for op in todo if all(id(t) in done for t in op.inputs())]
        op = next((o for o in ready if o.out.name in split), None) or \
            next((o for o in ready if any(id(t) in host for t in o.inputs())), ready[0])
        order.append(op)
        todo.remove(op)
        done.add(id(op.out))
    fusion.ops = order


def _saving_forward(fusion: Fusion, saved: list[str]) -> tuple[Fusion | None,
                                                                 tuple[int, ...]]:
    """``fusion`` with the tensors ``saved`` (by name) that are not outputs already as
    outputs after its own (None when that adds none), and each saved tensor's position
    among its outputs."""
    outputs = [t.name for t in fusion.outputs]
    extra = [name for name in dict.fromkeys(saved) if name not in outputs]
    positions = tuple((outputs + extra).index(name) for name in saved)
    if not extra:
        return None, positions
    work = fusion.clone()
    work.name = f"{fusion.name}_forward"
    by_name = {t.name: t for t in work.tensors}
    with work:
        for name in extra:
            ir.output(by_name[name])
    return work, positions
