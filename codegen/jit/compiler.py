"""The toolchain: the compiler, its flags, and the CUDA headers and ``libcudart``.

The CUDA headers and ``libcudart`` come from ``toolchain()`` (a toolkit's, else those of
the wheels torch brings; found here, not in the user's shell), so cpp_extension needs
neither ``CUDA_HOME`` nor ``TORCH_CUDA_ARCH_LIST`` and nothing in ``os.environ`` is
changed (except ``PATH``, once, where ninja is only next to this Python:
``_ninja_on_path``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import sys
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from ..backend.renderer import (
    runtime_headers_digest,
)
from .process import BuildError

_path_lock = threading.Lock()  # guards the one change to PATH


# The stable ABI version the generated C++ targets (the GPU machine's 2.11). The runtime
# calls nothing newer than 2.10's stable API (it compiles with the target set to 2.10), so
# torch 2.10, the oldest codegen accepts (codegen/version.py), builds it too.
TORCH_TARGET_VERSION = "0x020b000000000000"
# -O1: host code calling libraries builds faster than at -O2 and runs as fast (README).
# Hidden visibility: programs export nothing (they register through static init), so
# two programs' copies of the runtime never bind to each other.
CFLAGS = ("-O1", "-DNDEBUG", "-fvisibility=hidden", "-DUSE_CUDA",
          f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}")



# The CUDA headers a program needs: those the runtime includes
# (codegen/backend/include/codegen/*.h), and two that those include and the wheels torch
# depends on lack: crt/host_defines.h
# (cuda_runtime_api.h's; in the nvidia-cuda-crt wheel, and in Triton's copy of the CUDA
# headers) and nv/target (cuda_fp16.h's, via cublas_api.h; in the nvidia-cuda-cccl wheel).
CUDA_HEADERS = ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target", "cublas_v2.h",
                "cublasLt.h", "nvtx3/nvToolsExt.h")


def cuda_home() -> str | None:
    """The CUDA toolkit, a folder with ``include/cuda_runtime_api.h``: the one
    ``$CUDA_HOME`` (else ``$CUDA_PATH``) names where set, as torch takes it (set to a
    folder without a toolkit, it means none); else /usr/local/cuda, else the folder above
    the real nvcc (a wrapper in /usr/local/bin misleads torch). None where there is none:
    builds then take the headers from the wheels (``_cuda_include_folders``)."""
    named = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [named] if named else ["/usr/local/cuda"]
    nvcc = None if named else shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for c in candidates:
        if (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return c
    return None


def _wheel_cuda_folders() -> list[Path]:
    """Include folders of the wheels torch brings that hold CUDA headers: the nvidia-*
    wheels (the runtime, cuBLAS, NVTX), then Triton's copy of the CUDA headers (which has
    crt/, which those lack)."""
    found: list[Path] = []
    for entry in dict.fromkeys(sys.path):
        site = Path(entry or ".")
        found += sorted(site.glob("nvidia/*/include"))
        found += [t for t in [site / "triton" / "backends" / "nvidia" / "include"]
                  if t.is_dir()]
    nvidia = [f for f in found if f.parent.parent.name == "nvidia"]
    return list(dict.fromkeys([*nvidia, *(f for f in found if f not in nvidia)]))


def _wheel_cudart() -> Path | None:
    """The CUDA runtime library of torch's nvidia-* wheels (``libcudart.so.<major>``)."""
    for entry in dict.fromkeys(sys.path):
        for lib in sorted(Path(entry or ".").glob("nvidia/*/lib/libcudart.so.*")):
            return lib
    return None


def _cuda_include_folders(home: str | None) -> tuple[list[Path], list[str]]:
    """The folders a build takes the CUDA headers from, in search order, and the headers of
    ``CUDA_HEADERS`` none of them has. A folder is taken where it has a header that no
    folder before it has: the toolkit first, then the wheels."""
    candidates = ([Path(home) / "include"] if home else []) + _wheel_cuda_folders()
    folders: list[Path] = []
    missing = list(CUDA_HEADERS)
    for folder in candidates:
        have = [h for h in missing if (folder / h).is_file()]
        if have:
            folders.append(folder)
            missing = [h for h in missing if h not in have]
    return folders, missing


def _cuda_lib(home: str | None) -> tuple[str, ...] | None:
    """The link flags of the CUDA runtime library: the toolkit's, else the wheel's."""
    if home:
        for d in ("lib64", "lib"):
            if (Path(home) / d / "libcudart.so").exists():
                return f"-L{Path(home) / d}", "-lcudart"
    lib = _wheel_cudart()  # where torch loads it from, as the loader is told too
    return (f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}") \
        if lib is not None else None


# The wheels of CUDA 13 that hold the headers torch's own CUDA wheels lack.
_HEADER_WHEELS = {"crt/host_defines.h": "nvidia-cuda-crt", "nv/target": "nvidia-cuda-cccl"}


def _wheel_hint(missing: Sequence[str]) -> str:
    """How to get ``missing`` headers from the package index instead of a toolkit, where
    torch's CUDA is 13 and they are among those that only miss from its wheels."""
    major = (torch.version.cuda or "0").split(".")[0]
    if not missing or major != "13" or any(h not in _HEADER_WHEELS for h in missing):
        return ""
    wheels = " ".join(f"'{_HEADER_WHEELS[h]}=={major}.*'" for h in missing)
    return f", or pip install {wheels}"


def _where_cuda_was_looked_for(home: str | None) -> str:
    named = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    toolkit = (f"the toolkit at {home}" if home else
               f"no toolkit (CUDA_HOME={named} has none)" if named else
               "no toolkit (none at /usr/local/cuda or next to nvcc)")
    wheels = ", ".join(str(f) for f in _wheel_cuda_folders()
                       if any((f / h).exists() for h in CUDA_HEADERS)) \
        or "no wheel with CUDA headers on sys.path"
    return f"{toolkit}; {wheels}"


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The compiler and every flag a program is built with: the same for the runtime's
    precompiled header and for each program, which is what lets GCC use the former.
    cpp_extension adds its own (``-DTORCH_EXTENSION_NAME``, ``-shared``, ``-ltorch_python``
    ...) before these, so ours win where they differ (``-std=c++20``)."""

    cxx: tuple[str, ...]  # the compiler command ($CXX, one word: what cpp_extension runs)
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    def tag(self) -> str:
        """What a build's cache key must include besides the source (not the linker,
        which does not change the library's meaning)."""
        return f"{self.cxx}|{self.cflags}|{tuple(f for f in self.ldflags if f != GOLD)}"


GOLD = "-fuse-ld=gold"
_gold_failed = threading.Event()  # gold could not link here and the default linker could


def toolchain() -> Toolchain:
    """The toolchain of this machine (gold unless it failed here)."""
    return _toolchain(not _gold_failed.is_set())


@functools.cache
def _toolchain(gold: bool) -> Toolchain:
    """Flags for a host-only translation unit against torch's stable ABI, on this machine
    (no GPU needed: only the CUDA runtime's, cuBLAS's and NVTX's headers, from a CUDA
    toolkit or from the wheels torch brings). A BuildError saying what is missing where a
    build cannot run here."""
    cxx = tuple(shlex.split(os.environ.get("CXX") or "c++"))
    home = cuda_home()
    folders, missing = _cuda_include_folders(home)
    cuda_lib = _cuda_lib(home)
    problems = []
    if not cxx or shutil.which(cxx[0]) is None:
        problems.append(f"no C++ compiler: {cxx[0] if cxx else '$CXX'!r} is not on PATH "
                        "(install g++, or set CXX to a C++20 compiler)")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is built without CUDA (the programs "
                        "link libtorch_cuda); install a CUDA build of torch")
    elif missing or cuda_lib is None:
        what = [*missing, *(["libcudart.so"] if cuda_lib is None else [])]
        problems.append(f"no {', '.join(what)} (looked in: {_where_cuda_was_looked_for(home)}"
                        f"); install the CUDA toolkit {torch.version.cuda} and set CUDA_HOME "
                        f"to it{_wheel_hint(missing)}")
    if problems:
        raise BuildError(f"codegen: cannot build C++ here: {'; '.join(problems)}")
    assert cuda_lib is not None
    torch_dir = Path(torch.__file__).resolve().parent
    cflags = (
        "-std=c++20", "-fPIC", *CFLAGS, f"-DCODEGEN_RT_ABI=r{runtime_headers_digest()[:16]}",
        f"-isystem{torch_dir / 'include'}", f"-isystem{folders[0]}",
        # After the first folder (the toolkit's, where there is one): the wheels each
        # carry a partial CUDA runtime, of another version than the toolkit's.
        *(f"-idirafter{d}" for d in folders[1:]),
    )
    # gold links against libtorch's large symbol tables in half the time of GNU ld.
    linker = (GOLD,) if gold and shutil.which("ld.gold") else ()
    ldflags = ("-shared", *linker, f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
               "-ltorch_cuda", "-ltorch", *cuda_lib, f"-Wl,-rpath,{torch_dir / 'lib'}")
    return Toolchain(cxx, cflags, ldflags)


def toolchain_problem() -> str | None:
    """What keeps builds from running on this machine (no C++ compiler, a torch without
    CUDA, CUDA headers found nowhere, no ninja), as the BuildError a build would raise
    says it; None where builds can run. The one check the tests skip builds by and the
    demo falls back to the evaluator by."""
    try:
        toolchain()
        _ninja_on_path()
    except BuildError as e:
        return str(e)
    return None


def _full_torch(tools: Toolchain) -> Toolchain:
    """``tools`` for a translation unit that includes libtorch's own (unstable) C++
    headers: no TORCH_TARGET_VERSION, which those headers refuse, and the C++ API's
    include folder. Such a library is tied to this torch build (the cache key has its
    version); codegen builds one (``_no_backward``), never a program."""
    torch_dir = Path(torch.__file__).resolve().parent
    cflags = tuple(f for f in tools.cflags if not f.startswith("-DTORCH_TARGET_VERSION="))
    api = f"-isystem{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"
    return dataclasses.replace(tools, cflags=(*cflags, api))


def _tools(full_torch: bool, gold: bool | None = None) -> Toolchain:
    tools = toolchain() if gold is None else _toolchain(gold)
    return _full_torch(tools) if full_torch else tools


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH. Where PATH has none but this Python's
    environment does (the ninja wheel, a dependency of codegen, in a virtual environment
    that is not activated), that folder is appended to PATH, once; else a BuildError."""
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    with _path_lock:
        if scripts and shutil.which("ninja", path=scripts):
            os.environ["PATH"] = os.pathsep.join(
                p for p in (os.environ.get("PATH"), scripts) if p)
            return
    raise BuildError("codegen: ninja not found on PATH (torch.utils.cpp_extension builds "
                     "with it); `pip install ninja` and put its folder on PATH")
