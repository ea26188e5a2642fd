"""The canonical text of a host program: every field of every node, for the op name.

``canonical(value)`` serializes a value recursively and deterministically, from its data
alone, never from its ``str`` (which a node may abbreviate: ``CopyStream`` prints no pool)
nor from ``repr`` (which may hold a memory address). The same value gives the same text in
every process: nothing here depends on ``hash()``, ``id()`` or the order of a set.

    None, True, 3, 1.5    None, True, 3, 1.5 (a float as ``repr`` writes it, which
                          round-trips, so 1.0 and 1 differ)
    "T0"                  "T0" (JSON-quoted, ASCII only)
    torch.float32         torch.float32
    an enum member        codegen.frontend.ir.ParallelType.Stream (class and member name)
    a dataclass           codegen.hostir.Stream(index="i", pool=4): the qualified name of
                          its class, then every field (``dataclasses.fields``, in
                          declaration order, with ``repr=False`` and ``compare=False``
                          fields too, but not one whose metadata says ``digest: False``:
                          a program's source fusion, which its nodes already say all of);
                          the extents, ``codegen.frontend.ir.Expr``, are dataclasses
    a list, a tuple       [a, b], (a, b) (a one-element tuple: (a,))
    a dict                {k: v, ...} in insertion order: the order code that reads it
                          sees; equal dicts built in other orders get other texts (a
                          second build, never a wrong one)

Anything else (a set, a class, an arbitrary object, a subclass of ``int`` or ``str`` that
is not an enum) raises InternalError naming its type and where in the value it was, so a
node field of a new type fails the tests instead of being hashed by ``repr``. This module
is part of the renderer digest (it is not excluded there), so a change to the format
changes every op name.
"""

from __future__ import annotations

import dataclasses
import enum
import json

import torch

from ..errors import InternalError


def canonical(value: object) -> str:
    """The canonical text of ``value`` (see the module docstring)."""
    out: list[str] = []
    _write(value, out, type(value).__name__, set())
    return "".join(out)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _write(value: object, out: list[str], where: str, active: set[int]) -> None:
    """Appends the text of ``value`` to ``out``; ``where`` names the value's path for
    errors, ``active`` holds the containers being written (a cycle is an error)."""
    kind = type(value)
    if value is None or kind is bool or kind is int:
        out.append(str(value))
    elif kind is float:
        out.append(repr(value))
    elif kind is str:
        out.append(json.dumps(value, ensure_ascii=True))
    elif isinstance(value, torch.dtype):
        out.append(str(value))
    elif isinstance(value, enum.Enum):
        out.append(f"{_qualname(kind)}.{value.name}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        with _entered(value, where, active):
            out.append(_qualname(kind) + "(")
            fields = [f for f in dataclasses.fields(value) if f.metadata.get("digest", True)]
            for k, f in enumerate(fields):
                out.append(f"{', ' if k else ''}{f.name}=")
                _write(getattr(value, f.name), out, f"{where}.{f.name}", active)
            out.append(")")
    elif kind is list or kind is tuple:
        assert isinstance(value, (list, tuple))
        with _entered(value, where, active):
            out.append("[" if kind is list else "(")
            for k, item in enumerate(value):
                out.append(", " if k else "")
                _write(item, out, f"{where}[{k}]", active)
            out.append("]" if kind is list else ",)" if len(value) == 1 else ")")
    elif kind is dict:
        assert isinstance(value, dict)
        with _entered(value, where, active):
            out.append("{")
            for k, (key, item) in enumerate(value.items()):
                out.append(", " if k else "")
                _write(key, out, f"{where} key {k}", active)
                out.append(": ")
                _write(item, out, f"{where}[{key!r}]", active)
            out.append("}")
    else:
        raise InternalError(f"digest: no canonical form for a value of type "
                            f"{_qualname(kind)} (at {where}); add one to codegen/digest.py")


class _entered:
    """Marks a container as being written for the duration of a ``with``: a value that
    contains itself would otherwise recurse forever."""

    def __init__(self, value: object, where: str, active: set[int]) -> None:
        self.key, self.where, self.active = id(value), where, active

    def __enter__(self) -> None:
        if self.key in self.active:
            raise InternalError(f"digest: {self.where} contains itself")
        self.active.add(self.key)

    def __exit__(self, *exc: object) -> None:
        self.active.discard(self.key)
