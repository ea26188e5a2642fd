"""codegen: stream-parallel host programs for PyTorch, generated as C++.

Describe a tensor program, split an axis onto CUDA streams, and get a host IR, C++ source,
a compiled torch op, and a reference evaluator. See README.md.
"""

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
