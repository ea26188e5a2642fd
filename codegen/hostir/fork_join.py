"""The program's streams against the caller's: loops whose copies run ahead under the
loop before them (``run_copies_ahead``), and the fork and join around the loops
(``insert_fork_join``)."""

from __future__ import annotations

import dataclasses

from ..frontend.ir import Const, ParallelType
from .nodes import (
    MAIN_STREAM,
    Allocate,
    CopyStream,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Node,
    RingStream,
    SetCurrentStream,
    StagingSlot,
    Stream,
    Synchronize,
)
from .staging import _copy_stream_loops
from .streams import _copies_in, _map_stream_loops, on_caller_stream, stream_count


def _loop_worker(loop: ForLoop) -> Stream | None:
    first = loop.body[0] if loop.body else None
    if isinstance(first, SetCurrentStream) and isinstance(first.stream, Stream):
        return first.stream
    return None


def _runs_ahead(n: Node) -> bool:
    """A stream loop on the lease's second set of workers (``assign_streams``)."""
    worker = _loop_worker(n) if isinstance(n, ForLoop) else None
    return worker is not None and worker.base > 0


def run_copies_ahead(program: HostProgram) -> HostProgram:
    """Lets a loop on the second set of workers copy its host slices in while the loop
    before it still runs: its copies go first in each iteration, and only then does the
    worker wait for the caller's stream (which has joined the loop before); its staging
    is allocated before the loop before, and its fork comes before that loop's fork
    (``insert_fork_join``), so nothing orders its first copies after the loop before.

    Before:  for i ... [Stream]: (loop 1)
             ...; T3_stage = Allocate(...)
             for i ... [Stream]: SetCurrentStream(Stream(4 + i % 4))
               T3_i = ShardByStream(...); T3_s = StagingSlot(...); Copy(T3_i, out=T3_s)
               Linear(T2, T3_s, out=T4_i)
    After:   T3_stage = Allocate(...); for i ... [Stream]: (loop 1)
             ...
             for i ... [Stream]: SetCurrentStream(Stream(4 + i % 4))
               T3_i = ...; T3_s = ...; Copy(T3_i, out=T3_s)
               Synchronize(main_stream)
               Linear(T2, T3_s, out=T4_i)
    Waiting for the caller's stream in every iteration (not once per worker) costs an
    event wait per slice and keeps the loop body free of conditions; the runtime
    records the caller's event once.
    """
    if not any(_runs_ahead(n) for n in program.body):
        return program
    body: list[Node] = []
    hoist: dict[int, list[Node]] = {}  # position of a loop -> allocations to put before it
    last_loop: int | None = None
    for n in program.body:
        if isinstance(n, ForLoop) and n.parallel is ParallelType.Stream:
            if _runs_ahead(n) and last_loop is not None:
                own = {sl.stage for sl in n.body if isinstance(sl, StagingSlot)}
                moved = [a for a in body[last_loop + 1:]
                         if isinstance(a, Allocate) and a.out.name in own]
                body = [a for a in body if not any(a is m for m in moved)]
                hoist.setdefault(last_loop, []).extend(moved)
                copies = _copies_in(n.body)
                rest = [c for c in n.body[1:] if not any(c is m for m in copies)]
                n = dataclasses.replace(n, body=[n.body[0], *copies,
                                                 Synchronize(MAIN_STREAM), *rest])
            last_loop = len(body)
        body.append(n)
    out: list[Node] = [GetCurrentStream(MAIN_STREAM)]  # the stream the loop waits for
    for k, n in enumerate(body):
        out += hoist.get(k, [])
        out.append(n)
    return program.replace(body=out)


def insert_fork_join(program: HostProgram) -> HostProgram:
    """Orders the worker streams against the caller's stream, outside the compute loop.

    Before:  for i in range(0, S) [Stream]: ...
    After:   main_stream = GetCurrentStream()
             for j in range(0, min(S, pool)): SetCurrentStream(Stream(j)); Synchronize(main_stream)
             for i in range(0, S) [Stream]: ...
             SetCurrentStream(main_stream)
             for j in range(0, min(S, pool)): Synchronize(Stream(j))
    Synchronizing inside the compute loop would serialize the slices; here each worker
    waits once for the caller's prior work (fork) and the caller waits once for each
    worker (join), so the caller can consume the outputs on its own stream. A loop on
    the caller's stream (``on_caller_stream``) needs neither. The copy stream
    (``queue_copies_in``) is forked with the first loop that queues copies on it and
    joined with the last (``hoist_staging``), so it runs ahead across loops. The ring
    stream (``stage_in_ring``) is joined the same way but never forked: its copies read
    only host inputs (complete when the op is called), into ring bytes whose last readers
    it waits for by event.
    """
    pool = program.pool_size
    used = False
    copy_loops = [program.body[k] for k in _copy_stream_loops(program)]
    loops = [n for n in program.body if isinstance(n, ForLoop)
             and n.parallel is ParallelType.Stream and not on_caller_stream(n, pool)]

    def workers(loop: ForLoop) -> Stream:
        worker = _loop_worker(loop)
        return Stream("j", None, worker.base if worker else 0)

    def fork(loop: ForLoop) -> list[Node]:
        return [ForLoop("j", Const(0), stream_count(loop, pool),
                        [SetCurrentStream(workers(loop)), Synchronize(MAIN_STREAM)])]

    def fork_join(loop: ForLoop) -> list[Node]:
        nonlocal used
        if on_caller_stream(loop, pool):
            return [loop]
        used = True
        n_streams = stream_count(loop, pool)
        forks: list[Node] = [] if _runs_ahead(loop) else fork(loop)
        after = loops[loops.index(loop) + 1] if loop is not loops[-1] else None
        if after is not None and _runs_ahead(after):
            forks = fork(after) + forks  # before this loop: its copies run under this one
        join: list[Node] = [ForLoop("j", Const(0), n_streams, [Synchronize(workers(loop))])]
        if copy_loops and loop is copy_loops[0] and program.staging != "ring":
            forks += [SetCurrentStream(CopyStream(pool)), Synchronize(MAIN_STREAM)]
        if copy_loops and loop is copy_loops[-1]:
            join.append(Synchronize(RingStream() if program.staging == "ring"
                                    else CopyStream(pool)))
        return [*forks, loop, SetCurrentStream(MAIN_STREAM), *join]

    out = _map_stream_loops(program, fork_join)
    if used and not any(isinstance(n, GetCurrentStream) for n in out.body):
        out = out.replace(body=[GetCurrentStream(MAIN_STREAM), *out.body])
    return out
