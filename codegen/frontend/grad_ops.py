"""The ops of gradients: what ``codegen.transforms.gradient`` builds besides the public
ops (an op's ``OpDef.vjp`` gets both, see ``BUILDER``). Kept apart from ``ir``, the ops
users write; a definition may still use them.
"""

from __future__ import annotations

import types

from . import ir
from . import ops as ops_
from .ir import TensorView, _define


def matmul_tn(a: TensorView, b: TensorView) -> TensorView:
    """``a.mT @ b`` for ``a [k, m]`` and ``b [k, n]`` (a contraction over both rows), or
    batched: ``a [B, k, m]``, ``b [B, k, n]``."""
    return _define(ops_.MATMUL_TN, a=a, b=b)


def matmul_nt(a: TensorView, b: TensorView) -> TensorView:
    """``a @ b.mT`` for ``a [m, k]`` and ``b [n, k]``, or batched: ``a [B, m, k]``,
    ``b [B, n, k]``."""
    return _define(ops_.MATMUL_NT, a=a, b=b)


def matmul_tn_sum(a: TensorView, b: TensorView) -> TensorView:
    """The sum over the batch of ``a[i].T @ b[i]``: ``a [B, k, m]``, ``b [B, k, n]``,
    out ``[m, n]`` (the gradient of a weight every batch shares)."""
    return _define(ops_.MATMUL_TN_SUM, a=a, b=b)


def sum_rows(t: TensorView) -> TensorView:
    """``t`` summed over every axis but the last, for a 2-D or 3-D ``t``."""
    return _define(ops_.SUM_ROWS, x=t)


def silu_grad(dy: TensorView, x: TensorView) -> TensorView:
    """``dy * silu'(x)`` (torch's silu_backward)."""
    return _define(ops_.SILU_GRAD, a=dy, b=x)


def gelu_grad(dy: TensorView, x: TensorView, approximate: str = "none") -> TensorView:
    """``dy * gelu'(x)`` (torch's gelu_backward)."""
    return _define(ops_.GELU_GRAD, {"approximate": approximate}, a=dy, b=x)


def relu_grad(dy: TensorView, x: TensorView) -> TensorView:
    """``dy`` where ``x > 0``, else 0 (torch's threshold_backward at 0)."""
    return _define(ops_.RELU_GRAD, a=dy, b=x)


# What a gradient rule builds with (``OpDef.vjp``'s ``b``): the public ops of ``ir`` and
# the backward-only ones above.
BUILDER = types.SimpleNamespace(
    **{name: value for name, value in vars(ir).items() if not name.startswith("__")},
    matmul_tn=matmul_tn, matmul_nt=matmul_nt, matmul_tn_sum=matmul_tn_sum,
    sum_rows=sum_rows, silu_grad=silu_grad, gelu_grad=gelu_grad, relu_grad=relu_grad)
