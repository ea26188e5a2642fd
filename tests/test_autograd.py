"""Backward on the CPU: the derived programs (what is saved, how they are split, host
gradients), the evaluator's gradients against torch (gradcheck in fp64, exact on
integer-valued fp32), every op kind's rule, and the errors of what has no backward."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints
from helpers import BATCHED_SHAPES, BATCHED_TORCH, batched, stream_loops

import codegen as cg
from codegen import examples
from codegen import hostir as hir
from codegen.interp import races
from codegen.runtime import autograd

F64 = torch.float64


def _grads(program, inputs):
    """The evaluator's outputs and the gradients of sum(out * weights) for ``inputs``."""
    leaves = [x.detach().clone().requires_grad_(x.dtype.is_floating_point) for x in inputs]
    outs = cg.evaluate(program, leaves)
    torch.manual_seed(1)
    weights = [ints(*o.shape, dtype=o.dtype) for o in outs]
    sum(((o * w).sum() for o, w in zip(outs, weights)), torch.zeros((), dtype=F64)).backward()
    return outs, [x.grad for x in leaves], weights


def _torch_grads(fn, inputs, weights):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o * w).sum() for o, w in zip(outs, weights)), torch.zeros((), dtype=F64)).backward()
    return list(outs), [x.grad for x in leaves]


def _llama(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _gpt(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


# ---------------------------------------------------------------------------- gradcheck


def _gradcheck(fusion, shapes):
    program = cg.lower(fusion)
    torch.manual_seed(0)
    args = [torch.randn(*s, dtype=F64, requires_grad=True) for s in shapes]
    assert torch.autograd.gradcheck(lambda *a: cg.evaluate(program, list(a)), args)


@pytest.mark.parametrize("slices", [1, 3])
def test_gradcheck_llama_mlp(slices):
    _gradcheck(examples.llama_mlp(F64, slices), [(5, 4), (7, 4), (7, 4), (4, 7)])


def test_gradcheck_gpt_mlp():
    _gradcheck(examples.gpt_mlp(F64, 3), [(5, 4), (7, 4), (7,), (4, 7), (4,)])


@pytest.mark.parametrize("axis", [0, 1])
def test_gradcheck_split_matmul(axis):
    fusion = examples.matmul_rows(F64, 3) if axis == 0 else _matmul_cols(F64)
    _gradcheck(fusion, [(7, 4), (4, 5)])


def _matmul_cols(dtype=torch.float32, slices=3):
    with cg.Fusion("matmul_cols") as f:
        a = cg.input(["m", "k"], dtype, name="a")
        b = cg.input(["k", "n"], dtype, name="b")
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    return f


def _unary(op, **kw):
    with cg.Fusion(f"{op.__name__}_after_linear") as f:
        x = cg.input(["m", "k"], F64, name="x")
        w = cg.input(["n", "k"], F64, name="w")
        y = op(cg.linear(x, w), **kw)
        cg.output(y)
    y.outer_split(1, 2)
    y.axis(1).parallelize(cg.ParallelType.Stream)
    return f


@pytest.mark.parametrize("op,kw", [(cg.silu, {}), (cg.gelu, {"approximate": "none"}),
                                   (cg.gelu, {"approximate": "tanh"}), (cg.relu, {})],
                         ids=["silu", "gelu", "gelu_tanh", "relu"])
def test_gradcheck_activations(op, kw):
    _gradcheck(_unary(op, **kw), [(5, 3), (6, 3)])


@pytest.mark.parametrize("op", [cg.add, cg.mul])
@pytest.mark.parametrize("b_shape", [(5, 6), (6,)], ids=["same", "broadcast"])
def test_gradcheck_binary(op, b_shape):
    with cg.Fusion(f"{op.__name__}_bias") as f:
        x = cg.input(["m", "k"], F64, name="x")
        w = cg.input(["n", "k"], F64, name="w")
        b = cg.input(list(b_shape), F64, name="b")
        y = op(cg.linear(x, w), b)
        cg.output(y)
    _gradcheck(f, [(5, 3), (6, 3), b_shape])


def test_cast_gradient_is_cast_back():
    with cg.Fusion("cast_up") as f:
        x = cg.input(["m", "k"], torch.float32, name="x")
        w = cg.input(["n", "k"], torch.float32, name="w")
        y = cg.cast(cg.linear(x, w), F64)
        cg.output(y)
    x, w = ints(5, 3), ints(6, 3)
    (out,), (gx, gw), (weight,) = _grads(cg.lower(f), [x, w])
    assert out.dtype == F64 and gx.dtype == torch.float32
    _, (tx, tw) = _torch_grads(lambda x, w: F.linear(x, w).double(), [x, w], [weight])
    torch.testing.assert_close(gx, tx, rtol=0, atol=0)
    torch.testing.assert_close(gw, tw, rtol=0, atol=0)


# ---------------------------------------------------------------------------- exact


@pytest.mark.parametrize("case", ["llama", "gpt_relu", "linear_bias", "rows", "cols"])
def test_gradients_exact_on_integers(case):
    """Integer-valued fp32 inputs: every product and sum is exact, so the gradients must
    equal torch's bit for bit (the activations are kept to relu, exact too)."""
    torch.manual_seed(0)
    if case == "llama":  # silu is not exact: only the structure of the sums is tested
        fusion, fn = examples.llama_mlp(torch.float32, 3), _llama
        inputs = [ints(6, 4), ints(9, 4), ints(9, 4), ints(4, 9)]
    elif case == "gpt_relu":
        with cg.Fusion("relu_mlp") as fusion:
            x = cg.input(["m", "h"], torch.float32, name="x")
            w1 = cg.input(["i", "h"], torch.float32, name="w1")
            b1 = cg.input(["i"], torch.float32, name="b1")
            w2 = cg.input(["h", "i"], torch.float32, name="w2")
            b2 = cg.input(["h"], torch.float32, name="b2")
            hidden = cg.relu(cg.linear(x, w1, b1))
            y = cg.linear(hidden, w2, b2)
            cg.output(y)
        hidden.outer_split(1, 3)
        hidden.axis(1).parallelize(cg.ParallelType.Stream)

        def fn(x, w1, b1, w2, b2):
            return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)

        inputs = [ints(6, 4), ints(9, 4), ints(9), ints(4, 9), ints(4)]
    elif case == "linear_bias":
        fusion, inputs = examples.linear_bias(), [ints(5, 7), ints(6, 7), ints(6)]
        fn = F.linear
    elif case == "rows":
        fusion, fn, inputs = examples.matmul_rows(), torch.matmul, [ints(9, 4), ints(4, 5)]
    else:
        fusion, fn, inputs = _matmul_cols(), torch.matmul, [ints(9, 4), ints(4, 5)]
    outs, grads, weights = _grads(cg.lower(fusion), inputs)
    touts, tgrads = _torch_grads(fn, inputs, weights)
    exact = {"rtol": 0, "atol": 0} if case != "llama" else {"rtol": 1e-5, "atol": 1e-4}
    for got, want in zip(outs + grads, touts + tgrads):
        torch.testing.assert_close(got, want, **exact)


def test_only_the_wanted_gradients():
    """x alone requires grad: the backward computes dX and reads neither the saved x nor
    anything for dW."""
    program = cg.lower(examples.matmul_rows())
    g = autograd.derive(program.source, (True, False))
    assert [t.name for t in g.backward.outputs] == ["grad_T0"]
    assert [t.name for t in g.backward.inputs] == ["T1", "grad_T2"]
    assert g.saved_inputs == (1,) and g.grads == (("output", 0), None)
    x, w = ints(8, 4).requires_grad_(), ints(4, 5)
    cg.evaluate(program, [x, w])[0].sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(8, 5) @ w.t(), rtol=0, atol=0)


def test_passthrough_and_unused_inputs():
    """The gradient of a bias added to the output is the output's gradient itself; an
    input the output does not depend on gets zeros."""
    with cg.Fusion("residual") as f:
        x = cg.input(["m", "k"], torch.float32, name="x")
        w = cg.input(["k", "n"], torch.float32, name="w")
        r = cg.input(["m", "n"], torch.float32, name="r")
        cg.input(["m", "n"], torch.float32, name="unused")
        cg.output(cg.add(cg.matmul(x, w), r))
    program = cg.lower(f)
    inputs = [ints(3, 4), ints(4, 5), ints(3, 5), ints(3, 5)]
    leaves = [t.clone().requires_grad_() for t in inputs]
    weight = ints(3, 5)
    (cg.evaluate(program, leaves)[0] * weight).sum().backward()
    assert torch.equal(leaves[2].grad, weight)
    assert torch.equal(leaves[3].grad, torch.zeros(3, 5))
    assert torch.equal(leaves[1].grad, inputs[0].t() @ weight)


# ---------------------------------------------------------------------------- structure


def _race_check(program, env):
    """The stream-order checker on inputs of the sizes ``env`` gives."""
    races.check(program, [torch.zeros([e.evaluate(env) for e in t.shape], dtype=t.dtype)
                          for t in program.inputs])


def test_llama_saves_the_gemm_results_and_recomputes_the_rest():
    """torch saves gate, up, silu(gate) and the product (four [m, i] tensors); the saving
    forward keeps the two GEMM results and the backward recomputes the pointwise ones."""
    program = cg.lower(examples.llama_mlp())
    g = autograd.derive(program.source, (True,) * 4)
    assert [t.name for t in g.forward.outputs] == ["T8", "T4", "T6"]
    assert g.n_saved == 2 and g.saved_inputs == (0, 1, 2, 3)
    assert [t.name for t in g.backward.inputs] == [
        "x", "w_gate", "w_up", "w_down", "T4", "T6", "grad_T8"]
    assert [t.name for t in g.backward.outputs] == [
        "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down"]


def test_llama_backward_is_one_loop_split_like_the_forward():
    """Every gradient of the intermediate axis is per slice on the slice's stream (dW of
    the three weights too); dX contracts the split axis, so it runs whole after the
    loop: two GEMMs, the second accumulating onto the first (no Add); the silu that
    three pointwise nodes read is recomputed in each, never stored."""
    program = cg.lower(examples.llama_mlp())
    g = autograd.derive(program.source, (True,) * 4)
    bwd = cg.lower(g.backward)
    loops = stream_loops(bwd)
    assert len(loops) == 1
    inside = [n for n in loops[0].body if isinstance(n, hir.Compute)]
    assert sorted(n.out for n in inside if n.gemm is not None) == [
        "grad_T7_i", "grad_w_down_i", "grad_w_gate_i", "grad_w_up_i"]
    after = [n for n in bwd.body if isinstance(n, hir.Compute)]
    assert [(type(n).__name__, n.out, n.accumulate) for n in after] == [
        ("Matmul", "grad_x", False), ("Matmul", "grad_x", True)]
    assert [str(n) for n in inside if n.gemm is None] == [
        "Mul(Silu(T4_i), T6_i, out=T10_i)", "Mul(grad_T7_i, Silu(T4_i), out=grad_T6_i)",
        "SiluGrad(Mul(grad_T7_i, T6_i), T4_i, out=grad_T4_i)"]
    _race_check(bwd, {"m": 6, "h": 4, "inter": 9})


@pytest.mark.parametrize("axis", [0, 1])
def test_split_matmul_backward_follows_the_split(axis):
    """Split by rows: dX = dY_i @ w.T per slice, dW = x.T @ dY whole. By columns: dW_i =
    x.T @ dY_i per slice, dX whole."""
    fusion = examples.matmul_rows() if axis == 0 else _matmul_cols()
    g = autograd.derive(cg.lower(fusion).source, (True, True))
    bwd = cg.lower(g.backward)
    (loop,) = stream_loops(bwd)
    split = {n.out for n in loop.body if isinstance(n, hir.Compute)}
    whole = {n.out for n in bwd.body if isinstance(n, hir.Compute)}
    dx, dw = (t.name for t in g.backward.outputs)
    assert (split, whole) == (({f"{dx}_i"}, {dw}) if axis == 0 else ({f"{dw}_i"}, {dx}))


def test_host_weights_get_host_gradients_streamed_out():
    """A weight in host memory gets its gradient in host memory, copied out slice by slice
    from a staging slot on the slice's stream; the evaluator's values match torch."""
    program = cg.lower(examples.llama_mlp(torch.float32, 3, weights="cpu"))
    g = autograd.derive(program.source, (True,) * 4)
    devices = [t.device for t in g.backward.outputs]
    assert devices == ["cuda", "cpu", "cpu", "cpu"]
    bwd = cg.lower(g.backward)
    out_copies = [n for n in bwd.nodes() if isinstance(n, hir.Copy)
                  and n.out.startswith("grad_w")]
    assert {n.out for n in out_copies} == {"grad_w_gate_i", "grad_w_up_i", "grad_w_down_i"}
    _race_check(bwd, {"m": 6, "h": 4, "inter": 9})
    inputs = [ints(6, 4), ints(9, 4), ints(9, 4), ints(4, 9)]
    outs, grads, weights = _grads(program, inputs)
    _, tgrads = _torch_grads(_llama, inputs, weights)
    for got, want in zip(grads, tgrads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_backward_programs_print_their_gradient_ops():
    g = autograd.derive(cg.lower(examples.gpt_mlp(torch.float32, 2)).source, (True,) * 5)
    text = str(cg.lower(g.backward))
    assert "HostProgram gpt_mlp_backward(" in text
    assert "GeluGrad(" in text and "approximate=tanh" in text
    assert "SumRows(" in text and "MatmulTN(" in text


def test_backward_digest_ignores_the_source():
    """The source fusion is not part of the program: two lowerings of one fusion have one
    op name, and the backward's name differs from the forward's."""
    from codegen.backend.renderer import op_name

    f = examples.llama_mlp()
    assert op_name(cg.lower(f)) == op_name(cg.lower(f))
    g = autograd.derive(cg.lower(f).source, (True,) * 4)
    assert op_name(cg.lower(g.backward)) != op_name(cg.lower(f))


# ---------------------------------------------------------------------------- batched

@pytest.mark.parametrize("kind", sorted(BATCHED_SHAPES))
@pytest.mark.parametrize("axis", [0, 1, 2], ids=["batch", "rows", "cols"])
def test_gradcheck_batched(kind, axis):
    _gradcheck(batched(kind, F64, axis), BATCHED_SHAPES[kind])


@pytest.mark.parametrize("kind", sorted(BATCHED_SHAPES))
@pytest.mark.parametrize("axis", [0, 1, 2], ids=["batch", "rows", "cols"])
def test_batched_gradients_exact_on_integers(kind, axis):
    torch.manual_seed(0)
    inputs = [ints(*s) for s in BATCHED_SHAPES[kind]]
    outs, grads, weights = _grads(cg.lower(batched(kind, torch.float32, axis)), inputs)
    touts, tgrads = _torch_grads(BATCHED_TORCH[kind], inputs, weights)
    for got, want in zip(outs + grads, touts + tgrads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_batched_backward_ops():
    """Which GEMMs the gradients are: a batched product's are batched products, a shared
    operand's gradient sums over the batch (one contraction over batch and rows)."""
    def gemms(kind):
        program = cg.lower(batched(kind, torch.float32, 0))
        g = autograd.derive(program.source, (True,) * len(program.inputs))
        return sorted(op.defn.name for op in g.backward.ops)

    assert gemms("bmm") == ["matmul_nt", "matmul_tn"]
    assert gemms("shared") == ["linear", "matmul_tn_sum"]
    assert gemms("linear") == ["matmul", "matmul_tn_sum", "sum_rows"]


def test_batched_gradient_of_a_strided_input():
    """A batch that does not fold into rows (x [m, b, k] transposed to [b, m, k]): the
    evaluator's gradients still equal torch's."""
    torch.manual_seed(0)
    x = ints(5, 4, 3).transpose(0, 1)
    w, bias = ints(6, 3), ints(6)
    outs, grads, weights = _grads(cg.lower(batched("linear", torch.float32, 0)), [x, w, bias])
    touts, tgrads = _torch_grads(F.linear, [x, w, bias], weights)
    for got, want in zip(outs + grads, touts + tgrads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------- errors


def test_a_broadcast_without_a_backward_is_named():
    """b [m, n] broadcast against [batch, m, n] has no gradient rule: the forward runs
    where inputs require grad; the backward fails naming the op and the operand."""
    with cg.Fusion("add_over_batch") as f:
        x = cg.input(["b", "m", "k"], F64, name="x")
        w = cg.input(["k", "n"], F64, name="w")
        plane = cg.input(["m", "n"], F64, name="plane")
        cg.output(cg.add(cg.matmul(x, w), plane))
    inputs = [torch.randn(*s, dtype=F64, requires_grad=True) for s in [(2, 3, 4), (4, 5),
                                                                        (3, 5)]]
    out = cg.evaluate(cg.lower(f), inputs)[0]
    with pytest.raises(cg.ScheduleError, match=r"add_over_batch: no backward: add: no "
                                               r"backward for plane, broadcast from rank 2 "
                                               r"to rank 3"):
        out.sum().backward()


def test_a_double_backward_is_refused_by_name():
    """create_graph=True would give gradients that are constants of the graph built on
    them (the gradient programs have no backward): refused, naming the op. Under
    create_graph, a gradient that reads nothing that requires grad is still given."""
    program = cg.lower(examples.matmul_rows(F64, 3))
    x = torch.randn(6, 4, dtype=F64, requires_grad=True)
    w = torch.randn(4, 5, dtype=F64, requires_grad=True)
    (y,) = cg.evaluate(program, [x, w])
    with pytest.raises(cg.ScheduleError, match="matmul_rows: no double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    (y,) = cg.evaluate(program, [x, w.detach()])
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # dX reads w alone
    torch.testing.assert_close(gx, torch.ones(6, 5, dtype=F64) @ w.detach().T)


def test_no_grad_records_nothing():
    program = cg.lower(examples.matmul_rows())
    x, w = ints(8, 4).requires_grad_(), ints(4, 5)
    with torch.no_grad():
        out = cg.evaluate(program, [x, w])[0]
    assert out.grad_fn is None and not out.requires_grad


# ---------------------------------------------------------------------------- kernels

GRAD_MATH = r"""
#include <math.h>
#include <stdio.h>
#define __device__
#define __forceinline__ inline
#include KERNEL_TEXT

int main() {
  float x, dy;
  while (scanf("%a %a", &dy, &x) == 2) {
    const double d = x, g = dy;
    printf("%a %a %a %a %a %a\n", silu_grad(dy, x), gelu_grad(dy, x), gelu_tanh_grad(dy, x),
           silu_grad(g, d), gelu_grad(g, d), gelu_tanh_grad(g, d));
  }
}
"""


@pytest.mark.build
def test_activation_derivatives_match_torch(tmp_path):
    """The prelude's derivatives (compiled for the host, as the kernels' device functions
    are written) against torch's silu_backward and gelu_backward, in float and double."""
    import math
    import subprocess

    from test_pointwise_runtime import cxx, kernel_text

    prelude = tmp_path / "prelude.h"
    prelude.write_text(kernel_text("kPointwisePrelude"))
    source = tmp_path / "grad.cpp"
    source.write_text(GRAD_MATH)
    binary = cxx(source, tmp_path / "grad", f'-DKERNEL_TEXT="{prelude}"')
    xs = torch.cat([torch.linspace(-9, 9, 361), torch.tensor([0.0, 30.0, -30.0, 88.0])])
    dys = torch.linspace(-3, 3, len(xs))
    stdin = "".join(f"{float(g).hex()} {float(x).hex()}\n" for g, x in zip(dys, xs))
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    got = torch.tensor([[float.fromhex(v) for v in line.split()]
                        for line in run.stdout.splitlines()], dtype=F64)
    aten = torch.ops.aten
    for col, fn in enumerate([lambda g, x: aten.silu_backward(g, x),
                              lambda g, x: aten.gelu_backward(g, x),
                              lambda g, x: aten.gelu_backward(g, x, approximate="tanh")]):
        torch.testing.assert_close(got[:, col].float(), fn(dys, xs), rtol=1e-5, atol=4e-6)
        torch.testing.assert_close(got[:, col + 3], fn(dys.double(), xs.double()),
                                   rtol=1e-12, atol=1e-13)
    assert not math.isnan(got.sum())


@pytest.mark.build
def test_backward_programs_build(cache_dir):
    """The backward's C++ (MatmulTN, SumRows, the GELU-derivative kernel, host gradients
    copied out) builds and loads without a GPU."""
    for fusion in (examples.gpt_mlp(torch.bfloat16, 2),
                   examples.llama_mlp(torch.float32, 2, weights="cpu"),
                   batched("bmm", torch.bfloat16, 0), batched("linear", torch.float32, 1)):
        program = cg.lower(fusion)
        g = autograd.derive(program.source, (True,) * len(program.inputs))
        op = cg.build(cg.lower(g.backward).replace(source=None))
        assert op.name.startswith(f"codegen::{fusion.name}_backward_")
        assert "gemms.matmul_tn" in op.source


@pytest.mark.build
def test_a_linear_applied_twice_sums_its_gradients_and_builds(cache_dir):
    """One weight and bias read by two linears: dW's two GEMMs become one accumulating
    onto the other; the bias gradient's two row sums stay an add (a row sum does not
    accumulate in the runtime). Exact on integers; the C++ builds."""
    with cg.Fusion("tied_linear") as fusion:
        x1, x2 = cg.input(["m", "k"], name="x1"), cg.input(["m", "k"], name="x2")
        w, b = cg.input(["n", "k"], name="w"), cg.input(["n"], name="b")
        cg.output(cg.linear(x1, w, b))
        cg.output(cg.linear(x2, w, b))
    g = autograd.derive(cg.lower(fusion).source, (True,) * 4)
    bwd = cg.lower(g.backward)
    computes = [str(n) for n in bwd.nodes() if isinstance(n, hir.Compute)]
    assert "MatmulTN(grad_T4, x1, out=grad_w, accumulate=True)" in computes
    assert [c for c in computes if c.startswith("Add(")] == ["Add(T7, T10, out=grad_b)"]
    x1, x2, w, b, d1, d2 = ints(3, 4), ints(3, 4), ints(5, 4), ints(5), ints(3, 5), ints(3, 5)
    _race_check(bwd, {"m": 3, "k": 4, "n": 5})
    got = cg.evaluate(bwd, [x1, x2, w, d1, d2])
    assert [t.shape for t in got] == [(3, 4), (3, 4), (5, 4), (5,)]
    assert torch.equal(got[2], d1.t() @ x1 + d2.t() @ x2)
    assert torch.equal(got[3], d1.sum(0) + d2.sum(0))
    op = cg.build(bwd.replace(source=None))
    assert "rt::kAccumulate" in op.source


def test_unnamed_chain_with_a_host_weight():
    """Automatic names of the backward's ops never take a forward name the backward
    declares later (a saved GEMM result ``T3``)."""
    with cg.Fusion("chain") as f:
        x, w1 = cg.input(["m", "k"]), cg.input(["i", "k"])
        w2 = cg.input(["n", "i"], device="cpu")
        t = cg.linear(x, w1)
        cg.output(cg.linear(t, w2))
    t.outer_split(1, 2)
    t.axis(1).parallelize(cg.ParallelType.Stream)
    torch.manual_seed(0)
    inputs = [ints(5, 3), ints(4, 3), ints(6, 4)]
    _, grads, weights = _grads(cg.lower(f), inputs)
    _, tgrads = _torch_grads(lambda x, w1, w2: F.linear(F.linear(x, w1), w2), inputs, weights)
    for got, want in zip(grads, tgrads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_saved_result_that_is_an_output_is_saved_once():
    """t is an output and the backward reads it (dw2 = t.T @ dy): the saving forward adds
    no second copy of it."""
    with cg.Fusion("two_outputs") as f:
        x, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "i"]), cg.input(["i", "n"])
        t = cg.matmul(x, w1)
        cg.output(cg.matmul(t, w2))
        cg.output(t)
    t.outer_split(1, 2)
    t.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(f)
    g = autograd.derive(program.source, (True, True, True))
    assert g.forward is None and g.saved_outputs == (1,)
    torch.manual_seed(0)
    inputs = [ints(5, 3), ints(3, 4), ints(4, 6)]
    outs, grads, weights = _grads(program, inputs)

    def fn(x, w1, w2):
        t = x @ w1
        return t @ w2, t

    touts, tgrads = _torch_grads(fn, inputs, weights)
    for got, want in zip(outs + grads, touts + tgrads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_evaluator_derives_a_programs_backward_once(monkeypatch):
    """A model calls one program again and again (an offloaded Linear per layer): its
    backward is derived and lowered on the first call that records, not on every call."""
    calls = []

    def counting(fusion, wanted):
        calls.append(wanted)
        return derive(fusion, wanted)

    derive = autograd.derive
    monkeypatch.setattr(autograd, "derive", counting)
    program = cg.lower(examples.llama_mlp(F64, 2))
    shapes = [(5, 4), (7, 4), (7, 4), (4, 7)]
    for _ in range(10):
        leaves = [torch.randn(*s, dtype=F64, requires_grad=True) for s in shapes]
        cg.evaluate(program, leaves)[0].sum().backward()
        assert all(x.grad is not None for x in leaves)
    assert calls == [(True, True, True, True)]
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)  # another set of wanted inputs
    for _ in range(3):
        cg.evaluate(program, [x, *(torch.randn(*s, dtype=F64) for s in shapes[1:])])
    assert calls == [(True, True, True, True), (True, False, False, False)]


def test_the_evaluators_derived_programs_go_with_their_program():
    import gc

    program = cg.lower(examples.llama_mlp(F64, 2))
    leaves = [torch.randn(*s, dtype=F64, requires_grad=True)
              for s in [(5, 4), (7, 4), (7, 4), (4, 7)]]
    cg.evaluate(program, leaves)[0].sum().backward()
    key = id(program)
    assert key in autograd._evaluator_runners
    del program, leaves
    gc.collect()
    assert key not in autograd._evaluator_runners
