"""Does the kind of pinned memory set the copy bandwidth of the offloaded weights?

``codegen.nn.offload`` keeps the weights in one exact-size arena: ordinary host memory
(``torch.empty``) registered with ``cudaHostRegister``. The copy floor of the benchmarks
copies from ``pin_memory()`` tensors (PyTorch's caching host allocator, ``cudaHostAlloc``).
This probe copies the same 14.7 MB slices (a Llama gate weight's eighth) back to back,
1 GiB in all, from each kind of memory, on one stream, and prints GB/s (best of three):
the arena as offload makes it, the same memory advised to use transparent huge pages
before registering, and a ``pin_memory()`` tensor.

    python -m benchmarks.probes.arena_bandwidth
"""

from __future__ import annotations

import mmap

import torch

SLICE = 14336 // 8 * 4096 * 2  # bytes
COUNT = 1024 * 2**20 // SLICE


def gbps(src: torch.Tensor, dst: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(COUNT):
            dst[k % 4].copy_(src[k * SLICE:(k + 1) * SLICE], non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return COUNT * SLICE / (best * 1e6)


def registered(storage: torch.Tensor) -> torch.Tensor:
    status = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.numel(), 0)
    assert int(status) == 0, status
    return storage


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("arena_bandwidth needs a CUDA GPU")
    n = COUNT * SLICE
    dst = torch.empty(4, SLICE, dtype=torch.uint8, device="cuda")
    arena = registered(torch.ones(n, dtype=torch.uint8))
    region = mmap.mmap(-1, n)
    region.madvise(mmap.MADV_HUGEPAGE)
    huge = registered(torch.frombuffer(region, dtype=torch.uint8).fill_(1))
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    for name, src in (("arena (torch.empty + cudaHostRegister)", arena),
                      ("huge pages (mmap + MADV_HUGEPAGE + cudaHostRegister)", huge),
                      ("pin_memory() (cudaHostAlloc)", pinned),
                      ("arena again", arena)):
        print(f"{name}: {gbps(src, dst):.1f} GB/s")


if __name__ == "__main__":
    main()
