"""The build cache under concurrency and faults (CPU; CI)."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_build_path import Parked, _alive, fake_cxx_script, wait_until_exited

pytestmark = pytest.mark.build  # every test here builds C++

REPO = Path(__file__).resolve().parent.parent

COMPILE = """
import torch, codegen as cg
from codegen.examples import linear_bias
op = cg.compile(linear_bias())
out = op(torch.empty(9, 16, device="meta"), torch.empty(30, 16, device="meta"),
         torch.empty(30, device="meta"))
print("shape", list(out.shape))
"""


def _spawn(cache: Path, **env: str) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(REPO), "CODEGEN_CACHE_DIR": str(cache), **env}
    return subprocess.Popen([sys.executable, "-c", COMPILE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full, cwd=REPO,
                            start_new_session=True)


@pytest.fixture
def parked(tmp_path):
    runs = Parked(tmp_path)
    runs.guard()
    yield runs
    runs.close()


def _fake_cxx(tmp_path: Path) -> dict[str, str]:
    """The environment of a builder whose $CXX is the fake compiler (``fake_cxx_script``),
    which logs its compiles to ``compiles.log``."""
    script = fake_cxx_script(tmp_path / "bin", "g++-parking")
    return {"CXX": str(script), "CG_TEST_LOG": str(tmp_path / "compiles.log")}


def _kill_builder(victim: subprocess.Popen) -> None:
    """SIGKILLs the builder and its process group (the interpreter, ninja), as a kill of a
    job does; the compilers, in groups of their own, are not reached."""
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate()


def test_two_processes_compiling_at_once_share_one_build(tmp_path):
    procs = [_spawn(tmp_path), _spawn(tmp_path)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "shape [9, 30]" in out
    built = sum(err.count("codegen: built linear_bias") for _, err in results)
    assert built == 1, [err for _, err in results]
    assert len(list(tmp_path.glob("linear_bias*/*.so"))) == 1
    # and one autograd library (build._no_backward), also built once
    assert sum(err.count("codegen: built codegen_no_backward") for _, err in results) == 1


def test_build_killed_midway_is_repaired_by_the_next_compile(tmp_path, parked):
    cxx = _fake_cxx(tmp_path)
    first = _spawn(tmp_path, **cxx)
    _, err = first.communicate(timeout=600)  # the precompiled runtime is there; now a program
    assert first.returncode == 0, err
    for entry in tmp_path.glob("linear_bias*"):
        (entry / "ok").unlink()
    # Killed while its program compiles: the compile waits (parked) until it is killed.
    victim = _spawn(tmp_path, CODEGEN_REBUILD="1", **cxx, **parked.env("*linear_bias*.cpp *"))
    (compiler,) = parked.wait_for(1)
    _kill_builder(victim)
    group = os.getpgid(compiler)  # ninja's group for the command: nothing else reaches it
    assert group != os.getpgrp()
    os.killpg(group, signal.SIGKILL)
    assert not wait_until_exited([compiler])
    assert not list(tmp_path.glob("linear_bias*/ok"))
    survivor = _spawn(tmp_path, **cxx)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err
    assert "codegen: built linear_bias" in err and "shape [9, 30]" in out


def test_precompiled_runtime_killed_midway_is_rebuilt(tmp_path, parked):
    """A builder killed while its precompiled runtime compiles leaves that compiler running
    (a session of its own: nothing reaches it). The next builder writes a .gch of its own,
    beside the one the orphan would write, and removes what killed builders left."""
    cxx = _fake_cxx(tmp_path)
    victim = _spawn(tmp_path, **cxx, **parked.env("* c++-header *"))
    (orphan,) = parked.wait_for(1)
    _kill_builder(victim)
    assert _alive(orphan)
    (folder,) = tmp_path.glob("runtime-pch-*")
    assert not (folder / "ok").exists()
    left = folder / "codegen" / "runtime.h.gch.partial-1-0000"  # as a killed builder leaves
    left.write_bytes(b"half a header")
    survivor = _spawn(tmp_path, **cxx)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err
    assert "shape [9, 30]" in out and "without a precompiled runtime" not in err
    assert (folder / "ok").is_file() and (folder / "codegen" / "runtime.h.gch").is_file()
    outputs = [line.split(" -o ")[1].split()[0]
               for line in (tmp_path / "compiles.log").read_text().splitlines()
               if " c++-header " in line]
    assert len(outputs) == 2 and len(set(outputs)) == 2, outputs
    assert all(Path(o).parent == folder / "codegen" and ".partial" in Path(o).name
               for o in outputs), outputs
    assert not list(folder.glob("codegen/*.partial*"))


def test_a_linker_that_fails_falls_back_to_the_default_one(tmp_path, monkeypatch):
    # The H200 image's GCC in /opt/gcc has a libstdc++ linker script gold cannot read.

    from codegen import jit
    from codegen.examples import matmul_rows

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit.compiler, "GOLD", "-fuse-ld=no-such-linker")
    which = shutil.which  # "ld.gold is there"; cpp_extension looks for others
    monkeypatch.setattr(shutil, "which",
                        lambda name, **kw: "/usr/bin/ld.gold" if name == "ld.gold"
                        else which(name, **kw))
    monkeypatch.setattr(jit.compiler, "_gold_failed", threading.Event())
    jit.compiler._toolchain.cache_clear()
    try:
        assert "-fuse-ld=no-such-linker" in jit.compiler.toolchain().ldflags
        import codegen as cg

        op = cg.compile(matmul_rows(slices=3, name="gold_fallback"))
        assert op.library.is_file() and jit.compiler._gold_failed.is_set()
        assert "-fuse-ld=no-such-linker" not in jit.compiler.toolchain().ldflags
    finally:
        jit.compiler._toolchain.cache_clear()


def test_unused_precompiled_runtimes_are_removed_by_the_next_build(tmp_path, monkeypatch):
    import fcntl

    import codegen as cg
    from codegen import jit
    from codegen.examples import matmul_rows
    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    day_ago = time.time() - 2 * jit.precompiled.PCH_UNUSED_S

    def fake_pch(name: str, last_used: float) -> Path:
        folder = tmp_path / f"{jit.precompiled.PCH_PREFIX}{name}"
        (folder / "codegen").mkdir(parents=True)
        (folder / "codegen" / "runtime.h.gch").write_bytes(b"x" * 1000)
        (folder / "ok").write_text("key 1000\n")
        os.utime(folder / "ok", (last_used, last_used))
        return folder

    stale, recent, in_use = (fake_pch("stale", day_ago), fake_pch("recent", time.time()),
                             fake_pch("in_use", day_ago))
    # The file system's clock may lag time.time() by a tick: a second before the build.
    before = time.time() - 1
    with open(in_use / "users.lock", "a") as user:  # a compiler reading it, elsewhere
        fcntl.flock(user, fcntl.LOCK_SH)
        # A program of its own: one loaded earlier in this process would not be built.
        jit.op.build(cg.lower(matmul_rows(slices=3, name="pch_prune_probe")))
    assert not stale.exists()
    assert recent.exists() and in_use.exists()
    (current,) = [f for f in tmp_path.glob(f"{jit.precompiled.PCH_PREFIX}*")
                  if f not in (recent, in_use)]
    assert (current / "ok").is_file() and (current / "ok").stat().st_mtime >= before  # used
    assert jit.precompiled._prune_precompiled(keep=current) == [in_use]  # once nobody uses it
