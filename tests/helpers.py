"""Fusions used by several tests."""

import torch

import codegen as cg
from codegen import hostir as hir


def stream_matmul_columns(m=5, k=7, n=6, slices=3, dtype=torch.float32):
    """nvFuser's StreamTest.Matmul: out columns split ``slices`` ways on streams."""
    with cg.Fusion("matmul_n") as fusion:
        inp = cg.input([m, k], dtype)
        w = cg.input([k, n], dtype)
        out = cg.matmul(inp, w)
        cg.output(out)
    out.outer_split(1, slices)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    return fusion


def stream_matmul_rows(m="m", k="k", n="n", slices=4, dtype=torch.float32, name="matmul_m"):
    with cg.Fusion(name) as fusion:
        inp = cg.input([m, k], dtype)
        w = cg.input([k, n], dtype)
        out = cg.matmul(inp, w)
        cg.output(out)
    out.outer_split(0, slices)
    out.axis(0).parallelize(cg.ParallelType.Stream)
    return fusion


def two_matmuls(inlinable: bool, slices=(2, 3)):
    """t2 = (inp @ w1) @ w2. Inlinable: rows of t2 on streams. Not: columns of t1, then
    rows of t2."""
    with cg.Fusion("two_matmuls" if inlinable else "two_matmuls_not_inlinable") as fusion:
        inp = cg.input(["m", "k"])
        w1 = cg.input(["k", "n"])
        w2 = cg.input(["n", "p"])
        t1 = cg.matmul(inp, w1)
        t2 = cg.matmul(t1, w2)
        cg.output(t2)
    t2.outer_split(0, slices[0])
    t2.axis(0).parallelize(cg.ParallelType.Stream)
    if not inlinable:
        t1.outer_split(1, slices[1])
        t1.axis(1).parallelize(cg.ParallelType.Stream)
    return fusion


def stream_loops(program):
    return [n for n in program.nodes()
            if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream]
