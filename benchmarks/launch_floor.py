"""The launch floor: host µs of one cublasLtMatmul launch with everything cached.

``launch_floor.cpp`` loops N times over one ``cublasLtMatmul`` of a small bf16 GEMM whose
descriptors, layouts, algorithm and workspace were made before the loop, and returns host
ns per launch. ``measure()`` runs it with the GPU kept busy (as the benchmarks time the
op's host cost) and reports the median over a few blocks: the ``launch_floor_us`` that
``benchmarks.bench_matmul`` (``results.json``) and ``benchmarks.host_cost``
(``host_cost.json``) measure in the same process as the op. What the generated op adds per
slice is measured against it. It has no command line of its own.

The probe is built with ``torch.utils.cpp_extension.load`` (ninja, cached in
``$CODEGEN_CACHE_DIR/bench_launch_floor``) and links cuBLASLt. On a machine without a GPU
it still builds (the toolkit, arch list and the torch wheel's cuBLAS headers are found
here, as codegen's build does); ``ProbeUnavailable`` says why when it cannot.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import gpu_busy
from codegen.jit import cuda_home

SOURCE = Path(__file__).resolve().with_name("launch_floor.cpp")
NAME = "bench_launch_floor"
CFLAGS = ("-O2", "-DNDEBUG")


class ProbeUnavailable(RuntimeError):
    """The probe cannot be built or run here; the message says what is missing."""


def _wheel_nvidia_dirs() -> list[Path]:
    """The ``nvidia/*`` package folders of torch's CUDA wheels, on sys.path."""
    found: list[Path] = []
    for entry in sys.path:
        nv = Path(entry or ".") / "nvidia"
        if nv.is_dir():
            found += sorted(p for p in nv.iterdir() if p.is_dir())
    return found


def cublaslt_include_dirs(home: str) -> list[str]:
    """Folders to search for cublasLt.h after the toolkit's own include folder (which
    comes first: the wheels' include folders also hold a partial CUDA runtime)."""
    dirs = [str(d / "include") for d in _wheel_nvidia_dirs()
            if (d / "include" / "cublasLt.h").is_file()]
    if not dirs and not (Path(home) / "include" / "cublasLt.h").is_file():
        raise ProbeUnavailable(f"launch floor probe: no cublasLt.h in {home}/include nor in "
                               "the nvidia-* wheels on sys.path")
    return dirs


def cublaslt_library(home: str) -> Path | None:
    """The cuBLASLt shared library to link: the torch wheel's (the one torch loads) first,
    then the toolkit's; None if neither has one."""
    folders = [d / "lib" for d in _wheel_nvidia_dirs()]
    folders += [Path(home) / sub for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for folder in folders:
        libs = sorted(folder.glob("libcublasLt.so*")) if folder.is_dir() else []
        if libs:
            return min(libs, key=lambda p: len(p.name))  # libcublasLt.so before .so.13.1
    return None


@contextlib.contextmanager
def _toolchain(home: str) -> Iterator[Any]:
    """cpp_extension with CUDA_HOME = ``home`` and, without a GPU, an arch list (it wants
    one even for .cpp sources); both restored afterwards. Yields the module."""
    if "torch.utils.cpp_extension" not in sys.modules:
        saved = os.environ.get("CUDA_HOME")
        os.environ["CUDA_HOME"] = saved or home  # read once, at import
        log = logging.getLogger("torch.utils.cpp_extension")
        level = log.level
        log.setLevel(logging.ERROR)  # "no CUDA runtime found" is expected without a GPU
        try:
            importlib.import_module("torch.utils.cpp_extension")
        finally:
            log.setLevel(level)
            if saved is None:
                del os.environ["CUDA_HOME"]
    cpp = importlib.import_module("torch.utils.cpp_extension")
    saved_home, saved_arch = cpp.CUDA_HOME, os.environ.get("TORCH_CUDA_ARCH_LIST")
    cpp.CUDA_HOME = home
    if saved_arch is None and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        yield cpp
    finally:
        cpp.CUDA_HOME = saved_home
        if saved_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def build_dir() -> Path:
    root = os.environ.get("CODEGEN_CACHE_DIR") or str(Path.home() / ".cache" / "codegen")
    return Path(root).expanduser() / NAME


_built: Path | None = None


def _first_error(log: str) -> str:
    """The compiler's first ``error:`` line, else the log's last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.IGNORECASE) and "Error building" not in line:
            return line
    return lines[-1] if lines else "(no output)"


def build(folder: Path | None = None, verbose: bool = False) -> Path:
    """Builds (ninja: only if the source changed) and loads the probe; returns the
    library. Registers ``torch.ops.bench_probe.launch_floor_ns``."""
    global _built
    if _built is not None:
        return _built
    home = cuda_home()
    if home is None:
        raise ProbeUnavailable("launch floor probe: no CUDA toolkit with headers (looked at "
                               "$CUDA_HOME, $CUDA_PATH, /usr/local/cuda, next to nvcc)")
    cflags = [*CFLAGS, *(f"-idirafter{d}" for d in cublaslt_include_dirs(home))]
    lib = cublaslt_library(home)
    # libtorch_cuda already depends on cuBLASLt, so the symbols would resolve anyway;
    # linking names the dependency. The wheel ships only versioned names: -l:FILE.
    ldflags = [f"-L{lib.parent}", f"-l:{lib.name}"] if lib else []
    folder = folder or build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with _toolchain(home) as cpp:
        try:
            cpp.load(name=NAME, sources=[str(SOURCE)], build_directory=str(folder),
                     extra_cflags=cflags, extra_ldflags=ldflags, with_cuda=True,
                     is_python_module=False, verbose=verbose)
        except Exception as e:  # cpp_extension raises RuntimeError with ninja's log
            log = folder / "build.log"
            log.write_text(str(e))
            raise ProbeUnavailable(f"launch floor probe: build failed: {_first_error(str(e))} "
                                   f"(full log: {log})") from None
    _built = folder / f"{NAME}.so"
    return _built


def measure(n: int = 256, iters: int = 1000, blocks: int = 7, busy_ms: float = 40.0,
            warmup_s: float = 0.5) -> dict[str, Any]:
    """Host µs per cached cublasLtMatmul launch of a bf16 n³ GEMM: after ``warmup_s`` of
    launches (on the H200 machine a cold loop took 10 µs a launch, a warm one 6.7 µs),
    the median over ``blocks`` of ``iters`` launches each, the GPU kept busy by a sleep
    queued ahead (a block whose sleep ran out is repeated with a sleep twice as long,
    twice at most)."""
    build()
    probe = torch.ops.bench_probe.launch_floor_ns
    a, b, d = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:  # the GPU keeps up with 256³ GEMMs
        probe(a, b, d, iters)
        torch.cuda.synchronize()
    samples = []
    for _ in range(blocks):
        sleep = busy_ms
        for _attempt in range(3):
            with gpu_busy(sleep) as busy:
                ns = probe(a, b, d, iters)
            if not busy.drained:
                break
            sleep *= 2
        samples.append(ns / 1e3)
    # For comparison only: long loops on an idle GPU ran faster (6.7 vs 10 µs) on the H200
    # machine; the op's launches come in short bursts, as in the blocks above.
    long_loop = []
    for _ in range(3):
        long_loop.append(probe(a, b, d, 5 * iters) / 1e3)
        torch.cuda.synchronize()
    return {"launch_floor_us": statistics.median(samples), "samples_us": samples,
            "long_loop_us": statistics.median(long_loop),
            "gemm": f"bf16 {n}x{n}x{n}", "launches_per_block": iters,
            "method": "C++ loop over one cublasLtMatmul with cached descriptors, algorithm "
                      "and workspace; steady_clock around the loop; after a warm-up of "
                      f"{warmup_s} s of launches; GPU kept busy by a sleep kernel queued "
                      "ahead; median of blocks"}
