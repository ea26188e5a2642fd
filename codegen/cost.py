"""Estimates of a stream loop's GPU time, for a choice between two loops that compute the
same thing.

The one choice made with it: a matmul ``out [m, n] = a [m, k] @ b [k, n]`` whose ``b``
lives in host memory (row-major) and is read by the loop in blocks of columns can instead
stream ``b`` by blocks of rows, each slice adding its product onto the whole output (the
split contraction, ``passes.split_contractions``). A block of columns is a 2-D copy of
short rows, which the copy engine moves slower the shorter the rows; a block of rows is one
dense copy, but every slice reads and writes the whole output::

    columns  ~ max(copy(b) / efficiency(bytes of one row of a block), gemm)
    rows     ~ max(copy(b), gemm + 2 * slices * bytes(out) / HBM bandwidth)

``copy(b)`` is b's bytes at the pinned host-to-device rate, ``gemm`` the whole product's
flops at the GEMM rate. Both loops also pay one slice's copy before the first GEMM and one
slice's GEMM after the last copy, the same for both, left out. Rows are chosen only when
they are estimated at least ``MARGIN`` faster: the estimate leaves out that a split
contraction's thinner GEMMs run a little less efficiently and round a bf16 output once per
slice.

The constants are the H200's (benchmarks/RESULTS.md, "Weights streamed from pinned host
memory"): dense copies at 55.3 GB/s; a block of columns copied under GEMMs (on the copy
stream) reached 0.93 / 0.81 / 0.66 / 0.435 of that with rows of 8 / 4 / 2 / 1 KiB
(the copy-bound shape, S = 2 / 4 / 8 / 16); bf16 GEMMs ran at 805 TFLOP/s (x [12288,
8192] @ w [8192, 8192] in 2.05 ms). The HBM bandwidth and the fp32 GEMM rate are the
H200's data-sheet figures (4.8 TB/s; 67 TFLOP/s, of which 90% is taken), not measured here.
Against that table (balanced, copy-bound and GEMM-bound shapes, S = 2 / 4 / 8 / 16) the
rule picks the loop measured faster in every row; ``tests/test_cost.py`` holds the table.
"""

from __future__ import annotations

import dataclasses
import math

import torch

COPY_BYTES_PER_MS = 55.3e6  # pinned host-to-device, dense
HBM_BYTES_PER_MS = 4.8e9
GEMM_FLOPS_PER_MS = {torch.bfloat16: 805e9, torch.float16: 805e9, torch.float32: 60e9}
# Share of the dense copy rate that a 2-D copy of rows of this many bytes reached.
ROW_EFFICIENCY = ((1024, 0.435), (2048, 0.66), (4096, 0.81), (8192, 0.93))
MARGIN = 1.10


def row_efficiency(row_bytes: int) -> float:
    """The share of the dense copy rate that a 2-D copy of ``row_bytes``-long rows
    reaches: measured points, interpolated in log2(row bytes); below the shortest, a
    fixed cost per row (the rate falls in proportion); above the longest, the shortfall
    shrinks in proportion until the copy is dense."""
    (lo, e_lo), (hi, e_hi) = ROW_EFFICIENCY[0], ROW_EFFICIENCY[-1]
    if row_bytes <= 0:
        return e_lo
    if row_bytes <= lo:
        return e_lo * row_bytes / lo
    if row_bytes >= hi:
        return 1.0 - (1.0 - e_hi) * hi / row_bytes
    for (b0, e0), (b1, e1) in zip(ROW_EFFICIENCY, ROW_EFFICIENCY[1:]):
        if row_bytes <= b1:
            t = (math.log2(row_bytes) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return e0 + t * (e1 - e0)
    raise AssertionError("unreachable: row_bytes lies in the table's range")


@dataclasses.dataclass(frozen=True)
class StreamedMatmulCost:
    """Estimated milliseconds of the two loops of one streamed matmul."""

    columns_ms: float
    rows_ms: float


def streamed_matmul(m: int, k: int, n: int, slices: int, column_block: int,
                    dtype: torch.dtype, out_dtype: torch.dtype) -> StreamedMatmulCost:
    """The two estimates for ``out [m, n] = a [m, k] @ b [k, n]``, ``b`` (``dtype``) in
    host memory, in ``slices`` slices of ``column_block`` columns (or of rows)."""
    item, out_item = dtype.itemsize, out_dtype.itemsize
    copy = k * n * item / COPY_BYTES_PER_MS
    gemm = 2.0 * m * k * n / GEMM_FLOPS_PER_MS.get(dtype, GEMM_FLOPS_PER_MS[torch.float32])
    output_traffic = 2.0 * slices * m * n * out_item / HBM_BYTES_PER_MS
    columns = max(copy / row_efficiency(column_block * item), gemm)
    rows = max(copy, gemm + output_traffic)
    return StreamedMatmulCost(columns, rows)


def prefer_rows(costs: list[StreamedMatmulCost]) -> bool:
    """Whether the loops that stream by rows are, together, at least ``MARGIN`` faster."""
    columns = sum(c.columns_ms for c in costs)
    rows = sum(c.rows_ms for c in costs)
    return columns > MARGIN * rows
