"""Random schedules and shapes through lowering and the evaluator, against torch (exact).

Seeded and bounded: each case draws an op, a stream axis, a chain of splits ending in a
stream-parallel outer part, and extents (including 0 and 1), then checks the values."""

import random

import pytest
import torch
from conftest import ints

import codegen as cg


def draw_case(rng: random.Random):
    kind = rng.choice(["mm", "bmm", "bmm2", "linear", "linear_bias", "linear3d"])
    with cg.Fusion("random") as fusion:
        if kind == "mm":
            ins = [cg.input(["m", "k"]), cg.input(["k", "n"])]
            out = cg.matmul(*ins)
        elif kind in ("bmm", "bmm2"):
            ins = [cg.input(["b", "m", "k"]),
                   cg.input(["b", "k", "n"] if kind == "bmm" else ["k", "n"])]
            out = cg.matmul(*ins)
        elif kind == "linear3d":
            ins = [cg.input(["b", "m", "k"]), cg.input(["n", "k"]), cg.input(["n"])]
            out = cg.linear(*ins)
        else:
            ins = [cg.input(["m", "k"]), cg.input(["n", "k"])]
            if kind == "linear_bias":
                ins.append(cg.input(["n"]))
            out = cg.linear(*ins)
        cg.output(out)
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


@pytest.mark.parametrize("seed", range(60))
def test_random_schedule_matches_torch(seed):
    rng = random.Random(seed)
    kind, fusion, shapes = draw_case(rng)
    program = cg.lower(fusion, pool_size=rng.choice([1, 2, 4]))
    xs = [ints(*s) for s in shapes]
    (out,) = cg.evaluate(program, xs)
    if kind.startswith("linear"):
        expect = torch.nn.functional.linear(*xs)
    else:
        expect = torch.matmul(*xs)
    assert out.shape == expect.shape, (kind, shapes, str(program))
    assert torch.equal(out, expect), (kind, shapes, str(program))
