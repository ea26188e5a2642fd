"""GPU timing with CUDA events: warm-up, then the median of many repetitions."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 10) -> float:
    """Median milliseconds of one call of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
