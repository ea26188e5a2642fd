"""Transforms of fusions: the fusion passes (schedule, segments, allocations, the host
program built from them), the cost model of the contraction choice, the gradient
derivation, and the driver that runs them in order (``lowering.lower``)."""
