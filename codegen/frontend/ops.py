"""Op definitions: every op kind of the IR, defined once.

An :class:`OpDef` says everything the pipeline needs to know about one op kind:

- its operands (and which are optional) and attributes, and the checks of their ranks
  and values when the op is defined (``check``);
- the role of every axis (``axes``): an iteration axis lists the operand axes that index
  it; a reduction axis is one the output does not have (a matmul's ``k``); an operand
  absent from an iteration group is broadcast along it (a bias ``[n]`` against
  ``[m, n]``). Nothing is positional: the passes read the roles;
- its dtype rule (``dtype``);
- its semantics for the evaluator (``evaluate``: torch ops writing into ``out``, or for a
  pointwise op ``compute``: torch ops on operands already in the computation dtype);
- how it lowers to C++: a GEMM calls the runtime's ``Gemms`` (``family="gemm"``); a
  pointwise op is a C expression in a generated kernel (``cpp``), and ``epilogue`` names
  the GEMM epilogue that computes it inside a GEMM (cuBLASLt's), where one exists.

The IR (``ir.Op``), the host IR (``hostir.Compute``), the evaluator, the stream-order
checker and the renderer all dispatch through these definitions; adding an op kind is one
definition here (plus, for a pointwise op, one device function in
``codegen/backend/include/codegen/pointwise.h``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ScheduleError

Member = tuple[str, int]  # (operand name, axis); the output is "out"
Attrs = Mapping[str, Any]

# The dtypes a tensor may have, and their names in the printed IR.
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int8: "int8",
}
# The dtypes ops compute in, and results have (cast's targets).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Quantized values (int4 is stored unpacked in int8): program inputs that only the operands
# an op names in ``OpDef.quantized`` read (dequantize's q); every other operand refuses them.
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


@dataclasses.dataclass(frozen=True)
class AxisGroup:
    """Operand axes that index one dimension. An iteration group has the output's axis
    among its members; a reduction group's output axis is a reduction IterDomain (the
    output's shape does not have it)."""

    members: tuple[Member, ...]
    reduction: bool = False

    def output_axis(self) -> int:
        return next(a for n, a in self.members if n == "out")

    def inputs(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m[0] != "out")


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str  # the function (cg.<name>) and the fusion IR's spelling
    node: str  # the host IR's spelling, e.g. "Matmul", "Silu"
    family: str  # "gemm" or "pointwise"
    operands: tuple[str, ...]
    check: Callable[[Mapping[str, Any], Attrs], None]  # ranks and attrs; raises ScheduleError
    axes: Callable[[Mapping[str, int], Attrs], list[AxisGroup]]  # operand ranks -> roles
    dtype: Callable[[Mapping[str, Any], Attrs], torch.dtype]  # operands -> result
    optional: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()  # printed name=value, in this order
    evaluate: Callable[[Mapping[str, torch.Tensor], torch.Tensor, Attrs], None] | None = None
    compute: Callable[..., torch.Tensor] | None = None  # pointwise: operands -> result
    cpp: Callable[[list[str], Attrs], str] | None = None  # pointwise: C expression
    # The GEMM epilogue that computes this op (an rt::Epilogue of
    # codegen/backend/include/codegen/epilogue.h, e.g. "GeluTanh"), or None where there is none.
    epilogue: Callable[[Attrs], str | None] | None = None
    # A GEMM whose result may take a pointwise consumer as its epilogue.
    epilogues: bool = True
    # A GEMM the runtime can run adding onto its output (beta = 1, ``accumulate=True``).
    accumulates: bool = True
    # The operands that take a quantized dtype (QUANTIZED_DTYPES); no other does.
    quantized: tuple[str, ...] = ()
    # Extents the op ties beyond its axis groups: (operands, attrs) -> (a, b, factor)
    # triples, operand axis a of ``factor`` times the extent of operand axis b (a grouped
    # dequantize's K, its scale's groups times group_size); checked on the inputs when the
    # program is called.
    ties: Callable[[Mapping[str, Any], Attrs], list[tuple[Member, Member, int]]] | None = None
    # Pointwise: the size of the groups of the last axis that an operand indexes once per
    # group (a grouped dequantize's scale [N, K / g]), or None. The kernel of such an op
    # iterates [.., K / g, g] and reads that operand broadcast along g; it is never fused
    # with another op. Its output's last axis is never split on streams.
    groups: Callable[[Attrs], int | None] | None = None
    # Reverse mode (codegen.transforms.gradient): (dy, operands, attrs, builder) -> each
    # operand's gradient, built with the builder's ops (the functions of
    # codegen.frontend.ir and codegen.frontend.grad_ops), or a ScheduleError where the op
    # has none.
    vjp: Callable[..., dict[str, Any]] | None = None

    # One object per op kind: copies of a fusion (Fusion.clone) share the definitions, so
    # ``op.defn is ops.MATMUL`` holds in every copy.
    def __copy__(self) -> OpDef:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> OpDef:
        return self

    @property
    def is_gemm(self) -> bool:
        return self.family == "gemm"

    @property
    def is_pointwise(self) -> bool:
        return self.family == "pointwise"


OPS: dict[str, OpDef] = {}  # by name


def define(op: OpDef) -> OpDef:
    if op.name in OPS or any(o.node == op.node for o in OPS.values()):
        raise ValueError(f"op {op.name} ({op.node}) is defined twice")
    OPS[op.name] = op
    return op


def get(name: str) -> OpDef:
    return OPS[name]


def attr_str(value: object) -> str:
    """An attribute as the IR prints it: dtypes by name, strings bare."""
    if isinstance(value, torch.dtype):
        return DTYPE_NAMES.get(value, str(value))
    return str(value)


def same_dtype(op: str) -> Callable[[Mapping[str, Any], Attrs], torch.dtype]:
    """The dtype rule of ops whose operands share one dtype, which the result has."""

    def rule(tensors: Mapping[str, Any], attrs: Attrs) -> torch.dtype:
        if len({t.dtype for t in tensors.values()}) > 1:
            found = ", ".join(f"{k}={t.name} is {attr_str(t.dtype)}"
                              for k, t in tensors.items())
            raise ScheduleError(f"{op}: all operands must have one dtype, found {found}; "
                                "convert one with cg.cast")
        return next(iter(tensors.values())).dtype

    return rule


# ---------------------------------------------------------------------------- reverse mode
# Each rule gets the gradient of the op's result (dy), its operands (v: the forward's
# values, as the backward program sees them), its attributes and a builder (``b``: the
# functions of codegen.frontend.ir and codegen.frontend.grad_ops, so these rules build ops
# like a user's definition does), and gives the gradient of every operand.


def _unbroadcast(op: str, g: Any, like: Any, b: Any) -> Any:
    """The gradient of an operand broadcast along leading axes: ``g`` summed over them."""
    if g.ndim == like.ndim:
        return g
    if like.ndim == 1 and g.ndim <= 3:
        return b.sum_rows(g)
    return NoGradient(f"{op}: no backward for {like.name}, broadcast from rank {like.ndim} "
                      f"to rank {g.ndim} (only [n] against [m, n] or [b, m, n] has one)")


class NoGradient:
    """An operand's gradient the rules cannot give: raised only if it is asked for. The
    message may name the operand's tensor as ``{tensor}``, filled in when it is raised (a
    rule that does not read an operand does not know its name)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def error(self, tensor: str = "") -> ScheduleError:
        return ScheduleError(self.message.replace("{tensor}", tensor))


# ---------------------------------------------------------------------------- GEMMs


def _matmul_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    if (t["a"].ndim, t["b"].ndim) not in ((2, 2), (3, 3), (3, 2)):
        raise ScheduleError(
            f"matmul: supported ranks are 2-D x 2-D, 3-D x 3-D and 3-D x 2-D; got "
            f"a={t['a'].name} of rank {t['a'].ndim} and b={t['b'].name} of rank {t['b'].ndim}")


def _matmul_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    ra, rb = rank["a"], rank["b"]
    groups: list[AxisGroup] = []
    if ra == 3:
        batch: list[Member] = [("a", 0)] + ([("b", 0)] if rb == 3 else [])
        groups.append(AxisGroup((*batch, ("out", 0))))
    o = ra - 2
    groups.append(AxisGroup((("a", ra - 2), ("out", o))))
    groups.append(AxisGroup((("b", rb - 1), ("out", o + 1))))
    groups.append(AxisGroup((("a", ra - 1), ("b", rb - 2), ("out", o + 2)), reduction=True))
    return groups


# An empty contraction (k = 0) sums nothing: the slice is zeros (or the bias). torch
# cannot always say so itself: matmul(out=) of a 3-D x 2-D folds the operands to 2-D, and
# for k = 0 it then fails on an out that is a non-contiguous slice (rows of 3-D).
def _matmul_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor, attrs: Attrs) -> None:
    a, b = v["a"], v["b"]
    if a.shape[-1] == 0:
        out.zero_()
        return
    if a.dim() == 3 and b.dim() == 2:
        # torch.matmul(out=) folds 3-D x 2-D into one mm on out viewed 2-D, and fails
        # when out's batch stride is not rows * columns (a strided batched view).
        b = b.expand(a.shape[0], -1, -1)
    torch.matmul(a, b, out=out)


def _matmul_vjp(dy: Any, v: Mapping[str, Any], attrs: Attrs, b: Any) -> dict[str, Any]:
    a_, b_ = v["a"], v["b"]
    if b_.ndim == 3:  # batched: each batch's product, per batch
        return {"a": b.matmul_nt(dy, b_), "b": b.matmul_tn(a_, dy)}  # dy @ b.mT, a.mT @ dy
    if a_.ndim == 3:  # one b shared by the batch: its gradient sums over the batch
        return {"a": b.linear(dy, b_), "b": b.matmul_tn_sum(a_, dy)}
    return {"a": b.linear(dy, b_), "b": b.matmul_tn(a_, dy)}  # dy @ b.T, a.T @ dy


MATMUL = define(OpDef(
    name="matmul", node="Matmul", family="gemm", operands=("a", "b"),
    check=_matmul_check, axes=_matmul_axes, dtype=same_dtype("matmul"),
    evaluate=_matmul_evaluate, vjp=_matmul_vjp,
))


def _linear_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    bias = t.get("bias")
    if bias is not None and bias.ndim != 1:
        raise ScheduleError(f"linear: bias ({bias.name}) must be 1-D, got rank {bias.ndim}")
    if t["x"].ndim not in (2, 3) or t["w"].ndim != 2:
        raise ScheduleError(
            f"linear: x must be 2-D or 3-D and w 2-D; got x={t['x'].name} of rank "
            f"{t['x'].ndim}, w={t['w'].name} of rank {t['w'].ndim}")


def _linear_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    rx = rank["x"]
    groups = [AxisGroup((("x", d), ("out", d))) for d in range(rx - 1)]
    n_group: list[Member] = [("w", 0)] + ([("bias", 0)] if "bias" in rank else [])
    groups.append(AxisGroup((*n_group, ("out", rx - 1))))
    groups.append(AxisGroup((("x", rx - 1), ("w", 1), ("out", rx)), reduction=True))
    return groups


def _linear_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor, attrs: Attrs) -> None:
    x, w, bias = v["x"], v["w"], v.get("bias")
    if x.shape[-1] == 0 and bias is None:
        out.zero_()
    elif x.shape[-1] == 0:
        out.copy_(bias.expand_as(out))
    elif bias is None and x.dim() == 2:
        torch.matmul(x, w.t(), out=out)
    elif bias is None:  # torch.matmul(out=) folds 3-D x 2-D: see _matmul_evaluate
        torch.matmul(x, w.t().expand(x.shape[0], -1, -1), out=out)
    elif x.dim() == 2:
        torch.addmm(bias, x, w.t(), out=out)
    else:
        torch.baddbmm(bias, x, w.t().expand(x.shape[0], -1, -1), out=out)


def _linear_vjp(dy: Any, v: Mapping[str, Any], attrs: Attrs, b: Any) -> dict[str, Any]:
    grads = {"x": b.matmul(dy, v["w"])}  # dy @ w
    if v["x"].ndim == 2:
        grads["w"] = b.matmul_tn(dy, v["x"])  # dy.T @ x
        if "bias" in v:
            grads["bias"] = b.sum_rows(dy)
    else:  # w and bias are shared by the batch: their gradients sum over it too
        grads["w"] = b.matmul_tn_sum(dy, v["x"])
        if "bias" in v:
            grads["bias"] = b.sum_rows(dy)
    return grads


LINEAR = define(OpDef(
    name="linear", node="Linear", family="gemm", operands=("x", "w", "bias"),
    optional=("bias",), check=_linear_check, axes=_linear_axes, dtype=same_dtype("linear"),
    evaluate=_linear_evaluate, vjp=_linear_vjp,
))


# The GEMMs of gradients: the transposes are read in place (cuBLAS's op flags), never
# copied. Each is the runtime's ``Gemms::<name>``.


def _ranks(op: str, allowed: tuple[tuple[int, ...], ...], what: str
           ) -> Callable[[Mapping[str, Any], Attrs], None]:
    def check(t: Mapping[str, Any], attrs: Attrs) -> None:
        names = [n for n in ("a", "b", "x") if n in t]
        if tuple(t[n].ndim for n in names) not in allowed:
            found = ", ".join(f"{n}={t[n].name} of rank {t[n].ndim}" for n in names)
            raise ScheduleError(f"{op}: supported ranks are {what}; got {found}")

    return check


def _batch(rank: int) -> list[AxisGroup]:
    """The batch axis of a batched GEMM of rank-``rank`` operands a and b, if any."""
    return [AxisGroup((("a", 0), ("b", 0), ("out", 0)))] if rank == 3 else []


def _matmul_tn_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    o = rank["a"] - 2  # a [B?, k, m], b [B?, k, n] -> out [B?, m, n]
    return [*_batch(rank["a"]), AxisGroup((("a", o + 1), ("out", o))),
            AxisGroup((("b", o + 1), ("out", o + 1))),
            AxisGroup((("a", o), ("b", o), ("out", o + 2)), reduction=True)]


def _matmul_tn_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor,
                        attrs: Attrs) -> None:
    if v["a"].shape[-2] == 0:
        out.zero_()
    else:
        torch.matmul(v["a"].mT, v["b"], out=out)


# ``a.mT @ b`` (a ``[B?, k, m]``, b ``[B?, k, n]``): the weight gradients of matmul and
# linear (``x.T @ dy``, ``dy.T @ x``), a contraction over both operands' rows; batched,
# the gradient of a batched matmul's b.
MATMUL_TN = define(OpDef(
    name="matmul_tn", node="MatmulTN", family="gemm", operands=("a", "b"),
    check=_ranks("matmul_tn", ((2, 2), (3, 3)), "2-D x 2-D and 3-D x 3-D"),
    axes=_matmul_tn_axes, dtype=same_dtype("matmul_tn"), evaluate=_matmul_tn_evaluate,
))


def _matmul_nt_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    o = rank["a"] - 2  # a [B?, m, k], b [B?, n, k] -> out [B?, m, n]
    return [*_batch(rank["a"]), AxisGroup((("a", o), ("out", o))),
            AxisGroup((("b", o), ("out", o + 1))),
            AxisGroup((("a", o + 1), ("b", o + 1), ("out", o + 2)), reduction=True)]


def _matmul_nt_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor,
                        attrs: Attrs) -> None:
    if v["a"].shape[-1] == 0:
        out.zero_()
    else:
        torch.matmul(v["a"], v["b"].mT, out=out)


# ``a @ b.mT`` (a ``[B?, m, k]``, b ``[B?, n, k]``): the gradient of a batched matmul's a
# (a 2-D one is ``linear``).
MATMUL_NT = define(OpDef(
    name="matmul_nt", node="MatmulNT", family="gemm", operands=("a", "b"),
    check=_ranks("matmul_nt", ((2, 2), (3, 3)), "2-D x 2-D and 3-D x 3-D"),
    axes=_matmul_nt_axes, dtype=same_dtype("matmul_nt"), evaluate=_matmul_nt_evaluate,
))


def _matmul_tn_sum_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    # a [B, k, m], b [B, k, n] -> out [m, n]: a contraction over B and k.
    return [AxisGroup((("a", 2), ("out", 0))), AxisGroup((("b", 2), ("out", 1))),
            AxisGroup((("a", 0), ("b", 0), ("out", 2)), reduction=True),
            AxisGroup((("a", 1), ("b", 1), ("out", 3)), reduction=True)]


def _matmul_tn_sum_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor,
                            attrs: Attrs) -> None:
    a, b = v["a"].flatten(0, 1), v["b"].flatten(0, 1)
    if a.shape[0] == 0:
        out.zero_()
    else:
        torch.matmul(a.t(), b, out=out)


# ``sum over the batch of a[i].T @ b[i]`` (a ``[B, k, m]``, b ``[B, k, n]``, out
# ``[m, n]``): the gradient of a 2-D operand a batch shares (the w of a 3-D linear, the b
# of a 3-D x 2-D matmul). One GEMM over ``B * k`` rows where the batch folds into the
# rows, else one per batch, accumulating.
MATMUL_TN_SUM = define(OpDef(
    name="matmul_tn_sum", node="MatmulTNSum", family="gemm", operands=("a", "b"),
    check=_ranks("matmul_tn_sum", ((3, 3),), "3-D x 3-D"), axes=_matmul_tn_sum_axes,
    dtype=same_dtype("matmul_tn_sum"), evaluate=_matmul_tn_sum_evaluate, epilogues=False,
))


def _sum_rows_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    r = rank["x"]  # x [B?, m, n] -> out [n]: a contraction over every axis but the last
    return [AxisGroup((("x", r - 1), ("out", 0))),
            *(AxisGroup((("x", d), ("out", d + 1)), reduction=True) for d in range(r - 1))]


def _sum_rows_evaluate(v: Mapping[str, torch.Tensor], out: torch.Tensor,
                       attrs: Attrs) -> None:
    torch.sum(v["x"], tuple(range(v["x"].dim() - 1)), out=out)


# ``x.sum`` over every axis but the last, of a 2-D or 3-D ``x``: a bias gradient. It runs
# as a GEMM (a row of ones times ``x``: fp32 accumulation, as torch's sum); the runtime's
# ``Gemms::sum_rows``.
SUM_ROWS = define(OpDef(
    name="sum_rows", node="SumRows", family="gemm", operands=("x",),
    check=_ranks("sum_rows", ((2,), (3,)), "2-D and 3-D"), axes=_sum_rows_axes,
    dtype=lambda t, a: t["x"].dtype, evaluate=_sum_rows_evaluate, epilogues=False,
    accumulates=False,
))

# ---------------------------------------------------------------------------- pointwise


def _no_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    return None


def _unary_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    return [AxisGroup((("x", d), ("out", d))) for d in range(rank["x"])]


def _binary_check(op: str) -> Callable[[Mapping[str, Any], Attrs], None]:
    def check(t: Mapping[str, Any], attrs: Attrs) -> None:
        a, b = t["a"], t["b"]
        if b.ndim > a.ndim:
            raise ScheduleError(
                f"{op}: b ({b.name}, rank {b.ndim}) may broadcast along a's leading axes but "
                f"not have more axes than a ({a.name}, rank {a.ndim}); swap the operands")

    return check


def _binary_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    """b is aligned with a's trailing axes and broadcast along the leading ones."""
    ra, rb = rank["a"], rank["b"]
    return [AxisGroup((("a", d), *((("b", d - (ra - rb)),) if d >= ra - rb else ()),
                       ("out", d))) for d in range(ra)]


def _keep_dtype(tensors: Mapping[str, Any], attrs: Attrs) -> torch.dtype:
    return tensors["x"].dtype


def unary(name: str, node: str, compute: Callable[..., torch.Tensor],
          cpp: Callable[[list[str], Attrs], str], *, attrs: tuple[str, ...] = (),
          check: Callable[[Mapping[str, Any], Attrs], None] | None = None,
          dtype: Callable[[Mapping[str, Any], Attrs], torch.dtype] = _keep_dtype,
          epilogue: Callable[[Attrs], str | None] | None = None,
          vjp: Callable[..., dict[str, Any]] | None = None) -> OpDef:
    """A one-operand pointwise op (operand ``x``) of ``x``'s shape."""
    return define(OpDef(name=name, node=node, family="pointwise", operands=("x",),
                        check=check or _no_check, axes=_unary_axes, dtype=dtype,
                        attrs=attrs, compute=compute, cpp=cpp, epilogue=epilogue, vjp=vjp))


def binary(name: str, node: str, compute: Callable[..., torch.Tensor],
           cpp: Callable[[list[str], Attrs], str], *, attrs: tuple[str, ...] = (),
           check: Callable[[Mapping[str, Any], Attrs], None] | None = None,
           vjp: Callable[..., dict[str, Any]] | None = None) -> OpDef:
    """A two-operand pointwise op of ``a``'s shape, ``b`` broadcast along a's leading
    axes (same shape, or a bias ``[n]`` against ``[m, n]``), one dtype."""
    shapes = _binary_check(name)

    def check_all(t: Mapping[str, Any], a: Attrs) -> None:
        shapes(t, a)
        if check is not None:
            check(t, a)

    return define(OpDef(name=name, node=node, family="pointwise", operands=("a", "b"),
                        check=check_all, axes=_binary_axes, dtype=same_dtype(name),
                        attrs=attrs, compute=compute, cpp=cpp, vjp=vjp))


GELU_APPROXIMATIONS = ("none", "tanh")


def _gelu_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    if attrs["approximate"] not in GELU_APPROXIMATIONS:
        raise ScheduleError(
            f"gelu: approximate must be one of {', '.join(map(repr, GELU_APPROXIMATIONS))} "
            f"(as torch.nn.functional.gelu), got {attrs['approximate']!r}")


def dtype_list(dtypes: tuple[torch.dtype, ...]) -> str:
    """``torch.bfloat16, torch.float16 or torch.float32``: dtypes as a message lists them."""
    names = [f"torch.{DTYPE_NAMES[d]}" for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _cast_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    if not isinstance(attrs["dtype"], torch.dtype) or attrs["dtype"] not in FLOAT_DTYPES:
        names = ", ".join(f"torch.{DTYPE_NAMES[d]}" for d in FLOAT_DTYPES)
        raise ScheduleError(f"cast: dtype must be one of {names}, got {attrs['dtype']!r}")


SILU = unary("silu", "Silu", lambda x: F.silu(x), lambda x, a: f"silu({x[0]})",
             vjp=lambda dy, v, a, b: {"x": b.silu_grad(dy, v["x"])})
GELU = unary(
    "gelu", "Gelu", lambda x, approximate: F.gelu(x, approximate=approximate),
    lambda x, a: f"gelu_tanh({x[0]})" if a["approximate"] == "tanh" else f"gelu({x[0]})",
    attrs=("approximate",), check=_gelu_check,
    # cuBLASLt's GELU epilogue is the tanh form: the erf form has none.
    epilogue=lambda a: "GeluTanh" if a["approximate"] == "tanh" else None,
    vjp=lambda dy, v, a, b: {"x": b.gelu_grad(dy, v["x"], a["approximate"])})
RELU = unary("relu", "Relu", torch.relu, lambda x, a: f"relu({x[0]})",
             epilogue=lambda a: "Relu", vjp=lambda dy, v, a, b: {"x": b.relu_grad(dy, v["x"])})
CAST = unary("cast", "Cast", lambda x, dtype: x, lambda x, a: x[0], attrs=("dtype",),
             check=_cast_check, dtype=lambda tensors, a: a["dtype"],
             vjp=lambda dy, v, a, b: {"x": b.cast(dy, v["x"].dtype)})
ADD = binary("add", "Add", torch.add, lambda x, a: f"({x[0]} + {x[1]})",
             vjp=lambda dy, v, a, b: {"a": dy, "b": _unbroadcast("add", dy, v["b"], b)})
MUL = binary("mul", "Mul", torch.mul, lambda x, a: f"({x[0]} * {x[1]})",
             vjp=lambda dy, v, a, b: {
                 "a": b.mul(dy, v["b"]),
                 "b": _unbroadcast("mul", b.mul(dy, v["a"]), v["b"], b)})

# The derivatives of the activations, dy * f'(x) (operands a = dy, b = x), as torch's
# silu_backward, gelu_backward and threshold_backward compute them.
SILU_GRAD = binary("silu_grad", "SiluGrad", torch.ops.aten.silu_backward,
                   lambda x, a: f"silu_grad({x[0]}, {x[1]})")
GELU_GRAD = binary(
    "gelu_grad", "GeluGrad",
    lambda dy, x, approximate: torch.ops.aten.gelu_backward(dy, x, approximate=approximate),
    lambda x, a: (f"gelu_tanh_grad({x[0]}, {x[1]})" if a["approximate"] == "tanh"
                  else f"gelu_grad({x[0]}, {x[1]})"),
    attrs=("approximate",), check=_gelu_check)
RELU_GRAD = binary("relu_grad", "ReluGrad",
                   lambda dy, x: torch.ops.aten.threshold_backward(dy, x, 0),
                   lambda x, a: f"({x[1]} <= compute_t(0) ? compute_t(0) : {x[0]})")


# ---------------------------------------------------------------------------- dequantize

# What dequantize's scale may be, and its result.
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEQUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _shape_str(t: Any) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _dequantize_attrs(attrs: Attrs) -> None:
    """``group_size`` a positive int or None, ``dtype`` one of DEQUANTIZE_DTYPES."""
    g, dtype = attrs["group_size"], attrs["dtype"]
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise ScheduleError(f"dequantize: group_size must be a positive int (or None: one "
                            f"scale per row of q), found {g!r}")
    if not isinstance(dtype, torch.dtype) or dtype not in DEQUANTIZE_DTYPES:
        raise ScheduleError(f"dequantize: dtype (the result's) must be "
                            f"{dtype_list(DEQUANTIZE_DTYPES)}, found {dtype!r}")


def _dequantize_dtypes(q: Any, scale: Any) -> None:
    if q.dtype not in QUANTIZED_DTYPES:
        raise ScheduleError(
            f"dequantize: argument q ({q.name}) must be {dtype_list(QUANTIZED_DTYPES)} "
            f"(int4 values stored unpacked in int8), found {DTYPE_NAMES[q.dtype]}")
    if scale.dtype not in SCALE_DTYPES:
        raise ScheduleError(f"dequantize: argument scale ({scale.name}) must be "
                            f"{dtype_list(SCALE_DTYPES)}, found {DTYPE_NAMES[scale.dtype]}")


def _fixed(e: Any) -> int | None:
    """A fixed extent's value (an ``ir.Const``), or None for a named one."""
    value = getattr(e, "value", None)
    return value if isinstance(value, int) else None


def _dequantize_shapes(q: Any, scale: Any, g: int | None) -> None:
    """q ``[N, K]``; scale ``[N]``, or ``[N, K // g]`` with K a multiple of g, where the
    extents are fixed (named ones are checked when the program is called: ``ties``)."""
    if q.ndim != 2:
        raise ScheduleError(f"dequantize: argument q ({q.name}) must have rank 2 [N, K], "
                            f"found rank {q.ndim} {_shape_str(q)}")
    n, k = q.shape
    want: list[tuple[str, int | None]] = [(str(n), _fixed(n))]  # (spelled, fixed value)
    why = "one scale per row of q"
    if g is not None:
        fixed_k = _fixed(k)
        if fixed_k is not None and fixed_k % g:
            raise ScheduleError(f"dequantize: argument q ({q.name}) axis 1 (K = {k}) must "
                                f"be a multiple of group_size {g}")
        groups = None if fixed_k is None else fixed_k // g
        want.append((f"{k} / {g}" if groups is None else str(groups), groups))
        why = f"one scale per group of {g} elements of a row of q"
    # A named K shared with the scale's groups axis could only hold K = K / g: never, for g > 1.
    same_k = (g is not None and g > 1 and scale.ndim == 2 and _fixed(k) is None
              and str(scale.shape[1]) == str(k))
    if same_k or scale.ndim != len(want) or any(
            _fixed(e) is not None and w is not None and _fixed(e) != w
            for e, (_, w) in zip(scale.shape, want)):
        spelled = ", ".join(t for t, _ in want)
        raise ScheduleError(f"dequantize: argument scale ({scale.name}) must have shape "
                            f"[{spelled}] ({why}; q={q.name} is {_shape_str(q)}), found "
                            f"{_shape_str(scale)}")


def _dequantize_check(t: Mapping[str, Any], attrs: Attrs) -> None:
    _dequantize_attrs(attrs)
    _dequantize_dtypes(t["q"], t["scale"])
    _dequantize_shapes(t["q"], t["scale"], attrs["group_size"])


def _dequantize_axes(rank: Mapping[str, int], attrs: Attrs) -> list[AxisGroup]:
    """N indexes q, scale and out; K indexes q and out (a grouped scale's axis 1 indexes
    groups of K: ``ties`` and ``groups``)."""
    return [AxisGroup((("q", 0), ("scale", 0), ("out", 0))), AxisGroup((("q", 1), ("out", 1)))]


def _dequantize_ties(t: Mapping[str, Any], attrs: Attrs) -> list[tuple[Member, Member, int]]:
    g = attrs["group_size"]
    return [] if g is None else [(("q", 1), ("scale", 1), g)]


def _dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in the computation dtype (q and scale arrive in it), the scale first
    rounded to ``dtype`` as the reference's ``scale.to(dtype)``; q converts exactly. The
    product of the two is exact in fp32 for a 16-bit ``dtype``, so it rounds once on store,
    as torch's half-type product does."""
    s = scale.to(dtype).to(q.dtype)
    if group_size is None:
        return q * s[:, None]
    n, k = q.shape
    return (q.reshape(n, k // group_size, group_size) * s[:, :, None]).reshape(n, k)


# The kernel's rounding of the scale to the result's dtype (pointwise.h); fp32 needs none.
_ROUND = {torch.bfloat16: "round_bf16", torch.float16: "round_f16"}


def _dequantize_cpp(x: list[str], attrs: Attrs) -> str:
    rounding = _ROUND.get(attrs["dtype"])
    return f"({x[0]} * {rounding}({x[1]}))" if rounding else f"({x[0]} * {x[1]})"


def _dequantize_vjp(dy: Any, v: Mapping[str, Any], attrs: Attrs, b: Any) -> dict[str, Any]:
    why = ("dequantize: no backward for {tensor} (its {operand}): quantized values and "
           "their scales are constants; pass it without requires_grad (or .detach() it)")
    return {n: NoGradient(why.replace("{operand}", n)) for n in ("q", "scale")}


# ``q.to(dtype) * scale.to(dtype)``, one scale per row of q [N, K] (scale [N]) or per
# group of ``group_size`` elements of a row (scale [N, K // group_size]); q float8_e4m3fn
# or int8 (int4 values stored unpacked, not range-checked).
DEQUANTIZE = define(OpDef(
    name="dequantize", node="Dequantize", family="pointwise", operands=("q", "scale"),
    check=_dequantize_check, axes=_dequantize_axes, dtype=lambda t, a: a["dtype"],
    attrs=("group_size", "dtype"), compute=_dequantize, cpp=_dequantize_cpp,
    quantized=("q",), ties=_dequantize_ties, groups=lambda a: a["group_size"],
    vjp=_dequantize_vjp,
))


def compute_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype a pointwise expression computes in: float64 if any tensor it touches is
    float64, else float32 (half types are loaded into fp32 and rounded once, on store)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
