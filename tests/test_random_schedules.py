"""Random schedules and shapes through lowering and the evaluator, against torch (exact),
and through the stream-order checker (codegen.interp.races).

Seeded and bounded: each case draws an op, a stream axis, a chain of splits ending in a
stream-parallel outer part, and extents (including 0 and 1), then checks the values and
that every access of the host program is ordered. With ``placement``, each input and the
output also land in host memory or on the GPU at random (drawn from a separate generator,
so the schedules of the first test stay what they were), with and without a copy
stream, and with both loops of ``split_contraction="auto"`` where a program has a choice."""

import random

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import hostir as hir
from codegen.interp import races


def draw_case(rng: random.Random, placement: random.Random | None = None):
    def inp(shape):
        device = placement.choice(["cuda", "cpu"]) if placement else "cuda"
        return cg.input(shape, device=device)

    kind = rng.choice(["mm", "bmm", "bmm2", "linear", "linear_bias", "linear3d"])
    with cg.Fusion("random") as fusion:
        if kind == "mm":
            ins = [inp(["m", "k"]), inp(["k", "n"])]
            out = cg.matmul(*ins)
        elif kind in ("bmm", "bmm2"):
            ins = [inp(["b", "m", "k"]),
                   inp(["b", "k", "n"] if kind == "bmm" else ["k", "n"])]
            out = cg.matmul(*ins)
        elif kind == "linear3d":
            ins = [inp(["b", "m", "k"]), inp(["n", "k"]), inp(["n"])]
            out = cg.linear(*ins)
        else:
            ins = [inp(["m", "k"]), inp(["n", "k"])]
            if kind == "linear_bias":
                ins.append(inp(["n"]))
            out = cg.linear(*ins)
        cg.output(out, device=placement.choice(["cuda", "cpu"]) if placement else "cuda")
    axis = rng.randrange(out.ndim)
    for _ in range(rng.choice([1, 1, 2])):  # one split, sometimes a nested one
        if rng.random() < 0.5:
            out.outer_split(axis, rng.randint(1, 6))
        else:
            out.split(axis, rng.randint(1, 6))
    out.axis(axis).parallelize(cg.ParallelType.Stream)
    if rng.random() < 0.3:  # the stream axis need not be in front
        out.reorder({axis: len(out.loop) - 1})
    sizes = {s: rng.choice([0, 1, 2, 3, 5, 8, 13]) for s in "bmkn"}
    shapes = [[sizes[str(e)] for e in t.shape] for t in fusion.inputs]
    return kind, fusion, shapes


def check_case(rng: random.Random, placement: random.Random | None = None,
               copy_stream: bool = False, staging: str = "slots",
               split_contraction: bool | str = False):
    """Lowers a drawn case and checks it (and, where it has one, its alternative loop)."""
    kind, fusion, shapes = draw_case(rng, placement)
    program = cg.lower(fusion, pool_size=rng.choice([1, 2, 4]), copy_stream=copy_stream,
                       staging=staging, split_contraction=split_contraction)
    xs = [ints(*s) for s in shapes]
    if kind.startswith("linear"):
        expect = torch.nn.functional.linear(*xs)
    else:
        expect = torch.matmul(*xs)
    for variant in (program.replace(alternative=None), program.alternative):
        if variant is None:
            continue
        races.check(variant, xs)
        (out,) = cg.evaluate(variant, xs)
        assert out.shape == expect.shape, (kind, shapes, str(variant))
        assert torch.equal(out, expect), (kind, shapes, str(variant))
    return program


@pytest.mark.parametrize("seed", range(60))
def test_random_schedule_matches_torch_and_is_ordered(seed):
    check_case(random.Random(seed))


@pytest.mark.parametrize("staging", ["slots", "copy_stream", "ring"])
@pytest.mark.parametrize("seed", range(60))
def test_random_placement_matches_torch_and_is_ordered(seed, staging):
    check_case(random.Random(seed), random.Random(1000 + seed), staging == "copy_stream",
               "ring" if staging == "ring" else "slots")


@pytest.mark.parametrize("seed", range(60))
def test_random_placement_with_the_contraction_choice_is_exact_and_ordered(seed):
    """split_contraction="auto": both loops of every program that has a choice."""
    check_case(random.Random(seed), random.Random(1000 + seed), seed % 2 == 1, "slots", "auto")


@pytest.mark.parametrize("seed", range(40))
def test_random_contraction_choices_are_exact_and_ordered(seed):
    """x @ w with w in host memory and the output's columns on streams (random splits,
    pools, copy stream or ring, x on either side, extents from 0): both loops of the
    choice match torch and are stream-ordered."""
    rng = random.Random(seed)
    with cg.Fusion("choice") as fusion:
        x = cg.input(["m", "k"], device=rng.choice(["cuda", "cpu"]))
        out = cg.matmul(x, cg.input(["k", "n"], device="cpu"))
        cg.output(out)
    for _ in range(rng.choice([1, 1, 2])):
        if rng.random() < 0.5:
            out.outer_split(1, rng.randint(1, 6))
        else:
            out.split(1, rng.randint(1, 6))
    out.axis(1).parallelize(cg.ParallelType.Stream)
    staging, copy_stream = rng.choice([("slots", False), ("slots", True), ("ring", True)])
    program = cg.lower(fusion, pool_size=rng.choice([1, 2, 4]), copy_stream=copy_stream,
                       staging=staging, split_contraction="auto")
    assert program.alternative is not None and program.alternative.split_contraction
    m, k, n = (rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(3))
    xs = [ints(m, k), ints(k, n)]
    for variant in (program.replace(alternative=None), program.alternative):
        races.check(variant, xs)
        (y,) = cg.evaluate(variant, xs)
        assert torch.equal(y, xs[0] @ xs[1]), str(variant)


def test_random_placements_exercise_the_ring():
    """The ring cases are not vacuous: many programs take ring slots, and every one is
    released after its last reader (``races`` checks that) on the slice's worker."""
    ringed = 0
    for seed in range(60):
        program = check_case(random.Random(seed), random.Random(1000 + seed), staging="ring")
        nodes = list(program.nodes())
        taken = [n for n in nodes if isinstance(n, hir.RingSlot)]
        released = [n for n in nodes if isinstance(n, hir.ReleaseRingSlot)]
        assert len(taken) == len(released), str(program)
        ringed += bool(taken)
        # Never forked: nothing orders the ring stream after the caller's stream.
        for a, b in zip(nodes, nodes[1:]):
            assert not (isinstance(a, hir.SetCurrentStream) and isinstance(a.stream, hir.RingStream)
                        and isinstance(b, hir.Synchronize) and b.stream == hir.MAIN_STREAM)
    assert ringed >= 20, ringed


def test_random_placements_exercise_the_copy_stream():
    """The copy-stream cases are not vacuous: many programs move copies onto it, with
    slots reused by later slices (the copy stream waits for a slot's last reader's event)."""
    queued = reused = 0
    for seed in range(60):
        program = check_case(random.Random(seed), random.Random(1000 + seed), True)
        nodes = list(program.nodes())
        on_copier = [n for n in nodes if isinstance(n, hir.SetCurrentStream)
                     and isinstance(n.stream, hir.CopyStream)]
        queued += bool(on_copier)
        reused += any(isinstance(n, hir.WaitEvent) for n in nodes)
    assert queued >= 20 and reused >= 5, (queued, reused)


def draw_layer(rng: random.Random):
    """A GEMM followed by a random chain of exact elementwise ops (add and mul of a tensor
    of the output's shape or of a bias, a cast through float64 and back), scheduled on a
    random tensor of the chain: the split propagates through the elementwise ops both
    ways and the fusion pass merges what it can."""
    steps: list[str] = []
    with cg.Fusion("random_layer") as fusion:
        ins = [cg.input(["m", "k"]), cg.input(["n", "k"])]
        first = ins[0]
        if rng.random() < 0.3:  # a pointwise op before the GEMM (a residual)
            ins.append(cg.input(["m", "k"]))
            first = cg.add(ins[0], ins[2])
        t = cg.linear(first, ins[1])
        if rng.random() < 0.3:  # an activation after it (the GEMM's epilogue)
            t = cg.relu(t)
            steps.append("relu")
        chain = [t]
        for _ in range(rng.randint(1, 4)):
            step = rng.choice(["add", "mul", "add_bias", "mul_bias", "cast"])
            if step == "cast":
                t = cg.cast(cg.cast(t, torch.float64), torch.float32)
            else:
                other = cg.input(["n"] if step.endswith("bias") else ["m", "n"])
                ins.append(other)
                t = (cg.add if step.startswith("add") else cg.mul)(t, other)
            steps.append(step)
            chain.append(t)
        cg.output(t)
    target = rng.choice(chain)
    axis = rng.randrange(2)
    target.outer_split(axis, rng.randint(1, 5))
    target.axis(axis).parallelize(cg.ParallelType.Stream)
    sizes = {s: rng.choice([0, 1, 2, 3, 5, 8]) for s in "mkn"}
    shapes = [[sizes[str(e)] for e in x.shape] for x in fusion.inputs]
    return fusion, steps, shapes


def reference(steps, xs, residual):
    t = torch.nn.functional.linear(xs[0] + xs[2] if residual else xs[0], xs[1])
    others = iter(xs[3:] if residual else xs[2:])
    for step in steps:
        if step == "relu":
            t = torch.relu(t)
        elif step == "cast":
            t = t.double().float()
        else:
            t = t + next(others) if step.startswith("add") else t * next(others)
    return t


@pytest.mark.parametrize("seed", range(40))
def test_random_layer_matches_torch_and_is_ordered(seed):
    rng = random.Random(seed)
    fusion, steps, shapes = draw_layer(rng)
    program = cg.lower(fusion, pool_size=rng.choice([1, 2, 4]))
    xs = [ints(*s, lo=-3, hi=4) for s in shapes]
    races.check(program, xs)
    (out,) = cg.evaluate(program, xs)
    residual = any(op.defn.name == "add" and op.args.get("a") is fusion.inputs[0]
                   for op in fusion.ops)
    expect = reference(steps, xs, residual)
    assert torch.equal(out, expect), (steps, shapes, str(program))


def test_random_layers_fuse_and_loop():
    """The random layers are not vacuous: many fuse elementwise ops into one node, and
    many run the GEMM and the elementwise ops in one stream loop."""
    fused = looped = 0
    for seed in range(40):
        fusion, _, _ = draw_layer(random.Random(seed))
        program = cg.lower(fusion)
        computes = [n for n in program.nodes() if isinstance(n, hir.Compute)]
        fused += any(isinstance(a, hir.Apply) for n in computes for a in n.expr.args)
        looped += any(isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream
                      and sum(isinstance(c, hir.Compute) for c in n.body) >= 2
                      for n in program.nodes())
    assert fused >= 15 and looped >= 10, (fused, looped)
