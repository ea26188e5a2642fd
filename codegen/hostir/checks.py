"""The input checks of a program: each input size fixed, bound to a symbol, or
compared with one (``dim_checks``), in the order the C++ checks them."""

from __future__ import annotations

import dataclasses

from ..frontend.ir import Const, Expr
from .nodes import HostProgram

# ---------------------------------------------------------------------------- input checks


@dataclasses.dataclass(frozen=True)
class DimCheck:
    """One check of an input size, in order: ``fixed`` compares with a constant, ``bind``
    names a symbol from the size (its first use), ``same`` compares with a bound symbol."""

    tensor: str
    axis: int
    kind: str  # "fixed" | "bind" | "same"
    value: Expr


def dim_checks(program: HostProgram) -> list[DimCheck]:
    """The size checks of the inputs, shared by the evaluator and the generated C++."""
    bound: set[str] = set()
    checks: list[DimCheck] = []
    for t in program.inputs:
        for axis, e in enumerate(t.shape):
            if isinstance(e, Const):
                checks.append(DimCheck(t.name, axis, "fixed", e))
            else:
                name = str(e)
                checks.append(DimCheck(t.name, axis, "same" if name in bound else "bind", e))
                bound.add(name)
    return checks
