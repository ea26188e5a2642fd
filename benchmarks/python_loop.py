"""The reference: the hand-written PyTorch stream loop that users write today.

One GEMM slice per stream, forked from and joined back to the caller's stream. This is
what the generated op replaces; keep it idiomatic, not deliberately slow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _StreamRows:
    """The rows of an output in ``slices`` slices, slice i on stream i % pool."""

    def __init__(self, slices: int, pool: int = 4) -> None:
        self.slices = slices
        self.streams = [torch.cuda.Stream() for _ in range(min(slices, pool))]

    def run(self, m: int, gemm: Callable[[slice], object]) -> None:
        """Forks the streams from the caller's, calls ``gemm(rows)`` for each slice on its
        stream, and joins them back."""
        chunk = -(-m // self.slices)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i in range(self.slices):
            with torch.cuda.stream(self.streams[i % len(self.streams)]):
                gemm(slice(i * chunk, min((i + 1) * chunk, m)))
        for s in self.streams:
            main.wait_stream(s)


class PythonStreamLoop(_StreamRows):
    """``out = a @ b`` with the rows of ``out`` in ``slices`` slices on a pool of streams."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
        self.run(a.shape[0], lambda rows: torch.matmul(a[rows], b, out=out[rows]))
        return out


class PythonStreamLinear(_StreamRows):
    """``out = x @ w.T + bias`` (``F.linear``) with the rows of ``out`` in ``slices`` slices
    on a pool of streams; each slice is one ``torch.addmm`` (what ``F.linear`` calls for
    2-D inputs) into its rows of the output."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        wt = w.t()
        self.run(x.shape[0], lambda rows: torch.addmm(bias, x[rows], wt, out=out[rows]))
        return out
