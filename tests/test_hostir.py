"""Host IR: exact printed text, the host-IR passes, verify, and CODEGEN_DUMP."""

import pytest
import torch
from conftest import ints
from helpers import stream_loops, stream_matmul_columns, stream_matmul_rows, two_matmuls

import codegen as cg
from codegen import examples
from codegen import examples as ex
from codegen import hostir as hir
from codegen.errors import InternalError
from codegen.frontend.ir import Const, Sym

STREAM_TEST_MATMUL = """\
HostProgram stream_matmul_n(T0: float32[5, 7], T1: float32[7, 6]) -> (T2):
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[5, 6])
  for j in range(0, 3):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 3) [Stream]:
    SetCurrentStream(Stream(i))
    T1_i = ShardByStream(T1, axis=1, index=i, chunk=2)
    T2_i = ShardByStream(T2, axis=1, index=i, chunk=2)
    Matmul(T0, T1_i, out=T2_i)
  SetCurrentStream(main_stream)
  for j in range(0, 3):
    Synchronize(Stream(j))
  return T2"""

TWO_MATMULS_NOT_INLINABLE = """\
HostProgram two_matmuls_not_inlinable(T0: float32[m, k], T1: float32[k, n], \
T2: float32[n, p]) -> (T4):
  main_stream = GetCurrentStream()
  T3 = Allocate(float32[m, n])
  for j in range(0, 3):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 3) [Stream]:
    SetCurrentStream(Stream(i))
    T1_i = ShardByStream(T1, axis=1, index=i, chunk=ceilDiv(n, 3))
    T3_i = ShardByStream(T3, axis=1, index=i, chunk=ceilDiv(n, 3))
    Matmul(T0, T1_i, out=T3_i)
  SetCurrentStream(main_stream)
  for j in range(0, 3):
    Synchronize(Stream(j))
  T4 = Allocate(float32[m, p])
  for j in range(0, 2):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 2) [Stream]:
    SetCurrentStream(Stream(i))
    T3_i = ShardByStream(T3, axis=0, index=i, chunk=ceilDiv(m, 2))
    T4_i = ShardByStream(T4, axis=0, index=i, chunk=ceilDiv(m, 2))
    Matmul(T3_i, T2, out=T4_i)
  SetCurrentStream(main_stream)
  for j in range(0, 2):
    Synchronize(Stream(j))
  Deallocate(T3)
  return T4"""

ROWS_EIGHT_SLICES_POOL_FOUR = """\
HostProgram matmul_rows(T0: float32[m, k], T1: float32[k, n]) -> (T2):
  main_stream = GetCurrentStream()
  T2 = Allocate(float32[m, n])
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 8) [Stream]:
    SetCurrentStream(Stream(i % 4))
    T0_i = ShardByStream(T0, axis=0, index=i, chunk=ceilDiv(m, 8))
    T2_i = ShardByStream(T2, axis=0, index=i, chunk=ceilDiv(m, 8))
    Matmul(T0_i, T1, out=T2_i)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  return T2"""


def test_print_stream_test_matmul():
    assert str(cg.lower(stream_matmul_columns())) == STREAM_TEST_MATMUL


def test_print_two_matmuls_not_inlinable():
    assert str(cg.lower(two_matmuls(inlinable=False))) == TWO_MATMULS_NOT_INLINABLE


def test_print_pool_smaller_than_slice_count():
    program = cg.lower(stream_matmul_rows(slices=8), pool_size=4)
    assert str(program) == ROWS_EIGHT_SLICES_POOL_FOUR


def test_pool_size_option_bounds_streams():
    program = cg.lower(stream_matmul_rows(slices=8), pool_size=2)
    (loop,) = stream_loops(program)
    assert str(loop.body[0]) == "SetCurrentStream(Stream(i % 2))"
    forks = [n for n in program.body if isinstance(n, hir.ForLoop) and n is not loop]
    assert [f.stop for f in forks] == [Const(2), Const(2)]


def test_symbolic_slice_count_bounds_fork_join_with_min():
    with cg.Fusion("sym") as fusion:
        out = cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"]))
        cg.output(out)
    out.split(1, 8)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    text = str(cg.lower(fusion))
    assert "for j in range(0, min(ceilDiv(n, 8), 4)):" in text
    assert "SetCurrentStream(Stream(i % 4))" in text


def test_no_synchronize_inside_compute_loops():
    for fusion in (stream_matmul_columns(), two_matmuls(True), two_matmuls(False)):
        for loop in stream_loops(cg.lower(fusion)):
            assert not any(isinstance(n, hir.Synchronize) for n in loop.body)


def test_nodes_walks_loop_bodies():
    program = cg.lower(stream_matmul_columns())
    kinds = [type(n).__name__ for n in program.nodes()]
    assert kinds.count("Matmul") == 1 and kinds.count("ShardByStream") == 2
    assert kinds.count("Synchronize") == 2 and kinds.count("ForLoop") == 3


def test_remove_dead_code_drops_unused_views_and_allocations():
    t = hir.TensorInfo("T9", None, (Const(2),))
    loop = hir.ForLoop("i", Const(0), Const(2), [
        hir.ShardByStream("T0_i", "T0", 0, "i", Const(1)),
        hir.ShardByStream("T1_i", "T1", 0, "i", Const(1)),
        hir.Matmul("T1_i", "T0", "T0"),
    ], cg.ParallelType.Stream)
    program = hir.HostProgram("p", [hir.TensorInfo("T0", None, (Sym("a"),)),
                                    hir.TensorInfo("T1", None, (Sym("b"),))],
                              ["T1"], [hir.Allocate(t), loop, hir.Deallocate("T9")])
    cleaned = hir.remove_dead_code(program)
    assert [str(n) for n in cleaned.nodes()] == [
        "for i in range(0, 2) [Stream]:",
        "T1_i = ShardByStream(T1, axis=0, index=i, chunk=1)",
        "Matmul(T0, T0, out=T1_i)",
    ]
    assert len(list(program.nodes())) == 6  # the pass returned a new program


def test_verify_rejects_use_before_definition():
    program = hir.HostProgram("p", [], ["T1"], [hir.Matmul("T1", "T0", "T0")])
    with pytest.raises(InternalError, match="bug in codegen.*uses T0 before"):
        hir.verify(program)


def test_dump_prints_each_pass(monkeypatch, capsys):
    monkeypatch.setenv("CODEGEN_DUMP", "ir,hostir")
    cg.lower(stream_matmul_columns())
    err = capsys.readouterr().err
    for name in ("validate_schedule", "propagate_stream_sharding", "move_stream_to_front",
                 "build_host_program", "assign_streams", "insert_fork_join"):
        assert name in err
    assert "T1: float32[i{7}, i{6}] loop [iStream{3}, i{7}, i{2}]" in err


@pytest.mark.parametrize("slices, pool", [(1, 4), (4, 1), (1, 1)])
def test_a_loop_on_one_stream_stays_on_the_callers_stream(slices, pool):
    """One slice, or pool_size=1: no worker stream, so no fork, no join, no events."""
    program = cg.lower(ex.matmul_rows(torch.float32, slices), pool_size=pool)
    text = str(program)
    assert "SetCurrentStream" not in text and "Synchronize" not in text
    assert "GetCurrentStream" not in text
    (loop,) = [n for n in program.body if isinstance(n, hir.ForLoop)]
    assert hir.on_caller_stream(loop, pool)
    a, b = ints(9, 4), ints(4, 5)
    assert torch.equal(cg.evaluate(program, [a, b])[0], a @ b)


def test_two_slices_on_a_pool_of_two_still_fork_and_join():
    program = cg.lower(ex.matmul_rows(torch.float32, 2), pool_size=2)
    (loop,) = [n for n in program.body
               if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream]
    assert not hir.on_caller_stream(loop, 2)
    assert str(loop.body[0]) == "SetCurrentStream(Stream(i))"
    text = str(program)
    assert text.count("Synchronize(main_stream)") == 1  # the fork
    assert text.count("Synchronize(Stream(j))") == 1  # the join
    assert "main_stream = GetCurrentStream()" in text


def test_pool_of_one_stays_on_the_callers_stream_with_a_symbolic_slice_count():
    with cg.Fusion("rows_by_8") as fusion:
        out = cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"]))
        cg.output(out)
    out.split(0, 8)  # ceilDiv(m, 8) slices of 8 rows: a count known only at run time
    out.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion, pool_size=1)
    assert "SetCurrentStream" not in str(program) and "Synchronize" not in str(program)
    a, b = ints(21, 4), ints(4, 5)
    assert torch.equal(cg.evaluate(program, [a, b])[0], a @ b)
    assert "SetCurrentStream(Stream(i % 4))" in str(cg.lower(fusion, pool_size=4))


def test_remove_dead_code_drops_dead_gemms():
    """A GEMM whose result no output reads goes, with its allocation and its views; the
    live GEMM keeps the loop (the split reached it through the shared input)."""
    with cg.Fusion("dead") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        dead = cg.matmul(a, b)
        live = cg.matmul(a, b)
        cg.output(live)
    dead.outer_split(0, 2)
    dead.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    text = str(program)
    assert "T2" not in text and text.count("Matmul(") == 1, text
    assert "Matmul(T0_i, T1, out=T3_i)" in text
    with cg.Fusion("dead_loop") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        dead = cg.matmul(a, b)
        cg.output(cg.silu(b))
    dead.outer_split(0, 2)
    dead.axis(0).parallelize(cg.ParallelType.Stream)
    assert [str(n) for n in cg.lower(fusion).nodes()] == [
        "T3 = Allocate(float32[k, n])", "Silu(T1, out=T3)"]


def test_remove_dead_code_keeps_what_outputs_read_through_views():
    program = cg.lower(examples.llama_mlp())
    kinds = [type(n).__name__ for n in program.nodes()]
    assert kinds.count("Linear") == 3 and kinds.count("Mul") == 1
