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

from . import hostir as hir
from .errors import InternalError
from .ir import DTYPE_NAMES, CeilDiv, Const, Expr, Min, Mul, Sym

if TYPE_CHECKING:
    import jinja2

NAMESPACE = "codegen"

# dtype -> (ATen scalar type, cuBLAS data type, cuBLAS compute type). fp16 and bf16
# accumulate in fp32; fp32 uses TF32 tensor cores only when the user allowed it.
GEMM_TYPES: dict[torch.dtype, tuple[str, str, str]] = {
    torch.float32: (
        "at::kFloat", "CUDA_R_32F",
        "at::globalContext().allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32 "
        ": CUBLAS_COMPUTE_32F",
    ),
    torch.float16: ("at::kHalf", "CUDA_R_16F", "CUBLAS_COMPUTE_32F"),
    torch.bfloat16: ("at::kBFloat16", "CUDA_R_16BF", "CUBLAS_COMPUTE_32F"),
    torch.float64: ("at::kDouble", "CUDA_R_64F", "CUBLAS_COMPUTE_64F"),
}

# Names the generated function uses itself, and C++ keywords a symbol could collide with.
_RESERVED = {
    "op", "device", "device_guard", "gemm_type", "i", "j", "main_stream", "restore_main_stream",
    "rt", "at", "c10", "std", "auto", "bool", "break", "case", "char", "class", "const",
    "continue", "default", "delete", "do", "double", "else", "enum", "float", "for",
    "goto", "if", "int", "long", "namespace", "new", "operator", "private", "public",
    "return", "short", "signed", "sizeof", "static", "struct", "switch", "template",
    "this", "throw", "try", "typedef", "union", "unsigned", "using", "void", "while",
}


def template_dir() -> Path:
    """``templates/`` of a source checkout, or ``codegen/templates`` when installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / "program.cpp.j2").is_file():
            return candidate
    raise InternalError(f"templates not found next to {here}")


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


@functools.cache
def _renderer_digest() -> str:
    """A hash of everything besides the program that the C++ is made from: the templates
    and this module."""
    texts = [p.read_text() for p in sorted(template_dir().glob("*.j2"))]
    texts.append(Path(__file__).read_text())
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()


def op_name(program: hir.HostProgram) -> str:
    """``<program>_<hash>``: unique per program text, templates and renderer; stable
    across runs and processes, so it also keys the build cache."""
    digest = hashlib.sha256(f"{program}\n{_renderer_digest()}".encode()).hexdigest()
    return f"{program.name}_{digest[:12]}"


# ---------------------------------------------------------------------------- expressions


@dataclasses.dataclass
class _Names:
    """C++ names of the program's symbols (renamed only where they would collide)."""

    symbols: dict[str, str]

    @classmethod
    def of(cls, program: hir.HostProgram) -> _Names:
        taken = set(_RESERVED) | {t.name for t in program.inputs} | set(program.allocations())
        taken |= {d for n in program.nodes() for d in n.defines()}
        mapping: dict[str, str] = {}
        for c in hir.dim_checks(program):
            name = str(c.value)
            if c.kind == "bind":
                cpp = name if name not in taken else f"{name}_size"
                while cpp in taken:
                    cpp += "_"
                taken.add(cpp)
                mapping[name] = cpp
        return cls(mapping)

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return str(e.value)
        if isinstance(e, Sym):
            return self.symbols.get(e.name, e.name)
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
    """A TORCH_CHECK message, ``rt::msg(op, ...)``: string literals and C++ expressions
    (an expression part is written as ``{expr}``)."""
    out = ["op"]
    for p in parts:
        out.append(p[1:-1] if p.startswith("{") and p.endswith("}") else _cstr(p))
    return f"rt::msg({', '.join(out)})"


# ---------------------------------------------------------------------------- prepare


def _input_checks(program: hir.HostProgram, names: _Names) -> dict[str, list[dict[str, str]]]:
    first = program.inputs[0].name
    checks: list[dict[str, str]] = []
    for t in program.inputs:
        checks.append({"cond": f"{t.name}.is_cuda()", "message": _message(
            f": argument {t.name} must be a CUDA tensor, got a tensor on ",
            f"{{{t.name}.device()}}")})
    for t in program.inputs[1:]:
        checks.append({"cond": f"{t.name}.device() == {first}.device()", "message": _message(
            f": argument {t.name} is on ", f"{{{t.name}.device()}}", f" but {first} is on ",
            f"{{{first}.device()}}", "; all inputs must be on one device")})
    for t in program.inputs:
        scalar = GEMM_TYPES[t.dtype][0]
        checks.append({"cond": f"{t.name}.scalar_type() == {scalar}", "message": _message(
            f": argument {t.name} must be {DTYPE_NAMES[t.dtype]}, got ",
            f"{{{t.name}.scalar_type()}}")})
    for t in program.inputs:
        checks.append({"cond": f"{t.name}.dim() == {len(t.shape)}", "message": _message(
            f": argument {t.name} must have rank {len(t.shape)} {t.type_str()}, got shape ",
            f"{{{t.name}.sizes()}}")})
    dims: list[dict[str, str]] = []
    for c in hir.dim_checks(program):
        size = f"{c.tensor}.size({c.axis})"
        if c.kind == "bind":
            dims.append({"bind": names.expr(c.value), "value": size})
            continue
        want = names.expr(c.value)
        expected = ([f": argument {c.tensor} axis {c.axis} must have size {c.value} = ",
                     f"{{{want}}}", ", got "] if c.kind == "same" else
                    [f": argument {c.tensor} axis {c.axis} must have size {want}, got "])
        dims.append({"bind": "", "cond": f"{size} == {want}", "message": _message(
            *expected,
            f"{{{size}}}", " (shape ", f"{{{c.tensor}.sizes()}}", ")")})
    for k in program.constraints:
        lhs, rhs = names.expr(k.lhs), names.expr(k.rhs)
        dims.append({"bind": "", "cond": f"{lhs} == {rhs}", "message": _message(
            f": {k.what} must have equal sizes, got {k.lhs} = ", f"{{{lhs}}}",
            f" and {k.rhs} = ", f"{{{rhs}}}")})
    return {"checks": checks, "dims": dims}


def _stream(ref: hir.StreamRef) -> str:
    if isinstance(ref, str):
        return ref
    index = f"{ref.index} % {ref.pool}" if ref.pool else ref.index
    return f"rt::worker(device, {index})"


class _Statements:
    """Flattens the host program into statements with indentation and node fields."""

    def __init__(self, program: hir.HostProgram, names: _Names) -> None:
        self.program, self.names = program, names
        self.allocations = program.allocations()
        self.base: dict[str, str] = {}  # view -> the tensor it slices
        self.ones: list[dict[str, str]] = []
        self.out: list[dict[str, Any]] = []

    def emit(self, nodes: list[hir.Node], depth: int) -> None:
        for n in nodes:
            fields = getattr(self, type(n).__name__)(n)
            self.out.append({"kind": type(n).__name__, "hir": str(n),
                             "indent": "  " * depth, **fields})
            if isinstance(n, hir.ForLoop):
                self.emit(n.body, depth + 1)
                self.out.append({"kind": "EndFor", "hir": "", "indent": "  " * depth})

    def Allocate(self, n: hir.Allocate) -> dict[str, Any]:
        return {"out": n.out.name, "sizes": [self.names.expr(e) for e in n.out.shape],
                "like": self.program.inputs[0].name, "scalar_type": GEMM_TYPES[n.out.dtype][0]}

    def Deallocate(self, n: hir.Deallocate) -> dict[str, Any]:
        return {"tensor": n.tensor}

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
        self.base[n.out] = self.base.get(n.tensor, n.tensor)
        return {"out": n.out, "tensor": n.tensor, "axis": n.axis, "index": n.index,
                "chunk": self.names.expr(n.chunk)}

    def Matmul(self, n: hir.Matmul) -> dict[str, Any]:
        return {"out": n.out, "a": n.a, "b": n.b}

    def Linear(self, n: hir.Linear) -> dict[str, Any]:
        fields: dict[str, Any] = {"out": n.out, "x": n.x, "w": n.w, "bias": n.bias or ""}
        if n.bias:
            whole = self.base.get(n.out, n.out)
            fields["ones"] = f"ones_{whole}"
            if all(o["name"] != fields["ones"] for o in self.ones):
                rows = self.allocations[whole].shape[-2]
                self.ones.append({"name": fields["ones"], "size": self.names.expr(rows)})
        return fields


def prepare(program: hir.HostProgram) -> dict[str, Any]:
    """The plain data the templates render: strings and lists only."""
    if not isinstance(program, hir.HostProgram):
        raise TypeError(f"render expects a cg.HostProgram, got {type(program).__name__}")
    dtype = program.inputs[0].dtype  # one dtype per program (validate_schedule)
    names = _Names.of(program)
    statements = _Statements(program, names)
    statements.emit(program.body, 1)
    name = op_name(program)
    outs = program.outputs
    return {
        "program": program.name,  # the C++ function and the prefix of its messages
        "namespace": NAMESPACE,
        "op_name": name,
        "signature": program.signature().removesuffix(":"),
        "params": ", ".join(f"const at::Tensor& {t.name}" for t in program.inputs),
        "schema_args": ", ".join(f"Tensor {t.name}" for t in program.inputs),
        "schema_returns": "Tensor" if len(outs) == 1 else f"({', '.join(['Tensor'] * len(outs))})",
        "return_type": "at::Tensor" if len(outs) == 1
        else f"std::tuple<{', '.join(['at::Tensor'] * len(outs))}>",
        "return_expr": outs[0] if len(outs) == 1 else f"std::make_tuple({', '.join(outs)})",
        "first_input": program.inputs[0].name,
        "gemm_data": GEMM_TYPES[dtype][1],
        "gemm_compute": GEMM_TYPES[dtype][2],
        "layout_checks": [{"tensor": t.name} for t in program.inputs],
        "ones": statements.ones,
        "body": statements.out,
        **_input_checks(program, names),
    }


def render(program: hir.HostProgram) -> str:
    """The C++ translation unit of ``program`` (deterministic)."""
    return _environment().get_template("program.cpp.j2").render(**prepare(program))
