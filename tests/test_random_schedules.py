"""Random schedules and shapes through lowering and the evaluator, against torch (exact),
and through the stream-order checker (codegen.races).

Seeded and bounded: each case draws an op, a stream axis, a chain of splits ending in a
stream-parallel outer part, and extents (including 0 and 1), then checks the values and
that every access of the host program is ordered. With ``placement``, each input and the
output also land in host memory or on the GPU at random (drawn from a separate generator,
so the schedules of the first test stay what they were), with and without a copy
stream."""

import random

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import hostir as hir
from codegen import races


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
               copy_stream: bool = False):
    kind, fusion, shapes = draw_case(rng, placement)
    program = cg.lower(fusion, pool_size=rng.choice([1, 2, 4]), copy_stream=copy_stream)
    xs = [ints(*s) for s in shapes]
    races.check(program, xs)
    (out,) = cg.evaluate(program, xs)
    if kind.startswith("linear"):
        expect = torch.nn.functional.linear(*xs)
    else:
        expect = torch.matmul(*xs)
    assert out.shape == expect.shape, (kind, shapes, str(program))
    assert torch.equal(out, expect), (kind, shapes, str(program))
    return program


@pytest.mark.parametrize("seed", range(60))
def test_random_schedule_matches_torch_and_is_ordered(seed):
    check_case(random.Random(seed))


@pytest.mark.parametrize("copy_stream", [False, True])
@pytest.mark.parametrize("seed", range(60))
def test_random_placement_matches_torch_and_is_ordered(seed, copy_stream):
    check_case(random.Random(seed), random.Random(1000 + seed), copy_stream)


def test_random_placements_exercise_the_copy_stream():
    """The copy-stream cases are not vacuous: many programs move copies onto it, with
    slots reused by later slices (Synchronize(Stream(i % pool)) on the copy stream)."""
    queued = reused = 0
    for seed in range(60):
        program = check_case(random.Random(seed), random.Random(1000 + seed), True)
        nodes = list(program.nodes())
        on_copier = [n for n in nodes if isinstance(n, hir.SetCurrentStream)
                     and isinstance(n.stream, hir.CopyStream)]
        queued += bool(on_copier)
        reused += any(isinstance(n, hir.Synchronize) and isinstance(n.stream, hir.Stream)
                      and n.stream.pool for n in nodes)
    assert queued >= 20 and reused >= 5, (queued, reused)
