"""A split contraction on the GPU: the compiled op streaming a row-major host weight by
blocks of rows (exact on integers, any host layout, bf16 within rounding, captured in a
CUDA graph), and the input gradient of a host weight streamed in slices (exact, without
the whole weight on the GPU)."""

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples

pytestmark = [pytest.mark.gpu, pytest.mark.build]
CUDA = "cuda"
MiB = 2**20

_ops: dict = {}


def split_k_op(slices, dtype=torch.float32, **options):
    key = (slices, dtype, tuple(sorted(options.items())))
    if key not in _ops:
        _ops[key] = cg.compile(examples.stream_weights(dtype, slices), split_contraction=True,
                               **options)
    return _ops[key]


@pytest.fixture(autouse=True)
def _cache(cache_dir):
    return cache_dir


@pytest.mark.parametrize("options", [{}, {"copy_stream": True}, {"staging": "ring"}],
                         ids=["slots", "copy_stream", "ring"])
@pytest.mark.parametrize("slices", [1, 3, 8])
@pytest.mark.parametrize("k", [5, 301], ids=["k<S", "ragged"])
def test_exact_on_integers(slices, k, options):
    op = split_k_op(slices, **options)
    x = ints(64, k, device=CUDA, lo=-2, hi=3)
    for w in (ints(k, 1000, lo=-2, hi=3).pin_memory(), ints(k, 1000, lo=-2, hi=3)):
        assert torch.equal(op(x, w).cpu(), x.cpu() @ w)


def test_auto_runs_the_loop_it_picks_exactly():
    """split_contraction="auto": a short x streams w by rows, a long one by columns (fp32
    GEMMs are slow enough for the columns' 1 KiB rows to hide under them), a column-major
    w by columns; each exact, and the gradients through either loop too."""
    op = cg.compile(examples.stream_weights(torch.float32, 4), split_contraction="auto",
                    copy_stream=True)
    w = ints(1024, 1024, lo=-2, hi=3).pin_memory()
    w_cols = w.t().contiguous().pin_memory().t()
    for m, weight, rows in ((64, w, True), (8192, w, False), (64, w_cols, False)):
        x = ints(m, 1024, device=CUDA, lo=-2, hi=3)
        assert (op.pick([x, weight]) is op.alternative) is rows
        assert torch.equal(op(x, weight).cpu(), x.cpu() @ weight)
        xg, dy = x.clone().requires_grad_(), ints(m, 1024, device=CUDA, lo=-2, hi=3)
        weight.requires_grad_(True)
        op(xg, weight).backward(dy)
        weight.requires_grad_(False)
        assert torch.equal(xg.grad, dy @ weight.to(CUDA).t())
        assert torch.equal(weight.grad, (x.t() @ dy).cpu())
        weight.grad = None


def test_auto_call_runs_the_op_it_picks():
    """bf16 rounds the two loops differently: each call's result is its picked op's."""
    op = cg.compile(examples.stream_weights(torch.bfloat16, 4), split_contraction="auto")
    w = torch.randn(1024, 1024, dtype=torch.bfloat16).pin_memory()
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device=CUDA)
    picked = op.pick([x, w])
    other = op if picked is op.alternative else op.alternative
    assert picked is op.alternative  # bf16 GEMMs: a 64-row x is copy-bound
    assert not torch.equal(picked._overload(x, w), other._overload(x, w))
    assert torch.equal(op(x, w), picked._overload(x, w))


@pytest.mark.parametrize("layout", ["transposed", "column block", "every other column"])
def test_any_host_layout(layout):
    """Row blocks of a column-major or padded weight are 2-D copies: still exact."""
    op = split_k_op(3)
    x = ints(20, 24, device=CUDA)
    if layout == "transposed":
        w = ints(50, 24).pin_memory().t()
    elif layout == "column block":
        w = ints(24, 80).pin_memory()[:, 7:57]
    else:
        w = ints(24, 100).pin_memory()[:, ::2]
    assert torch.equal(op(x, w).cpu(), x.cpu() @ w)


def test_bf16_close_to_torch():
    op = split_k_op(8, torch.bfloat16)
    x = torch.randn(300, 512, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(512, 1000, dtype=torch.bfloat16).pin_memory()
    ref = x.double() @ w.to(CUDA).double()
    out = op(x, w).double()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


def test_captured_and_replayed():
    from codegen.nn import capture_graph

    op = split_k_op(4)
    x = ints(64, 96, device=CUDA)
    w = ints(96, 256).pin_memory()
    graph, out = capture_graph(lambda: op(x, w))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), x.cpu() @ w)


def test_holds_only_its_staging_slots():
    m, k, n, slices, pool = 256, 8192, 1024, 8, 4
    op = split_k_op(slices, pool_size=pool)
    x = ints(m, k, device=CUDA, lo=-2, hi=3)
    w = ints(k, n, lo=-2, hi=3).pin_memory()  # 32 MiB
    op(x, w)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = op(x, w)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    slots = pool * (k // slices) * n * 4  # 16 MiB
    assert extra <= slots + out.numel() * 4 + MiB, f"{extra / MiB:.1f} MiB"
    assert torch.equal(out, x @ w.to(CUDA))


def test_host_weight_input_gradient_is_streamed():
    """dX of a Linear whose weight is in host memory: exact, and the backward's peak GPU
    memory is its two stages (the weight's slices in, the gradient's out) and dX, below
    one whole weight (what copying it whole for dX took)."""
    m, k, n, slices, pool = 64, 2048, 4096, 8, 2  # w: 32 MiB in host memory
    op = cg.compile(examples.offload_linear(torch.float32, slices, False,
                                            name="host_linear_grad"), pool_size=pool)
    x = ints(m, k, device=CUDA, lo=-2, hi=3).requires_grad_(True)
    w = ints(n, k, lo=-2, hi=3).pin_memory().requires_grad_(True)
    dy = ints(m, n, device=CUDA, lo=-2, hi=3)
    op(x, w).backward(dy)  # builds the programs, warms the streams
    x.grad = w.grad = None
    y = op(x, w)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(dy)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    stages = 2 * pool * (n // slices) * k * 4  # 16 MiB
    assert extra <= stages + 2 * m * k * 4 + MiB < n * k * 4, f"{extra / MiB:.1f} MiB"
    assert torch.equal(x.grad, dy @ w.detach().to(CUDA))
    assert w.grad.device.type == "cpu" and torch.equal(w.grad, (dy.t() @ x.detach()).cpu())
