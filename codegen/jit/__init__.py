"""Building and loading: C++ source -> a loaded torch op, through a cache shared by processes.

One module per concern, lowest first: ``process`` (compiler runs, their timeout, stopping
them on any exit; ``BuildError``), ``compiler`` (the toolchain: compiler, flags, CUDA
headers and libraries), ``cache`` (the cache root, its entries, keys, stamps and locks),
``precompiled`` (the runtime header precompiled once per cache, and pruned),
``extension`` (a source to a loaded library through ``torch.utils.cpp_extension`` and
ninja: ``build_library``), ``no_backward`` (a small C++ library of our own: torch's
autograd-not-implemented kernel) and ``op`` (a host program to a registered torch op:
``CompiledOp``, ``build``, ``compile``). Build messages go to the ``codegen.jit`` logger.
"""

from .cache import cache_root
from .compiler import Toolchain, cuda_home, toolchain, toolchain_problem
from .extension import build_library
from .op import CompiledOp, build, compile, prepare
from .process import BuildError

__all__ = ["BuildError", "CompiledOp", "Toolchain", "build", "build_library", "cache_root",
           "compile", "cuda_home", "prepare", "toolchain", "toolchain_problem"]
