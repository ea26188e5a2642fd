"""codegen: stream-parallel host programs for PyTorch, generated as C++.

Describe a tensor program, split an axis onto CUDA streams, and get a host IR, C++ source,
a compiled torch op, and a reference evaluator. See README.md.
"""

# ruff: noqa: E402 - torch's version is checked before the modules that need a newer one

import torch as _torch

from .version import __version__, check_torch

# Before anything that uses torch's newer APIs: an old torch is one clear ImportError.
check_torch(str(_torch.__version__), str(_torch.__file__))

from .builder import BuildError, CompiledOp, build, compile
from .errors import InternalError, NoGPUError, ScheduleError
from .evaluator import evaluate
from .hostir import HostProgram
from .ir import (
    DeviceMesh,
    Fusion,
    IterDomain,
    ParallelType,
    TensorView,
    add,
    cast,
    gelu,
    input,
    linear,
    matmul,
    mul,
    output,
    relu,
    silu,
)
from .lowering import lower, schedule
from .renderer import render

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
    "evaluate",
    "gelu",
    "input",
    "linear",
    "lower",
    "matmul",
    "mul",
    "output",
    "relu",
    "schedule",
    "silu",
]
