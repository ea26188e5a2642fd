"""The build cache: its root, its entries (keys, stamps), and the locks around them.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..backend.renderer import (
    include_dir,
)
from . import compiler
from .process import BuildError

# How a library is built; part of every cache key (a change of path rebuilds).
BUILD_PATH = "torch.utils.cpp_extension.load+ninja"
_loaded: dict[str, tuple[str, Path]] = {}  # op name -> (digest, library) in this process
_lock = threading.Lock()  # guards _loaded, _name_locks, _registered; held for no compile
_name_locks: dict[str, threading.Lock] = {}  # op name -> held while it is built or loaded


def cache_root() -> Path:
    """The build cache: ``CODEGEN_CACHE_DIR`` (default ``~/.cache/codegen``), made
    absolute against the current folder: ninja runs in each entry's folder, where a
    relative path to the precompiled runtime would name nothing (and GCC would silently
    read the headers instead)."""
    root = os.environ.get("CODEGEN_CACHE_DIR") or str(Path.home() / ".cache" / "codegen")
    return Path(os.path.abspath(Path(root).expanduser()))


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



def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _key(source: str) -> str:
    """The full cache key of a source text (or of the digest of what determines it):
    also the torch and CUDA versions, the compiler, every flag and the build path."""
    tag = (f"{torch.__version__}|{torch.version.cuda}|{compiler.toolchain().tag()}|{include_dir()}|"
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
