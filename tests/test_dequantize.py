"""cg.dequantize on the CPU: the errors of its definition and of its inputs, its printing,
the evaluator against the reference (``codegen.nn.quantize.dequantize_reference``) bit for
bit, the kernel's expression (compiled for the host) against torch's half-type product, a
quantized weight streamed from host memory by rows and dequantized per slice before its
GEMM, fusion, the refused backward, and the generated C++ (its golden and its build).
tests/test_dequantize_gpu.py runs the compiled op."""

import re
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import ints
from test_copy import cxx
from test_pointwise_runtime import full_source, kernel_text

import codegen as cg
from codegen import hostir as hir
from codegen.examples import QUANTIZED_EXAMPLES, dequantize_linear
from codegen.frontend import ops
from codegen.interp import races
from codegen.nn.quantize import dequantize_reference
from tools.regen import CSRC_GEN

FP8, I8 = torch.float8_e4m3fn, torch.int8
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
RESULTS = [BF16, F16, F32]
Stream = cg.ParallelType.Stream


def program(name="dq", *, q_dtype=FP8, scale_dtype=BF16, group_size=None, dtype=BF16,
            device="cuda", slices=None):
    """``dequantize(q [n, k], s)`` (s ``[n]``, or ``[n, groups]`` with ``group_size``), its
    rows in ``slices`` stream slices, lowered."""
    with cg.Fusion(name) as f:
        q = cg.input(["n", "k"], q_dtype, name="q", device=device)
        s = cg.input(["n"] if group_size is None else ["n", "groups"], scale_dtype, name="s",
                     device=device)
        out = cg.dequantize(q, s, group_size=group_size, dtype=dtype)
        cg.output(out)
    if slices:
        out.outer_split(0, slices)
        out.axis(0).parallelize(Stream)
    return cg.lower(f)


def finite_fp8() -> torch.Tensor:
    """Every float8_e4m3fn value but the two NaNs, as fp8."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    return values[~values.float().isnan()]


def random_q(n, k, dtype, gen, int4=False):
    """fp8: any finite value; int8: the full range, or int4's [-8, 7] stored unpacked."""
    if dtype == FP8:
        values = finite_fp8()
        return values[torch.randint(len(values), (n, k), generator=gen)]
    lo, hi = (-8, 8) if int4 else (-128, 128)
    return torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)


def random_scale(shape, dtype, gen):
    """Scales over many binades (2^-30 .. 2^20): some overflow or underflow fp16, where
    the reference's ``scale.to(float16)`` does too."""
    mantissa = torch.rand(shape, generator=gen) + 0.5
    exponent = torch.randint(-30, 21, shape, generator=gen).float()
    return (mantissa * torch.exp2(exponent)).to(dtype)


def assert_bitwise(got, want):
    """Same dtype, same bits, NaN where the other has NaN (its payload aside)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


# ---------------------------------------------------------------------------- definition


def _refused(build) -> str:
    with cg.Fusion("bad"), pytest.raises(cg.ScheduleError) as e:
        build()
    return str(e.value)


def _inputs(q_shape=(4, 8), q_dtype=FP8, s_shape=(4,), s_dtype=BF16):
    return (cg.input(list(q_shape), q_dtype, name="w"), cg.input(list(s_shape), s_dtype, name="s"))


@pytest.mark.parametrize("q_dtype", [BF16, F32, torch.float64])
def test_q_must_be_fp8_or_int8(q_dtype):
    message = _refused(lambda: cg.dequantize(*_inputs(q_dtype=q_dtype)))
    assert message == ("dequantize: argument q (w) must be torch.float8_e4m3fn or torch.int8 "
                       "(int4 values stored unpacked in int8), found "
                       f"{ops.DTYPE_NAMES[q_dtype]}")


@pytest.mark.parametrize("s_dtype", [I8, FP8, torch.float64])
def test_scale_must_be_a_16_or_32_bit_float(s_dtype):
    message = _refused(lambda: cg.dequantize(*_inputs(s_dtype=s_dtype)))
    assert message == ("dequantize: argument scale (s) must be torch.bfloat16, torch.float16 "
                       f"or torch.float32, found {ops.DTYPE_NAMES[s_dtype]}")


@pytest.mark.parametrize("s_shape, group_size, want", [
    ((5,), None, "[4] (one scale per row of q; q=w is [4, 8]), found [5]"),
    ((4, 2), None, "[4] (one scale per row of q; q=w is [4, 8]), found [4, 2]"),
    ((4,), 4, "[4, 2] (one scale per group of 4 elements of a row of q; q=w is [4, 8]), "
              "found [4]"),
    ((4, 3), 4, "[4, 2] (one scale per group of 4 elements of a row of q; q=w is [4, 8]), "
                "found [4, 3]"),
    ((3, 2), 4, "[4, 2] (one scale per group of 4 elements of a row of q; q=w is [4, 8]), "
                "found [3, 2]"),
    (("n", "k"), 4, "[n, k / 4] (one scale per group of 4 elements of a row of q; q=w is "
                    "[n, k]), found [n, k]"),
])
def test_scale_shape_must_match_q(s_shape, group_size, want):
    """Fixed extents are checked at definition; so is a named K that the scale's groups
    axis shares (K = K / g has no solution for g > 1); other named ones when called."""
    q_shape = ("n", "k") if "n" in s_shape else (4, 8)
    message = _refused(lambda: cg.dequantize(*_inputs(q_shape=q_shape, s_shape=s_shape),
                                             group_size=group_size))
    assert message == f"dequantize: argument scale (s) must have shape {want}"


def test_k_must_be_a_multiple_of_group_size():
    message = _refused(lambda: cg.dequantize(*_inputs(q_shape=(4, 10), s_shape=(4, 2)),
                                             group_size=4))
    assert message == ("dequantize: argument q (w) axis 1 (K = 10) must be a multiple of "
                       "group_size 4")


@pytest.mark.parametrize("group_size", [0, -4, True, 2.5, "4"])
def test_group_size_must_be_a_positive_int(group_size):
    message = _refused(lambda: cg.dequantize(*_inputs(), group_size=group_size))
    assert message == ("dequantize: group_size must be a positive int (or None: one scale per "
                       f"row of q), found {group_size!r}")


@pytest.mark.parametrize("dtype", [I8, FP8, torch.float64, "bfloat16", None])
def test_result_dtype_must_be_bf16_f16_or_f32(dtype):
    message = _refused(lambda: cg.dequantize(*_inputs(), dtype=dtype))
    assert message == ("dequantize: dtype (the result's) must be torch.bfloat16, "
                       f"torch.float16 or torch.float32, found {dtype!r}")


@pytest.mark.parametrize("q_shape, found", [((2, 4, 8), "rank 3 [2, 4, 8]"), ((8,), "rank 1 [8]")])
def test_q_must_have_rank_2(q_shape, found):
    message = _refused(lambda: cg.dequantize(*_inputs(q_shape=q_shape)))
    assert message == f"dequantize: argument q (w) must have rank 2 [N, K], found {found}"


@pytest.mark.parametrize("use, op, arg", [
    (lambda w, x: cg.matmul(x, w), "matmul", "b"),
    (lambda w, x: cg.linear(x, w), "linear", "w"),
    (lambda w, x: cg.add(x, w), "add", "b"),
    (lambda w, x: cg.mul(w, x), "mul", "a"),
    (lambda w, x: cg.silu(w), "silu", "x"),
    (lambda w, x: cg.relu(w), "relu", "x"),
    (lambda w, x: cg.cast(w, BF16), "cast", "x"),
])
@pytest.mark.parametrize("q_dtype", [FP8, I8])
def test_other_ops_refuse_quantized_operands(use, op, arg, q_dtype):
    def build():
        w = cg.input([8, 8], q_dtype, name="w")
        use(w, cg.input([8, 8], BF16, name="x"))
    message = _refused(build)
    assert message == (f"{op}: argument {arg} (w) is {ops.DTYPE_NAMES[q_dtype]}, which only "
                       "cg.dequantize reads; dequantize it first (cg.dequantize(w, scale, ...))")


@pytest.mark.parametrize("dtype", [FP8, I8])
def test_nothing_casts_to_a_quantized_dtype(dtype):
    message = _refused(lambda: cg.cast(cg.input([4], BF16), dtype))
    assert message.startswith("cast: dtype must be one of torch.float32, torch.float16, "
                              "torch.bfloat16, torch.float64, got")


def test_quantized_inputs_are_declared_and_printed():
    with cg.Fusion("f") as f:
        q = cg.input(["n", "k"], FP8, name="q", device="cpu")
        i = cg.input([4, 8], I8, name="i")
        cg.output(cg.dequantize(i, cg.input([4], F32, name="s"), dtype=F16))
    assert (q.dtype, i.dtype) == (FP8, I8)
    text = str(f)
    assert "input q: float8_e4m3fn[i{n}, i{k}] device=cpu" in text
    assert "input i: int8[i{4}, i{8}]" in text
    assert "T3 = dequantize(i, s, group_size=None, dtype=float16)  # T3: float16[i{4}, i{8}]" \
        in text


def test_a_stream_split_of_a_grouped_k_is_refused():
    with cg.Fusion("dq") as f:
        w = cg.dequantize(cg.input(["n", "k"], I8, name="q"),
                          cg.input(["n", "groups"], BF16, name="s"), group_size=32)
        cg.output(w)
    w.outer_split(1, 2)
    w.axis(1).parallelize(Stream)
    with pytest.raises(cg.ScheduleError) as e:
        cg.lower(f)
    assert str(e.value) == (
        "dequantize T2 (group_size=32): axis 1 is split on streams (axis 1 [outer_split(2)]), "
        "but its operands (q=q, scale=s) index that axis by groups of 32; split it along "
        "another axis (rows, axis 0)")


def test_a_stream_split_of_grouped_scales_is_refused():
    with cg.Fusion("dq") as f:
        s = cg.input(["n", "groups"], BF16, name="s")
        cg.output(cg.dequantize(cg.input(["n", "k"], I8, name="q"), s, group_size=32))
    s.outer_split(1, 2)
    s.axis(1).parallelize(Stream)
    with pytest.raises(cg.ScheduleError, match=r"conflicting stream splits: s axis 1 "):
        cg.lower(f)


# ---------------------------------------------------------------------------- call time


def test_inputs_of_the_wrong_dtype_are_refused_by_name():
    p = program()
    q, s = finite_fp8()[:8].view(2, 4), torch.ones(2, dtype=BF16)
    with pytest.raises(ValueError, match=r"^dq: argument q must be float8_e4m3fn, got "
                                         r"torch.int8$"):
        cg.evaluate(p, [q.view(I8), s])
    with pytest.raises(ValueError, match=r"^dq: argument s must be bfloat16, got "
                                         r"torch.float32$"):
        cg.evaluate(p, [q, s.float()])
    with pytest.raises(ValueError, match=r"^dq: argument q must have rank 2 float8_e4m3fn"
                                         r"\[n, k\], got shape \[8\]$"):
        cg.evaluate(p, [q.flatten(), s])


def test_inputs_of_the_wrong_shape_are_refused_by_name():
    q = torch.zeros(3, 12, dtype=I8)
    with pytest.raises(ValueError, match=r"^dq: argument s axis 0 must have size n = 3, "
                                         r"got 4 \(shape \[4\]\)$"):
        cg.evaluate(program(q_dtype=I8), [q, torch.ones(4, dtype=BF16)])
    with pytest.raises(ValueError, match=r"^dq: dequantize T2: q=q axis 1 and scale=s axis 1 "
                                         r"times 4 must have equal sizes, got k = 12 and "
                                         r"groups \* 4 = 16$"):
        cg.evaluate(program(q_dtype=I8, group_size=4), [q, torch.ones(3, 4, dtype=BF16)])


# ---------------------------------------------------------------------------- the evaluator


CASES = [(FP8, None, False), (FP8, 16, False), (I8, 32, True), (I8, None, False)]


@pytest.mark.parametrize("q_dtype, group_size, int4", CASES,
                         ids=["fp8-rows", "fp8-groups", "int4-groups", "int8-rows"])
@pytest.mark.parametrize("scale_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("dtype", RESULTS)
def test_evaluator_is_the_reference_bit_for_bit(q_dtype, group_size, int4, scale_dtype, dtype):
    """Random values of every kind, rows in 3 stream slices (7 rows: one is short)."""
    gen = torch.Generator().manual_seed(hash((str(q_dtype), group_size, str(scale_dtype),
                                              str(dtype))) % 2**31)
    q = random_q(7, 64, q_dtype, gen, int4)
    s = random_scale((7,) if group_size is None else (7, 64 // group_size), scale_dtype, gen)
    p = program(q_dtype=q_dtype, scale_dtype=scale_dtype, group_size=group_size, dtype=dtype,
                slices=3)
    (out,) = cg.evaluate(p, [q, s])
    assert_bitwise(out, dequantize_reference(q, s, dtype))
    races.check(p, [q, s])


def _kernel_expression_program(tmp_path):
    """The prelude and dequantize's C expression for each result dtype (as the renderer
    writes it), compiled for the host: reads ``q-kind q-bits scale`` lines, prints the
    stored bits of each result dtype."""
    exprs = {d: ops.DEQUANTIZE.cpp(["x0", "x1"], {"dtype": d, "group_size": None})
             for d in RESULTS}
    source = tmp_path / "dequantize.cpp"
    source.write_text(f"""
#include <math.h>
#include <stdio.h>
#define __device__
#define __forceinline__ inline
#include KERNEL_TEXT

static float bf16_expr(float x0, float x1) {{ return {exprs[BF16]}; }}
static float f16_expr(float x0, float x1) {{ return {exprs[F16]}; }}
static float f32_expr(float x0, float x1) {{ return {exprs[F32]}; }}

int main() {{
  int kind;
  unsigned bits;
  float scale;
  while (scanf("%d %u %a", &kind, &bits, &scale) == 3) {{
    const unsigned char b = static_cast<unsigned char>(bits);
    const float q = kind ? to_compute<float>(i8{{b}}) : to_compute<float>(f8e4m3{{b}});
    bf16 r0;
    f16 r1;
    float r2;
    store(&r0, bf16_expr(q, scale));
    store(&r1, f16_expr(q, scale));
    store(&r2, f32_expr(q, scale));
    printf("%u %u %u\\n", r0.bits, r1.bits, cg_float_bits(r2));
  }}
}}
""")
    prelude = tmp_path / "prelude.h"
    prelude.write_text(kernel_text("kPointwisePrelude"))
    return cxx(source, tmp_path / "dequantize", f'-DKERNEL_TEXT="{prelude}"')


@pytest.mark.build
def test_the_kernel_expression_is_the_reference_bit_for_bit(tmp_path):
    """The kernel's math (prelude decode, scale rounding, fp32 product, one rounding on
    store; the host path of each conversion), every fp8 and int8 value against scales of
    each dtype over all binades, against ``dequantize_reference``'s torch ops."""
    binary = _kernel_expression_program(tmp_path)
    gen = torch.Generator().manual_seed(1)
    rows, want = [], {d: [] for d in RESULTS}
    for kind, q in ((0, finite_fp8()), (1, torch.arange(-128, 128, dtype=torch.int8))):
        for scale_dtype in (BF16, F16, F32):
            scale = random_scale((64,), scale_dtype, gen)  # one per row of every q value
            qq = q[None, :].expand(64, -1)
            bits = qq.contiguous().view(torch.uint8).reshape(-1).tolist()
            scales = scale[:, None].expand(-1, len(q)).reshape(-1).float().tolist()
            rows += [f"{kind} {b} {v.hex()}" for b, v in zip(bits, scales)]
            for d in RESULTS:
                want[d].append(dequantize_reference(qq, scale, d))
    run = subprocess.run([str(binary)], input="\n".join(rows) + "\n", capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    got = torch.tensor([[int(v) for v in line.split()] for line in run.stdout.splitlines()],
                       dtype=torch.int64)
    assert len(got) == len(rows)
    for col, d in enumerate(RESULTS):
        bits = torch.int16 if d != F32 else torch.int32
        mask = 0xFFFF if d != F32 else 0xFFFFFFFF
        values = (got[:, col] & mask).to(torch.int64)
        reference = torch.cat([w.reshape(-1) for w in want[d]])
        as_int = reference.view(bits).to(torch.int64) & mask
        nan = reference.isnan()
        assert torch.equal(values[~nan], as_int[~nan]), d
        got_values = values.to(torch.int32 if d == F32 else torch.int16)
        assert got_values[nan].view(d).isnan().all(), d


RENDERED = r"""
// The rendered kernel and views of one slice of a dequantize_linear example, run on the
// host (as test_pointwise_emulate.cpp runs kernels): reads n, k, the scales per row, then
// q's bytes and the scales' bits; prints which kernel the plan took and out's bits.
#include "codegen/pointwise.h"

#include <cstdio>
#include <cstring>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __launch_bounds__
#define __launch_bounds__(threads)

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

#include KERNEL_TEXT

namespace rt = codegen_rt;

struct Aligned {  // 16-byte aligned, as the caching allocator's blocks
  std::vector<unsigned char> bytes;
  unsigned char* data;
  explicit Aligned(size_t n) : bytes(n + 16) {
    data = bytes.data() + (16 - reinterpret_cast<uintptr_t>(bytes.data()) % 16) % 16;
  }
};

static rt::View dense(void* data, int64_t itemsize, int dim, int64_t n, int64_t k) {
  rt::View v;
  v.data = static_cast<char*>(data);
  v.dim = dim;
  v.itemsize = itemsize;
  v.sizes[0] = n;
  v.sizes[1] = k;
  v.strides[0] = dim == 2 ? k : 1;
  v.strides[1] = 1;
  return v;
}

int main() {
  long long n, k, groups;
  if (scanf("%lld %lld %lld", &n, &k, &groups) != 3) return 2;
  Aligned q(n * k), scale(n * groups * 2), out(n * k * 2);
  for (long long i = 0; i < n * k; ++i) {
    unsigned b;
    if (scanf("%u", &b) != 1) return 2;
    q.data[i] = static_cast<unsigned char>(b);
  }
  for (long long i = 0; i < n * groups; ++i) {
    unsigned b;
    if (scanf("%u", &b) != 1) return 2;
    reinterpret_cast<unsigned short*>(scale.data)[i] = static_cast<unsigned short>(b);
  }
  const rt::View T3_i = dense(out.data, 2, 2, n, k);
  const rt::View q_s = dense(q.data, 1, 2, n, k);
  const rt::View scale_s = dense(scale.data, 2, GROUPED ? 2 : 1, n, groups);
  const rt::View o = OUT;
  const rt::View ins[] = {INPUTS};
  rt::PointwiseLayout layout;
  std::memcpy(static_cast<void*>(&layout), &cg_pointwise_layout, sizeof cg_pointwise_layout);
  rt::check_itemsizes(layout, o, ins, CG_ARITY, "host", "kernel0");
  const rt::PointwisePlan plan = rt::plan_pointwise(
      rt::pointwise_args(o, ins, CG_ARITY, "host", "kernel0"), CG_ARITY, layout, 256);
  cg_args a;
  std::memcpy(&a, &plan.args, sizeof a);
  gridDim = plan.launch.grid;
  blockDim = plan.launch.block;
  for (blockIdx.z = 0; blockIdx.z < gridDim.z; ++blockIdx.z)
    for (blockIdx.y = 0; blockIdx.y < gridDim.y; ++blockIdx.y)
      for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
        for (threadIdx.y = 0; threadIdx.y < blockDim.y; ++threadIdx.y)
          for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x)
            (plan.vector ? cg_pointwise_vector : cg_pointwise_strided)(a);
  printf("%s\n", plan.vector ? "vector" : "strided");
  for (long long i = 0; i < n * k; ++i) {
    printf("%u\n", static_cast<unsigned>(reinterpret_cast<unsigned short*>(out.data)[i]));
  }
}
"""


@pytest.mark.build
@pytest.mark.parametrize("name, k", [("dequantize_linear_fp8", 256),
                                     ("dequantize_linear_fp8", 7),
                                     ("dequantize_linear_fp8", 13),
                                     ("dequantize_linear_fp8", 520),
                                     ("dequantize_linear_int4", 256),
                                     ("dequantize_linear_int4", 384)])
def test_the_rendered_kernel_and_views_run_on_the_host(tmp_path, name, k):
    """What the GPU runs for one slice, compiled for the host: the kernel text and the
    views of the rendered call (``rt::unsqueeze`` of per-row scales; ``rt::unflatten``
    of a grouped dequantize), planned by the runtime (the vector kernel: 8 bytes of q per
    access; the strided one where rows of K elements leave q unaligned) and run thread by
    thread: bit for bit the reference."""
    source = cg.render(cg.lower(QUANTIZED_EXAMPLES[name].make()))
    generated = source.split('R"cuda(\n', 1)[1].split(')cuda"', 1)[0]
    call = re.search(r"rt::pointwise\(kernel0, (.*), \{(.*)\}, streams\.current\(\), op\);",
                     source)
    kernel = tmp_path / "kernel.cu"
    kernel.write_text(full_source(generated, 2))
    harness = tmp_path / "rendered.cpp"
    harness.write_text(RENDERED)
    grouped = name.endswith("int4")
    binary = cxx(harness, tmp_path / "rendered", f'-DKERNEL_TEXT="{kernel}"',
                 f"-DOUT={call.group(1)}", f"-DINPUTS={call.group(2)}",
                 f"-DGROUPED={int(grouped)}")
    gen = torch.Generator().manual_seed(16)
    n = 22
    q = random_q(n, k, I8 if grouped else FP8, gen, int4=True)
    s = random_scale((n, k // 128) if grouped else (n,), BF16, gen)
    groups = k // 128 if grouped else 1
    stdin = " ".join(map(str, [n, k, groups, *q.view(torch.uint8).flatten().tolist(),
                               *(s.view(torch.int16).flatten().int() & 0xFFFF).tolist()]))
    run = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    kind, *bits = run.stdout.split()
    # Rows of 8-element multiples stay aligned for 8 bytes of q; others take the strided kernel.
    assert kind == ("vector" if k % 8 == 0 else "strided")
    got = torch.tensor([int(b) for b in bits], dtype=torch.int32)
    got = torch.where(got >= 1 << 15, got - (1 << 16), got).to(torch.int16)
    assert_bitwise(got.view(BF16).view(n, k), dequantize_reference(q, s))


# ---------------------------------------------------------------------------- a streamed weight


def exact_inputs(name, gen):
    """Integer-valued x (mostly 0) and q and scales 1 or 2 for QUANTIZED_EXAMPLES[name], such that
    every partial sum of the GEMM is an integer of magnitude at most 256: exact in bf16,
    so any order of summation, and any rounding of a partial sum, gives one result."""
    (m, k), (n, _), s_shape = QUANTIZED_EXAMPLES[name].shapes
    x = torch.randint(-1, 2, (m, k), generator=gen) * (torch.rand(m, k, generator=gen) < 0.25)
    x = x.to(BF16)
    q = torch.randint(-2, 3, (n, k), generator=gen, dtype=torch.int8)
    if name.endswith("fp8"):
        q = q.to(FP8)
    s = torch.randint(1, 3, s_shape, generator=gen).to(BF16)
    bound = x.abs().float() @ dequantize_reference(q, s).abs().float().T
    assert bound.max() <= 256, "choose another seed"
    return x, q, s


@pytest.mark.parametrize("name", sorted(QUANTIZED_EXAMPLES))
def test_streamed_quantized_linear_is_f_linear_of_the_reference(name):
    x, q, s = exact_inputs(name, torch.Generator().manual_seed(3))
    p = cg.lower(QUANTIZED_EXAMPLES[name].make())
    (y,) = cg.evaluate(p, [x, q, s])
    assert torch.equal(y, F.linear(x, dequantize_reference(q, s)))
    races.check(p, [x, q, s])


@pytest.mark.parametrize("name", sorted(QUANTIZED_EXAMPLES))
def test_each_slice_copies_its_rows_then_dequantizes_them_then_multiplies(name):
    """Per slice: a Copy of q's rows and of scale's rows into staging, then the
    Dequantize into the slice of the bf16 weight, then the GEMM that reads it (not fused:
    a prologue of a GEMM's operand is not something cuBLAS runs)."""
    p = cg.lower(QUANTIZED_EXAMPLES[name].make())
    (loop,) = [n for n in p.nodes() if isinstance(n, hir.ForLoop) and n.parallel is Stream]
    steps = [str(n).split("(")[0] for n in loop.body
             if isinstance(n, (hir.Copy, hir.Compute))]
    assert steps == ["Copy", "Copy", "Dequantize", "Linear"]
    copies = [n for n in loop.body if isinstance(n, hir.Copy)]
    assert [c.src for c in copies] == ["q_i", "scale_i"]
    (dq,) = [n for n in loop.body if isinstance(n, hir.Compute) and n.gemm is None]
    assert dq.expr.args == ("q_s", "scale_s") and dq.out == "T3_i"
    assert next(n for n in loop.body if isinstance(n, hir.Compute) and n.gemm).w == "T3_i"


DEQUANTIZE_LINEAR_FP8 = """\
HostProgram dequantize_linear_fp8(x: bfloat16[m, k], q: float8_e4m3fn[n, k] device=cpu, \
scale: bfloat16[n] device=cpu) -> (T4):
  main_stream = GetCurrentStream()
  T3 = Allocate(bfloat16[n, k])
  T4 = Allocate(bfloat16[m, n])
  q_stage = Allocate(float8_e4m3fn[4, ceilDiv(n, 4), k])
  scale_stage = Allocate(bfloat16[4, ceilDiv(n, 4)])
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 4) [Stream]:
    SetCurrentStream(Stream(i))
    q_i = ShardByStream(q, axis=0, index=i, chunk=ceilDiv(n, 4))
    q_s = StagingSlot(q_stage, slot=i, like=q_i)
    Copy(q_i, out=q_s)
    scale_i = ShardByStream(scale, axis=0, index=i, chunk=ceilDiv(n, 4))
    scale_s = StagingSlot(scale_stage, slot=i, like=scale_i)
    Copy(scale_i, out=scale_s)
    T3_i = ShardByStream(T3, axis=0, index=i, chunk=ceilDiv(n, 4))
    Dequantize(q_s, scale_s, group_size=None, dtype=bfloat16, out=T3_i)
    T4_i = ShardByStream(T4, axis=1, index=i, chunk=ceilDiv(n, 4))
    Linear(x, T3_i, out=T4_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(scale_stage)
  Deallocate(q_stage)
  Deallocate(T3)
  return T4"""


def test_print_fusion_and_host_ir():
    fusion = dequantize_linear("fp8")
    assert str(fusion).splitlines()[1:5] == [
        "  input x: bfloat16[i{m}, i{k}]",
        "  input q: float8_e4m3fn[i{n}, i{k}] device=cpu",
        "  input scale: bfloat16[i{n}] device=cpu",
        "  T3 = dequantize(q, scale, group_size=None, dtype=bfloat16)  # T3: bfloat16[i{n}, "
        "i{k}]",
    ]
    assert str(cg.lower(fusion)) == DEQUANTIZE_LINEAR_FP8
    grouped = str(cg.lower(dequantize_linear("int4")))
    assert "Dequantize(q_s, scale_s, group_size=128, dtype=bfloat16, out=T3_i)" in grouped
    assert "scale_stage = Allocate(bfloat16[4, ceilDiv(n, 4), groups])" in grouped


def test_the_docs_excerpt_is_the_lowerings():
    from test_docs import ROOT, _excerpt_mismatch

    text = (ROOT / "docs" / "quantized.md").read_text()
    block = text.split("and multiplies:\n\n```\n", 1)[1].split("```")[0]
    printed = str(cg.lower(dequantize_linear("fp8"))).splitlines()
    assert _excerpt_mismatch(block.splitlines(), printed) is None


def test_a_matmul_slices_a_per_row_dequantize_along_k():
    """``x @ dequantize(q [k, n], s [k])`` split by output columns slices q along its K:
    per-row scales are read whole by every slice."""
    with cg.Fusion("dq_matmul") as f:
        x = cg.input(["m", "k"], BF16, name="x")
        w = cg.dequantize(cg.input(["k", "n"], FP8, name="q", device="cpu"),
                          cg.input(["k"], F16, name="s", device="cpu"))
        y = cg.matmul(x, w)
        cg.output(y)
    y.outer_split(1, 3)
    y.axis(1).parallelize(Stream)
    p = cg.lower(f)
    assert "q_i = ShardByStream(q, axis=1, index=i, chunk=ceilDiv(n, 3))" in str(p)
    assert "Copy(s, out=s_dev)" in str(p)  # once, before the loop
    assert "Dequantize(q_s, s_dev, group_size=None, dtype=bfloat16, out=T3_i)" in str(p)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-2, 3, (5, 16), generator=gen).to(BF16)
    q = torch.randint(-8, 8, (16, 10), generator=gen).to(FP8)
    s = torch.exp2(torch.randint(-1, 2, (16,), generator=gen).float()).half()
    (out,) = cg.evaluate(p, [x, q, s])
    assert torch.equal(out, x @ dequantize_reference(q, s))
    races.check(p, [x, q, s])


# ---------------------------------------------------------------------------- fusion


def dequantize_add_bias(name):
    """``add(dequantize(q [n, k] fp8, s [n] fp32), b [k] bf16)``: a per-row dequantize and
    its reader, to be fused."""
    with cg.Fusion(name) as f:
        q = cg.input(["n", "k"], FP8, name="q")
        s = cg.input(["n"], F32, name="s")
        b = cg.input(["k"], BF16, name="b")
        cg.output(cg.add(cg.dequantize(q, s), b))
    return f


def test_a_per_row_dequantize_fuses_into_its_reader():
    """One kernel: its scale [n] is read along the rows (``rt::unsqueeze(s, 1)``), a bias
    [k] along the columns; computed in fp32 and rounded once."""
    p = cg.lower(dequantize_add_bias("dq_add"))
    (node,) = [n for n in p.nodes() if isinstance(n, hir.Compute)]
    assert str(node) == "Add(Dequantize(q, s, group_size=None, dtype=bfloat16), b, out=T4)"
    assert "rt::pointwise(kernel0, T4, {q, rt::unsqueeze(s, 1), b}, streams.current(), op);" \
        in cg.render(p)
    gen = torch.Generator().manual_seed(5)
    qv, sv = random_q(6, 16, FP8, gen), random_scale((6,), F32, gen) * 1e-6
    bv = torch.randn(16, generator=gen).to(BF16)
    (out,) = cg.evaluate(p, [qv, sv, bv])
    want = (qv.float() * sv.to(BF16).float()[:, None] + bv.float()).to(BF16)
    assert_bitwise(out, want)


def test_a_grouped_dequantize_is_a_kernel_of_its_own():
    """Its kernel iterates [n, k / g, g] (``rt::unflatten``), its scale [n, k / g] as
    [n, k / g, 1]: no other op shares that shape, so its reader is another kernel."""
    with cg.Fusion("dq_relu") as f:
        w = cg.dequantize(cg.input(["n", "k"], I8, name="q"),
                          cg.input(["n", "groups"], BF16, name="s"), group_size=4)
        cg.output(cg.relu(w))
    p = cg.lower(f)
    assert [str(n) for n in p.nodes() if isinstance(n, hir.Compute)] == [
        "Dequantize(q, s, group_size=4, dtype=bfloat16, out=T2)", "Relu(T2, out=T3)"]
    assert ("rt::pointwise(kernel0, rt::unflatten(T2, 1, T2.size(1) / 4, 4), "
            "{rt::unflatten(q, 1, q.size(1) / 4, 4), rt::unsqueeze(s, 2)}, streams.current(), "
            "op);") in cg.render(p)
    gen = torch.Generator().manual_seed(6)
    q, s = random_q(5, 12, I8, gen, int4=True), random_scale((5, 3), BF16, gen)
    (out,) = cg.evaluate(p, [q, s])
    assert_bitwise(out, dequantize_reference(q, s).relu())


def test_a_value_read_two_ways_is_not_fused():
    """s [n] both as a per-row scale (along the rows) and as mul's b (along the columns,
    n = k): one kernel would need two views of it, so two kernels."""
    with cg.Fusion("dq_twice") as f:
        s = cg.input(["n"], BF16, name="s")
        w = cg.dequantize(cg.input(["n", "n"], FP8, name="q"), s)
        cg.output(cg.mul(w, s))
    p = cg.lower(f)
    assert [str(n) for n in p.nodes() if isinstance(n, hir.Compute)] == [
        "Dequantize(q, s, group_size=None, dtype=bfloat16, out=T2)", "Mul(T2, s, out=T3)"]
    gen = torch.Generator().manual_seed(7)
    q, sv = random_q(6, 6, FP8, gen), random_scale((6,), BF16, gen)
    (out,) = cg.evaluate(p, [sv, q])
    assert_bitwise(out, dequantize_reference(q, sv) * sv)


def test_a_gemm_epilogue_stays_with_the_gemm_after_a_dequantized_weight():
    with cg.Fusion("dq_relu_linear") as f:
        x = cg.input(["m", "k"], BF16, name="x")
        w = cg.dequantize(cg.input(["n", "k"], FP8, name="q"), cg.input(["n"], BF16, name="s"))
        y = cg.relu(cg.linear(x, w))
        cg.output(y)
    y.outer_split(1, 2)
    y.axis(1).parallelize(Stream)
    p = cg.lower(f)
    assert [str(n) for n in p.nodes() if isinstance(n, hir.Compute)] == [
        "Dequantize(q_i, s_i, group_size=None, dtype=bfloat16, out=T3_i)",
        "Relu(Linear(x, T3_i), out=T5_i)"]


# ---------------------------------------------------------------------------- backward


def test_gradients_of_q_or_scale_are_refused_by_name():
    """The forward runs where they require grad; backward names the op and the tensor."""
    p = cg.lower(dequantize_linear("fp8", 2))
    x, q, s = exact_inputs("dequantize_linear_fp8", torch.Generator().manual_seed(8))
    for index, named in ((2, "scale (its scale)"), (1, "q (its q)")):
        args = [x, q, s]
        args[index] = args[index].clone().requires_grad_()
        (y,) = cg.evaluate(p, args)
        assert torch.equal(y.detach(), F.linear(x, dequantize_reference(q, s)))
        with pytest.raises(cg.ScheduleError) as e:
            y.float().sum().backward()
        assert str(e.value) == (
            f"dequantize_linear_fp8: no backward: dequantize: no backward for {named}: "
            "quantized values and their scales are constants; pass it without "
            "requires_grad (or .detach() it)")


def test_the_gradient_of_x_dequantizes_again_in_the_backward():
    p = cg.lower(dequantize_linear("int4", 2))
    x, q, s = exact_inputs("dequantize_linear_int4", torch.Generator().manual_seed(9))
    x = x.clone().requires_grad_()
    (y,) = cg.evaluate(p, [x, q, s])
    dy = ints(*y.shape, dtype=BF16, lo=-2, hi=3)
    (gx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.linear(xr, dequantize_reference(q, s)), xr, dy)
    assert torch.equal(gx, want)


# ---------------------------------------------------------------------------- C++


def test_the_cpp_checks_quantized_dtypes_and_reads_them_as_bytes():
    source = cg.render(cg.lower(dequantize_linear("fp8")))
    assert ('rt::host_input(q_arg, op, "q", rt::DType::Float8E4M3FN, 2, '
            '"float8_e4m3fn[n, k]", device);') in source
    assert "using in0_t = f8e4m3;\nusing in1_t = bf16;" in source
    assert "return (x0 * round_bf16(x1));" in source
    assert "rt::pointwise(kernel0, T3_i, {q_s, rt::unsqueeze(scale_s, 1)}, " in source
    grouped = cg.render(cg.lower(dequantize_linear("int4")))
    assert 'rt::DType::Int8, 2, "int8[n, k]", device);' in grouped
    assert ('CG_CHECK(k == (groups * 128), op, ": dequantize T3: q=q axis 1 and scale=scale '
            'axis 1 times 128 must have equal sizes, got k = "') in grouped


@pytest.mark.parametrize("dtype, expr", [(BF16, "(x0 * round_bf16(x1))"),
                                         (F16, "(x0 * round_f16(x1))"), (F32, "(x0 * x1)")])
def test_the_c_expression_rounds_the_scale_to_the_result_dtype(dtype, expr):
    assert ops.DEQUANTIZE.cpp(["x0", "x1"], {"dtype": dtype, "group_size": None}) == expr


@pytest.fixture(scope="module")
def built(cache_dir):
    return cg.compile(QUANTIZED_EXAMPLES["dequantize_linear_int4"].make())


@pytest.mark.build
def test_the_golden_is_what_builds(built):
    """csrc_gen/ holds the C++ of the quantized examples too (tools/regen.py; stale
    ones fail tests/test_build.py); the op built is that text, but for its name."""
    golden = (CSRC_GEN / "dequantize_linear_int4.cpp").read_text()
    assert built.source.replace(built.op_name, "NAME") == \
        golden.replace(golden.split("torch.ops.codegen.")[1].split("(")[0], "NAME")
    assert (CSRC_GEN / "dequantize_linear_fp8.cpp").read_text() == \
        cg.render(cg.lower(QUANTIZED_EXAMPLES["dequantize_linear_fp8"].make()))


@pytest.mark.build
def test_the_built_op_checks_its_inputs_like_the_evaluator(built):
    """Meta tensors (and FakeTensor, torch.compile) go through the same checks as
    ``evaluate``; a host argument is a CPU tensor."""
    x = torch.empty(9, 256, dtype=BF16, device="meta")
    q, s = torch.empty(22, 256, dtype=I8), torch.empty(22, 2, dtype=BF16)
    assert built(x, q, s).shape == (9, 22)
    with pytest.raises(ValueError, match=r"^dequantize_linear_int4: argument q must be int8, "
                                         r"got torch.float8_e4m3fn$"):
        built(x, q.view(FP8), s)
    with pytest.raises(ValueError, match=r"argument scale must be bfloat16, got torch.float16"):
        built(x, q, s.half())
    with pytest.raises(ValueError, match=r"q=q axis 1 and scale=scale axis 1 times 128 must "
                                         r"have equal sizes, got k = 256 and groups \* 128 = "
                                         r"384"):
        built(x, q, torch.empty(22, 3, dtype=BF16))
