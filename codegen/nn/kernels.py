"""The dequantization of quantized arena rows on the GPU, as Triton kernels (imported only
where a quantized weight is dequantized on a GPU; :mod:`codegen.nn.quantize` falls back to
torch's elementwise ops where Triton is missing or cannot build them).

Each kernel reads raw arena rows, ``raw`` [rows, row_bytes] (uint8, any row stride), and
their scales, ``scale`` (a view of the same rows' bytes in the weight's dtype), and writes
the weight rows ``out`` [rows, in_features] contiguous. A program dequantizes ``BLOCK``
bytes of one row (grid: (rows, byte blocks): rows on the grid's first axis, which takes
2^31 - 1 of them, not the 65535 of the others: an lm_head has 128256): one coalesced load
of the bytes, one of their scales, one store.

The values are exact; the product with the scale is rounded once into the weight's dtype,
to nearest even, as torch's ``q.to(dtype) * scale``. bfloat16 is rounded here from its
float32 bits (``out`` given as int16) rather than by the compiler's conversion, so that
Triton's CPU interpreter, which truncates, computes the same bits as the GPU (the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

INT4_BLOCK = 1024  # packed bytes a program reads: 2048 values, 16 groups of 128
FP8_BLOCK = 2048


@triton.jit
def _rounded(f, out):
    """float32 ``f`` in ``out``'s element type: int16 means bfloat16's bits."""
    if out.dtype.element_ty == tl.int16:
        bits = f.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even
        return tl.where(f != f, 0x7FC0, r).to(tl.int16)  # NaN stays a quiet NaN
    else:
        return f.to(out.dtype.element_ty)


@triton.jit
def int4_rows(raw, scale, out, raw_stride, scale_stride, n, K, BLOCK: tl.constexpr):
    """Row ``pid(0)``: ``n`` bytes of two values each (the even feature in the low nibble,
    sign-extended from 4 bits), then ``K / 128`` scales; value j times scale j // 128."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(raw + row * raw_stride + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale + row * scale_stride + offs // 64, mask=mask, other=0).to(tl.float32)
    low = b & 15
    high = b >> 4
    low = (low - ((low & 8) << 1)).to(tl.float32) * s
    high = (high - ((high & 8) << 1)).to(tl.float32) * s
    o = 2 * tl.program_id(1) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out + row * K + o, _rounded(tl.interleave(low, high), out), mask=o < K)


@triton.jit
def fp8_rows(raw, scale, out, raw_stride, scale_stride, K, BLOCK: tl.constexpr):
    """Row ``pid(0)``: ``K`` float8_e4m3fn values, decoded from their bits (exponent bias 7,
    3 mantissa bits, exponent 0 subnormal, 0x7f and 0xff NaN), then its one scale."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    b = tl.load(raw + row * raw_stride + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale + row * scale_stride).to(tl.float32)
    e = (b >> 3) & 15
    m = b & 7
    f = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                 (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    f = tl.where((b & 127) == 127, float("nan"), f)
    f = tl.where((b & 128) != 0, -f, f)
    tl.store(out + row * K + offs, _rounded(f * s, out), mask=mask)
