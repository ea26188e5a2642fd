"""GPU timing primitives of the benchmarks: timed blocks of calls (CUDA events), host time
per call with the GPU kept busy, warm-up, and capturing one call in a CUDA graph.

Imports without a GPU; every function here needs one when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

# torch.cuda._sleep spins for a number of GPU clock cycles; at 2 GHz or less (the H200
# runs 1.4-1.98 GHz) this many cycles last at least a millisecond.
CYCLES_PER_MS = 2_000_000


@dataclasses.dataclass
class Busy:
    """Set by ``gpu_busy`` on exit: ``drained`` is True when the GPU had finished the sleep
    before the timed block ended (the block may then have waited for the GPU)."""

    drained: bool = False


@contextlib.contextmanager
def gpu_busy(ms: float) -> Iterator[Busy]:
    """Queues about ``ms`` of a sleep kernel on the current stream, so that the host calls
    made inside the block are only queued, never waited for; synchronizes on exit."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(ms * CYCLES_PER_MS))
    marker = torch.cuda.Event()
    marker.record()
    state = Busy()
    try:
        yield state
    finally:
        state.drained = marker.query()
        torch.cuda.synchronize()


def host_sample(fn: Callable[[], Any], calls: int = 10, busy_ms: float = 15.0) -> float:
    """Host microseconds per call of ``fn``: the wall time of ``calls`` back-to-back Python
    calls (until the last returns) while a sleep kernel queued ahead keeps the GPU busy, so
    the launches are only queued, never waited for. If the sleep ran out before the calls
    were done, the sample is taken again with a sleep twice as long (twice at most)."""
    sleep = busy_ms
    for _attempt in range(3):
        with gpu_busy(sleep) as busy:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
        if not busy.drained:
            break
        sleep *= 2
    return elapsed / calls * 1e6


def warm_up(fn: Callable[[], Any], seconds: float, batch: int = 10) -> int:
    """Calls ``fn`` in batches of ``batch`` until ``seconds`` of wall time have passed (GPU
    work included); returns the number of calls."""
    calls = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        torch.cuda.synchronize()
        if time.perf_counter() - start >= seconds:
            return calls


class Block:
    """One timed block of a variant, reusable round after round: one untimed lead-in call
    (so the timed calls start in steady state: queued behind it when the GPU bounds the
    time, launched as fast as the host can when the host does), then ``reps`` calls
    between two CUDA events on the current stream. ``ms()`` is the time per call."""

    def __init__(self, fn: Callable[[], Any], reps: int) -> None:
        self.fn = fn
        self.reps = reps
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def run(self) -> None:
        """Queues the block; the caller synchronizes before ``ms()``."""
        self.fn()
        self.start.record()
        for _ in range(self.reps):
            self.fn()
        self.end.record()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end) / self.reps


def estimate_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """A rough time per call (one short block), to choose repetition counts."""
    block = Block(fn, calls)
    torch.cuda.synchronize()
    block.run()
    torch.cuda.synchronize()
    return block.ms()


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Captures one call of ``fn`` (static inputs, its output becomes the static output)
    after three warm-up calls on a side stream, as torch's CUDA-graph docs do, and on
    that same stream: a codegen op whose GEMMs run on the caller's stream (one slice, or
    pool_size=1) then finds that stream's cuBLASLt workspace allocated, as eager calls
    do (none is allocated during capture; README, "Measured on the H200").
    Returns (graph, static output); ``graph.replay()`` reruns the call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak device memory of one call of ``fn`` above what was allocated before it, MiB
    (the result is dropped after the measurement)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20
