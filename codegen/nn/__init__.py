"""Offload a model's Linear weights to host memory in one line, and run it.

    import codegen.nn
    model = codegen.nn.offload(model, slices=8)    # in place; returns the model
    model(x)                                         # or model.generate(...)
    codegen.nn.report(model)                         # what the last forward moved

``offload`` (the arena, the offloaded Linears, the report) is in ``offload.py``; the decode
steps a CUDA graph captures are in ``decode.py``.
"""

from .decode import StaticDecodeStep, cache_keyword, capture_graph, static_cache
from .offload import (
    ALIGN,
    Arena,
    OffloadedLinear,
    Report,
    arena,
    offload,
    offload_plan,
    report,
)
from .quantize import quantize_weight

__all__ = [
    "ALIGN",
    "Arena",
    "OffloadedLinear",
    "Report",
    "StaticDecodeStep",
    "arena",
    "cache_keyword",
    "capture_graph",
    "offload",
    "offload_plan",
    "quantize_weight",
    "report",
    "static_cache",
]
