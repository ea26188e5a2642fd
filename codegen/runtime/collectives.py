"""The Python half of the C++ runtime's collectives
(``codegen/backend/include/codegen/collective.h``).

A generated program posts each slice's all-gather or reduce-scatter through the
dispatcher op ``codegen::collective``, registered here over torch's functional
collectives, which take the process group by name. The stable ABI cannot call those
directly: their group argument has schema type ``Any`` in torch 2.14, which its
dispatcher bridge does not convert; ``str`` it does. With NCCL the collective runs on
NCCL's stream after the slice's stream's queued work, and the program's ``Wait`` is
``_c10d_functional::wait_tensor`` (the slice's stream waits, the host does not).
"""

from __future__ import annotations

import threading

import torch

_SCHEMA = ("collective(str kind, Tensor input, Tensor(a!) output, int group_size, "
           "str group_name) -> ()")
_library: torch.library.Library | None = None
_lock = threading.Lock()


def _collective(kind: str, input: torch.Tensor, output: torch.Tensor,  # noqa: A002
                group_size: int, group_name: str) -> None:
    functional = torch.ops._c10d_functional
    if kind == "all_gather":
        functional.all_gather_into_tensor_out(input.contiguous(), group_size, group_name,
                                              out=output)
    elif kind == "reduce_scatter":
        functional.reduce_scatter_tensor_out(input.contiguous(), "sum", group_size, group_name,
                                             out=output)
    else:
        raise ValueError(f"codegen::collective: unknown kind {kind!r}")


def register() -> None:
    """Defines ``codegen::collective`` once per process (before a program that posts
    collectives is first called)."""
    global _library
    with _lock:
        if _library is not None:
            return
        import torch.distributed  # noqa: F401 - registers the _c10d_functional ops

        library = torch.library.Library("codegen", "FRAGMENT")
        library.define(_SCHEMA)
        library.impl("collective", _collective, "CompositeExplicitAutograd")
        _library = library
