"""``copy_stream=True`` (hostir.queue_copies_in): host-to-device copies of host inputs read
in slices go on one copy stream, in slice order, each waiting for the event its slot's
last reader recorded, and each slice's GEMM waits for its copy; the copy stream is forked
once and joined once, so across loops it runs ahead (hostir.hoist_staging). Structure,
order (codegen.interp.races), values (the evaluator, exact on the CPU) and the C++; the GPU tests
are in test_copy_gpu.py (its graph-capture test runs with a copy stream too)."""

import dataclasses

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples as ex
from codegen import hostir as hir
from codegen.interp import races

STREAM_WEIGHTS_8 = """\
HostProgram stream_weights(T0: float32[m, k], T1: float32[k, n] device=cpu) -> (T2) [copy_stream]:
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[m, n])
  T1_stage = Allocate(float32[4, k, ceilDiv(n, 8)])
  T1_stage_free = CreateEvents(4)
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  SetCurrentStream(CopyStream)
  Synchronize(main_stream)
  for i in range(0, 8) [Stream]:
    SetCurrentStream(CopyStream)
    WaitEvent(T1_stage_free[i % 4])
    T1_i = ShardByStream(T1, axis=1, index=i, chunk=ceilDiv(n, 8))
    T1_s = StagingSlot(T1_stage, slot=i % 4, like=T1_i)
    Copy(T1_i, out=T1_s)
    SetCurrentStream(Stream(i % 4))
    Synchronize(CopyStream)
    T2_i = ShardByStream(T2, axis=1, index=i, chunk=ceilDiv(n, 8))
    Matmul(T0, T1_s, out=T2_i)
    RecordEvent(T1_stage_free[i % 4])
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Synchronize(CopyStream)
  Deallocate(T1_stage)
  return T2"""

# A slot per slice (3 slices, pool 4): no slot is reused, so the copy stream waits for no
# worker; the copy out of each slice stays on its worker, after its GEMM.
OFFLOAD_ACTIVATIONS_3 = """\
  for i in range(0, 3) [Stream]:
    SetCurrentStream(CopyStream)
    T0_i = ShardByStream(T0, axis=0, index=i, chunk=ceilDiv(m, 3))
    T0_s = StagingSlot(T0_stage, slot=i, like=T0_i)
    Copy(T0_i, out=T0_s)
    SetCurrentStream(Stream(i))
    Synchronize(CopyStream)
    T2_i = ShardByStream(T2, axis=0, index=i, chunk=ceilDiv(m, 3))
    T2_s = StagingSlot(T2_stage, slot=i, like=T2_i)
    Matmul(T0_s, T1, out=T2_s)
    Copy(T2_s, out=T2_i)
  SetCurrentStream(main_stream)"""


def lower(make, slices, pool=4, dtype=torch.float32):
    return cg.lower(make(dtype, slices), pool_size=pool, copy_stream=True)


def test_print_stream_weights_with_a_copy_stream():
    assert str(lower(ex.stream_weights, 8)) == STREAM_WEIGHTS_8


def test_a_slot_per_slice_needs_no_wait_for_its_worker():
    text = str(lower(ex.offload_activations, 3))
    assert OFFLOAD_ACTIVATIONS_3 in text, text
    assert "Synchronize(Stream(i" not in text and "Event" not in text


def test_only_copies_of_slices_move_to_the_copy_stream():
    with cg.Fusion("both_on_host") as fusion:
        out = cg.matmul(cg.input(["m", "k"], device="cpu"), cg.input(["k", "n"], device="cpu"))
        cg.output(out)
    out.outer_split(0, 6)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion, pool_size=2, copy_stream=True)
    (loop,) = [n for n in program.body
               if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream]
    where, on = {}, None
    for n in loop.body:
        if isinstance(n, hir.SetCurrentStream):
            on = n.stream
        elif isinstance(n, (hir.Copy, hir.Matmul)):
            where[str(n)] = on
    copier, worker = hir.CopyStream(2), hir.Stream("i", 2)
    # T0 is sliced by rows (T0_i); T1 is read whole, so it is copied once before the loop.
    assert where == {"Copy(T0_i, out=T0_s)": copier, "Matmul(T0_s, T1_dev, out=T2_i)": worker}
    xs = [ints(13, 5), ints(5, 4)]
    races.check(program, xs)
    assert torch.equal(cg.evaluate(program, xs)[0], xs[0] @ xs[1])


@pytest.mark.parametrize("pool", [2, 3, 4])
@pytest.mark.parametrize("slices", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("make", [ex.stream_weights, ex.offload_activations])
def test_copy_stream_programs_are_ordered_and_exact(make, slices, pool):
    program = lower(make, slices, pool)
    x, w = ints(13, 7), ints(7, 11)
    races.check(program, [x, w])
    (out,) = cg.evaluate(program, [x, w])
    assert torch.equal(out, x @ w)


def rewrite_loop(program, fn):
    body = [dataclasses.replace(n, body=fn(n.body))
            if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream else n
            for n in program.body]
    return program.replace(body=body)


def _slot_event_wait(n):
    return isinstance(n, hir.WaitEvent)


def _slot_event_record(n):
    return isinstance(n, hir.RecordEvent)


def _copy_wait(n):
    return isinstance(n, hir.Synchronize) and isinstance(n.stream, hir.CopyStream)


@pytest.mark.parametrize("drop,kind,example", [
    # The copy into slot 0 for slice 4 would overwrite what slice 0's GEMM still reads.
    (_slot_event_wait, "write after read", "Copy(T1_i, out=T1_s) on CopyStream [i=4] is "
     "not ordered after Matmul(T0, T1_s, out=T2_i) on Stream(0) [i=0]"),
    # The same, with the event never recorded (a wait for an event not recorded waits
    # for nothing).
    (_slot_event_record, "write after read", "Copy(T1_i, out=T1_s) on CopyStream [i=4] is "
     "not ordered after Matmul(T0, T1_s, out=T2_i) on Stream(0) [i=0]"),
    # Slice 0's GEMM would read its slot while the copy still writes it.
    (_copy_wait, "read before write", "Matmul(T0, T1_s, out=T2_i) on Stream(0) [i=0] "
     "is not ordered after Copy(T1_i, out=T1_s) on CopyStream [i=0]"),
])
def test_each_wait_in_the_loop_is_needed(drop, kind, example):
    """Dropping the copy stream's wait for the event of the slot's last reader, that
    record, or the worker's wait for the copy, leaves exactly that hazard on the slots."""
    program = rewrite_loop(lower(ex.stream_weights, 8),
                           lambda body: [n for n in body if not drop(n)])
    found = races.find_races(program, [ints(9, 16), ints(16, 13)])
    assert {(r.kind, r.tensor) for r in found} == {(kind, "T1_stage")}
    assert any(example in str(r) for r in found), [str(r) for r in found]


@pytest.mark.parametrize("slices", [3, 8])
def test_the_copy_stream_must_be_joined_directly(slices):
    """Without its own join the copy stream is still ordered before the caller's stream
    (each copy is waited for by a worker that is joined), but the C++ runtime would join
    it only on exit and a CUDA graph capture must rejoin it: the checker names it."""
    program = lower(ex.stream_weights, slices)
    program = program.replace(body=[n for n in program.body if not (
        isinstance(n, hir.Synchronize) and isinstance(n.stream, hir.CopyStream))])
    found = races.find_races(program, [ints(9, 16), ints(16, 13)])
    assert [str(r) for r in found] == ["stream not joined: CopyStream got work, and "
                                       "main_stream never waits for it after its last work"]


@pytest.mark.parametrize("make,slices,pool", [
    (ex.stream_weights, 8, 1),  # pool_size=1: the caller's stream
    (ex.offload_activations, 1, 4),  # one slice: the caller's stream
    (ex.matmul_rows, None, 4),  # no host operand
])
def test_loops_on_the_callers_stream_and_gpu_programs_are_unchanged(make, slices, pool):
    def text(**args):
        fusion = make() if slices is None else make(torch.float32, slices)
        return str(cg.lower(fusion, pool_size=pool, **args))

    assert text(copy_stream=True) == text().replace(":\n", " [copy_stream]:\n", 1)


def test_copy_stream_must_be_a_bool():
    with pytest.raises(cg.ScheduleError, match="lower: copy_stream must be True or False, "
                                               "got 'yes'"):
        cg.lower(ex.stream_weights(torch.float32, 8), copy_stream="yes")


def test_copy_stream_cpp():
    program = lower(ex.stream_weights, 8)
    source = cg.render(program)
    for node in program.nodes():
        assert f"// hir: {node}" in source
    lines = [line.strip() for line in source.splitlines()]
    copier = "streams.copy_stream(4)"
    assert f"streams.set_current({copier});" in lines
    assert "rt::Events T1_stage_free = streams.events(4);" in lines
    assert "streams.wait(T1_stage_free, i % 4);  // nothing if not yet recorded in this call" \
        in lines  # the copy stream, for the slot's last reader
    assert "streams.record(T1_stage_free, i % 4);" in lines  # after that reader
    assert f"streams.wait({copier});" in lines  # the worker, for the copy
    loop = source[source.index("for (int64_t i = 0; i < 8; ++i) {"):]
    assert loop.index(f"streams.set_current({copier});") \
        < loop.index("rt::copy(T1_s, T1_i, cudaMemcpyHostToDevice, streams.current(), op);") \
        < loop.index("streams.set_current(streams.worker(i % 4));") \
        < loop.index(f"streams.wait({copier});") \
        < loop.index("gemms.matmul(T2_i, T0, T1_s, streams.current());")


@pytest.mark.parametrize("make", [ex.stream_weights, ex.offload_activations])
@pytest.mark.build
def test_copy_stream_op_builds(cache_dir, make):
    op = cg.compile(make(torch.bfloat16, 8), copy_stream=True)
    assert op.library.is_file()
    assert "[copy_stream]" in str(op.host_ir)
    assert "streams.wait(streams.copy_stream(4));" in op.source
