"""C++ source -> a loaded torch op, through a cache shared by processes.

The cache (``CODEGEN_CACHE_DIR``, default ``~/.cache/codegen``) has one folder per
(op name, full hash of what the source is made from + torch + compiler + flags; for a
rendered program that hash is known without rendering, so a cached op loads without
Jinja). A folder whose ``ok`` stamp names that hash and its library's hash is loaded
directly (``torch.ops.load_library``, no compiler); otherwise it is built under an
exclusive ``flock`` (released by the OS if the builder dies, so a killed build leaves
nothing that blocks the next) and loaded under the same lock. In one process, a lock per
op name keeps two threads off one entry; different ops build at the same time.
``CODEGEN_REBUILD=1`` forces a build.

The cache root and the folder of each entry and precompiled runtime are created private
(mode 0700); one that is not owned by this user, or that group or others can write, is
refused (``_private``): a library there could have been swapped by someone else.

A program is one translation unit against torch's stable ABI (no ATen headers), built by
``torch.utils.cpp_extension.load`` and ninja in the entry's folder (``build.ninja``,
``<name>.o``, ``<name>.so``) with the flags of ``toolchain()`` as ``extra_cflags`` /
``extra_ldflags``; ``load`` also loads the library. The runtime headers a program starts
with are precompiled once per cache (``_precompiled_runtime``, one direct compiler run:
cpp_extension builds libraries, not headers); the folder of that ``.gch`` goes first on
the include path and GCC uses it, ``-DTORCH_EXTENSION_NAME`` notwithstanding. The build
is ``with_cuda=False``: the file has no CUDA code, and the CUDA headers and ``libcudart``
come from ``toolchain()`` (a toolkit's, else those of the wheels torch brings; found
here, not in the user's shell), so
cpp_extension needs neither ``CUDA_HOME`` nor ``TORCH_CUDA_ARCH_LIST`` and nothing in
``os.environ`` is changed (except ``PATH``, once, where ninja is only next to this
Python: ``_ninja_on_path``). Each compiler run is stopped after ``CODEGEN_BUILD_TIMEOUT_S``
(default 600) seconds with a ``BuildError``, and when the build is interrupted
(KeyboardInterrupt, any exception): SIGKILL to the compiler's process groups, then a wait
until they have exited, since they write into a folder whose lock is about to be released;
a process that outlives that wait is a ``BuildError`` that names it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .. import distributed
from .. import hostir as hir
from ..backend.renderer import (
    NAMESPACE,
    include_dir,
    op_name,
    program_digest,
    render,
    runtime_headers_digest,
)
from ..errors import NoGPUError
from ..frontend.ir import Fusion
from ..interp.evaluator import check_inputs, program_device
from ..runtime import autograd, collectives
from ..runtime.dispatch import dispatch

# The stable ABI version the generated C++ targets (the GPU machine's 2.11). The runtime
# calls nothing newer than 2.10's stable API (it compiles with the target set to 2.10), so
# torch 2.10, the oldest codegen accepts (codegen/version.py), builds it too.
TORCH_TARGET_VERSION = "0x020b000000000000"
# -O1: host code calling libraries builds faster than at -O2 and runs as fast (README).
# Hidden visibility: programs export nothing (they register through static init), so
# two programs' copies of the runtime never bind to each other.
CFLAGS = ("-O1", "-DNDEBUG", "-fvisibility=hidden", "-DUSE_CUDA",
          f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}")
# How a library is built; part of every cache key (a change of path rebuilds).
BUILD_PATH = "torch.utils.cpp_extension.load+ninja"
# Seconds one compiler run may take (CODEGEN_BUILD_TIMEOUT_S overrides).
BUILD_TIMEOUT_S = 600.0
# Seconds after which a build still running logs that it is (once).
PROGRESS_AFTER_S = 5.0
# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger(__name__)
_loaded: dict[str, tuple[str, Path]] = {}  # op name -> (digest, library) in this process
_lock = threading.Lock()  # guards _loaded, _name_locks, _registered; held for no compile
_name_locks: dict[str, threading.Lock] = {}  # op name -> held while it is built or loaded


class BuildError(RuntimeError):
    """The generated C++ did not compile or load; says where the full log is."""


class _BuildTimeout(BuildError):
    """A compiler run took longer than ``build_timeout()`` and was stopped."""


class _LinkError(BuildError):
    """The source compiled and the link failed."""


def cache_root() -> Path:
    """The build cache: ``CODEGEN_CACHE_DIR`` (default ``~/.cache/codegen``), made
    absolute against the current folder: ninja runs in each entry's folder, where a
    relative path to the precompiled runtime would name nothing (and GCC would silently
    read the headers instead)."""
    root = os.environ.get("CODEGEN_CACHE_DIR") or str(Path.home() / ".cache" / "codegen")
    return Path(os.path.abspath(Path(root).expanduser()))


def build_timeout() -> float:
    """Seconds one compiler run may take: ``CODEGEN_BUILD_TIMEOUT_S``, default 600."""
    text = os.environ.get("CODEGEN_BUILD_TIMEOUT_S", "").strip()
    if not text:
        return BUILD_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise BuildError(f"codegen: CODEGEN_BUILD_TIMEOUT_S must be a number of seconds > 0, "
                         f"got {text!r}")
    return seconds


def _private(folder: Path, parents: bool = False) -> None:
    """Creates ``folder`` private (mode 0700) where it is missing, and refuses it, the way
    ssh refuses a key file, where it is not owned by this user or group or others can
    write it: whoever can write there can replace a library this process would load."""
    folder.mkdir(mode=0o700, parents=parents, exist_ok=True)
    st = folder.stat()
    uid = os.geteuid()
    if st.st_uid != uid:
        wrong = f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
        fix = "set CODEGEN_CACHE_DIR to a folder of your own"
    elif st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        wrong = f"it is writable by {who} (mode {st.st_mode & 0o7777:04o})"
        fix = f"chmod 700 {folder}, or set CODEGEN_CACHE_DIR to a folder of your own"
    else:
        return
    raise BuildError(f"codegen: refusing to use the build cache folder {folder}: {wrong}, so "
                     f"a library there may not be the one codegen built. Fix: {fix}")


# ---------------------------------------------------------------------------- toolchain


# The CUDA headers a program needs: those the runtime includes (codegen/include/codegen/*.h),
# and two that those include and the wheels torch depends on lack: crt/host_defines.h
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


def _timed_out(what: str, seconds: float, log_path: Path) -> _BuildTimeout:
    return _BuildTimeout(
        f"codegen: building {what} timed out after {seconds:g} s and the compiler was "
        f"stopped; if the build is just slow here, raise the limit with "
        f"CODEGEN_BUILD_TIMEOUT_S=<seconds> (default {BUILD_TIMEOUT_S:g})\nfull log: {log_path}")


def _run(command: list[str], log_path: Path, what: str) -> None:
    """Runs a compiler command; a failure is a BuildError with its first diagnostic, and
    one that runs past ``build_timeout()`` is stopped (its whole process group). So is
    one whose caller is interrupted or fails while it runs (any ``BaseException``)."""
    timeout = build_timeout()
    proc: subprocess.Popen[str] | None = None

    def kill() -> tuple[set[int], set[int]]:
        return _kill_group(proc.pid) if proc is not None else (set(), set())

    stop = _Stop(f"building {what}", log_path.parent, kill)
    try:
        # A session of its own: one killpg stops the compiler and what it started (cc1plus,
        # as) and nothing of ours. Nothing else stops it either (neither a kill of our
        # process group nor a terminal's Ctrl-C reaches it): every way out of here does.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        with _Watchdog(timeout, stop, what) as watchdog:
            while True:
                try:
                    output, _ = proc.communicate(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    # Its output ends when every process holding the pipe has exited; one
                    # that a kill does not end would keep this waiting without a word.
                    if watchdog.fired:
                        stop.finish()
    except _StillRunning:
        raise  # nothing more to try
    except BaseException:
        if proc is not None:
            stop.finish()
            proc.wait()  # reaps it
            if proc.stdout is not None:
                proc.stdout.close()
        raise
    if watchdog.fired and proc.returncode != 0:
        stop.finish()
        log_path.write_text(f"$ {shlex.join(command)}\n{output}\n(stopped after {timeout:g} s)\n")
        raise _timed_out(what, timeout, log_path)
    if proc.returncode != 0:
        log = f"$ {shlex.join(command)}\n{output}"
        log_path.write_text(log)
        raise BuildError(f"codegen: building {what} failed: {_first_error(log)}\n"
                         f"full log: {log_path}")


# The runtime's umbrella header: the first include of every program, precompiled once.
RUNTIME_HEADER = "codegen/runtime.h"
PCH_PREFIX = "runtime-pch-"
# A precompiled runtime (~115 MB) that no build has used for this long is removed by the
# next build (an upgrade of codegen or torch leaves the old one behind).
PCH_UNUSED_S = 24 * 3600


@contextlib.contextmanager
def _precompiled_runtime(tools: Toolchain) -> Iterator[Path | None]:
    """A folder holding a copy of the runtime headers and ``runtime.h.gch``, built once per
    toolchain and header text (the first program in a fresh cache pays ~6 s), under an
    exclusive lock and stamped like an op, so a killed build is rebuilt by the next
    process. Put before the package's include folder, GCC takes the .gch when its flags
    match and silently reads the headers otherwise; None when it cannot be built (then
    programs build without it, just slower; but a compiler that times out is an error:
    it would hang on the program too). The flags name the headers' hash
    (CODEGEN_RT_ABI); the .gch is renamed into place whole, so the stamp checks its size
    rather than hashing 115 MB on every build.

    While the caller compiles, a shared lock on the folder's ``users.lock`` keeps
    ``_prune_precompiled`` away from it; the stamp's mtime records the last use."""
    headers = sorted(include_dir().rglob("*.h"))
    key = _digest(f"{tools.tag()}|{torch.__version__}".encode())
    folder = cache_root() / f"{PCH_PREFIX}{key[:16]}"
    pch = folder / f"{RUNTIME_HEADER}.gch"
    stamp = folder / "ok"
    with contextlib.ExitStack() as users:
        try:
            _share(folder, users)
            with _exclusive(folder):
                if not (stamp.is_file() and pch.is_file()
                        and stamp.read_text().split() == [key, str(pch.stat().st_size)]):
                    stamp.unlink(missing_ok=True)
                    for h in headers:
                        target = folder / h.relative_to(include_dir())
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(h.read_bytes())
                    # Each builder writes a .gch of its own, renamed into place once its
                    # compiler exited: a compiler whose builder was killed outright (its
                    # session is its own, so nothing stops it) may go on writing after the
                    # lock was released, and must not write into the next builder's file.
                    # Those that killed builders left are removed: one still being
                    # written, once unlinked, becomes no one's .gch.
                    for stale in pch.parent.glob(f"{pch.name}.partial*"):
                        stale.unlink(missing_ok=True)
                    partial = pch.with_name(
                        f"{pch.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
                    try:
                        _run([*tools.cxx, *tools.cflags, f"-I{folder}", "-x", "c++-header",
                              str(folder / RUNTIME_HEADER), "-o", str(partial)],
                             folder / "build.log", "the runtime's precompiled header")
                        partial.replace(pch)
                    finally:
                        partial.unlink(missing_ok=True)
                    stamp.write_text(f"{key} {pch.stat().st_size}\n")
                os.utime(stamp)
        except (_BuildTimeout, _StillRunning):
            raise  # a hung compiler would hang on the program too; a live one writes here
        except (BuildError, OSError) as e:
            log.warning("building without a precompiled runtime (%s)", e)
            users.close()
            folder = None
        yield folder


def _share(folder: Path, stack: contextlib.ExitStack) -> None:
    """Holds a shared lock on ``folder/users.lock`` until ``stack`` closes, creating the
    folder (private); retried if a pruner removed the folder while we waited for the lock."""
    for _ in range(3):
        _private(folder)
        lock = folder / "users.lock"
        f = stack.enter_context(open(lock, "a"))
        fcntl.flock(f, fcntl.LOCK_SH)
        with contextlib.suppress(OSError):
            if os.fstat(f.fileno()).st_ino == lock.stat().st_ino:
                return
        f.close()
    raise OSError(f"{folder} keeps being removed while we wait for it")


def _prune_precompiled(keep: Path | None) -> list[Path]:
    """Removes the other precompiled runtimes of the cache that no build has used for
    ``PCH_UNUSED_S`` and that nobody compiles against now (their ``users.lock`` can be
    locked exclusively at once); returns them."""
    removed = []
    for folder in cache_root().glob(f"{PCH_PREFIX}*"):
        if folder == keep or not folder.is_dir():
            continue
        used = folder / "ok" if (folder / "ok").exists() else folder
        with contextlib.suppress(OSError):
            if time.time() - used.stat().st_mtime < PCH_UNUSED_S:
                continue
            with open(folder / "users.lock", "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                with _exclusive(folder):  # not being built either
                    shutil.rmtree(folder)
                    removed.append(folder)
    return removed


# ---------------------------------------------------------------------------- cache


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _key(source: str) -> str:
    """The full cache key of a source text (or of the digest of what determines it):
    also the torch and CUDA versions, the compiler, every flag and the build path."""
    tag = (f"{torch.__version__}|{torch.version.cuda}|{toolchain().tag()}|{include_dir()}|"
           f"{BUILD_PATH}")
    return _digest(f"{tag}\n{source}".encode())


@dataclasses.dataclass
class _Entry:
    folder: Path
    name: str

    @property
    def source(self) -> Path:
        return self.folder / f"{self.name}.cpp"

    @property
    def object(self) -> Path:
        return self.folder / f"{self.name}.o"  # cpp_extension's name for it

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"  # cpp_extension's name for it

    @property
    def stamp(self) -> Path:
        return self.folder / "ok"

    @property
    def log(self) -> Path:
        return self.folder / "build.log"

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
    with open(folder / "codegen.lock", "w") as f:  # cpp_extension's own is "lock"
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_flags(flags: Sequence[str]) -> list[str]:
    """``flags`` as they must be written into build.ninja: cpp_extension joins them with
    spaces into a ninja variable, and ninja hands the command to ``/bin/sh``; so each is
    quoted for the shell (a path with a space stays one argument) and its ``$`` doubled
    for ninja. Flags without such characters are unchanged."""
    return [shlex.quote(f).replace("$", "$$") for f in flags]


def _failed_target(log: str) -> str | None:
    """The target of ninja's first failed step (``FAILED: [code=1] name.o``), or None."""
    match = re.search(r"^FAILED: (?:\[code=\d+\] )?(\S+)", log, re.MULTILINE)
    return match[1] if match else None


# Lines of a ninja log that are not diagnostics: its progress lines and echoed commands.
_NOT_DIAGNOSTIC = re.compile(
    r"^\[\d+/\d+\] |^FAILED: |^ninja: build stopped|Error building extension| -o \S")


def _first_error(log: str) -> str:
    """The compiler's first diagnostic (``file:line:col: error: ...``), else the linker's
    (``ld: cannot find ...``, not collect2's summary), else a tool's (``c++: error: ...``),
    else a line that says error, else the last line."""
    lines = [line for line in log.splitlines() if not _NOT_DIAGNOSTIC.search(line)]
    for pattern in (r":\d+:\d+: (fatal )?error:", r"^\S*\bld(\.gold)?: ",
                    r"^\S+: (fatal )?error:", r"\berror\b"):
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE):
                return line.strip()
    return lines[-1].strip() if lines else "(no compiler output)"


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


# ---------------------------------------------------------------------------- cpp_extension


@functools.cache
def _cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported on the first build (0.1 s; a cached op
    loads without it). Its import warns that it found no CUDA runtime and names a
    CUDA_HOME; codegen builds with_cuda=False and uses neither, so that warning is
    silenced."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH. Where PATH has none but this Python's
    environment does (the ninja wheel, a dependency of codegen, in a virtual environment
    that is not activated), that folder is appended to PATH, once; else a BuildError."""
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    with _lock:
        if scripts and shutil.which("ninja", path=scripts):
            os.environ["PATH"] = os.pathsep.join(
                p for p in (os.environ.get("PATH"), scripts) if p)
            return
    raise BuildError("codegen: ninja not found on PATH (torch.utils.cpp_extension builds "
                     "with it); `pip install ninja` and put its folder on PATH")


# ---------------------------------------------------------------------------- stopping compilers


@dataclasses.dataclass(frozen=True)
class _Process:
    pid: int
    state: str  # /proc's letter: R, S, D, Z ...
    ppid: int
    pgrp: int
    session: int
    started: int  # clock ticks after boot


def _processes() -> list[_Process]:
    """Every process, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            found.append(_Process(int(stat.parent.name), fields[0], int(fields[1]),
                                  int(fields[2]), int(fields[3]), int(fields[19])))
    return found


def _ticks_since_boot() -> int:
    """Now, in the unit and from the origin of ``_Process.started``."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


# Seconds a SIGKILLed compiler has to exit. A killed process on a busy machine may wait a
# while to be scheduled; one stuck in the kernel (a hung file system) may never exit.
EXIT_WAIT_S = 60.0


class _StillRunning(BuildError):
    """A compiler was killed (SIGKILL) and had not exited when the wait for it ended: it
    may still write into the cache, so the build is not done."""


def _wait_until_exited(pids: set[int], groups: set[int], what: str, folder: Path,
                       seconds: float | None = None) -> None:
    """Waits until every process of ``pids`` and of the process groups ``groups`` has
    exited (gone, or a zombie until its parent reaps it): a SIGKILL is only delivered, and
    the process still has to run its exit. A ``_StillRunning`` names those left after
    ``seconds`` (default ``EXIT_WAIT_S``)."""
    seconds = EXIT_WAIT_S if seconds is None else seconds
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in _processes()
                if (p.pid in pids or p.pgrp in groups) and p.state not in "ZX"]
        if not left:
            return
        if time.monotonic() >= deadline:
            running = ", ".join(f"pid {p.pid} (state {p.state}, process group {p.pgrp})"
                                for p in left)
            raise _StillRunning(
                f"codegen: {what}: the compiler was killed (SIGKILL) and should have exited; "
                f"{seconds:g} s later these of its processes were still running: {running}. "
                f"They may still write into {folder}, so nothing built there is used. A "
                "process that SIGKILL does not end is stuck in the kernel (state D: a hung "
                "file system or device); once it is gone, build again")
        time.sleep(0.01)


def _kill_group(pgrp: int) -> tuple[set[int], set[int]]:
    """SIGKILLs the process group ``pgrp``; returns (pids, process groups) killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgrp, signal.SIGKILL)
    return set(), {pgrp}


def _kill_tree(roots: list[int]) -> tuple[set[int], set[int]]:
    """SIGKILLs ``roots``, every process under them and their process groups other than
    ours; returns (pids, process groups) killed. Each is stopped before its children are
    listed, so none starts another in between and none is orphaned (an orphan would no
    longer be found under its root); the groups take whatever left the tree earlier."""
    ours = os.getpgrp()
    tree: list[int] = []
    groups: set[int] = set()
    todo = list(roots)
    while todo:
        p = todo.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except OSError:  # gone already
            continue
        tree.append(p)
        for q in _processes():
            if q.pid == p and q.pgrp != ours:
                groups.add(q.pgrp)
            if q.ppid == p and q.pid not in tree:
                todo.append(q.pid)
    for g in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(g, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return set(tree), groups


def _kill_builds_in(folder: str, since: int) -> tuple[set[int], set[int]]:
    """SIGKILLs the processes of this session started from ``since`` (``_ticks_since_boot``)
    that work in ``folder`` (the ninja that cpp_extension runs there, and the compilers
    ninja started, which go on after ninja is killed: each runs in a process group of its
    own), with everything under them and their groups; returns (pids, process groups)
    killed. A process of another session, or one that was there before the build (a
    shell whose folder it is), is not the build's."""
    session, me = os.getsid(0), os.getpid()
    roots = []
    for p in _processes():
        if p.session == session and p.pid != me and p.started >= since:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{p.pid}/cwd") == folder:
                    roots.append(p.pid)
    return _kill_tree(roots)


class _Stop:
    """How to stop one compiler run: ``kill`` SIGKILLs what it finds of the run and says
    what it killed (pids, process groups); ``finish`` kills once more and waits until all
    of it has exited."""

    def __init__(self, what: str, folder: Path,
                 kill: Callable[[], tuple[set[int], set[int]]]) -> None:
        self.what = what
        self.folder = folder
        self._kill = kill
        self._lock = threading.Lock()  # the watchdog's thread kills too
        self._pids: set[int] = set()
        self._groups: set[int] = set()

    def kill(self) -> None:
        pids, groups = self._kill()
        with self._lock:
            self._pids |= pids
            self._groups |= groups

    def finish(self) -> None:
        self.kill()
        with self._lock:
            pids, groups = set(self._pids), set(self._groups)
        _wait_until_exited(pids, groups, self.what, self.folder)


def _deadline_passed(done: threading.Event, seconds: float) -> bool:
    """Waits until ``done`` is set (the run ended: False) or ``seconds`` have passed (the
    run is to be stopped: True). Replaceable, so that a test stops a run at a moment it
    chooses (its compiler known to be running) rather than at a time."""
    return not done.wait(seconds)


class _Watchdog:
    """Stops a compiler run (``stop.kill()``) once ``_deadline_passed`` says it has run
    ``seconds`` (``fired``), and again every 0.1 s until the ``with`` block ends: what the
    build starts after the first kill (ninja, where cpp_extension had not yet started it)
    is stopped too."""

    def __init__(self, seconds: float, stop: _Stop, name: str) -> None:
        self.seconds = seconds
        self.stop = stop
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name=f"codegen build watchdog {name}")

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if not _deadline_passed(self._done, self.seconds):
            return
        self.fired = True
        while True:
            self.stop.kill()
            if self._done.wait(0.1):
                return


def _forget_version(name: str) -> None:
    """cpp_extension numbers a name's builds within a process (a second build of ``name``
    with other sources or flags is ``name_v1.so``, one with the same ones is skipped).
    codegen's cache decides when to build; cpp_extension is told to build ``name.so``."""
    versioner = getattr(_cpp_extension(), "JIT_EXTENSION_VERSIONER", None)
    entries = getattr(versioner, "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


def _cpp_extension_build(entry: _Entry, tools: Toolchain, includes: list[str]) -> None:
    """Builds ``entry.library`` from ``entry.source`` with cpp_extension.load and ninja in
    the entry's folder, and loads it (``load`` does, through ``torch.ops.load_library``).
    A failure is a BuildError with the first diagnostic (a ``_LinkError`` where the object
    compiled), one past ``build_timeout()`` a ``_BuildTimeout``. Caller holds the locks."""
    if len(tools.cxx) != 1:
        raise BuildError(f"codegen: CXX={shlex.join(tools.cxx)!r}: torch.utils.cpp_extension "
                         "runs $CXX as one command; name the compiler alone (cpp_extension "
                         "puts ccache or sccache in front of it itself, where it finds them)")
    _ninja_on_path()
    cpp_extension = _cpp_extension()
    _forget_version(entry.name)
    # cpp_extension's own lock file: in torch before filelock (2.11's FileBaton) its mere
    # presence blocks, and one left by a killed build would block forever. Ours is held.
    (entry.folder / "lock").unlink(missing_ok=True)
    timeout = build_timeout()
    # A tick early: a process started now may be stamped with the tick this reading rounds
    # down from.
    stop = _Stop(f"building {entry.name}", entry.folder,
                 functools.partial(_kill_builds_in, os.path.realpath(entry.folder),
                                   _ticks_since_boot() - 1))
    try:
        with _Watchdog(timeout, stop, entry.folder.name) as watchdog:
            try:
                cpp_extension.load(
                    entry.name, [str(entry.source)],
                    extra_cflags=_ninja_flags([*tools.cflags, *includes]),
                    extra_ldflags=_ninja_flags([f for f in tools.ldflags
                                                if f != "-shared"]),  # it adds -shared
                    build_directory=str(entry.folder), is_python_module=False,
                    with_cuda=False)
                built = None
            except RuntimeError as e:  # ninja's failure ("Error building extension ...")
                if not str(e).startswith("Error building extension"):
                    raise BuildError(f"codegen: building {entry.name} failed: {e}") from None
                built = e
    except BaseException:
        # An error or an interrupt (KeyboardInterrupt) while ninja ran: subprocess.run
        # kills ninja, not the compilers it started (groups of their own), which would go
        # on writing into the folder after its lock is released.
        stop.finish()
        raise
    if built is None:
        if not entry.library.is_file():
            raise BuildError(f"codegen: building {entry.name}: cpp_extension reported "
                             f"success but made no {entry.library}")
        return
    log = str(built)
    if watchdog.fired:
        stop.finish()
        entry.log.write_text(f"{log}\n(stopped after {timeout:g} s)\n")
        raise _timed_out(entry.name, timeout, entry.log)
    entry.log.write_text(log)
    # A link error only where ninja's failed step is the link: the compiler can fail and
    # still leave an object (an argument it could not read beside the source it compiled).
    error = _LinkError if _failed_target(log) == entry.library.name else BuildError
    raise error(f"codegen: building {entry.name} failed: {_first_error(log)}\n"
                f"full log: {entry.log}")


def _compile(entry: _Entry, source: str, key: str, full_torch: bool = False) -> float:
    """Builds ``entry`` from ``source`` and loads it; returns seconds. Caller holds the
    locks."""
    # A builder killed mid-way (SIGKILL, power loss) leaves no stamp and maybe a partial
    # object or library. We hold the entry's flock, so nobody else is building here: stale.
    for stale in (entry.stamp, entry.library, entry.object, entry.log):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    tools = _tools(full_torch)
    # A full-torch library does not include the runtime: no precompiled header for it.
    with (contextlib.nullcontext(None) if full_torch else _precompiled_runtime(tools)) as pch:
        if not full_torch:
            _prune_precompiled(keep=pch)
        entry.source.write_text(source)
        includes = [*([f"-I{pch}", "-Winvalid-pch"] if pch else []), f"-I{include_dir()}"]
        try:
            _cpp_extension_build(entry, tools, includes)
        except _LinkError as gold_error:
            if GOLD not in tools.ldflags:
                raise
            # gold is faster but cannot read some toolchains' libstdc++ linker scripts
            # (seen with a GCC in /opt/gcc). Link again with the default linker (ninja
            # keeps the object); where that works, gold was the trouble: off from now on.
            _cpp_extension_build(entry, _tools(full_torch, gold=False), includes)
            _gold_failed.set()
            log.warning("gold could not link here, the default linker could; linking with "
                        "it from now on (%s)", str(gold_error).splitlines()[0])
    entry.stamp.write_text(f"{key} {_digest(entry.library.read_bytes())}\n")
    return time.perf_counter() - start


def _check_loaded(name: str, key: str) -> Path | None:
    """The library of ``name`` if this process loaded it (for ``key``). Caller holds
    ``_lock``."""
    if name not in _loaded:
        return None
    loaded_key, library = _loaded[name]
    if loaded_key != key:
        raise BuildError(
            f"codegen: op name {name} is already loaded in this process for another "
            "program (a hash-prefix collision, or a source changed under one name); "
            "rename the Fusion, or start a new process")
    return library


@contextlib.contextmanager
def _progress(name: str, why: str) -> Iterator[None]:
    """Logs one line, saying ``why`` it may be slow, if the build of ``name`` is still
    running after ``PROGRESS_AFTER_S``: a long wait is not a silent one."""
    timer = threading.Timer(PROGRESS_AFTER_S, log.info, args=(
        "still building %s after %g s (%s) ...", name, PROGRESS_AFTER_S, why))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def prepare() -> None:
    """Builds what the first program of a cache builds besides itself: the precompiled
    runtime and ``codegen_no_backward``; afterwards a program's build time is its own."""
    try:
        _private(cache_root(), parents=True)
    except OSError as e:
        raise BuildError(f"codegen: cannot create the build cache {cache_root()} ({e}); "
                         "set CODEGEN_CACHE_DIR to a writable folder") from None
    with _precompiled_runtime(toolchain()):
        pass
    _no_backward()


def build_library(name: str, source: str | Callable[[], str], key: str | None = None, *,
                  full_torch: bool = False) -> Path:
    """The path of a loaded library for ``source``: from the cache, or built now.
    ``source`` may be a function, called only to build; then ``key`` must name
    everything the source depends on. ``full_torch``: built against libtorch's own C++
    headers (``_full_torch``), not only the stable ABI. Threads building different
    names build at once; one name is built or loaded by one thread at a time."""
    if key is None:
        if callable(source):
            raise TypeError("build_library: a lazy source needs a key")
        key = source
    full_key = _key(f"full torch\n{key}" if full_torch else key)
    with _lock:
        library = _check_loaded(name, full_key)
        if library is not None:
            return library
        name_lock = _name_locks.setdefault(name, threading.Lock())
    with name_lock:
        with _lock:  # another thread may have loaded it while we waited
            library = _check_loaded(name, full_key)
        if library is not None:
            return library
        root = cache_root()
        entry = _Entry(root / f"{name}-{full_key[:16]}", name)
        try:
            _private(root, parents=True)
            _private(entry.folder)
        except OSError as e:
            raise BuildError(f"codegen: cannot create the build cache {entry.folder} ({e}); "
                             "set CODEGEN_CACHE_DIR to a writable folder") from None
        if not os.access(entry.folder, os.W_OK):
            raise BuildError(f"codegen: the build cache {entry.folder} is not writable; "
                             "set CODEGEN_CACHE_DIR to a writable folder")
        rebuild = os.environ.get("CODEGEN_REBUILD", "") not in ("", "0")
        # Loaded under the lock, once: a concurrent CODEGEN_REBUILD cannot swap the
        # library between the stamp check and dlopen. A build loads what it built
        # (cpp_extension.load does).
        with _exclusive(entry.folder):
            if rebuild or not entry.valid(full_key):
                log.info("building %s ...", name)
                why = ("against torch's full C++ headers, once per cache and torch"
                       if full_torch else "the first build of a cache also precompiles the "
                       "runtime's headers, once")
                with _progress(name, why):
                    seconds = _compile(entry, source() if callable(source) else source,
                                       full_key, full_torch)
                log.info("built %s in %.1f s (%s)", name, seconds, entry.folder)
            else:
                torch.ops.load_library(str(entry.library))
        with _lock:
            _loaded[name] = (full_key, entry.library)
        return entry.library


# ---------------------------------------------------------------------------- the op


# torch's C++ kernel for ops without a derivative (autograd_not_implemented_fallback.h),
# registered for one op at a time at the Autograd key. It runs the op below autograd and,
# where an input requires grad, gives the outputs a node whose backward raises "derivative
# for codegen::<op> is not implemented". The Python alternative
# (torch.library.register_autograd) costs a trip through Python on every call: 20 us of
# host time per call on the H200 machine (benchmarks/host_cost.py), more than the GEMM.
NO_BACKWARD_SOURCE = """\
// codegen: torch's autograd-not-implemented kernel for one codegen op at a time.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <exception>
#include <memory>
#include <mutex>
#include <vector>

// 0 when `name` (an op of the codegen namespace, without it) has the kernel now.
extern "C" __attribute__((visibility("default"))) int codegen_register_no_backward(
    const char* name) {
  static std::mutex mutex;
  static auto* fragments = new std::vector<std::unique_ptr<torch::Library>>();  // kept
  try {
    std::lock_guard<std::mutex> lock(mutex);
    auto fragment = std::make_unique<torch::Library>(
        torch::Library::IMPL, "NAMESPACE", c10::DispatchKey::Autograd, __FILE__, __LINE__);
    fragment->impl(name, torch::autograd::autogradNotImplementedFallback());
    fragments->push_back(std::move(fragment));
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
"""


@functools.cache
def _no_backward() -> Callable[[bytes], int] | None:
    """The registration function of NO_BACKWARD_SOURCE, built once per cache and torch;
    None (with a note on stderr) where it cannot be built."""
    try:
        library = build_library("codegen_no_backward",
                                NO_BACKWARD_SOURCE.replace("NAMESPACE", NAMESPACE),
                                full_torch=True)
        register = ctypes.CDLL(str(library)).codegen_register_no_backward
    except (BuildError, OSError, AttributeError) as e:  # not built, not loaded, no symbol
        log.warning("ops get a Python autograd kernel instead (%s)", e)
        return None
    register.argtypes, register.restype = [ctypes.c_char_p], ctypes.c_int
    return register


def differentiable(program: hir.HostProgram) -> bool:
    """Whether ``program`` has a backward (codegen.runtime.autograd): it was lowered from a fusion
    and does not communicate (a backward program itself has no source)."""
    return program.source is not None and not distributed.communications(program)


@functools.cache
def _autograd_library() -> torch.library.Library:
    return torch.library.Library(NAMESPACE, "IMPL")  # kept: it holds the registrations


def _register_python_parts(program: hir.HostProgram, qualname: str, overload: Any,
                           register: Callable[[bytes], int] | None) -> None:
    """What the C++ does not register: a fake implementation (output shapes for
    FakeTensor, meta tensors and torch.compile, after the same input checks as the
    evaluator) and an autograd kernel: the backward's (``autograd.register``) for a
    differentiable program; else one that says there is none (``register``, from
    ``_no_backward``: torch's C++ one; a Python formula where it is None or fails), so
    inputs that require grad (say, an nn.Parameter under inference) run forward, whoever
    calls the op, and backward fails with a message that names the op."""
    outputs = [program.allocations()[o] for o in program.outputs]
    n_inputs = len(program.inputs)

    def fake(*args: Any) -> Any:
        inputs = args[:n_inputs]  # a program with collectives also takes a group name
        env = check_inputs(program, inputs)
        device = program_device(program, inputs)  # host outputs are CPU tensors
        outs = [inputs[0].new_empty([e.evaluate(env) for e in o.shape], dtype=o.dtype,
                                    device="cpu" if o.device == "cpu" else device)
                for o in outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # noqa: ARG001
        raise RuntimeError(
            f"{program.name}: this op has no backward (a program with collectives, or one "
            "lowered without its source fusion, such as a backward program); compute it "
            "under torch.no_grad(), or with .detach()ed inputs, where gradients are not "
            "needed")

    torch.library.register_fake(qualname)(fake)
    if differentiable(program):
        autograd.register(program, qualname, overload, _autograd_library(), _realize)
        return
    if register is not None and register(qualname.split("::")[1].encode()) == 0:
        return
    if register is not None:
        log.warning("%s gets a Python autograd kernel (registering torch's C++ one failed)",
                    qualname)
    torch.library.register_autograd(qualname, backward)


def _realize(program: hir.HostProgram) -> Callable[..., Any]:
    """A derived program (a saving forward, a backward) as a built op, called below
    autograd."""
    return build(program)._overload


class CompiledOp:
    """A host program compiled to a torch op: ``op(*inputs)`` runs it.

    ``.name`` is the qualified op name (``codegen::<program>_<hash>``), ``.op`` the
    ``torch.ops`` packet, ``.source`` the C++, ``.host_ir`` the HostProgram.
    """

    def __init__(self, program: hir.HostProgram, op_name: str, library: Path,
                 source: str | None = None, alternative: CompiledOp | None = None) -> None:
        self.host_ir = program
        self.op_name = op_name
        self.library = library
        self._source = source
        self.name = f"{NAMESPACE}::{op_name}"
        self.op = getattr(getattr(torch.ops, NAMESPACE), op_name)
        self._overload = self.op.default  # called directly: no overload resolution per call
        self._communicates = bool(distributed.communications(program))
        self._differentiable = differentiable(program)
        # split_contraction="auto" left to the call: the op of program.alternative, and
        # the program's dispatch, which picks it per call
        self.alternative = alternative
        self._dispatch = dispatch(program) if alternative is not None else None
        # Host inputs only: no input says which GPU runs the op (the current one does).
        self._host_only = all(t.device == "cpu" for t in program.inputs)

    def pick(self, inputs: Sequence[torch.Tensor]) -> CompiledOp:
        """The op that runs for ``inputs``: this one, or its alternative where the
        program's dispatch picks that for the inputs' extents and layouts (``lower``'s
        ``split_contraction="auto"``, ``codegen.dispatch``)."""
        if self._dispatch is None or self.alternative is None:
            return self
        return self.alternative if self._dispatch.rows(inputs) else self

    @property
    def source(self) -> str:
        """The C++ (rendered on first access when the op came from the cache)."""
        if self._source is None:
            self._source = render(self.host_ir)
        return self._source

    def __call__(self, *inputs: torch.Tensor, group: Any = None) -> Any:
        """Runs the op; a program with collectives runs them over ``group`` (default:
        torch.distributed's default group), resolved now."""
        if self.alternative is not None:
            op = self.pick(inputs)
            if op is not self:
                return op(*inputs, group=group)
        if self._communicates:
            pg = distributed.resolve_group(self.host_ir, group)
            return self._overload(*inputs, pg.group_name)  # type: ignore[union-attr]
        if group is not None:
            raise TypeError(f"{self.host_ir.name}: group= is only for programs with "
                            "collectives; this one has none")
        if self._host_only and not torch.cuda.is_available():
            raise NoGPUError(f"{self.host_ir.name}: the compiled op runs on a CUDA GPU, and "
                               "this machine has none; cg.evaluate(op.host_ir, inputs) runs "
                               "the same host program on the CPU")
        if not self._differentiable or autograd.requires_grad(inputs) or \
                torch.compiler.is_compiling():
            return self._overload(*inputs)
        with _below_autograd():  # skips the Python autograd kernel: nothing to record
            return self._overload(*inputs)

    def __repr__(self) -> str:
        return f"CompiledOp({self.name}, library={self.library})"


_below_autograd = torch._C._AutoDispatchBelowAutograd
_registered: set[str] = set()  # ops whose Python parts are registered in this process


def build(program: hir.HostProgram, source: str | None = None) -> CompiledOp:
    """Builds (or loads from cache) the op of ``program``; ``source`` defaults to
    ``render(program)``."""
    if not isinstance(program, hir.HostProgram):
        hint = "; for a cg.Fusion, cg.compile(fusion) lowers and builds it" \
            if isinstance(program, Fusion) else ""
        raise TypeError(f"build expects a cg.HostProgram (from cg.lower), got "
                        f"{type(program).__name__}{hint}")
    alternative = None
    if program.alternative is not None:  # as differentiable as the program it stands for
        alternative = build(program.alternative if program.source is not None
                            else program.alternative.replace(source=None))
    name = op_name(program)
    if distributed.communications(program):
        collectives.register()
    if source is None:  # the digest covers the program, the templates and the renderer
        library = build_library(name, lambda: render(program),
                                key=f"rendered:{program_digest(program)}")
    else:
        library = build_library(name, source)
    compiled = CompiledOp(program, name, library, source, alternative)
    register = _no_backward()  # built (once) before _lock is taken: build_library takes it
    with _lock:
        if compiled.name not in _registered:
            _register_python_parts(program, compiled.name, compiled._overload, register)
            _registered.add(compiled.name)
    return compiled


def compile(fusion: Any, *, pool_size: int = 4,  # noqa: A001 - public API
            gemm_sm_count: int = 0, gemm_library: str = "cublaslt",
            copy_stream: bool = False, staging: str = "slots",
            split_contraction: bool | str = False) -> CompiledOp:
    """Lower, render, build and load ``fusion`` as a torch op. ``gemm_sm_count`` caps the
    SMs of each GEMM (cuBLASLt's SM_COUNT_TARGET; 0 = all); ``gemm_library="cublas"``
    calls cublasGemmEx instead of cached cuBLASLt plans (the default); ``copy_stream``
    queues host-to-device copies on one stream; ``staging="ring"`` lands them in the
    thread's staging ring, ahead of the caller's stream; ``split_contraction`` streams a
    row-major host operand read by column blocks as blocks of rows (see ``lower``);
    ``"auto"`` builds both loops where the choice depends on the call's extents, and
    each call runs the one ``codegen.transforms.cost`` estimates faster (``CompiledOp.pick``)."""
    from ..transforms.lowering import lower

    return build(lower(fusion, pool_size=pool_size, gemm_sm_count=gemm_sm_count,
                       gemm_library=gemm_library, copy_stream=copy_stream, staging=staging,
                       split_contraction=split_contraction))
