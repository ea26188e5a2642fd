"""Interleaved measurement, the pure-Python part: round orders, repetition counts, and
summaries (median of per-round ratios, with their spread). No GPU and no torch here.

Why interleaved: the H200 power-caps within about a second of sustained GEMMs, and then
drifts by a few percent from block to block, so a variant timed after another one is
timed on a different card. Each round times every variant once (in a rotated order), and
each ratio is taken inside a round, between neighbours in time, before its median over
the rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: ``items`` rotated left by the round index, so
    over ``len(items)`` rounds every item runs once in every position.

    >>> rotated("abc", 1)
    ['b', 'c', 'a']
    """
    if not items:
        return []
    r = round_index % len(items)
    return list(items[r:]) + list(items[:r])


def reps_for(estimate_ms: float, block_ms: float, min_reps: int, max_reps: int) -> int:
    """Calls per timed block so that one block lasts about ``block_ms`` of GPU time,
    within [min_reps, max_reps]."""
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError(f"reps_for: need 1 <= min_reps <= max_reps, got {min_reps}, {max_reps}")
    if not estimate_ms > 0 or math.isinf(estimate_ms):
        return min_reps
    return max(min_reps, min(max_reps, math.ceil(block_ms / estimate_ms)))


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with linear interpolation between order statistics; for one value,
    that value three times."""
    if not values:
        raise ValueError("quartiles: no values")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``."""
    q1, med, q3 = quartiles(values)
    return {"median": med, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def per_round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """``num[i] / den[i]`` for each round i (both timed in round i)."""
    if len(num) != len(den):
        raise ValueError(f"per_round_ratios: {len(num)} numerator rounds but {len(den)} "
                         "denominator rounds; both must come from the same rounds")
    if any(d <= 0 for d in den):
        raise ValueError("per_round_ratios: a denominator time is <= 0")
    return [n / d for n, d in zip(num, den)]


def ratio_fields(name: str, num: Sequence[float], den: Sequence[float]) -> dict[str, object]:
    """Row fields of one ratio: ``name`` is the median of per-round ratios (NOT the ratio of
    medians), ``name_iqr`` [q1, q3] and ``name_range`` [min, max] their spread.

    >>> ratio_fields("op_ratio", [2.0, 3.0, 4.0], [1.0, 1.0, 2.0])["op_ratio"]
    2.0
    """
    s = spread(per_round_ratios(num, den))
    return {name: s["median"], f"{name}_iqr": [s["q1"], s["q3"]],
            f"{name}_range": [s["min"], s["max"]]}


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"8192"`` -> (8192, 8192, 8192); ``"16384x8192x1024"`` -> (16384, 8192, 1024)."""
    parts = text.lower().replace("^3", "").replace("³", "").split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"shape {text!r}: expected N or MxNxK with integers") from None
    if len(dims) == 1:
        dims *= 3
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"shape {text!r}: expected N or MxNxK with positive integers")
    return dims[0], dims[1], dims[2]


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); positive integers only."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected a comma-separated list of integers") \
            from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} {text!r}: expected positive integers")
    return values
