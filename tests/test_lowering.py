"""Structure of lowered programs, and their values through the evaluator (CPU, exact)."""

import pytest
import torch
from conftest import ints
from helpers import stream_loops, stream_matmul_columns, stream_matmul_rows, two_matmuls

import codegen as cg
from codegen import hostir as hir
from codegen.frontend.ir import Const


def record_matmuls(monkeypatch):
    """Records the operand shapes of every torch.matmul the evaluator makes."""
    calls = []
    real = torch.matmul

    def spy(a, b, *, out=None):
        calls.append((list(a.shape), list(b.shape), list(out.shape)))
        return real(a, b, out=out)

    monkeypatch.setattr(torch, "matmul", spy)
    return calls


def test_stream_test_matmul_is_one_loop_of_three_column_slices(monkeypatch):
    program = cg.lower(stream_matmul_columns())
    (loop,) = stream_loops(program)
    assert loop.stop == Const(3)
    kinds = [type(n).__name__ for n in loop.body]
    assert kinds == ["SetCurrentStream", "ShardByStream", "ShardByStream", "Matmul"]
    # The output is allocated whole, before the loop.
    body = program.body
    alloc = next(i for i, n in enumerate(body) if isinstance(n, hir.Allocate))
    assert body[alloc].out.name == "T2" and alloc < body.index(loop)
    a, b = ints(5, 7), ints(7, 6)
    calls = record_matmuls(monkeypatch)
    (out,) = cg.evaluate(program, [a, b])
    assert calls == [([5, 7], [7, 2], [5, 2])] * 3
    assert torch.equal(out, a @ b)


def test_rows_split_slices_input_and_output_rows(monkeypatch):
    program = cg.lower(stream_matmul_rows(slices=4))
    (loop,) = stream_loops(program)
    shards = [n for n in loop.body if isinstance(n, hir.ShardByStream)]
    assert [(s.tensor, s.axis) for s in shards] == [("T0", 0), ("T2", 0)]
    a, b = ints(10, 3), ints(3, 5)
    calls = record_matmuls(monkeypatch)
    (out,) = cg.evaluate(program, [a, b])
    assert [c[0] for c in calls] == [[3, 3], [3, 3], [3, 3], [1, 3]]  # ceil(10/4) = 3
    assert torch.equal(out, a @ b)


@pytest.mark.parametrize("b_rank", [3, 2])
def test_batched_matmul_split_on_batch(b_rank):
    with cg.Fusion("bmm") as fusion:
        a = cg.input(["b", "m", "k"])
        b = cg.input(["b", "k", "n"] if b_rank == 3 else ["k", "n"])
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(0, 2)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    sliced = {n.tensor for n in loop.body if isinstance(n, hir.ShardByStream)}
    assert sliced == ({"T0", "T1", "T2"} if b_rank == 3 else {"T0", "T2"})
    x = ints(5, 4, 3)
    y = ints(5, 3, 6) if b_rank == 3 else ints(3, 6)
    assert torch.equal(cg.evaluate(program, [x, y])[0], torch.matmul(x, y))


def test_batched_matmul_split_on_rows():
    with cg.Fusion("bmm_rows") as fusion:
        a = cg.input([None, "m", "k"])
        b = cg.input(["k", "n"])
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(1, 3)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    x, y = ints(2, 7, 3), ints(3, 4)
    assert torch.equal(cg.evaluate(program, [x, y])[0], x @ y)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("x_rank", [2, 3])
def test_linear_with_bias(axis, x_rank):
    with cg.Fusion("linear_bias") as fusion:
        x = cg.input(["m", "k"] if x_rank == 2 else ["b", "m", "k"])
        w = cg.input(["n", "k"])
        bias = cg.input(["n"])
        out = cg.linear(x, w, bias)
        cg.output(out)
    axis = axis if x_rank == 2 else axis + 1
    out.outer_split(axis, 3)
    out.axis(axis).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    sliced = {n.tensor: n.axis for n in loop.body if isinstance(n, hir.ShardByStream)}
    n_axis = x_rank - 1
    if axis == n_axis:  # columns: w rows and bias are sliced, x is read whole
        assert sliced == {"T1": 0, "T2": 0, "T3": n_axis}
    else:
        assert sliced == {"T0": axis, "T3": axis}
    xv = ints(7, 5) if x_rank == 2 else ints(2, 7, 5)
    wv, bv = ints(8, 5), ints(8)
    expect = torch.nn.functional.linear(xv, wv, bv)
    assert torch.equal(cg.evaluate(program, [xv, wv, bv])[0], expect)


def test_linear_without_bias():
    with cg.Fusion("linear") as fusion:
        x = cg.input(["m", "k"])
        w = cg.input(["n", "k"])
        out = cg.linear(x, w)
        cg.output(out)
    out.outer_split(0, 2)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    xv, wv = ints(5, 3), ints(4, 3)
    assert torch.equal(cg.evaluate(cg.lower(fusion), [xv, wv])[0], xv @ wv.T)


def test_two_matmuls_inlinable_is_one_loop_with_two_matmuls():
    program = cg.lower(two_matmuls(inlinable=True))
    (loop,) = stream_loops(program)
    assert sum(isinstance(n, hir.Matmul) for n in loop.body) == 2
    # The intermediate is produced and consumed slice by slice: one view, reused.
    views = [n.out for n in loop.body if isinstance(n, hir.ShardByStream)]
    assert views == ["T0_i", "T3_i", "T4_i"]
    a, b, c = ints(7, 4), ints(4, 5), ints(5, 3)
    assert torch.equal(cg.evaluate(program, [a, b, c])[0], a @ b @ c)


def test_two_matmuls_not_inlinable_is_two_loops_with_whole_intermediate():
    program = cg.lower(two_matmuls(inlinable=False))
    first, second = stream_loops(program)
    assert (first.stop, second.stop) == (Const(3), Const(2))
    body = program.body
    alloc_t3 = next(i for i, n in enumerate(body)
                    if isinstance(n, hir.Allocate) and n.out.name == "T3")
    assert alloc_t3 < body.index(first)
    assert [n.axis for n in first.body if isinstance(n, hir.ShardByStream)] == [1, 1]
    assert [(n.tensor, n.axis) for n in second.body if isinstance(n, hir.ShardByStream)] == [
        ("T3", 0), ("T4", 0)]
    # The intermediate is freed after its last reader.
    assert isinstance(body[-1], hir.Deallocate) and body[-1].tensor == "T3"
    a, b, c = ints(7, 4), ints(4, 5), ints(5, 3)
    assert torch.equal(cg.evaluate(program, [a, b, c])[0], a @ b @ c)


def test_only_producer_scheduled_consumer_runs_whole():
    with cg.Fusion("producer_only") as fusion:
        inp, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["n", "p"])
        t1 = cg.matmul(inp, w1)
        t2 = cg.matmul(t1, w2)
        cg.output(t2)
    t1.outer_split(1, 2)  # t1's columns are t2's contraction: t2 cannot follow
    t1.axis(1).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    assert len(stream_loops(program)) == 1
    assert isinstance(program.body[-2], hir.Matmul) and program.body[-2].out == "T4"
    a, b, c = ints(3, 4), ints(4, 5), ints(5, 2)
    assert torch.equal(cg.evaluate(program, [a, b, c])[0], a @ b @ c)


@pytest.mark.parametrize("n,slices,lengths", [(5, 4, [2, 2, 1, 0]), (7, 3, [3, 3, 1]),
                                               (2, 4, [1, 1, 0, 0]), (6, 3, [2, 2, 2])])
def test_ragged_and_empty_slices(monkeypatch, n, slices, lengths):
    program = cg.lower(stream_matmul_columns(m=3, k=4, n=n, slices=slices))
    a, b = ints(3, 4), ints(4, n)
    calls = record_matmuls(monkeypatch)
    (out,) = cg.evaluate(program, [a, b])
    assert [c[1][1] for c in calls] == lengths
    assert torch.equal(out, a @ b)


def test_inner_split_gives_fixed_size_slices_and_symbolic_count():
    with cg.Fusion("inner") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.matmul(a, b)
        cg.output(out)
    out.split(0, 4)  # [ceilDiv(m, 4), 4]: slices of 4 rows
    out.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    assert str(loop.stop) == "ceilDiv(m, 4)"
    assert "SetCurrentStream(Stream(i % 4))" in str(program)
    for m in (1, 4, 9, 17):
        x, y = ints(m, 3), ints(3, 2)
        assert torch.equal(cg.evaluate(program, [x, y])[0], x @ y)


def test_nested_split_stream_on_outer_of_outer():
    with cg.Fusion("nested") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.matmul(a, b)
        cg.output(out)
    out.split(0, 2).outer_split(0, 3)  # [3, ceilDiv(ceilDiv(m, 2), 3), 2, n, rk]
    out.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)
    shard = next(n for n in loop.body if isinstance(n, hir.ShardByStream))
    assert str(shard.chunk) == "2 * ceilDiv(ceilDiv(m, 2), 3)"
    for m in (1, 5, 11, 12, 13):
        x, y = ints(m, 3), ints(3, 2)
        assert torch.equal(cg.evaluate(program, [x, y])[0], x @ y)


def test_symbolic_extents_one_program_many_shapes():
    program = cg.lower(stream_matmul_rows(slices=3))
    for m, k, n in [(1, 1, 1), (3, 5, 7), (9, 2, 4), (0, 3, 2), (4, 0, 3), (2, 3, 0)]:
        a, b = ints(m, k), ints(k, n)
        (out,) = cg.evaluate(program, [a, b])
        assert out.shape == (m, n)
        assert torch.equal(out, a @ b)


def test_stream_axis_found_anywhere_in_the_loop_domain():
    """nvFuser only looked at the front of the loop domain; we search it all."""
    with cg.Fusion("anywhere") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        out = cg.matmul(a, b)
        cg.output(out)
    out.outer_split(1, 2)
    out.reorder({1: 3})  # [m, ceilDiv(n, 2), rk, iStream{2}]
    out.axis(3).parallelize(cg.ParallelType.Stream)
    scheduled = cg.schedule(fusion)
    t2 = scheduled.outputs[0]
    assert t2.loop[0].is_stream  # moved to the front by the pass
    assert len(stream_loops(cg.lower(fusion))) == 1


def test_schedule_on_input_propagates_to_output():
    with cg.Fusion("input_scheduled") as fusion:
        a, b = cg.input(["m", "k"]), cg.input(["k", "n"])
        cg.output(cg.matmul(a, b))
    a.outer_split(0, 2)
    a.axis(0).parallelize(cg.ParallelType.Stream)
    scheduled = cg.schedule(fusion)
    assert scheduled.outputs[0].loop[0].is_stream
    x, y = ints(5, 3), ints(3, 4)
    assert torch.equal(cg.evaluate(cg.lower(fusion), [x, y])[0], x @ y)


def test_lowering_does_not_change_the_users_fusion():
    fusion = stream_matmul_columns()
    before = str(fusion)
    cg.lower(fusion)
    assert str(fusion) == before
    assert fusion.inputs[1].stream_id() is None


def test_unscheduled_fusion_has_no_loop_and_no_streams():
    with cg.Fusion("plain") as fusion:
        cg.output(cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"])))
    program = cg.lower(fusion)
    assert not any(isinstance(n, (hir.ForLoop, hir.GetCurrentStream, hir.Synchronize))
                   for n in program.nodes())
    x, y = ints(3, 4), ints(4, 5)
    assert torch.equal(cg.evaluate(program, [x, y])[0], x @ y)


def test_two_outputs():
    with cg.Fusion("two_outputs") as fusion:
        a, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["n", "p"])
        t1 = cg.matmul(a, w1)
        t2 = cg.matmul(t1, w2)
        cg.output(t1)
        cg.output(t2)
    t2.outer_split(0, 2)
    t2.axis(0).parallelize(cg.ParallelType.Stream)
    program = cg.lower(fusion)
    assert not any(isinstance(n, hir.Deallocate) for n in program.nodes())
    x, y, z = ints(5, 3), ints(3, 4), ints(4, 2)
    o1, o2 = cg.evaluate(program, [x, y, z])
    assert torch.equal(o1, x @ y) and torch.equal(o2, x @ y @ z)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_on_cpu(dtype):
    program = cg.lower(stream_matmul_rows(slices=2, dtype=dtype))
    a, b = ints(6, 4, dtype=dtype), ints(4, 3, dtype=dtype)
    (out,) = cg.evaluate(program, [a, b])
    assert out.dtype == dtype
    assert torch.equal(out.double(), a.double() @ b.double())


def test_1024_slices_more_than_rows():
    program = cg.lower(stream_matmul_rows(slices=1024))
    assert "SetCurrentStream(Stream(i % 4))" in str(program)
    for m in (5, 1024, 3000):
        a, b = ints(m, 3), ints(3, 4)
        assert torch.equal(cg.evaluate(program, [a, b])[0], a @ b)


def test_evaluator_takes_any_layout():
    program = cg.lower(stream_matmul_rows(slices=3))
    a = ints(4, 7).t()  # transposed
    b = ints(4, 1).expand(4, 5)  # expanded: stride 0
    over = torch.arange(12.0).as_strided((7, 4), (1, 1))  # overlapping rows
    assert torch.equal(cg.evaluate(program, [a, b])[0], a @ b)
    assert torch.equal(cg.evaluate(program, [over, b])[0], over @ b)
