"""Host IR: the host program that loops over stream slices, and the passes over it.

Instructions are verbs (``SetCurrentStream``, ``Synchronize``), values are nouns (a tensor
name, ``Stream(i % 4)``, the caller's stream ``main_stream``). ``str(program)`` is the one
official dump: one node per line, loop bodies indented; the C++ renderer puts each of these
lines above the statements it emits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from .errors import InternalError
from .ir import DTYPE_NAMES, Const, Expr, ParallelType, minimum

MAIN_STREAM = "main_stream"

# ---------------------------------------------------------------------------- values


@dataclasses.dataclass(frozen=True)
class Stream:
    """A worker stream from PyTorch's pool: ``Stream(i % pool)`` or ``Stream(i)``."""

    index: str
    pool: int | None = None

    def __str__(self) -> str:
        return f"Stream({self.index} % {self.pool})" if self.pool else f"Stream({self.index})"


StreamRef = Stream | str  # a worker stream, or the named value of GetCurrentStream


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[Expr, ...]

    def type_str(self) -> str:
        return f"{DTYPE_NAMES[self.dtype]}[{', '.join(map(str, self.shape))}]"


# ---------------------------------------------------------------------------- nodes


class Node:
    def children(self) -> list[Node]:
        return []

    def uses(self) -> list[str]:
        """Tensor values this node reads."""
        return []

    def defines(self) -> list[str]:
        """Tensor values this node defines."""
        return []


@dataclasses.dataclass(eq=False)
class Allocate(Node):
    out: TensorInfo

    def defines(self) -> list[str]:
        return [self.out.name]

    def __str__(self) -> str:
        return f"{self.out.name} = Allocate({self.out.type_str()})"


@dataclasses.dataclass(eq=False)
class Deallocate(Node):
    tensor: str

    def uses(self) -> list[str]:
        return [self.tensor]

    def __str__(self) -> str:
        return f"Deallocate({self.tensor})"


@dataclasses.dataclass(eq=False)
class GetCurrentStream(Node):
    out: str = MAIN_STREAM

    def __str__(self) -> str:
        return f"{self.out} = GetCurrentStream()"


@dataclasses.dataclass(eq=False)
class SetCurrentStream(Node):
    stream: StreamRef

    def __str__(self) -> str:
        return f"SetCurrentStream({self.stream})"


@dataclasses.dataclass(eq=False)
class Synchronize(Node):
    """The current stream waits for ``stream`` (an event wait; the host never blocks)."""

    stream: StreamRef

    def __str__(self) -> str:
        return f"Synchronize({self.stream})"


@dataclasses.dataclass(eq=False)
class ForLoop(Node):
    index: str
    start: Expr
    stop: Expr
    body: list[Node]
    parallel: ParallelType = ParallelType.Serial

    def children(self) -> list[Node]:
        return self.body

    def __str__(self) -> str:
        tag = " [Stream]" if self.parallel is ParallelType.Stream else ""
        return f"for {self.index} in range({self.start}, {self.stop}){tag}:"


@dataclasses.dataclass(eq=False)
class ShardByStream(Node):
    """``out`` = slice ``index`` of ``tensor`` along ``axis``: elements
    ``[index*chunk, min((index+1)*chunk, n))``, clamped to n (so it may be empty)."""

    out: str
    tensor: str
    axis: int
    index: str
    chunk: Expr

    def uses(self) -> list[str]:
        return [self.tensor]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        return (f"{self.out} = ShardByStream({self.tensor}, axis={self.axis}, "
                f"index={self.index}, chunk={self.chunk})")


@dataclasses.dataclass(eq=False)
class Matmul(Node):
    """``out`` (already allocated, possibly a slice) = ``a @ b``."""

    out: str
    a: str
    b: str

    def uses(self) -> list[str]:
        return [self.a, self.b, self.out]

    def __str__(self) -> str:
        return f"Matmul({self.a}, {self.b}, out={self.out})"


@dataclasses.dataclass(eq=False)
class Linear(Node):
    """``out`` = ``x @ w.T (+ bias)``."""

    out: str
    x: str
    w: str
    bias: str | None = None

    def uses(self) -> list[str]:
        return [self.x, self.w] + ([self.bias] if self.bias else []) + [self.out]

    def __str__(self) -> str:
        bias = f", {self.bias}" if self.bias else ""
        return f"Linear({self.x}, {self.w}{bias}, out={self.out})"


# ---------------------------------------------------------------------------- program


@dataclasses.dataclass(frozen=True)
class Constraint:
    """Two extents an op needs equal, that the input checks do not already tie."""

    lhs: Expr
    rhs: Expr
    what: str  # e.g. "matmul T2: T0 axis 1 and T1 axis 0"


@dataclasses.dataclass(eq=False)
class HostProgram:
    name: str
    inputs: list[TensorInfo]
    outputs: list[str]
    body: list[Node]
    constraints: list[Constraint] = dataclasses.field(default_factory=list)
    pool_size: int = 4
    gemm_sm_count: int = 0  # SMs each GEMM may use (cuBLASLt's SM_COUNT_TARGET); 0 = all

    def nodes(self) -> Iterator[Node]:
        """Every node in program order, loop bodies included (pre-order)."""

        def walk(nodes: list[Node]) -> Iterator[Node]:
            for n in nodes:
                yield n
                yield from walk(n.children())

        yield from walk(self.body)

    def replace(self, **changes: object) -> HostProgram:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def allocations(self) -> dict[str, TensorInfo]:
        return {n.out.name: n.out for n in self.nodes() if isinstance(n, Allocate)}

    def signature(self) -> str:
        args = ", ".join(f"{t.name}: {t.type_str()}" for t in self.inputs)
        budget = f" [gemm_sm_count={self.gemm_sm_count}]" if self.gemm_sm_count else ""
        return f"HostProgram {self.name}({args}) -> ({', '.join(self.outputs)}){budget}:"

    def __str__(self) -> str:
        lines = [self.signature()]

        def emit(nodes: list[Node], depth: int) -> None:
            for n in nodes:
                lines.append("  " * depth + str(n))
                emit(n.children(), depth + 1)

        emit(self.body, 1)
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- verify


def verify(program: HostProgram) -> HostProgram:
    """Checks the invariants every pass must keep: each tensor is defined before it is
    used, defined once per scope, and stream nodes name a stream that exists."""
    has_main = False

    def check(nodes: list[Node], scope: set[str], in_loop: bool) -> set[str]:
        """Returns what is defined after ``nodes``."""
        nonlocal has_main
        local = set(scope)
        for n in nodes:
            for u in n.uses():
                if u not in local:
                    raise InternalError(f"{n}: uses {u} before it is defined\n{program}")
            for d in n.defines():
                if d in local:
                    raise InternalError(f"{n}: redefines {d}\n{program}")
                local.add(d)
            if isinstance(n, GetCurrentStream):
                has_main = True
            if isinstance(n, (SetCurrentStream, Synchronize)):
                s = n.stream
                if isinstance(s, str) and not has_main:
                    raise InternalError(f"{n}: {s} is not defined\n{program}")
                if isinstance(s, Stream) and not in_loop:
                    raise InternalError(f"{n}: worker stream outside a loop\n{program}")
            if isinstance(n, ForLoop):
                check(n.body, local, True)
            if isinstance(n, Deallocate):
                local.discard(n.tensor)
        return local

    defined = check(program.body, {t.name for t in program.inputs}, False)
    for o in program.outputs:
        if o not in defined:
            raise InternalError(f"output {o} is not defined at the end\n{program}")
    return program


# ---------------------------------------------------------------------------- passes

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


def assign_streams(program: HostProgram) -> HostProgram:
    """Puts each stream loop's iteration on a worker stream from a bounded pool.

    Before:  for i in range(0, 8) [Stream]:  Matmul(...)
    After:   for i in range(0, 8) [Stream]:  SetCurrentStream(Stream(i % 4)); Matmul(...)
    (``Stream(i)`` when the loop never has more iterations than the pool.)
    """
    pool = program.pool_size

    def assign(loop: ForLoop) -> list[Node]:
        fits = isinstance(loop.stop, Const) and loop.stop.value <= pool
        stream = Stream(loop.index, None if fits else pool)
        body = [SetCurrentStream(stream), *loop.body]
        return [dataclasses.replace(loop, body=body)]

    return _map_stream_loops(program, assign)


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
    worker (join), so the caller can consume the outputs on its own stream.
    """
    pool = program.pool_size
    used = False

    def fork_join(loop: ForLoop) -> list[Node]:
        nonlocal used
        used = True
        n_streams = minimum(loop.stop, Const(pool))
        fork = ForLoop("j", Const(0), n_streams,
                       [SetCurrentStream(Stream("j")), Synchronize(MAIN_STREAM)])
        join = ForLoop("j", Const(0), n_streams, [Synchronize(Stream("j"))])
        return [fork, loop, SetCurrentStream(MAIN_STREAM), join]

    out = _map_stream_loops(program, fork_join)
    if used:
        out = out.replace(body=[GetCurrentStream(MAIN_STREAM), *out.body])
    return out


def remove_dead_code(program: HostProgram) -> HostProgram:
    """Drops views and allocations that nothing reads (and their Deallocate).

    Before:  T3_i = ShardByStream(T3, ...)   # T3_i never used
    After:   (gone)
    """

    def used_names(nodes: list[Node]) -> set[str]:
        names: set[str] = set()
        for n in nodes:
            if not isinstance(n, Deallocate):
                names.update(n.uses())
            names |= used_names(n.children())
        return names

    live = used_names(program.body) | set(program.outputs)

    def keep(nodes: list[Node]) -> list[Node]:
        kept: list[Node] = []
        for n in nodes:
            if isinstance(n, (ShardByStream, Allocate)) and not set(n.defines()) & live:
                continue
            if isinstance(n, Deallocate) and n.tensor not in live:
                continue
            if isinstance(n, ForLoop):
                n = dataclasses.replace(n, body=keep(n.body))
            kept.append(n)
        return kept

    return program.replace(body=keep(program.body))


HOSTIR_PASSES: tuple[HostPass, ...] = (remove_dead_code, assign_streams, insert_fork_join)


# ---------------------------------------------------------------------------- input checks


@dataclasses.dataclass(frozen=True)
class DimCheck:
    """One check of an input size, in order: ``fixed`` compares with a constant, ``bind``
    names a symbol from the size (its first use), ``same`` compares with a bound symbol."""

    tensor: str
    axis: int
    kind: str  # "fixed" | "bind" | "same"
    value: Expr


def dim_checks(program: HostProgram) -> list[DimCheck]:
    """The size checks of the inputs, shared by the evaluator and the generated C++."""
    bound: set[str] = set()
    checks: list[DimCheck] = []
    for t in program.inputs:
        for axis, e in enumerate(t.shape):
            if isinstance(e, Const):
                checks.append(DimCheck(t.name, axis, "fixed", e))
            else:
                name = str(e)
                checks.append(DimCheck(t.name, axis, "same" if name in bound else "bind", e))
                bound.add(name)
    return checks
