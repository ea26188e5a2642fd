"""Host-resident inputs and outputs (issue 10): the definition, the staged host IR, and
the evaluator's per-slice copies on the CPU (exact against torch on integer values)."""

import pytest
import torch
from conftest import ints
from helpers import stream_loops

import codegen as cg
from codegen import examples as ex
from codegen import hostir as hir
from codegen.errors import InternalError
from codegen.evaluator import program_device
from codegen.ir import Const, Sym

Stream = cg.ParallelType.Stream

STREAM_WEIGHTS_8 = """\
HostProgram stream_weights(T0: float32[m, k], T1: float32[k, n] device=cpu) -> (T2):
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[m, n])
  T1_stage = Allocate(float32[4, k, ceilDiv(n, 8)])
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 8) [Stream]:
    SetCurrentStream(Stream(i % 4))
    T1_i = ShardByStream(T1, axis=1, index=i, chunk=ceilDiv(n, 8))
    T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i)
    Copy(T1_i, out=T1_s)
    T2_i = ShardByStream(T2, axis=1, index=i, chunk=ceilDiv(n, 8))
    Matmul(T0, T1_s, out=T2_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(T1_stage)
  return T2"""

OFFLOAD_ACTIVATIONS_3 = """\
HostProgram offload_activations(T0: float32[m, k] device=cpu, T1: float32[k, n]) -> (T2):
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[m, n], device=cpu, pinned=True)
  T0_stage = Allocate(float32[3, ceilDiv(m, 3), k])
  T2_stage = Allocate(float32[3, ceilDiv(m, 3), n])
  for j in range(0, 3):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 3) [Stream]:
    SetCurrentStream(Stream(i))
    T0_i = ShardByStream(T0, axis=0, index=i, chunk=ceilDiv(m, 3))
    T0_s = StagingSlot(T0_stage, slot=i, like=T0_i)
    Copy(T0_i, out=T0_s)
    T2_i = ShardByStream(T2, axis=0, index=i, chunk=ceilDiv(m, 3))
    T2_s = StagingSlot(T2_stage, slot=i, like=T2_i)
    Matmul(T0_s, T1, out=T2_s)
    Copy(T2_s, out=T2_i)
  SetCurrentStream(main_stream)
  for j in range(0, 3):
    Synchronize(Stream(j))
  Deallocate(T2_stage)
  Deallocate(T0_stage)
  StreamSynchronize(main_stream)
  return T2"""

# (example, shapes of x and w): ragged in the split dimension, 13 = 8 + 5.
EXAMPLES = {
    "stream_weights": (ex.stream_weights, ((5, 7), (7, 13))),
    "offload_activations": (ex.offload_activations, ((13, 7), (7, 5))),
}


def kinds(nodes):
    return [type(n).__name__ for n in nodes]


def record_copies(monkeypatch):
    """Records (source device, destination device, shape) of every Tensor.copy_."""
    calls = []
    real = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        calls.append((src.device.type, self.device.type, list(src.shape)))
        return real(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    return calls


# ---------------------------------------------------------------------------- definition


@pytest.mark.parametrize("device", ["tpu", "cuda:0", "CPU", "", None, torch.device("cpu")])
def test_input_device_must_be_cuda_or_cpu(device):
    with cg.Fusion("bad"), pytest.raises(cg.ScheduleError, match=r"input w: device must be"):
        cg.input(["k", "n"], name="w", device=device)


def test_cuda_index_gets_a_hint():
    with cg.Fusion("bad"), pytest.raises(cg.ScheduleError, match='the inputs are on at run'):
        cg.input(["k", "n"], name="w", device="cuda:1")


def test_output_device_must_be_cuda_or_cpu():
    with cg.Fusion("bad"):
        out = cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"]))
        with pytest.raises(cg.ScheduleError, match=r"output T2: device must be .*'host'"):
            cg.output(out, device="host")
        assert out.device == "cuda"


def test_fusion_prints_residency_of_host_tensors_only():
    text = str(ex.offload_activations(torch.float32, 4))
    assert "input T0: float32[i{m}, i{k}] device=cpu\n" in text
    assert "input T1: float32[i{k}, i{n}]\n" in text
    assert "# T2: float32[i{m}, i{n}, r{k}] loop [iStream{4}, i{ceilDiv(m, 4)}, i{n}, r{k}] " \
           "device=cpu" in text


def test_input_infos_carry_the_device():
    program = cg.lower(ex.stream_weights(torch.float32, 8))
    assert [(t.name, t.device) for t in program.inputs] == [("T0", "cuda"), ("T1", "cpu")]


# ---------------------------------------------------------------------------- host IR


def test_print_stream_weights():
    assert str(cg.lower(ex.stream_weights(torch.float32, 8))) == STREAM_WEIGHTS_8


def test_print_offload_activations():
    assert str(cg.lower(ex.offload_activations(torch.float32, 3))) == OFFLOAD_ACTIVATIONS_3


@pytest.mark.parametrize("slices, slots", [(1, 1), (2, 2), (3, 3), (4, 4), (8, 4), (16, 4)])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_one_staging_slot_per_worker_stream(name, slices, slots):
    make, _ = EXAMPLES[name]
    program = cg.lower(make(torch.float32, slices), pool_size=4)
    (loop,) = stream_loops(program)
    assert kinds(loop.body).count("Copy") == (1 if name == "stream_weights" else 2)
    (stream,) = [n.stream for n in loop.body if isinstance(n, hir.SetCurrentStream)]
    staged = [n for n in loop.body if isinstance(n, hir.StagingSlot)]
    assert staged and all(s.slot == stream for s in staged)  # slot = stream index
    allocs = program.allocations()
    for s in staged:
        assert allocs[s.stage].shape[0] == Const(slots)
        assert allocs[s.stage].device == "cuda"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_streamed_operands_are_never_whole_on_the_gpu(name):
    make, _ = EXAMPLES[name]
    program = cg.lower(make(torch.float32, 8))
    host = {t.name: t.shape for t in program.inputs if t.device == "cpu"}
    host |= {t.name: t.shape for t in program.allocations().values() if t.device == "cpu"}
    assert host
    for t in program.allocations().values():
        if t.device == "cuda":
            assert t.shape not in host.values(), f"{t.name} is a whole host operand"
            assert t.name.endswith("_stage") or t.name == "T2"
    whole_copies = [n for n in program.nodes() if isinstance(n, hir.Copy) and n.src in host]
    assert not whole_copies


def test_staging_slot_follows_pool_size():
    program = cg.lower(ex.stream_weights(torch.float32, 8), pool_size=2)
    (loop,) = stream_loops(program)
    assert str(loop.body[0]) == "SetCurrentStream(Stream(i % 2))"
    assert str(loop.body[2]) == "T1_s = StagingSlot(T1_stage, slot=i % 2, like=T1_i)"
    assert program.allocations()["T1_stage"].shape[0] == Const(2)


def test_symbolic_slice_count_gives_min_slots():
    with cg.Fusion("sym") as fusion:
        out = cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"], device="cpu"))
        cg.output(out)
    out.split(1, 8)  # ceilDiv(n, 8) slices of 8 columns
    out.axis(1).parallelize(Stream)
    program = cg.lower(fusion)
    assert "T1_stage = Allocate(float32[min(ceilDiv(n, 8), 4), k, 8])" in str(program)
    w = ints(7, 20)
    x = ints(3, 7)
    assert torch.equal(cg.evaluate(program, [x, w])[0], x @ w)


def test_verify_rejects_a_slot_of_another_stream():
    program = cg.lower(ex.stream_weights(torch.float32, 8))
    (loop,) = stream_loops(program)
    slot = next(n for n in loop.body if isinstance(n, hir.StagingSlot))
    slot.slot = hir.Stream("i", 2)
    with pytest.raises(InternalError, match="slot differs from the loop's stream Stream"):
        hir.verify(program)


def test_verify_rejects_a_staging_slot_outside_a_loop():
    info = hir.TensorInfo("S", torch.float32, (Const(2), Sym("k")))
    program = hir.HostProgram("p", [hir.TensorInfo("T0", torch.float32, (Sym("k"),))], ["S"], [
        hir.Allocate(info), hir.StagingSlot("T0_s", "S", hir.Stream("i"), "T0")])
    with pytest.raises(InternalError, match="staging slot outside a loop"):
        hir.verify(program)


def host_reads_whole():
    """x and w both in host memory; columns on streams: w is streamed, x read whole."""
    with cg.Fusion("whole_x") as fusion:
        x = cg.input(["m", "k"], device="cpu")
        w = cg.input(["k", "n"], device="cpu")
        out = cg.matmul(x, w)
        cg.output(out)
    out.outer_split(1, 3)
    out.axis(1).parallelize(Stream)
    return fusion


def test_host_operand_read_whole_is_copied_once_before_the_loop(monkeypatch):
    program = cg.lower(host_reads_whole())
    body = program.body
    (loop,) = stream_loops(program)
    top = [str(n) for n in body]
    assert top.index("Copy(T0, out=T0_dev)") < body.index(loop)
    assert "T0_dev = Allocate(float32[m, k])" in top and "Deallocate(T0_dev)" in top
    assert "Matmul(T0_dev, T1_s, out=T2_i)" in [str(n) for n in loop.body]
    x, w = ints(4, 6), ints(6, 8)
    calls = record_copies(monkeypatch)
    (out,) = cg.evaluate(program, [x, w])  # on the GPU where there is one
    assert torch.equal(out.cpu(), x @ w)
    assert [c[2] for c in calls] == [[4, 6], [6, 3], [6, 3], [6, 2]]


def test_host_output_read_by_a_later_loop_is_whole_on_the_gpu():
    """t1 = x @ w1 by columns (a host output that t2 also reads, by rows): it is
    computed into a GPU tensor and copied to the host once."""
    with cg.Fusion("two_loops") as fusion:
        x = cg.input(["m", "k"])
        w1 = cg.input(["k", "n"], device="cpu")
        w2 = cg.input(["n", "p"], device="cpu")
        t1 = cg.matmul(x, w1)
        t2 = cg.matmul(t1, w2)
        cg.output(t1, device="cpu")
        cg.output(t2)
    t1.outer_split(1, 3)
    t1.axis(1).parallelize(Stream)
    t2.outer_split(0, 2)
    t2.axis(0).parallelize(Stream)
    program = cg.lower(fusion)
    top = [str(n) for n in program.body]
    assert "T3_dev = Allocate(float32[m, n])" in top
    assert "T3 = Allocate(float32[m, n], device=cpu, pinned=True)" in top
    first, second = stream_loops(program)
    assert top.index("Copy(T3_dev, out=T3)") > program.body.index(first)
    assert top.index("Copy(T2, out=T2_dev)") < program.body.index(second)  # w2 read whole
    assert top[-1] == "StreamSynchronize(main_stream)"
    xs = [ints(10, 4), ints(4, 5), ints(5, 6)]
    t1_out, t2_out = cg.evaluate(program, xs)
    assert torch.equal(t1_out, xs[0] @ xs[1]) and torch.equal(t2_out, xs[0] @ xs[1] @ xs[2])


def test_inlined_consumer_reads_the_host_output_slot():
    """Rows of t1 and t2 in one loop: t2's slice reads t1's staging slot."""
    with cg.Fusion("inlined") as fusion:
        x = cg.input(["m", "k"], device="cpu")
        w1 = cg.input(["k", "n"])
        w2 = cg.input(["n", "p"])
        t1 = cg.matmul(x, w1)
        t2 = cg.matmul(t1, w2)
        cg.output(t1, device="cpu")
        cg.output(t2, device="cpu")
    t2.outer_split(0, 3)
    t2.axis(0).parallelize(Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    assert [str(n) for n in loop.body if isinstance(n, (hir.Matmul, hir.Copy))] == [
        "Copy(T0_i, out=T0_s)",
        "Matmul(T0_s, T1, out=T3_s)",
        "Copy(T3_s, out=T3_i)",
        "Matmul(T3_s, T2, out=T4_s)",
        "Copy(T4_s, out=T4_i)",
    ]
    xs = [ints(10, 4), ints(4, 5), ints(5, 6)]
    t1_out, t2_out = cg.evaluate(program, xs)
    assert torch.equal(t1_out, xs[0] @ xs[1]) and torch.equal(t2_out, xs[0] @ xs[1] @ xs[2])


def test_host_output_without_a_stream_loop():
    with cg.Fusion("no_loop") as fusion:
        out = cg.linear(cg.input(["m", "k"], device="cpu"), cg.input(["n", "k"]),
                        cg.input(["n"]))
        cg.output(out, device="cpu")
    program = cg.lower(fusion)
    assert [str(n) for n in program.body] == [
        "main_stream = GetCurrentStream()",
        "T3_dev = Allocate(float32[m, n])",
        "T3 = Allocate(float32[m, n], device=cpu, pinned=True)",
        "T0_dev = Allocate(float32[m, k])",
        "Copy(T0, out=T0_dev)",
        "Linear(T0_dev, T1, T2, out=T3_dev)",
        "Copy(T3_dev, out=T3)",
        "Deallocate(T3_dev)",
        "Deallocate(T0_dev)",
        "StreamSynchronize(main_stream)",
    ]
    x, w, b = ints(3, 4), ints(5, 4), ints(5)
    assert torch.equal(cg.evaluate(program, [x, w, b])[0], torch.nn.functional.linear(x, w, b))


def test_device_programs_are_unchanged():
    program = cg.lower(ex.matmul_rows(torch.float32, 4))
    assert not any(isinstance(n, (hir.Copy, hir.StagingSlot, hir.StreamSynchronize))
                   for n in program.nodes())


# ---------------------------------------------------------------------------- evaluator


@pytest.mark.parametrize("slices", [1, 2, 3, 8])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_evaluate_exact_with_one_copy_per_slice(monkeypatch, name, slices):
    make, (xs, ws) = EXAMPLES[name]
    program = cg.lower(make(torch.float32, slices), pool_size=4)
    x, w = ints(*xs), ints(*ws)
    calls = record_copies(monkeypatch)
    (out,) = cg.evaluate(program, [x, w])
    assert torch.equal(out, x @ w)
    assert out.device.type == "cpu" and out.shape == (xs[0], ws[1])
    chunk = -(-13 // slices)
    sizes = [min(chunk, 13 - i * chunk) for i in range(slices) if i * chunk < 13]
    sizes += [0] * (slices - len(sizes))  # empty slices when slices > 13 / chunk
    if name == "stream_weights":  # w [7, 13] in by column slices
        assert [c[2] for c in calls] == [[7, s] for s in sizes]
    else:  # x [13, 7] in, then out [13, 5] back, by row slices
        assert [c[2] for c in calls] == [shape for s in sizes for shape in ([s, 7], [s, 5])]


def test_evaluate_more_slices_than_rows():
    program = cg.lower(ex.offload_activations(torch.float32, 8))
    x, w = ints(5, 3), ints(3, 4)
    assert torch.equal(cg.evaluate(program, [x, w])[0], x @ w)


def test_evaluate_bf16_exact():
    program = cg.lower(ex.stream_weights(torch.bfloat16, 3))
    x, w = ints(6, 5, dtype=torch.bfloat16), ints(5, 11, dtype=torch.bfloat16)
    assert torch.equal(cg.evaluate(program, [x, w])[0], x @ w)


def test_evaluate_transposed_host_input():
    program = cg.lower(ex.stream_weights(torch.float32, 3))
    x, w = ints(6, 5), ints(11, 5).t()
    assert torch.equal(cg.evaluate(program, [x, w])[0], x @ w)


def test_all_inputs_in_host_memory_run_on_the_cpu_without_cuda():
    program = cg.lower(host_reads_whole())
    x, w = ints(4, 6), ints(6, 8)
    if not torch.cuda.is_available():
        assert program_device(program, [x, w]) == torch.device("cpu")
    assert torch.equal(cg.evaluate(program, [x, w])[0].cpu(), x @ w)


def test_program_device_is_the_first_cuda_input():
    program = cg.lower(ex.offload_activations(torch.float32, 2))
    meta = torch.empty(7, 5, device="meta")
    assert program_device(program, [ints(4, 7), meta]) == torch.device("meta")


def test_device_tensor_where_host_memory_was_declared():
    program = cg.lower(ex.stream_weights(torch.float32, 2))
    w = torch.empty(7, 13, device="meta")  # any non-CPU tensor: the check is the same
    with pytest.raises(ValueError, match=r'stream_weights: argument T1 was declared '
                                         r'device="cpu" .* but is on meta; pass a CPU tensor'):
        cg.evaluate(program, [ints(5, 7), w])


def test_host_input_checks_still_check_dtype_and_size():
    program = cg.lower(ex.stream_weights(torch.float32, 2))
    with pytest.raises(ValueError, match="argument T1 must be float32"):
        cg.evaluate(program, [ints(5, 7), ints(7, 13, dtype=torch.float64)])
    with pytest.raises(ValueError, match="argument T1 axis 0 must have size k = 7, got 6"):
        cg.evaluate(program, [ints(5, 7), ints(6, 13)])


def test_cuda_inputs_on_one_device_is_still_checked():
    with cg.Fusion("three") as fusion:
        x = cg.input(["m", "k"])
        h = cg.input(["k", "n"], device="cpu")
        w = cg.input(["n", "p"])
        out = cg.matmul(cg.matmul(x, h), w)
        cg.output(out)
    program = cg.lower(fusion)
    with pytest.raises(ValueError, match="argument T2 is on meta but T0 is on cpu"):
        cg.evaluate(program, [ints(2, 3), ints(3, 4), torch.empty(4, 5, device="meta")])
