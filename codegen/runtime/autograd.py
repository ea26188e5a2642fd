"""The autograd bridge: a program's outputs with a backward through its derived programs.

``Function`` is a ``torch.autograd.Function`` over the two programs ``codegen.gradient``
derives (the saving forward and the backward), made on first use per set of wanted
inputs by a ``Runner``. The runner lowers them with the forward's options and hands
each to the ``realize`` function of the backend that called it (the compiled op builds
it, the evaluator runs it), so this module imports neither backend. ``register`` gives a
compiled op its autograd kernel, so ``op(x, w).sum().backward()``,
``torch.ops.codegen.<op>``, ``torch.compile`` and ``torch.library.opcheck`` all see the
backward; ``evaluate`` does the same for the evaluator.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import hostir as hir
from ..errors import InternalError, ScheduleError
from ..frontend.ir import Fusion
from ..transforms.gradient import Gradient, derive
from ..transforms.lowering import lower

# A backend's way to run a lowered program: the program -> a function of its inputs that
# returns its outputs (the compiled op's overload, or the evaluator).
Realize = Callable[[hir.HostProgram], Callable[..., Any]]

class Runner:
    """The programs of one differentiable program, made on first use per set of wanted
    inputs: lowered with the forward's options, then made runnable by ``realize`` (built
    by the compiled op's, run by the evaluator's).

    It keeps what it needs of the program (its name, source fusion and lowering
    options), not the program itself, so that the evaluator's cache of runners
    (``evaluator_runner``) does not keep the programs it is keyed by alive."""

    def __init__(self, program: hir.HostProgram, realize: Realize) -> None:
        if program.source is None:
            raise InternalError(f"{program.name}: no source fusion to differentiate")
        self.name = program.name
        self.source: Fusion = program.source
        # the forward's lowering options: the derived programs run the loops it runs
        self.options: dict[str, Any] = dict(
            pool_size=program.pool_size, gemm_sm_count=program.gemm_sm_count,
            copy_stream=program.copy_stream, staging=program.staging,
            split_contraction=program.split_contraction)
        self.gemm_library = program.gemm_library
        self.backward_gemm_library = backward_gemm_library(program)
        self.realize = realize
        self.n_outputs = len(program.outputs)
        self._plans: dict[tuple[bool, ...], tuple[Gradient, Any, Any]] = {}
        self._lock = threading.Lock()

    def plan(self, wanted: tuple[bool, ...]) -> tuple[Gradient, Any, Any]:
        """The gradient and its (saving forward, backward) runnables for ``wanted``."""
        with self._lock:
            if wanted not in self._plans:
                g = derive(self.source, wanted)
                self._plans[wanted] = (g, self._runnable(g.forward, keep=True),
                                       self._runnable(g.backward, keep=False))
            return self._plans[wanted]

    def _runnable(self, fusion: Fusion | None, keep: bool) -> Any:
        if fusion is None:
            return None
        program = lower(fusion, **self.options,
                        gemm_library=self.gemm_library if keep else self.backward_gemm_library)
        if not keep:
            program = program.replace(source=None)  # no backward of a backward
        run = self.realize(program)
        return lambda *args: _as_list(run(*args))


def backward_gemm_library(program: hir.HostProgram) -> str:
    """The GEMM library of ``program``'s backward: cublasGemmEx, the call torch's own
    backward makes, unless an SM budget (which only cuBLASLt has) was asked for. The
    backward's GEMMs have no epilogue (a bias gradient is a row sum, an activation's
    gradient a kernel), and on the H200 cuBLASLt's choice for their slices ran the
    GPU-resident ``llama_mlp`` step 1-2% slower than cublasGemmEx's
    (``benchmarks/results/backward_streams.txt``)."""
    return program.gemm_library if program.gemm_sm_count else "cublas"


def _as_list(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


class Function(torch.autograd.Function):
    """``Function.apply(runner, forward, *inputs)``: the program's outputs, with a
    backward through its derived programs. ``forward`` runs the program itself below
    autograd (the compiled op's overload, or the evaluator)."""

    @staticmethod
    def forward(ctx: Any, runner: Runner, run_forward: Callable[..., Any],
                *inputs: torch.Tensor) -> Any:
        wanted = tuple(bool(x) for x in ctx.needs_input_grad[2:])
        ctx.runner, ctx.wanted, ctx.error = runner, wanted, None
        try:
            gradient, saving, _ = runner.plan(wanted)
        except ScheduleError as e:  # forward runs; backward, if it is ever asked for, fails
            ctx.error = e
            outs = _as_list(run_forward(*inputs))
            return tuple(outs) if len(outs) > 1 else outs[0]
        outs = _as_list(saving(*inputs) if saving is not None else run_forward(*inputs))
        n = runner.n_outputs
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in inputs]
        ctx.save_for_backward(*[inputs[k] for k in gradient.saved_inputs],
                              *[outs[k] for k in gradient.saved_outputs])
        result = tuple(outs[:n])
        return result if n > 1 else result[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.error is not None:
            raise ScheduleError(f"{ctx.runner.name}: no backward: {ctx.error}")
        if torch.is_grad_enabled() and any(
                t.requires_grad for t in (*ctx.saved_tensors, *grads) if t is not None):
            # create_graph=True: the gradients would be constants of the graph built on them
            raise ScheduleError(f"{ctx.runner.name}: no double backward: the "
                                "gradient programs have no backward of their own, and "
                                "backward(create_graph=True) or torch.autograd.grad(..., "
                                "create_graph=True) through this op needs one")
        gradient, _, backward = ctx.runner.plan(ctx.wanted)
        grads = tuple(g.contiguous() for g in grads)  # sum().backward() gives expanded ones
        outs = _as_list(backward(*ctx.saved_tensors, *grads)) if backward is not None else []
        result: list[torch.Tensor | None] = [None, None]
        for where, (shape, dtype, device) in zip(gradient.grads, ctx.shapes):
            if where is None:
                result.append(None)
            elif where[0] == "output":
                result.append(outs[where[1]])
            elif where[0] == "grad":
                result.append(grads[where[1]])
            else:
                result.append(torch.zeros(shape, dtype=dtype, device=device))
        return tuple(result)


def requires_grad(inputs: Sequence[object]) -> bool:
    """Whether autograd records a call on ``inputs`` (grad mode on, an input requires
    grad)."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def register(program: hir.HostProgram, qualname: str, overload: Any,
             library: torch.library.Library, realize: Realize) -> None:
    """Gives the compiled op ``qualname`` (its ``overload``) an autograd kernel: calls
    that record go through ``Function``; the others run the op below autograd.
    ``realize`` builds the derived programs."""
    runner = Runner(program, realize)

    def run_forward(*args: torch.Tensor) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args)

    def kernel(*args: Any) -> Any:
        if requires_grad(args):
            return Function.apply(runner, run_forward, *args)
        return run_forward(*args)

    library.impl(qualname.split("::")[1], kernel, "Autograd")


# The evaluator's runners, by the id of the program each belongs to; an entry goes when its
# program is collected (a weakref.finalize), before the id can be reused.
_evaluator_runners: dict[int, Runner] = {}
_evaluator_runners_lock = threading.Lock()


def evaluator_runner(program: hir.HostProgram, realize: Realize) -> Runner:
    """The runner of ``program`` for the evaluator, made on its first call that records:
    the backward is derived and lowered once per program (and set of wanted inputs), not
    on every call (a model's Linears call one program again and again)."""
    with _evaluator_runners_lock:
        runner = _evaluator_runners.get(id(program))
        if runner is None:
            runner = _evaluator_runners[id(program)] = Runner(program, realize)
            weakref.finalize(program, _evaluator_runners.pop, id(program), None)
        return runner


def evaluate(program: hir.HostProgram, inputs: Sequence[torch.Tensor],
             run: Callable[[], list[torch.Tensor]], realize: Realize) -> list[torch.Tensor]:
    """The evaluator's outputs for ``inputs`` (``run`` computes them), with a backward
    where autograd records, its programs run by ``realize``."""
    runner = evaluator_runner(program, realize)
    return _as_list(Function.apply(runner, lambda *args: run(), *inputs))
