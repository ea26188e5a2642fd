"""How a library is built: torch.utils.cpp_extension and ninja against the shared
precompiled runtime, gold retried only for a failed link, a timeout on every compiler run,
builds of different programs at once from several threads, and a cache that only its
owner can write (CPU; CI)."""

import contextlib
import dataclasses
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import codegen as cg
from codegen import jit
from codegen.backend.renderer import include_dir
from codegen.examples import matmul_rows

pytestmark = pytest.mark.build  # every test here builds C++

RUNTIME_PROGRAM = '#include "codegen/runtime.h"\nint {name}_probe() {{ return 1; }}\n'
PLAIN_PROGRAM = 'extern "C" int {name}_probe() {{ return 1; }}\n'  # no headers: quick


# Seconds after which a parked compiler run (below) is let go if nothing else ended it: it
# then fails, and so does its test. Only a builder that never stops the run gets there.
PARK_GUARD_S = 300.0
# Seconds a test waits for something that happens as soon as the build gets to it (a
# compiler run starting, a killed process exiting): only a broken build runs past them.
REACHED_S = 600.0
EXITED_S = 120.0

FAKE_CXX = """#!/bin/sh
case " $* " in *".cpp "*|*" c++-header "*) echo "$*" >> "$CG_TEST_LOG";; esac
case " $* " in
  $CG_TEST_PARK_ON)
    echo "$$" >> "$CG_TEST_PIDS"
    read -r word < "$CG_TEST_FIFO"
    [ "$word" = go ] || exit 1;;
esac
exec {real} "$@"
"""


def fake_cxx_script(folder: Path, name: str) -> Path:
    """A compiler script for $CXX (its name says g++, so cpp_extension takes it for GCC):
    logs each compile (a run given a .cpp file or a header) to $CG_TEST_LOG and runs the
    real c++. A run whose arguments match the case pattern $CG_TEST_PARK_ON (none where it
    is unset) first appends its pid to $CG_TEST_PIDS and blocks reading the FIFO
    $CG_TEST_FIFO (``Parked``): it never ends on its own, however fast the machine."""
    real = shutil.which("c++")
    if real is None:
        pytest.skip("needs a C++ compiler named c++")
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(FAKE_CXX.replace("{real}", real))
    script.chmod(0o755)
    return script


class Parked:
    """The parked runs of fake compilers (``fake_cxx_script``): their pids, and the FIFO
    they wait on for a word, ``go`` (run the real compiler) or another (exit 1)."""

    def __init__(self, folder: Path) -> None:
        self.pids = folder / "parked.pids"
        self.fifo = folder / "parked.fifo"
        self.pids.write_text("")
        os.mkfifo(self.fifo)
        self._writers: list[int] = []
        self._closed = threading.Event()

    def env(self, pattern: str) -> dict[str, str]:
        """The environment that parks the runs matching ``pattern`` (a case pattern)."""
        return {"CG_TEST_PARK_ON": pattern, "CG_TEST_PIDS": str(self.pids),
                "CG_TEST_FIFO": str(self.fifo)}

    def running(self) -> list[int]:
        """The pids of the runs parked so far (whole lines only)."""
        text = self.pids.read_text()
        return [int(p) for p in text[:text.rfind("\n") + 1].split()]

    def wait_for(self, count: int = 1) -> list[int]:
        """The pids once ``count`` runs are parked (polled: a run parks when the build gets
        to it, however long that takes here)."""
        deadline = time.monotonic() + REACHED_S
        while len(self.running()) < count:
            assert time.monotonic() < deadline, f"{count} compiler run(s) never started"
            time.sleep(0.01)
        return self.running()

    def release(self, word: str, count: int) -> None:
        """Gives ``count`` parked runs (now or later) ``word``. Read and write, the FIFO
        opens at once and keeps the words for a run that opens it later."""
        fd = os.open(self.fifo, os.O_RDWR)
        os.write(fd, f"{word}\n".encode() * count)
        self._writers.append(fd)

    def guard(self) -> None:
        """Lets the runs go (to fail) ``PARK_GUARD_S`` after the first parked, unless the
        test is over by then: a builder that never stops one fails its test, not hangs."""
        def watch() -> None:
            while not self.running():
                if self._closed.wait(0.05):
                    return
            if not self._closed.wait(PARK_GUARD_S):
                self.release("stop", 64)

        threading.Thread(target=watch, daemon=True).start()

    def close(self) -> None:
        """Ends every parked run still there (a pid that is now another process's is left
        alone), and the writers."""
        self._closed.set()
        mine = f"CG_TEST_FIFO={self.fifo}".encode()
        for pid in self.running():
            with contextlib.suppress(OSError):
                if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        for fd in self._writers:
            os.close(fd)


def wait_until_exited(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running after ``EXITED_S`` (polled: a killed process still
    has to be scheduled to exit); [] as soon as all have exited."""
    deadline = time.monotonic() + EXITED_S
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


@pytest.fixture
def parked(tmp_path):
    runs = Parked(tmp_path)
    runs.guard()
    yield runs
    runs.close()


@pytest.fixture
def fake_cxx(monkeypatch, tmp_path, parked):
    """Installs a fake $CXX for one test (the toolchain is recomputed before and after);
    gives a function (name, park_on, folder) -> the log of compiles; runs matching the
    case pattern ``park_on`` park (``parked``)."""
    monkeypatch.setattr(jit.compiler, "_gold_failed", threading.Event())
    jit.compiler._toolchain.cache_clear()

    def install(name: str, park_on: str | None = None, folder: Path | None = None) -> Path:
        script = fake_cxx_script(folder or tmp_path / "bin", name)
        log = tmp_path / "compiles.log"
        log.write_text("")
        monkeypatch.setenv("CXX", str(script))
        monkeypatch.setenv("CG_TEST_LOG", str(log))
        for key, value in parked.env(park_on or "").items():
            monkeypatch.setenv(key, value)
        jit.compiler._toolchain.cache_clear()
        return log

    yield install
    monkeypatch.undo()
    jit.compiler._toolchain.cache_clear()


def stop_when_parked(monkeypatch, runs: Parked) -> None:
    """A build's watchdog fires once a compiler run is parked (its pid written), not after
    a time: the run is known to be going, and it will never end on its own."""
    def parked_yet(done: threading.Event, seconds: float) -> bool:
        while not done.wait(0.01):
            if runs.running():
                return True
        return False

    monkeypatch.setattr(jit.process, "_deadline_passed", parked_yet)


@contextlib.contextmanager
def interrupted_when_parked(runs: Parked) -> Iterator[None]:
    """Expects the block to be interrupted: SIGINT to this process's main thread (there a
    KeyboardInterrupt, as Ctrl-C gives) once a compiler run is parked."""
    main, over = threading.main_thread().ident, threading.Event()

    def interrupt() -> None:
        while not runs.running():
            if over.wait(0.01):
                return
        signal.pthread_kill(main, signal.SIGINT)

    # Python makes SIGINT a KeyboardInterrupt only where it was not ignored when the
    # process started; it is in a job that a shell started in the background.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        over.set()
        thread.join()
        signal.signal(signal.SIGINT, handler)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _pch_folder(cache: Path) -> Path:
    """The one precompiled runtime of a cache."""
    (folder,) = cache.glob(f"{jit.precompiled.PCH_PREFIX}*")
    return folder

# ---------------------------------------------------------------------------- the build path


def test_a_program_is_built_by_cpp_extension_and_ninja_with_the_precompiled_runtime(
        cache_dir):
    op = cg.compile(matmul_rows(slices=6, name="ninja_path"))
    folder, name = op.library.parent, op.op_name
    assert op.library == folder / f"{name}.so"
    ninja = (folder / "build.ninja").read_text()
    assert f"-DTORCH_EXTENSION_NAME={name}" in ninja  # cpp_extension wrote it
    pch = Path(re.search(r" -I(\S+) -Winvalid-pch ", ninja).group(1))
    assert pch.parent == cache_dir and pch.name.startswith(jit.precompiled.PCH_PREFIX)
    assert f"-I{pch} -Winvalid-pch -I{include_dir()}" in ninja
    steps = (folder / ".ninja_log").read_text()
    assert f"\t{name}.o\t" in steps and f"\t{name}.so\t" in steps
    assert str(op.library) in torch.ops.loaded_libraries
    # ninja's compile command (ninja from this interpreter's environment, a dependency, not
    # whichever is on PATH), asked which headers it reads: the .gch ("!": used).
    commands = subprocess.run([sys.executable, "-m", "ninja", "-t", "commands", f"{name}.o"],
                              cwd=folder, capture_output=True, text=True, check=True)
    command = shlex.split(commands.stdout.splitlines()[-1])
    mmd = command.index("-MMD")
    del command[mmd:mmd + 3]  # -MMD -MF <name>.o.d
    out = command.index("-o")
    del command[out:out + 2]
    command.remove("-c")
    headers = subprocess.run([*command, "-fsyntax-only", "-H"], capture_output=True,
                             text=True, cwd=folder.parent)
    assert headers.returncode == 0, headers.stderr
    assert headers.stderr.splitlines()[0] == f"! {pch / 'codegen' / 'runtime.h.gch'}"


def test_the_autograd_library_of_torchs_full_headers_is_built_by_ninja_too(cache_dir):
    assert jit.no_backward._no_backward() is not None
    _, library = jit.cache._loaded["codegen_no_backward"]
    ninja = (library.parent / "build.ninja").read_text()
    assert "torch/csrc/api/include" in ninja and "-DTORCH_TARGET_VERSION" not in ninja
    assert "runtime-pch-" not in ninja  # it does not include the runtime


def test_a_build_loads_its_library_once_under_the_entry_lock(cache_dir, monkeypatch):
    monkeypatch.setenv("CODEGEN_REBUILD", "1")  # a build, not a load from the cache
    loads = []
    real = torch.ops.load_library

    def probe(path: str) -> None:
        with open(Path(path).parent / "codegen.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                loads.append((path, False))
            except BlockingIOError:
                loads.append((path, True))
        real(path)

    monkeypatch.setattr(torch.ops, "load_library", probe)
    library = jit.build_library("load_once_probe", RUNTIME_PROGRAM.format(name="load_once"))
    assert loads == [(str(library), True)]
    assert (library.parent / "ok").read_text().split()[1] == jit.cache._digest(
        library.read_bytes())


def _headers_compiled(folder: Path) -> list[str]:
    """The files ninja recorded as read by the compile of ``folder``'s object (its deps
    log, from the compiler's -MMD): the runtime's headers appear only where the compiler
    read them rather than the precompiled runtime."""
    deps = subprocess.run(["ninja", "-t", "deps"], cwd=folder, capture_output=True,
                          text=True, check=True).stdout
    return [line.strip() for line in deps.splitlines()[1:] if line.strip()]


def test_a_cache_path_with_a_space_builds_with_the_precompiled_runtime(cache_dir, tmp_path,
                                                                       monkeypatch):
    spaced = tmp_path / "a cache"
    spaced.symlink_to(cache_dir)  # the session's cache (and its runtime) under a spaced path
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(spaced))
    monkeypatch.setenv("CODEGEN_REBUILD", "1")  # a build, not a load from the cache
    library = jit.build_library("spaced_probe", RUNTIME_PROGRAM.format(name="spaced"))
    assert library.parent.parent == spaced
    ninja = (library.parent / "build.ninja").read_text()
    (flag,) = shlex.split(re.search(r" ('-I[^']*') -Winvalid-pch ", ninja).group(1))
    assert Path(flag[2:]).parent == spaced  # quoted for ninja's shell: one argument
    headers = _headers_compiled(library.parent)
    assert headers == [str(library.with_suffix(".cpp"))], headers


def test_a_relative_cache_dir_is_made_absolute(cache_dir, monkeypatch):
    monkeypatch.chdir(cache_dir.parent)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", cache_dir.name)
    monkeypatch.setenv("CODEGEN_REBUILD", "1")
    assert jit.cache.cache_root() == cache_dir
    library = jit.build_library("relative_probe", RUNTIME_PROGRAM.format(name="relative"))
    assert library.parent.parent == cache_dir
    headers = _headers_compiled(library.parent)  # ninja ran in the entry's folder
    assert headers == [str(library.with_suffix(".cpp"))], headers


def test_a_failed_compile_that_left_an_object_is_not_taken_for_a_link_error(
        tmp_path, monkeypatch):
    """GCC given an input it cannot find beside the source still compiles the source, and
    fails: ninja's failed step is the compile, so the error is reported once, as a
    compile error, and the link is not retried without gold."""
    real = jit.compiler._toolchain

    def stray_input(gold: bool) -> jit.compiler.Toolchain:
        tools = real(gold)
        return dataclasses.replace(tools, cflags=(*tools.cflags, "no_such_input"))

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit.compiler, "_gold_failed", threading.Event())
    monkeypatch.setattr(jit.compiler, "_toolchain", stray_input)
    with pytest.raises(cg.BuildError, match=r"building stray_probe failed: .*no_such_input") \
            as e:
        jit.build_library("stray_probe", PLAIN_PROGRAM.format(name="stray"),
                          full_torch=True)
    assert not isinstance(e.value, jit.extension._LinkError)
    (folder,) = tmp_path.glob("stray_probe-*")
    assert (folder / "stray_probe.o").is_file()  # what made it look like a link error
    assert not jit.compiler._gold_failed.is_set()


@pytest.mark.parametrize("log,target", [
    ("[1/2] c++ ... -c a.cpp -o a.o\nFAILED: a.o \nc++ ...\nninja: build stopped", "a.o"),
    ("[2/2] c++ a.o -shared -o a.so\nFAILED: [code=1] a.so \nld: cannot find -lx", "a.so"),
    ("Error building extension 'a': ninja: error: loading 'build.ninja'", None),
])
def test_the_failed_step_is_read_from_ninjas_log(log, target):
    assert jit.extension._failed_target(log) == target


# ---------------------------------------------------------------------------- gold


def test_a_compile_error_is_not_blamed_on_gold(cache_dir, fake_cxx):
    # The same path in every run of a cache, so its precompiled runtime is reused.
    log = fake_cxx("g++-counting", folder=cache_dir / "test-cxx")
    if jit.compiler.GOLD not in jit.compiler.toolchain().ldflags:
        pytest.skip("gold is not on this machine")
    with pytest.raises(cg.BuildError, match=r"building gold_blame_probe failed: .*error"):
        jit.build_library("gold_blame_probe", "int f() { return 1 +; }\n")
    compiles = [line for line in log.read_text().splitlines() if "gold_blame_probe" in line]
    assert len(compiles) == 1, compiles
    assert not jit.compiler._gold_failed.is_set()
    assert jit.compiler.GOLD in jit.compiler.toolchain().ldflags


def test_a_link_that_fails_without_gold_too_leaves_gold_on(tmp_path, monkeypatch):
    real = jit.compiler._toolchain

    def missing_library(gold: bool) -> jit.compiler.Toolchain:
        tools = real(gold)
        return dataclasses.replace(tools, ldflags=(*tools.ldflags, "-lcodegen_no_such_lib"))

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit.compiler, "_gold_failed", threading.Event())
    monkeypatch.setattr(jit.compiler, "_toolchain", missing_library)
    if jit.compiler.GOLD not in jit.compiler.toolchain().ldflags:
        pytest.skip("gold is not on this machine")
    with pytest.raises(cg.BuildError, match=r"building link_probe failed: .*ld.*cannot find "
                                            r"-lcodegen_no_such_lib"):
        jit.build_library("link_probe", PLAIN_PROGRAM.format(name="link"),
                          full_torch=True)
    assert not jit.compiler._gold_failed.is_set()
    assert jit.compiler.GOLD in jit.compiler.toolchain().ldflags
    (folder,) = tmp_path.glob("link_probe-*")
    steps = [line.split("\t")[3] for line in (folder / ".ninja_log").read_text().splitlines()
             if not line.startswith("#")]
    assert steps == ["link_probe.o"], steps  # compiled once; both links failed (unlogged)


# ---------------------------------------------------------------------------- timeouts


def test_a_hung_compiler_is_stopped_with_a_clear_error(tmp_path, monkeypatch, fake_cxx,
                                                      parked):
    fake_cxx("g++-hang", park_on="*.cpp *")
    stop_when_parked(monkeypatch, parked)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "1.5")  # what the message says
    with pytest.raises(cg.BuildError, match=(
            r"building hang_probe timed out after 1.5 s and the compiler was stopped; .*"
            r"raise the limit with CODEGEN_BUILD_TIMEOUT_S=<seconds> \(default 600\)\n"
            r"full log: .*build.log")):
        jit.build_library("hang_probe", PLAIN_PROGRAM.format(name="hang"), full_torch=True)
    hung = parked.running()
    assert hung and not wait_until_exited(hung)


def test_a_hung_compiler_of_the_precompiled_runtime_is_stopped_too(tmp_path, monkeypatch,
                                                                   fake_cxx, parked):
    fake_cxx("g++-hang", park_on="* c++-header *")
    stop_when_parked(monkeypatch, parked)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "1")
    with pytest.raises(cg.BuildError, match=r"building the runtime's precompiled header timed "
                                            r"out after 1 s .*CODEGEN_BUILD_TIMEOUT_S"):
        jit.build_library("hang_pch_probe", RUNTIME_PROGRAM.format(name="hang_pch"))
    hung = parked.running()
    assert hung and not wait_until_exited(hung)
    assert not list((tmp_path / "cache").glob("runtime-pch-*/codegen/*.partial*"))


def test_an_interrupted_build_stops_its_compiler(tmp_path, monkeypatch, fake_cxx, parked):
    """Ctrl-C (a KeyboardInterrupt) during a build: subprocess.run kills ninja; the compile
    ninja started (a process group of its own) is stopped by the builder before the
    entry's lock is released."""
    fake_cxx("g++-hang", park_on="*.cpp *")
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    with interrupted_when_parked(parked):
        jit.build_library("interrupted_probe", PLAIN_PROGRAM.format(name="interrupted"),
                          full_torch=True)
    hung = parked.running()
    assert hung and not wait_until_exited(hung)


def test_an_interrupted_build_stops_the_precompiled_runtimes_compiler(tmp_path, monkeypatch,
                                                                       fake_cxx, parked):
    """Its compiler runs in a session of its own, which neither Ctrl-C nor a kill of the
    builder's process group reaches: the builder stops it, on any way out."""
    fake_cxx("g++-hang", park_on="* c++-header *")
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    with interrupted_when_parked(parked):
        jit.build_library("interrupted_pch_probe",
                          RUNTIME_PROGRAM.format(name="interrupted_pch"))
    hung = parked.running()
    assert hung and not wait_until_exited(hung)
    assert not list((tmp_path / "cache").glob("runtime-pch-*/codegen/*.partial*"))


def test_an_interrupt_before_popen_returns_still_stops_the_compiler(tmp_path, monkeypatch,
                                                                     fake_cxx, parked):
    """Ctrl-C may land after the compiler has started but before Popen has returned (its
    pid not yet in the builder's hands): here it lands exactly there, every time."""
    fake_cxx("g++-hang", park_on="* c++-header *")
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    real = subprocess.Popen

    def popen_interrupted_on_return(*args, **kwargs):
        proc = real(*args, **kwargs)
        parked.wait_for(1)  # the compiler runs
        signal.raise_signal(signal.SIGINT)
        return proc

    monkeypatch.setattr(jit.process.subprocess, "Popen", popen_interrupted_on_return)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            jit.build_library("interrupted_popen_probe",
                              RUNTIME_PROGRAM.format(name="interrupted_popen"))
    finally:
        signal.signal(signal.SIGINT, handler)
        monkeypatch.setattr(jit.process.subprocess, "Popen", real)
    hung = parked.running()
    assert hung and not wait_until_exited(hung)


def test_a_compiler_that_outlives_its_kill_is_an_error_that_names_it(tmp_path, monkeypatch,
                                                                     fake_cxx, parked):
    fake_cxx("g++-hang", park_on="* c++-header *")
    stop_when_parked(monkeypatch, parked)
    # As if SIGKILL did not end it (a process stuck in the kernel): the parked run never
    # exits, so the wait for it need not be long to run out.
    monkeypatch.setattr(jit.process, "_kill_group", lambda pgrp: (set(), {pgrp}))
    monkeypatch.setattr(jit.process, "EXIT_WAIT_S", 0.5)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cg.BuildError) as error:
        jit.build_library("unkillable_probe", RUNTIME_PROGRAM.format(name="unkillable"))
    (pid,) = parked.running()
    folder = _pch_folder(tmp_path / "cache")
    assert re.fullmatch(
        rf"codegen: building the runtime's precompiled header: the compiler was killed "
        rf"\(SIGKILL\) and should have exited; 0.5 s later these of its processes were still "
        rf"running: pid {pid} \(state \w, process group {pid}\)\. They may still write into "
        rf"{re.escape(str(folder))}, so nothing built there is used\. .* build again",
        str(error.value)), str(error.value)
    assert not (folder / "ok").exists()


def test_a_bad_timeout_is_refused(monkeypatch):
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(cg.BuildError, match="CODEGEN_BUILD_TIMEOUT_S must be a number of "
                                            "seconds > 0, got 'soon'"):
        jit.process.build_timeout()


# ---------------------------------------------------------------------------- concurrency


def _in_threads(*calls):
    """Runs each call in a thread of its own, all started together; their exceptions."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def run(call):
        try:
            start.wait(timeout=REACHED_S)
            call()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REACHED_S)
    assert not any(t.is_alive() for t in threads), "a build never finished"
    return errors


def test_two_programs_build_at_once_from_two_threads(tmp_path, monkeypatch):
    """Each fake compile waits until the other one has started: only builds that run at
    the same time get through."""
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    inside = threading.Barrier(2)

    def compile_(entry, source, key, full_torch=False):
        inside.wait(timeout=20)
        return 0.0

    monkeypatch.setattr(jit.extension, "_compile", compile_)
    names = [f"at_once_{i}_{os.getpid()}" for i in (1, 2)]
    errors = _in_threads(*[lambda n=n: jit.build_library(n, f"// {n}\n") for n in names])
    for n in names:  # the fake libraries stay out of later tests
        jit.cache._loaded.pop(n, None)
    assert not errors, errors


def test_two_real_builds_overlap_in_time(cache_dir, monkeypatch, fake_cxx, parked):
    """Each program's compile waits (parked) until the other's has started: only builds
    that run at the same time get through."""
    monkeypatch.setenv("CODEGEN_REBUILD", "1")  # the same two names each run, built anew
    # The gold test's compiler (name and folder), so its precompiled runtime is reused.
    fake_cxx("g++-counting", park_on="*overlap_probe_*.cpp *", folder=cache_dir / "test-cxx")
    met = threading.Event()

    def meet() -> None:
        while len(parked.running()) < 2:
            if met.wait(0.01):
                return
        parked.release("go", 2)

    meeting = threading.Thread(target=meet, daemon=True)
    meeting.start()
    names = ["overlap_probe_a", "overlap_probe_b"]
    errors = _in_threads(*[lambda n=n: jit.build_library(n, RUNTIME_PROGRAM.format(name=n))
                           for n in names])
    met.set()
    meeting.join()
    assert not errors, errors
    assert len(parked.running()) == 2


def test_one_program_from_two_threads_is_built_once(cache_dir, monkeypatch):
    monkeypatch.setenv("CODEGEN_REBUILD", "1")
    built = []
    real = jit.extension._compile
    monkeypatch.setattr(jit.extension, "_compile",
                        lambda entry, *a, **k: built.append(entry.name) or real(entry, *a, **k))
    source = RUNTIME_PROGRAM.format(name="once")
    libraries = []
    errors = _in_threads(*[lambda: libraries.append(jit.build_library("once_probe", source))
                           for _ in range(2)])
    assert not errors, errors
    assert built == ["once_probe"] and len(set(libraries)) == 1


# ---------------------------------------------------------------------------- a private cache


def test_a_cache_root_that_others_can_write_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(root))
    with pytest.raises(cg.BuildError, match=re.escape(
            f"refusing to use the build cache folder {root}: it is writable by group and "
            f"others (mode 0777), so a library there may not be the one codegen built. "
            f"Fix: chmod 700 {root}, or set CODEGEN_CACHE_DIR to a folder of your own")):
        jit.build_library("never_built_shared", "// nothing\n")
    assert list(root.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_root_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(root))
    with pytest.raises(cg.BuildError, match=re.escape(
            f"{root}: it is owned by uid 12345, not by you (uid 0), so a library there may not "
            "be the one codegen built. Fix: set CODEGEN_CACHE_DIR to a folder of your own")):
        jit.build_library("never_built_theirs", "// nothing\n")


def test_an_entry_that_group_can_write_is_not_loaded(cache_dir, monkeypatch):
    source = RUNTIME_PROGRAM.format(name="group_entry")
    library = jit.build_library("group_entry_probe", source)
    folder = library.parent
    monkeypatch.delitem(jit.cache._loaded, "group_entry_probe")  # as in a new process
    folder.chmod(0o770)
    try:
        with pytest.raises(cg.BuildError, match=re.escape(
                f"{folder}: it is writable by group (mode 0770)")):
            jit.build_library("group_entry_probe", source)
    finally:
        folder.chmod(0o700)
    assert jit.build_library("group_entry_probe", source) == library


def test_a_new_cache_is_private_whatever_the_umask(tmp_path, monkeypatch):
    root = tmp_path / "new" / "cache"  # as .ci/run's $PWD/.codegen-cache in a fresh clone
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(root))
    umask = os.umask(0)
    try:
        library = jit.build_library("private_probe", PLAIN_PROGRAM.format(name="private"),
                                    full_torch=True)
    finally:
        os.umask(umask)
    assert library.parent.parent == root
    assert root.stat().st_mode & 0o777 == 0o700
    assert library.parent.stat().st_mode & 0o777 == 0o700


def test_a_pytest_tmp_dir_is_a_good_cache(tmp_path, monkeypatch):
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    library = jit.build_library("tmp_dir_probe", RUNTIME_PROGRAM.format(name="tmp_dir"))
    assert library.parent.stat().st_mode & 0o777 == 0o700
    pch = _pch_folder(tmp_path)
    assert (pch / "ok").is_file() and pch.stat().st_mode & 0o777 == 0o700
