"""Layers on the GPU: the MLP examples and every elementwise op against torch, the GEMM
epilogues and their fallback, peak memory against eager, CUDA-graph capture."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples

pytestmark = pytest.mark.gpu


def llama_ref(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def gpt_ref(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _randn(shapes, dtype, device="cuda", scale=0.5):
    return [torch.randn(s, device=device, dtype=torch.float32).mul(scale).to(dtype)
            for s in shapes]


def _close(out, ref, dtype):
    """Relative error of the whole tensor: bf16 results within a few roundings."""
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    bound = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5,
             torch.float64: 1e-12}[dtype]
    assert err < bound, (err, bound)


@pytest.mark.parametrize("weights", ["cuda", "cpu"])
@pytest.mark.parametrize("slices", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name,make,ref", [("llama_mlp", examples.llama_mlp, llama_ref),
                                           ("gpt_mlp", examples.gpt_mlp, gpt_ref)])
def test_mlp_matches_torch(name, make, ref, dtype, slices, weights, cache_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    m, h, i = 96, 128, 352  # ragged: 352 = 4 * 88, 3 * 117 + 1
    shapes = ([(m, h), (i, h), (i, h), (h, i)] if name == "llama_mlp"
              else [(m, h), (i, h), (i,), (h, i), (h,)])
    xs = _randn(shapes, dtype)
    args = [xs[0]] + [t.cpu().pin_memory() if weights == "cpu" else t for t in xs[1:]]
    op = cg.compile(make(dtype, slices, weights, name=f"{name}_{weights}_s{slices}"))
    out = op(*args)
    expect = ref(*xs)
    _close(out, expect, dtype)
    (evaluated,) = cg.evaluate(op.host_ir, args)
    _close(evaluated, expect, dtype)


ELEMENTWISE = {
    "silu": (lambda a, b: cg.silu(a), lambda a, b: F.silu(a)),
    "gelu": (lambda a, b: cg.gelu(a), lambda a, b: F.gelu(a)),
    "gelu_tanh": (lambda a, b: cg.gelu(a, approximate="tanh"),
                  lambda a, b: F.gelu(a, approximate="tanh")),
    "relu": (lambda a, b: cg.relu(a), lambda a, b: torch.relu(a)),
    "add": (lambda a, b: cg.add(a, b), torch.add),
    "mul": (lambda a, b: cg.mul(a, b), torch.mul),
    "swiglu": (lambda a, b: cg.mul(cg.silu(a), b), lambda a, b: F.silu(a) * b),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_op_matches_torch(name, dtype, axis, bias, cache_dir):
    """Each op on stream slices of both axes (a column slice is strided), with b a full
    tensor or a broadcast bias, in every dtype; ragged (37 = 3 * 13 - 2, 131 columns)."""
    build, ref = ELEMENTWISE[name]
    with cg.Fusion(f"ew_{name}_{str(dtype)[6:]}_{axis}_{int(bias)}") as fusion:
        a = cg.input(["m", "n"], dtype)
        b = cg.input(["n"] if bias else ["m", "n"], dtype)
        out = build(a, b)
        cg.output(out)
    out.outer_split(axis, 3)
    out.axis(axis).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion)
    xs = _randn([(37, 131), (131,) if bias else (37, 131)], dtype, scale=3.0)
    got = op(*xs)
    expect = ref(*xs)
    if name in ("add", "mul", "relu"):
        assert torch.equal(got, expect)
    else:
        torch.testing.assert_close(got, expect, rtol=1e-2 if dtype in (
            torch.bfloat16, torch.float16) else 1e-5, atol=1e-5)


def test_cast_and_integer_exact_chain(cache_dir):
    """A chain of exact ops across dtypes: bf16 GEMM, cast to fp32, add, relu, mul."""
    with cg.Fusion("exact_chain") as fusion:
        x = cg.input(["m", "k"], torch.bfloat16)
        w = cg.input(["n", "k"], torch.bfloat16)
        y = cg.cast(cg.linear(x, w), torch.float32)
        out = cg.mul(cg.relu(cg.add(y, cg.input(["n"], torch.float32))),
                     cg.input(["m", "n"], torch.float32))
        cg.output(out)
    out.outer_split(0, 4)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion)
    xs = [ints(50, 16, dtype=torch.bfloat16, device="cuda"),
          ints(24, 16, dtype=torch.bfloat16, device="cuda"), ints(24, device="cuda"),
          ints(50, 24, device="cuda")]
    expect = torch.relu(F.linear(xs[0], xs[1]).float() + xs[2]) * xs[3]
    assert torch.equal(op(*xs), expect)


@pytest.mark.parametrize("library", ["cublaslt", "cublas"])
def test_epilogue_and_its_fallback(library, cache_dir):
    """tanh-GELU after a linear: in cuBLASLt's epilogue (one node), or as its own kernel
    with gemm_library="cublas" (two nodes); both match torch."""
    with cg.Fusion(f"epilogue_{library}") as fusion:
        x = cg.input(["m", "k"], torch.bfloat16)
        out = cg.gelu(cg.linear(x, cg.input(["n", "k"], torch.bfloat16),
                                cg.input(["n"], torch.bfloat16)), approximate="tanh")
        cg.output(out)
    out.outer_split(1, 2)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion, gemm_library=library)
    fused = "Gelu(Linear(" in str(op.host_ir)
    assert fused == (library == "cublaslt")
    xs = _randn([(64, 96), (160, 96), (160,)], torch.bfloat16)
    _close(op(*xs), F.gelu(F.linear(*xs), approximate="tanh"), torch.bfloat16)


def _peak_extra_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def test_peak_memory_at_most_eager(cache_dir):
    """Intermediates are freed at their Deallocate: the gate and up results go back to the
    caching allocator before down's output is allocated, so the op's peak is at most
    eager's (transformers' LlamaMLP: gate, SiLU, up, product alive at once at most three)."""
    m, h, i = 1024, 512, 2048
    xs = _randn([(m, h), (i, h), (i, h), (h, i)], torch.bfloat16)
    op = cg.compile(examples.llama_mlp(torch.bfloat16, 4, name="llama_mlp_peak"))
    op(*xs)  # streams, workspaces and kernels are made on the first call
    eager = _peak_extra_mib(lambda: llama_ref(*xs))
    ours = _peak_extra_mib(lambda: op(*xs))
    intermediate = m * i * 2 / 2**20
    assert ours <= eager + 0.01, (ours, eager)
    # gate, up and the product (3 intermediates), then the output: never all at once.
    assert ours <= 3 * intermediate + m * h * 2 / 2**20 + 0.01, (ours, intermediate)


def test_mlp_graph_capture_replays(cache_dir):
    from benchmarks.gpu_timing import capture_graph

    xs = _randn([(64, 128), (256, 128), (256, 128), (128, 256)], torch.bfloat16)
    op = cg.compile(examples.llama_mlp(torch.bfloat16, 4, name="llama_mlp_graph"))
    graph, out = capture_graph(lambda: op(*xs))
    for t in xs:
        t.copy_(torch.randn_like(t).mul(0.5))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, llama_ref(*xs), torch.bfloat16)
