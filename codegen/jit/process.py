"""Compiler runs, stopped when they must be: a timeout per run, and on any exit.

Each compiler run is stopped after ``CODEGEN_BUILD_TIMEOUT_S`` (default 600) seconds with a
``BuildError``, and when the build is interrupted (KeyboardInterrupt, any exception):
SIGKILL to the compiler's process groups, then a wait until they have exited, since they
write into a folder whose lock is about to be released; a process that outlives that wait
is a ``BuildError`` that names it. The processes of a build are found by scanning
``/proc`` (``_kill_builds_in``); a watchdog thread stops a run that passes its deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Build messages: INFO what is built and how long it took, WARNING a slower fallback taken.
log = logging.getLogger("codegen.jit")


# Seconds one compiler run may take (CODEGEN_BUILD_TIMEOUT_S overrides).
BUILD_TIMEOUT_S = 600.0


class BuildError(RuntimeError):
    """The generated C++ did not compile or load; says where the full log is."""


class _BuildTimeout(BuildError):
    """A compiler run took longer than ``build_timeout()`` and was stopped."""


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


def _timed_out(what: str, seconds: float, log_path: Path) -> _BuildTimeout:
    return _BuildTimeout(
        f"codegen: building {what} timed out after {seconds:g} s and the compiler was "
        f"stopped; if the build is just slow here, raise the limit with "
        f"CODEGEN_BUILD_TIMEOUT_S=<seconds> (default {BUILD_TIMEOUT_S:g})\nfull log: {log_path}")


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT held back while the block runs and handled when it ends (a KeyboardInterrupt
    raised there, by Python's default handler), so that a process the block starts is
    known to the code that stops it: Popen returns only after its child has started, and
    an interrupt in between would leave the child running with no one holding its pid.
    Only in the main thread (where Python runs signal handlers) and only over a handler
    written in Python; SIG_IGN and SIG_DFL stay as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    caught: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, caught[0])


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
        with _interrupts_deferred():  # an interrupt raised inside Popen would lose the pid
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
    """SIGKILLs the processes of this process's session (``os.getsid``) started from
    ``since`` (``_ticks_since_boot``) that work in ``folder`` (the ninja that
    cpp_extension runs there, and the compilers ninja started, which go on after ninja is
    killed: each runs in a process group of its own), with everything under them and
    their groups; returns (pids, process groups) killed. A process of another process
    session, or one that was there before the build (a shell whose folder it is), is not
    the build's."""
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
