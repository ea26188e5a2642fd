"""Fusions used by several tests: the bundled examples, with sizes as parameters."""

import torch

import codegen as cg
from codegen import examples


def stream_matmul_columns(m=5, k=7, n=6, slices=3):
    """nvFuser's StreamTest.Matmul: out columns split ``slices`` ways on streams."""
    return examples.stream_matmul_n(m, k, n, slices)


def stream_matmul_rows(slices=4, dtype=torch.float32):
    """[m, k] @ [k, n], symbolic extents, output rows in ``slices`` stream slices."""
    return examples.matmul_rows(dtype, slices)


def two_matmuls(inlinable: bool):
    """t2 = (inp @ w1) @ w2. Inlinable: rows of t2 on streams (2 slices). Not: columns of
    t1 (3 slices), then rows of t2 (2 slices)."""
    return examples.two_matmuls() if inlinable else examples.two_matmuls_not_inlinable()


def stream_loops(program):
    return [n for n in program.nodes()
            if isinstance(n, cg.hostir.ForLoop) and n.parallel is cg.ParallelType.Stream]
