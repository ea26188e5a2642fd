"""codegen's version and the torch it needs, in one place: setup.py reads this file
without importing codegen (which imports torch), and ``import codegen`` checks the torch
it finds against it."""

from __future__ import annotations

import re

__version__ = "0.1.0"
# The generated C++ compiles against torch's stable ABI, whose C shims (streams, the
# cuBLAS handle, the dispatcher) the runtime headers call first appeared in torch 2.10.
TORCH_REQUIRED = "2.10"


def torch_problem(found: str, where: str) -> str | None:
    """Why the torch of version ``found`` (installed at ``where``) cannot run codegen, or
    None when it can. Pre-releases and local builds of the required minor version count
    as that version ("2.10.0a0+git..." is 2.10)."""
    need = tuple(int(p) for p in TORCH_REQUIRED.split("."))
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is not None and (int(match[1]), int(match[2])) >= need:
        return None
    return (f"codegen needs torch >= {TORCH_REQUIRED} (the C++ it generates uses the "
            f"stable ABI of torch {TORCH_REQUIRED}), but found torch {found} at {where}. "
            f"Fix: pip install 'torch>={TORCH_REQUIRED}'")


def check_torch(found: str, where: str) -> None:
    """Raises ImportError, saying what was found and what is needed, where the torch of
    version ``found`` at ``where`` is older than ``TORCH_REQUIRED``."""
    problem = torch_problem(found, where)
    if problem is not None:
        raise ImportError(problem)
