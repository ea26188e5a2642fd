"""The precompiled runtime header, built once per cache and toolchain, and its pruning.

The runtime headers a program starts with are precompiled once per cache
(``_precompiled_runtime``, one direct compiler run: cpp_extension builds libraries, not
headers); the folder of that ``.gch`` goes first on the include path and GCC uses it,
``-DTORCH_EXTENSION_NAME`` notwithstanding. Precompiled headers unused for a day are
removed (``_prune_precompiled``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..backend.renderer import (
    include_dir,
)
from . import cache, compiler, process
from .process import BuildError

# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger("codegen.jit")


# The runtime's umbrella header: the first include of every program, precompiled once.
RUNTIME_HEADER = "codegen/runtime.h"
PCH_PREFIX = "runtime-pch-"
# A precompiled runtime (~115 MB) that no build has used for this long is removed by the
# next build (an upgrade of codegen or torch leaves the old one behind).
PCH_UNUSED_S = 24 * 3600


@contextlib.contextmanager
def _precompiled_runtime(tools: compiler.Toolchain) -> Iterator[Path | None]:
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
    key = cache._digest(f"{tools.tag()}|{torch.__version__}".encode())
    folder = cache.cache_root() / f"{PCH_PREFIX}{key[:16]}"
    pch = folder / f"{RUNTIME_HEADER}.gch"
    stamp = folder / "ok"
    with contextlib.ExitStack() as users:
        try:
            _share(folder, users)
            with cache._exclusive(folder):
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
                        process._run([*tools.cxx, *tools.cflags, f"-I{folder}", "-x", "c++-header",
                              str(folder / RUNTIME_HEADER), "-o", str(partial)],
                             folder / "build.log", "the runtime's precompiled header")
                        partial.replace(pch)
                    finally:
                        partial.unlink(missing_ok=True)
                    stamp.write_text(f"{key} {pch.stat().st_size}\n")
                os.utime(stamp)
        except (process._BuildTimeout, process._StillRunning):
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
        cache._private(folder)
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
    for folder in cache.cache_root().glob(f"{PCH_PREFIX}*"):
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
                with cache._exclusive(folder):  # not being built either
                    shutil.rmtree(folder)
                    removed.append(folder)
    return removed
