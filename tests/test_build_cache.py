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


def test_build_killed_midway_is_repaired_by_the_next_compile(tmp_path):
    victim = _spawn(tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/*.ninja")) and time.monotonic() < deadline:
        time.sleep(0.1)  # wait until ninja runs the compiler
    time.sleep(1.0)
    os.killpg(victim.pid, signal.SIGKILL)  # the interpreter, ninja and the compiler
    victim.wait()
    assert not list(tmp_path.glob("*/ok")), "the victim finished before it was killed"
    survivor = _spawn(tmp_path)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err
    assert "codegen: built" in err and "shape [9, 30]" in out
