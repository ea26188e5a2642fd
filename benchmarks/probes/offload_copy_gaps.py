"""Where does the copy engine wait in a forward of the offloaded 4-layer Llama?

Traces three forwards back to back (512 tokens, S = 8, with and without prefetch) with the
profiler and takes the host-to-device copies in start order: their total time, the
copy-engine time between the first and the last, the idle gaps between consecutive
copies (total, count over 20 µs) and the largest ones with the copies around them
(their sizes in MB), so the time beyond the copy floor can be assigned to copies waiting.

    python -m benchmarks.probes.offload_copy_gaps
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.probes.offload_host_cost import llama


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("offload_copy_gaps needs a CUDA GPU")
    ids = torch.randint(0, 32000, (1, 512), device="cuda")
    for prefetch in (True, False):
        model = llama(prefetch)
        with torch.no_grad():
            for _ in range(2):
                model(ids)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(ids)
                torch.cuda.synchronize()
        copies = sorted((e for e in prof.events() if "HtoD" in e.name),
                        key=lambda e: e.time_range.start)
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                          and "Memcpy" not in e.name), key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in copies)
        span = copies[-1].time_range.end - copies[0].time_range.start
        gaps = []
        for a, b in zip(copies, copies[1:]):
            gap = b.time_range.start - max(a.time_range.end, 0)
            if gap > 0:
                gaps.append((gap, a, b))
        print(f"prefetch={prefetch}: {len(copies)} copies, busy {busy / 1e3:.2f} ms over a "
              f"span of {span / 1e3:.2f} ms; gaps {sum(g for g, _, _ in gaps) / 1e3:.2f} ms "
              f"in total, {sum(g > 20 for g, _, _ in gaps)} over 20 µs")
        for gap, a, b in sorted(gaps, key=lambda g: -g[0])[:12]:
            between = [k.name[:40] for k in kernels
                       if a.time_range.end <= k.time_range.start < b.time_range.start][:4]
            print(f"  {gap:7.0f} µs after a copy of {a.time_range.elapsed_us():.0f} µs, "
                  f"before one of {b.time_range.elapsed_us():.0f} µs; kernels starting "
                  f"then: {between}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
