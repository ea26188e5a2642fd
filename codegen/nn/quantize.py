"""Weight-only quantization of offloaded Linears: fewer bytes over PCIe, dequantized on the
GPU between a span's copy and the GEMM piece that reads it.

Two forms, each one scale per group of a row, the scales in the weight's dtype:

- ``fp8``: ``float8_e4m3fn`` values, one scale per output row (the row's largest
  magnitude over 448, e4m3fn's largest finite value);
- ``int4``: symmetric integers in [-8, 7], one scale per group of ``INT4_GROUP`` input
  features (the group's largest magnitude over 7), two values a byte in the arena (the
  even feature in the low nibble).

The layer then computes ``F.linear(x, q.to(dtype) * scale)``, ``scale`` broadcast over its
group (the reference semantics: :func:`dequantize_reference`).

In the arena a quantized weight is ``out_features`` rows of ``row_bytes(...)`` bytes, each
its quantized values followed by its scales, so that a span of rows (a GEMM piece) carries
the scales it needs and a copy plan cuts quantized weights exactly as it cuts others.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InternalError

FORMATS = ("fp8", "int4")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT4_GROUP = 128
INT4_MAX = 7


def check_format(kind: object) -> str | None:
    """offload's ``quantize``: ``kind`` if it names a format (or is None), else a
    ValueError naming the choices."""
    if kind is None or kind in FORMATS:
        return kind  # type: ignore[return-value]
    raise ValueError(f"codegen.nn.offload: quantize must be None, 'fp8' or 'int4', got "
                     f"{kind!r}")


def unsupported(kind: str, in_features: int, dtype: torch.dtype) -> str | None:
    """Why a weight of ``in_features`` columns in ``dtype`` cannot be quantized to ``kind``
    (None where it can)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"its weight is {dtype}; quantize takes bfloat16, float16 or float32 weights"
    if kind == "int4" and in_features % INT4_GROUP:
        return (f"in_features = {in_features} is not a multiple of int4's group of "
                f"{INT4_GROUP} input features")
    if kind == "fp8" and in_features % dtype.itemsize:
        return (f"in_features = {in_features} is not a multiple of {dtype.itemsize} (each "
                "row's scale must start at a multiple of its size)")
    return None


def groups(kind: str, in_features: int) -> int:
    """Scales per row."""
    return 1 if kind == "fp8" else in_features // INT4_GROUP


def row_bytes(kind: str, in_features: int, dtype: torch.dtype) -> int:
    """Bytes of one quantized row in the arena: its values, then its scales."""
    values = in_features if kind == "fp8" else in_features // 2
    return values + groups(kind, in_features) * dtype.itemsize


def quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of weight ``w`` [out, in] as offload stores them: for ``fp8``, ``q``
    float8_e4m3fn [out, in] and ``scale`` [out]; for ``int4``, ``q`` int8 [out, in] in
    [-8, 7] (unpacked: the arena packs two a byte) and ``scale`` [out, in / 128]. ``scale``
    is in ``w``'s dtype; ``q.to(dtype) * scale`` (broadcast over each group) approximates
    ``w``. Runs where ``w`` is (a GPU quantizes an 8B model's weights in seconds)."""
    if kind is None or kind not in FORMATS:
        raise ValueError(f"codegen.nn.quantize_weight: kind must be 'fp8' or 'int4', got "
                         f"{kind!r}")
    if w.dim() != 2:
        raise ValueError(f"codegen.nn.quantize_weight: expected a 2-D weight [out, in], got "
                         f"shape {tuple(w.shape)}")
    why = unsupported(kind, w.shape[1], w.dtype)
    if why is not None:
        raise ValueError(f"codegen.nn.quantize_weight: {why}")
    w = w.detach()
    # A scale never below the dtype's smallest subnormal: a row (group) of zeros, or of
    # magnitudes too small for their scale in fp16, gets one it can divide by (its values
    # then quantize to 0 or to the largest that fits), never a scale that rounds to 0.
    least = torch.finfo(w.dtype).tiny * torch.finfo(w.dtype).eps
    if kind == "fp8":
        amax = w.abs().amax(dim=1).float()
        scale = (amax / FP8_MAX).clamp(min=least).to(w.dtype)
        q = (w.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale
    out, inp = w.shape
    grouped = w.float().view(out, inp // INT4_GROUP, INT4_GROUP)
    amax = grouped.abs().amax(dim=2)
    scale = (amax / INT4_MAX).clamp(min=least).to(w.dtype)
    q = torch.round(grouped / scale.float()[:, :, None]).clamp(-8, INT4_MAX)
    return q.to(torch.int8).view(out, inp), scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the layer computes with: ``q.to(dtype) * scale``, each scale over its
    group of columns (one per row for fp8, ``INT4_GROUP`` columns for int4)."""
    if scale.dim() == 1:
        return q.to(dtype) * scale.to(dtype)[:, None]
    out, inp = q.shape
    g = inp // scale.shape[1]
    return (q.to(dtype).view(out, scale.shape[1], g) * scale.to(dtype)[:, :, None]).view(
        out, inp)


def pack_rows(q: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """The arena's rows of a quantized weight (uint8 [out, row_bytes]): each row's values
    (int4 packed two a byte, the even column low), then its scales' bytes."""
    out = q.shape[0]
    if kind == "fp8":
        values = q.view(torch.uint8)
    else:
        u = q.view(out, -1, 2).to(torch.uint8) & 0x0F
        values = u[:, :, 0] | (u[:, :, 1] << 4)
    scales = scale.contiguous().view(out, -1).view(torch.uint8)
    return torch.cat((values, scales), dim=1)


def unpack_rows(raw: torch.Tensor, kind: str, in_features: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The weight rows (``dtype`` [rows, in_features]) of raw arena rows (uint8 [rows,
    row_bytes], a view of the staging or a copy): ``dequantize_reference`` of what
    ``pack_rows`` stored, run where ``raw`` is."""
    return dequantizer(raw, kind, in_features, dtype)()


def dequantizer(raw: torch.Tensor, kind: str, in_features: int,
                dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """``unpack_rows`` of ``raw`` as a function that reads the rows as they are when it is
    called: its views and launch arguments are made once (the streamer makes one per GEMM
    piece and calls it every forward). Called with ``into`` (contiguous ``dtype`` [rows,
    in_features]), it writes the rows there, else into new ones, and returns them; called
    with ``stream`` too (the current stream's raw handle, the rows' device current), it
    launches there without looking either up. On a GPU
    it is one Triton kernel (:mod:`codegen.nn.kernels`); elsewhere, and where that kernel
    cannot be built, torch's elementwise ops (:func:`unpack_rows_eager`)."""
    if raw.is_cuda and raw.shape[0] and _kernel(kind, dtype, raw.device) is not None:
        return _launcher(raw, kind, in_features, dtype)
    return functools.partial(_eager_into, raw, kind, in_features, dtype)


def _eager_into(raw: torch.Tensor, kind: str, in_features: int, dtype: torch.dtype,
                into: torch.Tensor | None = None, stream: int | None = None) -> torch.Tensor:
    """The eager dequantizer (``stream``, as ``_Launch`` takes it: unused, torch's ops run
    on the current stream)."""
    if into is not None:
        _check_into(into, (raw.shape[0], in_features), dtype)
    rows = unpack_rows_eager(raw, kind, in_features, dtype)
    return rows if into is None else into.copy_(rows)


def _check_into(into: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
    """``into`` can take the dequantized rows: contiguous ``dtype`` of ``shape``, at a
    multiple of 16 bytes (as a compiled kernel's store assumes)."""
    if (tuple(into.shape) != tuple(shape) or into.dtype != dtype or not into.is_contiguous()
            or into.data_ptr() % 16):
        raise InternalError(
            f"codegen.nn.offload: dequantizing into a {into.dtype} {tuple(into.shape)} "
            f"tensor (contiguous: {into.is_contiguous()}, at byte {into.data_ptr() % 16} of "
            f"16); expected contiguous {dtype} {tuple(shape)} at a multiple of 16 bytes (bug)")


_KERNELS: dict[Any, Any] = {}  # (kind, dtype) -> the Triton kernel, or None where it failed
_BUILDING = threading.Lock()


def _kernel(kind: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The Triton kernel that dequantizes ``kind`` into ``dtype``, built and run once on a
    row of zeros the first time (Triton compiles at its first launch) and kept once that
    ran; None, said once, where it cannot be imported or built. Running out of memory
    there is the caller's error, as are errors of later calls."""
    key = (kind, dtype)
    with _BUILDING:  # one thread builds; the others then read what it kept
        if key not in _KERNELS:
            try:
                from . import kernels

                kernel = kernels.fp8_rows if kind == "fp8" else kernels.int4_rows
                features = INT4_GROUP
                _launcher(torch.zeros(1, row_bytes(kind, features, dtype), dtype=torch.uint8,
                                      device=device), kind, features, dtype, kernel)()
                _KERNELS[key] = kernel
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to build falls back, said once
                _KERNELS[key] = None
                logging.getLogger("codegen.nn").warning(
                    "codegen.nn.offload: the %s dequantization kernel (Triton) did not build "
                    "(%s: %s); dequantizing with torch's elementwise ops instead", kind,
                    type(e).__name__, e)
    return _KERNELS[key]


def _launcher(raw: torch.Tensor, kind: str, in_features: int, dtype: torch.dtype,
              kernel: Any = None) -> _Launch:
    """``dequantizer`` on a GPU: ``kernel`` (default: the one ``_kernel`` kept) bound to
    ``raw``'s rows (``_Launch``)."""
    return _Launch(raw, kind, in_features, dtype,
                   kernel if kernel is not None else _KERNELS[(kind, dtype)])


class _Launch:
    """A dequantization kernel bound to raw arena rows, its grid and arguments made once;
    each call allocates the weight rows (or takes them: contiguous, at a multiple of 16
    bytes, as the compiled kernel assumes), launches one kernel on the current stream of
    the rows' device and returns them. bfloat16 rows are written as int16 (the kernel
    rounds them itself).

    The first launch goes through Triton's JIT, which compiles (or finds) the kernel for
    its arguments' specialization (their alignment, and which integers are 1 or multiples
    of 16) and returns it; later launches call that compiled kernel directly
    (``compiled``), skipping the JIT's binding of the arguments. Their arguments are
    specialized alike: the same rows, strides and sizes, and new rows from torch's
    allocator (aligned to 512 bytes) or given ones (checked for 16). Triton's CPU
    interpreter (the tests) returns no compiled kernel and launches through the JIT each
    time."""

    def __init__(self, raw: torch.Tensor, kind: str, in_features: int, dtype: torch.dtype,
                 kernel: Any) -> None:
        from .kernels import FP8_BLOCK, INT4_BLOCK

        rows = raw.shape[0]
        n = in_features if kind == "fp8" else in_features // 2
        scale = raw[:, n:].view(dtype)  # [rows, groups]: each row's scales, after its values
        self.stored = torch.int16 if dtype == torch.bfloat16 else dtype
        self.dtype = dtype
        self.block = FP8_BLOCK if kind == "fp8" else INT4_BLOCK
        self.grid = (rows, (n + self.block - 1) // self.block)  # rows first
        self.launch = kernel[self.grid]
        self.args = (raw, scale, raw.stride(0), scale.stride(0),
                     *((in_features,) if kind == "fp8" else (n, in_features)))
        self.device, self.shape = raw.device, (rows, in_features)
        # Triton launches on the current device (CPU tensors: its interpreter, the tests).
        self.index = raw.device.index if raw.device.type == "cuda" else None
        self.compiled: Any = None  # the compiled kernel's launcher at this grid

    def __call__(self, into: torch.Tensor | None = None,
                 stream: int | None = None) -> torch.Tensor:
        """The rows dequantized (into ``into``, where given). ``stream``: the raw handle of
        the current stream, where the caller has it: the compiled kernel then launches on
        it, where the rows' device is the current one, without switching devices or
        looking the stream up (a decode step makes one launch a Linear, and those cost the
        host microseconds)."""
        if into is not None:
            _check_into(into, self.shape, self.dtype)
        out = (torch.empty(self.shape, dtype=self.stored, device=self.device) if into is None
               else into.view(self.stored))
        raw, scale, *rest = self.args
        if (self.compiled is not None and stream is not None
                and torch.cuda.current_device() == self.index):
            self.compiled(raw, scale, out, *rest, self.block, stream=stream)
            return out.view(self.dtype)
        with (torch.cuda.device(self.index) if self.index is not None
              else contextlib.nullcontext()):
            if self.compiled is not None:
                self.compiled(raw, scale, out, *rest, self.block)
            else:
                kernel = self.launch(raw, scale, out, *rest, BLOCK=self.block)
                if hasattr(kernel, "run") and hasattr(kernel, "__getitem__"):
                    self.compiled = kernel[(*self.grid, 1)]  # its launcher takes 3 axes
        return out.view(self.dtype)


def unpack_rows_eager(raw: torch.Tensor, kind: str, in_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """``unpack_rows`` with torch's elementwise ops (the CPU's way, and the reference of
    the GPU's kernel)."""
    rows = raw.shape[0]
    n = in_features if kind == "fp8" else in_features // 2
    values, scales = raw[:, :n], raw[:, n:]
    scale = scales.contiguous().view(dtype) if rows else scales.new_empty(
        0, groups(kind, in_features), dtype=dtype)
    if kind == "fp8":
        return values.view(FP8).to(dtype) * scale
    low = (values << 4).view(torch.int8) >> 4  # sign-extended low nibble
    high = values.view(torch.int8) >> 4
    q = torch.stack((low, high), dim=2).view(rows, in_features)
    return dequantize_reference(q, scale.view(rows, groups(kind, in_features)), dtype)
