"""Fusion IR: tensors, IterDomains, splits, ops. No CUDA here.

A TensorView has a *logical* domain (its shape, plus the reduction axis of the op that
defines it) and a *loop* domain, derived from the logical one by splits and reorders.
Scheduling one loop IterDomain with ``ParallelType.Stream`` asks the lowering to run the
op as a loop over stream slices of the logical axis that IterDomain came from.

Extents are small integer expressions (:class:`Expr`): constants, named symbols (a ``str``
extent of :func:`input`; the same name means the same size), and ``ceilDiv`` after a split.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import enum
import re
from collections.abc import Iterator, Mapping, Sequence

import torch

from ..errors import ScheduleError
from . import ops as ops_
from .ops import DTYPE_NAMES, AxisGroup, OpDef

# ---------------------------------------------------------------------------- extents


# The longest Fusion name: it names the build's files (with a digest and suffixes).
MAX_NAME = 120
# The most slices an outer split makes (each costs microseconds of host time).
MAX_SLICES = 65536


class Expr:
    """An integer expression over named extents. Immutable, hashable, printable."""

    def evaluate(self, env: Mapping[str, int]) -> int:
        raise NotImplementedError

    def symbols(self) -> Iterator[str]:
        yield from ()


@dataclasses.dataclass(frozen=True)
class Const(Expr):
    value: int

    def evaluate(self, env: Mapping[str, int]) -> int:
        return self.value

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class Sym(Expr):
    name: str

    def evaluate(self, env: Mapping[str, int]) -> int:
        return env[self.name]

    def symbols(self) -> Iterator[str]:
        yield self.name

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class BinaryExpr(Expr):
    lhs: Expr
    rhs: Expr

    def symbols(self) -> Iterator[str]:
        yield from self.lhs.symbols()
        yield from self.rhs.symbols()


class CeilDiv(BinaryExpr):
    def evaluate(self, env: Mapping[str, int]) -> int:
        return -(-self.lhs.evaluate(env) // self.rhs.evaluate(env))

    def __str__(self) -> str:
        return f"ceilDiv({self.lhs}, {self.rhs})"


class Mul(BinaryExpr):
    def evaluate(self, env: Mapping[str, int]) -> int:
        return self.lhs.evaluate(env) * self.rhs.evaluate(env)

    def __str__(self) -> str:
        return f"{self.lhs} * {self.rhs}"


class Min(BinaryExpr):
    def evaluate(self, env: Mapping[str, int]) -> int:
        return min(self.lhs.evaluate(env), self.rhs.evaluate(env))

    def __str__(self) -> str:
        return f"min({self.lhs}, {self.rhs})"


def ceil_div(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(-(-a.value // b.value))
    if b == Const(1):
        return a
    return CeilDiv(a, b)


def mul_extents(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value * b.value)
    if a == Const(1):
        return b
    if b == Const(1):
        return a
    return Mul(a, b)


def minimum(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(min(a.value, b.value))
    if a == b:
        return a
    return Min(a, b)


# ---------------------------------------------------------------------------- domains


class IterType(enum.Enum):
    Iteration = "i"
    Reduction = "r"


class ParallelType(enum.Enum):
    Serial = "S"
    Stream = "Stream"
    DIDx = "DIDx"  # across the ranks of the tensor's DeviceMesh (the argument is the local shard)


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """The ranks a tensor is spread over: ranks ``0 .. size-1`` of the process group the
    program is called with (the default group unless one is given). A loop axis made by
    ``outer_split(axis, size)`` and parallelized on ``ParallelType.DIDx`` is sharded: rank
    r holds block r of that axis, and the op's argument is that local block."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ScheduleError(f"DeviceMesh: size must be an int >= 1, got {self.size!r}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size))

    def __str__(self) -> str:
        return f"DeviceMesh({self.size})"


@dataclasses.dataclass(eq=False)
class IterDomain:
    """One axis of a domain. ``definition`` is the split that produced it, if any."""

    extent: Expr
    iter_type: IterType = IterType.Iteration
    parallel_type: ParallelType = ParallelType.Serial
    definition: Split | None = None
    owner: TensorView | None = dataclasses.field(default=None, repr=False)

    @property
    def is_reduction(self) -> bool:
        return self.iter_type is IterType.Reduction

    @property
    def is_stream(self) -> bool:
        return self.parallel_type is ParallelType.Stream

    def parallelize(self, parallel_type: ParallelType) -> IterDomain:
        """Marks this loop axis; ``ParallelType.Stream`` runs its slices on CUDA streams."""
        if not isinstance(parallel_type, ParallelType):
            raise ScheduleError(
                f"parallelize expects a cg.ParallelType, got {parallel_type!r}"
            )
        owner = self.owner
        if owner is not None and self not in owner.loop:
            raise ScheduleError(
                f"{self} is no longer in {owner.name}'s loop domain {owner.loop_str()} (it "
                f"was split); parallelize one of the axes returned by {owner.name}.axis(i)"
            )
        where = f"{owner.name} axis {owner.loop.index(self)} ({self})" if owner else str(self)
        if parallel_type is ParallelType.Stream:
            if self.is_reduction:
                raise ScheduleError(
                    f"{where}: a reduction axis cannot be stream-parallel (that would be a "
                    "split-K across streams, which codegen does not implement); put the "
                    "stream on an iteration axis of the output instead"
                )
            if owner is not None:
                other = owner.stream_id()
                if other is not None and other is not self:
                    raise ScheduleError(
                        f"{where}: {owner.name} already has a stream axis at loop position "
                        f"{owner.loop.index(other)} ({other}); a tensor can have only one"
                    )
        self.parallel_type = parallel_type
        return self

    def __str__(self) -> str:
        tag = "" if self.parallel_type is ParallelType.Serial else self.parallel_type.value
        return f"{self.iter_type.value}{tag}{{{self.extent}}}"


@dataclasses.dataclass(eq=False)
class Split:
    """``input`` -> (``outer``, ``inner``). An inner split fixes the inner extent to
    ``factor``; an outer split fixes the outer extent. The other is ``ceilDiv``."""

    input: IterDomain
    factor: int
    inner_split: bool
    outer: IterDomain
    inner: IterDomain


# ---------------------------------------------------------------------------- tensors


# Where a fusion input or output lives: "cuda" (the GPU the op runs on) or "cpu" (host
# memory, copied to and from the GPU slice by slice on the slices' streams).
DEVICES = ("cuda", "cpu")


@dataclasses.dataclass(eq=False)
class TensorView:
    name: str
    dtype: torch.dtype
    logical: list[IterDomain]
    definition: Op | None = None
    loop: list[IterDomain] = dataclasses.field(default_factory=list)
    device: str = "cuda"  # residency of an input or output (DEVICES); "cuda" otherwise
    mesh: DeviceMesh | None = None  # set by set_device_mesh; None: not distributed

    def __post_init__(self) -> None:
        if not self.loop:
            self.loop = list(self.logical)
        for i in self.logical:
            i.owner = self

    # -- shape
    @property
    def shape(self) -> list[Expr]:
        """Extents of the non-reduction logical axes: the tensor's runtime shape."""
        return [i.extent for i in self.logical if not i.is_reduction]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # -- scheduling
    def set_device_mesh(self, mesh: DeviceMesh) -> TensorView:
        """Places this tensor on ``mesh`` (see codegen.distributed)."""
        if not isinstance(mesh, DeviceMesh):
            raise ScheduleError(f"{self.name}.set_device_mesh expects a cg.DeviceMesh, got "
                                f"{mesh!r}")
        self.mesh = mesh
        return self

    def _loop_axis(self, axis: int, what: str) -> int:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ScheduleError(f"{self.name}.{what}: axis must be an int, got {axis!r}")
        n = len(self.loop)
        if not -n <= axis < n:
            raise ScheduleError(
                f"{self.name}.{what}: axis {axis} is out of range for a loop domain of "
                f"{n} axes {self.loop_str()}"
            )
        return axis % n

    def axis(self, axis: int) -> IterDomain:
        """The loop IterDomain at ``axis`` (negative counts from the end)."""
        return self.loop[self._loop_axis(axis, "axis")]

    def _split(self, axis: int, factor: int, inner_split: bool) -> TensorView:
        what = "split" if inner_split else "outer_split"
        pos = self._loop_axis(axis, what)
        if isinstance(factor, bool) or not isinstance(factor, int):
            raise ScheduleError(
                f"{self.name}.{what}(axis={axis}): factor must be an int, got {factor!r}"
            )
        if factor < 1:
            raise ScheduleError(
                f"{self.name}.{what}(axis={axis}): factor must be >= 1, got {factor}"
            )
        if not inner_split and factor > MAX_SLICES:  # each slice costs host time
            raise ScheduleError(f"{self.name}.outer_split(axis={axis}): factor (the number of "
                                f"slices) must be at most {MAX_SLICES}, got {factor}")
        parent = self.loop[pos]
        if parent.is_stream:
            raise ScheduleError(
                f"{self.name}.{what}(axis={axis}): {parent} is already stream-parallel; "
                "split first, then parallelize one of the results"
            )
        fixed, rest = Const(factor), ceil_div(parent.extent, Const(factor))
        outer_extent, inner_extent = (rest, fixed) if inner_split else (fixed, rest)
        outer = IterDomain(outer_extent, parent.iter_type, owner=self)
        inner = IterDomain(inner_extent, parent.iter_type, owner=self)
        split = Split(parent, factor, inner_split, outer, inner)
        outer.definition = inner.definition = split
        self.loop[pos : pos + 1] = [outer, inner]
        return self

    def split(self, axis: int, factor: int) -> TensorView:
        """Inner split: loop axis of extent n becomes ``[ceilDiv(n, factor), factor]``."""
        return self._split(axis, factor, inner_split=True)

    def outer_split(self, axis: int, factor: int) -> TensorView:
        """Outer split: loop axis of extent n becomes ``[factor, ceilDiv(n, factor)]``."""
        return self._split(axis, factor, inner_split=False)

    def reorder(self, order: Mapping[int, int] | Sequence[int]) -> TensorView:
        """``{old: new}`` moves the named axes (others keep their relative order), or a
        full permutation: the old positions in their new order."""
        n = len(self.loop)
        if not isinstance(order, (Mapping, Sequence)) or isinstance(order, str):
            raise ScheduleError(f"{self.name}.reorder: expected {{old: new}} positions or a "
                                f"permutation of 0..{n - 1}, got {order!r}")
        if isinstance(order, Mapping):
            moves = {self._loop_axis(o, "reorder"): self._loop_axis(d, "reorder")
                     for o, d in order.items()}
            if len(set(moves.values())) != len(moves):
                raise ScheduleError(
                    f"{self.name}.reorder({dict(order)}): two axes moved to one position"
                )
            rest = iter(i for i in range(n) if i not in moves)
            by_new = {d: o for o, d in moves.items()}
            perm = [by_new[p] if p in by_new else next(rest) for p in range(n)]
        else:
            perm = [self._loop_axis(o, "reorder") for o in order]
            if sorted(perm) != list(range(n)):
                raise ScheduleError(
                    f"{self.name}.reorder({list(order)}): expected a permutation of "
                    f"0..{n - 1}"
                )
        self.loop = [self.loop[p] for p in perm]
        return self

    def stream_id(self) -> IterDomain | None:
        """The stream IterDomain wherever it is in the loop domain (not only in front)."""
        found = [i for i in self.loop if i.is_stream]
        return found[0] if found else None

    # -- printing
    def loop_str(self) -> str:
        return "[" + ", ".join(map(str, self.loop)) + "]"

    def logical_str(self) -> str:
        return "[" + ", ".join(map(str, self.logical)) + "]"

    def __str__(self) -> str:
        text = f"{self.name}: {DTYPE_NAMES[self.dtype]}{self.logical_str()}"
        if self.loop != self.logical:
            text += f" loop {self.loop_str()}"
        if self.device != "cuda":
            text += f" device={self.device}"
        if self.mesh is not None:
            text += f" on {self.mesh}"
        return text


# ---------------------------------------------------------------------------- ops


@dataclasses.dataclass(eq=False)
class Op:
    """``out = defn(args, attrs)``: one op of the fusion, of the kind ``defn`` (see
    codegen.frontend.ops: its operands, axis roles, dtype rule and semantics). ``args`` maps the
    definition's operand names to tensors (an absent optional operand is not a key);
    ``op.<operand>`` reads them (None for an absent optional one)."""

    defn: OpDef
    args: dict[str, TensorView]
    attrs: dict[str, object] = dataclasses.field(default_factory=dict)
    out: TensorView = None  # type: ignore[assignment]  # set by _define

    def __getattr__(self, name: str) -> TensorView | None:
        args, defn = self.__dict__.get("args"), self.__dict__.get("defn")
        if args is not None and name in args:
            return args[name]
        if defn is not None and name in defn.optional:
            return None
        raise AttributeError(name)

    def operands(self) -> dict[str, TensorView]:
        return {**self.args, "out": self.out}

    def axes(self) -> list[AxisGroup]:
        """The role of every axis: iteration groups (with the operand axes that index each
        output axis) and reductions (see ops.AxisGroup)."""
        return self.defn.axes({n: t.ndim for n, t in self.args.items()}, self.attrs)

    def iteration_groups(self) -> list[tuple[tuple[str, int], ...]]:
        return [g.members for g in self.axes() if not g.reduction]

    def inputs(self) -> list[TensorView]:
        return list(self.args.values())

    @property
    def kind(self) -> str:
        return self.defn.node

    def __str__(self) -> str:
        args = [t.name for t in self.inputs()]
        args += [f"{k}={ops_.attr_str(v)}" for k, v in self.attrs.items()]
        return f"{self.out.name} = {self.defn.name}({', '.join(args)})"


# ---------------------------------------------------------------------------- fusion

_current: contextvars.ContextVar[Fusion | None] = contextvars.ContextVar(
    "codegen_fusion", default=None
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Fusion:
    """A tensor program. Use as a context manager around ``input``/ops/``output``."""

    def __init__(self, name: str = "fusion") -> None:
        if not isinstance(name, str) or not _IDENT.fullmatch(name):
            raise ScheduleError(
                f"Fusion name must be a C identifier (letters, digits, _), got {name!r}"
            )
        if len(name) > MAX_NAME:  # it names the build's files, with a digest and suffixes
            raise ScheduleError(f"Fusion name must be at most {MAX_NAME} characters, got "
                                f"{len(name)} ({name[:24]}...)")
        self.name = name
        self.inputs: list[TensorView] = []
        self.outputs: list[TensorView] = []
        self.ops: list[Op] = []
        # every input extent symbol -> whether codegen named it (a free extent, None)
        self._symbols: dict[str, bool] = {}
        self._token: contextvars.Token | None = None
        self._reserved: set[str] = set()  # names automatic names skip (still free to take)

    def __enter__(self) -> Fusion:
        if _current.get() is not None:
            raise ScheduleError("Fusion contexts cannot be nested")
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._token = None

    @property
    def tensors(self) -> list[TensorView]:
        """Every tensor in definition order: inputs first, then op outputs."""
        return self.inputs + [op.out for op in self.ops]

    def _fresh_name(self) -> str:
        """``T<n>``, n the tensor's position in definition order, or the next n whose name
        no tensor has taken (an explicit ``name=`` may have taken it) nor is reserved."""
        taken = {t.name for t in self.tensors} | self._reserved
        n = len(self.tensors)
        while f"T{n}" in taken:
            n += 1
        return f"T{n}"

    def _check_name(self, name: object) -> str:
        """An explicit tensor name: an identifier that no tensor of the fusion has yet."""
        if not isinstance(name, str) or not _IDENT.fullmatch(name):
            raise ScheduleError(
                f"tensor name must be an identifier (a letter or _, then letters, digits or "
                f"_), got {name!r}"
            )
        if any(t.name == name for t in self.tensors):
            raise ScheduleError(
                f"tensor name {name!r} is already taken in Fusion {self.name} (explicit "
                "names must be unique, and automatic names T<n> skip the names taken); "
                "choose another name"
            )
        return name

    def _extent_name(self, tensor: str, axis: int, name: object,
                     known: dict[str, bool]) -> str:
        """The symbol of an input extent: ``name`` (the user's str), or for a free extent
        (None) ``<tensor>_size<axis>``, suffixed ``_2``, ``_3``, ... while that is taken.
        ``known`` maps the symbols so far to whether codegen made them (free); this adds
        the result. A user's name may not be one made for a free extent: that would
        silently tie the two sizes."""
        if name is None:
            base = candidate = f"{tensor}_size{axis}"
            n = 2
            while candidate in known:
                candidate, n = f"{base}_{n}", n + 1
            known[candidate] = True
            return candidate
        if not isinstance(name, str) or not _IDENT.fullmatch(name):
            raise ScheduleError(
                f"input {tensor}: extent name {name!r} (axis {axis}) must be an identifier "
                "(a letter or _, then letters, digits or _)"
            )
        if known.get(name):
            raise ScheduleError(
                f"input {tensor}: extent name {name!r} (axis {axis}) is the name given to a "
                "free extent (None) defined before it; naming it would tie the two sizes. "
                "Choose another name, or give both axes one str name"
            )
        known[name] = False
        return name

    def clone(self) -> Fusion:
        """A deep copy, so that lowering never edits the user's fusion."""
        token, self._token = self._token, None  # a context token cannot be copied
        try:
            return copy.deepcopy(self)
        finally:
            self._token = token

    def symbols(self) -> list[str]:
        """Named extents of the inputs, in first-use order."""
        seen: dict[str, None] = {}
        for t in self.inputs:
            for e in t.shape:
                for s in e.symbols():
                    seen.setdefault(s)
        return list(seen)

    def __str__(self) -> str:
        lines = [f"Fusion {self.name}:"]
        for t in self.inputs:
            lines.append(f"  input {t}")
        for op in self.ops:
            lines.append(f"  {op}  # {op.out}")
        lines.append("  outputs " + ", ".join(t.name for t in self.outputs))
        return "\n".join(lines)


def current_fusion(what: str) -> Fusion:
    fusion = _current.get()
    if fusion is None:
        raise ScheduleError(f"cg.{what} must be called inside `with cg.Fusion(...)`")
    return fusion


def _owned(fusion: Fusion, t: object, op: str, arg: str) -> TensorView:
    if not isinstance(t, TensorView):
        raise ScheduleError(f"{op}: argument {arg} must be a tensor of the fusion, got "
                            f"{type(t).__name__}")
    if t not in fusion.tensors:
        raise ScheduleError(f"{op}: argument {arg} ({t.name}) belongs to another Fusion")
    return t


def _check_device(device: object, what: str) -> str:
    """``device`` as a residency ("cuda" or "cpu"), or a ScheduleError naming ``what``."""
    if isinstance(device, str) and device in DEVICES:
        return device
    hint = ""
    if isinstance(device, (str, torch.device)) and str(device).startswith("cuda:"):
        hint = " (the GPU is the one the inputs are on at run time; say \"cuda\")"
    raise ScheduleError(
        f"{what}: device must be \"cuda\" (GPU memory) or \"cpu\" (host memory, streamed "
        f"through the GPU slice by slice), got {device!r}{hint}"
    )


def input(  # noqa: A001 - the public API
    shape: Sequence[int | str | None], dtype: torch.dtype = torch.float32,
    name: str | None = None, device: str = "cuda",
) -> TensorView:
    """A fusion input. Extents: int = fixed, str = named symbol, None = free.
    ``device="cpu"`` declares it host-resident: the program copies what each slice reads
    to the GPU on that slice's stream (``evaluate`` then needs a CPU tensor there)."""
    fusion = current_fusion("input")
    name = fusion._fresh_name() if name is None else fusion._check_name(name)
    device = _check_device(device, f"input {name}")
    if dtype not in DTYPE_NAMES:
        raise ScheduleError(
            f"input {name}: dtype {dtype} is not supported; use one of "
            + ", ".join(DTYPE_NAMES.values())
        )
    if isinstance(shape, (str, int)) or not isinstance(shape, Sequence):
        raise ScheduleError(f"input {name}: shape must be a list, got {shape!r}")
    ids = []
    known = dict(fusion._symbols)  # committed only if the whole input is valid
    for d, e in enumerate(shape):
        if e is None:
            extent: Expr = Sym(fusion._extent_name(name, d, None, known))
        elif isinstance(e, bool):
            raise ScheduleError(f"input {name}: extent {d} must be int, str or None, got {e!r}")
        elif isinstance(e, int):
            if e < 0:
                raise ScheduleError(f"input {name}: extent {d} must be >= 0, got {e}")
            extent = Const(e)
        elif isinstance(e, str):
            extent = Sym(fusion._extent_name(name, d, e, known))
        else:
            raise ScheduleError(
                f"input {name}: extent {d} must be int, str or None, got {e!r}"
            )
        ids.append(IterDomain(extent))
    t = TensorView(name, dtype, ids, device=device)
    fusion.inputs.append(t)
    fusion._symbols = known
    return t


def _unify(op: str, group: list[tuple[str, TensorView, int]], pointwise: bool = False) -> Expr:
    """The extent of one dimension shared by several operands; fixed sizes must agree. In
    a pointwise op, a size 1 against another size is torch's size-1 broadcasting, which
    codegen does not do (only a vector along the leading axes): refused by name."""
    extents = [(n, t, a, t.shape[a]) for n, t, a in group]
    ones = [x[3] == Const(1) for x in extents]
    if pointwise and any(ones) and not all(ones):
        (n, t, a, _), (n2, t2, a2, e2) = extents[ones.index(True)], extents[ones.index(False)]
        raise ScheduleError(
            f"{op}: {n}={t.name} axis {a} has size 1 where {n2}={t2.name} axis {a2} has "
            f"size {e2}: size-1 broadcasting is not supported (b may only broadcast along "
            f"a's leading axes, a bias [n] against [m, n]); give {t.name} the full size")
    consts = {e.value for *_, e in extents if isinstance(e, Const)}
    if len(consts) > 1:
        found = ", ".join(f"{n}={t.name} axis {a} is {e}" for n, t, a, e in extents)
        raise ScheduleError(f"{op}: sizes that must be equal differ: {found}")
    for *_, e in extents:
        if isinstance(e, Const):
            return e
    return extents[0][3]


def _refuse_quantized(defn: OpDef, args: Mapping[str, TensorView]) -> None:
    """A quantized tensor (fp8, int8) is read only by the operands that say they take one
    (``OpDef.quantized``: dequantize's q)."""
    for n, t in args.items():
        if t.dtype in ops_.QUANTIZED_DTYPES and n not in defn.quantized:
            raise ScheduleError(
                f"{defn.name}: argument {n} ({t.name}) is {DTYPE_NAMES[t.dtype]}, which only "
                f"cg.dequantize reads; dequantize it first (cg.dequantize({t.name}, scale, "
                "...))")


def _define(defn: OpDef, attrs: dict[str, object] | None = None,
            **operands: TensorView | None) -> TensorView:
    """Defines one op of kind ``defn`` in the current fusion: checks its operands (each a
    tensor of the fusion; an optional one may be None) and attributes, and creates its
    output from the definition's axis roles and dtype rule."""
    fusion = current_fusion(defn.name)
    args = {n: _owned(fusion, t, defn.name, n) for n, t in operands.items()
            if t is not None or n not in defn.optional}
    attrs = dict(attrs or {})
    defn.check(args, attrs)
    _refuse_quantized(defn, args)
    dtype = defn.dtype(args, attrs)
    op = Op(defn, args, attrs)
    out_ids: dict[int, IterDomain] = {}
    for group in op.axes():
        extent = _unify(defn.name, [(n, args[n], a) for n, a in group.inputs()],
                        defn.family == "pointwise")
        kind = IterType.Reduction if group.reduction else IterType.Iteration
        out_ids[group.output_axis()] = IterDomain(extent, kind)
    op.out = TensorView(fusion._fresh_name(), dtype, [out_ids[k] for k in sorted(out_ids)],
                        definition=op)
    fusion.ops.append(op)
    return op.out


def matmul(a: TensorView, b: TensorView) -> TensorView:
    """``a @ b`` for 2-D x 2-D, 3-D x 3-D (batched) and 3-D x 2-D."""
    return _define(ops_.MATMUL, a=a, b=b)


def linear(x: TensorView, w: TensorView, bias: TensorView | None = None) -> TensorView:
    """``x @ w.T + bias``: x ``[.., k]`` (2-D or 3-D), w ``[n, k]``, bias ``[n]``."""
    return _define(ops_.LINEAR, x=x, w=w, bias=bias)


def silu(t: TensorView) -> TensorView:
    """``x * sigmoid(x)``, elementwise (torch.nn.functional.silu)."""
    return _define(ops_.SILU, x=t)


def gelu(t: TensorView, approximate: str = "none") -> TensorView:
    """GELU, elementwise: ``approximate="none"`` (the erf form) or ``"tanh"``, as
    torch.nn.functional.gelu."""
    return _define(ops_.GELU, {"approximate": approximate}, x=t)


def relu(t: TensorView) -> TensorView:
    """``max(x, 0)``, elementwise (NaN stays NaN, as torch.relu)."""
    return _define(ops_.RELU, x=t)


def add(a: TensorView, b: TensorView) -> TensorView:
    """``a + b``, elementwise; ``b`` has a's shape or is broadcast along a's leading axes
    (a bias ``[n]`` against ``[m, n]``)."""
    return _define(ops_.ADD, a=a, b=b)


def mul(a: TensorView, b: TensorView) -> TensorView:
    """``a * b``, elementwise; ``b`` as for :func:`add`."""
    return _define(ops_.MUL, a=a, b=b)


def cast(t: TensorView, dtype: torch.dtype) -> TensorView:
    """``t`` converted to ``dtype`` (rounded to nearest even, as ``Tensor.to``)."""
    return _define(ops_.CAST, {"dtype": dtype}, x=t)


def dequantize(q: TensorView, scale: TensorView, *, group_size: int | None = None,
               dtype: torch.dtype = torch.bfloat16) -> TensorView:
    """``q.to(dtype) * scale.to(dtype)``, elementwise: q ``[N, K]`` (float8_e4m3fn, or
    int8: int4 values stored unpacked in int8 are read as they are, not range-checked);
    scale (bfloat16, float16 or float32) ``[N]``, one per row of q, or with
    ``group_size=g`` ``[N, K // g]``, one per group of g elements of a row (K a multiple
    of g). The result is ``dtype`` (bfloat16, float16 or float32), rounded once."""
    return _define(ops_.DEQUANTIZE, {"group_size": group_size, "dtype": dtype}, q=q,
                   scale=scale)


def output(t: TensorView, device: str = "cuda") -> None:
    """Marks ``t`` as an output of the fusion (the op returns outputs in this order).
    ``device="cpu"`` returns it in (pinned) host memory, copied back slice by slice on
    the slices' streams; it is complete when the op returns."""
    fusion = current_fusion("output")
    t = _owned(fusion, t, "output", "t")
    device = _check_device(device, f"output {t.name}")
    if t.definition is None:
        raise ScheduleError(
            f"output: {t.name} is a fusion input; outputs must be computed by an op"
        )
    if t in fusion.outputs:
        raise ScheduleError(f"output: {t.name} is already an output")
    t.device = device
    fusion.outputs.append(t)
