"""One-off measurements, each answering one question (``README.md`` here: the question, the
date and the answer). Run from the checkout's root as ``python -m benchmarks.probes.<name>``;
what they share with the benchmarks comes from ``benchmarks.common``."""
