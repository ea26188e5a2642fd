"""The compiled op on a GPU against torch. Marked `gpu`; run on the H200 with
`PYTHONPATH=. python3 -m pytest -m gpu -q`."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples as ex

pytestmark = [pytest.mark.gpu, pytest.mark.build, pytest.mark.usefixtures("no_tf32")]
CUDA = "cuda"



@pytest.fixture(scope="module")
def ops(cache_dir):
    return {name: cg.compile(e.make()) for name, e in ex.EXAMPLES.items()}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def torch_ref(name, xs):
    d = [x.double().to(CUDA) for x in xs]  # host inputs (device="cpu") too
    if name in ("stream_matmul_n", "matmul_rows", "matmul_rows_bf16", "batched",
                "stream_weights", "offload_activations"):
        return d[0] @ d[1]
    if name in ("two_matmuls", "two_matmuls_not_inlinable"):
        return d[0] @ d[1] @ d[2]
    if name == "linear_bias":
        return F.linear(d[0], d[1], d[2])
    if name == "llama_mlp":
        return F.linear(F.silu(F.linear(d[0], d[1])) * F.linear(d[0], d[2]), d[3])
    if name == "gpt_mlp":
        return F.linear(F.gelu(F.linear(d[0], d[1], d[2]), approximate="tanh"), d[3], d[4])
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_example_matches_torch(ops, name):
    e = ex.EXAMPLES[name]
    dtype = e.make().inputs[0].dtype
    xs = [torch.randn(s, device=d, dtype=dtype) for s, d in zip(e.shapes, e.devices(CUDA))]
    out = ops[name](*xs).to(CUDA)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, torch_ref(name, xs)) < tol


@pytest.mark.parametrize("name", sorted(n for n, e in ex.EXAMPLES.items() if e.exact))
def test_example_exact_on_integer_values(ops, name):
    e = ex.EXAMPLES[name]
    dtype = e.make().inputs[0].dtype
    xs = [ints(*s, dtype=dtype, device=d, lo=-2, hi=3) for s, d in zip(e.shapes, e.devices(CUDA))]
    out = ops[name](*xs).to(CUDA)
    assert torch.equal(out.double(), torch_ref(name, xs))


SHAPES = [(1, 1, 1), (5, 3, 7), (37, 24, 20), (3, 8, 2), (129, 65, 33), (1000, 512, 300)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_shapes_symbolic_ragged(ops, m, k, n, dtype):
    op = ops["matmul_rows"] if dtype == torch.float32 else (
        ops["matmul_rows_bf16"] if dtype == torch.bfloat16 else
        cg.compile(ex.matmul_rows(torch.float16, 4, "matmul_rows_f16")))
    a, b = (torch.randn(m, k, device=CUDA, dtype=dtype), torch.randn(k, n, device=CUDA,
                                                                      dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(op(a, b), a.double() @ b.double()) < tol


@pytest.mark.parametrize("slices", [1, 2, 3, 7, 8, 64])
def test_slice_counts_with_pool_of_four(cache_dir, slices):
    op = cg.compile(ex.matmul_rows(torch.float32, slices, f"rows_{slices}"))
    a, b = ints(50, 16, device=CUDA), ints(16, 9, device=CUDA)
    assert torch.equal(op(a, b), a @ b)


def test_linear_3d_and_bias_variants(cache_dir):
    with cg.Fusion("linear3d") as fusion:
        x, w, bias = cg.input(["b", "m", "k"]), cg.input(["n", "k"]), cg.input(["n"])
        out = cg.linear(x, w, bias)
        cg.output(out)
    out.outer_split(1, 3)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion)
    xs = [ints(4, 10, 6, device=CUDA), ints(5, 6, device=CUDA), ints(5, device=CUDA)]
    assert torch.equal(op(*xs), torch.nn.functional.linear(*xs))


def test_transposed_inputs_use_op_flags(ops):
    a = ints(24, 37, device=CUDA).t()  # column-major [37, 24]
    b = ints(20, 24, device=CUDA).t()
    assert not a.is_contiguous() and not b.is_contiguous()
    assert torch.equal(ops["matmul_rows"](a, b), a @ b)
    col_slice = ints(37, 40, device=CUDA)[:, 3:27]  # row-major with a wider row stride
    assert torch.equal(ops["matmul_rows"](col_slice, b), col_slice @ b)


def test_empty_and_degenerate_extents(ops):
    op = ops["matmul_rows"]
    for m, k, n in [(0, 4, 3), (5, 0, 3), (5, 4, 0), (2, 4, 3)]:  # m=2 < 4 slices
        a, b = ints(m, k, device=CUDA), ints(k, n, device=CUDA)
        out = op(a, b)
        assert out.shape == (m, n) and torch.equal(out, a @ b)


def test_nan_and_inf_propagate_like_torch(ops):
    a, b = torch.randn(9, 4, device=CUDA), torch.randn(4, 6, device=CUDA)
    a[2, 1], b[0, 3] = float("nan"), float("inf")
    out, ref = ops["matmul_rows"](a, b), a @ b
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_slices_run_on_distinct_streams(ops):
    from codegen.tools.timeline import profile_kernels

    a = torch.randn(2048, 2048, device=CUDA)
    b = torch.randn(2048, 2048, device=CUDA)
    kernels = profile_kernels(lambda: ops["matmul_rows"](a, b))
    gemms = [k for k in kernels if "memset" not in k.name.lower()]
    assert len(gemms) >= 4, [k.name for k in kernels]
    assert len({k.stream for k in gemms}) >= 2, gemms


def test_ordered_against_the_callers_stream_without_host_sync(ops):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(4096, 1024, device=CUDA)
        b = torch.randn(1024, 512, device=CUDA)
        for _ in range(20):  # keep the caller's stream busy when the op is called
            a = a * 1.0001
        out = ops["matmul_rows"](a, b)
        ref = a @ b
        err = ((out - ref).norm() / ref.norm())  # consumed on the caller's stream
    torch.cuda.synchronize()
    assert err.item() < 1e-5


def test_cuda_graph_capture_and_replay_with_new_data(ops):
    op = ops["matmul_rows"]
    a, b = torch.randn(512, 256, device=CUDA), torch.randn(256, 128, device=CUDA)
    op(a, b)  # warm up: streams, handles, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a, b)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, a.double() @ b.double()) < 1e-5


def test_torch_compile(ops):
    op = ops["matmul_rows"]
    f = torch.compile(lambda a, b: op(a, b) * 2 + 1, fullgraph=True)
    a, b = ints(33, 16, device=CUDA), ints(16, 8, device=CUDA)
    assert torch.equal(f(a, b), (a @ b) * 2 + 1)


def test_opcheck(ops):
    a, b = torch.randn(37, 24, device=CUDA), torch.randn(24, 20, device=CUDA)
    torch.library.opcheck(ops["matmul_rows"].op.default, (a, b),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("case,match", [
    ("cpu", "argument T0 must be a CUDA tensor, got a tensor on cpu"),
    ("dtype", "argument T1 must be float32, got float16"),
    ("size", "argument T1 axis 0 must have size k = 24, got 23"),
    ("rank", r"argument T0 must have rank 2 float32\[m, k\], got shape \[37, 24, 1\]"),
    ("layout", "argument T1 has sizes .* strides .*Pass T1.contiguous()"),
], ids=["cpu", "dtype", "size", "rank", "layout"])
def test_bad_inputs_raise(ops, case, match):
    a, b = torch.randn(37, 24, device=CUDA), torch.randn(24, 20, device=CUDA)
    if case == "cpu":
        a = a.cpu()
    elif case == "dtype":
        b = b.half()
    elif case == "size":
        b = b[:23]
    elif case == "rank":
        a = a[..., None]
    elif case == "layout":
        b = torch.randn(1, 20, device=CUDA).expand(24, 20)
    with pytest.raises(RuntimeError, match=match):
        ops["matmul_rows"](a, b)


def test_missing_argument_raises(ops):
    with pytest.raises((RuntimeError, TypeError)):
        ops["matmul_rows"](torch.randn(3, 4, device=CUDA))


def test_fixed_extent_program(ops):
    with pytest.raises(RuntimeError, match="argument T0 axis 0 must have size 5, got 6"):
        ops["stream_matmul_n"](torch.randn(6, 7, device=CUDA), torch.randn(7, 6, device=CUDA))


def test_1024_slices(cache_dir):
    op = cg.compile(ex.matmul_rows(torch.float32, 1024, "rows_1024"))
    for m in (5, 3000):
        a, b = ints(m, 16, device=CUDA), ints(16, 9, device=CUDA)
        assert torch.equal(op(a, b), a @ b)


def test_overlapping_strides_are_refused(ops):
    over = torch.randn(64, device=CUDA).as_strided((37, 24), (1, 1))
    with pytest.raises(RuntimeError, match=r"argument T0 has sizes \[37, 24\] and strides "
                                           r"\[1, 1\].*T0.contiguous\(\)"):
        ops["matmul_rows"](over, torch.randn(24, 20, device=CUDA))


def test_requires_grad_runs_forward_and_backward(ops):
    a = torch.randn(37, 24, device=CUDA, requires_grad=True)
    b = torch.randn(24, 20, device=CUDA)
    out = ops["matmul_rows"](a, b)
    assert rel_err(out.detach(), a.detach().double() @ b.double()) < 1e-5
    grad = torch.randn_like(out)
    out.backward(grad)
    assert rel_err(a.grad, grad.double() @ b.double().T) < 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_two_gpus(ops):
    a, b = torch.randn(37, 24, device="cuda:0"), torch.randn(24, 20, device="cuda:1")
    with pytest.raises(RuntimeError, match="argument T1 is on cuda:1 but T0 is on cuda:0"):
        ops["matmul_rows"](a, b)


@pytest.mark.parametrize("name", ["two_matmuls_not_inlinable", "linear_bias", "batched"])
def test_evaluator_on_cuda_matches_torch(name):
    e = ex.EXAMPLES[name]
    xs = [ints(*s, device=CUDA) for s in e.shapes]
    (out,) = cg.evaluate(cg.lower(e.make()), xs)
    assert out.is_cuda and torch.equal(out.double(), torch_ref(name, xs))
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # restored
