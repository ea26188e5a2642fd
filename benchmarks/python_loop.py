"""The reference: the hand-written PyTorch stream loop that users write today.

One GEMM slice per stream, forked from and joined back to the caller's stream. This is
what the generated op replaces; keep it idiomatic, not deliberately slow.
"""

from __future__ import annotations

import torch


class PythonStreamLoop:
    """``out = a @ b`` with the rows of ``out`` in ``slices`` slices on a pool of streams."""

    def __init__(self, slices: int, pool: int = 4) -> None:
        self.slices = slices
        self.streams = [torch.cuda.Stream() for _ in range(min(slices, pool))]

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m = a.shape[0]
        out = torch.empty(m, b.shape[1], device=a.device, dtype=a.dtype)
        chunk = -(-m // self.slices)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i in range(self.slices):
            with torch.cuda.stream(self.streams[i % len(self.streams)]):
                rows = slice(i * chunk, min((i + 1) * chunk, m))
                torch.matmul(a[rows], b, out=out[rows])
        for s in self.streams:
            main.wait_stream(s)
        return out


class PythonStreamLinear:
    """``out = x @ w.T + bias`` (``F.linear``) with the rows of ``out`` in ``slices`` slices
    on a pool of streams; each slice is one ``torch.addmm`` (what ``F.linear`` calls for
    2-D inputs) into its rows of the output."""

    def __init__(self, slices: int, pool: int = 4) -> None:
        self.slices = slices
        self.streams = [torch.cuda.Stream() for _ in range(min(slices, pool))]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = torch.empty(m, w.shape[0], device=x.device, dtype=x.dtype)
        chunk = -(-m // self.slices)
        wt = w.t()
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i in range(self.slices):
            with torch.cuda.stream(self.streams[i % len(self.streams)]):
                rows = slice(i * chunk, min((i + 1) * chunk, m))
                torch.addmm(bias, x[rows], wt, out=out[rows])
        for s in self.streams:
            main.wait_stream(s)
        return out
