"""codegen: stream-parallel host programs for PyTorch, generated as C++.

Describe a tensor program, split an axis onto CUDA streams, and get a host IR, C++ source,
a compiled torch op, and a reference evaluator. See README.md.
"""

# ruff: noqa: E402 - torch's version is checked before the modules that need a newer one

import logging as _logging
import sys as _sys

import torch as _torch

from .version import __version__, check_torch

# Before anything that uses torch's newer APIs: an old torch is one clear ImportError.
check_torch(str(_torch.__version__), str(_torch.__file__))

from .backend.renderer import render
from .errors import InternalError, NoGPUError, ScheduleError
from .frontend.ir import (
    DeviceMesh,
    Fusion,
    IterDomain,
    ParallelType,
    TensorView,
    add,
    cast,
    dequantize,
    gelu,
    input,
    linear,
    matmul,
    mul,
    output,
    relu,
    silu,
)
from .hostir import HostProgram
from .interp.evaluator import evaluate
from .jit import BuildError, CompiledOp, build, compile
from .transforms.lowering import lower, schedule

__all__ = [
    "__version__",
    "BuildError",
    "CompiledOp",
    "DeviceMesh",
    "build",
    "compile",
    "render",
    "Fusion",
    "HostProgram",
    "InternalError",
    "IterDomain",
    "NoGPUError",
    "ParallelType",
    "ScheduleError",
    "TensorView",
    "add",
    "cast",
    "dequantize",
    "evaluate",
    "gelu",
    "input",
    "linear",
    "lower",
    "nn",
    "matmul",
    "mul",
    "output",
    "relu",
    "schedule",
    "silu",
]


class _UntilLoggingIsConfigured(_logging.StreamHandler):  # type: ignore[type-arg]
    """Writes codegen's records to stderr (``codegen: <message>``) while the application
    has configured no logging (the root logger has no handler), as a script that just
    calls ``cg.compile`` needs to see what a build is doing; once logging is configured,
    the records reach the application's handlers alone (they propagate)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_logging.Formatter("codegen: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> object:
        return _sys.stderr  # the current one (pytest, for one, replaces it)

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: _logging.LogRecord) -> None:
        if not _logging.getLogger().handlers:
            super().emit(record)


# INFO: what is being built and how long it took. Silenced like any library's messages:
# logging.getLogger("codegen").setLevel(logging.WARNING).
_logger = _logging.getLogger("codegen")
if _logger.level == _logging.NOTSET:
    _logger.setLevel(_logging.INFO)
_logger.addHandler(_UntilLoggingIsConfigured())

# `import codegen` gives codegen.nn and codegen.examples too; imported last, once the
# package is whole.
from . import examples, nn  # noqa: F401
