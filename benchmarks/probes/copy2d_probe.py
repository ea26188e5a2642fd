"""Host-to-device bandwidth of 2-D copies (column blocks of a row-major pinned matrix)
by row width, on one stream and spread over four, beside 1-D copies of the same bytes.

    python -m benchmarks.probes.copy2d_probe

Why: stream_weights copies each slice of w [k, n] (columns n/S) with one
cudaMemcpy2DAsync, rows n/S * 2 bytes wide; benchmarks.bench_copy found those copies slower
than 1-D copies of the same bytes once rows are 4 KiB or narrower. This says whether the
row width or the concurrency is to blame. Prints GB/s (best of 5 blocks); about 10 s.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import os
import sys

import torch

K, N = 8192, 8192  # bf16 w: 128 MiB, rows 16 KiB


@functools.cache
def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its wheel's, else the system's)."""
    roots = [os.path.dirname(torch.__file__), *sys.path]
    for pattern in ("lib/libcudart.so*", "nvidia/*/lib/libcudart.so*",
                    "nvidia/cuda_runtime/lib/libcudart.so*"):
        for root in roots:
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return ctypes.CDLL(found[0])
    return ctypes.CDLL("libcudart.so")


def memcpy2d(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """One cudaMemcpy2DAsync of a [rows, cols] view with unit column stride."""
    item = src.element_size()
    status = cudart().cudaMemcpy2DAsync(
        ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(dst.stride(0) * item),
        ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(src.stride(0) * item),
        ctypes.c_size_t(src.shape[1] * item), ctypes.c_size_t(src.shape[0]),
        ctypes.c_int(1), ctypes.c_void_p(stream.cuda_stream))  # 1: host to device
    if status != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with error {status}")


def copies_gbps(streams: int, slices: int, two_d: bool) -> float:
    """GB/s of copying all of w in ``slices`` column blocks (2-D) or contiguous blocks
    (1-D, as [rows, all columns] blocks), slice i on stream i % ``streams``."""
    host = torch.randn(K, N, dtype=torch.bfloat16).pin_memory()
    width = N // slices
    blocks = ([host[:, i * width:(i + 1) * width] for i in range(slices)] if two_d
              else list(host.chunk(slices)))
    dst = [torch.empty(b.shape, dtype=b.dtype, device="cuda") for b in blocks]
    pool = [torch.cuda.Stream() for _ in range(streams)]
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in pool:
            s.wait_event(start)
        for i, (d, b) in enumerate(zip(dst, blocks)):
            memcpy2d(d, b, pool[i % streams])
        for s in pool:
            torch.cuda.current_stream().wait_stream(s)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return host.numel() * host.element_size() / best / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.copy2d_probe",
                                     description=__doc__.splitlines()[0])
    parser.parse_args()
    if not torch.cuda.is_available():
        print("copy2d_probe: needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"{'S':>3} {'row bytes':>9} {'2-D, 1 stream':>14} {'2-D, 4 streams':>15} "
          f"{'dense, 4 streams':>16}   (GB/s; dense: row blocks, width = pitch)")
    for slices in (1, 2, 4, 8, 16):
        print(f"{slices:>3} {N // slices * 2:>9} {copies_gbps(1, slices, True):14.1f} "
              f"{copies_gbps(4, slices, True):15.1f} {copies_gbps(4, slices, False):16.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
