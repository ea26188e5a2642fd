"""Backward of compiled ops on the GPU: gradients against torch autograd (exact on
integer-valued fp32, within rounding in bf16), host-resident weights getting host
gradients, torch.compile(fullgraph=True) with backward, opcheck, and the no-grad path."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints
from helpers import BATCHED_SHAPES, BATCHED_TORCH, batched

import codegen as cg
from codegen import examples
from codegen.frontend import grad_ops

pytestmark = [pytest.mark.gpu, pytest.mark.build]


def _llama(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _gpt(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _matmul_cols(dtype, slices=3):
    with cg.Fusion("matmul_cols") as f:
        a = cg.input(["m", "k"], dtype, name="a")
        b = cg.input(["k", "n"], dtype, name="b")
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    return f


def _run(fn, inputs, weight):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in leaves]


CASES = {  # name -> (fusion for a dtype, torch reference, input shapes)
    "matmul_rows": (lambda d: examples.matmul_rows(d, 4), torch.matmul, [(256, 64), (64, 96)]),
    "matmul_cols": (_matmul_cols, torch.matmul, [(256, 64), (64, 96)]),
    "linear_bias": (None, F.linear, [(96, 64), (80, 64), (80,)]),
    "llama_mlp": (lambda d: examples.llama_mlp(d, 4), _llama,
                  [(128, 64), (192, 64), (192, 64), (64, 192)]),
    "gpt_mlp": (lambda d: examples.gpt_mlp(d, 4), _gpt,
                [(128, 64), (192, 64), (192,), (64, 192), (64,)]),
}


def _fusion(case, dtype):
    make = CASES[case][0]
    if make is None:  # linear_bias is fixed at fp32
        return examples.linear_bias()
    return make(dtype)


@pytest.mark.parametrize("case", ["matmul_rows", "matmul_cols", "linear_bias"])
def test_gemm_gradients_exact_on_integers(case, cache_dir):
    torch.manual_seed(0)
    _, fn, shapes = CASES[case]
    op = cg.compile(_fusion(case, torch.float32))
    inputs = [ints(*s, device="cuda") for s in shapes]
    weight = ints(*fn(*inputs).shape, device="cuda")
    out, grads = _run(op, inputs, weight)
    tout, tgrads = _run(fn, inputs, weight)
    for got, want in zip([out, *grads], [tout, *tgrads]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["llama_mlp", "gpt_mlp", "matmul_rows", "matmul_cols"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_gradients_match_torch(case, dtype, cache_dir):
    """Against torch autograd of the same math in the same dtype, both against an fp64
    reference: codegen's error is within a small factor of torch's own."""
    torch.manual_seed(0)
    _, fn, shapes = CASES[case]
    op = cg.compile(_fusion(case, dtype))
    inputs = [(torch.randn(*s, device="cuda") / s[-1] ** 0.25).to(dtype) for s in shapes]
    weight = torch.randn(fn(*inputs).shape, device="cuda").to(dtype)
    got = _run(op, inputs, weight)
    want = _run(fn, inputs, weight)
    exact = _run(fn, [x.double() for x in inputs], weight.double())
    for g, w, e in zip([got[0], *got[1]], [want[0], *want[1]], [exact[0], *exact[1]]):
        assert g.dtype == w.dtype and g.shape == w.shape
        err, ref_err = (g.double() - e).abs().max(), (w.double() - e).abs().max()
        scale = e.abs().max()
        assert err <= 4 * ref_err + 1e-3 * scale, (case, err, ref_err, scale)


def _scaled(shapes, scale):
    return [tuple(d * scale for d in s) for s in shapes]


@pytest.mark.parametrize("kind", sorted(BATCHED_SHAPES))
@pytest.mark.parametrize("axis", [0, 1, 2], ids=["batch", "rows", "cols"])
def test_batched_gradients_exact_on_integers(kind, axis, cache_dir):
    """Batched GEMM gradients (MatmulNT, batched MatmulTN, MatmulTNSum, a 3-D SumRows),
    exact; the inputs 16 times the CPU tests' sizes."""
    torch.manual_seed(0)
    op = cg.compile(batched(kind, torch.float32, axis, slices=4))
    inputs = [ints(*s, device="cuda") for s in _scaled(BATCHED_SHAPES[kind], 16)]
    weight = ints(*BATCHED_TORCH[kind](*inputs).shape, device="cuda")
    out, grads = _run(op, inputs, weight)
    tout, tgrads = _run(BATCHED_TORCH[kind], inputs, weight)
    for got, want in zip([out, *grads], [tout, *tgrads]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["shared", "linear"])
def test_batched_gradient_of_a_strided_batch(kind, cache_dir):
    """A 3-D input whose batch does not fold into its rows ([m, b, k] transposed): the
    summed weight gradient (and the bias's) runs one GEMM per batch, accumulating."""
    torch.manual_seed(0)
    op = cg.compile(batched(kind, torch.float32, 0, slices=4))
    b, m, k = _scaled([BATCHED_SHAPES[kind][0]], 16)[0]
    x = ints(m, b, k, device="cuda").transpose(0, 1)
    rest = [ints(*s, device="cuda") for s in _scaled(BATCHED_SHAPES[kind][1:], 16)]
    weight = ints(*BATCHED_TORCH[kind](x, *rest).shape, device="cuda")
    out, grads = _run(op, [x, *rest], weight)
    tout, tgrads = _run(BATCHED_TORCH[kind], [x, *rest], weight)
    for got, want in zip([out, *grads], [tout, *tgrads]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["shared", "linear"])
def test_batched_gradient_of_an_expanded_batch_of_rows(kind, cache_dir):
    """A 3-D input of one row per batch, expanded from one row (batch stride 0, as a
    decode step's): the summed weight gradient cannot fold the batch into rows and runs
    one GEMM per batch."""
    torch.manual_seed(0)
    op = cg.compile(batched(kind, torch.float32, 0, slices=4))
    b, _, k = _scaled([BATCHED_SHAPES[kind][0]], 16)[0]
    row = ints(1, 1, k, device="cuda").requires_grad_(True)
    rest = [ints(*s, device="cuda").requires_grad_(True)
            for s in _scaled(BATCHED_SHAPES[kind][1:], 16)]
    x = row.expand(b, 1, k)
    weight = ints(*BATCHED_TORCH[kind](x, *rest).shape, device="cuda")
    (op(x, *rest) * weight).sum().backward()
    got = [row.grad, *(t.grad for t in rest)]
    row2 = row.detach().clone().requires_grad_(True)
    rest2 = [t.detach().clone().requires_grad_(True) for t in rest]
    (BATCHED_TORCH[kind](row2.expand(b, 1, k), *rest2) * weight).sum().backward()
    for g, want in zip(got, [row2.grad, *(t.grad for t in rest2)]):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_sum_rows_of_a_strided_batch(cache_dir):
    """SumRows of a 3-D input whose batch does not fold into its rows: one GEMM per
    batch, accumulating; and of one that folds: one GEMM."""
    with cg.Fusion("sum_rows_3d") as f:
        x = cg.input(["b", "m", "n"], torch.float32, name="x")
        cg.output(grad_ops.sum_rows(x))
    op = cg.compile(f)
    torch.manual_seed(0)
    for x in (ints(48, 6, 40, device="cuda").transpose(0, 1), ints(6, 48, 40, device="cuda")):
        torch.testing.assert_close(op(x), x.sum((0, 1)), rtol=0, atol=0)


def test_host_weights_get_host_gradients(cache_dir):
    torch.manual_seed(0)
    op = cg.compile(examples.llama_mlp(torch.float32, 4, weights="cpu"))
    x = ints(64, 32, device="cuda", lo=-2, hi=3)
    ws = [ints(*s, lo=-2, hi=3).pin_memory() for s in [(96, 32), (96, 32), (32, 96)]]
    leaves = [x.clone().requires_grad_()] + [w.clone().pin_memory().requires_grad_()
                                             for w in ws]
    out = op(*leaves)
    weight = ints(*out.shape, device="cuda", lo=-2, hi=3)
    (out * weight).sum().backward()
    ref = [x.clone().requires_grad_()] + [w.cuda().requires_grad_() for w in ws]
    (_llama(*ref) * weight).sum().backward()
    assert leaves[0].grad.device.type == "cuda"
    for got, want in zip([t.grad for t in leaves[1:]], [t.grad for t in ref[1:]]):
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want.cpu(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(leaves[0].grad, ref[0].grad, rtol=1e-4, atol=1e-3)


def test_torch_compile_fullgraph_with_backward(cache_dir):
    torch.manual_seed(0)
    op = cg.compile(examples.llama_mlp(torch.float32, 4))
    inputs = [ints(*s, device="cuda", lo=-2, hi=3) / 4 for s in CASES["llama_mlp"][2]]
    weight = torch.randn(128, 64, device="cuda")
    eager = _run(op, inputs, weight)
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    got = _run(compiled, inputs, weight)
    for g, e in zip([got[0], *got[1]], [eager[0], *eager[1]]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_opcheck_with_gradients(cache_dir):
    op = cg.compile(examples.linear_bias())
    args = [torch.randn(32, 16, device="cuda", requires_grad=True),
            torch.randn(24, 16, device="cuda", requires_grad=True),
            torch.randn(24, device="cuda", requires_grad=True)]
    torch.library.opcheck(op.op, args)


def test_no_grad_and_detached_inputs_record_nothing(cache_dir):
    op = cg.compile(examples.matmul_rows(torch.float32, 4))
    x, w = torch.randn(64, 32, device="cuda", requires_grad=True), torch.randn(32, 16,
                                                                               device="cuda")
    with torch.no_grad():
        assert op(x, w).grad_fn is None
    assert op(x.detach(), w).grad_fn is None
    assert op(x, w).grad_fn is not None
