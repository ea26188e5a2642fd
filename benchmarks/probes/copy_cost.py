"""What does one host-to-device copy cost the copy engine beyond its bytes?

Copies ``--mib`` MiB from pinned memory to the GPU in copies of each size, back to back on
one stream (CUDA events, sizes interleaved in rounds, median of ``--rounds``), and fits
``time = copies * c + bytes / bandwidth`` by least squares over the copies of at least
``--fit-from`` KiB (smaller ones cost more than that line: the engine does not reach its
bandwidth on them): ``c`` is the fixed cost of a copy on the copy engine, the bandwidth
that of its bytes. Then, for a weight of
``--weight-mib`` MiB cut into S slices (one copy each), what S copies cost beyond one:
``(S - 1) * c`` against the weight's copy time, the share by which a pipeline bound by its
copies exceeds the copy floor from the copies' count alone.

    python -m benchmarks.probes.copy_cost [--mib 512] [--rounds 7] [--weight-mib 128]
                                          [--fit-from 1024]
"""

from __future__ import annotations

import argparse
import statistics

import torch

SIZES_KIB = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def fit(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(fixed ms a copy, bytes a ms) of ``time = n * c + bytes / bw`` for points (n copies,
    bytes, ms) of the same total bytes: a line in n."""
    ns = [float(n) for n, _, _ in points]
    ts = [t for _, _, t in points]
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
    c = (sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts))
         / sum((n - mean_n) ** 2 for n in ns))
    base = mean_t - c * mean_n  # the bytes' time
    return c, points[0][1] / base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--weight-mib", type=int, default=128)
    p.add_argument("--fit-from", type=int, default=1024, metavar="KiB")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_cost needs a CUDA GPU")
    total = args.mib << 20
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def copies(size: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for a in range(0, total, size):
                dst[a:a + size].copy_(src[a:a + size], non_blocking=True)
            end.record()
        end.synchronize()
        return start.elapsed_time(end)

    sizes = [k << 10 for k in SIZES_KIB if (k << 10) <= total]
    for size in sizes:  # warm-up
        copies(size)
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for size in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            times[size].append(copies(size))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {args.mib} MiB pinned -> "
          f"GPU in copies of each size, back to back on one stream, median of {args.rounds}")
    points = []
    for size in sizes:
        ms = statistics.median(times[size])
        n = total // size
        if size >= args.fit_from << 10:
            points.append((n, total, ms))
        print(f"  {size >> 10:>7} KiB x {n:>5}: {ms:8.3f} ms  {total / ms / 1e6:6.1f} GB/s  "
              f"{ms / n * 1e3:9.2f} µs a copy")
    c, bw = fit(points)
    print(f"fit over copies of {args.fit_from} KiB and more: {c * 1e3:.2f} µs a copy on the "
          f"copy engine + the bytes at {bw / 1e6:.1f} GB/s")
    weight = args.weight_mib << 20
    alone = weight / bw
    for s in (1, 2, 4, 8, 16, 32):
        extra = (s - 1) * c
        print(f"  a {args.weight_mib} MiB weight in {s:>2} copies: {alone + extra:.3f} ms, "
              f"{(alone + extra) / alone:.3f}x its copy in one")


if __name__ == "__main__":
    main()
