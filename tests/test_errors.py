"""User mistakes get ScheduleError / ValueError naming the tensor, axis or argument."""

import pytest
import torch
from conftest import ints
from helpers import stream_matmul_columns, stream_matmul_rows

import codegen as cg
from codegen import hostir as hir

S = cg.ParallelType.Stream


def matmul_fusion(a_shape=("m", "k"), b_shape=("k", "n"), dtype=torch.float32):
    with cg.Fusion("f") as fusion:
        a, b = cg.input(list(a_shape), dtype), cg.input(list(b_shape), dtype)
        out = cg.matmul(a, b)
        cg.output(out)
    return fusion, a, b, out


def test_schedule_error_is_a_value_error():
    assert issubclass(cg.ScheduleError, ValueError)


def test_two_stream_axes_on_one_tensor():
    _, _, _, out = matmul_fusion()
    out.axis(0).parallelize(S)
    with pytest.raises(cg.ScheduleError, match=r"T2 axis 1 .*already has a stream axis"):
        out.axis(1).parallelize(S)


def test_parallelizing_an_axis_that_was_split_away():
    _, _, _, out = matmul_fusion()
    first = out.axis(0)
    out.split(0, 2)
    with pytest.raises(cg.ScheduleError, match=r"i\{m\} is no longer in T2's loop domain"):
        first.parallelize(S)


def test_two_stream_axes_through_a_stale_reference_are_caught_by_validation():
    fusion, _, _, out = matmul_fusion()
    first = out.axis(0)
    out.split(0, 2)  # `first` is no longer in the loop domain
    out.axis(0).parallelize(S)
    first.parallel_type = S  # bypasses parallelize's checks; validation still catches it
    with pytest.raises(cg.ScheduleError, match="T2 has 2 stream axes"):
        cg.lower(fusion)


@pytest.mark.parametrize("factor", [0, -2])
def test_split_factor_below_one(factor):
    _, _, _, out = matmul_fusion()
    with pytest.raises(cg.ScheduleError, match=rf"T2.outer_split\(axis=1\): factor must be >= 1, "
                                               rf"got {factor}"):
        out.outer_split(1, factor)


def test_split_factor_not_an_int():
    _, _, _, out = matmul_fusion()
    with pytest.raises(cg.ScheduleError, match="factor must be an int, got 2.5"):
        out.split(0, 2.5)


@pytest.mark.parametrize("call", ["axis", "split", "reorder"])
def test_axis_out_of_range(call):
    _, _, _, out = matmul_fusion()
    with pytest.raises(cg.ScheduleError, match=r"T2\.\w+: axis 5 is out of range .* 3 axes"):
        if call == "axis":
            out.axis(5)
        elif call == "split":
            out.split(5, 2)
        else:
            out.reorder({5: 0})


def test_stream_on_reduction_axis_is_rejected():
    _, _, _, out = matmul_fusion()
    with pytest.raises(cg.ScheduleError, match=r"T2 axis 2 \(r\{k\}\).*split-K"):
        out.axis(2).parallelize(S)


def test_stream_on_input_contraction_axis_cannot_be_honoured():
    fusion, a, _, _ = matmul_fusion()
    a.outer_split(1, 2)
    a.axis(1).parallelize(S)
    with pytest.raises(cg.ScheduleError, match=r"conflicting stream splits: T0 axis 1"):
        cg.lower(fusion)


def test_conflicting_split_factors():
    fusion, a, _, out = matmul_fusion()
    a.outer_split(0, 2)
    a.axis(0).parallelize(S)
    out.outer_split(0, 3)
    out.axis(0).parallelize(S)
    with pytest.raises(cg.ScheduleError, match=r"T0 axis 0 \[outer_split\(2\)\] but matmul T2 "
                                               r"axis 0 \[outer_split\(3\)\]"):
        cg.lower(fusion)


def test_conflicting_axes_on_inputs_and_output():
    fusion, a, b, out = matmul_fusion()
    out.outer_split(0, 2)
    out.axis(0).parallelize(S)
    b.outer_split(1, 2)
    b.axis(1).parallelize(S)
    with pytest.raises(cg.ScheduleError, match="conflicting stream splits: T1 axis 1"):
        cg.lower(fusion)


def test_stream_on_inner_part_of_split():
    fusion, _, _, out = matmul_fusion()
    out.split(0, 4)
    out.axis(1).parallelize(S)
    with pytest.raises(cg.ScheduleError, match="inner part of a split.*not be contiguous"):
        cg.lower(fusion)


def test_split_of_a_stream_axis():
    _, _, _, out = matmul_fusion()
    out.axis(0).parallelize(S)
    with pytest.raises(cg.ScheduleError, match="already stream-parallel"):
        out.split(0, 2)


def test_definition_errors():
    with pytest.raises(cg.ScheduleError, match=r"matmul: sizes that must be equal differ: "
                                               r"a=T0 axis 1 is 7, b=T1 axis 0 is 6"):
        matmul_fusion((5, 7), (6, 4))
    with pytest.raises(cg.ScheduleError, match="supported ranks.*rank 1"):
        matmul_fusion(("m", "k"), ("k",))
    with pytest.raises(cg.ScheduleError, match="one dtype.*b=T1 is float16"):
        with cg.Fusion("f"):
            cg.matmul(cg.input([2, 3]), cg.input([3, 4], torch.float16))
    with pytest.raises(cg.ScheduleError, match="dtype torch.int32 is not supported"):
        with cg.Fusion("f"):
            cg.input([2], torch.int32)
    with pytest.raises(cg.ScheduleError, match="must be called inside"):
        cg.input([2, 3])
    with pytest.raises(cg.ScheduleError, match="C identifier"):
        cg.Fusion("my op")
    with pytest.raises(cg.ScheduleError, match=r"Fusion name must be at most 120 characters, "
                                               r"got 121 \(aaaa"):
        cg.Fusion("a" * 121)
    with pytest.raises(cg.ScheduleError, match="T0 is a fusion input"):
        with cg.Fusion("f"):
            cg.output(cg.input([2]))
    with pytest.raises(cg.ScheduleError, match="bias .* must be 1-D"):
        with cg.Fusion("f"):
            cg.linear(cg.input([2, 3]), cg.input([4, 3]), cg.input([4, 1]))
    with pytest.raises(cg.ScheduleError, match="no outputs"):
        with cg.Fusion("f") as fusion:
            cg.input([2])
        cg.lower(fusion)


@pytest.mark.parametrize("a, b", [(["m", "n"], ["m", 1]), (["m", "n"], [1, "n"]),
                                  (["m", 1], ["m", "n"])])
def test_size_one_broadcasting_is_refused_where_it_is_written(a, b):
    """torch broadcasts a size-1 axis; codegen broadcasts b along a's leading axes only.
    Refused at the op, naming the operand and axis (not, later, at the call)."""
    with cg.Fusion("f"), pytest.raises(cg.ScheduleError, match=(
            r"mul: (a|b)=(x|scale) axis [01] has size 1 where (a|b)=(x|scale) axis [01] has "
            r"size [mn]: size-1 broadcasting is not supported")):
        cg.mul(cg.input(a, name="x"), cg.input(b, name="scale"))
    with cg.Fusion("f"):  # a bias along the leading axes, and fixed sizes of 1 on both
        cg.add(cg.input(["m", "n"]), cg.input(["n"]))
        cg.add(cg.input([4, 1]), cg.input([4, 1]))


def test_tensor_of_another_fusion():
    with cg.Fusion("a"):
        x = cg.input([2, 2])
    with cg.Fusion("b"):
        y = cg.input([2, 2])
        with pytest.raises(cg.ScheduleError, match=r"argument a \(T0\) belongs to another"):
            cg.matmul(x, y)


# ------------------------------------------------------------------ evaluator input errors


@pytest.fixture
def program():
    return cg.lower(stream_matmul_rows())


def test_evaluate_wrong_dtype(program):
    with pytest.raises(ValueError, match="matmul_rows: argument T1 must be float32, got "
                                         "torch.float16"):
        cg.evaluate(program, [ints(2, 3), ints(3, 4, dtype=torch.float16)])


def test_evaluate_wrong_rank(program):
    with pytest.raises(ValueError, match=r"argument T0 must have rank 2 float32\[m, k\], got "
                                         r"shape \[2, 3, 1\]"):
        cg.evaluate(program, [ints(2, 3, 1), ints(3, 4)])


def test_evaluate_named_extent_mismatch(program):
    with pytest.raises(ValueError, match=r"argument T1 axis 0 must have size k = 3, got 5"):
        cg.evaluate(program, [ints(2, 3), ints(5, 4)])


def test_evaluate_fixed_extent_mismatch():
    program = cg.lower(stream_matmul_columns())
    with pytest.raises(ValueError, match=r"argument T0 axis 0 must have size 5, got 4"):
        cg.evaluate(program, [ints(4, 7), ints(7, 6)])


def test_evaluate_op_constraint_between_different_names():
    fusion, *_ = matmul_fusion(("m", "k1"), ("k2", "n"))
    with pytest.raises(ValueError, match=r"matmul T2: a=T0 axis 1 and b=T1 axis 0 must have "
                                         r"equal sizes, got k1 = 3 and k2 = 4"):
        cg.evaluate(cg.lower(fusion), [ints(2, 3), ints(4, 5)])


def test_evaluate_argument_count_and_type(program):
    with pytest.raises(ValueError, match=r"expected 2 inputs \(T0, T1\), got 1"):
        cg.evaluate(program, [ints(2, 3)])
    with pytest.raises(ValueError, match="expected 2 inputs"):
        cg.evaluate(program, [ints(2, 3), ints(3, 4), ints(1)])
    with pytest.raises(TypeError, match="argument T1 must be a torch.Tensor, got list"):
        cg.evaluate(program, [ints(2, 3), [[1.0]]])
    with pytest.raises(TypeError, match="inputs must be a list"):
        cg.evaluate(program, ints(2, 3))
    with pytest.raises(TypeError, match="expects a cg.HostProgram"):
        cg.evaluate("program", [])


def test_evaluate_inputs_on_different_devices(program):
    with pytest.raises(ValueError, match="argument T1 is on meta but T0 is on cpu"):
        cg.evaluate(program, [ints(2, 3), torch.empty(3, 4, device="meta")])


def test_evaluate_requires_grad_and_nan_propagate_like_torch(program):
    a = ints(4, 3).requires_grad_()
    b = ints(3, 2)
    b[1, 1] = float("nan")
    (out,) = cg.evaluate(program, [a, b])
    expect = a.detach() @ b
    assert torch.equal(out.isnan(), expect.isnan())
    assert torch.equal(out.nan_to_num(), expect.nan_to_num())


def test_a_program_may_mix_dtypes_but_not_one_op():
    """Two GEMMs of two dtypes are one program (each dtype gets its rt::Gemms); one GEMM
    of two dtypes is refused, pointing at cg.cast."""
    with cg.Fusion("mixed") as fusion:
        cg.output(cg.matmul(cg.input([2, 3]), cg.input([3, 4])))
        cg.output(cg.matmul(cg.input([2, 3], torch.bfloat16), cg.input([3, 4], torch.bfloat16)))
    xs = [ints(2, 3), ints(3, 4), ints(2, 3, dtype=torch.bfloat16),
          ints(3, 4, dtype=torch.bfloat16)]
    outs = cg.evaluate(cg.lower(fusion), xs)
    assert torch.equal(outs[0], xs[0] @ xs[1]) and torch.equal(outs[1], xs[2] @ xs[3])
    with cg.Fusion("one_op"), pytest.raises(
            cg.ScheduleError, match="matmul: all operands must have one dtype, found a=T0 is "
                                    "float32, b=T1 is bfloat16; convert one with cg.cast"):
        cg.matmul(cg.input([2, 3]), cg.input([3, 4], torch.bfloat16))


def test_evaluator_names_an_unknown_node_kind_as_a_bug():
    class Mystery(hir.Node):
        def __str__(self) -> str:
            return "Mystery()"

    program = hir.HostProgram("p", [], [], [Mystery()])
    with pytest.raises(cg.InternalError, match="bug.*the evaluator has no rule for Mystery "
                                               r"nodes \(Mystery\(\)\)"):
        cg.evaluate(program, [])


def test_more_mistakes_are_named():
    with cg.Fusion("f") as fusion:
        out = cg.matmul(cg.input(["m", "k"]), cg.input(["k", "n"]))
        cg.output(out)
    with pytest.raises(cg.ScheduleError, match=r"T2.reorder: expected \{old: new\} positions "
                                               r"or a permutation of 0..2, got 1"):
        out.reorder(1)
    with pytest.raises(cg.ScheduleError, match="outer_split.*number of slices.*at most 65536, "
                                               "got 1000000000000"):
        out.outer_split(0, 10**12)
    program = cg.lower(fusion)
    with pytest.raises(cg.ScheduleError, match="schedule expects a cg.Fusion, got HostProgram"):
        cg.schedule(program)
    with pytest.raises(TypeError, match="f: group= is only for programs with collectives"):
        cg.evaluate(program, [ints(2, 3), ints(3, 4)], group="pg")
    with pytest.raises(ValueError, match=r"f: argument T0 must be a dense \(strided\) tensor, "
                                         r"got layout torch.sparse_coo"):
        cg.evaluate(program, [ints(2, 3).to_sparse(), ints(3, 4)])
    with pytest.raises(cg.ScheduleError, match="matmul_rows: slices must be an int >= 1, got 0"):
        cg.examples.matmul_rows(slices=0)


def test_a_bias_broadcast_beyond_rank_3_names_its_operand_in_backward():
    with cg.Fusion("f") as fusion:
        cg.output(cg.add(cg.input([2, 3, 4, 5], name="a"), cg.input([5], name="bias")))
    a, bias = (torch.randn(s, requires_grad=True) for s in ((2, 3, 4, 5), (5,)))
    (out,) = cg.evaluate(cg.lower(fusion), [a, bias])
    torch.testing.assert_close(out, a + bias)  # the forward runs
    with pytest.raises(cg.ScheduleError, match=r"f: no backward: add: no backward for bias, "
                                               r"broadcast from rank 1 to rank 4"):
        out.sum().backward()
