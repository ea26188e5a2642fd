"""Choosing between streaming a row-major host weight by blocks of columns and by blocks of
rows (``split_contraction="auto"``): the cost model (the loops measured on the H200 that
its constants were chosen against; what holds whatever the constants: units against the
data sheet, more work never faster, the clear cases), the choice made at lowering where
every extent is known, the choice left to the call (both loops printed, both built, each
call running the one estimated faster), and every path exact against torch."""

import dataclasses

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples
from codegen import hostir as hir
from codegen.interp import races
from codegen.runtime.dispatch import dispatch
from codegen.transforms import cost

# bench_copy on the H200 (benchmarks/RESULTS.md, "Split contraction, copy stream, dense
# slices"): bf16 x [m, 8192] @ w [8192, 8192], op / floor of the column loop (copy
# stream) and of the split contraction, by shape and S.
MEASURED = {
    ("balanced", 12288): {2: (0.993, 1.017), 4: (1.165, 1.065), 8: (1.451, 1.132),
                          16: (2.223, 1.538)},
    ("copy-bound", 3072): {2: (0.785, 0.792), 4: (1.034, 0.911), 8: (1.363, 0.996),
                           16: (2.165, 1.053)},
    ("GEMM-bound", 37632): {2: (0.808, 0.859), 4: (0.954, 1.081), 8: (1.064, 1.329),
                            16: (1.180, 1.816)},
}
ROWS = [(shape, m, s, *ratios) for (shape, m), by_s in MEASURED.items()
        for s, ratios in by_s.items()]


def weights(m="m", k="k", n="n", slices=4, dtype=torch.float32, name="weights"):
    """x [m, k] @ w [k, n] (w in host memory), output columns in ``slices`` slices."""
    with cg.Fusion(name) as f:
        out = cg.matmul(cg.input([m, k], dtype, name="x"),
                        cg.input([k, n], dtype, name="w", device="cpu"))
        cg.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    return f


def comment(program):
    """The comment under the signature, its lines joined."""
    lines = str(program).splitlines()[1:]
    return " ".join(line.removeprefix("  # ") for line in lines if line.startswith("  # "))


@pytest.mark.parametrize(("shape", "m", "slices", "columns", "rows"), ROWS)
def test_the_model_picks_the_loop_measured_faster(shape, m, slices, columns, rows):
    """The rows the constants were chosen against (cost.py's docstring): a check that a
    change of the model keeps them, not evidence of its accuracy elsewhere (the tests
    below check what holds whatever the constants)."""
    estimate = cost.streamed_matmul(m, 8192, 8192, slices, 8192 // slices, torch.bfloat16,
                                    torch.bfloat16)
    assert cost.prefer_rows([estimate]) == (rows < columns)


DTYPES = [torch.bfloat16, torch.float32]
# From the H200's data sheet, not from any measurement the model was fitted to: PCIe 5 x16
# moves at most 64 GB/s one way; dense GEMMs peak at 989 TFLOP/s in bf16, 67 in fp32.
PCIE_BYTES_PER_MS = 64e9 / 1e3
PEAK_FLOPS_PER_MS = {torch.bfloat16: 989e12 / 1e3, torch.float32: 67e12 / 1e3}


def both(m, k, n, slices, dtype=torch.bfloat16):
    """The two estimates with ``n`` in ``slices`` column blocks of equal width."""
    estimate = cost.streamed_matmul(m, k, n, slices, -(-n // slices), dtype, dtype)
    return estimate.columns_ms, estimate.rows_ms


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("slices", [1, 2, 4, 8, 16])
def test_estimates_are_milliseconds_above_what_the_hardware_allows(dtype, slices):
    """Neither loop can beat copying the weight at the bus's peak or the GEMM at the GPU's;
    with column blocks of 1 KiB or more and k >= 1024 (no loop made of tiny copies or
    dominated by output traffic) neither is estimated at ten times that: a unit off by a
    thousand (seconds, microseconds) fails both ways."""
    for m in (1, 64, 4096, 65536):
        for k in (1024, 8192):
            for block in (512, 1024, 4096, 8192):
                if block * dtype.itemsize < 1024:
                    continue
                n = slices * block
                floor = max(k * n * dtype.itemsize / PCIE_BYTES_PER_MS,
                            2 * m * k * n / PEAK_FLOPS_PER_MS[dtype])
                for ms in both(m, k, n, slices, dtype):
                    assert floor <= ms <= 10 * floor, (m, k, n, slices, ms, floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("slices", [1, 2, 3, 4, 8, 16, 32])
def test_more_work_is_never_estimated_faster(dtype, slices):
    """Both estimates are non-decreasing in m, in k, and in n (as wider column blocks of
    the same count: the copy grows, and its rows get no shorter)."""
    sizes = sorted({2**p for p in range(17)} | {3 * 2**p for p in range(15)})
    for k, block in ((64, 1), (1024, 64), (8192, 4096)):
        costs = [both(m, k, slices * block, slices, dtype) for m in sizes]
        assert all(a <= b for pair in zip(costs, costs[1:]) for a, b in zip(*pair)), (k, block)
    for m, block in ((1, 1), (512, 64), (65536, 4096)):
        costs = [both(m, k, slices * block, slices, dtype) for k in sizes]
        assert all(a <= b for pair in zip(costs, costs[1:]) for a, b in zip(*pair)), (m, block)
    for m, k in ((1, 64), (512, 1024), (65536, 8192)):
        costs = [both(m, k, slices * block, slices, dtype) for block in sizes]
        assert all(a <= b for pair in zip(costs, costs[1:]) for a, b in zip(*pair)), (m, k)


def test_the_clear_cases_pick_the_loop_that_must_win():
    """In 8 or 16 slices: copies short enough (1 or 0.5 KiB rows of bf16) and a GEMM too
    small to hide them, the dense row blocks, by far; a GEMM that dwarfs the copy, the
    columns, whose copies hide under it, not the row loop that reads and writes the whole
    output once a slice."""
    for slices in (8, 16):
        block = 8192 // slices
        copy_bound = cost.streamed_matmul(16, 8192, 8192, slices, block, torch.bfloat16,
                                          torch.bfloat16)
        assert copy_bound.columns_ms > 1.4 * copy_bound.rows_ms
        assert cost.prefer_rows([copy_bound])
        gemm_bound = cost.streamed_matmul(2**20, 8192, 8192, slices, block, torch.bfloat16,
                                          torch.bfloat16)
        assert gemm_bound.rows_ms > 1.3 * gemm_bound.columns_ms
        assert not cost.prefer_rows([gemm_bound])


def test_the_row_loop_pays_for_the_output_once_a_slice():
    """GEMM-bound, each slice of the row loop reads and writes the whole output: more
    slices, a longer row loop; the column loop's GEMMs cost the same however cut."""
    rows = [both(2**18, 8192, 8192, slices)[1] for slices in (2, 4, 8, 16)]
    assert all(a < b for a, b in zip(rows, rows[1:])), rows


def test_one_slice_is_a_dense_copy_either_way():
    one = cost.streamed_matmul(3072, 8192, 8192, 1, 8192, torch.bfloat16, torch.bfloat16)
    assert one.columns_ms < one.rows_ms and not cost.prefer_rows([one])


def test_row_efficiency_rises_with_row_length_through_the_measured_points():
    lengths = [2**p for p in range(4, 20)]
    shares = [cost.row_efficiency(b) for b in lengths]
    assert all(0 < a < b <= 1 for a, b in zip(shares, shares[1:]))
    for row_bytes, share in cost.ROW_EFFICIENCY:
        assert cost.row_efficiency(row_bytes) == pytest.approx(share)
    assert cost.row_efficiency(2**20) > 0.999


def test_known_extents_settle_the_columns_at_lowering():
    """GEMM-bound: the column loop alone, with its estimate printed."""
    program = cg.lower(weights(37632, 8192, 8192, 8, torch.bfloat16), split_contraction="auto")
    assert program.alternative is None and not program.split_contraction
    assert "accumulate=True" not in str(program)
    assert program.choice_str() == (
        "split_contraction=auto: T2 = x[37632, 8192] @ w[8192, 8192] in 8 slices; w streamed "
        "by blocks of columns: columns 6.73 ms, rows 8.63 ms estimated")
    assert comment(program) == program.choice_str()
    assert "[split_contraction=auto]" in str(program).splitlines()[0]


def test_known_extents_that_favour_rows_keep_the_columns_for_other_layouts():
    """Copy-bound: rows, estimated at lowering; the column loop stays as the program for a
    host weight that is not row-major (whose column blocks are the dense copies)."""
    program = cg.lower(weights(3072, 8192, 8192, 8, torch.bfloat16), split_contraction="auto")
    assert program.alternative is not None and program.alternative.split_contraction
    assert program.choice_str() == (
        "split_contraction=auto: T2 = x[3072, 8192] @ w[8192, 8192] in 8 slices; w streamed "
        "by blocks of rows (its alternative; columns 3.69 ms, rows 2.51 ms estimated), or of "
        "columns (this program) where w is not row-major")
    assert comment(program) == program.choice_str()
    x, w = torch.empty(3072, 8192), torch.empty(8192, 8192, dtype=torch.bfloat16)
    assert dispatch(program).for_inputs([x, w]) is program.alternative
    assert dispatch(program).for_inputs([x, w.t().contiguous().t()]) is program


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("slices", [1, 2, 3, 4, 8, 16])
def test_rows_are_chosen_below_one_threshold_of_m(dtype, slices):
    """What a traced call guards on: rows exactly for m below ``rows_below``."""
    for k, n in ((64, 64), (1024, 4096), (8192, 8192), (4096, 14336)):
        block = -(-n // slices)

        def rows_at(m, k=k, n=n, block=block):
            return cost.prefer_rows([cost.streamed_matmul(m, k, n, slices, block, dtype,
                                                          dtype)])

        below = cost.rows_below(rows_at)
        for e in range(0, 40):
            for m in (2**e - 1, 2**e, 3 * 2**e // 2):
                assert rows_at(m) == (m < below), (k, n, m, below)


def test_symbolic_extents_leave_the_choice_to_the_call():
    program = cg.lower(weights(dtype=torch.bfloat16), split_contraction="auto")
    columns, rows = program, program.alternative
    assert rows is not None and rows.split_contraction and not columns.split_contraction
    assert str(columns).endswith("\n  return T2\n" + str(rows))
    assert str(rows).startswith("HostProgram weights(") and "accumulate=True" in str(rows)
    assert comment(columns) == columns.choice_str()
    assert columns.choice_str().endswith(
        "w streamed by blocks of columns (this program) or of rows (its alternative), "
        "whichever codegen.transforms.cost estimates faster for the call's extents")
    big = {"k": 8192, "n": 8192}
    assert dispatch(program).for_extents({"m": 3072, **big}) is rows
    assert dispatch(program).for_extents({"m": 37632, **big}) is columns
    # fp32 GEMMs are an order of magnitude slower: the same extents keep their columns
    fp32 = cg.lower(weights(), split_contraction="auto")
    assert dispatch(fp32).for_extents({"m": 3072, **big}) is fp32


def test_no_candidate_means_no_choice():
    program = cg.lower(examples.offload_linear(torch.float32, 4), split_contraction="auto")
    assert program.choice is None and program.alternative is None
    assert str(program) == str(cg.lower(examples.offload_linear(torch.float32, 4)))


def both_results(program, x, w):
    """The column loop's and the row loop's results, which round bf16 differently."""
    columns = cg.evaluate(program.replace(alternative=None), [x, w])[0]
    rows = cg.evaluate(program.alternative, [x, w])[0]
    assert not torch.equal(columns, rows)  # else the tests below could not tell them apart
    return columns, rows


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("options", [{}, {"copy_stream": True}, {"staging": "ring"}],
                         ids=["slots", "copy_stream", "ring"])
def test_the_evaluator_runs_the_loop_picked(monkeypatch, rows, options):
    monkeypatch.setattr(cost, "prefer_rows", lambda costs: rows)
    program = cg.lower(weights(slices=4, dtype=torch.bfloat16), split_contraction="auto",
                       **options)
    torch.manual_seed(0)
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(64, 16).bfloat16()
    by_columns, by_rows = both_results(program, x, w)
    picked = dispatch(program).for_extents({"m": 8, "k": 64, "n": 16})
    assert picked is (program.alternative if rows else program)
    assert torch.equal(cg.evaluate(program, [x, w])[0], by_rows if rows else by_columns)
    xi, wi = ints(7, 20, dtype=torch.bfloat16), ints(20, 11, dtype=torch.bfloat16)
    races.check(program, [xi, wi])
    assert torch.equal(cg.evaluate(program, [xi, wi])[0], xi @ wi)


def test_a_host_operand_that_is_not_row_major_keeps_its_columns(monkeypatch):
    """Its column blocks are the dense copies: the rows are never picked for it."""
    monkeypatch.setattr(cost, "prefer_rows", lambda costs: True)
    program = cg.lower(weights(slices=4, dtype=torch.bfloat16), split_contraction="auto")
    torch.manual_seed(1)
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(64, 16).bfloat16()
    w_cols = w.t().contiguous().t()  # the same values, column-major
    by_columns, by_rows = both_results(program, x, w)
    assert dispatch(program).for_inputs([x, w]) is program.alternative
    assert dispatch(program).for_inputs([x, w_cols]) is program
    assert torch.equal(cg.evaluate(program, [x, w])[0], by_rows)
    assert torch.equal(cg.evaluate(program, [x, w_cols])[0], by_columns)


@pytest.mark.parametrize("rows", [True, False])
def test_the_checker_checks_the_loop_picked(monkeypatch, rows):
    """The row loop without the wait between its slices' sums: caught where it runs."""
    monkeypatch.setattr(cost, "prefer_rows", lambda costs: rows)
    program = cg.lower(weights(slices=4), split_contraction="auto", pool_size=2)
    racy = program.alternative.replace(body=[
        dataclasses.replace(n, body=[b for b in n.body if not isinstance(b, hir.WaitEvent)])
        if isinstance(n, hir.ForLoop) else n for n in program.alternative.body])
    program = program.replace(alternative=racy)
    inputs = [ints(3, 8), ints(8, 5)]
    if rows:
        with pytest.raises(cg.InternalError, match=r"write after write on T2"):
            races.check(program, inputs)
    else:
        races.check(program, inputs)


@pytest.mark.parametrize("rows", [True, False])
def test_gradients_through_either_choice(monkeypatch, rows):
    monkeypatch.setattr(cost, "prefer_rows", lambda costs: rows)
    x, w = ints(6, 16, dtype=torch.float64), ints(16, 12, dtype=torch.float64)
    program = cg.lower(weights(slices=4, dtype=torch.float64), split_contraction="auto")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    (y,) = cg.evaluate(program, [xg, wg])
    dy = ints(6, 12, dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(xg.grad, dy @ w.T) and torch.equal(wg.grad, x.T @ dy)


@pytest.mark.build
def test_compiled_op_builds_both_loops_and_picks_per_call(cache_dir, monkeypatch):
    op = cg.compile(weights(dtype=torch.bfloat16), split_contraction="auto")
    assert op.alternative is not None and op.alternative.host_ir is op.host_ir.alternative
    assert op.host_ir.split_contraction is False and op.alternative.host_ir.split_contraction

    def shaped(m):
        return [torch.empty(m, 8192, dtype=torch.bfloat16, device="meta"),
                torch.empty(8192, 8192, dtype=torch.bfloat16)]

    estimated = []

    def prefer_rows(costs, real=cost.prefer_rows):
        estimated.append(costs)
        return real(costs)

    monkeypatch.setattr(cost, "prefer_rows", prefer_rows)
    assert op.pick(shaped(3072)) is op.alternative
    assert op.pick(shaped(37632)) is op
    assert op.pick(shaped(3072)) is op.alternative
    assert len(estimated) == 2  # remembered per extents and layouts
    x, w = shaped(3072)
    assert op.pick([x, w.t().contiguous().t()]) is op  # a column-major w keeps its columns
    assert op.alternative.pick(shaped(37632)) is op.alternative
    # inputs it cannot read: the op itself, whose checks say what is wrong
    assert op.pick([x]) is op and op.pick([x.flatten(), w]) is op and op.pick([x, 3]) is op
    with pytest.raises(ValueError, match=r"argument w must have rank 2"):
        op(x, w[0])


def test_cli_shows_both_loops():
    from codegen.tools.cli import show

    text = show("stream_weights", "hostir", split_contraction="auto")
    assert text.count("HostProgram stream_weights(") == 2
    cpp = show("stream_weights", "cpp", split_contraction="auto")
    assert cpp.count("// @generated by codegen") == 2
    program = cg.lower(examples.stream_weights(), split_contraction="auto")
    assert "\n".join(f"// {line}" for line in program.choice_lines()) in cpp


@pytest.mark.build
def test_torch_compile_traces_the_loop_each_shape_picks(cache_dir):
    """Traced with m dynamic, the choice is one guard, m < threshold: calls below it share
    one graph (calling the row loop's op), calls above it another (the column loop's)."""
    op = cg.compile(weights(dtype=torch.bfloat16), split_contraction="auto")
    called: list[set[str]] = []

    def backend(gm, example_inputs):
        called.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    below = cost.choice_rows_below(op.host_ir.choice, "m", {"k": 8192, "n": 8192})
    assert 3072 < below < 37632
    f = torch.compile(lambda x, w: op(x, w), fullgraph=True, backend=backend, dynamic=True)
    w = torch.empty(8192, 8192, dtype=torch.bfloat16)
    for m, picked, graphs in ((3072, op.alternative, 1), (3000, op.alternative, 1),
                              (below - 1, op.alternative, 1), (below, op, 2),
                              (37632, op, 2)):
        y = f(torch.empty(m, 8192, dtype=torch.bfloat16, device="meta"), w)
        assert y.shape == (m, 8192) and len(called) == graphs, (m, len(called))
        assert any(picked.op_name in target for target in called[-1]), called[-1]
