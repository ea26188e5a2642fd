"""Host-resident inputs and outputs: the definition, the staged host IR, and
the evaluator's per-slice copies on the CPU (exact against torch on integer values)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ints
from helpers import stream_loops

import codegen as cg
from codegen import examples as ex
from codegen import hostir as hir
from codegen.errors import InternalError
from codegen.frontend.ir import Const, Sym
from codegen.interp.evaluator import program_device

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
    streams = [n.stream for n in loop.body if isinstance(n, hir.SetCurrentStream)]
    staged = [n for n in loop.body if isinstance(n, hir.StagingSlot)]
    if slots == 1:  # one slice: on the caller's stream, one slot
        assert staged and not streams and all(s.slot == hir.Stream("i") for s in staged)
    else:
        assert staged and all(s.slot == streams[0] for s in staged)  # slot = stream index
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


@pytest.mark.parametrize("layout", ["every other column", "expanded column"])
def test_evaluate_host_input_in_a_layout_cublas_cannot_read(layout):
    """The reference semantics for layouts a GEMM could not read in place (no stride 1):
    the evaluator copies them like any other. The compiled op's check for them is
    check_copyable (test_copy_plan.cpp, and test_copy_gpu runs the op on them)."""
    program = cg.lower(ex.stream_weights(torch.float32, 3))
    x = ints(6, 5)
    w = ints(5, 22)[:, ::2] if layout == "every other column" else ints(5, 1).expand(5, 11)
    row_major = w.stride(1) == 1 and w.stride(0) >= w.shape[1]
    column_major = w.stride(0) == 1 and w.stride(1) >= w.shape[0]
    assert not row_major and not column_major  # what gemm.h's check_matrix refuses
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


# ---------------------------------------------------------------------------- C++


TESTS = Path(__file__).resolve().parent


def cxx(source: Path, out: Path, *flags: str) -> Path:
    """Compiles ``source`` with the programs' flags and include path (torch, the CUDA
    toolkit, the runtime), warnings as errors; links nothing of torch's."""
    from codegen.backend.renderer import include_dir
    from codegen.jit import BuildError, toolchain

    try:
        tools = toolchain()
    except BuildError:
        pytest.skip("needs the CUDA toolkit's headers")
    if shutil.which(tools.cxx[0]) is None:
        pytest.skip("needs a C++ compiler")
    cmd = [*tools.cxx, *tools.cflags, "-Wall", "-Wextra", "-Werror", f"-I{include_dir()}",
           str(source), "-o", str(out), *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.build
def test_copy_plans_move_every_element_once(tmp_path):
    """copy.h's plan for slices of host tensors in many layouts (row/column-major,
    padded, batched, permuted or expanded batch, vectors; ragged and empty slices) into
    staging slots and back, emulated with memcpy: exact, nothing written outside the
    view, and one cudaMemcpy2DAsync for a column block of a row-major matrix."""
    binary = cxx(TESTS / "test_copy_plan.cpp", tmp_path / "copy_plan")
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok:"), run.stdout + run.stderr


def nvtx_logger(folder: Path) -> Path:
    """The NVTX injection library of the tests (tests/test_copy_nvtx_logger.cpp)."""
    return cxx(TESTS / "test_copy_nvtx_logger.cpp", folder / "libnvtx_logger.so", "-shared",
               "-fPIC")


NVTX_PROGRAM = """
#include "codegen/nvtx.h"
int main() {
  { const codegen_rt::Range r("prog", "Copy(T0, out=T0_dev)"); }
  for (int i = 0; i < 2; ++i) {
    const codegen_rt::Range r("prog", "i", i, "Matmul(T0, T1_i, out=T2_i)");
  }
}
"""


@pytest.mark.build
def test_nvtx_ranges_are_named_for_hir_lines_when_a_tool_is_attached(tmp_path):
    source = tmp_path / "ranges.cpp"
    source.write_text(NVTX_PROGRAM)
    binary = cxx(source, tmp_path / "ranges")
    log = tmp_path / "nvtx.log"
    env = {**os.environ, "NVTX_INJECTION64_PATH": str(nvtx_logger(tmp_path)),
           "CODEGEN_NVTX_LOG": str(log)}
    assert subprocess.run([str(binary)], env=env, timeout=600).returncode == 0
    assert log.read_text().splitlines() == [
        "push prog: Copy(T0, out=T0_dev)", "pop",
        "push prog: i=0 Matmul(T0, T1_i, out=T2_i)", "pop",
        "push prog: i=1 Matmul(T0, T1_i, out=T2_i)", "pop"]
    without = subprocess.run([str(binary)], timeout=600)  # no tool: ranges do nothing
    assert without.returncode == 0


# ---------------------------------------------------------------------------- render


def cpp_of(fusion, **lower_args):
    program = cg.lower(fusion, **lower_args)
    return program, cg.render(program)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_hir_line_of_a_copy_program_is_in_the_cpp(name):
    make, _ = EXAMPLES[name]
    program, source = cpp_of(make(torch.float32, 8))
    for node in program.nodes():
        assert f"// hir: {node}" in source


def test_stream_weights_cpp():
    _, source = cpp_of(ex.stream_weights(torch.float32, 8))
    lines = [line.strip() for line in source.splitlines()]
    assert ('const rt::Buffer T0 = rt::input(T0_arg, op, "T0", rt::DType::Float32, 2, '
            '"float32[m, k]");') in lines
    assert "const int32_t device = T0.device;" in lines  # the GPU input's device
    assert ('const rt::HostBuffer T1 = rt::host_input(T1_arg, op, "T1", rt::DType::Float32, '
            '2, "float32[k, n]", device);') in lines
    assert "host_tensors.keep(T1);" in lines
    assert not any("rt::same_device" in line for line in lines)  # one GPU input
    assert ("rt::Staging T1_stage = streams.keep(rt::staging({4, k, rt::ceil_div(n, 8)}, "
            "rt::DType::Float32, device, op));  // one slot per worker stream") in lines
    assert "const rt::View T1_s = rt::slot(T1_stage, i % 4, T1_i);" in lines
    assert 'const rt::Range range(op, "i", i, "Copy(T1_i, out=T1_s)");' in lines
    assert "rt::copy(T1_s, T1_i, cudaMemcpyHostToDevice, streams.current(), op);" in lines
    assert 'const rt::Range range(op, "i", i, "Matmul(T0, T1_s, out=T2_i)");' in lines
    assert "rt::synchronize" not in source  # GPU output: no host wait
    # cuBLAS reads T0 in place, so its layout must suit cuBLAS; T1 is read through its
    # copies, slices of ceil(n / 8) columns, so their layout must suit those copies.
    assert 'rt::check_matrix(T0, op, "T0");' in lines
    assert 'rt::check_copyable(T1, op, "T1", /*axis=*/1, rt::ceil_div(n, 8));' in lines
    assert not any("check_matrix(T1" in line for line in lines)
    # The pinned inputs are kept by an object declared before the call's streams (so it
    # is destroyed after they joined the caller's stream).
    assert source.index("rt::HostTensors host_tensors") < source.index("rt::Streams streams")


def test_host_input_read_whole_is_checked_whole_and_a_sliced_one_by_its_slices():
    _, source = cpp_of(host_reads_whole())
    lines = [line.strip() for line in source.splitlines()]
    checks = [line for line in lines if line.startswith("rt::check_")]
    assert checks == ['rt::check_copyable(T0, op, "T0");',
                      'rt::check_copyable(T1, op, "T1", /*axis=*/1, rt::ceil_div(n, 3));']
    # Before anything is queued: the checks come before the streams exist.
    assert source.index("rt::check_copyable(T1") < source.index("rt::Streams streams")


def test_offload_activations_cpp():
    _, source = cpp_of(ex.offload_activations(torch.float32, 8))
    lines = [line.strip() for line in source.splitlines()]
    assert "rt::Buffer T2 = rt::empty_pinned({m, n}, rt::DType::Float32, device, op);" in lines
    assert "host_tensors.keep(T2);" in lines
    assert "rt::copy(T0_s, T0_i, cudaMemcpyHostToDevice, streams.current(), op);" in lines
    assert "rt::copy(T2_i, T2_s, cudaMemcpyDeviceToHost, streams.current(), op);" in lines
    assert "rt::synchronize(main_stream, op);  // host outputs are complete when the op " \
           "returns" in lines
    assert 'const rt::Range range(op, "StreamSynchronize(main_stream)");' in lines


def test_host_outputs_refuse_capture_before_anything_is_queued():
    """The host output of the second loop is allocated after the first loop's GEMMs;
    under graph capture the op must refuse before those GEMMs are captured."""
    with cg.Fusion("late_host_output") as fusion:
        x = cg.input(["m", "k"])
        t1 = cg.matmul(x, cg.input(["k", "n"]))
        t2 = cg.matmul(t1, cg.input(["n", "p"]))
        cg.output(t2, device="cpu")
    t1.outer_split(1, 3)
    t1.axis(1).parallelize(Stream)
    t2.outer_split(0, 2)
    t2.axis(0).parallelize(Stream)
    _, source = cpp_of(fusion)
    refusal = source.index("rt::refuse_capture_of_host_outputs(device, op);")
    assert refusal < source.index("rt::Streams streams") < source.index("gemms.matmul")
    _, gpu_only = cpp_of(ex.stream_weights(torch.float32, 8))
    assert "refuse_capture_of_host_outputs" not in gpu_only


def test_all_host_inputs_run_on_the_current_device_in_cpp():
    _, source = cpp_of(host_reads_whole())
    assert "const int32_t device = torch::stable::accelerator::getCurrentDeviceIndex();" in source
    # x is read whole: its GPU copy takes its memory order (memcpy cannot transpose).
    assert ("rt::Buffer T0_dev = streams.keep(rt::empty_like(T0, rt::DType::Float32, device, "
            "op));  // in T0's memory order") in source
    assert 'const rt::Range range(op, "Copy(T0, out=T0_dev)");' in source


def test_a_pageable_host_allocation_has_no_cpp():
    program = cg.lower(ex.offload_activations(torch.float32, 2))
    alloc = next(n for n in program.nodes() if isinstance(n, hir.Allocate) and n.pinned)
    alloc.pinned = False
    with pytest.raises(InternalError, match="host allocations are pinned"):
        cg.render(program)


def test_a_copy_between_two_gpu_tensors_has_no_cpp():
    program = cg.lower(host_reads_whole())
    copy = next(n for n in program.nodes() if isinstance(n, hir.Copy))
    copy.src = "T0_dev"
    with pytest.raises(InternalError, match="a copy from cuda to cuda has no C"):
        cg.render(program)


# ---------------------------------------------------------------------------- build


def matmul_without_a_loop():
    """No stream axis: the host weight is copied whole (on the caller's stream, no
    GetCurrentStream in the program), then one GEMM."""
    with cg.Fusion("no_loop_host") as fusion:
        cg.output(cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"], device="cpu")))
    return fusion


def batched_host_operand():
    """3-D: a host batch streamed in and the output streamed back (rank-4 staging)."""
    with cg.Fusion("batched_host") as fusion:
        a = cg.input(["b", "m", "k"], device="cpu")
        w = cg.input(["b", "k", "n"])
        out = cg.matmul(a, w)
        cg.output(out, device="cpu")
    out.outer_split(0, 3)
    out.axis(0).parallelize(Stream)
    return fusion


@pytest.mark.parametrize("make", [matmul_without_a_loop, host_reads_whole, batched_host_operand])
@pytest.mark.build
def test_host_programs_build(cache_dir, make):
    op = cg.compile(make())
    assert op.library.is_file()
    if make is batched_host_operand:
        assert ("rt::Staging T0_stage = streams.keep(rt::staging({3, rt::ceil_div(b, 3), m, "
                "k}") in op.source


# ---------------------------------------------------------------------------- timeline


def test_planned_hidden_fraction():
    from codegen.tools.timeline import planned_hidden

    # copy ~ GEMM: all but the first slice's copy hide
    assert planned_hidden({"HtoD": 800.0}, 800.0, 8, 4) == pytest.approx(7 / 8)
    # copies twice the GEMMs: each later copy hides for one GEMM slice only
    assert planned_hidden({"HtoD": 1600.0}, 800.0, 8, 4) == pytest.approx(7 / 8 / 2)
    # GEMMs dominate: still the first copy stands alone
    assert planned_hidden({"HtoD": 100.0}, 800.0, 4, 4) == pytest.approx(3 / 4)
    # in and out: the first copy in and the last copy out stand alone
    assert planned_hidden({"HtoD": 400.0, "DtoH": 400.0}, 800.0, 4, 4) == pytest.approx(3 / 4)
    assert planned_hidden({"HtoD": 800.0}, 800.0, 1, 1) == 0.0
    assert planned_hidden({"HtoD": 800.0}, 800.0, 8, 1) == 0.0  # one stream: serial


def test_measured_overlap_from_events():
    from codegen.tools.timeline import KernelEvent, measure_overlap, overlap_report

    events = [  # copy 0 alone, copy 1 under GEMM 0 (half of it), copy out 0 under GEMM 1
        KernelEvent("Memcpy HtoD (Pinned -> Device)", 7, 0.0, 100.0, "HtoD", 1000),
        KernelEvent("nvjet_gemm", 7, 100.0, 100.0),
        KernelEvent("Memcpy HtoD (Pinned -> Device)", 11, 100.0, 200.0, "HtoD", 1000),
        KernelEvent("nvjet_gemm", 11, 300.0, 100.0),
        KernelEvent("Memcpy DtoH (Device -> Pinned)", 7, 310.0, 50.0, "DtoH", 500),
        KernelEvent("Memset (Device)", 7, 120.0, 500.0, "memset"),  # not a GEMM
    ]
    o = measure_overlap(events)
    assert o.copy_us == 350.0 and o.hidden_us == 150.0 and o.gemm_us == 200.0
    assert o.measured == pytest.approx(150 / 350)
    assert o.copies == {"HtoD": (2, 2000, 300.0), "DtoH": (1, 500, 50.0)}
    text = overlap_report(events, slices=2, streams=2)
    assert "HtoD: 2 copies" in text and "GEMM kernels: 2, 0.200 ms busy" in text
    assert "measured 42.9 %, planned" in text
    assert overlap_report([KernelEvent("gemm", 1, 0.0, 1.0)], 2, 2) == \
        "no host copies or collectives in this program"


def test_measured_overlap_of_collectives():
    from codegen.tools.timeline import KernelEvent, _kernel_kind, measure_overlap, overlap_report

    assert _kernel_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == "collective"
    assert _kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "kernel"
    # all-gather + GEMM, 3 slices on 2 streams: gather 0 alone, gathers 1 and 2 under the
    # GEMMs of slices 0 and 1 (40 of their 50 us each).
    ag, gemm = "ncclDevKernel_AllGather_RING_LL", "nvjet_gemm"
    events = [
        KernelEvent(ag, 3, 0.0, 50.0, "collective"),
        KernelEvent(gemm, 3, 50.0, 100.0),
        KernelEvent(ag, 5, 60.0, 50.0, "collective"),
        KernelEvent(gemm, 5, 150.0, 100.0),
        KernelEvent(ag, 3, 160.0, 50.0, "collective"),
        KernelEvent(gemm, 3, 250.0, 100.0),
    ]
    o = measure_overlap(events)
    assert o.gemms == 3 and o.copies == {"collective": (3, 0, 150.0)}
    assert o.hidden_us == 100.0 and o.measured == pytest.approx(100 / 150)
    text = overlap_report(events, slices=3, streams=2)
    assert "collectives: 3 kernels, 0.150 ms busy" in text
    # planned: (S - 1) * min(C / S, G / S) / C = 2 * 50 / 150
    assert "collective time hidden under GEMMs: measured 66.7 %, planned 66.7 %" in text


def test_collectives_are_marked_with_nvtx_ranges_named_for_their_lines():
    import codegen as cg
    from codegen import examples

    source = cg.render(cg.lower(examples.allgather_matmul(torch.float32, 4, 2)))
    assert ('const rt::Range range(op, "i", i, "comm_i = Communication(AllGather, '
            'input=x_i, output=x_gathered_i, team=(0, 1), group=pg)");') in source
    assert 'const rt::Range range(op, "i", i, "Wait(comm_i)");' in source
    source = cg.render(cg.lower(examples.matmul_reduce_scatter(torch.float32, 4, 2)))
    assert source.count("const rt::Range range(") == 3 * source.count("hir: Matmul(")


def test_timeline_slices_and_streams():
    from codegen.tools.timeline import _slices_and_streams

    program = cg.lower(ex.stream_weights(torch.bfloat16, 8))
    assert _slices_and_streams(program, [(64, 32), (32, 100)]) == (8, 4)
    program = cg.lower(matmul_without_a_loop())
    assert _slices_and_streams(program, [(4, 4), (4, 4)]) == (1, 1)


def test_bench_copy_table_and_ratios():
    from benchmarks import bench_copy
    from benchmarks.common import median_ratio

    assert median_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    row = {"shape": "balanced", "m": 13312, "slices": 8, "copy_ms": 2.4, "gemm_ms": 2.3,
           "op_ms": 2.8, "op_ratio": 1.17, "floor_ratio": 1.125, "op_floor_ratio": 1.04,
           "op_cs_floor_ratio": 1.01, "op_sk_floor_ratio": 1.02, "op_auto_floor_ratio": 1.03,
           "auto_loop": "rows", "op_col_ratio": 1.15, "op_col_floor_ratio": 1.022,
           "op_col_cs_floor_ratio": 1.011, "python_ratio": 1.2, "copy_then_gemm_ratio": 1.96,
           "op_host_us": 120.0}
    text = bench_copy.table([row])
    assert "balanced  13312   8" in text
    # op, floor, op/floor, copy stream, split contraction, auto (rows), w^T, its / floor
    # without and with the copy stream
    assert ("1.170  1.125    1.040    1.010    1.020  1.030   r    1.150     1.022   1.011"
            in text)


WARN_PROBE = """
#include "codegen/runtime.h"

namespace {
void NAME(torch::stable::Tensor) { codegen_rt::warn_pageable_once("NAME", "T1"); }
}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(codegen, m) { m.def("NAME(Tensor x) -> ()"); }
STABLE_TORCH_LIBRARY_IMPL(codegen, CPU, m) { m.impl("NAME", TORCH_BOX(&NAME)); }
"""

WARN_ONCE = """
import warnings, torch
from codegen.jit import build_library
import sys
for name in ("warn_probe_a", "warn_probe_b"):
    build_library(name, sys.argv[1].replace("NAME", name))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        torch.ops.codegen.warn_probe_a(torch.ones(1))
        torch.ops.codegen.warn_probe_b(torch.ones(1))
print("CAUGHT", [(c.category.__name__, str(c.message).splitlines()[0]) for c in caught])
"""


@pytest.mark.build
def test_pageable_warning_is_printed_once_per_process(cache_dir):
    """rt::warn_pageable_once (host.h) from two separately built libraries, twice each:
    one warning (the flag is one symbol for the whole process, though each library hides
    the rest of the runtime). It goes through TORCH_WARN's C entry point, which torch.ops
    calls print on stderr: no Python warning (checked here, so a change shows)."""
    import sys

    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "CODEGEN_CACHE_DIR": str(cache_dir)}
    run = subprocess.run([sys.executable, "-c", WARN_ONCE, WARN_PROBE], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "CAUGHT []" in run.stdout, run.stdout
    assert run.stderr.count("is in pageable host memory") == 1, run.stderr
    assert ("Warning: warn_probe_a: argument T1 is in pageable host memory, so its copies to "
            "the GPU cannot overlap the GEMMs (the results are right). Pass T1.pin_memory() "
            "to overlap them. (codegen warns once per process.)") in run.stderr, run.stderr


@pytest.mark.build
def test_fake_impl_puts_outputs_where_the_op_does(cache_dir):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with cg.Fusion("host_in_gpu_out") as f:  # the first input is in host memory
        x = cg.input(["m", "k"], torch.float32, device="cpu")
        w = cg.input(["k", "n"], torch.float32)
        out = cg.matmul(x, w)
        cg.output(out)
    out.outer_split(0, 2)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    op = cg.compile(f)
    with FakeTensorMode():
        out = op(torch.empty(6, 4), torch.empty(4, 3, device="cuda"))
    assert out.shape == (6, 3) and out.device.type == "cuda"  # not x's device
    out = op(torch.empty(6, 4), torch.empty(4, 3, device="meta"))
    assert out.shape == (6, 3) and out.device.type == "meta"
