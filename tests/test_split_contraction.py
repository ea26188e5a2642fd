"""A contraction split over a stream loop, each slice accumulating onto the whole output:
a row-major host weight read by blocks of rows (``lower(..., split_contraction=True)``)
and the input gradient of a host weight streamed in by slices. The host IR, the
evaluator against torch, the stream-order checker (a missing wait and a missing zeroing
caught), the C++ and its build, and bad options."""

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples
from codegen import hostir as hir
from codegen.interp import races
from codegen.runtime import autograd

SIGNATURE = ("HostProgram stream_weights(T0: float32[m, k], T1: float32[k, n] device=cpu) "
             "-> (T2) [split_contraction]:")
SPLIT_K = SIGNATURE + """
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[m, n], zeroed=True)
  T1_stage = Allocate(float32[4, ceilDiv(k, 8), n])
  T2_sum = CreateEvents(1)
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 8) [Stream]:
    SetCurrentStream(Stream(i % 4))
    T0_i = ShardByStream(T0, axis=1, index=i, chunk=ceilDiv(k, 8))
    T1_i = ShardByStream(T1, axis=0, index=i, chunk=ceilDiv(k, 8))
    T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i)
    Copy(T1_i, out=T1_s)
    WaitEvent(T2_sum[0])
    Matmul(T0_i, T1_s, out=T2, accumulate=True)
    RecordEvent(T2_sum[0])
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(T1_stage)
  return T2"""


def split_k(slices=8, dtype=torch.float32, **options):
    return cg.lower(examples.stream_weights(dtype, slices), split_contraction=True, **options)


def test_split_contraction_prints_as_expected():
    """The loop slices x by columns and w by rows (dense blocks), the output is zeroed
    and whole, and each slice's GEMM waits for the previous slice's."""
    assert str(split_k()) == SPLIT_K


def test_the_option_is_off_by_default_and_only_takes_matching_loops():
    plain = cg.lower(examples.stream_weights(torch.float32, 8))
    assert not plain.split_contraction and "accumulate" not in str(plain)
    # rows of x in host memory: nothing is read by column blocks
    rows = cg.lower(examples.offload_activations(torch.float32, 4), split_contraction=True)
    assert "accumulate" not in str(rows)
    # a weight on the GPU, and a loop of more than the one GEMM (an activation after it)
    with cg.Fusion("gpu_w") as f:
        cg.output(cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"])))
    f.outputs[0].outer_split(1, 4)
    f.outputs[0].axis(1).parallelize(cg.ParallelType.Stream)
    assert "accumulate" not in str(cg.lower(f, split_contraction=True))
    with cg.Fusion("relu_after") as f:
        y = cg.relu(cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"], device="cpu")))
        cg.output(y)
    y.outer_split(1, 4)
    y.axis(1).parallelize(cg.ParallelType.Stream)
    assert "accumulate" not in str(cg.lower(f, split_contraction=True))


def test_bad_option_is_named():
    with pytest.raises(cg.ScheduleError, match=r"lower: split_contraction must be True, "
                                               r"False or 'auto', got 'yes'"):
        cg.lower(examples.stream_weights(torch.float32, 4), split_contraction="yes")


@pytest.mark.parametrize("seed", range(24))
def test_random_sizes_and_options_are_exact_and_ordered(seed):
    """Ragged and empty slices (k not a multiple of S, k < S), every staging, pool sizes
    that reuse slots: exact on integers and stream-ordered."""
    rng = random.Random(seed)
    slices, pool = rng.choice([1, 2, 3, 5, 8]), rng.choice([1, 2, 4])
    staging, copy_stream = rng.choice([("slots", False), ("slots", True), ("ring", True)])
    m, k, n = rng.randint(1, 9), rng.randint(1, 23), rng.randint(1, 9)
    program = split_k(slices, pool_size=pool, copy_stream=copy_stream, staging=staging)
    torch.manual_seed(seed)
    x, w = ints(m, k), ints(k, n)
    races.check(program, [x, w])
    (y,) = cg.evaluate(program, [x, w])
    assert torch.equal(y, x @ w)


def test_half_precision_rounds_once_per_slice():
    """bf16: each slice adds its fp32 product onto the bf16 output and rounds the sum once
    (what cuBLAS does with beta = 1): the result is that sequence of roundings, bit for
    bit, and within a few roundings of the exact product."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 256).bfloat16(), torch.randn(256, 24).bfloat16()
    (y,) = cg.evaluate(split_k(8, torch.bfloat16), [x, w])
    expect = torch.zeros(16, 24, dtype=torch.bfloat16)
    for k in range(0, 256, 32):  # ceilDiv(256, 8) = 32 rows of w per slice
        product = x[:, k:k + 32].float() @ w[k:k + 32].float()
        expect = (expect.float() + product).bfloat16()
    assert torch.equal(y, expect)
    ref = x.double() @ w.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2


def _without(program, drop):
    def walk(nodes):
        out = []
        for n in nodes:
            if drop(n):
                continue
            if isinstance(n, hir.ForLoop):
                n = dataclasses.replace(n, body=walk(n.body))
            out.append(n)
        return out

    return program.replace(body=walk(program.body))


def test_a_missing_wait_between_slices_is_caught():
    program = _without(split_k(4, pool_size=2), lambda n: isinstance(n, hir.WaitEvent))
    with pytest.raises(cg.InternalError, match=r"write after write on T2 .* Matmul\(T0_i, "
                                               r"T1_s, out=T2, accumulate=True\) on Stream\(1\)"):
        races.check(program, [ints(3, 8), ints(8, 5)])


def test_a_sum_that_is_not_zeroed_is_caught():
    def unzeroed(n):
        return dataclasses.replace(n, zeroed=False) if isinstance(n, hir.Allocate) else n

    program = split_k(4)
    program = program.replace(body=[unzeroed(n) for n in program.body])
    with pytest.raises(cg.InternalError, match=r"uninitialized read on T2"):
        races.check(program, [ints(3, 8), ints(8, 5)])


# ---------------------------------------------------------------------------- backward


def _host_linear_backward(slices=4, pool=4, **options):
    program = cg.lower(examples.offload_linear(torch.float32, slices, False, name="ol"),
                       pool_size=pool, **options)
    g = autograd.derive(program.source, (True, True))
    return cg.lower(g.backward, pool_size=pool, **options)


def test_input_gradient_streams_the_host_weight_in_slices():
    """dX = dY @ w contracts the split axis: it joins the loop and streams w by the
    forward's slices (dense row blocks of w [n, k]) instead of copying it whole."""
    program = _host_linear_backward()
    text = str(program)
    assert "grad_x = Allocate(float32[m, k], zeroed=True)" in text
    assert "Matmul(grad_T2_i, w_s, out=grad_x, accumulate=True)" in text
    assert "w_i = ShardByStream(w, axis=0, index=i, chunk=ceilDiv(n, 4))" in text
    gpu_allocs = [n.out for n in program.nodes() if isinstance(n, hir.Allocate)
                  and n.out.device == "cuda"]
    assert not [t for t in gpu_allocs if t.shape == program.inputs[1].shape], gpu_allocs


@pytest.mark.parametrize("pool,options", [(4, {}), (2, {}), (2, {"copy_stream": True}),
                                          (2, {"staging": "ring"}), (1, {})])
def test_host_weight_gradients_are_exact_and_ordered(pool, options):
    program = _host_linear_backward(4, pool, **options)
    torch.manual_seed(pool)
    x, w, dy = ints(6, 5), ints(9, 5), ints(6, 9)
    races.check(program, [x, w, dy])
    gx, gw = cg.evaluate(program, [x, w, dy])
    assert torch.equal(gx, dy @ w) and torch.equal(gw, dy.t() @ x)


def _llama_host_backward(slices=3, **options):
    program = cg.lower(examples.llama_mlp(torch.float32, slices, weights="cpu"), **options)
    g = autograd.derive(program.source, (True,) * 4)
    return cg.lower(g.backward, **options)


def test_llama_with_host_weights_sums_its_input_gradients_in_the_loop():
    """x feeds two GEMMs, so dX is the sum of two contractions, both split over the loop:
    both accumulate into one zeroed grad_x, ordered by one event (the slice's first GEMM
    onto it waits, its last records)."""
    program = _llama_host_backward()
    sums = [n for n in program.nodes() if isinstance(n, hir.Compute) and n.accumulate]
    assert sorted(n.expr.args[1] for n in sums) == ["w_gate_s", "w_up_s"]
    assert {n.out for n in sums} == {"grad_x"}
    text = str(program)
    assert "grad_x = Allocate(float32[m, h], zeroed=True)" in text and "Add(" not in text
    assert text.count("CreateEvents(1)") == 1
    assert ("WaitEvent(grad_x_sum[0])\n    Matmul(grad_T6_i, w_up_s, out=grad_x, "
            "accumulate=True)\n    Matmul(grad_T4_i, w_gate_s, out=grad_x, accumulate=True)"
            "\n    RecordEvent(grad_x_sum[0])") in text


@pytest.mark.parametrize("options", [{"pool_size": 1}, {"pool_size": 2}, {},
                                     {"pool_size": 2, "copy_stream": True},
                                     {"staging": "ring"}])
def test_llama_host_weight_gradients_exact_and_ordered(options):
    program = _llama_host_backward(3, **options)
    torch.manual_seed(len(options))
    m, h, i = 4, 6, 9
    x, wg, wu, wd = ints(m, h), ints(i, h), ints(i, h), ints(h, i)
    t4, t6, dy = x @ wg.t(), x @ wu.t(), ints(m, h)
    args = [x, wg, wu, wd, t4, t6, dy]
    races.check(program, args)
    gx, gwg, gwu, gwd = cg.evaluate(program, args)
    x_, wg_, wu_, wd_ = (t.clone().double().requires_grad_() for t in (x, wg, wu, wd))
    F.linear(F.silu(F.linear(x_, wg_)) * F.linear(x_, wu_), wd_).backward(dy.double())
    for got, want in [(gx, x_), (gwg, wg_), (gwu, wu_), (gwd, wd_)]:
        torch.testing.assert_close(got.double(), want.grad, rtol=1e-5, atol=1e-3)


def test_a_missing_wait_on_a_two_gemm_sum_is_caught():
    program = _without(_llama_host_backward(3, pool_size=2),
                       lambda n: isinstance(n, hir.WaitEvent) and n.event.name == "grad_x_sum")
    args = [ints(4, 6), ints(9, 6), ints(9, 6), ints(6, 9), ints(4, 9), ints(4, 9), ints(4, 6)]
    with pytest.raises(cg.InternalError, match=r"write after write on grad_x"):
        races.check(program, args)


# ---------------------------------------------------------------------------- C++


@pytest.mark.build
def test_cpp_zeroes_the_sum_and_accumulates(cache_dir):
    op = cg.build(split_k(4))
    assert "rt::zeros({m, n}, rt::DType::Float32, device, streams.current().handle, op)" \
        in op.source
    assert "gemms.matmul(T2, T0_i, T1_s, rt::kAccumulate, streams.current());" in op.source
    assert op.host_ir.split_contraction and "[split_contraction]" in str(op.host_ir)


@pytest.mark.parametrize("second", ["matmul", "linear"])
def test_a_host_operand_joins_the_loop_only_by_blocks_of_rows(second):
    """t = x @ w1 split by columns, then y = t @ w2 with w2 in host memory: ``matmul`` reads
    w2 [i, n] by blocks of rows (dense) and joins t's loop, summing; ``linear`` would read
    w2 [n, i] by blocks of columns (2-D copies) and gets a loop of its own instead."""
    with cg.Fusion(f"two_{second}") as f:
        x = cg.input(["m", "k"], name="x")
        w1 = cg.input(["k", "i"], name="w1")
        shape = ["i", "n"] if second == "matmul" else ["n", "i"]
        w2 = cg.input(shape, name="w2", device="cpu")
        t = cg.matmul(x, w1)
        y = cg.matmul(t, w2) if second == "matmul" else cg.linear(t, w2)
        cg.output(y)
    t.outer_split(1, 3)
    t.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(f)
    loops = [n for n in program.body if isinstance(n, hir.ForLoop)
             and n.parallel is cg.ParallelType.Stream]
    sums = [n for n in program.nodes() if isinstance(n, hir.Compute) and n.accumulate]
    assert (len(loops), len(sums)) == ((1, 1) if second == "matmul" else (1, 0))
    torch.manual_seed(0)
    xs, w1s, w2s = ints(5, 4), ints(4, 7), ints(*[7 if d == "i" else 6 for d in shape])
    races.check(program, [xs, w1s, w2s])
    (got,) = cg.evaluate(program, [xs, w1s, w2s])
    want = (xs @ w1s) @ (w2s if second == "matmul" else w2s.t())
    assert torch.equal(got, want)


def test_fp16_sums_are_not_split():
    """A partial sum may overflow fp16 where the whole sum fits (300 * 300 - 299 * 300):
    an fp16 input gradient stays one GEMM (fp32 accumulation, one rounding), and
    ``split_contraction`` leaves an fp16 loop by columns."""
    h = torch.float16
    program = cg.lower(examples.offload_linear(h, 2, False, name="ol"))
    backward = cg.lower(autograd.derive(program.source, (True, True)).backward)
    assert "accumulate" not in str(backward)
    x, w, dy = torch.ones(1, 1, dtype=h), torch.tensor([[300.], [-299.]], dtype=h), \
        torch.tensor([[300., 300.]], dtype=h)
    gx, _ = cg.evaluate(backward, [x, w, dy])
    assert gx.item() == 300.0
    assert "accumulate" not in str(split_k(4, h))


def test_event_names_avoid_every_value():
    """The sum's event is named ``<out>_sum`` unless a value already is."""
    with cg.Fusion("taken") as f:
        t = cg.input(["m", "i"], name="t")
        w2 = cg.input(["i", "n"], name="w2", device="cpu")
        y_sum = cg.input(["m", "n"], name="y_sum")
        a = cg.relu(t)
        y = cg.matmul(a, w2)
        y.name = "y"
        cg.output(cg.add(y, y_sum))
    a.outer_split(1, 2)
    a.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(f)
    assert "y_sum2 = CreateEvents(1)" in str(program)
    torch.manual_seed(0)
    ts, w2s, ys = ints(3, 4), ints(4, 5), ints(3, 5)
    races.check(program, [ts, w2s, ys])
    assert torch.equal(cg.evaluate(program, [ts, w2s, ys])[0], torch.relu(ts) @ w2s + ys)


def test_a_chain_streams_its_first_host_weight_for_the_input_gradient():
    """linear(linear(x, w1), w2) with w1 in host memory, split on the middle axis: the
    backward computes dX in the loop (w1 streamed by slices), ahead of dW2 (which reads
    nothing from host memory)."""
    with cg.Fusion("chain") as f:
        x, w1 = cg.input(["m", "k"], name="x"), cg.input(["i", "k"], name="w1", device="cpu")
        w2 = cg.input(["n", "i"], name="w2")
        t = cg.linear(x, w1)
        cg.output(cg.linear(t, w2))
    t.outer_split(1, 2)
    t.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(f)
    backward = cg.lower(autograd.derive(program.source, (True, True, True)).backward)
    sums = [n for n in backward.nodes() if isinstance(n, hir.Compute) and n.accumulate]
    assert [n.expr.args[1] for n in sums] == ["w1_s"]
    torch.manual_seed(0)
    x, w1, w2 = ints(5, 3), ints(4, 3), ints(6, 4)
    dy, t = ints(5, 6), x @ w1.t()
    inputs = [x, w1, w2, t, dy]  # the forward's inputs, the saved t, the output's gradient
    races.check(backward, inputs)
    gx, gw1, gw2 = cg.evaluate(backward, inputs)
    dt = dy @ w2
    assert torch.equal(gx, dt @ w1) and torch.equal(gw1, dt.t() @ x)
    assert torch.equal(gw2, dy.t() @ t)
