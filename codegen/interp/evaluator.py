"""The reference interpreter of host IR: runs a HostProgram node by node with torch ops.

It is the executable specification of host-IR semantics, the CPU oracle of the tests,
and a fallback where no CUDA build is possible. Each compute node is one torch call per
slice, writing into that slice (``torch.matmul(a_i, b, out=c_i)``), so a profiler shows
exactly what the host program does. On CUDA, ``Stream(k)`` is the k-th stream of a pool
that this module keeps per device; on the CPU stream nodes only record what they would do.
On every exit, an exception mid-loop included, the caller's stream is current again and
ordered after every worker stream used, and the caller's current device is restored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from .. import distributed
from .. import hostir as hir
from ..errors import InternalError
from ..frontend import ops
from ..frontend.ir import DTYPE_NAMES
from ..runtime import autograd
from ..runtime.dispatch import chosen


@functools.cache
def _worker_stream(device: torch.device, k: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {DTYPE_NAMES.get(x.dtype, x.dtype)} tensor of shape {list(x.shape)}"
    return f"{type(x).__name__}"


def check_inputs(program: hir.HostProgram, inputs: Sequence[object]) -> dict[str, int]:
    """Checks ``inputs`` against the program's signature; returns the named extents.
    Raises ValueError (or TypeError for a non-tensor) naming the argument."""
    name = program.name
    expected = [t.name for t in program.inputs]
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, Sequence):
        raise TypeError(f"{name}: inputs must be a list of tensors ({', '.join(expected)}), "
                        f"got {_describe(inputs)}")
    if len(inputs) != len(expected):
        raise ValueError(f"{name}: expected {len(expected)} inputs ({', '.join(expected)}), "
                         f"got {len(inputs)}")
    device = None
    for info, x in zip(program.inputs, inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: argument {info.name} must be a torch.Tensor, "
                            f"got {_describe(x)}")
        if x.layout != torch.strided:
            raise ValueError(f"{name}: argument {info.name} must be a dense (strided) tensor, "
                             f"got layout {x.layout}; call .to_dense() first")
        if x.dtype != info.dtype:
            raise ValueError(f"{name}: argument {info.name} must be "
                             f"{DTYPE_NAMES[info.dtype]}, got {x.dtype}")
        if x.dim() != len(info.shape):
            raise ValueError(f"{name}: argument {info.name} must have rank {len(info.shape)} "
                             f"{info.type_str()}, got shape {list(x.shape)}")
        if info.device == "cpu":
            _check_host_input(name, info, x)
            continue
        if device is None:
            device, first = x.device, info.name
        elif x.device != device:
            raise ValueError(f"{name}: argument {info.name} is on {x.device} but {first} is "
                             f"on {device}; all inputs must be on one device")
    env: dict[str, int] = {}
    by_name = dict(zip(expected, inputs))
    for c in hir.dim_checks(program):
        size = by_name[c.tensor].shape[c.axis]
        if c.kind == "bind":
            env[str(c.value)] = size
            continue
        want = c.value.evaluate(env)
        if size != want:
            tied = f"{c.value} = {want}" if c.kind == "same" else str(want)
            raise ValueError(f"{name}: argument {c.tensor} axis {c.axis} must have size "
                             f"{tied}, got {size} (shape {list(by_name[c.tensor].shape)})")
    for k in program.constraints:
        lhs, rhs = k.lhs.evaluate(env), k.rhs.evaluate(env)
        if lhs != rhs:
            raise ValueError(f"{name}: {k.what} must have equal sizes, got {k.lhs} = {lhs} "
                             f"and {k.rhs} = {rhs}")
    return env


def _check_host_input(name: str, info: hir.TensorInfo, x: torch.Tensor) -> None:
    """A ``device="cpu"`` input must be a CPU tensor (pinned or pageable).

    A GPU tensor there is refused rather than used in place: the declaration promises
    that the program streams the operand through staging slots and never holds it whole
    on the GPU, the compiled op copies it from host memory, and accepting a GPU tensor
    would silently run a different program (and hide a misplaced ``.cuda()``)."""
    if x.device.type != "cpu":
        raise ValueError(
            f"{name}: argument {info.name} was declared device=\"cpu\" (host memory, "
            f"copied to the GPU slice by slice) but is on {x.device}; pass a CPU tensor "
            f"({info.name}.cpu(), pinned with .pin_memory() for overlapped copies) or "
            f"declare it cg.input(..., device=\"cuda\")"
        )


def program_device(program: hir.HostProgram, inputs: Sequence[torch.Tensor]) -> torch.device:
    """Where ``evaluate`` runs ``program`` (after ``check_inputs``).

    The device of the first ``device="cuda"`` input, all of which are on one device: a
    CPU tensor there runs the whole program on the CPU (staging and copies included, so
    the CPU tests check the same program). With no such input (every input in host
    memory) it is the current CUDA device when CUDA is available, like the compiled op,
    else the CPU. Host inputs and outputs are always CPU tensors."""
    for info, x in zip(program.inputs, inputs):
        if info.device == "cuda":
            return x.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Test-only fault injection: when set, ``_fault_hook(interpreter, node)`` runs before every
# compute node, so a test can raise mid-loop and check what ``evaluate`` leaves behind (the
# interpreter's ``streams.log``). Nothing in the package sets it.
_fault_hook: Callable[[Interpreter, hir.Node], None] | None = None

CALLER = None  # the key of the caller's stream in Streams; workers are keyed by index


class Streams:
    """The stream state of one evaluation, as a scope guard (the evaluator's counterpart of
    the C++ runtime's RAII fork/join guard).

    Streams are keyed ``None`` (the caller's) or by worker index. ``pending`` holds the
    workers that were current since the caller's stream last waited for them: work may be
    queued there that the caller is not ordered after. On every exit, exceptions included,
    the guard makes the caller's stream current again, makes it wait for every pending
    worker (a no-op when the program's own join ran), and restores the caller's current
    device (``torch.cuda.set_stream`` switches it). ``log`` records each stream action as
    a tuple, on the CPU too, where the actions themselves do nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.current: int | None = CALLER
        self.pending: dict[int, None] = {}  # insertion-ordered set
        self.log: list[tuple[object, ...]] = []
        self._caller = torch.cuda.current_stream(device) if self.cuda else None
        self._caller_device = torch.cuda.current_device() if self.cuda else None

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.set_current(CALLER)
            for k in list(self.pending):
                self.synchronize(k)
            self.log.append(("exit",))
        finally:
            if self._caller_device is not None:
                torch.cuda.set_device(self._caller_device)

    def stream(self, key: int | None) -> torch.cuda.Stream:
        return self._caller if key is CALLER else _worker_stream(self.device, key)

    def set_current(self, key: int | None) -> None:
        if self.cuda:
            torch.cuda.set_stream(self.stream(key))
        self.current = key
        if key is not CALLER:
            self.pending[key] = None
        self.log.append(("set", key))

    def record(self) -> object:
        """An event recorded on the current stream (a marker on the CPU)."""
        self.log.append(("record", self.current))
        if not self.cuda:
            return ("recorded", self.current)
        event = torch.cuda.Event()
        event.record(self.stream(self.current))
        return event

    def wait_event(self, event: object) -> None:
        """The current stream waits for ``event`` (from ``record``)."""
        self.log.append(("wait event", self.current))
        if self.cuda:
            self.stream(self.current).wait_event(event)  # type: ignore[arg-type]

    def synchronize(self, key: int | None) -> None:
        """The current stream waits for ``key``'s stream."""
        if self.cuda:
            self.stream(self.current).wait_stream(self.stream(key))
        if self.current is CALLER and key is not CALLER:
            self.pending.pop(key, None)
        self.log.append(("wait", self.current, key))


class Interpreter(distributed.CommunicationEvaluator):
    def __init__(self, program: hir.HostProgram, env: dict[str, int],
                 values: dict[str, torch.Tensor], streams: Streams) -> None:
        self.program, self.env, self.values, self.streams = program, env, values, streams
        self.device = streams.device
        # Loop indices live apart from the extents in env, so an extent may be named like
        # a loop index ("i") without one shadowing the other.
        self.indices: dict[str, int] = {}
        self.stream_names: dict[str, int | None] = {}  # values of GetCurrentStream
        self.events: dict[str, list[object | None]] = {}  # CreateEvents; None: not recorded
        self.group: object | None = None  # the process group of Communication nodes

    def stream_key(self, ref: hir.StreamRef) -> int | None:
        if isinstance(ref, str):
            if ref not in self.stream_names:
                raise InternalError(f"{self.program.name}: stream {ref} is not defined")
            return self.stream_names[ref]
        return ref.position(self.indices)

    def run(self, nodes: list[hir.Node]) -> None:
        for node in nodes:
            if _fault_hook is not None and isinstance(node, hir.Compute):
                _fault_hook(self, node)
            self.handler(node)(node)

    def handler(self, node: hir.Node) -> Callable[[hir.Node], None]:
        """The method for ``node``'s kind: named as its class, or ``Compute`` for every
        compute node."""
        kind = "Compute" if isinstance(node, hir.Compute) else type(node).__name__
        method = getattr(self, kind, None)
        if method is None:
            raise InternalError(f"{self.program.name}: the evaluator has no rule for "
                                f"{kind} nodes ({node})")
        return method

    # One method per node kind, named as the node.
    def Allocate(self, n: hir.Allocate) -> None:
        shape = [e.evaluate(self.env) for e in n.out.shape]
        if n.out.device == "cpu":  # pinned only where there is a GPU to copy to
            self.values[n.out.name] = torch.empty(shape, dtype=n.out.dtype,
                                                  pin_memory=n.pinned and self.streams.cuda)
            return
        make = torch.zeros if n.zeroed else torch.empty
        self.values[n.out.name] = make(shape, dtype=n.out.dtype, device=self.device)

    def Deallocate(self, n: hir.Deallocate) -> None:
        del self.values[n.tensor]

    def GetCurrentStream(self, n: hir.GetCurrentStream) -> None:
        self.stream_names[n.out] = self.streams.current

    def SetCurrentStream(self, n: hir.SetCurrentStream) -> None:
        self.streams.set_current(self.stream_key(n.stream))

    def Synchronize(self, n: hir.Synchronize) -> None:
        self.streams.synchronize(self.stream_key(n.stream))

    def CreateEvents(self, n: hir.CreateEvents) -> None:
        self.events[n.name] = [None] * n.count.evaluate(self.env)

    def RecordEvent(self, n: hir.RecordEvent) -> None:
        self.events[n.event.name][n.event.position(self.indices)] = self.streams.record()

    def WaitEvent(self, n: hir.WaitEvent) -> None:
        event = self.events[n.event.name][n.event.position(self.indices)]
        if event is not None:  # not recorded yet in this call: nothing to wait for
            self.streams.wait_event(event)

    def ForLoop(self, n: hir.ForLoop) -> None:
        per_iteration = [d for node in n.body for d in node.defines()]  # slice views
        for i in range(n.start.evaluate(self.env), n.stop.evaluate(self.env)):
            self.indices[n.index] = i
            self.run(n.body)
            for d in per_iteration:
                self.values.pop(d, None)
        self.indices.pop(n.index, None)

    def ShardByStream(self, n: hir.ShardByStream) -> None:
        t = self.values[n.tensor]
        size = t.shape[n.axis]
        chunk = n.chunk.evaluate(self.env)
        start = min(self.indices[n.index] * chunk, size)
        self.values[n.out] = t.narrow(n.axis, start, min(chunk, size - start))

    def StagingSlot(self, n: hir.StagingSlot) -> None:
        like = self.values[n.like]
        slot = self.values[n.stage][n.slot.slot(self.indices)]
        self.values[n.out] = slot.view(-1)[: like.numel()].view(like.shape)

    def RingSlot(self, n: hir.RingSlot) -> None:
        # The evaluator's calls are not pipelined: a fresh block stands for the ring's bytes.
        like = self.values[n.like]
        self.values[n.out.name] = torch.empty_like(like, device=self.device)

    def ReleaseRingSlot(self, n: hir.ReleaseRingSlot) -> None:
        if self.streams.cuda:  # its block is freed on the ring stream: not before this reader
            self.values[n.slot].record_stream(self.streams.stream(self.streams.current))

    def Copy(self, n: hir.Copy) -> None:
        self.values[n.out].copy_(self.values[n.src], non_blocking=True)

    def StreamSynchronize(self, n: hir.StreamSynchronize) -> None:
        if self.streams.cuda:
            self.streams.stream(self.stream_key(n.stream)).synchronize()

    def Compute(self, n: hir.Compute) -> None:
        """One op (or a fused expression) into ``out``: a GEMM by its definition's torch
        call, then its epilogue in place; a pointwise expression computed in its compute
        dtype (fp32 for half types) and rounded once into ``out``, as the kernel does. An
        accumulating GEMM adds its product, computed in the compute dtype, onto ``out``
        and rounds the sum once, as cuBLAS does with beta = 1."""
        out = self.values[n.out]
        gemm = n.gemm
        if gemm is None:
            out.copy_(self.pointwise(n.expr, ops.compute_dtype(self.dtypes(n))))
            return
        operands = {k: self.values[v] for k, v in gemm.operands().items()}
        if n.accumulate:
            dtype = ops.compute_dtype([out.dtype])
            product = torch.empty(out.shape, dtype=dtype, device=out.device)
            gemm.defn.evaluate({k: v.to(dtype) for k, v in operands.items()}, product,
                               dict(gemm.attrs))
            out.copy_(out.to(dtype) + product)
            return
        gemm.defn.evaluate(operands, out, dict(gemm.attrs))
        if n.epilogue is not None:
            out.copy_(self.pointwise(dataclasses.replace(n.epilogue, args=(n.out,)),
                                     ops.compute_dtype([out.dtype])))

    def dtypes(self, n: hir.Compute) -> list[torch.dtype]:
        return [self.values[v].dtype for v in n.uses()]

    def pointwise(self, e: hir.Apply | str, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(e, str):
            return self.values[e].to(dtype)
        args = [self.pointwise(a, dtype) for a in e.args]
        compute = e.defn.compute
        if compute is None:
            raise InternalError(f"{self.program.name}: {e.defn.node} is not pointwise")
        return compute(*args, **dict(e.attrs))


def evaluate(program: hir.HostProgram, inputs: Sequence[torch.Tensor], *,
             group: object | None = None) -> list[torch.Tensor]:
    """Runs ``program`` on ``inputs`` (CPU or CUDA tensors); returns its outputs. A program
    that communicates (see codegen.distributed) takes this rank's local blocks and runs
    its collectives over ``group`` (default: torch.distributed's default group)."""
    if not isinstance(program, hir.HostProgram):
        raise TypeError(f"evaluate expects a cg.HostProgram (from cg.lower), "
                        f"got {type(program).__name__}")
    env = check_inputs(program, inputs)
    if group is not None and not distributed.communications(program):
        raise TypeError(f"{program.name}: group= is only for programs with collectives; "
                        "this one has none")
    program = chosen(program, inputs)  # split_contraction="auto": the loop for these inputs
    if program.source is not None and not distributed.communications(program) and \
            autograd.requires_grad(inputs):
        return autograd.evaluate(program, inputs, lambda: _run(program, inputs, env, group),
                                 _realize)
    return _run(program, inputs, env, group)


def _realize(program: hir.HostProgram) -> Callable[..., list[torch.Tensor]]:
    """A derived program (a backward) run by the evaluator."""
    return lambda *args: evaluate(program, list(args))


def _run(program: hir.HostProgram, inputs: Sequence[torch.Tensor], env: dict[str, int],
         group: object | None) -> list[torch.Tensor]:
    device = program_device(program, inputs)
    values = {t.name: x for t, x in zip(program.inputs, inputs)}
    with Streams(device) as streams, torch.no_grad():
        interp = Interpreter(program, env, values, streams)
        interp.group = distributed.resolve_group(program, group)
        interp.run(program.body)
    missing = [o for o in program.outputs if o not in values]
    if missing:
        raise InternalError(f"{program.name}: outputs {missing} were never computed")
    return [values[o] for o in program.outputs]
