"""HostProgram -> plain data -> Jinja templates -> one C++ translation unit.

Every decision is made here, in Python, where it is tested: C++ names, extent
expressions, the cuBLAS data and compute types for a dtype, which input checks run, the
op's schema. The templates in ``templates/`` hold C++ text and loops over the lists
prepared here; ``nodes.cpp.j2`` has one macro per host-IR node kind. Each emitted
statement is preceded by its host-IR line as a ``// hir:`` comment.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed
from .. import hostir as hir
from ..errors import InternalError
from ..frontend import ops
from ..frontend.ir import DTYPE_NAMES, CeilDiv, Const, Expr, Min, Mul, Sym
from . import digest

if TYPE_CHECKING:
    import jinja2

NAMESPACE = "codegen"

# dtype -> the runtime's DType (codegen/backend/include/codegen/tensor.h). The cuBLAS data and
# accumulate types follow from it and from torch's precision flags at call time
# (rt::gemm_type): fp16 and bf16 accumulate in fp32; fp32 uses TF32 only when allowed.
DTYPES: dict[torch.dtype, str] = {
    torch.float32: "rt::DType::Float32",
    torch.float16: "rt::DType::Float16",
    torch.bfloat16: "rt::DType::BFloat16",
    torch.float64: "rt::DType::Float64",
    torch.float8_e4m3fn: "rt::DType::Float8E4M3FN",
    torch.int8: "rt::DType::Int8",
}

# Identifiers the generated function uses itself, C++ keywords and common macros: a
# program symbol (tensor, view, extent) spelled like one of these is renamed in the C++
# (``op`` -> ``op_``); messages keep the user's spelling.
_RESERVED = frozenset("""
    op device device_guard gemms streams main_stream group_name i j rt codegen_rt torch std
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast
    else enum explicit export extern false float for friend goto if inline int long
    mutable namespace new noexcept not not_eq nullptr operator or or_eq private
    protected public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try
    typedef typeid typename union unsigned using virtual void volatile wchar_t while xor
    xor_eq NULL EOF assert errno stdin stdout stderr int8_t int16_t int32_t int64_t
    uint8_t uint16_t uint32_t uint64_t size_t CG_CHECK TORCH_BOX
    False None True as async await def del elif except finally from global import in is
    lambda nonlocal pass raise with yield print Tensor str Any List Optional Scalar Device
""".split())  # the last two lines: words torch's schema parser refuses as argument names

# The op argument that names the process group of a program's collectives; torch names
# the default group "0".
GROUP_PARAM = "group_name"
DEFAULT_GROUP = "0"

# Suffixes of C++ names derived from a symbol (``T0_arg`` is the parameter of ``T0``).
_DERIVED = ("_arg",)


def template_dir() -> Path:
    """The Jinja templates (``codegen/backend/templates``), shipped with the package."""
    return Path(__file__).resolve().parent / "templates"


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2  # only when rendering: a cached op loads without it

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


# Modules that cannot change a program's C++ (they build, run, time or show it), by path in
# the package; every other module of the package (subpackages included) is hashed into the
# op name, new ones included by default.
# (the build's flags key the build cache instead.)
_NOT_SHAPING_CPP = frozenset({"tools/timeline.py", "tools/demo.py", "tools/cli.py",
                              "tools/timing.py", "distributed/evaluation.py", "__init__.py",
                              "__main__.py", "version.py"})
# Stages that only build, run or call compiled programs (building, the call-time policy,
# the interpreters, offloading a model), likewise.
_NOT_SHAPING_PACKAGES = ("jit/", "runtime/", "interp/", "nn/")


def include_dir() -> Path:
    """The runtime headers (``codegen/backend/include``), on the include path of every
    build."""
    return Path(__file__).resolve().parent / "include"


@functools.cache
def _renderer_digest() -> str:
    """A hash of everything besides the program that the C++ depends on: the templates,
    the runtime headers and the package's modules (a change to a pass can change the
    program without changing the renderer)."""
    package = Path(__file__).resolve().parent.parent
    modules = [p for p in sorted(package.rglob("*.py"))
               if p.relative_to(package).as_posix() not in _NOT_SHAPING_CPP
               and not p.relative_to(package).as_posix().startswith(_NOT_SHAPING_PACKAGES)]
    return _files_digest([*sorted(template_dir().glob("*.j2")), *modules],
                         runtime_headers_digest())


@functools.cache
def runtime_headers_digest() -> str:
    """A hash of the runtime headers (``include_dir()``): part of the op name, and the
    version of what the programs in a process share (``CODEGEN_RT_ABI``,
    codegen/jit/compiler.py)."""
    return _files_digest(sorted(include_dir().rglob("*.h")))


def _files_digest(files: list[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for e in extra:
        h.update(e.encode() + b"\0")
    return h.hexdigest()


def program_digest(program: hir.HostProgram) -> str:
    """The full hash of what the C++ of ``program`` is made from: every field of the
    program and of each of its nodes (``digest.canonical``: options, constraints and
    what ``str(program)`` does not print included), and the renderer. The build cache
    stores it and compares it on load."""
    text = f"{digest.canonical(program)}\n{_renderer_digest()}"
    return hashlib.sha256(text.encode()).hexdigest()


def op_name(program: hir.HostProgram) -> str:
    """``<program>_<hash>``: unique per program and renderer; stable across runs and
    processes, so it also keys the build cache."""
    return f"{program.name}_{program_digest(program)[:12]}"


# ---------------------------------------------------------------------------- names


@dataclasses.dataclass
class _Names:
    """C++ names of the program's symbols. Tensor values (inputs, allocations, views) and
    extents are two namespaces in the host IR (a tensor may be named like an extent:
    ``cg.input(["m", "k"], name="m")``) but one scope in C++, so each gets a spelling of
    its own: its name, unless that collides with a reserved word, a name the generated
    code derives from another symbol, or a symbol spelled before it (tensors first); then
    it gets trailing ``_``s."""

    cpp: dict[str, str]  # tensor values
    extents: dict[str, str]

    @classmethod
    def of(cls, program: hir.HostProgram) -> _Names:
        values = [t.name for t in program.inputs] + list(program.allocations())
        values += [d for n in program.nodes() for d in n.defines()]
        extents = [str(c.value) for c in hir.dim_checks(program) if c.kind == "bind"]
        taken: set[str] = set(_RESERVED)

        def spell(names: list[str]) -> dict[str, str]:
            out: dict[str, str] = {}
            for name in dict.fromkeys(names):
                spelled = name
                while {spelled, *(spelled + d for d in _DERIVED)} & taken:
                    spelled += "_"
                taken.update({spelled, *(spelled + d for d in _DERIVED)})
                out[name] = spelled
            return out

        cpp = spell(values)
        return cls(cpp, spell(extents))

    def __call__(self, name: str) -> str:
        return self.cpp[name]

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return str(e.value)
        if isinstance(e, Sym):
            return self.extents.get(e.name, e.name)
        if isinstance(e, CeilDiv):
            return f"rt::ceil_div({self.expr(e.lhs)}, {self.expr(e.rhs)})"
        if isinstance(e, Mul):
            return f"({self.expr(e.lhs)} * {self.expr(e.rhs)})"
        if isinstance(e, Min):
            return f"std::min<int64_t>({self.expr(e.lhs)}, {self.expr(e.rhs)})"
        raise InternalError(f"no C++ for expression {e!r}")


def _cstr(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _message(*parts: str) -> str:
    """The message arguments of a CG_CHECK, ``op, ...``: string literals and C++
    expressions (an expression part is written as ``{expr}``)."""
    out = ["op"]
    for p in parts:
        out.append(p[1:-1] if p.startswith("{") and p.endswith("}") else _cstr(p))
    return ", ".join(out)


# ---------------------------------------------------------------------------- prepare


def _gemm_operands(program: hir.HostProgram) -> set[str]:
    """The tensors a GEMM reads, directly or through views (slices, staging, blocks)."""
    root = hir.view_roots(program)
    found: set[str] = set()
    for n in program.nodes():
        if isinstance(n, hir.Compute) and n.gemm is not None:
            found |= {root.get(a, a) for a in n.gemm.args if isinstance(a, str)}
        elif isinstance(n, distributed.Communication):  # collectives read their views too
            found |= {root.get(u, u) for u in n.uses()}
    return found


def _layout_checks(program: hir.HostProgram, t: hir.TensorInfo, names: _Names,
                   ) -> list[dict[str, str]]:
    """The layout checks of input ``t``. cuBLAS reads a GPU input in place, so its layout
    must suit cuBLAS (``rt::check_matrix``). A host input is read only through its copies
    into dense GPU memory (copy.h), so its layout must suit them (``rt::check_copyable``):
    as a whole where it is copied whole, and as its slices (a full one and the last)
    for each way a stream loop slices it. A GPU input only pointwise kernels read needs
    no check: they take any strides."""
    check = {"name": names(t.name), "arg": _cstr(t.name), "check": "check_matrix", "slices": ""}
    if t.device != "cpu":
        return [check] if t.name in _gemm_operands(program) else []
    check["check"] = "check_copyable"
    ways: list[str] = []
    for n in program.nodes():
        if isinstance(n, hir.ShardByStream) and n.tensor == t.name:
            way = f", /*axis=*/{n.axis}, {names.expr(n.chunk)}"
        elif isinstance(n, hir.Copy) and n.src == t.name:
            way = ""
        else:
            continue
        if way not in ways:
            ways.append(way)
    return [{**check, "slices": way} for way in ways or [""]]


def _input_checks(program: hir.HostProgram, names: _Names) -> dict[str, Any]:
    """Inputs on the GPU are checked first (``rt::input``: CUDA tensors, all on one
    device, which is the op's device); then host inputs (``rt::host_input``: CPU tensors,
    pinned or pageable, see codegen/backend/include/codegen/host.h). With no GPU input the op
    runs on the current CUDA device, as the evaluator does (``program_device``)."""
    def spec(t: hir.TensorInfo) -> dict[str, Any]:
        return {"name": names(t.name), "arg": _cstr(t.name), "dtype": DTYPES[t.dtype],
                "rank": len(t.shape), "type": _cstr(t.type_str())}

    on_gpu = [t for t in program.inputs if t.device == "cuda"]
    inputs = [spec(t) for t in on_gpu]
    host_inputs = [spec(t) for t in program.inputs if t.device == "cpu"]
    first = on_gpu[0].name if on_gpu else ""
    device = (f"{names(first)}.device" if on_gpu
              else "torch::stable::accelerator::getCurrentDeviceIndex()")
    same_device = [{"name": names(t.name), "arg": _cstr(t.name), "first": names(first),
                    "first_arg": _cstr(first)} for t in on_gpu[1:]]
    dims: list[dict[str, str]] = []
    for c in hir.dim_checks(program):
        size = f"{names(c.tensor)}.size({c.axis})"
        if c.kind == "bind":
            dims.append({"bind": names.expr(c.value), "value": size})
            continue
        want = names.expr(c.value)
        expected = ([f": argument {c.tensor} axis {c.axis} must have size {c.value} = ",
                     f"{{{want}}}", ", got "] if c.kind == "same" else
                    [f": argument {c.tensor} axis {c.axis} must have size {want}, got "])
        dims.append({"bind": "", "cond": f"{size} == {want}", "message": _message(
            *expected, f"{{{size}}}", " (shape ", f"{{{names(c.tensor)}.shape()}}", ")")})
    for k in program.constraints:
        lhs, rhs = names.expr(k.lhs), names.expr(k.rhs)
        dims.append({"bind": "", "cond": f"{lhs} == {rhs}", "message": _message(
            f": {k.what} must have equal sizes, got {k.lhs} = ", f"{{{lhs}}}",
            f" and {k.rhs} = ", f"{{{rhs}}}")})
    layouts = [layout for t in program.inputs for layout in _layout_checks(program, t, names)]
    return {"inputs": inputs, "host_inputs": host_inputs, "device": device,
            "same_device": same_device, "dims": dims, "layouts": layouts}


def _stream(ref: hir.StreamRef) -> str:
    if isinstance(ref, str):
        return ref
    if isinstance(ref, hir.CopyStream):
        return f"streams.copy_stream({ref.position_str()})"
    if isinstance(ref, hir.RingStream):
        return "streams.ring_stream()"
    return f"streams.worker({ref.position_str()})"


# The storage and compute types of pointwise kernels (codegen/backend/include/codegen/pointwise.h).
_C_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "float",
            torch.float64: "double", torch.float8_e4m3fn: "f8e4m3", torch.int8: "i8"}

# (source, destination) residency -> the cudaMemcpyKind of a Copy.
_COPY_KINDS = {("cpu", "cuda"): "cudaMemcpyHostToDevice",
               ("cuda", "cpu"): "cudaMemcpyDeviceToHost"}


class _Statements:
    """Flattens the host program into statements with indentation and node fields.

    A node's method returns its fields; a ``kind`` among them picks another macro than
    the node's class name (the variants of Allocate). ``range`` fields name the NVTX
    range of a statement that queues GPU work: the program, the index of the loop it is
    in (the innermost) and its host-IR line."""

    def __init__(self, program: hir.HostProgram, names: _Names) -> None:
        self.program, self.names = program, names
        self.allocations = program.allocations()
        infos = hir.value_infos(program)
        self.devices = {v: t.device for v, t in infos.items()}
        self.stages = {n.stage for n in program.nodes() if isinstance(n, hir.StagingSlot)}
        # A GPU tensor that receives a host input whole takes that input's memory order.
        self.copied_whole = {n.out: n.src for n in program.nodes()
                             if isinstance(n, hir.Copy) and n.out in self.allocations
                             and n.src in {t.name for t in program.inputs}}
        self.loops: list[str] = []
        self.out: list[dict[str, Any]] = []
        # Per value: the tensor it views (a collective needs it) and its rank.
        self.base: dict[str, str] = {}
        self.rank = {t.name: len(t.shape) for t in program.inputs}
        self.rank |= {name: len(t.shape) for name, t in self.allocations.items()}
        self.dtypes = {v: t.dtype for v, t in infos.items()}
        # One rt::Gemms per dtype of the program's GEMMs (its types are read once a call).
        gemm_dtypes = list(dict.fromkeys(self.dtypes[n.out] for n in program.nodes()
                                         if isinstance(n, hir.Compute) and n.gemm))
        self.gemms = {t: "gemms" if len(gemm_dtypes) == 1 else f"gemms_{DTYPE_NAMES[t]}"
                      for t in gemm_dtypes}
        self.kernels: list[dict[str, Any]] = []

    def emit(self, nodes: list[hir.Node], depth: int) -> None:
        for n in nodes:
            kind = "Compute" if isinstance(n, hir.Compute) else type(n).__name__
            fields = getattr(self, kind)(n)
            kind = fields.pop("kind", type(n).__name__)
            self.out.append({"kind": kind, "hir": str(n), "indent": "  " * depth, **fields})
            if isinstance(n, hir.ForLoop):
                self.loops.append(n.index)
                self.emit(n.body, depth + 1)
                self.loops.pop()
                self.out.append({"kind": "EndFor", "hir": "", "indent": "  " * depth})

    def range(self, n: hir.Node) -> str:
        """The arguments of the statement's ``rt::Range``
        (codegen/backend/include/codegen/nvtx.h)."""
        if self.loops:
            index = self.loops[-1]
            return f"op, {_cstr(index)}, {index}, {_cstr(str(n))}"
        return f"op, {_cstr(str(n))}"

    def Allocate(self, n: hir.Allocate) -> dict[str, Any]:
        fields: dict[str, Any] = {"out": self.names(n.out.name),
                                  "sizes": [self.names.expr(e) for e in n.out.shape],
                                  "dtype": DTYPES[n.out.dtype]}
        if n.out.device == "cpu":
            if not n.pinned:
                raise InternalError(f"{n}: host allocations are pinned (host outputs); "
                                    "no C++ for pageable ones\n{self.program}")
            return {**fields, "kind": "AllocatePinned"}
        if n.out.name in self.stages:
            return {**fields, "kind": "AllocateStaging"}
        if n.out.name in self.copied_whole:
            return {**fields, "kind": "AllocateLike",
                    "like": self.names(self.copied_whole[n.out.name])}
        if n.zeroed:
            return {**fields, "kind": "AllocateZeroed"}
        return fields

    def StagingSlot(self, n: hir.StagingSlot) -> dict[str, Any]:
        self.rank[n.out] = self.rank[n.like]
        return {"out": self.names(n.out), "stage": self.names(n.stage),
                "slot": n.slot.slot_str(), "like": self.names(n.like)}

    def RingSlot(self, n: hir.RingSlot) -> dict[str, Any]:
        self.rank[n.out.name] = self.rank[n.like]
        return {"out": self.names(n.out.name), "like": self.names(n.like), "slots": n.slots}

    def ReleaseRingSlot(self, n: hir.ReleaseRingSlot) -> dict[str, Any]:
        return {"slot": self.names(n.slot)}

    def Copy(self, n: hir.Copy) -> dict[str, Any]:
        route = (self.devices[n.src], self.devices[n.out])
        if route not in _COPY_KINDS:
            raise InternalError(f"{n}: a copy from {route[0]} to {route[1]} has no C++ "
                                f"(only host <-> GPU)\n{self.program}")
        return {"out": self.names(n.out), "src": self.names(n.src),
                "copy_kind": _COPY_KINDS[route], "range": self.range(n)}

    def StreamSynchronize(self, n: hir.StreamSynchronize) -> dict[str, Any]:
        # The caller's stream, the program's last node: every stream has joined it (the host
        # IR's order, which codegen.interp.races checks), so the host tensors are done with.
        done = n.stream == hir.MAIN_STREAM and not self.loops and n is self.program.body[-1]
        return {"stream": _stream(n.stream), "range": self.range(n), "host_done": done}

    def Deallocate(self, n: hir.Deallocate) -> dict[str, Any]:
        return {"tensor": self.names(n.tensor)}

    def CreateEvents(self, n: hir.CreateEvents) -> dict[str, Any]:
        return {"out": self.names(n.name), "count": self.names.expr(n.count)}

    def RecordEvent(self, n: hir.RecordEvent) -> dict[str, Any]:
        return {"events": self.names(n.event.name), "position": n.event.position_str()}

    def WaitEvent(self, n: hir.WaitEvent) -> dict[str, Any]:
        return {"events": self.names(n.event.name), "position": n.event.position_str()}

    def GetCurrentStream(self, n: hir.GetCurrentStream) -> dict[str, Any]:
        return {"out": n.out}

    def SetCurrentStream(self, n: hir.SetCurrentStream) -> dict[str, Any]:
        return {"stream": _stream(n.stream)}

    def Synchronize(self, n: hir.Synchronize) -> dict[str, Any]:
        return {"stream": _stream(n.stream)}

    def ForLoop(self, n: hir.ForLoop) -> dict[str, Any]:
        return {"index": n.index, "start": self.names.expr(n.start),
                "stop": self.names.expr(n.stop)}

    def ShardByStream(self, n: hir.ShardByStream) -> dict[str, Any]:
        self._view(n.out, n.tensor, self.rank[n.tensor])
        return {"out": self.names(n.out), "tensor": self.names(n.tensor), "axis": n.axis,
                "index": n.index, "chunk": self.names.expr(n.chunk)}

    def _view(self, out: str, tensor: str, rank: int) -> None:
        self.base[out] = self.base.get(tensor, tensor)
        self.rank[out] = rank

    def Unflatten(self, n: distributed.Unflatten) -> dict[str, Any]:
        self._view(n.out, n.tensor, self.rank[n.tensor] + 1)
        return {"out": self.names(n.out), "tensor": self.names(n.tensor), "axis": n.axis,
                "outer": self.names.expr(n.sizes[0]), "inner": self.names.expr(n.sizes[1])}

    def CheckDivisible(self, n: distributed.CheckDivisible) -> dict[str, Any]:
        size = f"{self.names(n.tensor)}.size({n.axis})"
        return {"cond": f"{size} % {n.divisor} == 0", "message": _message(
            f": argument {n.tensor} axis {n.axis} must have a size divisible by {n.divisor} "
            f"({n.reason}), got ", f"{{{size}}}", " (shape ",
            f"{{{self.names(n.tensor)}.shape()}}", ")")}

    def Communication(self, n: distributed.Communication) -> dict[str, Any]:
        def tensor(name: str, merge: bool) -> str:
            base = self.names(self.base.get(name, name))
            flag = ", /*merge_leading=*/true" if merge else ""
            return f"rt::as_tensor({base}, {self.names(name)}, op{flag})"

        stacked_out = self.rank[n.output] == self.rank[n.input] + 1
        stacked_in = self.rank[n.input] == self.rank[n.output] + 1
        return {"out": self.names(n.out), "collective": f"rt::Collective::{n.kind.value}",
                "input": tensor(n.input, stacked_in), "output": tensor(n.output, stacked_out),
                "size": len(n.team), "range": self.range(n)}

    def Wait(self, n: distributed.Wait) -> dict[str, Any]:
        return {"communication": self.names(n.communication), "range": self.range(n)}

    def Compute(self, n: hir.Compute) -> dict[str, Any]:
        """A GEMM (``gemms.matmul`` / ``gemms.linear``, its epilogue as an
        ``rt::Epilogue``, ``rt::kAccumulate`` when it adds onto out) or a pointwise
        kernel (``rt::pointwise``, the kernel's source declared before the function, see
        ``_kernel``)."""
        gemm = n.gemm
        if gemm is None:
            kernel = self.kernel(n)
            out, inputs = self.kernel_views(n)
            return {"kind": "Pointwise", "kernel": kernel, "out": out,
                    "inputs": ", ".join(inputs), "range": self.range(n)}
        if any(isinstance(a, hir.Apply) for a in gemm.args):
            raise InternalError(f"{n}: a GEMM's operands must be values\n{self.program}")
        args = [self.names(a) for a in gemm.args if isinstance(a, str)]
        epilogue = n.epilogue
        if epilogue is not None:
            name = epilogue.defn.epilogue(dict(epilogue.attrs)) if epilogue.defn.epilogue \
                else None
            if name is None:
                raise InternalError(f"{n}: {epilogue.defn.node} has no GEMM epilogue\n"
                                    f"{self.program}")
            args.append(f"rt::Epilogue::{name}")
        if n.accumulate:
            args.append("rt::kAccumulate")
        return {"kind": "Gemm", "gemms": self.gemms[self.dtypes[n.out]],
                "call": gemm.defn.name, "out": self.names(n.out), "args": ", ".join(args),
                "range": self.range(n)}

    def kernel_views(self, n: hir.Compute) -> tuple[str, list[str]]:
        """The views pointwise node ``n`` passes its kernel, out's and each value's, such
        that the kernel's broadcasting (numpy's: axes aligned at the end) reads each value
        along the axes its ops read it (``Apply.read_axes``): a value along leading axes of
        out (a per-row scale ``[n]`` of ``[n, k]``) gets size-1 axes after them
        (``rt::unsqueeze``). An op with ``groups`` g iterates ``[.., k / g, g]``: out and
        the values along its last axis are viewed so (``rt::unflatten``), and a value
        along its groups (``[n, k / g]``) gets a size-1 axis for g."""
        rank = self.rank[n.out]
        root = n.expr.defn
        g = root.groups(dict(n.expr.attrs)) if root.groups is not None else None
        reads = n.expr.read_axes(self.rank)
        views = []
        for v in n.expr.leaves():
            ways = {axes for leaf, axes in reads if leaf == v}
            if len(ways) != 1:
                raise InternalError(f"{n}: one kernel reads {v} along axes "
                                    f"{sorted(ways, key=str)}\n{self.program}")
            (axes,) = ways
            view = self.names(v)
            if g is not None:
                view, axes = _grouped(view, axes, rank, g)
            views.append(_broadcast(view, axes, rank + (g is not None), n))
        out = self.names(n.out)
        if g is not None:
            out = _grouped(out, tuple(range(rank)), rank, g)[0]
        return out, views

    def kernel(self, n: hir.Compute) -> str:
        """Declares the kernel of pointwise node ``n`` (``self.kernels``); its C++ name."""
        leaves = n.expr.leaves()
        index = {v: k for k, v in enumerate(leaves)}
        compute = _C_TYPES[ops.compute_dtype([self.dtypes[v] for v in n.uses()])]

        def c(e: hir.Apply | str) -> str:
            if isinstance(e, str):
                return f"x{index[e]}"
            cpp = e.defn.cpp
            if cpp is None:
                raise InternalError(f"{n}: {e.defn.node} has no C expression\n{self.program}")
            return cpp([c(a) for a in e.args if a is not None], dict(e.attrs))

        params = ", ".join(f"compute_t x{k}" for k in range(len(leaves)))
        lines = [f"using out_t = {_C_TYPES[self.dtypes[n.out]]};"]
        lines += [f"using in{k}_t = {_C_TYPES[self.dtypes[v]]};" for k, v in enumerate(leaves)]
        lines += [f"using compute_t = {compute};",
                  f"__device__ __forceinline__ compute_t expr({params}) "
                  f"{{ return {c(n.expr)}; }}"]
        name = f"kernel{len(self.kernels)}"
        self.kernels.append({"name": name, "label": _cstr(str(n)), "source": lines,
                             "arity": len(leaves)})
        return name


def _grouped(view: str, axes: tuple[int | None, ...], rank: int, g: int
             ) -> tuple[str, tuple[int | None, ...]]:
    """``view`` (reading out's ``axes``) for a kernel that iterates out's last axis k as
    ``[k / g, g]``: an axis along k unflattened so (``rt::unflatten``), an axis along
    the groups (None) reading axis k / g; with the axes of the new shape it reads."""
    last = rank - 1
    if last in axes:
        axis = axes.index(last)
        split = f"rt::unflatten({view}, {axis}, {view}.size({axis}) / {g}, {g})"
        return split, (*axes[:axis], last, rank, *axes[axis + 1:])
    return view, tuple(last if a is None else a for a in axes)


def _broadcast(view: str, axes: tuple[int | None, ...], rank: int, n: hir.Node) -> str:
    """``view`` reading out's ``axes`` (increasing) as the kernel broadcasts it: size-1
    axes inserted (``rt::unsqueeze``) for out's axes after its first that it does not
    read; the ones before are numpy's leading broadcast."""
    if None in axes or list(axes) != sorted(set(axes)):  # type: ignore[type-var]
        raise InternalError(f"{n}: a kernel cannot read a value along axes {axes} of its "
                            "output (none, or out of order)")
    for a in range(axes[0] if axes else rank, rank):
        if a not in axes:
            view = f"rt::unsqueeze({view}, {a - axes[0]})"
    return view


def _cublaslt(program: hir.HostProgram) -> str:
    """The Gemms constructor's flag for ``program.gemm_library`` (lowering validates it;
    a HostProgram built by hand is checked here)."""
    if program.gemm_library not in hir.GEMM_LIBRARIES:
        raise InternalError(f"{program.name}: gemm_library must be one of "
                            f"{hir.GEMM_LIBRARIES}, got {program.gemm_library!r}")
    return "true" if program.gemm_library == "cublaslt" else "false"


def _gemms_on_caller(program: hir.HostProgram) -> bool:
    """Whether a GEMM runs on the caller's stream (outside loops that switch to worker
    streams): only then does a call claim a cuBLASLt workspace for that stream."""

    def walk(nodes: list[hir.Node], on_worker: bool) -> bool:
        for n in nodes:
            if isinstance(n, hir.Compute) and n.gemm is not None and not on_worker:
                return True
            if isinstance(n, hir.ForLoop):
                switches = any(isinstance(c, hir.SetCurrentStream)
                               and isinstance(c.stream, hir.Stream) for c in n.body)
                if walk(n.body, on_worker or switches):
                    return True
        return False

    return walk(program.body, False)


def prepare(program: hir.HostProgram) -> dict[str, Any]:
    """The plain data the templates render: strings and lists only."""
    if not isinstance(program, hir.HostProgram):
        raise TypeError(f"render expects a cg.HostProgram, got {type(program).__name__}")
    names = _Names.of(program)
    statements = _Statements(program, names)
    statements.emit(program.body, 1)
    outs = [names(o) for o in program.outputs]
    # Programs with collectives take the process group's name (resolved when called).
    communicates = any(isinstance(n, distributed.Communication) for n in program.nodes())
    group_param = [f"std::string {GROUP_PARAM}"] if communicates else []
    group_schema = [f"str {GROUP_PARAM}='{DEFAULT_GROUP}'"] if communicates else []
    # Programs with host tensors keep their pinned ones (rt::HostTensors, host.h).
    host = any(t.device == "cpu" for t in [*program.inputs, *statements.allocations.values()])
    allocs = statements.allocations
    host_outputs = any(allocs[o].device == "cpu" for o in program.outputs if o in allocs)
    return {
        "host": host,
        "host_outputs": host_outputs,
        "ring": any(isinstance(n, hir.RingSlot) for n in program.nodes()),
        "program": program.name,  # the prefix of its messages
        # The C++ function: the name alone could be a keyword (float), a macro (stdin) or
        # an overloaded C function (abs, whose address TORCH_BOX could not take).
        "function": f"{program.name}_program",
        "namespace": NAMESPACE,
        "op_name": op_name(program),
        "signature": program.signature().removesuffix(":"),
        "choice": program.choice_lines(),
        "params": ", ".join([f"torch::stable::Tensor {names(t.name)}_arg"
                             for t in program.inputs] + group_param),
        "schema_args": ", ".join([f"Tensor {names(t.name)}" for t in program.inputs]
                                 + group_schema),
        "schema_returns": "Tensor" if len(outs) == 1 else f"({', '.join(['Tensor'] * len(outs))})",
        "return_type": "torch::stable::Tensor" if len(outs) == 1
        else f"std::tuple<{', '.join(['torch::stable::Tensor'] * len(outs))}>",
        "return_expr": f"{outs[0]}.tensor" if len(outs) == 1
        else f"std::make_tuple({', '.join(o + '.tensor' for o in outs)})",
        "gemms": [{"name": name, "dtype": DTYPES[t]} for t, name in statements.gemms.items()],
        "kernels": statements.kernels,
        "sm_count": program.gemm_sm_count,
        "cublaslt": _cublaslt(program),
        "caller_gemms": _gemms_on_caller(program),
        "body": statements.out,
        **_input_checks(program, names),
    }


def render(program: hir.HostProgram) -> str:
    """The C++ translation unit of ``program`` (deterministic)."""
    data = prepare(program)
    schema = f"{data['op_name']}({data['schema_args']}) -> {data['schema_returns']}"
    try:  # a schema torch refuses would abort the process when the library loads
        torch._C.parse_schema(schema)
    except RuntimeError as e:
        raise InternalError(f"{program.name}: the op schema {schema!r} does not parse: "
                            f"{e}") from None
    return _environment().get_template("program.cpp.j2").render(**data)
