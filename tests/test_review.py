"""The Python side of the runtime's promises: the evaluator's join on every exit, k = 0,
one input read with different splits, names. CPU, exact against torch."""

import contextlib

import pytest
import torch
from conftest import ints
from helpers import stream_loops, stream_matmul_rows, two_matmuls

import codegen as cg
from codegen import hostir as hir
from codegen.interp import evaluator

S = cg.ParallelType.Stream


# ---------------------------------------------------------------------------- item 1


class Fault(Exception):
    pass


def fault_at(monkeypatch, k):
    """Makes the k-th compute node (0-based) raise; returns the list that receives the
    interpreter, to read its stream log after the fault."""
    seen = []

    def hook(interp, node):
        seen.append(interp)
        if len(seen) == k + 1:
            raise Fault(f"fault at compute node {k}: {node}")

    monkeypatch.setattr(evaluator, "_fault_hook", hook)
    return seen


def unjoined_workers(log):
    """Workers whose last use as the current stream is not followed by the caller's
    stream waiting for them."""
    open_workers = set()
    for entry in log:
        if entry[0] == "set" and entry[1] is not None:
            open_workers.add(entry[1])
        elif entry[0] == "wait" and entry[1] is None:
            open_workers.discard(entry[2])
    return open_workers


@pytest.mark.parametrize("k", [0, 1, 2])
def test_fault_mid_loop_joins_every_worker_used_into_the_callers_stream(monkeypatch, k):
    program = cg.lower(stream_matmul_rows(slices=4))
    seen = fault_at(monkeypatch, k)
    with pytest.raises(Fault, match=f"fault at compute node {k}"):
        cg.evaluate(program, [ints(8, 3), ints(3, 5)])
    streams = seen[0].streams
    # Slices 0..k ran on workers 0..k; the fork touched all 4. The program's own join
    # never ran; the guard's did: the caller's stream is current and waits for each.
    assert streams.current is None
    assert not streams.pending
    assert unjoined_workers(streams.log) == set()
    exit_at = streams.log.index(("set", None))
    assert streams.log[exit_at:] == [("set", None), ("wait", None, 0), ("wait", None, 1),
                                     ("wait", None, 2), ("wait", None, 3), ("exit",)]


@pytest.mark.parametrize("k", range(5))
def test_fault_in_any_of_two_loops_leaves_no_worker_unjoined(monkeypatch, k):
    program = cg.lower(two_matmuls(inlinable=False))  # loops of 3 and 2 slices
    seen = fault_at(monkeypatch, k)
    with pytest.raises(Fault):
        cg.evaluate(program, [ints(7, 4), ints(4, 5), ints(5, 3)])
    assert unjoined_workers(seen[0].streams.log) == set()
    assert seen[0].streams.current is None


def test_normal_exit_needs_no_extra_join(monkeypatch):
    """The program's own join orders the caller after the workers; the guard only makes
    the caller's stream current again (so the evaluator still checks the host IR's join)."""
    program = cg.lower(stream_matmul_rows(slices=2))
    seen = fault_at(monkeypatch, 99)
    a, b = ints(5, 3), ints(3, 4)
    (out,) = cg.evaluate(program, [a, b])
    assert torch.equal(out, a @ b)
    log = seen[0].streams.log
    assert log[-4:] == [("wait", None, 0), ("wait", None, 1), ("set", None), ("exit",)]
    assert not seen[0].streams.pending


class FakeCuda:
    """torch.cuda's current-device and current-stream state, for the guard on the CPU:
    set_stream makes the stream's device current, as torch.cuda.set_stream does."""

    class Stream:
        def __init__(self, name, index, waits):
            self.name, self.device, self.waits = name, torch.device("cuda", index), waits

        def wait_stream(self, other):
            self.waits.append((self.name, other.name))

    def __init__(self):
        self.device, self.waits = 0, []
        self.streams = {i: self.Stream(f"caller{i}", i, self.waits) for i in (0, 1)}

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: self.streams[torch.device(device).index])
        monkeypatch.setattr(torch.cuda, "set_stream", self.set_stream)
        monkeypatch.setattr(evaluator, "_worker_stream",
                            lambda device, k: self.Stream(f"worker{k}", device.index, self.waits))

    def set_device(self, index):
        self.device = index

    def set_stream(self, stream):
        self.device = stream.device.index
        self.streams[self.device] = stream


@pytest.mark.parametrize("fault", [False, True])
def test_guard_restores_the_callers_device_and_stream(monkeypatch, fault):
    """Item 9 on the CPU, with torch.cuda's state faked (tests/test_review_gpu.py has the
    real one, on 2 GPUs): evaluating on cuda:1 while cuda:0 is current."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    caller1 = cuda.streams[1]
    with pytest.raises(Fault) if fault else contextlib.nullcontext():
        with evaluator.Streams(torch.device("cuda", 1)) as streams:
            streams.set_current(0)
            streams.set_current(1)
            assert cuda.device == 1 and cuda.streams[1].name == "worker1"
            if fault:
                raise Fault("mid-loop")
            streams.set_current(None)
            streams.synchronize(0)
            streams.synchronize(1)
    assert cuda.device == 0
    assert cuda.streams[1] is caller1 and cuda.streams[0].name == "caller0"
    assert cuda.waits == [("caller1", "worker0"), ("caller1", "worker1")]


def test_fault_hook_is_unset_by_default():
    assert evaluator._fault_hook is None


# ---------------------------------------------------------------------------- item 3


def k0_fusion(kind):
    with cg.Fusion(kind) as fusion:
        if kind == "bmm2":
            ins = [cg.input(["b", "m", "k"]), cg.input(["k", "n"])]
            out = cg.matmul(*ins)
        elif kind == "bmm":
            ins = [cg.input(["b", "m", "k"]), cg.input(["b", "k", "n"])]
            out = cg.matmul(*ins)
        elif kind == "mm":
            ins = [cg.input(["m", "k"]), cg.input(["k", "n"])]
            out = cg.matmul(*ins)
        else:
            x = cg.input(["b", "m", "k"] if kind.startswith("linear3") else ["m", "k"])
            ins = [x, cg.input(["n", "k"])] + ([cg.input(["n"])] if kind.endswith("b") else [])
            out = cg.linear(*ins)
        cg.output(out)
    return fusion, out


K0_CASES = [(kind, axis) for kind in ("bmm2", "bmm", "linear3", "linear3b")
            for axis in (None, 0, 1, 2)]
K0_CASES += [(kind, axis) for kind in ("mm", "linear", "linearb") for axis in (None, 0, 1)]


@pytest.mark.parametrize("kind,axis", K0_CASES)
def test_empty_contraction_gives_zeros_or_bias(kind, axis):
    """torch.matmul(out=) folds 3-D x 2-D and raised for k = 0 on a row slice of 3-D."""
    fusion, out = k0_fusion(kind)
    if axis is not None:
        out.outer_split(axis, 2)
        out.axis(axis).parallelize(S)
    sizes = {"b": 2, "m": 3, "k": 0, "n": 4}
    xs = [ints(*[sizes[str(e)] for e in t.shape]) + 1 for t in fusion.inputs]
    expect = (torch.nn.functional.linear(*xs) if kind.startswith("linear")
              else torch.matmul(*xs))
    (got,) = cg.evaluate(cg.lower(fusion), xs)
    assert torch.equal(got, expect)


# ---------------------------------------------------------------------------- item 5


def shared_input_fusion(second=None):
    """t1 = a @ w1 (rows in 2 slices) and t2 = a @ w2, t2 split as ``second`` = (axis,
    factor) if given, else left to follow t1."""
    with cg.Fusion("shared_input") as fusion:
        a, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["k", "p"])
        t1, t2 = cg.matmul(a, w1), cg.matmul(a, w2)
        cg.output(t1)
        cg.output(t2)
    t1.outer_split(0, 2)
    t1.axis(0).parallelize(S)
    if second is not None:
        t2.outer_split(*second)
        t2.axis(second[0]).parallelize(S)
    return fusion


@pytest.mark.parametrize("second", [(1, 3), (0, 4)], ids=["columns3", "rows4"])
def test_one_input_read_with_different_splits_is_two_loops(second):
    program = cg.lower(shared_input_fusion(second))
    first, other = stream_loops(program)
    assert (str(first.stop), str(other.stop)) == ("2", str(second[1]))
    read_a = [[n.axis for n in loop.body if isinstance(n, hir.ShardByStream) and n.tensor == "T0"]
              for loop in (first, other)]
    assert read_a == [[0], [0] if second[0] == 0 else []]
    for m, k, n, p in [(7, 3, 5, 6), (1, 2, 1, 1), (0, 3, 2, 2), (5, 0, 3, 4)]:
        a, w1, w2 = ints(m, k), ints(k, n), ints(k, p)
        o1, o2 = cg.evaluate(program, [a, w1, w2])
        assert torch.equal(o1, a @ w1) and torch.equal(o2, a @ w2)
    # The input shows no split: its readers disagree.
    assert cg.schedule(shared_input_fusion(second)).inputs[0].stream_id() is None


def test_split_still_passes_through_an_input_to_its_other_readers():
    fusion = shared_input_fusion()
    program = cg.lower(fusion)
    (loop,) = stream_loops(program)  # t2 follows t1 through a: one loop, two matmuls
    assert sum(isinstance(n, hir.Matmul) for n in loop.body) == 2
    assert cg.schedule(fusion).inputs[0].loop[0].is_stream  # read one way: shown
    x, y, z = ints(5, 3), ints(3, 4), ints(3, 2)
    o1, o2 = cg.evaluate(program, [x, y, z])
    assert torch.equal(o1, x @ y) and torch.equal(o2, x @ z)


def test_a_split_the_user_put_on_an_input_is_still_a_requirement():
    with cg.Fusion("user_input") as fusion:
        a, w1, w2 = cg.input(["m", "k"]), cg.input(["k", "n"]), cg.input(["k", "p"])
        cg.output(cg.matmul(a, w1))
        t2 = cg.matmul(a, w2)
        cg.output(t2)
    a.outer_split(0, 2)
    a.axis(0).parallelize(S)
    t2.outer_split(1, 3)
    t2.axis(1).parallelize(S)
    with pytest.raises(cg.ScheduleError, match=r"conflicting stream splits: T0 axis 0 .*T4"):
        cg.lower(fusion)


# ---------------------------------------------------------------------------- item 6


def test_explicit_name_of_a_later_auto_name_is_skipped():
    with cg.Fusion("names") as fusion:
        a = cg.input(["m", "k"])
        w = cg.input(["k", "n"], name="T2")
        out = cg.matmul(a, w)
        cg.output(out)
    assert [t.name for t in fusion.tensors] == ["T0", "T2", "T3"]
    out.outer_split(0, 2)
    out.axis(0).parallelize(S)
    x, y = ints(5, 3), ints(3, 4)
    assert torch.equal(cg.evaluate(cg.lower(fusion), [x, y])[0], x @ y)


def test_explicit_name_already_taken_is_refused():
    with cg.Fusion("names"), pytest.raises(cg.ScheduleError, match="'T0' is already taken"):
        cg.input(["m"])
        cg.input(["m"], name="T0")


@pytest.mark.parametrize("name", ["", "1a", "a-b", "a b", "é", "a\n", 3])
def test_tensor_name_that_is_not_an_identifier_is_refused(name):
    with cg.Fusion("names"), pytest.raises(cg.ScheduleError, match="must be an identifier"):
        cg.input(["m"], name=name)


@pytest.mark.parametrize("extent", ["", "1a", "a-b", "n+1", "é"])
def test_extent_name_that_is_not_an_identifier_is_refused(extent):
    with cg.Fusion("names"), pytest.raises(
            cg.ScheduleError, match=r"input T0: extent name .* \(axis 1\) must be an identifier"):
        cg.input(["m", extent])


def test_cpp_words_and_generated_names_are_accepted_and_evaluate_right():
    """C++ keywords are the renderer's to mangle; the IR and the evaluator take them. An
    extent named like the loop index, a tensor named like a slice view."""
    with cg.Fusion("words") as fusion:
        a = cg.input(["i", "int"], name="and")
        a_view = cg.input(["i", "int"], name="and_i")
        w = cg.input(["int", "NULL"], name="op")
        t1, t2 = cg.matmul(a, w), cg.matmul(a_view, w)
        cg.output(t1)
        cg.output(t2)
    t1.outer_split(0, 3)
    t1.axis(0).parallelize(S)
    program = cg.lower(fusion)
    views = [n.out for n in program.nodes() if isinstance(n, hir.ShardByStream)]
    assert "and_i" not in views and len(views) == len(set(views))
    for i in (1, 5, 7):
        x, y, z = ints(i, 3), ints(i, 3), ints(3, 2)
        o1, o2 = cg.evaluate(program, [x, y, z])
        assert torch.equal(o1, x @ z) and torch.equal(o2, y @ z)


def test_extent_named_like_a_free_extent_is_refused():
    with cg.Fusion("free"), pytest.raises(
            cg.ScheduleError, match=r"extent name 'x_size0' \(axis 1\) is the name given to a "
                                    "free extent"):
        cg.input([None, "k"], name="x")
        cg.input(["k", "x_size0"])


def test_free_extent_skips_a_name_the_user_took():
    with cg.Fusion("free") as fusion:
        a = cg.input(["m", "x_size1"])
        x = cg.input(["x_size1", None], name="x")
        cg.output(cg.matmul(a, x))
    assert [str(e) for e in x.shape] == ["x_size1", "x_size1_2"]
    program = cg.lower(fusion)
    a_v, x_v = ints(2, 3), ints(3, 5)  # the free extent (5) differs from x_size1 (3)
    assert torch.equal(cg.evaluate(program, [a_v, x_v])[0], a_v @ x_v)


def test_a_failed_input_reserves_no_names():
    with cg.Fusion("free") as fusion:
        with pytest.raises(cg.ScheduleError, match="extent 1 must be >= 0"):
            cg.input([None, -1], name="x")
        cg.input(["x_size0"], name="y")  # x never existed: its free name is free
    assert [str(e) for e in fusion.inputs[0].shape] == ["x_size0"]


def test_stage_modules_are_not_shadowed_by_the_public_functions():
    """``cg.render`` and ``cg.build`` are functions (the public API); the stages that hold
    them are modules of their own names, importable as modules."""
    import importlib
    import inspect

    import codegen.backend.renderer as renderer_module
    import codegen.jit.op as op_module

    assert inspect.ismodule(op_module) and inspect.ismodule(renderer_module)
    assert cg.render is renderer_module.render and cg.build is op_module.build
    assert inspect.isfunction(cg.render) and inspect.isfunction(cg.build)
    for name in ("codegen.jit", "codegen.jit.op", "codegen.backend.renderer"):
        assert inspect.ismodule(importlib.import_module(name))
