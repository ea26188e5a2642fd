"""The call's choice: which loop of a ``split_contraction="auto"`` program runs.

A program lowered with ``split_contraction="auto"`` whose choice depends on extents known
only at the call carries the program that streams its host operands by blocks of rows
as its ``alternative`` (it streams them by blocks of columns itself). ``Dispatch`` picks
one of the two for a call's inputs, from their extents and the host operands' layouts,
with ``codegen.transforms.cost``; the compiled op (``CompiledOp``), the evaluator and the
stream-order checker all ask the program's one ``Dispatch`` (``dispatch(program)``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import hostir as hir
from ..frontend.ir import Sym
from ..transforms import cost


def row_major_matrix(x: torch.Tensor) -> bool:
    """Whether a block of ``x``'s rows is one dense run of memory per row (a 2-D matrix
    whose last axis is contiguous)."""
    return x.dim() != 2 or x.stride(1) == 1 or x.size(1) <= 1


def extent_axes(program: hir.HostProgram) -> tuple[tuple[str, int, int], ...]:
    """(extent, input position, axis): the input axis that binds each named extent of
    ``program``'s signature (the input checks' ``bind``)."""
    position = {t.name: i for i, t in enumerate(program.inputs)}
    return tuple((str(c.value), position[c.tensor], c.axis) for c in hir.dim_checks(program)
                 if c.kind == "bind")


class Dispatch:
    """Picks ``program`` (blocks of columns) or its ``alternative`` (blocks of rows) per
    call, and remembers the pick per (extents, layouts)."""

    def __init__(self, program: hir.HostProgram) -> None:
        if program.choice is None or program.alternative is None:
            raise ValueError(f"{program.name}: no choice left to the call")
        self.program = program
        self.choice = program.choice
        self.alternative = program.alternative
        # the input axes that give the choice's extents, the host inputs whose layout it
        # reads, and the choice made per (extents, layouts): True for the alternative
        self._extent_axes = extent_axes(program)
        self._host_inputs = [(i, t.name) for i, t in enumerate(program.inputs)
                             if t.device == "cpu"]
        self._rows: dict[tuple[int | bool, ...], bool] = {}

    def for_extents(self, env: Mapping[str, int],
                    row_major: Mapping[str, bool] | None = None) -> hir.HostProgram:
        """The program that runs for the extents ``env`` (and the host operands' layouts
        ``row_major``, by name, where given; all row-major where None)."""
        rows = cost.prefers_rows(self.choice, env, row_major)
        return self.alternative if rows else self.program

    def rows(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether the alternative runs for ``inputs``; False for inputs it cannot read
        (the program's input checks then say what is wrong)."""
        try:
            extents = [inputs[i].shape[a] for _, i, a in self._extent_axes]
            layouts = [row_major_matrix(inputs[i]) for i, _ in self._host_inputs]
        except (IndexError, AttributeError, TypeError):
            return False
        key = (*extents, *layouts)
        if torch.compiler.is_compiling() or not all(type(e) is int for e in extents):
            return self._decide(key)  # traced or symbolic: the choice becomes guards
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = self._decide(key)
        return rows

    def for_inputs(self, inputs: Sequence[torch.Tensor]) -> hir.HostProgram:
        """The program that runs for ``inputs``."""
        return self.alternative if self.rows(inputs) else self.program

    def _decide(self, key: tuple[Any, ...]) -> bool:
        """The choice for (extents, layouts) ``key``. Traced with the output's rows ``m``
        a symbolic size, the choice is one comparison, ``m < threshold``, which becomes
        the guard (not one guard, and one recompilation, per value of m); the other
        extents are specialized."""
        n = len(self._extent_axes)
        extents = {name: e for (name, _, _), e in zip(self._extent_axes, key[:n])}
        row_major = {name: bool(f) for (_, name), f in zip(self._host_inputs, key[n:])}
        m = next((mm.m.name for mm in self.choice.matmuls if isinstance(mm.m, Sym)), None)
        if m is not None and type(extents.get(m)) is not int:
            below = cost.choice_rows_below(
                self.choice, m, {k: int(e) for k, e in extents.items() if k != m}, row_major)
            if below is not None:
                return bool(extents[m] < below)
        env = {name: int(e) for name, e in extents.items()}
        return cost.prefers_rows(self.choice, env, row_major)


# Each program's Dispatch, by the program's id; an entry goes when its program is
# collected (a weakref.finalize), before the id can be reused.
_dispatches: dict[int, Dispatch] = {}
_lock = threading.Lock()


def dispatch(program: hir.HostProgram) -> Dispatch | None:
    """``program``'s one ``Dispatch``; None where it has no choice left to the call."""
    if program.alternative is None or program.choice is None:
        return None
    with _lock:
        found = _dispatches.get(id(program))
        if found is None:
            found = _dispatches[id(program)] = Dispatch(program)
            weakref.finalize(program, _dispatches.pop, id(program), None)
        return found


def chosen(program: hir.HostProgram, inputs: Sequence[torch.Tensor]) -> hir.HostProgram:
    """The program that runs for ``inputs``: ``program``, or its alternative where its
    dispatch picks that."""
    found = dispatch(program)
    return program if found is None else found.for_inputs(inputs)
