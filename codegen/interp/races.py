"""The stream-order checker: proves, for concrete sizes, that a host program orders every
access to memory after the accesses it depends on.

A host program is correct only if its ``Synchronize`` nodes (event waits), its fork and
join, its staging-slot reuse and its ``StreamSynchronize`` order each GPU access after
the ones it depends on; a missing wait gives right numbers on most runs and wrong ones on
some, so the GPU tests cannot prove it. This module runs the program the way the
evaluator does (the same view semantics: it subclasses the evaluator's interpreter),
but every tensor holds the ids of its elements instead of values, every compute node and
copy records which elements it reads and writes on which stream, and stream order is a
vector clock per stream:

- an operation on a stream happens after everything queued on that stream before it;
- ``Synchronize(X)`` on stream C: what C queues next happens after everything queued on
  X so far (an event recorded on X, waited for on C);
- ``Communication`` runs on a stream of its own that starts after the posting stream
  (c10d's collective stream waits for the current stream); ``Wait`` joins it back;
- ``StreamSynchronize(X)``: the host has seen X finish, and whatever it queues afterwards,
  on any stream, happens after X's work.

It reports, per element:

- a read not ordered after the write it reads, or of an element never written;
- a write not ordered after the earlier reads and writes;
- a use not ordered after its ``Allocate``: the caching allocator may hand out a block
  that earlier work queued on the allocating stream still uses, so another stream needs
  a wait first;
- a ``Deallocate`` before every access is ordered before the allocating stream (the
  allocator gives the block to the next allocation on that stream at once; the C++
  runtime also keeps it until the join, a second line of defence this does not assume);
- at the return: an output element not written, or not ordered before the caller's
  stream (GPU outputs) or the host (host outputs); an input or output still read after
  the caller's stream goes on (the caller may overwrite it there, or on the host once
  that stream has passed the call); a stream that got work and that the caller's stream
  did not wait for directly afterwards (transitive order is not enough: the C++ runtime
  joins such a stream only on exit, and a CUDA graph capture must rejoin every stream).

What it does not model: work the runtime adds on its own (cuBLAS workspaces, a
``contiguous()`` before a collective), other calls and programs on the same streams, the
caller's use of its memory beyond the rules above, and the C++ runtime's event reuse
(one event per stream, the caller's recorded once per fork; this is sound because work
only goes on the current stream, so the caller's stream gets none while its workers
wait for it).

The caller's stream is ordered after its own writes of the inputs; the worker streams
are not (that is what the fork is for).

    >>> check(cg.lower(fusion), [a, b])      # raises InternalError listing the races
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import distributed
from .. import hostir as hir
from ..errors import InternalError
from ..runtime.dispatch import chosen
from .evaluator import CALLER, Interpreter, Streams, check_inputs

HOST = "host"  # the key of the host thread's clock
_ID_BITS = 32  # element id = buffer index << _ID_BITS | offset in the buffer

Key = object  # a stream's clock key: CALLER, a worker index, HOST, or ("comm", n)
Clock = dict[Key, int]  # stream -> the first of its epochs not yet seen


@dataclasses.dataclass(frozen=True)
class Access:
    stream: Key
    epoch: int
    what: str  # "Copy(T0_i, out=T0_s) on Stream(1) [i=5]"


@dataclasses.dataclass(frozen=True)
class Race:
    kind: str  # see KINDS
    tensor: str  # the allocation or input whose elements are involved (or the stream)
    first: Access | None  # the earlier access (None: never written)
    second: str  # the later access, or what happens at the return
    elements: int = 1

    def __str__(self) -> str:
        if self.kind == "stream not joined":
            return f"{self.kind}: {self.tensor} got work, and {self.second}"
        where = (f"{self.kind} on {self.tensor} ({self.elements} element"
                 f"{'s' if self.elements != 1 else ''})")
        if self.first is None:
            return f"{where}: {self.second}, but nothing wrote them"
        return f"{where}: {self.second} is not ordered after {self.first.what}"


KINDS = ("read before write", "write after read", "write after write", "uninitialized read",
         "use before allocation", "free while in use", "output not ready",
         "still read at the return", "stream not joined", "use after release")


@dataclasses.dataclass
class _Element:
    write: Access | None = None
    reads: list[Access] = dataclasses.field(default_factory=list)
    # The Allocate that made it (None for inputs): until then the caching allocator may
    # still give the block to work queued earlier on the allocating stream.
    born: Access | None = None


@dataclasses.dataclass
class _Buffer:
    name: str
    device: str
    stream: Key  # where it was allocated (the caching allocator's stream)
    size: int


def _stream_str(key: Key, copier: int | None = None) -> str:
    if key is CALLER:
        return "main_stream"
    if key == HOST:
        return "the host"
    if isinstance(key, tuple):
        return f"the collective stream of {key[1]}"
    if key == hir.RING_POSITION:
        return "RingStream"
    return "CopyStream" if key == copier else f"Stream({key})"


class _Checker(Interpreter):
    """Runs a program on element ids (see the module docstring)."""

    def __init__(self, program: hir.HostProgram, env: dict[str, int]) -> None:
        super().__init__(program, env, {}, Streams(torch.device("cpu")))
        self.buffers: list[_Buffer] = []
        self.allocated: dict[str, int] = {}  # live allocations and inputs -> buffer index
        self.elements: dict[int, _Element] = {}
        self.clocks: dict[Key, Clock] = {CALLER: {CALLER: 1}, HOST: {HOST: 1}}
        self.found: dict[tuple[str, str, str, str], Race] = {}
        self.communications = 0
        self.released: set[int] = set()  # buffers of ring slots released
        self.copier = program.pool_size if program.copy_stream else None  # CopyStream

    def stream_str(self, key: Key) -> str:
        return _stream_str(key, self.copier)

    # ------------------------------------------------------------------ clocks

    def clock(self, key: Key) -> Clock:
        return self.clocks.setdefault(key, {key: 0})

    def join(self, into: Key, other: Key) -> None:
        """``into`` from now on happens after everything queued on ``other`` so far."""
        mine = self.clock(into)
        for k, e in self.clock(other).items():
            mine[k] = max(mine.get(k, 0), e)

    @staticmethod
    def ordered(a: Access, clock: Clock) -> bool:
        return clock.get(a.stream, 0) > a.epoch

    # ------------------------------------------------------------------ memory

    def buffer(self, name: str, shape: Sequence[int], device: str, stream: Key,
               written: Access | None = None, born: Access | None = None) -> None:
        """A new buffer ``name``: an input ``written`` before the call, or an allocation
        ``born`` on ``stream``."""
        if name in self.allocated:  # the lowering never allocates in a loop
            raise InternalError(f"{self.program.name}: {name} allocated again while live")
        index, size = len(self.buffers), int(torch.Size(shape).numel())
        self.buffers.append(_Buffer(name, device, stream, size))
        self.allocated[name] = index
        ids = torch.arange(size, dtype=torch.int64).add_(index << _ID_BITS)
        self.values[name] = ids.view(list(shape))
        self.elements.update((e, _Element(write=written, born=born)) for e in ids.tolist())

    def ids(self, name: str) -> list[int]:
        return self.values[name].flatten().tolist()

    def tensor_of(self, element: int) -> str:
        return self.buffers[element >> _ID_BITS].name

    def report(self, kind: str, element: int, first: Access | None, second: str) -> None:
        tensor = self.tensor_of(element)
        key = (kind, tensor, first.what if first else "", second)
        old = self.found.get(key)
        self.found[key] = dataclasses.replace(old, elements=old.elements + 1) if old else \
            Race(kind, tensor, first, second)

    def where(self, node: hir.Node, key: Key) -> str:
        indices = ", ".join(f"{k}={v}" for k, v in self.indices.items())
        return f"{node} on {self.stream_str(key)}" + (f" [{indices}]" if indices else "")

    def access(self, node: hir.Node, reads: Sequence[str], writes: Sequence[str],
               key: Key | None = None) -> None:
        """Records ``node`` reading ``reads`` and writing ``writes`` on stream ``key``
        (default: the current one), checking each element against its history."""
        key = self.streams.current if key is None else key
        for name in [*reads, *writes] if self.released else []:
            # a released ring slot's bytes may hold the next slice already
            gone = [e for e in self.ids(name) if e >> _ID_BITS in self.released]
            if gone:
                self.report("use after release", gone[0], None,
                            f"{node} after the ReleaseRingSlot of what {name} views")
        self.join(key, HOST)  # queued now, so after whatever the host has waited for
        clock = self.clock(key)
        a = Access(key, clock[key], self.where(node, key))
        read = [e for name in reads for e in self.ids(name)]
        written = [e for name in writes for e in self.ids(name)]
        for e in [*read, *written]:
            born = self.elements[e].born
            if born is not None and not self.ordered(born, clock):
                self.report("use before allocation", e, born, a.what)
        for e in read:
            state = self.elements[e]
            if state.write is None:
                self.report("uninitialized read", e, None, a.what)
            elif not self.ordered(state.write, clock):
                self.report("read before write", e, state.write, a.what)
            state.reads.append(a)
        for e in written:
            state = self.elements[e]
            for r in state.reads:
                if r is not a and not self.ordered(r, clock):
                    self.report("write after read", e, r, a.what)
            if state.write is not None and not self.ordered(state.write, clock):
                self.report("write after write", e, state.write, a.what)
            state.write, state.reads = a, []
        clock[key] += 1

    def check_free(self, index: int, what: str, key: Key | None = None) -> None:
        """Buffer ``index`` goes back to the caching allocator: each access must be
        ordered before the stream it was allocated on (or ``key``), as it stands now."""
        buf = self.buffers[index]
        clock = self.clock(buf.stream if key is None else key)
        first = index << _ID_BITS
        for e in range(first, first + buf.size):
            state = self.elements[e]
            for a in [*state.reads, *([state.write] if state.write else [])]:
                if not self.ordered(a, clock):
                    self.report("free while in use", e, a,
                                f"{what} (allocated on {self.stream_str(buf.stream)})")

    # ------------------------------------------------------------------ nodes

    def born(self, node: hir.Node, stream: Key) -> Access:
        """The allocation ``node`` on ``stream``, as an access of that stream."""
        access = Access(stream, self.clock(stream)[stream], self.where(node, stream))
        self.clock(stream)[stream] += 1
        return access

    def Allocate(self, n: hir.Allocate) -> None:
        shape = [e.evaluate(self.env) for e in n.out.shape]
        stream = HOST if n.out.device == "cpu" else self.streams.current
        self.buffer(n.out.name, shape, n.out.device, stream, born=self.born(n, stream))
        if n.zeroed:  # cleared on the allocating stream
            self.access(n, [], [n.out.name])

    def Deallocate(self, n: hir.Deallocate) -> None:
        self.check_free(self.allocated.pop(n.tensor), str(n))
        super().Deallocate(n)

    def RingSlot(self, n: hir.RingSlot) -> None:
        """Fresh bytes born on the ring stream: the ring's reuse of bytes across slices and
        calls is the runtime's, by the events that ``ReleaseRingSlot`` records, so what
        is checked here is that the release comes after every use of the slot."""
        key = self.streams.current
        self.buffer(n.out.name, self.values[n.like].shape, "cuda", key, born=self.born(n, key))

    def ReleaseRingSlot(self, n: hir.ReleaseRingSlot) -> None:
        key = self.streams.current
        self.join(key, HOST)
        index = self.allocated.pop(n.slot)
        self.check_free(index, str(n), key)
        self.released.add(index)

    def Synchronize(self, n: hir.Synchronize) -> None:
        self.join(self.streams.current, self.stream_key(n.stream))
        super().Synchronize(n)

    def StreamSynchronize(self, n: hir.StreamSynchronize) -> None:
        self.join(HOST, self.stream_key(n.stream))

    def RecordEvent(self, n: hir.RecordEvent) -> None:
        """The event holds the current stream's clock as it stands: what was queued so far."""
        key = self.streams.current
        self.join(key, HOST)
        self.events[n.event.name][n.event.position(self.indices)] = dict(self.clock(key))

    def WaitEvent(self, n: hir.WaitEvent) -> None:
        recorded = self.events[n.event.name][n.event.position(self.indices)]
        if recorded is not None:
            mine = self.clock(self.streams.current)
            for k, e in recorded.items():  # type: ignore[union-attr]
                mine[k] = max(mine.get(k, 0), e)

    def Copy(self, n: hir.Copy) -> None:
        self.access(n, [n.src], [n.out])

    def Compute(self, n: hir.Compute) -> None:
        self.access(n, n.reads(), n.writes())

    def Communication(self, n: distributed.Communication) -> None:
        self.communications += 1
        key = ("comm", f"{n.out}#{self.communications}")
        self.clocks[key] = {**self.clock(self.streams.current), key: 0}
        self.access(n, [n.input], [n.output], key)
        self.values[n.out] = key  # type: ignore[assignment]

    def Wait(self, n: distributed.Wait) -> None:
        self.join(self.streams.current, self.values[n.communication])  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the return

    def finish(self, inputs: Sequence[hir.TensorInfo]) -> None:
        """What the caller does after the return: reads the outputs (GPU ones on its
        stream, host ones on the host); may overwrite inputs and outputs on its stream
        (or, for host memory, on the host once that stream has passed the call); the op's
        temporaries go back to the allocator. And every stream that got work must have
        been waited for by main_stream directly, after that work: the C++ runtime joins
        the others only on exit, and a CUDA graph capture must rejoin every stream."""
        caller, host = self.clock(CALLER), self.clock(HOST)
        outputs = set(self.program.outputs)
        for name in self.program.outputs:
            on_host = self.buffers[self.allocated[name]].device == "cpu"
            who = "the host after the return" if on_host else "main_stream after the return"
            clock = host if on_host else caller
            for e in self.ids(name):
                w = self.elements[e].write
                if w is None or not self.ordered(w, clock):
                    self.report("output not ready", e, w, f"{name} read by {who}")
        for name in [*(i.name for i in inputs), *self.program.outputs]:
            for e in self.ids(name):
                for r in self.elements[e].reads:
                    if not self.ordered(r, caller):
                        self.report("still read at the return", e, r,
                                    f"{name} overwritten by main_stream after the return")
        temporaries = set(self.allocated) - outputs - {i.name for i in inputs}
        for name in sorted(temporaries):
            if self.buffers[self.allocated[name]].device == "cuda":
                self.check_free(self.allocated[name], f"{name} freed at the return")
        for key in self.streams.pending:
            name = self.stream_str(key)
            self.found["stream not joined", name, "", ""] = Race(
                "stream not joined", name, None,
                "main_stream never waits for it after its last work")


def find_races(program: hir.HostProgram, inputs: Sequence[torch.Tensor]) -> list[Race]:
    """The races of ``program`` run on inputs shaped as ``inputs`` (CPU tensors, as for
    ``evaluate``; only their shapes and layouts matter; of its alternative where its choice
    picks that for them). Empty when every access is ordered."""
    if not isinstance(program, hir.HostProgram):
        raise TypeError(f"find_races expects a cg.HostProgram, got {type(program).__name__}")
    env = check_inputs(program, inputs)
    program = chosen(program, inputs)  # split_contraction="auto": the loop these run
    checker = _Checker(program, env)
    for info, x in zip(program.inputs, inputs):
        key = HOST if info.device == "cpu" else CALLER
        written = Access(key, 0, f"{info.name} written by {_stream_str(key)} before the call")
        checker.buffer(info.name, x.shape, info.device, key, written)
    checker.run(program.body)
    checker.finish(program.inputs)
    return list(checker.found.values())


def check(program: hir.HostProgram, inputs: Sequence[torch.Tensor]) -> None:
    """Raises InternalError listing the races of ``program`` (see ``find_races``)."""
    races = find_races(program, inputs)
    if races:
        shapes = ", ".join(f"{t.name}: {list(x.shape)}" for t, x in zip(program.inputs, inputs))
        listed = "\n".join(f"  {r}" for r in races[:8])
        more = f"\n  ... and {len(races) - 8} more" if len(races) > 8 else ""
        raise InternalError(f"{program.name}: {len(races)} unordered accesses for inputs "
                            f"{shapes}:\n{listed}{more}\n{program}")
