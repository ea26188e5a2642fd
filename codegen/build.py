"""C++ source -> a loaded torch op, through a cache shared by processes.

The cache (``CODEGEN_CACHE_DIR``, default ``~/.cache/codegen``) has one folder per
(op name, hash of source + flags + torch + Python; for a rendered program the op name
already hashes everything its source is made from, so a cached op loads without
rendering). A folder whose ``ok`` stamp matches
its library is loaded directly (``torch.ops.load_library``, no compiler, no ninja);
otherwise it is built with ``torch.utils.cpp_extension`` and ninja under an exclusive
``flock`` (released by the OS if the builder dies, so a killed build leaves nothing
that blocks the next). ``CODEGEN_REBUILD=1`` forces a build.

On a machine without a GPU this still builds: the toolkit's location, the arch list and
the cuBLAS headers of the torch wheel are found here, not in the user's shell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import hostir as hir
from .evaluator import check_inputs
from .render import NAMESPACE, include_dir, op_name, program_digest, render

# The oldest torch whose stable ABI the generated C++ targets (the GPU machine's 2.11):
# one source builds and loads on 2.11 and newer.
TORCH_TARGET_VERSION = "0x020b000000000000"
# -O1: host code calling libraries builds faster than at -O2 and runs as fast (README).
# Hidden visibility: programs export nothing (they register through static init), so
# two programs' copies of the runtime never bind to each other.
CFLAGS = ("-O1", "-DNDEBUG", "-fvisibility=hidden", "-DUSE_CUDA",
          f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}")
_loaded: dict[str, tuple[str, Path]] = {}  # op name -> (digest, library) in this process
_lock = threading.Lock()


class BuildError(RuntimeError):
    """The generated C++ did not compile or load; says where the full log is."""


def cache_root() -> Path:
    root = os.environ.get("CODEGEN_CACHE_DIR") or str(Path.home() / ".cache" / "codegen")
    return Path(root).expanduser()


# ---------------------------------------------------------------------------- toolchain


def _cuda_home() -> str | None:
    """A CUDA toolkit with headers: $CUDA_HOME if it has them, else /usr/local/cuda, else
    the folder above the real nvcc (a wrapper in /usr/local/bin misleads torch)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    from shutil import which
    nvcc = which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return c
    return None


def _wheel_cuda_includes() -> list[str]:
    """Include folders of the nvidia-* wheels that hold cublas_v2.h (torch's deps)."""
    found = []
    for entry in sys.path:
        nv = Path(entry) / "nvidia"
        if nv.is_dir():
            found += [str(h.parent) for h in sorted(nv.glob("*/include/cublas_v2.h"))]
    return found


@contextlib.contextmanager
def _toolchain() -> Iterator[list[str]]:
    """Sets what cpp_extension needs for this build only; yields extra C++ flags."""
    home = _cuda_home()
    if home is None:
        raise BuildError("codegen: no CUDA toolkit with headers found (looked at $CUDA_HOME, "
                         "/usr/local/cuda and next to nvcc); set CUDA_HOME")
    if "torch.utils.cpp_extension" not in sys.modules:
        # CUDA_HOME is read once, at import; without a GPU the import also warns that no
        # CUDA runtime was found, which is expected here: only host code is compiled.
        saved_env = os.environ.get("CUDA_HOME")
        os.environ["CUDA_HOME"] = saved_env or home
        log = logging.getLogger("torch.utils.cpp_extension")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            importlib.import_module("torch.utils.cpp_extension")
        finally:
            log.setLevel(level)
            if saved_env is None:
                del os.environ["CUDA_HOME"]
    cpp = importlib.import_module("torch.utils.cpp_extension")

    saved_home, saved_arch = cpp.CUDA_HOME, os.environ.get("TORCH_CUDA_ARCH_LIST")
    cpp.CUDA_HOME = home
    if saved_arch is None and not torch.cuda.is_available():
        # Only .cpp is compiled, but cpp_extension asks for an arch list without a GPU.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        # After the toolkit's own include folder: the wheels also carry a partial runtime.
        yield [f"-I{include_dir()}", *(f"-idirafter{d}" for d in _wheel_cuda_includes())]
    finally:
        cpp.CUDA_HOME = saved_home
        if saved_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


# ---------------------------------------------------------------------------- cache


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _key(source: str) -> str:
    """The full cache key of a source text (or of the digest of what determines it):
    also the torch, CUDA and Python versions, the compiler and every flag."""
    compiler = os.environ.get("CXX", "c++")
    flags = [*CFLAGS, f"-I{include_dir()}", *_wheel_cuda_includes()]
    tag = f"{torch.__version__}|{torch.version.cuda}|{sys.version_info[:2]}|{compiler}|{flags}"
    return _digest(f"{tag}\n{source}".encode())


@dataclasses.dataclass
class _Entry:
    folder: Path
    name: str

    @property
    def source(self) -> Path:
        return self.folder / f"{self.name}.cpp"

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"

    @property
    def stamp(self) -> Path:
        return self.folder / "ok"

    def valid(self, key: str) -> bool:
        """Built completely from what ``key`` names: the stamp holds the full key and the
        library's current hash (a folder reached by a collision of the folder name, or
        holding a half-written library, is not valid)."""
        try:
            return self.stamp.read_text().split() == [key, _digest(self.library.read_bytes())]
        except OSError:
            return False


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    with open(folder / "codegen.lock", "w") as f:  # cpp_extension uses "lock"
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _first_error(log: str) -> str:
    """The compiler's first diagnostic (``file:line:col: error: ...``), else a line
    that says error, else the last line."""
    lines = log.splitlines()
    for pattern in (r":\d+:\d+: (fatal )?error:", r"\berror\b"):
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE) and "Error building extension" not in line:
                return line.strip()
    return lines[-1].strip() if lines else "(no compiler output)"


def _forget_versions(name: str) -> None:
    """cpp_extension numbers a second build of one name in a process ``<name>_v1`` (and
    then looks for ``<name>.so``, which a failed first build never wrote); every build
    here is of a new source in its own folder, so its version history is dropped."""
    cpp = sys.modules.get("torch.utils.cpp_extension")
    versioner = getattr(cpp, "JIT_EXTENSION_VERSIONER", None)
    entries = getattr(versioner, "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


def _compile(entry: _Entry, source: str, key: str) -> float:
    """Builds ``entry`` from ``source``; returns seconds. Caller holds the lock."""
    # A builder killed mid-way (SIGKILL, power loss) leaves no stamp, maybe a partial
    # library, and maybe cpp_extension's own "lock" file (older torches do not clean it
    # up, and would wait on it forever). We hold the entry's flock, so nobody else is
    # building here: all of it is stale.
    for stale in (entry.stamp, entry.library, entry.folder / "lock"):
        stale.unlink(missing_ok=True)
    entry.source.write_text(source)
    start = time.perf_counter()
    with _toolchain() as extra:
        from torch.utils.cpp_extension import load  # after _toolchain fixed CUDA_HOME

        _forget_versions(entry.name)
        try:
            load(name=entry.name, sources=[str(entry.source)], build_directory=str(entry.folder),
                 extra_cflags=[*CFLAGS, *extra], with_cuda=True, is_python_module=False,
                 verbose=False)
        except Exception as e:  # cpp_extension raises RuntimeError with the ninja log
            log_path = entry.folder / "build.log"
            log_path.write_text(str(e))
            raise BuildError(f"codegen: building {entry.name} failed: {_first_error(str(e))}\n"
                             f"full log: {log_path}") from None
    entry.stamp.write_text(f"{key} {_digest(entry.library.read_bytes())}\n")
    return time.perf_counter() - start


def build_library(name: str, source: str | Callable[[], str], key: str | None = None) -> Path:
    """The path of a loaded library for ``source``: from the cache, or built now.
    ``source`` may be a function, called only to build; then ``key`` must name
    everything the source depends on."""
    if key is None:
        if callable(source):
            raise TypeError("build_library: a lazy source needs a key")
        key = source
    full_key = _key(key)
    with _lock:
        if name in _loaded:
            loaded_key, library = _loaded[name]
            if loaded_key != full_key:
                raise BuildError(
                    f"codegen: op name {name} is already loaded in this process for another "
                    "program (a hash-prefix collision, or a source changed under one name); "
                    "rename the Fusion, or start a new process")
            return library
        root = cache_root()
        entry = _Entry(root / f"{name}-{full_key[:16]}", name)
        try:
            entry.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BuildError(f"codegen: cannot create the build cache {entry.folder} ({e}); "
                             "set CODEGEN_CACHE_DIR to a writable folder") from None
        if not os.access(entry.folder, os.W_OK):
            raise BuildError(f"codegen: the build cache {entry.folder} is not writable; "
                             "set CODEGEN_CACHE_DIR to a writable folder")
        rebuild = os.environ.get("CODEGEN_REBUILD", "") not in ("", "0")
        with _exclusive(entry.folder):
            if rebuild or not entry.valid(full_key):
                seconds = _compile(entry, source() if callable(source) else source, full_key)
                print(f"codegen: built {name} in {seconds:.1f} s ({entry.folder})",
                      file=sys.stderr, flush=True)
            # Loaded under the lock: a concurrent CODEGEN_REBUILD cannot swap the library
            # between the stamp check and dlopen.
            torch.ops.load_library(str(entry.library))
        _loaded[name] = (full_key, entry.library)
        return entry.library


# ---------------------------------------------------------------------------- the op


def _register_python_parts(program: hir.HostProgram, qualname: str) -> None:
    """What the C++ does not register: a fake implementation (output shapes for
    FakeTensor, meta tensors and torch.compile, after the same input checks as the
    evaluator) and an autograd formula that says there is no backward yet. The latter
    lets inputs that require grad (say, an nn.Parameter under inference) run forward,
    whoever calls the op, and makes backward fail with a message instead of torch's
    generic one."""
    outputs = [program.allocations()[o] for o in program.outputs]

    def fake(*inputs: torch.Tensor) -> Any:
        env = check_inputs(program, inputs)
        outs = [inputs[0].new_empty([e.evaluate(env) for e in o.shape], dtype=o.dtype)
                for o in outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError(
            f"{program.name}: codegen ops have no backward yet; compute the op under "
            "torch.no_grad(), or with .detach()ed inputs, where gradients are not needed")

    torch.library.register_fake(qualname)(fake)
    torch.library.register_autograd(qualname, backward)


class CompiledOp:
    """A host program compiled to a torch op: ``op(*inputs)`` runs it.

    ``.name`` is the qualified op name (``codegen::<program>_<hash>``), ``.op`` the
    ``torch.ops`` packet, ``.source`` the C++, ``.host_ir`` the HostProgram.
    """

    def __init__(self, program: hir.HostProgram, op_name: str, library: Path,
                 source: str | None = None) -> None:
        self.host_ir = program
        self.op_name = op_name
        self.library = library
        self._source = source
        self.name = f"{NAMESPACE}::{op_name}"
        self.op = getattr(getattr(torch.ops, NAMESPACE), op_name)

    @property
    def source(self) -> str:
        """The C++ (rendered on first access when the op came from the cache)."""
        if self._source is None:
            self._source = render(self.host_ir)
        return self._source

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.op(*inputs)

    def __repr__(self) -> str:
        return f"CompiledOp({self.name}, library={self.library})"


_registered: set[str] = set()  # ops whose Python parts are registered in this process


def build(program: hir.HostProgram, source: str | None = None) -> CompiledOp:
    """Builds (or loads from cache) the op of ``program``; ``source`` defaults to
    ``render(program)``."""
    name = op_name(program)
    if source is None:  # the digest covers the program, the templates and the renderer
        library = build_library(name, lambda: render(program),
                                key=f"rendered:{program_digest(program)}")
    else:
        library = build_library(name, source)
    compiled = CompiledOp(program, name, library, source)
    with _lock:
        if compiled.name not in _registered:
            _register_python_parts(program, compiled.name)
            _registered.add(compiled.name)
    return compiled


def compile(fusion: Any, *, pool_size: int = 4,  # noqa: A001 - public API
            gemm_sm_count: int = 0) -> CompiledOp:
    """Lower, render, build and load ``fusion`` as a torch op. ``gemm_sm_count`` caps the
    SMs of each GEMM (cuBLASLt's SM_COUNT_TARGET; 0 = all)."""
    from .lowering import lower

    return build(lower(fusion, pool_size=pool_size, gemm_sm_count=gemm_sm_count))
