"""Tensor parallelism: sharding analysis, host-IR structure of the sliced collectives, and
the evaluator over torch.distributed (gloo, 2 and 4 processes on the CPU), exact against
torch on integer inputs."""

import dataclasses
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ints
from helpers import stream_loops

import codegen as cg
from codegen import distributed
from codegen.examples import allgather_matmul, matmul_reduce_scatter
from codegen.frontend.ir import Const

DIDx, Stream = cg.ParallelType.DIDx, cg.ParallelType.Stream
EXAMPLES = {"AllGather": allgather_matmul, "ReduceScatter": matmul_reduce_scatter}

AG_4_2 = """\
HostProgram allgather_matmul(x: float32[m_local, k], w: float32[k, n_local]) -> (T2):
  main_stream = GetCurrentStream()
  CheckDivisible(x, axis=0, by=4)
  T2 = Allocate(float32[2 * m_local, n_local])
  x_gathered = Allocate(float32[8, ceilDiv(m_local, 4), k])
  T2_blocks = Unflatten(T2, axis=0, sizes=(2, m_local))
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 4) [Stream]:
    SetCurrentStream(Stream(i))
    x_i = ShardByStream(x, axis=0, index=i, chunk=ceilDiv(m_local, 4))
    x_gathered_i = ShardByStream(x_gathered, axis=0, index=i, chunk=2)
    comm_i = Communication(AllGather, input=x_i, output=x_gathered_i, team=(0, 1), group=pg)
    Wait(comm_i)
    T2_blocks_i = ShardByStream(T2_blocks, axis=1, index=i, chunk=ceilDiv(m_local, 4))
    Matmul(x_gathered_i, w, out=T2_blocks_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(x_gathered)
  return T2"""

RS_4_2 = """\
HostProgram matmul_reduce_scatter(x: float32[m, k_local], w: float32[k_local, n]) -> (T2):
  main_stream = GetCurrentStream()
  CheckDivisible(x, axis=0, by=8)
  T2 = Allocate(float32[ceilDiv(m, 2), n])
  T2_partial = Allocate(float32[8, ceilDiv(m, 8), n])
  x_blocks = Unflatten(x, axis=0, sizes=(2, ceilDiv(m, 2)))
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 4) [Stream]:
    SetCurrentStream(Stream(i))
    x_blocks_i = ShardByStream(x_blocks, axis=1, index=i, chunk=ceilDiv(m, 8))
    T2_partial_i = ShardByStream(T2_partial, axis=0, index=i, chunk=2)
    Matmul(x_blocks_i, w, out=T2_partial_i)
    T2_i = ShardByStream(T2, axis=0, index=i, chunk=ceilDiv(m, 8))
    comm_i = Communication(ReduceScatter, input=T2_partial_i, output=T2_i, team=(0, 1), \
group=pg)
    Wait(comm_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Deallocate(T2_partial)
  return T2"""


def kinds(nodes):
    return [type(n).__name__ for n in nodes]


# ---------------------------------------------------------------------------- host IR


def test_print_allgather_matmul_and_the_module_docstring_shows_it():
    text = str(cg.lower(allgather_matmul(torch.float32, 4, 2)))
    assert text == AG_4_2
    assert "\n".join("    " + line for line in text.splitlines()) in distributed.__doc__


def test_print_matmul_reduce_scatter():
    assert str(cg.lower(matmul_reduce_scatter(torch.float32, 4, 2))) == RS_4_2


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("factor", [1, 2])  # S = D, 2D
def test_sliced_allgather_matmul_structure(world_size, factor):
    d, s = world_size, world_size * factor
    program = cg.lower(allgather_matmul(torch.bfloat16, s, d))
    (loop,) = stream_loops(program)
    assert loop.stop == Const(s)
    assert kinds(loop.body) == ["SetCurrentStream", "ShardByStream", "ShardByStream",
                                "Communication", "Wait", "ShardByStream", "Matmul"]
    stream = "Stream(i)" if s <= program.pool_size else f"Stream(i % {program.pool_size})"
    assert str(loop.body[0]) == f"SetCurrentStream({stream})"
    x_i, gathered_i, comm, wait, out_i, mm = loop.body[1:]
    assert (x_i.tensor, x_i.axis) == ("x", 0)
    assert (gathered_i.axis, gathered_i.chunk) == (0, Const(d))  # [D, chunk, k] of slice i
    assert comm.kind is distributed.CommunicationType.AllGather
    assert (comm.input, comm.output, comm.team) == (x_i.out, gathered_i.out, tuple(range(d)))
    assert wait.communication == comm.out
    assert out_i.axis == 1  # piece i of every rank's block of out rows: [D, chunk, n]
    assert (mm.a, mm.b, mm.out) == (gathered_i.out, "w", out_i.out)
    allocs = program.allocations()
    assert [str(e) for e in allocs["x_gathered"].shape] == [str(s * d), f"ceilDiv(m_local, {s})",
                                                            "k"]
    assert [str(e) for e in allocs["T2"].shape] == [f"{d} * m_local", "n_local"]
    (check,) = [n for n in program.body if isinstance(n, distributed.CheckDivisible)]
    assert (check.tensor, check.axis, check.divisor) == ("x", 0, s)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("factor", [1, 2])
def test_sliced_matmul_reduce_scatter_structure(world_size, factor):
    d, s = world_size, world_size * factor
    program = cg.lower(matmul_reduce_scatter(torch.float32, s, d))
    (loop,) = stream_loops(program)
    assert loop.stop == Const(s)
    assert kinds(loop.body) == ["SetCurrentStream", "ShardByStream", "ShardByStream", "Matmul",
                                "ShardByStream", "Communication", "Wait"]
    x_i, partial_i, mm, out_i, comm, wait = loop.body[1:]
    assert (x_i.tensor, x_i.axis) == ("x_blocks", 1)
    assert (mm.a, mm.b, mm.out) == (x_i.out, "w", partial_i.out)
    assert (out_i.tensor, out_i.axis) == ("T2", 0)
    assert comm.kind is distributed.CommunicationType.ReduceScatter
    assert (comm.input, comm.output) == (partial_i.out, out_i.out)
    assert wait.communication == comm.out
    (check,) = [n for n in program.body if isinstance(n, distributed.CheckDivisible)]
    assert (check.tensor, check.axis, check.divisor) == ("x", 0, d * s)
    assert [str(e) for e in program.allocations()["T2"].shape] == [f"ceilDiv(m, {d})", "n"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_one_slice_is_the_collective_and_one_gemm_on_the_callers_stream(kind, world_size):
    program = cg.lower(EXAMPLES[kind](torch.float32, 1, world_size))
    assert not stream_loops(program)
    top = [k for k in kinds(program.body) if k not in ("Allocate", "Deallocate",
                                                      "CheckDivisible")]
    if kind == "AllGather":
        assert top == ["Communication", "Wait", "Matmul"]
        assert [str(e) for e in program.allocations()["x_gathered"].shape] == [
            f"{world_size} * m_local", "k"]
    else:
        assert top == ["Matmul", "Communication", "Wait"]
    (comm,) = distributed.communications(program)
    assert comm.kind.value == kind and comm.team == tuple(range(world_size))
    assert "Synchronize" not in kinds(program.nodes())


def test_signatures_are_the_local_shards():
    ag = cg.lower(allgather_matmul(torch.float32, 2, 4))
    assert ag.signature() == ("HostProgram allgather_matmul(x: float32[m_local, k], "
                              "w: float32[k, n_local]) -> (T2):")
    rs = cg.lower(matmul_reduce_scatter(torch.float32, 2, 4, name="rs"))
    assert rs.signature() == ("HostProgram rs(x: float32[m, k_local], "
                              "w: float32[k_local, n]) -> (T2):")


def test_building_needs_no_process_group():
    assert not dist.is_initialized()
    cg.lower(allgather_matmul(torch.float32, 4, 8))  # world size 8 on a machine of 1 process


def test_schedule_shows_the_mesh_and_didx_axes():
    text = str(cg.schedule(allgather_matmul(torch.float32, 2, 2)))
    assert "x: float32[i{m}, i{k}] loop [iDIDx{2}, i{ceilDiv(m, 2)}, i{k}] on DeviceMesh(2)" in text


def test_fixed_sizes_are_divided_at_lower_time():
    fusion = _ag_fusion(m=8, k=3, n=4, d=2)
    program = cg.lower(fusion)
    assert program.signature() == "HostProgram ag(T0: float32[4, 3], T1: float32[3, 4]) -> (T2):"
    with pytest.raises(cg.ScheduleError, match="T0 axis 0 has the fixed size 9, which the "
                                               "world size 2 does not divide"):
        cg.lower(_ag_fusion(m=9, k=3, n=4, d=2))


def test_dump_prints_the_distributed_fusion(monkeypatch, capsys):
    monkeypatch.setenv("CODEGEN_DUMP", "ir,hostir")
    cg.lower(matmul_reduce_scatter(torch.float32, 2, 2))
    err = capsys.readouterr().err
    assert "=== ir (distributed) ===" in err and "iDIDx{2}" in err
    assert "Communication(ReduceScatter" in err and "hostir after insert_fork_join" in err


# ---------------------------------------------------------------------------- schedule errors


def _ag_fusion(m="m", k="k", n="n", d=2, mesh=True):
    """x rows sharded, out rows whole: an all-gather (no stream split)."""
    with cg.Fusion("ag") as fusion:
        x = cg.input([m, k])
        w = cg.input([k, n])
        out = cg.matmul(x, w)
        cg.output(out)
    if mesh:
        for t in (x, w, out):
            t.set_device_mesh(cg.DeviceMesh(d))
    x.outer_split(0, d)
    x.axis(0).parallelize(DIDx)
    return fusion


@pytest.mark.parametrize("args, match", [
    ((0, 2), "slices must be an int >= 1, got 0"),
    ((2, 0), "world_size must be an int >= 1, got 0"),
    ((2, True), "world_size must be an int >= 1, got True"),
    ((1.0, 2), "slices must be an int >= 1, got 1.0"),
])
@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_bad_example_arguments(kind, args, match):
    with pytest.raises(cg.ScheduleError, match=match):
        EXAMPLES[kind](torch.float32, *args)


def test_allgather_with_stream_slices_of_the_whole_axis_is_refused():
    fusion = _ag_fusion()
    out = fusion.outputs[0]
    out.outer_split(0, 2)
    out.axis(0).parallelize(Stream)  # slice i = rank i's whole block: a broadcast each
    with pytest.raises(cg.ScheduleError, match=r"T0 axis 0 is sharded over 2 ranks, but T2 axis "
                                               r"0 is cut into 2 stream slices of the whole "
                                               r"axis; a slice must take a piece of every"):
        cg.lower(fusion)


def test_didx_without_a_split():
    fusion = _ag_fusion()
    w = fusion.inputs[1]
    w.axis(0).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match=r"T1 axis 0 .*DIDx on an axis that is not "
                                               r"split; shard it with T1.outer_split\(0, 2\)"):
        cg.lower(fusion)


def test_didx_split_by_another_factor_than_the_mesh():
    fusion = _ag_fusion(d=2)
    fusion.outputs[0].outer_split(1, 3)
    fusion.outputs[0].axis(1).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match=r"DIDx on outer_split\(1, 3\) but the mesh has "
                                               "2 ranks"):
        cg.lower(fusion)


def test_didx_on_an_inner_split():
    fusion = _ag_fusion()
    w = fusion.inputs[1]
    w.split(1, 2)
    w.axis(1).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match=r"split\(1, 2\) is an inner split; use "
                                               "outer_split"):
        cg.lower(fusion)


def test_didx_without_a_mesh():
    with pytest.raises(cg.ScheduleError, match="T0 has a DIDx axis but no device mesh; call "
                                               r"T0.set_device_mesh\(cg.DeviceMesh"):
        cg.lower(_ag_fusion(mesh=False))


def test_two_meshes():
    fusion = _ag_fusion()
    fusion.inputs[1].set_device_mesh(cg.DeviceMesh(4))
    with pytest.raises(cg.ScheduleError, match="all tensors must be on one DeviceMesh, found "
                                               r"T0 on DeviceMesh\(2\), T1 on DeviceMesh\(4\)"):
        cg.lower(fusion)


@pytest.mark.parametrize("size", [0, -1, 2.0])
def test_bad_mesh(size):
    with pytest.raises(cg.ScheduleError, match="DeviceMesh: size must be an int >= 1"):
        cg.DeviceMesh(size)


def test_set_device_mesh_takes_a_mesh():
    with cg.Fusion("f"):
        x = cg.input(["m"])
    with pytest.raises(cg.ScheduleError, match="T0.set_device_mesh expects a cg.DeviceMesh"):
        x.set_device_mesh(2)


def _rs_fusion(shard_w=True, shard_out=True):
    """x and (by default) w sharded on k, out's rows sharded: a reduce-scatter."""
    with cg.Fusion("rs") as fusion:
        x, w = cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.matmul(x, w)
        cg.output(out)
    x.set_device_mesh(cg.DeviceMesh(2))
    x.outer_split(1, 2)
    x.axis(1).parallelize(DIDx)
    if shard_w:
        w.outer_split(0, 2)
        w.axis(0).parallelize(DIDx)
    if shard_out:
        out.outer_split(0, 2)
        out.axis(0).parallelize(DIDx)
    return fusion


def test_reduce_scatter_fusion_of_the_user():
    program = cg.lower(_rs_fusion())
    assert [type(c).__name__ for c in distributed.communications(program)] == ["Communication"]
    assert program.signature() == "HostProgram rs(T0: float32[m, k_local], " \
                                  "T1: float32[k_local, n]) -> (T2):"


def test_reduction_axis_marked_didx_as_nvfuser_spells_it():
    plain = cg.lower(matmul_reduce_scatter(torch.float32, 4, 2))
    fusion = matmul_reduce_scatter(torch.float32, 4, 2)
    out = fusion.outputs[0]
    out.outer_split(-1, 2)
    out.axis(-2).parallelize(DIDx)  # rk: [.., rDIDx{2}, r{k/2}]
    assert str(cg.lower(fusion)) == str(plain)
    fusion = _ag_fusion()
    out = fusion.outputs[0]
    out.outer_split(-1, 2)
    out.axis(-2).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match="its reduction axis is DIDx but the operands' "
                                               r"contraction \(T0 axis 1, T1 axis 0\) is not"):
        cg.lower(fusion)


def test_partial_sums_without_a_sharded_output_need_an_allreduce():
    with pytest.raises(cg.ScheduleError, match="needs an all-reduce, which is not implemented; "
                                               r"shard T2's rows for a reduce-scatter"):
        cg.lower(_rs_fusion(shard_out=False))


def test_contraction_sharded_in_one_operand_only():
    with pytest.raises(cg.ScheduleError, match="the contraction is sharded in T0 axis 1 but not "
                                               "in T1 axis 0; shard both"):
        cg.lower(_rs_fusion(shard_w=False))


def test_reduce_scatter_with_columns_on_streams():
    fusion = matmul_reduce_scatter(torch.float32, 1, 2)
    out = fusion.outputs[0]
    out.outer_split(2, 2)
    out.axis(2).parallelize(Stream)
    with pytest.raises(cg.ScheduleError, match="reduce-scatter of T2's rows with its columns on "
                                               "streams is not implemented"):
        cg.lower(fusion)


def test_allgather_along_columns_is_refused():
    fusion = _ag_fusion()
    w = fusion.inputs[1]
    w.outer_split(1, 2)
    w.axis(1).parallelize(DIDx)  # w's columns sharded, out's not
    with pytest.raises(cg.ScheduleError, match="an all-gather along a non-leading axis is not "
                                               "implemented"):
        cg.lower(fusion)


def test_output_sharded_without_a_reduction_is_refused():
    with cg.Fusion("rowslice") as fusion:
        x, w = cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.matmul(x, w)
        cg.output(out)
    out.set_device_mesh(cg.DeviceMesh(2))
    out.outer_split(0, 2)
    out.axis(0).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match="each rank would slice its own block of T0"):
        cg.lower(fusion)


def test_two_ops_in_a_distributed_fusion():
    with cg.Fusion("two") as fusion:
        x, w, v = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["n", "p"])
        out = cg.matmul(cg.matmul(x, w), v)
        cg.output(out)
    x.set_device_mesh(cg.DeviceMesh(2))
    with pytest.raises(cg.ScheduleError, match="one 2-D matmul of two fusion inputs"):
        cg.lower(fusion)


def test_host_resident_tensors_in_a_distributed_fusion():
    with cg.Fusion("host") as fusion:
        x, w = cg.input(["m", "k"]), cg.input(["k", "n"], device="cpu")
        out = cg.matmul(x, w)
        cg.output(out)
    x.set_device_mesh(cg.DeviceMesh(2))
    x.outer_split(0, 2)
    x.axis(0).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match="T1 is device='cpu': host-resident tensors in a "
                                               "distributed fusion are not implemented"):
        cg.lower(fusion)


def test_two_didx_axes_on_one_tensor():
    fusion = _ag_fusion()
    x = fusion.inputs[0]
    x.outer_split(2, 2)
    x.axis(2).parallelize(DIDx)
    with pytest.raises(cg.ScheduleError, match="T0 has 2 DIDx axes"):
        cg.lower(fusion)


def test_stream_on_the_contraction():
    fusion = _ag_fusion()
    w = fusion.inputs[1]
    w.outer_split(0, 2)
    w.axis(0).parallelize(Stream)
    with pytest.raises(cg.ScheduleError, match="T1 axis 0 is on streams but it is contracted"):
        cg.lower(fusion)


# ---------------------------------------------------------------------------- evaluate, 1 process


def test_evaluate_without_torch_distributed_is_a_clear_error():
    assert not dist.is_initialized()
    program = cg.lower(allgather_matmul(torch.float32, 2, 2))
    with pytest.raises(RuntimeError, match=r"communicates over 2 ranks, but torch.distributed is "
                                           r"not initialized; call torch.distributed.init_"):
        cg.evaluate(program, [ints(4, 3), ints(3, 2)])


@pytest.fixture
def one_rank():
    """A gloo group of this process alone (destroyed after the test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_size_must_match_the_program(one_rank):
    program = cg.lower(matmul_reduce_scatter(torch.float32, 2, 2))
    with pytest.raises(ValueError, match=r"built for world size 2 \(DeviceMesh\(2\)\), but the "
                                         "process group has 1 ranks"):
        cg.evaluate(program, [ints(8, 3), ints(3, 5)])


@pytest.mark.parametrize("slices", [1, 2, 3])
def test_world_size_one_is_the_local_matmul(one_rank, slices):
    x, w = ints(6, 5), ints(5, 4)
    for make in EXAMPLES.values():
        (out,) = cg.evaluate(cg.lower(make(torch.float32, slices, 1)), [x, w])
        assert torch.equal(out, x @ w)


def test_slices_must_divide_the_local_rows(one_rank):
    program = cg.lower(allgather_matmul(torch.float32, 4, 1))
    with pytest.raises(ValueError, match=r"allgather_matmul: argument x axis 0 must have a size "
                                         r"divisible by 4 \(4 stream slices\), got 6"):
        cg.evaluate(program, [ints(6, 3), ints(3, 2)])


# ---------------------------------------------------------------------------- evaluate, gloo


def _shard(t, axis, rank, world_size):
    return t.chunk(world_size, axis)[rank]


def _check_examples(rank, d):
    """Both examples at S = 1, D, 2D, fp32 and bf16, exact against torch."""
    gen = torch.Generator().manual_seed(0)  # same global data on every rank
    m, k, n = 4 * d * d, 2 * d, 3 * d  # m divisible by D * 2D; k and n by D
    for dtype, lo, hi in ((torch.float32, -4, 5), (torch.bfloat16, -2, 3)):
        x = torch.randint(lo, hi, (m, k), generator=gen).to(dtype)
        w = torch.randint(lo, hi, (k, n), generator=gen).to(dtype)
        full = (x.float() @ w.float()).to(dtype)
        for s in (1, d, 2 * d):
            program = cg.lower(allgather_matmul(dtype, s, d))
            (out,) = cg.evaluate(program, [_shard(x, 0, rank, d), _shard(w, 1, rank, d)])
            assert torch.equal(out, _shard(full, 1, rank, d)), ("allgather_matmul", dtype, s)
            program = cg.lower(matmul_reduce_scatter(dtype, s, d))
            (out,) = cg.evaluate(program, [_shard(x, 1, rank, d), _shard(w, 0, rank, d)])
            assert torch.equal(out, _shard(full, 0, rank, d)), ("matmul_reduce_scatter", dtype, s)


def _check_layouts_and_one_slice_loops(rank, d):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randint(-4, 5, (8 * d, 2 * d), generator=gen).float(), \
        torch.randint(-4, 5, (2 * d, 3 * d), generator=gen).float()
    # Column-major local shards: the collectives get dense copies, the results agree.
    x_t = _shard(x, 0, rank, d).t().contiguous().t()
    (out,) = cg.evaluate(cg.lower(allgather_matmul(torch.float32, 1, d)),
                         [x_t, _shard(w, 1, rank, d)])
    assert torch.equal(out, x @ _shard(w, 1, rank, d))
    # A stream split of 1 slice per block: the sliced lowering with one iteration.
    fusion = matmul_reduce_scatter(torch.float32, 1, d)
    t2 = fusion.outputs[0]
    t2.outer_split(1, 1)
    t2.axis(1).parallelize(Stream)
    program = cg.lower(fusion)
    assert len(stream_loops(program)) == 1
    (out,) = cg.evaluate(program, [_shard(x, 1, rank, d), _shard(w, 0, rank, d)])
    assert torch.equal(out, _shard(x @ w, 0, rank, d))
    # Column slices after a whole all-gather (the communicated rows carry no stream split).
    fusion = allgather_matmul(torch.float32, 1, d)
    t2 = fusion.outputs[0]
    t2.outer_split(2, 3)  # [m, DIDx{D}, 3, n/(3D), rk]: slices of each rank's columns
    t2.axis(2).parallelize(Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    assert "Communication" not in kinds(loop.body)
    (out,) = cg.evaluate(program, [_shard(x, 0, rank, d), _shard(w, 1, rank, d)])
    assert torch.equal(out, x @ _shard(w, 1, rank, d))


def _check_bad_inputs(rank, d):
    rs = cg.lower(matmul_reduce_scatter(torch.float32, 1, d))
    with pytest.raises(ValueError, match=rf"argument x axis 0 must have a size divisible by {d} "
                                         rf"\(world size {d}\), got {2 * d + 1}"):
        cg.evaluate(rs, [ints(2 * d + 1, 2), ints(2, 3)])
    rs = cg.lower(matmul_reduce_scatter(torch.float32, 2, d))
    with pytest.raises(ValueError, match=rf"divisible by {2 * d} \(world size {d} x 2 stream "
                                         rf"slices\), got {3 * d}"):
        cg.evaluate(rs, [ints(3 * d, 2), ints(2, 3)])
    with pytest.raises(ValueError, match="argument w axis 0 must have size k_local = 2, got 3"):
        cg.evaluate(rs, [ints(4 * d, 2), ints(3, 3)])
    other = cg.lower(allgather_matmul(torch.float32, 1, 2 * d))
    with pytest.raises(ValueError, match=f"built for world size {2 * d}"):
        cg.evaluate(other, [ints(2, 2), ints(2, 2)])


def _check_subgroups(rank, d):
    """group= runs the program over a subgroup: two all-gathers of 2 ranks each."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    x = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(8, 3) + 100 * (rank // 2)
    w = ints(3, 5)  # each rank its own w: the result is its gathered x @ its w
    program = cg.lower(allgather_matmul(torch.float32, 2, 2))
    (out,) = cg.evaluate(program, [_shard(x, 0, rank % 2, 2), w], group=mine)
    assert torch.equal(out, x @ w)


def _worker(rank, world_size, store_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # How long a rank waits for the others (at the rendezvous, in each collective): only a
    # hang should run out of it, not ranks that start (import torch) or compute slowly on a
    # busy machine.
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=600))
    try:
        torch.manual_seed(rank)
        _check_examples(rank, world_size)
        _check_layouts_and_one_slice_loops(rank, world_size)
        _check_bad_inputs(rank, world_size)
        if world_size == 4:
            _check_subgroups(rank, world_size)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_processes_match_torch(world_size):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, (world_size, os.path.join(tmp, "store")), nprocs=world_size)


def test_verify_waits_refuses_a_second_post_before_the_first_wait():
    from codegen import distributed as dist_ir
    from codegen.errors import InternalError

    program = cg.lower(allgather_matmul(torch.float32, 4, 2))
    loop = next(n for n in program.body if isinstance(n, cg.hostir.ForLoop) and n.body
                and any(isinstance(b, dist_ir.Communication) for b in n.body))
    wait = next(b for b in loop.body if isinstance(b, dist_ir.Wait))
    comm = next(b for b in loop.body if isinstance(b, dist_ir.Communication))
    body = [b for b in loop.body if b is not wait]
    # Two posts in one block, then no wait: what a future "post all, then wait" pass
    # would produce, and what wait_tensor (all works of a storage) cannot order.
    body.insert(body.index(comm) + 1, dataclasses.replace(comm, out="comm_again"))
    broken = program.replace(body=[dataclasses.replace(loop, body=body) if n is loop else n
                                   for n in program.body])
    with pytest.raises(InternalError, match="posted before comm_i was waited for"):
        dist_ir.verify_waits(broken)
    assert dist_ir.verify_waits(program) is program
