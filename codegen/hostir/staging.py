"""Host-resident operands: staging slots for host slices and results
(``stage_host_tensors``, ``synchronize_host_outputs``), the copy stream
(``queue_copies_in``, ``hoist_staging``) and the staging ring (``stage_in_ring``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import InternalError
from ..frontend.ir import Const, ParallelType
from .nodes import (
    MAIN_STREAM,
    Allocate,
    Copy,
    CopyStream,
    CreateEvents,
    Deallocate,
    Event,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Node,
    RecordEvent,
    ReleaseRingSlot,
    RingSlot,
    RingStream,
    SetCurrentStream,
    ShardByStream,
    StagingSlot,
    Stream,
    StreamRef,
    StreamSynchronize,
    Synchronize,
    TensorInfo,
    WaitEvent,
    _FreshNames,
)
from .streams import _copies_in, _map_stream_loops, on_caller_stream, stream_count, worker_stream

# ---------------------------------------------------------------------------- host-resident


def _renamed(node: Node, mapping: Mapping[str, str]) -> Node:
    """``node`` (a new one if anything changed) with tensor names replaced by ``mapping``."""
    if isinstance(node, ForLoop):
        return dataclasses.replace(node, body=[_renamed(n, mapping) for n in node.body])
    if isinstance(node, Allocate):
        new = mapping.get(node.out.name)
        return dataclasses.replace(node, out=dataclasses.replace(node.out, name=new)) \
            if new else node
    return node.renamed(mapping)


def _uses(node: Node, name: str) -> bool:
    return name in node.uses() or any(_uses(c, name) for c in node.children())


def _is_stream_loop(n: Node) -> bool:
    return isinstance(n, ForLoop) and n.parallel is ParallelType.Stream


def _sliced_only(body: list[Node], name: str, written: bool) -> bool:
    """Every use of ``name`` is a ShardByStream in a stream loop; with ``written``, each
    such view is also written in its loop (it is an op output computed slice by slice)."""
    for top in body:
        if not _uses(top, name):
            continue
        if not _is_stream_loop(top):
            return False
        assert isinstance(top, ForLoop)
        for n in top.body:
            if isinstance(n, ShardByStream) and n.tensor == name:
                if written and not any(n.out in m.writes() for m in top.body):
                    return False
            elif _uses(n, name):
                return False
    return True


def _stage_loop(loop: ForLoop, info: TensorInfo, read: bool, pool: int, fresh: _FreshNames,
                ) -> tuple[list[Node], ForLoop, list[Node]]:
    """Stages the slices of host tensor ``info`` in one stream loop: returns the staging
    allocations (before the loop), the new loop, and the deallocations (after it).

    Before:  T1_i = ShardByStream(T1, ...); Matmul(T0, T1_i, out=T2_i)
    After:   T1_i = ShardByStream(T1, ...); T1_s = StagingSlot(T1_stage, slot=i % 4,
             like=T1_i); Copy(T1_i, out=T1_s); Matmul(T0, T1_s, out=T2_i)
    A ``read`` (input) slice is copied in right after its view; an output slice is
    computed into its slot and copied out right after the node that writes it.
    """
    allocs: list[Node] = []
    body: list[Node] = []
    mapping: dict[str, str] = {}  # host view -> its slot, in the nodes after the view
    copy_out: dict[str, str] = {}  # slot -> host view
    stream = worker_stream(loop, pool)
    for n in loop.body:
        n = _renamed(n, mapping)
        body.append(n)
        if isinstance(n, ShardByStream) and n.tensor == info.name:
            stage = fresh(f"{info.name}_stage")
            chunk_shape = tuple(n.chunk if a == n.axis else e for a, e in enumerate(info.shape))
            allocs.append(Allocate(TensorInfo(stage, info.dtype,
                                              (stream_count(loop, pool), *chunk_shape))))
            slot = fresh(f"{info.name}_s")
            body.append(StagingSlot(slot, stage, stream, like=n.out))
            mapping[n.out] = slot
            if read:
                body.append(Copy(n.out, out=slot))
            else:
                copy_out[slot] = n.out
        for w in n.writes():
            if w in copy_out:
                body.append(Copy(w, out=copy_out.pop(w)))
    if copy_out:
        raise InternalError(f"{loop}: host slices {sorted(copy_out.values())} never written")
    deallocs: list[Node] = [Deallocate(a.out.name) for a in allocs if isinstance(a, Allocate)]
    return allocs, dataclasses.replace(loop, body=body), deallocs


def _stage_sliced(body: list[Node], info: TensorInfo, read: bool, pool: int,
                  fresh: _FreshNames) -> list[Node]:
    out: list[Node] = []
    for n in body:
        if isinstance(n, ForLoop) and _uses(n, info.name):
            allocs, loop, deallocs = _stage_loop(n, info, read, pool, fresh)
            out += [*allocs, loop, *deallocs]
        else:
            out.append(n)
    return out


def _copy_whole(body: list[Node], info: TensorInfo, read: bool, fresh: _FreshNames,
                ) -> list[Node]:
    """A host tensor read whole (or an output also read by other ops, or computed
    outside a loop) lives whole on the GPU as ``<name>_dev``: an input is copied in once
    before its first use, an output copied out once after the node that computes it."""
    dev = fresh(f"{info.name}_dev")
    body = [_renamed(n, {info.name: dev}) for n in body]
    users = [k for k, n in enumerate(body) if _uses(n, dev)]  # an output's first: its op
    out: list[Node] = []
    for k, n in enumerate(body):
        if read and k == users[0]:
            out += [Allocate(dataclasses.replace(info, name=dev, device="cuda")),
                    Copy(info.name, out=dev)]
        if not read and isinstance(n, Allocate) and n.out.name == dev:
            out += [Allocate(dataclasses.replace(n.out, device="cuda")),
                    Allocate(info, pinned=True)]
            continue
        out.append(n)
        if not read and k == users[0]:
            out.append(Copy(dev, out=info.name))
        if k == users[-1]:
            out.append(Deallocate(dev))
    return out


def stage_host_tensors(program: HostProgram) -> HostProgram:
    """Moves host-resident inputs and outputs through the GPU, slice by slice.

    Before: compute nodes read host inputs and write host outputs (``device=cpu``) as if
    they were on the GPU. After: every tensor a compute node touches is on the GPU.
    A host tensor that only stream loops use, slice by slice, goes through a staging
    tensor with one slot per worker stream (``_stage_loop``); anything else is copied
    whole once (``_copy_whole``). Host outputs are allocated in pinned memory.

        for i in range(0, 8) [Stream]:
          T1_i = ShardByStream(T1, axis=1, index=i, chunk=ceilDiv(n, 8))
          T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i)
          Copy(T1_i, out=T1_s)
          Matmul(T0, T1_s, out=T2_i)
    """
    pool = program.pool_size
    allocs = program.allocations()
    host = [(t, True) for t in program.inputs if t.device == "cpu"]
    host += [(allocs[o], False) for o in program.outputs if allocs[o].device == "cpu"]
    if not host:
        return program
    fresh = _FreshNames(program)
    body = list(program.body)
    for info, read in host:
        if not any(_uses(n, info.name) for n in body):
            continue
        if _sliced_only(body, info.name, written=not read):
            body = _stage_sliced(body, info, read, pool, fresh)
            if not read:
                body = [Allocate(n.out, pinned=True)
                        if isinstance(n, Allocate) and n.out.name == info.name else n
                        for n in body]
        else:
            body = _copy_whole(body, info, read, fresh)
    return program.replace(body=body)


def synchronize_host_outputs(program: HostProgram) -> HostProgram:
    """Makes host outputs complete when the program returns.

    Before:  ...; return T2             (T2 = Allocate(..., device=cpu, pinned=True))
    After:   ...; StreamSynchronize(main_stream); return T2
    The copies out were queued on worker streams that the caller's stream joined, so
    waiting for the caller's stream waits for them; only programs with host outputs
    block the host.
    """
    allocs = program.allocations()
    if not any(allocs[o].device == "cpu" for o in program.outputs if o in allocs):
        return program
    body = list(program.body)
    if not any(isinstance(n, GetCurrentStream) for n in body):
        body.insert(0, GetCurrentStream(MAIN_STREAM))
    return program.replace(body=[*body, StreamSynchronize(MAIN_STREAM)])


def queue_copies_in(program: HostProgram) -> HostProgram:
    """With ``copy_stream``, queues each stream loop's host-to-device copies on one copy
    stream, in slice order, instead of on the slices' worker streams.

    Before:  SetCurrentStream(Stream(i % 4)); T1_i = ShardByStream(T1, ...)
             T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i); Copy(T1_i, out=T1_s)
             Matmul(T0, T1_s, ...)
    After:   SetCurrentStream(CopyStream); WaitEvent(T1_stage_free[i % 4])
             T1_i = ...; T1_s = ...; Copy(T1_i, out=T1_s)
             SetCurrentStream(Stream(i % 4)); Synchronize(CopyStream)
             Matmul(T0, T1_s, ...); RecordEvent(T1_stage_free[i % 4])
    A slot reused by a later slice first waits for the event its last reader recorded
    (the GEMM of slice i - 4 that read it: not the rest of that worker's queue, such as
    the next GEMM of its slice or a copy out); where every slice has its own slot
    (``Stream(i)``) there is nothing to wait for. The worker then waits for the copy
    stream, whose last work is this slice's copy. The copies leave the host in order,
    one at a time, so the first one ends after its own bytes instead of sharing the bus
    with the copies of the other workers; copies out (host outputs) stay on the
    workers. The events are made with the staging (``CreateEvents`` after its
    Allocate). A loop on the caller's stream (``on_caller_stream``) is left alone.
    """
    if not program.copy_stream:
        return program
    pool = program.pool_size
    copier = CopyStream(pool)
    created: dict[str, CreateEvents] = {}  # stage -> its events

    def queue(loop: ForLoop) -> list[Node]:
        moved = _copies_in(loop.body)
        if not moved or on_caller_stream(loop, pool):
            return [loop]
        first = loop.body[0]
        if not (isinstance(first, SetCurrentStream) and isinstance(first.stream, Stream)):
            raise InternalError(f"{loop}: streams are not assigned\n{program}")
        worker = first.stream
        rest = [n for n in loop.body[1:] if not any(n is m for m in moved)]
        waits: list[Node] = []
        if worker.pool:  # slots are reused: Stream(i % pool)
            for slot in (n for n in moved if isinstance(n, StagingSlot)):
                event = Event(f"{slot.stage}_free", slot.slot)
                created[slot.stage] = CreateEvents(event.name, stream_count(loop, pool))
                waits.append(WaitEvent(event))
                readers = [k for k, n in enumerate(rest) if _reads(n, slot.out, rest)]
                if not readers:
                    raise InternalError(f"{slot}: nothing reads the slot\n{program}")
                rest.insert(readers[-1] + 1, RecordEvent(event))
        body = [SetCurrentStream(copier), *waits, *moved,
                SetCurrentStream(worker), Synchronize(copier), *rest]
        return [dataclasses.replace(loop, body=body)]

    out = _map_stream_loops(program, queue)
    if not created:
        return out
    body: list[Node] = []
    for n in out.body:
        body.append(n)
        if isinstance(n, Allocate) and n.out.name in created:
            body.append(created[n.out.name])
    return out.replace(body=body)


def _copy_stream_loops(program: HostProgram) -> list[int]:
    """Positions in the program's body of the stream loops that use the copy stream."""
    return [k for k, n in enumerate(program.body) if isinstance(n, ForLoop) and any(
        isinstance(c, SetCurrentStream) and isinstance(c.stream, (CopyStream, RingStream))
        for c in n.body)]


def hoist_staging(program: HostProgram) -> HostProgram:
    """With a copy stream, allocates every staging tensor (and its events) before the
    first loop and frees it after the last, so the copy stream is forked once, before
    the first loop, and joined once, after the last (``insert_fork_join``): the copies of
    loop l + 1 then queue right behind those of loop l and run under loop l's GEMMs,
    where a fork per loop would start them only after loop l had finished.

    Before:  T1_stage = Allocate(...); for ...: (copies into T1_stage); Deallocate(T1_stage)
             T3_stage = Allocate(...); for ...: (copies into T3_stage); Deallocate(T3_stage)
    After:   T1_stage = Allocate(...); T3_stage = Allocate(...)
             for ...: ...; for ...: ...
             Deallocate(T1_stage); Deallocate(T3_stage)
    Staging lives on the caller's stream's pool, allocated before the copy stream's fork,
    so the caching allocator's rule (a block is used on another stream only after its
    allocation) holds; freed after the final join. GPU memory for the staging of all
    loops is held at once (the slots, never a whole host tensor).
    """
    loops = _copy_stream_loops(program)
    if len(loops) < 2:
        return program
    stages = {n.stage for k in loops for n in program.body[k].body  # type: ignore[attr-defined]
              if isinstance(n, StagingSlot)}

    def hoisted(n: Node) -> bool:
        return (isinstance(n, Allocate) and n.out.name in stages) or \
            (isinstance(n, CreateEvents) and n.name.removesuffix("_free") in stages)

    def freed(n: Node) -> bool:
        return isinstance(n, Deallocate) and n.tensor in stages

    first, last = program.body[loops[0]], program.body[loops[-1]]
    head = [n for n in program.body if hoisted(n)]
    tail = [n for n in program.body if freed(n)]
    body: list[Node] = []
    for n in program.body:
        if hoisted(n) or freed(n):
            continue
        if n is first:
            body += head
        body.append(n)
        if n is last:
            body += tail
    return program.replace(body=body)


def _reads(n: Node, slot: str, body: list[Node]) -> bool:
    """Whether ``n`` (a node of a loop ``body``, with what it nests) uses staging slot
    ``slot`` or a view of it, other than the node that takes the slot and the Copy that
    fills it: the rule that places the event after a slot's last reader (RecordEvent in
    ``queue_copies_in``, ReleaseRingSlot in ``stage_in_ring``)."""
    if (isinstance(n, (StagingSlot, RingSlot)) and slot in n.defines()) or \
            (isinstance(n, Copy) and n.out == slot):
        return False
    aliases = {slot}
    for m in body:  # views of the slot defined in the loop body (a view's first use)
        if m.defines() and m.uses() and m.uses()[0] in aliases:
            aliases.update(m.defines())

    def uses(m: Node) -> set[str]:
        return set(m.uses()).union(*(uses(c) for c in m.children()))

    return bool(uses(n) & aliases) and not (set(n.defines()) & aliases)


def stage_in_ring(program: HostProgram) -> HostProgram:
    """With ``staging="ring"``, the copy stream's slices land in the thread's staging ring
    instead of per-call staging, and its copies are not ordered after the caller's stream:
    the copies of this call queue right behind the previous call's (of any program that
    stages in the ring) and run under its last GEMMs, where a fork would hold them until
    the previous call had finished.

    Before:  T1_stage = Allocate(...); T1_stage_free = CreateEvents(4)
             for i ... [Stream]: SetCurrentStream(CopyStream); WaitEvent(T1_stage_free[i % 4])
               T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i); Copy(T1_i, out=T1_s)
               SetCurrentStream(Stream(i % 4)); Synchronize(CopyStream)
               Matmul(T0, T1_s, ...); RecordEvent(T1_stage_free[i % 4])
    After:   for i ... [Stream]: SetCurrentStream(RingStream)
               T1_s = RingSlot(like=T1_i, slots=5); Copy(T1_i, out=T1_s)
               SetCurrentStream(Stream(i % 4)); Synchronize(RingStream)
               Matmul(T0, T1_s, ...); ReleaseRingSlot(T1_s)
    The slot's event moves into the ring (recorded by ``ReleaseRingSlot`` after the last
    reader, waited for by the ``RingSlot`` that reuses the bytes, in any later call).
    Without the fork, nothing orders the copies after work queued on the caller's stream:
    a ring program's host inputs must be complete when it is called (written by the host,
    or by a copy the host has waited for; codegen's own host outputs are complete when
    their op returns). ``insert_fork_join`` then joins the ring stream but does not fork
    it.
    """
    if program.staging != "ring":
        return program
    infos = program.allocations()
    loops = set(_copy_stream_loops(program))  # a loop on the caller's stream keeps its slots
    stages = {n.stage for k in loops for n in _copies_in(program.body[k].children())
              if isinstance(n, StagingSlot)}  # copies in; a host output keeps its slots
    events = {f"{s}_free" for s in stages}

    def staged(n: Node) -> bool:
        return (isinstance(n, Allocate) and n.out.name in stages) or \
            (isinstance(n, Deallocate) and n.tensor in stages) or \
            (isinstance(n, CreateEvents) and n.name in events) or \
            (isinstance(n, (WaitEvent, RecordEvent)) and n.event.name in events)

    def ring(stream: StreamRef) -> StreamRef:
        return RingStream() if isinstance(stream, CopyStream) else stream

    def body_of(loop: ForLoop) -> list[Node]:
        count = stream_count(loop, program.pool_size)
        ring_slots = (count.value if isinstance(count, Const) else program.pool_size) + 1
        body: list[Node] = []
        slots: list[str] = []
        for n in loop.body:
            if staged(n):
                continue
            if isinstance(n, StagingSlot) and n.stage in stages:
                stage = infos[n.stage]
                out = TensorInfo(n.out, stage.dtype, stage.shape[1:], stage.device)
                body.append(RingSlot(out, n.like, ring_slots))
                slots.append(n.out)
            elif isinstance(n, (SetCurrentStream, Synchronize)):
                body.append(dataclasses.replace(n, stream=ring(n.stream)))
            else:
                body.append(n)
        for slot in slots:
            readers = [k for k, n in enumerate(body) if _reads(n, slot, body)]
            if not readers:
                raise InternalError(f"{slot}: nothing reads the ring slot\n{program}")
            body.insert(readers[-1] + 1, ReleaseRingSlot(slot))
        return body

    body = [dataclasses.replace(n, body=body_of(n)) if k in loops else n
            for k, n in enumerate(program.body) if not staged(n)]
    return program.replace(body=body)
