"""Host-IR passes over streams: which worker stream each slice runs on
(``assign_streams``) and the order of a contraction split over slices
(``order_accumulation``); the helpers of every pass over stream loops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..frontend.ir import Const, Expr, ParallelType, minimum
from .nodes import (
    Compute,
    Copy,
    CreateEvents,
    Event,
    ForLoop,
    HostProgram,
    Node,
    RecordEvent,
    SetCurrentStream,
    StagingSlot,
    Stream,
    WaitEvent,
    _FreshNames,
)

HostPass = Callable[[HostProgram], HostProgram]


def _map_stream_loops(
    program: HostProgram, fn: Callable[[ForLoop], list[Node]]
) -> HostProgram:
    body: list[Node] = []
    for n in program.body:
        if isinstance(n, ForLoop) and n.parallel is ParallelType.Stream:
            body.extend(fn(n))
        else:
            body.append(n)
    return program.replace(body=body)


def worker_stream(loop: ForLoop, pool: int) -> Stream:
    """The worker stream of an iteration of a stream loop: ``Stream(i % pool)``, or
    ``Stream(i)`` when the loop never has more iterations than the pool. The one rule
    for both ``assign_streams`` and the staging slots (``StagingSlot``)."""
    fits = isinstance(loop.stop, Const) and loop.stop.value <= pool
    return Stream(loop.index, None if fits else pool)


def stream_count(loop: ForLoop, pool: int) -> Expr:
    """How many worker streams (and staging slots) a stream loop uses."""
    return minimum(loop.stop, Const(pool))


def on_caller_stream(loop: ForLoop, pool: int) -> bool:
    """Whether a stream loop runs on one stream only (one slice, or ``pool_size=1``):
    then its iterations stay on the caller's stream, which orders them as a worker
    would, without the events and stream switches of a fork and a join."""
    count = stream_count(loop, pool)
    return pool <= 1 or (isinstance(count, Const) and count.value <= 1)


def assign_streams(program: HostProgram) -> HostProgram:
    """Puts each stream loop's iteration on a worker stream from a bounded pool.

    Before:  for i in range(0, 8) [Stream]:  Matmul(...)
    After:   for i in range(0, 8) [Stream]:  SetCurrentStream(Stream(i % 4)); Matmul(...)
    (``Stream(i)`` when the loop never has more iterations than the pool; a loop that
    would use one stream keeps the caller's, ``on_caller_stream``.)
    Without a copy stream, a loop that copies host slices in right after another stream
    loop takes the lease's second set of workers, ``Stream(4 + i % 4)``, so that its
    copies can run under the loop before it (``run_copies_ahead``).
    """
    pool = program.pool_size
    previous_base: int | None = None  # the set of the last stream loop on workers

    def assign(loop: ForLoop) -> list[Node]:
        nonlocal previous_base
        if on_caller_stream(loop, pool):
            previous_base = None
            return [loop]
        ahead = not program.copy_stream and previous_base == 0 and bool(_copies_in(loop.body))
        worker = dataclasses.replace(worker_stream(loop, pool), base=pool if ahead else 0)
        previous_base = worker.base
        body = [SetCurrentStream(worker), *loop.body]
        return [dataclasses.replace(loop, body=body)]

    return _map_stream_loops(program, assign)


def order_accumulation(program: HostProgram) -> HostProgram:
    """Orders the slices of a contraction split over a stream loop: a GEMM that adds its
    slice's product onto ``out`` (``accumulate=True``) runs after the previous slice's,
    which another worker queued.

    Before:  for i in range(0, 8) [Stream]:
               SetCurrentStream(Stream(i % 4)); ...
               Matmul(T0_i, T1_s, out=T2, accumulate=True)
    After:   T2_sum = CreateEvents(1)
             for i in range(0, 8) [Stream]:
               SetCurrentStream(Stream(i % 4)); ...
               WaitEvent(T2_sum[0])
               Matmul(T0_i, T1_s, out=T2, accumulate=True)
               RecordEvent(T2_sum[0])
    One event per sum: slice i's GEMM waits for the last record, slice i - 1's GEMM (the
    first waits for nothing), and for nothing else its worker queued (the copies of the
    next slices, a copy out) so those keep running under the sum. Where a slice has
    several GEMMs onto one sum (``accumulate_sums``), the first waits and the last
    records. A loop on the caller's stream (``on_caller_stream``) is in order already and
    is left alone."""
    pool = program.pool_size
    fresh = _FreshNames(program)

    def order(loop: ForLoop) -> list[Node]:
        sums = [n for n in loop.body if isinstance(n, Compute) and n.accumulate]
        if not sums or on_caller_stream(loop, pool):
            return [loop]
        events = {out: Event(fresh(f"{out}_sum"), 0)
                  for out in dict.fromkeys(n.out for n in sums)}
        first = {id(next(n for n in sums if n.out == out)) for out in events}
        last = {id(next(n for n in reversed(sums) if n.out == out)) for out in events}
        body: list[Node] = []
        for n in loop.body:
            if isinstance(n, Compute) and id(n) in first:
                body.append(WaitEvent(events[n.out]))
            body.append(n)
            if isinstance(n, Compute) and id(n) in last:
                body.append(RecordEvent(events[n.out]))
        made = [CreateEvents(e.name, Const(1)) for e in events.values()]
        return [*made, dataclasses.replace(loop, body=body)]

    return _map_stream_loops(program, order)


def _copies_in(body: list[Node]) -> list[Node]:
    """The nodes of a stream loop's body that copy host slices into staging slots: each
    ``Copy(T_i, out=T_s)`` with ``T_s = StagingSlot(..., like=T_i)``, and the views that
    define ``T_i`` and ``T_s``, in body order."""
    slots = {n.out: n for n in body if isinstance(n, StagingSlot)}
    copies = [n for n in body
              if isinstance(n, Copy) and n.out in slots and slots[n.out].like == n.src]
    views = {c.src for c in copies} | {c.out for c in copies}
    return [n for n in body if any(n is c for c in copies) or set(n.defines()) & views]
