"""Can SMs reading pinned host memory add to the copy engine's host-to-device bandwidth?

A decode step of an offloaded model is bound by one copy engine (about 55 GB/s on an H100
here) while its SMs mostly idle. Pinned host memory is mapped into the GPU's address
space (unified addressing), so a kernel can load it directly. This probe times, on one
pinned buffer of ``--mib`` MiB:

1. the copy engine alone: the buffer in ``--chunk`` MiB copies, back to back;
2. a Triton kernel alone that copies the buffer with ``G`` programs (persistent, each
   strides over blocks), for several G;
3. both at once: the kernel copies the last fraction ``f`` of the buffer on one stream
   while the copy engine copies the rest on another; the time until both end.

Each configuration is timed with CUDA events, rounds interleaved, median of ``--rounds``.

    python -m benchmarks.probes.host_reads [--mib 1024] [--chunk 32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _pull(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n]; program p copies blocks p, p + programs, ..."""
    pid = tl.program_id(0)
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)  # n < 2^31 (pull)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


BLOCK = 4096  # int32 elements: 16 KiB a block


def pull(src: torch.Tensor, dst: torch.Tensor, programs: int) -> None:
    """``dst.copy_(src)`` by ``programs`` programs of ``_pull`` (int32 views)."""
    assert src.numel() < 2**31 - BLOCK, "int32 offsets"
    _pull[(programs,)](src, dst, src.numel(), BLOCK=BLOCK, num_warps=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    dev = torch.device("cuda")
    n = args.mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    src.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32))
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    ce_stream, sm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    chunk = args.chunk << 20
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def ce(lo: int, hi: int) -> None:
        with torch.cuda.stream(ce_stream):
            for a in range(lo, hi, chunk):
                b = min(hi, a + chunk)
                dst[a:b].copy_(src[a:b], non_blocking=True)

    def sm(lo: int, hi: int, programs: int) -> None:
        if hi > lo:
            with torch.cuda.stream(sm_stream):
                pull(src[lo:hi].view(torch.int32), dst[lo:hi].view(torch.int32), programs)

    def timed(fn) -> float:  # noqa: ANN001
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cur = torch.cuda.current_stream()
        start.record(cur)
        ce_stream.wait_stream(cur)
        sm_stream.wait_stream(cur)
        fn()
        cur.wait_stream(ce_stream)
        cur.wait_stream(sm_stream)
        end.record(cur)
        end.synchronize()
        return start.elapsed_time(end)

    configs: dict[str, object] = {"copy engine alone": lambda: ce(0, n)}
    for g in (8, 16, 32, 64, sms, 2 * sms):
        configs[f"kernel alone, {g} programs"] = lambda g=g: sm(0, n, g)
    for g in (16, 32, 64):
        for f in (0.05, 0.1, 0.15, 0.2, 0.3):
            split = int(n * (1 - f)) // 4096 * 4096
            configs[f"both, kernel {f:.2f} on {g} programs"] = (
                lambda s=split, g=g: (ce(0, s), sm(s, n, g)))
    # warm-up (compiles the kernel), then a check of the bytes
    for fn in configs.values():
        timed(fn)
    torch.cuda.synchronize()
    dst.zero_()
    sm(0, n, 64)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src), "the kernel's copy differs from the source"
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for k, fn in configs.items():
            times[k].append(timed(fn))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{args.mib} MiB pinned -> GPU, copy-engine chunks {args.chunk} MiB, median of "
          f"{args.rounds} rounds")
    base = statistics.median(times["copy engine alone"])
    for k, ts in times.items():
        ms = statistics.median(ts)
        print(f"{k:>40}  {ms:8.3f} ms  {n / ms / 1e6:6.1f} GB/s  {base / ms:5.3f}x the copy "
              f"engine's rate  (min {min(ts):.3f}, max {max(ts):.3f})")


if __name__ == "__main__":
    main()
