"""How a library is built: torch.utils.cpp_extension and ninja against the shared
precompiled runtime, gold retried only for a failed link, a timeout on every compiler run,
builds of different programs at once from several threads, and a cache that only its
owner can write (CPU; CI)."""

import dataclasses
import fcntl
import importlib
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

import codegen as cg
from codegen.examples import matmul_rows
from codegen.renderer import include_dir

pytestmark = pytest.mark.build  # every test here builds C++

builder = importlib.import_module("codegen.builder")  # cg.build is the function

RUNTIME_PROGRAM = '#include "codegen/runtime.h"\nint {name}_probe() {{ return 1; }}\n'
PLAIN_PROGRAM = 'extern "C" int {name}_probe() {{ return 1; }}\n'  # no headers: quick


def _fake_cxx(folder: Path, name: str, hang_on: str | None = None) -> Path:
    """A compiler script for $CXX (its name says g++, so cpp_extension takes it for GCC):
    runs the real c++, after logging each run given a .cpp file (a compile) to
    $CG_TEST_LOG; runs that match ``hang_on`` (a case pattern) write their pid to
    $CG_TEST_PIDS and sleep instead."""
    real = shutil.which("c++")
    if real is None:
        pytest.skip("needs a C++ compiler named c++")
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    hang = f'  {hang_on}) echo "$$" >> "$CG_TEST_PIDS"; exec sleep 60;;\n' if hang_on else ""
    script.write_text(
        "#!/bin/sh\n"
        f'case " $* " in\n{hang}'
        '  *".cpp "*) echo "$*" >> "$CG_TEST_LOG";;\n'
        "esac\n"
        f'exec {real} "$@"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def fake_cxx(monkeypatch, tmp_path):
    """Installs a fake $CXX for one test (the toolchain is recomputed before and after);
    gives a function (name, hang_on, folder) -> (log of compiles, file of hung pids)."""
    monkeypatch.setattr(builder, "_gold_failed", threading.Event())
    builder._toolchain.cache_clear()

    def install(name: str, hang_on: str | None = None,
                folder: Path | None = None) -> tuple[Path, Path]:
        script = _fake_cxx(folder or tmp_path / "bin", name, hang_on)
        log, pids = tmp_path / "compiles.log", tmp_path / "hung.pids"
        log.write_text("")
        pids.write_text("")
        monkeypatch.setenv("CXX", str(script))
        monkeypatch.setenv("CG_TEST_LOG", str(log))
        monkeypatch.setenv("CG_TEST_PIDS", str(pids))
        builder._toolchain.cache_clear()
        return log, pids

    yield install
    monkeypatch.undo()
    builder._toolchain.cache_clear()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _pch_folder(cache: Path) -> Path:
    """The one precompiled runtime of a cache."""
    (folder,) = cache.glob(f"{builder.PCH_PREFIX}*")
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
    assert pch.parent == cache_dir and pch.name.startswith(builder.PCH_PREFIX)
    assert f"-I{pch} -Winvalid-pch -I{include_dir()}" in ninja
    steps = (folder / ".ninja_log").read_text()
    assert f"\t{name}.o\t" in steps and f"\t{name}.so\t" in steps
    assert str(op.library) in builder.torch.ops.loaded_libraries
    # ninja's compile command, asked which headers it reads: the .gch ("!": used).
    command = shlex.split(subprocess.run(["ninja", "-t", "commands", f"{name}.o"], cwd=folder,
                                         capture_output=True, text=True,
                                         check=True).stdout.splitlines()[-1])
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
    assert builder._no_backward() is not None
    _, library = builder._loaded["codegen_no_backward"]
    ninja = (library.parent / "build.ninja").read_text()
    assert "torch/csrc/api/include" in ninja and "-DTORCH_TARGET_VERSION" not in ninja
    assert "runtime-pch-" not in ninja  # it does not include the runtime


def test_a_build_loads_its_library_once_under_the_entry_lock(cache_dir, monkeypatch):
    monkeypatch.setenv("CODEGEN_REBUILD", "1")  # a build, not a load from the cache
    loads = []
    real = builder.torch.ops.load_library

    def probe(path: str) -> None:
        with open(Path(path).parent / "codegen.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                loads.append((path, False))
            except BlockingIOError:
                loads.append((path, True))
        real(path)

    monkeypatch.setattr(builder.torch.ops, "load_library", probe)
    library = builder.build_library("load_once_probe", RUNTIME_PROGRAM.format(name="load_once"))
    assert loads == [(str(library), True)]
    assert (library.parent / "ok").read_text().split()[1] == builder._digest(
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
    library = builder.build_library("spaced_probe", RUNTIME_PROGRAM.format(name="spaced"))
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
    assert builder.cache_root() == cache_dir
    library = builder.build_library("relative_probe", RUNTIME_PROGRAM.format(name="relative"))
    assert library.parent.parent == cache_dir
    headers = _headers_compiled(library.parent)  # ninja ran in the entry's folder
    assert headers == [str(library.with_suffix(".cpp"))], headers


def test_a_failed_compile_that_left_an_object_is_not_taken_for_a_link_error(
        tmp_path, monkeypatch):
    """GCC given an input it cannot find beside the source still compiles the source, and
    fails: ninja's failed step is the compile, so the error is reported once, as a
    compile error, and the link is not retried without gold."""
    real = builder._toolchain

    def stray_input(gold: bool) -> builder.Toolchain:
        tools = real(gold)
        return dataclasses.replace(tools, cflags=(*tools.cflags, "no_such_input"))

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(builder, "_gold_failed", threading.Event())
    monkeypatch.setattr(builder, "_toolchain", stray_input)
    with pytest.raises(cg.BuildError, match=r"building stray_probe failed: .*no_such_input") \
            as e:
        builder.build_library("stray_probe", PLAIN_PROGRAM.format(name="stray"),
                              full_torch=True)
    assert not isinstance(e.value, builder._LinkError)
    (folder,) = tmp_path.glob("stray_probe-*")
    assert (folder / "stray_probe.o").is_file()  # what made it look like a link error
    assert not builder._gold_failed.is_set()


@pytest.mark.parametrize("log,target", [
    ("[1/2] c++ ... -c a.cpp -o a.o\nFAILED: a.o \nc++ ...\nninja: build stopped", "a.o"),
    ("[2/2] c++ a.o -shared -o a.so\nFAILED: [code=1] a.so \nld: cannot find -lx", "a.so"),
    ("Error building extension 'a': ninja: error: loading 'build.ninja'", None),
])
def test_the_failed_step_is_read_from_ninjas_log(log, target):
    assert builder._failed_target(log) == target


# ---------------------------------------------------------------------------- gold


def test_a_compile_error_is_not_blamed_on_gold(cache_dir, fake_cxx):
    # The same path in every run of a cache, so its precompiled runtime is reused.
    log, _ = fake_cxx("g++-counting", folder=cache_dir / "test-cxx")
    if builder.GOLD not in builder.toolchain().ldflags:
        pytest.skip("gold is not on this machine")
    with pytest.raises(cg.BuildError, match=r"building gold_blame_probe failed: .*error"):
        builder.build_library("gold_blame_probe", "int f() { return 1 +; }\n")
    compiles = [line for line in log.read_text().splitlines() if "gold_blame_probe" in line]
    assert len(compiles) == 1, compiles
    assert not builder._gold_failed.is_set()
    assert builder.GOLD in builder.toolchain().ldflags


def test_a_link_that_fails_without_gold_too_leaves_gold_on(tmp_path, monkeypatch):
    real = builder._toolchain

    def missing_library(gold: bool) -> builder.Toolchain:
        tools = real(gold)
        return dataclasses.replace(tools, ldflags=(*tools.ldflags, "-lcodegen_no_such_lib"))

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(builder, "_gold_failed", threading.Event())
    monkeypatch.setattr(builder, "_toolchain", missing_library)
    if builder.GOLD not in builder.toolchain().ldflags:
        pytest.skip("gold is not on this machine")
    with pytest.raises(cg.BuildError, match=r"building link_probe failed: .*ld.*cannot find "
                                            r"-lcodegen_no_such_lib"):
        builder.build_library("link_probe", PLAIN_PROGRAM.format(name="link"),
                              full_torch=True)
    assert not builder._gold_failed.is_set()
    assert builder.GOLD in builder.toolchain().ldflags
    (folder,) = tmp_path.glob("link_probe-*")
    steps = [line.split("\t")[3] for line in (folder / ".ninja_log").read_text().splitlines()
             if not line.startswith("#")]
    assert steps == ["link_probe.o"], steps  # compiled once; both links failed (unlogged)


# ---------------------------------------------------------------------------- timeouts


def test_a_hung_compiler_is_stopped_with_a_clear_error(tmp_path, monkeypatch, fake_cxx):
    _, pids = fake_cxx("g++-hang", hang_on='*".cpp "*')
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "1.5")
    start = time.monotonic()
    with pytest.raises(cg.BuildError, match=(
            r"building hang_probe timed out after 1.5 s and the compiler was stopped; .*"
            r"raise the limit with CODEGEN_BUILD_TIMEOUT_S=<seconds> \(default 600\)\n"
            r"full log: .*build.log")):
        builder.build_library("hang_probe", PLAIN_PROGRAM.format(name="hang"), full_torch=True)
    assert time.monotonic() - start < 30
    hung = [int(p) for p in pids.read_text().split()]
    assert hung and not any(_alive(p) for p in hung)


def test_a_hung_compiler_of_the_precompiled_runtime_is_stopped_too(tmp_path, monkeypatch,
                                                                   fake_cxx):
    _, pids = fake_cxx("g++-hang", hang_on='*" c++-header "*')
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "1")
    with pytest.raises(cg.BuildError, match=r"building the runtime's precompiled header timed "
                                            r"out after 1 s .*CODEGEN_BUILD_TIMEOUT_S"):
        builder.build_library("hang_pch_probe", RUNTIME_PROGRAM.format(name="hang_pch"))
    hung = [int(p) for p in pids.read_text().split()]
    assert hung and not any(_alive(p) for p in hung)


def test_a_bad_timeout_is_refused(monkeypatch):
    monkeypatch.setenv("CODEGEN_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(cg.BuildError, match="CODEGEN_BUILD_TIMEOUT_S must be a number of "
                                            "seconds > 0, got 'soon'"):
        builder.build_timeout()


# ---------------------------------------------------------------------------- concurrency


def _in_threads(*calls):
    """Runs each call in a thread of its own, all started together; their exceptions."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def run(call):
        try:
            start.wait(timeout=30)
            call()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
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

    monkeypatch.setattr(builder, "_compile", compile_)
    names = [f"at_once_{i}_{os.getpid()}" for i in (1, 2)]
    errors = _in_threads(*[lambda n=n: builder.build_library(n, f"// {n}\n") for n in names])
    for n in names:  # the fake libraries stay out of later tests
        builder._loaded.pop(n, None)
    assert not errors, errors


def test_two_real_builds_overlap_in_time(cache_dir, monkeypatch):
    monkeypatch.setenv("CODEGEN_REBUILD", "1")  # the same two names each run, built anew
    spans: dict[str, tuple[float, float]] = {}
    real = builder._compile

    def timed(entry, *args, **kwargs):
        start = time.monotonic()
        try:
            return real(entry, *args, **kwargs)
        finally:
            spans[entry.name] = (start, time.monotonic())

    monkeypatch.setattr(builder, "_compile", timed)
    names = ["overlap_probe_a", "overlap_probe_b"]
    errors = _in_threads(*[lambda n=n: builder.build_library(n, RUNTIME_PROGRAM.format(name=n))
                           for n in names])
    assert not errors, errors
    (a0, a1), (b0, b1) = spans[names[0]], spans[names[1]]
    assert max(a0, b0) < min(a1, b1), spans  # both were building at one moment


def test_one_program_from_two_threads_is_built_once(cache_dir, monkeypatch):
    monkeypatch.setenv("CODEGEN_REBUILD", "1")
    built = []
    real = builder._compile
    monkeypatch.setattr(builder, "_compile",
                        lambda entry, *a, **k: built.append(entry.name) or real(entry, *a, **k))
    source = RUNTIME_PROGRAM.format(name="once")
    libraries = []
    errors = _in_threads(*[lambda: libraries.append(builder.build_library("once_probe", source))
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
        builder.build_library("never_built_shared", "// nothing\n")
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
        builder.build_library("never_built_theirs", "// nothing\n")


def test_an_entry_that_group_can_write_is_not_loaded(cache_dir, monkeypatch):
    source = RUNTIME_PROGRAM.format(name="group_entry")
    library = builder.build_library("group_entry_probe", source)
    folder = library.parent
    monkeypatch.delitem(builder._loaded, "group_entry_probe")  # as in a new process
    folder.chmod(0o770)
    try:
        with pytest.raises(cg.BuildError, match=re.escape(
                f"{folder}: it is writable by group (mode 0770)")):
            builder.build_library("group_entry_probe", source)
    finally:
        folder.chmod(0o700)
    assert builder.build_library("group_entry_probe", source) == library


def test_a_new_cache_is_private_whatever_the_umask(tmp_path, monkeypatch):
    root = tmp_path / "new" / "cache"  # as .ci/run's $PWD/.codegen-cache in a fresh clone
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(root))
    umask = os.umask(0)
    try:
        library = builder.build_library("private_probe", PLAIN_PROGRAM.format(name="private"),
                                        full_torch=True)
    finally:
        os.umask(umask)
    assert library.parent.parent == root
    assert root.stat().st_mode & 0o777 == 0o700
    assert library.parent.stat().st_mode & 0o777 == 0o700


def test_a_pytest_tmp_dir_is_a_good_cache(tmp_path, monkeypatch):
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    library = builder.build_library("tmp_dir_probe", RUNTIME_PROGRAM.format(name="tmp_dir"))
    assert library.parent.stat().st_mode & 0o777 == 0o700
    pch = _pch_folder(tmp_path)
    assert (pch / "ok").is_file() and pch.stat().st_mode & 0o777 == 0o700
