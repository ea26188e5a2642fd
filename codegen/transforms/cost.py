"""Estimates of a stream loop's GPU time, for a choice between two loops that compute the
same thing.

The one choice made with it: a matmul ``out [m, n] = a [m, k] @ b [k, n]`` whose ``b``
lives in host memory (row-major) and is read by the loop in blocks of columns can instead
stream ``b`` by blocks of rows, each slice adding its product onto the whole output (the
split contraction, ``passes.split_contractions``). A block of columns is a 2-D copy of
short rows, which the copy engine moves slower the shorter the rows; a block of rows is one
dense copy, but every slice reads and writes the whole output. Each loop is a two-stage
pipeline (copy, then GEMM, per slice), estimated as its longer stage plus one slice of the
shorter (the first copy before any GEMM, or the last GEMM after every copy)::

    columns  ~ max(Cc, G) + min(Cc, G) / slices,   Cc = copy(b) / efficiency(row bytes)
    rows     ~ max(C, Gr) + min(C, Gr) / slices,   Gr = G + 2 * slices * bytes(out) / HBM

``C = copy(b)`` is b's bytes at the pinned host-to-device rate, ``G`` the whole product's
flops at the GEMM rate; a column block as wide as b (one slice) is a dense copy. Rows are
chosen only when estimated at least ``MARGIN`` faster: near a tie the column loop, which
rounds a bf16 output once instead of once per slice, is kept. A host operand that is not
row-major (a transposed or column-major ``b``) has dense column blocks already, and its
row blocks would be the 2-D copies: it keeps its columns (``prefers_rows``).

The constants are the H200's (benchmarks/RESULTS.md): dense copies at 55.3 GB/s; 2-D
copies traced under GEMMs at 49 / 37 / 24 GB/s with rows of 4 / 2 / 1 KiB (0.89 / 0.67 /
0.44 of dense), and within 5% of dense with 8 KiB rows (S = 2); bf16 GEMMs at 805 TFLOP/s
(x [12288, 8192] @ w [8192, 8192] in 2.05 ms). The HBM bandwidth and the fp32 GEMM rate
are the H200's data-sheet figures (4.8 TB/s; 67 TFLOP/s, of which 90% is taken), not
measured here. Against the loops measured on three shapes at S = 2 / 4 / 8 / 16 (balanced,
copy-bound, GEMM-bound) the estimated ratio of the two loops was within 0.1 of the measured
one in 10 of the 12 rows (0.15 and 0.18 too high at S = 16) and the rule picks the faster
loop in every row; ``tests/test_cost.py`` holds that table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch

from .. import hostir as hir
from ..frontend.ir import Sym

COPY_BYTES_PER_MS = 55.3e6  # pinned host-to-device, dense
HBM_BYTES_PER_MS = 4.8e9
GEMM_FLOPS_PER_MS = {torch.bfloat16: 805e9, torch.float16: 805e9, torch.float32: 60e9}
# Share of the dense copy rate that a 2-D copy of rows of this many bytes reached.
ROW_EFFICIENCY = ((1024, 0.44), (2048, 0.67), (4096, 0.89), (8192, 0.95))
MARGIN = 1.05


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
    """The two estimates for ``out [m, n] = a [m, k] @ b [k, n]``, ``b`` (``dtype``,
    row-major) in host memory, in ``slices`` slices of ``column_block`` columns (or of
    rows)."""
    copy = k * n * dtype.itemsize / COPY_BYTES_PER_MS
    gemm = 2.0 * m * k * n / GEMM_FLOPS_PER_MS.get(dtype, GEMM_FLOPS_PER_MS[torch.float32])
    output_traffic = 2.0 * slices * m * n * out_dtype.itemsize / HBM_BYTES_PER_MS
    efficiency = 1.0 if column_block >= n else row_efficiency(column_block * dtype.itemsize)
    return StreamedMatmulCost(_pipeline(copy / efficiency, gemm, slices),
                              _pipeline(copy, gemm + output_traffic, slices))


def _pipeline(copy: float, gemm: float, slices: int) -> float:
    """Copies feeding GEMMs slice by slice: the longer stage, plus one slice of the other."""
    return max(copy, gemm) + min(copy, gemm) / max(slices, 1)


def rows_below(prefer_rows_at: Callable[[int], bool], limit: int = 2**48) -> int:
    """The least m (rows of the output) from which the column loop is chosen, given
    whether rows are chosen at a given m: the choice is rows below a threshold and columns
    from it on (the column loop's 2-D copies cost the same at any m, the row loop's output
    traffic grows with m; ``tests/test_cost.py`` checks this over a grid of shapes).
    ``limit`` where rows are chosen for every m up to it."""
    lo, hi = 0, limit  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if prefer_rows_at(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def prefer_rows(costs: list[StreamedMatmulCost]) -> bool:
    """Whether the loops that stream by rows are, together, at least ``MARGIN`` faster."""
    columns = sum(c.columns_ms for c in costs)
    rows = sum(c.rows_ms for c in costs)
    return columns > MARGIN * rows


def matmul_cost(mm: hir.StreamedMatmul, env: Mapping[str, int]) -> StreamedMatmulCost:
    """The two estimates of one streamed matmul of a program, its extents bound by ``env``."""
    m, k, n, slices, column_block = (e.evaluate(env) for e in mm.extents())
    return streamed_matmul(m, k, n, slices, column_block, mm.dtype, mm.out_dtype)


def prefers_rows(choice: hir.ContractionChoice, env: Mapping[str, int],
                 row_major: Mapping[str, bool] | None = None) -> bool:
    """Whether blocks of rows are estimated faster for ``choice``'s loops at the extents
    ``env``; never where a host operand is not row-major (``row_major``, by name; all are
    where it is None): its column blocks are dense copies already."""
    if row_major is not None and not all(row_major.get(mm.host, True)
                                         for mm in choice.matmuls):
        return False
    return prefer_rows([matmul_cost(mm, env) for mm in choice.matmuls])


def choice_rows_below(choice: hir.ContractionChoice, m: str, env: Mapping[str, int],
                      row_major: Mapping[str, bool] | None = None) -> int | None:
    """The least value of the extent ``m`` from which ``choice`` takes blocks of columns,
    the other extents being ``env``: rows exactly below it. None where ``m`` is not every
    matmul's row count."""
    if any(mm.m != Sym(m) for mm in choice.matmuls):
        return None
    return rows_below(lambda v: prefers_rows(choice, {**env, m: v}, row_major))


def estimate_str(choice: hir.ContractionChoice, env: Mapping[str, int]) -> str:
    """Both loops' estimates, summed over ``choice``'s matmuls, as the host IR prints them."""
    costs = [matmul_cost(mm, env) for mm in choice.matmuls]
    columns, rows = sum(c.columns_ms for c in costs), sum(c.rows_ms for c in costs)
    return f"columns {columns:.2f} ms, rows {rows:.2f} ms estimated"
