"""Layers on the GPU: the MLP examples and every elementwise op against torch, the GEMM
epilogues and their fallback, peak memory against eager, CUDA-graph capture."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples

pytestmark = [pytest.mark.gpu, pytest.mark.build]


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


MLP_CASES = [  # (dtype, slices, weights, copy_stream): one build each, 3 s on the H200
    (torch.bfloat16, 1, "cuda", False), (torch.bfloat16, 4, "cuda", False),
    (torch.float32, 2, "cuda", False), (torch.bfloat16, 4, "cpu", False),
    (torch.bfloat16, 4, "cpu", True), (torch.float32, 8, "cpu", True),
]


@pytest.mark.parametrize("dtype,slices,weights,copy_stream", MLP_CASES)
@pytest.mark.parametrize("name,make,ref", [("llama_mlp", examples.llama_mlp, llama_ref),
                                           ("gpt_mlp", examples.gpt_mlp, gpt_ref)])
def test_mlp_matches_torch(name, make, ref, dtype, slices, weights, copy_stream, cache_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    m, h, i = 96, 128, 352  # ragged: 352 = 3 * 117 + 1
    shapes = ([(m, h), (i, h), (i, h), (h, i)] if name == "llama_mlp"
              else [(m, h), (i, h), (i,), (h, i), (h,)])
    xs = _randn(shapes, dtype)
    args = [xs[0]] + [t.cpu().pin_memory() if weights == "cpu" else t for t in xs[1:]]
    tag = f"{name}_{str(dtype)[6:]}_{weights}_s{slices}{'_cs' if copy_stream else ''}"
    op = cg.compile(make(dtype, slices, weights, name=tag), copy_stream=copy_stream)
    expect = ref(*xs)
    for _ in range(2):  # the second call reuses the lease's streams, events and kernels
        _close(op(*args), expect, dtype)
    (evaluated,) = cg.evaluate(op.host_ir, args)
    _close(evaluated, expect, dtype)


# name -> (its expression, torch's, whether exact on any input)
ELEMENTWISE = {
    "silu": (lambda a, b, c: cg.silu(a), lambda a, b, c: F.silu(a), False),
    "gelu": (lambda a, b, c: cg.gelu(a), lambda a, b, c: F.gelu(a), False),
    "gelu_tanh": (lambda a, b, c: cg.gelu(a, approximate="tanh"),
                  lambda a, b, c: F.gelu(a, approximate="tanh"), False),
    "relu": (lambda a, b, c: cg.relu(a), lambda a, b, c: torch.relu(a), True),
    "add": (lambda a, b, c: cg.add(a, b), lambda a, b, c: a + b, True),
    "mul": (lambda a, b, c: cg.mul(a, b), lambda a, b, c: a * b, True),
    "add_bias": (lambda a, b, c: cg.add(a, c), lambda a, b, c: a + c, True),
    "mul_bias": (lambda a, b, c: cg.mul(a, c), lambda a, b, c: a * c, True),
    "swiglu": (lambda a, b, c: cg.mul(cg.silu(a), b), lambda a, b, c: F.silu(a) * b, False),
}


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
def test_elementwise_ops_match_torch(dtype, axis, cache_dir):
    """Every op as one output of one program, on stream slices of either axis (a column
    slice is strided), with b a full tensor or a broadcast bias c, in every dtype; ragged
    (37 rows, 131 columns in 3 slices)."""
    with cg.Fusion(f"elementwise_{str(dtype)[6:]}_{axis}") as fusion:
        a = cg.input(["m", "n"], dtype)
        b = cg.input(["m", "n"], dtype)
        c = cg.input(["n"], dtype)
        outs = {name: build(a, b, c) for name, (build, _, _) in ELEMENTWISE.items()}
        for out in outs.values():
            cg.output(out)
    for out in outs.values():
        out.outer_split(axis, 3)
        out.axis(axis).parallelize(cg.ParallelType.Stream)
    op = cg.compile(fusion)
    xs = _randn([(37, 131), (37, 131), (131,)], dtype, scale=3.0)
    got = dict(zip(outs, op(*xs)))
    for name, (_, ref, exact) in ELEMENTWISE.items():
        expect = ref(*xs)
        if exact:
            assert torch.equal(got[name], expect), name
        else:
            half = dtype in (torch.bfloat16, torch.float16)
            torch.testing.assert_close(got[name], expect, rtol=1e-2 if half else 1e-5,
                                       atol=1e-2 if half else 1e-6, msg=name)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_gemms_summed_by_accumulating(library, dtype, cache_dir):
    """x @ w1.T + y @ w2 runs as two GEMMs into one output, the second with beta 1:
    exact on integers."""
    with cg.Fusion(f"gemm_sum_{library}_{str(dtype)[6:]}") as fusion:
        x, w1 = cg.input(["m", "k"], dtype, name="x"), cg.input(["n", "k"], dtype, name="w1")
        y, w2 = cg.input(["m", "j"], dtype, name="y"), cg.input(["j", "n"], dtype, name="w2")
        cg.output(cg.add(cg.linear(x, w1), cg.matmul(y, w2)))
    op = cg.compile(fusion, gemm_library=library)
    assert "Matmul(y, w2, out=T6, accumulate=True)" in str(op.host_ir)
    xs = [ints(37, 24, dtype=dtype, device="cuda", lo=-2, hi=3),
          ints(20, 24, dtype=dtype, device="cuda", lo=-2, hi=3),
          ints(37, 9, dtype=dtype, device="cuda", lo=-2, hi=3),
          ints(9, 20, dtype=dtype, device="cuda", lo=-2, hi=3)]
    expect = xs[0].float() @ xs[1].float().t() + xs[2].float() @ xs[3].float()
    assert torch.equal(op(*xs).float(), expect)


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


def peak_mib(fn):
    from benchmarks.common import peak_mib as measure

    return measure(fn)


def test_peak_memory_at_most_eager(cache_dir):
    """Intermediates are freed at their Deallocate: the gate and up results go back to the
    caching allocator before down's output is allocated, so the op's peak is at most
    eager's (transformers' LlamaMLP: gate, SiLU, up, product alive at once at most three)."""
    m, h, i = 1024, 512, 2048
    xs = _randn([(m, h), (i, h), (i, h), (h, i)], torch.bfloat16)
    op = cg.compile(examples.llama_mlp(torch.bfloat16, 4, name="llama_mlp_peak"))
    op(*xs)  # streams, workspaces and kernels are made on the first call
    eager = peak_mib(lambda: llama_ref(*xs))
    ours = peak_mib(lambda: op(*xs))
    intermediate = m * i * 2 / 2**20
    assert ours <= eager + 0.01, (ours, eager)
    # gate, up and the product (3 intermediates), then the output: never all at once.
    assert ours <= 3 * intermediate + m * h * 2 / 2**20 + 0.01, (ours, intermediate)


def test_mlp_graph_capture_replays(cache_dir):
    from codegen.nn import capture_graph

    xs = _randn([(64, 128), (256, 128), (256, 128), (128, 256)], torch.bfloat16)
    op = cg.compile(examples.llama_mlp(torch.bfloat16, 4, name="llama_mlp_graph"))
    graph, out = capture_graph(lambda: op(*xs))
    for t in xs:
        t.copy_(torch.randn_like(t).mul(0.5))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, llama_ref(*xs), torch.bfloat16)


@pytest.mark.parametrize("copy_stream", [False, True])
def test_host_weights_cost_at_most_their_staging_slots(copy_stream, cache_dir):
    """Streaming the weights from host memory adds at most the staging slots to a call's
    peak device memory (the slots of both loops are alive together), never a whole weight.
    (Measured once at slots + 0.25 MiB, the output's size: the gate and up results were
    freed only at the exit while the second loop's workers or the copy stream had
    unjoined work; Streams::release frees at the Deallocate now.)"""
    m, h, i, slices, pool = 256, 512, 2048, 8, 4
    xs = _randn([(m, h), (i, h), (i, h), (h, i)], torch.bfloat16)
    host = [xs[0]] + [t.cpu().pin_memory() for t in xs[1:]]
    gpu_op = cg.compile(examples.llama_mlp(torch.bfloat16, slices, name="peak_gpu"))
    host_op = cg.compile(examples.llama_mlp(torch.bfloat16, slices, "cpu", name="peak_host"),
                         pool_size=pool, copy_stream=copy_stream)
    gpu_op(*xs), host_op(*host)  # streams, workspaces and kernels first
    slots = pool * (i // slices * h * 2) * 2 + pool * (h // slices * i * 2)
    extra = peak_mib(lambda: host_op(*host)) - peak_mib(lambda: gpu_op(*xs))
    weights = 3 * i * h * 2 / 2**20
    assert extra <= slots / 2**20 + 0.01, (extra, slots / 2**20, weights)
