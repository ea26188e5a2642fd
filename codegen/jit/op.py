"""A host program -> a registered torch op (``CompiledOp``), and ``compile``.

``build`` renders (only when the cache misses), builds and loads a program's library,
and registers what the C++ does not: the fake implementation and the autograd kernel
(``codegen.runtime.autograd``, given this module's way to build the derived programs).
``CompiledOp`` calls the op, picking its alternative per call through the program's
``Dispatch`` (``codegen.runtime.dispatch``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from .. import hostir as hir
from ..backend.renderer import (
    NAMESPACE,
    op_name,
    program_digest,
    render,
)
from ..errors import NoGPUError
from ..frontend.ir import Fusion
from ..interp.evaluator import check_inputs, program_device
from ..runtime import autograd, collectives
from ..runtime.dispatch import dispatch
from . import cache, compiler, extension, no_backward, precompiled
from .process import BuildError

# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger("codegen.jit")


def prepare() -> None:
    """Builds what the first program of a cache builds besides itself: the precompiled
    runtime and ``codegen_no_backward``; afterwards a program's build time is its own."""
    try:
        cache._private(cache.cache_root(), parents=True)
    except OSError as e:
        raise BuildError(f"codegen: cannot create the build cache {cache.cache_root()} ({e}); "
                         "set CODEGEN_CACHE_DIR to a writable folder") from None
    with precompiled._precompiled_runtime(compiler.toolchain()):
        pass
    no_backward._no_backward()


def differentiable(program: hir.HostProgram) -> bool:
    """Whether ``program`` has a backward (codegen.runtime.autograd): it was lowered from a fusion
    and does not communicate (a backward program itself has no source)."""
    return program.source is not None and not distributed.communications(program)


@functools.cache
def _autograd_library() -> torch.library.Library:
    return torch.library.Library(NAMESPACE, "IMPL")  # kept: it holds the registrations


def _register_python_parts(program: hir.HostProgram, qualname: str, overload: Any,
                           register: Callable[[bytes], int] | None) -> None:
    """What the C++ does not register: a fake implementation (output shapes for
    FakeTensor, meta tensors and torch.compile, after the same input checks as the
    evaluator) and an autograd kernel: the backward's (``autograd.register``) for a
    differentiable program; else one that says there is none (``register``, from
    ``_no_backward``: torch's C++ one; a Python formula where it is None or fails), so
    inputs that require grad (say, an nn.Parameter under inference) run forward, whoever
    calls the op, and backward fails with a message that names the op."""
    outputs = [program.allocations()[o] for o in program.outputs]
    n_inputs = len(program.inputs)

    def fake(*args: Any) -> Any:
        inputs = args[:n_inputs]  # a program with collectives also takes a group name
        env = check_inputs(program, inputs)
        device = program_device(program, inputs)  # host outputs are CPU tensors
        outs = [inputs[0].new_empty([e.evaluate(env) for e in o.shape], dtype=o.dtype,
                                    device="cpu" if o.device == "cpu" else device)
                for o in outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # noqa: ARG001
        raise RuntimeError(
            f"{program.name}: this op has no backward (a program with collectives, or one "
            "lowered without its source fusion, such as a backward program); compute it "
            "under torch.no_grad(), or with .detach()ed inputs, where gradients are not "
            "needed")

    torch.library.register_fake(qualname)(fake)
    if differentiable(program):
        autograd.register(program, qualname, overload, _autograd_library(), _realize)
        return
    if register is not None and register(qualname.split("::")[1].encode()) == 0:
        return
    if register is not None:
        log.warning("%s gets a Python autograd kernel (registering torch's C++ one failed)",
                    qualname)
    torch.library.register_autograd(qualname, backward)


def _realize(program: hir.HostProgram) -> Callable[..., Any]:
    """A derived program (a saving forward, a backward) as a built op, called below
    autograd."""
    return build(program)._overload


class CompiledOp:
    """A host program compiled to a torch op: ``op(*inputs)`` runs it.

    ``.name`` is the qualified op name (``codegen::<program>_<hash>``), ``.op`` the
    ``torch.ops`` packet, ``.source`` the C++, ``.host_ir`` the HostProgram.
    """

    def __init__(self, program: hir.HostProgram, op_name: str, library: Path,
                 source: str | None = None, alternative: CompiledOp | None = None) -> None:
        self.host_ir = program
        self.op_name = op_name
        self.library = library
        self._source = source
        self.name = f"{NAMESPACE}::{op_name}"
        self.op = getattr(getattr(torch.ops, NAMESPACE), op_name)
        self._overload = self.op.default  # called directly: no overload resolution per call
        self._communicates = bool(distributed.communications(program))
        self._differentiable = differentiable(program)
        # split_contraction="auto" left to the call: the op of program.alternative, and
        # the program's dispatch, which picks it per call
        self.alternative = alternative
        self._dispatch = dispatch(program) if alternative is not None else None
        # Host inputs only: no input says which GPU runs the op (the current one does).
        self._host_only = all(t.device == "cpu" for t in program.inputs)

    def pick(self, inputs: Sequence[torch.Tensor]) -> CompiledOp:
        """The op that runs for ``inputs``: this one, or its alternative where the
        program's dispatch picks that for the inputs' extents and layouts (``lower``'s
        ``split_contraction="auto"``, ``codegen.dispatch``)."""
        if self._dispatch is None or self.alternative is None:
            return self
        return self.alternative if self._dispatch.rows(inputs) else self

    @property
    def source(self) -> str:
        """The C++ (rendered on first access when the op came from the cache)."""
        if self._source is None:
            self._source = render(self.host_ir)
        return self._source

    def __call__(self, *inputs: torch.Tensor, group: Any = None) -> Any:
        """Runs the op; a program with collectives runs them over ``group`` (default:
        torch.distributed's default group), resolved now."""
        if self.alternative is not None:
            op = self.pick(inputs)
            if op is not self:
                return op(*inputs, group=group)
        if self._communicates:
            pg = distributed.resolve_group(self.host_ir, group)
            return self._overload(*inputs, pg.group_name)  # type: ignore[union-attr]
        if group is not None:
            raise TypeError(f"{self.host_ir.name}: group= is only for programs with "
                            "collectives; this one has none")
        if self._host_only and not torch.cuda.is_available():
            raise NoGPUError(f"{self.host_ir.name}: the compiled op runs on a CUDA GPU, and "
                               "this machine has none; cg.evaluate(op.host_ir, inputs) runs "
                               "the same host program on the CPU")
        if not self._differentiable or autograd.requires_grad(inputs) or \
                torch.compiler.is_compiling():
            return self._overload(*inputs)
        with _below_autograd():  # skips the Python autograd kernel: nothing to record
            return self._overload(*inputs)

    def __repr__(self) -> str:
        return f"CompiledOp({self.name}, library={self.library})"


_below_autograd = torch._C._AutoDispatchBelowAutograd
_registered: set[str] = set()  # ops whose Python parts are registered in this process


def build(program: hir.HostProgram, source: str | None = None) -> CompiledOp:
    """Builds (or loads from cache) the op of ``program``; ``source`` defaults to
    ``render(program)``."""
    if not isinstance(program, hir.HostProgram):
        hint = "; for a cg.Fusion, cg.compile(fusion) lowers and builds it" \
            if isinstance(program, Fusion) else ""
        raise TypeError(f"build expects a cg.HostProgram (from cg.lower), got "
                        f"{type(program).__name__}{hint}")
    alternative = None
    if program.alternative is not None:  # as differentiable as the program it stands for
        alternative = build(program.alternative if program.source is not None
                            else program.alternative.replace(source=None))
    name = op_name(program)
    if distributed.communications(program):
        collectives.register()
    if source is None:  # the digest covers the program, the templates and the renderer
        library = extension.build_library(name, lambda: render(program),
                                key=f"rendered:{program_digest(program)}")
    else:
        library = extension.build_library(name, source)
    compiled = CompiledOp(program, name, library, source, alternative)
    # built (once) before the lock is taken: build_library takes it
    register = no_backward._no_backward()
    with cache._lock:
        if compiled.name not in _registered:
            _register_python_parts(program, compiled.name, compiled._overload, register)
            _registered.add(compiled.name)
    return compiled


def compile(fusion: Any, *, pool_size: int = 4,  # noqa: A001 - public API
            gemm_sm_count: int = 0, gemm_library: str = "cublaslt",
            copy_stream: bool = False, staging: str = "slots",
            split_contraction: bool | str = False) -> CompiledOp:
    """Lower, render, build and load ``fusion`` as a torch op. ``gemm_sm_count`` caps the
    SMs of each GEMM (cuBLASLt's SM_COUNT_TARGET; 0 = all); ``gemm_library="cublas"``
    calls cublasGemmEx instead of cached cuBLASLt plans (the default); ``copy_stream``
    queues host-to-device copies on one stream; ``staging="ring"`` lands them in the
    thread's staging ring, ahead of the caller's stream; ``split_contraction`` streams a
    row-major host operand read by column blocks as blocks of rows (see ``lower``);
    ``"auto"`` builds both loops where the choice depends on the call's extents, and
    each call runs the one ``codegen.transforms.cost`` estimates faster (``CompiledOp.pick``)."""
    from ..transforms.lowering import lower

    return build(lower(fusion, pool_size=pool_size, gemm_sm_count=gemm_sm_count,
                       gemm_library=gemm_library, copy_stream=copy_stream, staging=staging,
                       split_contraction=split_contraction))
