"""The program an offloaded ``nn.Linear`` runs: its definition, owned by ``codegen.nn``."""

from __future__ import annotations

import torch

from ..errors import ScheduleError
from ..frontend import ir
from ..frontend.ir import Fusion, ParallelType


def offload_linear(dtype: torch.dtype = torch.bfloat16, slices: int = 8, bias: bool = False,
                   name: str = "offload_linear") -> Fusion:
    """``F.linear(x, w, bias)``: x [m, k] on the GPU, w [n, k] (and bias [n]) in host
    memory, streamed in by row blocks of ``slices`` (the output features); every extent
    symbolic, so one program serves every Linear of a dtype (``codegen.nn.offload``)."""
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise ScheduleError(f"{name}: slices must be an int >= 1, got {slices!r}")
    with Fusion(name) as fusion:
        x = ir.input(["m", "k"], dtype, name="x")
        w = ir.input(["n", "k"], dtype, name="w", device="cpu")
        b = ir.input(["n"], dtype, name="bias", device="cpu") if bias else None
        out = ir.linear(x, w, b)
        ir.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(ParallelType.Stream)
    return fusion
