"""Layers as one program: elementwise ops between GEMMs, fused into kernels and epilogues,
intermediates freed at Deallocate; the Llama and GPT MLP examples. CPU only: structure,
exact text, the evaluator against torch, the stream-order checker, bad input."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import ints
from helpers import stream_loops

import codegen as cg
from codegen import examples
from codegen import hostir as hir
from codegen.interp import races

LLAMA_MLP = """\
HostProgram llama_mlp(x: bfloat16[m, h], w_gate: bfloat16[inter, h], w_up: bfloat16[inter, h], \
w_down: bfloat16[h, inter]) -> (T8):
  main_stream = GetCurrentStream()
  T4 = Allocate(bfloat16[m, inter])
  T6 = Allocate(bfloat16[m, inter])
  T7 = Allocate(bfloat16[m, inter])
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 4) [Stream]:
    SetCurrentStream(Stream(i))
    w_gate_i = ShardByStream(w_gate, axis=0, index=i, chunk=ceilDiv(inter, 4))
    T4_i = ShardByStream(T4, axis=1, index=i, chunk=ceilDiv(inter, 4))
    Linear(x, w_gate_i, out=T4_i)
    w_up_i = ShardByStream(w_up, axis=0, index=i, chunk=ceilDiv(inter, 4))
    T6_i = ShardByStream(T6, axis=1, index=i, chunk=ceilDiv(inter, 4))
    Linear(x, w_up_i, out=T6_i)
    T7_i = ShardByStream(T7, axis=1, index=i, chunk=ceilDiv(inter, 4))
    Mul(Silu(T4_i), T6_i, out=T7_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(T4)
  Deallocate(T6)
  T8 = Allocate(bfloat16[m, h])
  Linear(T7, w_down, out=T8)
  Deallocate(T7)
  return T8"""

GPT_MLP = """\
HostProgram gpt_mlp(x: bfloat16[m, h], w1: bfloat16[inter, h], b1: bfloat16[inter], \
w2: bfloat16[h, inter], b2: bfloat16[h]) -> (T7):
  main_stream = GetCurrentStream()
  T6 = Allocate(bfloat16[m, inter])
  for j in range(0, 2):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 2) [Stream]:
    SetCurrentStream(Stream(i))
    w1_i = ShardByStream(w1, axis=0, index=i, chunk=ceilDiv(inter, 2))
    b1_i = ShardByStream(b1, axis=0, index=i, chunk=ceilDiv(inter, 2))
    T6_i = ShardByStream(T6, axis=1, index=i, chunk=ceilDiv(inter, 2))
    Gelu(Linear(x, w1_i, b1_i), approximate=tanh, out=T6_i)
  SetCurrentStream(main_stream)
  for j in range(0, 2):
    Synchronize(Stream(j))
  T7 = Allocate(bfloat16[m, h])
  Linear(T6, w2, b2, out=T7)
  Deallocate(T6)
  return T7"""


def test_llama_mlp_host_ir():
    assert str(cg.lower(examples.llama_mlp())) == LLAMA_MLP


def test_gpt_mlp_host_ir():
    assert str(cg.lower(examples.gpt_mlp(slices=2))) == GPT_MLP


def llama_ref(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def gpt_ref(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _inputs(example, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = examples.EXAMPLES[example].shapes
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("weights", ["cuda", "cpu"])
@pytest.mark.parametrize("slices", [1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,make,ref", [("llama_mlp", examples.llama_mlp, llama_ref),
                                           ("gpt_mlp", examples.gpt_mlp, gpt_ref)])
def test_mlp_evaluates_like_torch_and_is_ordered(name, make, ref, dtype, slices, weights):
    xs = _inputs(name, dtype)
    program = cg.lower(make(dtype, slices, weights))
    (out,) = cg.evaluate(program, xs)
    expect = ref(*xs)
    # The fused SiLU-and-multiply rounds once where torch rounds the SiLU too; the
    # epilogue's tanh-GELU here runs after a rounded GEMM, as the cuBLAS fallback does.
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out, expect, rtol=tol, atol=tol)
    races.check(program, xs)
    for pool in (1, 2, 3):
        races.check(cg.lower(make(dtype, slices, weights), pool_size=pool), xs)


@pytest.mark.parametrize("example", ["llama_mlp", "gpt_mlp"])
def test_mlp_examples_refuse_bad_arguments(example):
    make = getattr(examples, example)
    with pytest.raises(cg.ScheduleError, match=f"{example}: weights must be"):
        make(weights="gpu")
    with pytest.raises(cg.ScheduleError, match=f"{example}: slices must be an int >= 1, got 0"):
        make(slices=0)


# ---------------------------------------------------------------------------- elementwise ops


def _fusion(build, dtype=torch.float32):
    with cg.Fusion("elementwise") as fusion:
        out = build(dtype)
        cg.output(out)
    return fusion, out


def _split(out, axis, slices=3):
    out.outer_split(axis, slices)
    out.axis(axis).parallelize(cg.ParallelType.Stream)


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("op,torch_op", [(cg.add, torch.add), (cg.mul, torch.mul)])
def test_binary_ops_exact_with_a_broadcast_bias(op, torch_op, axis):
    fusion, out = _fusion(lambda dt: op(cg.input(["m", "n"], dt), cg.input(["n"], dt)))
    if axis is not None:
        _split(out, axis)
    program = cg.lower(fusion)
    xs = [ints(7, 5), ints(5)]
    (got,) = cg.evaluate(program, xs)
    assert torch.equal(got, torch_op(*xs))
    races.check(program, xs)
    # Split by columns, the bias is read slice by slice; by rows, whole.
    views = {n.tensor for n in program.nodes() if isinstance(n, hir.ShardByStream)}
    assert ("T1" in views) == (axis == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
@pytest.mark.parametrize("fn,ref", [
    (cg.silu, F.silu),
    (lambda t: cg.gelu(t), F.gelu),
    (lambda t: cg.gelu(t, approximate="tanh"), lambda t: F.gelu(t, approximate="tanh")),
])
def test_unary_ops_match_torch(fn, ref, dtype):
    """One op alone computes in fp32 (fp64 for fp64) and rounds once, as torch's kernels
    do (the CPU's vectorized and scalar exp differ in the last bit: not bitwise)."""
    fusion, out = _fusion(lambda dt: fn(cg.input(["m", "n"], dt)), dtype)
    _split(out, 1)
    x = torch.randn(6, 11, dtype=torch.float64).mul(4).to(dtype)
    (got,) = cg.evaluate(cg.lower(fusion), [x])
    torch.testing.assert_close(got, ref(x))


def test_cast_between_dtypes_and_mixed_gemms():
    """A program may mix dtypes through cast; each dtype's GEMMs get their own rt::Gemms."""
    with cg.Fusion("mixed") as fusion:
        a = cg.input(["m", "k"], torch.bfloat16)
        w = cg.input(["k", "n"], torch.bfloat16)
        w2 = cg.input(["n", "p"], torch.float32)
        y = cg.cast(cg.matmul(a, w), torch.float32)
        out = cg.matmul(y, w2)
        cg.output(out)
    _split(out, 0, 2)
    program = cg.lower(fusion)
    xs = [ints(5, 4, dtype=torch.bfloat16), ints(4, 3, dtype=torch.bfloat16), ints(3, 2)]
    (got,) = cg.evaluate(program, xs)
    assert got.dtype == torch.float32
    assert torch.equal(got, (xs[0] @ xs[1]).float() @ xs[2])
    assert "Cast(T3_i, dtype=float32, out=T4_i)" in str(program)
    source = cg.render(program)
    assert "rt::Gemms gemms_bfloat16(rt::DType::BFloat16" in source
    assert "rt::Gemms gemms_float32(rt::DType::Float32" in source
    assert "using out_t = float;\nusing in0_t = bf16;" in source


def test_split_propagates_through_elementwise_ops_both_ways():
    """Scheduling the elementwise result splits its producer GEMM (backwards) and its
    consumer (forwards): all three run in one loop."""
    with cg.Fusion("chain") as fusion:
        x = cg.input(["m", "k"])
        w = cg.input(["n", "k"])
        s = cg.silu(cg.linear(x, w))
        out = cg.add(s, cg.input(["n"]))
        cg.output(out)
    _split(s, 0)
    program = cg.lower(fusion)
    (loop,) = [n for n in program.nodes() if isinstance(n, hir.ForLoop)
               and n.parallel is cg.ParallelType.Stream]
    computes = [str(n) for n in loop.body if isinstance(n, hir.Compute)]
    assert computes == ["Linear(T0_i, T1, out=T2_i)", "Add(Silu(T2_i), T4, out=T5_i)"]
    xs = [ints(7, 3), ints(4, 3), ints(4)]
    (got,) = cg.evaluate(program, xs)
    torch.testing.assert_close(got, F.silu(F.linear(xs[0], xs[1])) + xs[2])


def _lowered(build, **options):
    with cg.Fusion("f") as fusion:
        for out in build():
            cg.output(out)
    return cg.lower(fusion, **options)


def _computes(program):
    return [str(n) for n in program.nodes() if isinstance(n, hir.Compute)]


def test_fusion_rules():
    """What fuses: pointwise into pointwise, tanh-GELU into a cuBLASLt GEMM. What does
    not: erf-GELU into a GEMM (no epilogue), anything with gemm_library="cublas", a value
    that is also an output or read twice, a cast in the middle of an expression."""
    def gemm_gelu(approximate):
        return lambda: [cg.gelu(cg.matmul(cg.input([4, 3]), cg.input([3, 5])), approximate)]

    assert _computes(_lowered(gemm_gelu("tanh"))) == \
        ["Gelu(Matmul(T0, T1), approximate=tanh, out=T3)"]
    assert _computes(_lowered(gemm_gelu("none"))) == \
        ["Matmul(T0, T1, out=T2)", "Gelu(T2, approximate=none, out=T3)"]
    assert _computes(_lowered(gemm_gelu("tanh"), gemm_library="cublas")) == \
        ["Matmul(T0, T1, out=T2)", "Gelu(T2, approximate=tanh, out=T3)"]

    def shared():
        s = cg.silu(cg.input([4, 5]))
        return [cg.mul(s, s)]

    assert _computes(_lowered(shared)) == ["Silu(T0, out=T1)", "Mul(T1, T1, out=T2)"]

    def also_output():
        s = cg.silu(cg.input([4, 5]))
        return [s, cg.add(s, cg.input([5]))]

    assert _computes(_lowered(also_output)) == ["Silu(T0, out=T1)", "Add(T1, T2, out=T3)"]

    def cast_inside():
        c = cg.cast(cg.input([4, 5]), torch.bfloat16)
        return [cg.silu(c)]

    assert _computes(_lowered(cast_inside)) == \
        ["Cast(T0, dtype=bfloat16, out=T1)", "Silu(T1, out=T2)"]

    def chain_to(dtype):
        def build():
            a, b = cg.input([4, 5]), cg.input([4, 5])
            return [cg.cast(cg.add(cg.silu(a), cg.mul(a, b)), dtype)]
        return build

    # Narrowing: the fp32 sum is rounded once, to bf16, in one kernel.
    assert _computes(_lowered(chain_to(torch.bfloat16))) == \
        ["Cast(Add(Silu(T0), Mul(T0, T1)), dtype=bfloat16, out=T5)"]
    # Widening: computing the sum in fp64 would skip its fp32 rounding: two nodes.
    assert _computes(_lowered(chain_to(torch.float64))) == \
        ["Add(Silu(T0), Mul(T0, T1), out=T4)", "Cast(T4, dtype=float64, out=T5)"]


def test_a_unary_result_read_by_several_kernels_is_recomputed_in_each():
    """silu(a) read by three pointwise nodes is computed inside each of them (each reads a
    where it read silu(a)), and never stored; read by a GEMM too, it is stored."""
    def readers(gemm):
        def build():
            a, b, c = (cg.input([4, 5], name=n) for n in "abc")
            s = cg.silu(a)
            outs = [cg.mul(s, b), cg.add(c, s), cg.relu(s)]
            return outs + ([cg.matmul(s, cg.input([5, 3], name="w"))] if gemm else [])
        return build

    program = _lowered(readers(False))
    assert _computes(program) == ["Mul(Silu(a), b, out=T4)", "Add(c, Silu(a), out=T5)",
                                  "Relu(Silu(a), out=T6)"]
    assert [n.out.name for n in program.nodes() if isinstance(n, hir.Allocate)] == \
        ["T4", "T5", "T6"]
    a, b, c = (torch.randn(4, 5) for _ in range(3))
    s = F.silu(a)
    for got, want in zip(cg.evaluate(program, [a, b, c]), [s * b, c + s, F.relu(s)]):
        torch.testing.assert_close(got, want)
    stored = _computes(_lowered(readers(True)))
    assert stored[0] == "Silu(a, out=T3)" and "Matmul(T3, w, out=T8)" in stored


def test_a_result_read_by_several_kernels_in_a_loop_is_recomputed_per_slice():
    def build():
        a, b = cg.input(["m", "n"], name="a"), cg.input(["m", "n"], name="b")
        s = cg.gelu(a, "tanh")
        y, z = cg.mul(s, b), cg.add(b, s)
        for t in (s, y, z):
            t.outer_split(1, 3)
            t.axis(1).parallelize(cg.ParallelType.Stream)
        return [y, z]

    program = _lowered(build)
    (loop,) = stream_loops(program)
    assert [str(n) for n in loop.body if isinstance(n, hir.Compute)] == [
        "Mul(Gelu(a_i, approximate=tanh), b_i, out=T3_i)",
        "Add(b_i, Gelu(a_i, approximate=tanh), out=T4_i)"]
    a, b = torch.randn(4, 7), torch.randn(4, 7)
    races.check(program, [a, b])
    s = F.gelu(a, approximate="tanh")
    y, z = cg.evaluate(program, [a, b])
    torch.testing.assert_close(y, s * b)
    torch.testing.assert_close(z, b + s)


def test_two_gemm_results_added_become_one_accumulating_gemm():
    """x @ w1 + y @ w2: the second GEMM adds its product onto the first's output (beta 1),
    no Add and no intermediates; exact on integers. Not merged: a GEMM with a bias (its
    epilogue adds it), a GEMM result that is also an output, a broadcast add."""
    def two(bias=False, also_output=False):
        def build():
            x, w1 = cg.input(["m", "k"], name="x"), cg.input(["n", "k"], name="w1")
            y, w2 = cg.input(["m", "j"], name="y"), cg.input(["j", "n"], name="w2")
            first = cg.linear(x, w1, cg.input(["n"], name="b") if bias else None)
            second = cg.matmul(y, w2)
            return [cg.add(first, second)] + ([second] if also_output else [])
        return build

    with cg.Fusion("to_host") as fusion:  # the sum lands in host memory: staged, not summed
        x, w1, y, w2 = (cg.input([3, 3], name=n) for n in ("x", "w1", "y", "w2"))
        cg.output(cg.add(cg.matmul(x, w1), cg.matmul(y, w2)), device="cpu")
    to_host = cg.lower(fusion)
    assert "Add(" in str(to_host) and "accumulate" not in str(to_host)
    args = [ints(3, 3) for _ in range(4)]
    races.check(to_host, args)
    assert torch.equal(cg.evaluate(to_host, args)[0], args[0] @ args[1] + args[2] @ args[3])

    program = _lowered(two())
    assert _computes(program) == ["Linear(x, w1, out=T6)",
                                  "Matmul(y, w2, out=T6, accumulate=True)"]
    text = str(program)
    assert "T6 = Allocate(float32[m, n])\n  Linear(x, w1, out=T6)" in text
    assert "T4" not in text and "T5" not in text
    x, w1, y, w2 = ints(3, 4), ints(5, 4), ints(3, 2), ints(2, 5)
    races.check(program, [x, w1, y, w2])
    (out,) = cg.evaluate(program, [x, w1, y, w2])
    assert torch.equal(out, x @ w1.t() + y @ w2)
    assert "Add(" in _computes(_lowered(two(bias=True)))[-1]
    assert "Add(" in _computes(_lowered(two(also_output=True)))[-1]

    def broadcast():
        return [cg.add(cg.matmul(cg.input([4, 3]), cg.input([3, 5])), cg.input([5]))]

    assert _computes(_lowered(broadcast))[-1].startswith("Add(")


@pytest.mark.build
def test_the_accumulating_gemm_in_cpp(cache_dir):
    with cg.Fusion("gemm_sum") as fusion:
        x, w1 = cg.input(["m", "k"], name="x"), cg.input(["k", "n"], name="w1")
        y, w2 = cg.input(["m", "j"], name="y"), cg.input(["j", "n"], name="w2")
        cg.output(cg.add(cg.matmul(x, w1), cg.matmul(y, w2)))
    op = cg.build(cg.lower(fusion))
    assert "gemms.matmul(T6, y, w2, rt::kAccumulate, streams.current());" in op.source


def test_fused_kernel_source():
    """The kernel of a fused node is its expression in C, over its distinct inputs."""
    source = cg.render(cg.lower(examples.llama_mlp()))
    assert ('const rt::PointwiseKernel kernel0{\n    "Mul(Silu(T4_i), T6_i, out=T7_i)", R"cuda(\n'
            "using out_t = bf16;\nusing in0_t = bf16;\nusing in1_t = bf16;\n"
            "using compute_t = float;\n"
            "__device__ __forceinline__ compute_t expr(compute_t x0, compute_t x1) "
            "{ return (silu(x0) * x1); }\n)cuda\", 2};") in source
    assert "rt::pointwise(kernel0, T7_i, {T4_i, T6_i}, streams.current(), op);" in source
    gpt = cg.render(cg.lower(examples.gpt_mlp()))
    assert "gemms.linear(T6_i, x, w1_i, b1_i, rt::Epilogue::GeluTanh, streams.current());" \
        in gpt
    assert "PointwiseKernel" not in gpt


def test_deallocate_frees_after_the_join():
    """The C++ gives an intermediate back to the caching allocator at its Deallocate, which
    comes after the join (so the workers' uses are ordered before the caller's stream)."""
    source = cg.render(cg.lower(examples.llama_mlp()))
    join = source.index("// hir: Synchronize(Stream(j))")
    for t in ("T4", "T6", "T7"):
        assert source.index(f"streams.release({t});") > join
    assert source.index("streams.release(T4);") < source.index("// hir: T8 = Allocate")


# ---------------------------------------------------------------------------- bad input


def test_mismatched_shapes_name_both_operands():
    with cg.Fusion("bad"), pytest.raises(
            cg.ScheduleError, match=r"add: sizes that must be equal differ: a=T0 axis 1 is 5, "
                                    r"b=T1 axis 0 is 4"):
        cg.add(cg.input([3, 5]), cg.input([4]))
    with cg.Fusion("bad"), pytest.raises(
            cg.ScheduleError, match=r"mul: b \(T1, rank 2\) may broadcast along a's leading "
                                    r"axes but not have more axes than a \(T0, rank 1\)"):
        cg.mul(cg.input([5]), cg.input([3, 5]))


def test_unknown_gelu_approximation():
    with cg.Fusion("bad"), pytest.raises(
            cg.ScheduleError, match=r"gelu: approximate must be one of 'none', 'tanh'.*got 'erf'"):
        cg.gelu(cg.input([3]), approximate="erf")


@pytest.mark.parametrize("dtype", ["float32", torch.int32, float, None])
def test_cast_to_a_non_dtype(dtype):
    with cg.Fusion("bad"), pytest.raises(cg.ScheduleError, match=r"cast: dtype must be one of "
                                                               r"torch.float32.*got"):
        cg.cast(cg.input([3]), dtype)


def test_elementwise_operands_must_be_tensors_of_the_fusion():
    with cg.Fusion("other"):
        foreign = cg.input([3])
    with cg.Fusion("bad"):
        with pytest.raises(cg.ScheduleError, match="silu: argument x .* belongs to another"):
            cg.silu(foreign)
        with pytest.raises(cg.ScheduleError, match="add: argument b must be a tensor"):
            cg.add(cg.input([3]), 1.0)


def test_evaluator_refuses_wrong_shapes_naming_the_argument():
    program = cg.lower(examples.llama_mlp(torch.float32))
    xs = _inputs("llama_mlp", torch.float32)
    xs[2] = xs[2][:, :5]
    with pytest.raises(ValueError, match="llama_mlp: argument w_up axis 1 must have size h"):
        cg.evaluate(program, xs)


@pytest.mark.parametrize("split", [None, 0, 1])
def test_relu_exact_fused_into_a_kernel_and_an_epilogue(split):
    """relu alone, in a pointwise kernel (after an add) and in a GEMM's epilogue."""
    with cg.Fusion("relus") as fusion:
        x, w, b = cg.input(["m", "k"]), cg.input(["n", "k"]), cg.input(["n"])
        gemm = cg.relu(cg.linear(x, w, b))
        chain = cg.relu(cg.add(gemm, b))
        cg.output(gemm)
        cg.output(chain)
    if split is not None:
        _split(gemm, split)
    program = cg.lower(fusion)
    computes = [str(n) for n in program.nodes() if isinstance(n, hir.Compute)]
    suffix = "_i" if split is not None else ""
    b_ = "T2_i" if split == 1 else "T2"
    assert computes == [f"Relu(Linear({'T0_i' if split == 0 else 'T0'}, "
                        f"{'T1_i' if split == 1 else 'T1'}, {b_}), out=T4{suffix})",
                        f"Relu(Add(T4{suffix}, {b_}), out=T6{suffix})"]
    xs = [ints(7, 3), ints(5, 3), ints(5)]
    outs = cg.evaluate(program, xs)
    expect = torch.relu(F.linear(*xs))
    assert torch.equal(outs[0], expect) and torch.equal(outs[1], torch.relu(expect + xs[2]))
    assert "rt::Epilogue::Relu" in cg.render(program)


# ---------------------------------------------------------------------------- copies ahead


def _loops(program):
    return [n for n in program.body if isinstance(n, hir.ForLoop)
            and n.parallel is cg.ParallelType.Stream]


def test_second_loop_copies_run_ahead_on_a_second_set_of_workers():
    """Without a copy stream, the down loop of a host-weight MLP runs on the lease's
    second set of workers: forked before the gate/up loop, its first copies queued before
    it waits for the caller's stream (which joined the gate/up loop), its staging
    allocated before both forks."""
    program = cg.lower(examples.llama_mlp(torch.float32, 8, "cpu"))
    first, second = _loops(program)
    assert str(first.body[0]) == "SetCurrentStream(Stream(i % 4))"
    assert [str(n) for n in second.body[:5]] == [
        "SetCurrentStream(Stream(4 + i % 4))",
        "w_down_i = ShardByStream(w_down, axis=0, index=i, chunk=ceilDiv(h, 8))",
        "w_down_s = StagingSlot(w_down_stage, slot=i % 4, like=w_down_i)",
        "Copy(w_down_i, out=w_down_s)", "Synchronize(main_stream)"]
    text = str(program)
    assert text.index("w_down_stage = Allocate") < text.index("SetCurrentStream(Stream(4 + j))") \
        < text.index("SetCurrentStream(Stream(j))") < text.index("for i in range(0, 8)")
    xs = _inputs("llama_mlp", torch.float32)
    races.check(program, xs)
    # Without the wait, down would read the intermediate before the first loop wrote it.
    broken = program.replace(body=[dataclasses.replace(n, body=[
        c for c in n.body if not (isinstance(c, hir.Synchronize) and c.stream == "main_stream")])
        if n is second else n for n in program.body])
    kinds = {(r.kind, r.tensor) for r in races.find_races(broken, xs)}
    assert ("read before write", "T7") in kinds, kinds


@pytest.mark.parametrize("copy_stream", [False, True])
def test_gpu_resident_programs_keep_one_set_of_workers(copy_stream):
    for make in (examples.llama_mlp, examples.gpt_mlp):
        text = str(cg.lower(make(torch.float32, 8), copy_stream=copy_stream))
        assert "Stream(4 +" not in text


def test_with_a_copy_stream_the_second_loop_keeps_the_first_set():
    text = str(cg.lower(examples.llama_mlp(torch.float32, 8, "cpu"), copy_stream=True))
    assert "Stream(4 +" not in text and text.count("SetCurrentStream(CopyStream)") == 3


# ---------------------------------------------------------------------------- found in review


def test_a_pointwise_op_before_a_gemm_stays_out_of_its_operands():
    """add -> matmul -> relu in one loop: the relu becomes the GEMM's epilogue, the add
    stays a kernel of its own (a GEMM's operands are values, never expressions)."""
    with cg.Fusion("residual") as fusion:
        x, y, w = cg.input(["m", "k"]), cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.relu(cg.matmul(cg.add(x, y), w))
        cg.output(out)
    _split(out, 0, 2)
    program = cg.lower(fusion)
    computes = [str(n) for n in program.nodes() if isinstance(n, hir.Compute)]
    assert computes == ["Add(T0_i, T1_i, out=T3_i)", "Relu(Matmul(T3_i, T2), out=T5_i)"]
    xs = [ints(6, 3), ints(6, 3), ints(3, 4)]
    (got,) = cg.evaluate(program, xs)
    assert torch.equal(got, torch.relu((xs[0] + xs[1]) @ xs[2]))
    assert "gemms.matmul(T5_i, T3_i, T2, rt::Epilogue::Relu, streams.current());" \
        in cg.render(program)
    bad = program.replace(body=[dataclasses.replace(n, body=[
        hir.Compute.of(hir.Apply("relu", (hir.Apply("matmul", (
            hir.Apply("add", ("T0_i", "T1_i")), "T2")),)), "T5_i")
        if isinstance(c, hir.Compute) and c.out == "T5_i" else c for c in n.body])
        if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream else n
        for n in program.body])
    with pytest.raises(cg.InternalError, match="a GEMM's operands must be values"):
        hir.verify(bad)


def test_a_top_level_epilogue_fuses_although_its_input_is_freed_after_the_gemm():
    with cg.Fusion("top") as fusion:
        x, y, w = cg.input([4, 3]), cg.input([4, 3]), cg.input([3, 5])
        cg.output(cg.relu(cg.matmul(cg.add(x, y), w)))
    program = cg.lower(fusion)
    assert [str(n) for n in program.nodes()] == [
        "T3 = Allocate(float32[4, 3])", "Add(T0, T1, out=T3)", "T5 = Allocate(float32[4, 5])",
        "Relu(Matmul(T3, T2), out=T5)", "Deallocate(T3)"]
    xs = [ints(4, 3), ints(4, 3), ints(3, 5)]
    assert torch.equal(cg.evaluate(program, xs)[0], torch.relu((xs[0] + xs[1]) @ xs[2]))


def test_a_widening_cast_keeps_its_producers_rounding():
    """Cast(Mul(a, b)) of bf16 a, b to fp32 is not one fp32 kernel: that would skip the
    bf16 rounding of the product that torch does (17 * 17 = 289 rounds to 288)."""
    with cg.Fusion("widen") as fusion:
        a, b = cg.input(["n"], torch.bfloat16), cg.input(["n"], torch.bfloat16)
        cg.output(cg.cast(cg.mul(a, b), torch.float32))
    program = cg.lower(fusion)
    xs = [torch.tensor([17.0, 16.0]).bfloat16()] * 2
    assert cg.evaluate(program, xs)[0].tolist() == (xs[0] * xs[1]).float().tolist() \
        == [288.0, 256.0]
    assert "Cast(T2, dtype=float32, out=T3)" in str(program)


def test_host_output_loop_after_copy_stream_loops_keeps_its_staging():
    with cg.Fusion("three_loops") as fusion:
        x = cg.input(["m", "k"], device="cpu")
        a = cg.relu(x)
        b = cg.add(a, x)
        c = cg.relu(b)
        cg.output(c, device="cpu")
    _split(a, 0, 2)
    _split(b, 1, 2)
    _split(c, 0, 3)
    for copy_stream in (False, True):
        program = cg.lower(fusion, copy_stream=copy_stream)
        x_ = ints(5, 4)
        races.check(program, [x_])
        (got,) = cg.evaluate(program, [x_])
        assert torch.equal(got, torch.relu(torch.relu(x_) + x_))


def test_a_dead_loop_beside_a_live_one_is_dropped_with_its_copies():
    """Both loops name their slice of x ``T0_i``; the dead one's goes with its loop."""
    with cg.Fusion("dead_beside") as fusion:
        x = cg.input(["m", "k"], device="cpu")
        dead = cg.relu(x)
        out = cg.relu(x)
        cg.output(out)
    _split(dead, 0, 3)
    _split(out, 0, 2)
    for copy_stream in (False, True):
        program = cg.lower(fusion, pool_size=2, copy_stream=copy_stream)
        assert sum(isinstance(n, hir.Copy) for n in program.nodes()) == 1
        assert len(_loops(program)) == 1
        x_ = ints(5, 4)
        assert torch.equal(cg.evaluate(program, [x_])[0], torch.relu(x_))


def test_an_input_only_kernels_read_gets_no_cublas_layout_check():
    with cg.Fusion("strided") as fusion:
        a, w = cg.input(["m", "k"]), cg.input(["k", "n"])
        cg.output(cg.matmul(cg.relu(a), w))
    source = cg.render(cg.lower(fusion))
    assert "rt::check_matrix(w," not in source and "rt::check_matrix(T1, op" in source
    assert "rt::check_matrix(T0, op" not in source


def test_3d_linear_into_a_strided_slice():
    """A 3-D linear split along its rows writes a slice whose batch stride is not rows x
    columns: the evaluator's torch call must not fold the batch into the rows."""
    with cg.Fusion("rows_of_3d") as f:
        x = cg.input(["b", "m", "k"], device="cpu")
        w = cg.input(["n", "k"])
        y = cg.linear(x, w)
        cg.output(y)
    y.outer_split(1, 3)
    y.axis(1).parallelize(cg.ParallelType.Stream)
    torch.manual_seed(0)
    x, w = ints(2, 9, 4), ints(5, 4)
    assert torch.equal(cg.evaluate(cg.lower(f), [x, w])[0], x @ w.t())
