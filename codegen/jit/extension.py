"""C++ source -> a loaded library, through the cache and ``torch.utils.cpp_extension``.

A program is one translation unit against torch's stable ABI (no ATen headers), built by
``torch.utils.cpp_extension.load`` and ninja in the entry's folder (``build.ninja``,
``<name>.o``, ``<name>.so``) with the flags of ``compiler.toolchain()`` as
``extra_cflags`` / ``extra_ldflags``; ``load`` also loads the library. The build is
``with_cuda=False``: the file has no CUDA code. ``build_library`` is the entry point.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from ..backend.renderer import (
    include_dir,
)
from . import cache, compiler, precompiled, process
from .process import BuildError

# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger("codegen.jit")


# Seconds after which a build still running logs that it is (once).
PROGRESS_AFTER_S = 5.0


class _LinkError(BuildError):
    """The source compiled and the link failed."""


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


def _forget_version(name: str) -> None:
    """cpp_extension numbers a name's builds within a process (a second build of ``name``
    with other sources or flags is ``name_v1.so``, one with the same ones is skipped).
    codegen's cache decides when to build; cpp_extension is told to build ``name.so``."""
    versioner = getattr(_cpp_extension(), "JIT_EXTENSION_VERSIONER", None)
    entries = getattr(versioner, "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


def _cpp_extension_build(entry: cache._Entry, tools: compiler.Toolchain,
                         includes: list[str]) -> None:
    """Builds ``entry.library`` from ``entry.source`` with cpp_extension.load and ninja in
    the entry's folder, and loads it (``load`` does, through ``torch.ops.load_library``).
    A failure is a BuildError with the first diagnostic (a ``_LinkError`` where the object
    compiled), one past ``build_timeout()`` a ``_BuildTimeout``. Caller holds the locks."""
    if len(tools.cxx) != 1:
        raise BuildError(f"codegen: CXX={shlex.join(tools.cxx)!r}: torch.utils.cpp_extension "
                         "runs $CXX as one command; name the compiler alone (cpp_extension "
                         "puts ccache or sccache in front of it itself, where it finds them)")
    compiler._ninja_on_path()
    cpp_extension = _cpp_extension()
    _forget_version(entry.name)
    # cpp_extension's own lock file: in torch before filelock (2.11's FileBaton) its mere
    # presence blocks, and one left by a killed build would block forever. Ours is held.
    (entry.folder / "lock").unlink(missing_ok=True)
    timeout = process.build_timeout()
    # A tick early: a process started now may be stamped with the tick this reading rounds
    # down from.
    stop = process._Stop(f"building {entry.name}", entry.folder,
                 functools.partial(process._kill_builds_in, os.path.realpath(entry.folder),
                                   process._ticks_since_boot() - 1))
    try:
        with process._Watchdog(timeout, stop, entry.folder.name) as watchdog:
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
        raise process._timed_out(entry.name, timeout, entry.log)
    entry.log.write_text(log)
    # A link error only where ninja's failed step is the link: the compiler can fail and
    # still leave an object (an argument it could not read beside the source it compiled).
    error = _LinkError if _failed_target(log) == entry.library.name else BuildError
    raise error(f"codegen: building {entry.name} failed: {process._first_error(log)}\n"
                f"full log: {entry.log}")


def _compile(entry: cache._Entry, source: str, key: str, full_torch: bool = False) -> float:
    """Builds ``entry`` from ``source`` and loads it; returns seconds. Caller holds the
    locks."""
    # A builder killed mid-way (SIGKILL, power loss) leaves no stamp and maybe a partial
    # object or library. We hold the entry's flock, so nobody else is building here: stale.
    for stale in (entry.stamp, entry.library, entry.object, entry.log):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    tools = compiler._tools(full_torch)
    # A full-torch library does not include the runtime: no precompiled header for it.
    runtime = contextlib.nullcontext(None) if full_torch else \
        precompiled._precompiled_runtime(tools)
    with runtime as pch:
        if not full_torch:
            precompiled._prune_precompiled(keep=pch)
        entry.source.write_text(source)
        includes = [*([f"-I{pch}", "-Winvalid-pch"] if pch else []), f"-I{include_dir()}"]
        try:
            _cpp_extension_build(entry, tools, includes)
        except _LinkError as gold_error:
            if compiler.GOLD not in tools.ldflags:
                raise
            # gold is faster but cannot read some toolchains' libstdc++ linker scripts
            # (seen with a GCC in /opt/gcc). Link again with the default linker (ninja
            # keeps the object); where that works, gold was the trouble: off from now on.
            _cpp_extension_build(entry, compiler._tools(full_torch, gold=False), includes)
            compiler._gold_failed.set()
            log.warning("gold could not link here, the default linker could; linking with "
                        "it from now on (%s)", str(gold_error).splitlines()[0])
    entry.stamp.write_text(f"{key} {cache._digest(entry.library.read_bytes())}\n")
    return time.perf_counter() - start


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
    full_key = cache._key(f"full torch\n{key}" if full_torch else key)
    with cache._lock:
        library = cache._check_loaded(name, full_key)
        if library is not None:
            return library
        name_lock = cache._name_locks.setdefault(name, threading.Lock())
    with name_lock:
        with cache._lock:  # another thread may have loaded it while we waited
            library = cache._check_loaded(name, full_key)
        if library is not None:
            return library
        root = cache.cache_root()
        entry = cache._Entry(root / f"{name}-{full_key[:16]}", name)
        try:
            cache._private(root, parents=True)
            cache._private(entry.folder)
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
        with cache._exclusive(entry.folder):
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
        with cache._lock:
            cache._loaded[name] = (full_key, entry.library)
        return entry.library
