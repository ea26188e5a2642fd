"""The build cache under concurrency and faults (CPU; CI)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_two_processes_compiling_at_once_share_one_build(tmp_path):
    procs = [_spawn(tmp_path), _spawn(tmp_path)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "shape [9, 30]" in out
    built = sum(err.count("codegen: built") for _, err in results)
    assert built == 1, [err for _, err in results]
    assert len(list(tmp_path.glob("*/*.so"))) == 1


def _kill_when(victim: subprocess.Popen, ready, delay: float) -> None:
    deadline = time.monotonic() + 120
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    os.killpg(victim.pid, signal.SIGKILL)  # the interpreter and the compiler
    victim.wait()


def test_build_killed_midway_is_repaired_by_the_next_compile(tmp_path):
    first = _spawn(tmp_path)
    first.communicate(timeout=600)  # the precompiled runtime is there; now kill a program
    for entry in tmp_path.glob("linear_bias*"):
        (entry / "ok").unlink()
    victim = _spawn(tmp_path, CODEGEN_REBUILD="1")
    _kill_when(victim, lambda: list(tmp_path.glob("linear_bias*/*.so.partial")) or
               list(tmp_path.glob("linear_bias*/*.cpp")), delay=0.3)
    assert not list(tmp_path.glob("linear_bias*/ok")), "the victim finished before it was killed"
    survivor = _spawn(tmp_path)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err
    assert "codegen: built" in err and "shape [9, 30]" in out


def test_precompiled_runtime_killed_midway_is_rebuilt(tmp_path):
    victim = _spawn(tmp_path)
    _kill_when(victim, lambda: list(tmp_path.glob("runtime-pch-*/codegen/runtime.h")), 1.0)
    assert not list(tmp_path.glob("runtime-pch-*/ok")), "the victim finished first"
    survivor = _spawn(tmp_path)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err
    assert "shape [9, 30]" in out and "without a precompiled runtime" not in err
    assert list(tmp_path.glob("runtime-pch-*/ok"))
    assert list(tmp_path.glob("runtime-pch-*/codegen/*.gch"))


def test_a_linker_that_fails_falls_back_to_the_default_one(tmp_path, monkeypatch):
    # The H200 image's GCC in /opt/gcc has a libstdc++ linker script gold cannot read.
    import importlib

    from codegen.examples import matmul_rows

    build = importlib.import_module("codegen.build")  # cg.build is the function

    monkeypatch.setenv("CODEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "GOLD", "-fuse-ld=no-such-linker")
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(build, "_gold_failed", build.threading.Event())
    build._toolchain.cache_clear()
    try:
        assert "-fuse-ld=no-such-linker" in build.toolchain().ldflags
        import codegen as cg

        op = cg.compile(matmul_rows(slices=3, name="gold_fallback"))
        assert op.library.is_file() and build._gold_failed.is_set()
        assert "-fuse-ld=no-such-linker" not in build.toolchain().ldflags
    finally:
        build._toolchain.cache_clear()
