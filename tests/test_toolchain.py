"""Where builds find what they need: a CUDA toolkit, or the wheels torch brings where their
headers suffice (no toolkit); and where nothing suffices, one message naming what is
missing, which the tests skip by and the demo falls back to the evaluator by."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import codegen as cg
from codegen import jit
from codegen.backend.renderer import include_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_toolchain(monkeypatch):
    """The toolchain recomputed for one test's environment, and again after it."""
    jit.compiler._toolchain.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    jit.compiler._toolchain.cache_clear()


def _fake_wheels(site: Path, headers, cudart: str | None = "libcudart.so.13") -> Path:
    """A site folder holding an nvidia-* wheel with ``headers`` (empty files), and its
    CUDA runtime library."""
    wheel = site / "nvidia" / "cu99"
    for h in headers:
        (wheel / "include" / h).parent.mkdir(parents=True, exist_ok=True)
        (wheel / "include" / h).write_text("")
    if cudart:
        (wheel / "lib").mkdir(parents=True)
        (wheel / "lib" / cudart).write_text("")
    return wheel


def test_the_cuda_headers_checked_are_those_the_runtime_includes():
    included = set()
    for header in include_dir().rglob("*.h"):
        included |= set(re.findall(r"#include <((?:cuda|cublas|nvtx|nvrtc|cufft|nccl)\S*)>",
                                   header.read_text()))
    assert included and included <= set(jit.compiler.CUDA_HEADERS), included


def test_cuda_home_set_to_a_folder_without_a_toolkit_means_none(fresh_toolchain, tmp_path):
    fresh_toolchain.setenv("CUDA_HOME", str(tmp_path / "nonexistent"))
    assert jit.compiler.cuda_home() is None
    fresh_toolchain.setenv("CUDA_HOME", str(tmp_path))  # a folder, but no toolkit in it
    assert jit.compiler.cuda_home() is None


@pytest.mark.build
def test_without_a_toolkit_the_wheels_headers_and_runtime_are_used(fresh_toolchain,
                                                                     tmp_path):
    fresh_toolchain.setenv("CUDA_HOME", str(tmp_path / "nonexistent"))
    wheel = _fake_wheels(tmp_path / "site", jit.compiler.CUDA_HEADERS)
    fresh_toolchain.setattr(jit.compiler, "_wheel_cuda_folders", lambda: [wheel / "include"])
    fresh_toolchain.setattr(jit.compiler, "_wheel_cudart",
                            lambda: wheel / "lib" / "libcudart.so.13")
    tools = jit.compiler.toolchain()
    cuda = [f for f in tools.cflags if "cu99" in f or "/cuda" in f]
    assert cuda == [f"-isystem{wheel / 'include'}"]  # first on the path: no toolkit before
    assert tools.ldflags[-4:-1] == (f"-L{wheel / 'lib'}", "-l:libcudart.so.13",
                                    f"-Wl,-rpath,{wheel / 'lib'}")
    assert jit.compiler.toolchain_problem() is None


@pytest.mark.build
def test_a_toolkit_comes_first_and_the_wheels_after_it(fresh_toolchain, tmp_path):
    toolkit = tmp_path / "cuda"
    for h in ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target"):
        (toolkit / "include" / h).parent.mkdir(parents=True, exist_ok=True)
        (toolkit / "include" / h).write_text("")
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libcudart.so").write_text("")
    wheel = _fake_wheels(tmp_path / "site", jit.compiler.CUDA_HEADERS)
    fresh_toolchain.setenv("CUDA_HOME", str(toolkit))
    fresh_toolchain.setattr(jit.compiler, "_wheel_cuda_folders", lambda: [wheel / "include"])
    tools = jit.compiler.toolchain()
    # the wheel's partial runtime after the toolkit's: -idirafter, for cuBLAS and NVTX only
    cuda = [f for f in tools.cflags if str(tmp_path) in f]
    assert cuda == [f"-isystem{toolkit / 'include'}", f"-idirafter{wheel / 'include'}"]
    assert f"-L{toolkit / 'lib64'}" in tools.ldflags and "-lcudart" in tools.ldflags


@pytest.mark.build
def test_what_is_missing_is_named_with_where_it_was_looked_for(fresh_toolchain, tmp_path):
    fresh_toolchain.setenv("CUDA_HOME", str(tmp_path / "nonexistent"))
    have = [h for h in jit.compiler.CUDA_HEADERS if h != "nv/target"]
    wheel = _fake_wheels(tmp_path / "site", have)
    fresh_toolchain.setattr(jit.compiler, "_wheel_cuda_folders", lambda: [wheel / "include"])
    fresh_toolchain.setattr(jit.compiler, "_wheel_cudart",
                            lambda: wheel / "lib" / "libcudart.so.13")
    fresh_toolchain.setattr(torch.version, "cuda", "13.0")
    problem = jit.compiler.toolchain_problem()
    assert problem == (
        f"codegen: cannot build C++ here: no nv/target (looked in: no toolkit (CUDA_HOME="
        f"{tmp_path / 'nonexistent'} has none); {wheel / 'include'}); install the CUDA toolkit "
        "13.0 and set CUDA_HOME to it, or pip install 'nvidia-cuda-cccl==13.*'")
    with pytest.raises(cg.BuildError) as e:
        jit.extension.build_library("missing_probe", "int f() { return 0; }\n")
    assert str(e.value) == problem


def test_a_missing_compiler_and_a_torch_without_cuda_are_named(fresh_toolchain, tmp_path):
    fresh_toolchain.setenv("CXX", str(tmp_path / "no-such-c++"))
    fresh_toolchain.setattr(torch.version, "cuda", None)
    problem = jit.compiler.toolchain_problem()
    assert problem.startswith("codegen: cannot build C++ here: no C++ compiler: "
                              f"'{tmp_path / 'no-such-c++'}' is not on PATH (install g++, "
                              "or set CXX to a C++20 compiler); torch ")
    assert "is built without CUDA (the programs link libtorch_cuda); install a CUDA build " \
        "of torch" in problem


def test_build_tests_are_skipped_saying_what_is_missing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CXX": str(tmp_path / "no-such-c++"),
           "CODEGEN_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                          "no:cacheprovider", "tests/test_toolchain.py", "-k",
                          "builds_from_the_wheels or the_cuda_headers_checked"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout, run.stdout
    assert re.search(r"SKIPPED \[1\] tests/test_toolchain.py:\d+: builds C\+\+: codegen: "
                     r"cannot build C\+\+ here: no C\+\+ compiler: "
                     + re.escape(f"'{tmp_path / 'no-such-c++'}' is not on PATH"), run.stdout), \
        run.stdout


def test_the_demo_falls_back_to_the_evaluator(monkeypatch, capsys):
    from codegen.tools import demo

    why = "codegen: cannot build C++ here: no nv/target (looked in: ...)"
    monkeypatch.setattr(demo, "toolchain_problem", lambda: why)
    monkeypatch.setattr(demo, "compile", lambda *a, **k: pytest.fail("built"))
    assert demo.run_demo(size=64, slices=2) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"not building the C++ ops: {why}\nthe evaluator's checks run all "
                          "the same\n")
    assert "evaluator on CPU, stream_matmul_n: matches torch; every access stream-ordered" in out
    assert "evaluator on CPU, demo_gpt_mlp: relative error" in out
    assert out.endswith("no ops built: running and timing them needs them built (above: why "
                        "not)\n")


@pytest.mark.build
def test_a_program_builds_from_the_wheels_without_a_toolkit(fresh_toolchain, tmp_path):
    """torch's nvidia-* wheels and Triton's headers, and nv/target where the CUDA
    compute libraries' wheel (nvidia-cuda-cccl) would put it: no toolkit on any path."""
    wheels = jit.compiler._wheel_cuda_folders()
    target = next((Path(h) / "include" / "nv" for h in (jit.compiler.cuda_home(),) if h), None)
    if not wheels or target is None or not target.is_dir():
        pytest.skip("needs torch's CUDA wheels, and nv/ of a toolkit to stand for the "
                    "nvidia-cuda-cccl wheel")
    cccl = tmp_path / "site" / "nvidia" / "cccl" / "include"
    cccl.mkdir(parents=True)
    (cccl / "nv").symlink_to(target)
    fresh_toolchain.setenv("CUDA_HOME", str(tmp_path / "nonexistent"))
    fresh_toolchain.setattr(jit.compiler, "_wheel_cuda_folders", lambda: [*wheels, cccl])
    fresh_toolchain.setenv("CODEGEN_CACHE_DIR", str(tmp_path / "cache"))
    tools = jit.compiler.toolchain()
    assert not any("/usr/local/cuda" in f for f in (*tools.cflags, *tools.ldflags)), tools
    assert jit.compiler.toolchain_problem() is None
    library = jit.extension.build_library("wheels_probe", '#include "codegen/runtime.h"\n'
                                    'int wheels_probe() { return 1; }\n')
    assert library.is_file() and str(library) in torch.ops.loaded_libraries
