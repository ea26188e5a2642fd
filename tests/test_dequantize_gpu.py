"""cg.dequantize compiled and run on a GPU: bit for bit the reference
(``codegen.nn.quantize.dequantize_reference``: torch's half-type product rounds once, as
the kernel does), alone and fused, in the vector and the strided kernel; a quantized
weight streamed from host memory by rows into a linear; the input checks of the C++.
Marked `gpu`; run with `PYTHONPATH=. python3 -m pytest -q tests/test_dequantize_gpu.py`."""

import pytest
import torch
import torch.nn.functional as F
from test_dequantize import (
    BF16,
    F16,
    F32,
    FP8,
    I8,
    Stream,
    assert_bitwise,
    dequantize_add_bias,
    exact_inputs,
    random_q,
    random_scale,
)

import codegen as cg
from codegen.examples import QUANTIZED_EXAMPLES
from codegen.nn.quantize import dequantize_reference, quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.build, pytest.mark.usefixtures("no_tf32")]
CUDA = "cuda"



def dequantize_fusion(name, q_dtype, scale_dtype, group_size, dtype, slices):
    """``dequantize(q [n, k], s)`` on the GPU, its rows in ``slices`` stream slices."""
    with cg.Fusion(name) as f:
        q = cg.input(["n", "k"], q_dtype, name="q")
        s = cg.input(["n"] if group_size is None else ["n", "groups"], scale_dtype, name="s")
        out = cg.dequantize(q, s, group_size=group_size, dtype=dtype)
        cg.output(out)
    if slices > 1:
        out.outer_split(0, slices)
        out.axis(0).parallelize(Stream)
    return f


# (q dtype, group_size, int4 values): fp8 per row, int4 in int8 by groups, and the others.
KINDS = {"fp8-rows": (FP8, None, False), "int4-groups": (I8, 32, True),
         "fp8-groups": (FP8, 8, False), "int8-rows": (I8, None, False)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("scale_dtype", [BF16, F16, F32])
def test_gpu_dequantize_is_the_reference_bit_for_bit(cache_dir, kind, dtype, scale_dtype):
    """Rows in 3 stream slices (ragged), contiguous inputs (the vector kernel, and rows
    that are not a multiple of its width), q read transposed and q starting one byte into
    its allocation (the strided kernel); every value of q and scales over all binades."""
    q_dtype, group_size, int4 = KINDS[kind]
    name = f"dq_{kind.replace('-', '_')}_{str(dtype)[6:]}_{str(scale_dtype)[6:]}"
    op = cg.compile(dequantize_fusion(name, q_dtype, scale_dtype, group_size, dtype, 3))
    gen = torch.Generator().manual_seed(11)
    sizes = ((37, 256), (5, 64)) + (((9, 7), (6, 13), (11, 520)) if group_size is None
                                    else ((6, 13 * group_size),))
    for n, k in sizes:
        q = random_q(n, k, q_dtype, gen, int4)
        s = random_scale((n,) if group_size is None else (n, k // group_size), scale_dtype, gen)
        want = dequantize_reference(q, s, dtype)
        assert_bitwise(op(q.to(CUDA), s.to(CUDA)).cpu(), want)
        strided = q.t().contiguous().to(CUDA).t()  # column-major: the strided kernel
        assert_bitwise(op(strided, s.to(CUDA)).cpu(), want)
        shifted = torch.empty(n * k + 1, dtype=q_dtype, device=CUDA)[1:].view(n, k)
        shifted.copy_(q.to(CUDA))  # one byte off the allocation's alignment
        assert_bitwise(op(shifted, s.to(CUDA)).cpu(), want)


def test_gpu_per_row_dequantize_fused_with_a_bias_is_the_evaluator(cache_dir):
    """One kernel reads the scale [n] along the rows and the bias [k] along the columns;
    the evaluator computes the same expression in fp32, rounded once."""
    op = cg.compile(dequantize_add_bias("dq_add_bias"))
    gen = torch.Generator().manual_seed(12)
    q, s = random_q(64, 128, FP8, gen), random_scale((64,), F32, gen) * 1e-6
    b = torch.randn(128, generator=gen).to(BF16)
    (want,) = cg.evaluate(op.host_ir, [q, s, b])
    assert_bitwise(op(q.to(CUDA), s.to(CUDA), b.to(CUDA)).cpu(), want)


@pytest.mark.parametrize("name", sorted(QUANTIZED_EXAMPLES))
def test_gpu_streamed_quantized_linear_is_exact_on_integer_values(cache_dir, name):
    """Host-resident q and scale, 4 row slices: integer-valued x and q, power-of-two
    scales, so every product and sum is exact and the GEMM is F.linear exactly."""
    op = cg.compile(QUANTIZED_EXAMPLES[name].make())
    x, q, s = exact_inputs(name, torch.Generator().manual_seed(13))
    y = op(x.to(CUDA), q.pin_memory(), s.pin_memory())
    assert torch.equal(y.cpu(), F.linear(x, dequantize_reference(q, s)))


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("m, n, k", [(64, 300, 256), (1, 4096, 1024)])
def test_gpu_streamed_quantized_linear_matches_f_linear(cache_dir, kind, m, n, k):
    """A quantized random weight (``quantize_weight``, as codegen.nn.offload stores it) in
    host memory: within bf16 GEMM tolerance of F.linear with the reference weight."""
    name = f"dequantize_linear_{kind}"
    op = cg.compile(QUANTIZED_EXAMPLES[name].make())
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(n, k, generator=gen).to(BF16) / 16
    q, s = quantize_weight(w, kind)
    x = torch.randn(m, k, generator=gen).to(BF16)
    y = op(x.to(CUDA), q.pin_memory(), s.pin_memory()).double().cpu()
    ref = F.linear(x.double(), dequantize_reference(q, s).double())
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


def test_gpu_call_time_dtypes_and_shapes_are_checked_by_name(cache_dir):
    """The C++ checks each argument's dtype (float8_e4m3fn and int8 by name) and the
    extents dequantize ties, before anything is queued."""
    op = cg.compile(QUANTIZED_EXAMPLES["dequantize_linear_int4"].make())
    x, q, s = exact_inputs("dequantize_linear_int4", torch.Generator().manual_seed(15))
    x = x.to(CUDA)
    with pytest.raises(RuntimeError, match=r"dequantize_linear_int4: argument q must be int8, "
                                           r"got float8_e4m3fn"):
        op(x, q.view(FP8), s)
    with pytest.raises(RuntimeError, match=r"dequantize_linear_int4: argument scale must be "
                                           r"bfloat16, got float32"):
        op(x, q, s.float())
    with pytest.raises(RuntimeError, match=r"dequantize T3: q=q axis 1 and scale=scale axis 1 "
                                           r"times 128 must have equal sizes, got k = 256 and "
                                           r"groups \* 128 = 384"):
        op(x, q, torch.ones(q.shape[0], 3, dtype=BF16))
    fp8 = cg.compile(QUANTIZED_EXAMPLES["dequantize_linear_fp8"].make())
    with pytest.raises(RuntimeError, match=r"dequantize_linear_fp8: argument q must be "
                                           r"float8_e4m3fn, got int8"):
        fp8(x, q, s[:, 0].contiguous())
