"""Weight-only quantization of offloaded Linears (``offload(..., quantize="fp8" | "int4")``),
on the CPU: ``quantize_weight`` against its definition, each offloaded Linear against the
torch reference ``F.linear(x, q.to(dtype) * scale)`` for every dtype the offload takes,
pieces and ring wraps included, generate, the report's quantized bytes and logits error,
the state dict, the budget, and the refusals."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_greedy_generate, tiny_llama
from torch import nn

import codegen.nn
from codegen.nn.quantize import (
    FP8,
    INT4_GROUP,
    dequantize_reference,
    pack_rows,
    row_bytes,
    unpack_rows,
)

KINDS = ("fp8", "int4")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def reference_weight(w, kind):
    """The weight the layer must compute with, written out from the definition."""
    q, scale = codegen.nn.quantize_weight(w, kind)
    if kind == "fp8":
        return q.to(w.dtype) * scale[:, None]
    return q.to(w.dtype) * scale.repeat_interleave(INT4_GROUP, dim=1)


# ---------------------------------------------------------------------------- quantize_weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_is_e4m3fn_with_one_scale_per_row(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 64, dtype=dtype) * torch.logspace(-3, 2, 96, dtype=dtype)[:, None]
    q, scale = codegen.nn.quantize_weight(w, "fp8")
    assert q.dtype == FP8 and q.shape == (96, 64)
    assert scale.dtype == dtype and scale.shape == (96,)
    # Each row's largest magnitude lands on e4m3fn's largest value (448), within the
    # scale's rounding to the weight's dtype.
    top = q.float().abs().amax(dim=1)
    assert torch.all((top > 448 * 0.98) & (top <= 448))
    # e4m3fn keeps 3 mantissa bits: each value within 1/16 of itself (plus the scale's
    # rounding), or the subnormals' step near zero.
    w_hat = (q.float() * scale.float()[:, None])
    err = (w_hat - w.float()).abs()
    assert torch.all(err <= w.float().abs() / 16 + scale.float()[:, None] * 2**-6
                     + w.float().abs() * 2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_is_symmetric_in_groups_of_128(dtype):
    torch.manual_seed(1)
    w = torch.randn(40, 384, dtype=dtype)
    w[3, 128:256] *= 100  # one group far larger than its neighbours
    q, scale = codegen.nn.quantize_weight(w, "int4")
    assert q.dtype == torch.int8 and q.shape == (40, 384)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert scale.dtype == dtype and scale.shape == (40, 3)
    groups = w.float().view(40, 3, 128)
    expected = (groups.abs().amax(dim=2) / 7).to(dtype)
    assert torch.equal(scale, expected)
    # Rounded to the nearest step: within half a step (the scale's rounding aside).
    w_hat = q.float().view(40, 3, 128) * scale.float()[:, :, None]
    assert torch.all((w_hat - groups).abs() <= scale.float()[:, :, None] * 0.5 * 1.01)
    assert scale[3, 1] > 50 * scale[3, 0]  # the large group has a scale of its own


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_packed_for_the_arena_unpack_to_the_reference(kind, dtype):
    torch.manual_seed(2)
    w = torch.randn(50, 256, dtype=dtype)
    q, scale = codegen.nn.quantize_weight(w, kind)
    rows = pack_rows(q, scale, kind)
    assert rows.dtype == torch.uint8 and rows.shape == (50, row_bytes(kind, 256, dtype))
    want = reference_weight(w, kind)
    assert torch.equal(dequantize_reference(q, scale, dtype), want)
    assert torch.equal(unpack_rows(rows, kind, 256, dtype), want)
    assert torch.equal(unpack_rows(rows[7:31], kind, 256, dtype), want[7:31])  # a piece


def test_bad_weights_are_refused_by_name():
    with pytest.raises(ValueError, match="kind must be 'fp8' or 'int4'"):
        codegen.nn.quantize_weight(torch.randn(4, 128), None)
    with pytest.raises(ValueError, match="codegen.nn.quantize_weight: kind must be 'fp8' or "
                                         "'int4', got 'int8'"):
        codegen.nn.quantize_weight(torch.randn(4, 128), "int8")
    with pytest.raises(ValueError, match="in_features = 100 is not a multiple of int4's group"):
        codegen.nn.quantize_weight(torch.randn(4, 100), "int4")
    with pytest.raises(ValueError, match="expected a 2-D weight"):
        codegen.nn.quantize_weight(torch.randn(4, 128, 2), "fp8")


# ---------------------------------------------------------------------------- offloaded


class Stack(nn.Module):
    def __init__(self, dtype, bias):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(256, 384, bias=bias).to(dtype)
        self.b = nn.Linear(384, 256, bias=bias).to(dtype)
        self.c = nn.Linear(256, 128, bias=bias).to(dtype)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_each_offloaded_linear_equals_the_torch_reference(kind, dtype, bias):
    ref = Stack(dtype, bias)
    weights = {n: reference_weight(m.weight, kind) for n, m in ref.named_children()}
    # A ring of a few rows, copies of 64 rows: every weight in pieces, the ring wrapping.
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               staging=3 * 64 * 400, copy_size=64 * 400)
    plan = codegen.nn.offload_plan(model)
    assert all(lay.quant == kind for lay in plan.layouts)
    assert any(len(call.pieces) > 1 for call in plan.calls)
    torch.manual_seed(4)
    x = torch.randn(5, 256, dtype=dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]

    def reference(h):
        for n, m in ref.named_children():
            h = F.linear(h, weights[n], m.bias)
            h = torch.relu(h) if n != "c" else h
        return h

    with torch.no_grad():
        want = reference(x)
        for _ in range(3):  # by the plan: pieces, the ring wrapping, the next forward's spans
            torch.testing.assert_close(model(x), want, rtol=tol, atol=tol)
        r = codegen.nn.report(model)
        assert r.unplanned_calls == 0 and r.quantize == kind and r.linears == 3
        # Called outside the model's forward: the weight's rows copied whole, dequantized.
        torch.testing.assert_close(model.a(x), F.linear(x, weights["a"], ref.a.bias),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, scratch", [(512, None), (65, None), (512, 48 * 1024)])
def test_a_quantized_call_of_many_rows_runs_a_gemm_per_scratch_weight(kind, bias, rows,
                                                                      scratch, monkeypatch):
    """A call of more than MERGED_ROWS rows dequantizes its pieces into their rows of a
    scratch weight and runs one GEMM per scratch: a scratch is one piece or at most
    SCRATCH_BYTES and the call's larger activation, and takes every next piece that fits.
    Weights are larger than the ring (a piece's copy waits for the dequantization of
    an earlier piece of the same call, before the call's GEMM). 512 rows of input
    (activations larger than any weight) with the default SCRATCH_BYTES: one GEMM a call;
    65, or a small SCRATCH_BYTES: several. Values equal the torch reference, biases
    included."""
    from codegen.nn import streamer as streamer_module

    if scratch is not None:
        monkeypatch.setattr(streamer_module, "SCRATCH_BYTES", scratch)
    ref = Stack(torch.float32, bias)
    weights = {n: reference_weight(m.weight, kind) for n, m in ref.named_children()}
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               staging=24 * 1024, copy_size=8 * 1024)
    plan = codegen.nn.offload_plan(model)
    assert all(call.pieces for call in plan.calls)
    assert sum(plan.layouts[call.linear].weight_bytes > plan.ring_bytes
               for call in plan.calls) >= 2
    gemms = []
    gemm = streamer_module._gemm

    def spy(x, w, b, out, r0, r1):
        gemms.append((x.shape[0], w.shape[0], r0, r1, out is None))
        return gemm(x, w, b, out, r0, r1)

    monkeypatch.setattr(streamer_module, "_gemm", spy)
    torch.manual_seed(4)
    assert rows > streamer_module.MERGED_ROWS
    x = torch.randn(rows, 256)
    want = x
    for n, m in ref.named_children():
        want = F.linear(want, weights[n], m.bias)
        want = torch.relu(want) if n != "c" else want
    with torch.no_grad():
        for _ in range(2):
            gemms.clear()
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
            at = 0
            for call in plan.calls:
                lay = plan.layouts[call.linear]
                row = lay.in_features * 4
                cap = min(streamer_module.SCRATCH_BYTES,
                          x.shape[0] * max(lay.in_features, lay.out_features) * 4)
                pieces = [p.rows for p in call.pieces]
                mine = []
                while at < len(gemms) and (not mine or mine[-1][3] < lay.out_features):
                    mine.append(gemms[at])
                    at += 1
                assert [(g[2], g[3]) for g in mine][0][0] == 0
                assert all(a[3] == b[2] for a, b in zip(mine, mine[1:]))  # in order, whole
                assert mine[-1][3] == lay.out_features and mine[0][4] == (len(mine) == 1)
                for _, scratch_rows, r0, r1, _ in mine:
                    assert scratch_rows == r1 - r0
                    starts = [p[0] for p in pieces]
                    assert r0 in starts and (r1 in starts or r1 == lay.out_features)
                    assert (r1 - r0) * row <= cap or (r0, r1) in pieces  # fits, or one piece
                for a, b in zip(mine, mine[1:]):  # the next piece did not fit
                    nxt = next(p for p in pieces if p[0] == b[2])
                    assert (nxt[1] - a[2]) * row > cap
            assert at == len(gemms)
            if rows == 512 and scratch is None:
                assert len(gemms) == len(plan.calls)
            else:
                assert len(gemms) > len(plan.calls)  # some weight ran as several GEMMs


def quantized_reference(ref, kind, keep=lambda n: n != "lm_head"):
    """``ref`` with each kept Linear's weight replaced by its dequantized quantization."""
    out = copy.deepcopy(ref)
    for n, m in out.named_modules():
        if type(m) is nn.Linear and keep(n):
            m.weight.data = reference_weight(m.weight.data, kind)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_llama_forwards_and_generates_as_its_reference(kind):
    ref = tiny_llama(dtype=torch.bfloat16, seed=5, hidden=128, intermediate=256)
    want = quantized_reference(ref, kind)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               filter=lambda n, m: n != "lm_head")
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want(ids).logits, rtol=2e-2, atol=2e-2)
    assert_same_greedy_generate(model, want, ids[:1, :5], 5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_report_counts_quantized_bytes_and_the_logits_error(kind):
    ref = tiny_llama(dtype=torch.bfloat16, seed=6, hidden=128, intermediate=256)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               filter=lambda n, m: n != "lm_head")
    ids = torch.randint(0, 97, (1, 6))
    r = codegen.nn.report(model, reference=ref, inputs=ids)
    linears = [m for n, m in ref.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    per_value = 1 if kind == "fp8" else 0.5
    scales = lambda m: m.out_features * (1 if kind == "fp8" else m.in_features // 128)  # noqa: E731
    expected = sum(int(m.weight.numel() * per_value) + 2 * scales(m) for m in linears)
    assert r.bytes_moved == expected < sum(m.weight.numel() * 2 for m in linears)
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert r.logits_error == pytest.approx(
        ((got - want).abs().max() / want.abs().max()).item())
    assert 0 < r.logits_error < (0.1 if kind == "fp8" else 0.5)
    assert r.quantize == kind
    with pytest.raises(ValueError, match="give both reference= .* and inputs="):
        codegen.nn.report(model, reference=ref)


def test_a_weight_the_format_cannot_take_is_streamed_as_it_is():
    torch.manual_seed(7)
    ref = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="int4")
    plan = codegen.nn.offload_plan(model)
    assert [lay.quant for lay in plan.layouts] == ["int4", None]  # 64 is not a group
    assert model[2].weight.dtype == torch.bfloat16
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        h = torch.relu(F.linear(x, reference_weight(ref[0].weight, "int4"), ref[0].bias))
        torch.testing.assert_close(model(x), ref[2](h))


def test_backward_through_a_quantized_weight_is_refused_by_name():
    ref = Stack(torch.float32, True)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="fp8")
    assert not model.a.weight.requires_grad and model.a.weight.dtype == FP8
    x = torch.randn(2, 256, requires_grad=True)
    y = model(x)  # values in grad mode too
    with torch.no_grad():
        torch.testing.assert_close(y, model(x))
    with pytest.raises(RuntimeError, match=r"codegen.nn.offload: c: backward through a weight "
                                           r"quantized to fp8 is not supported"):
        y.sum().backward()


def test_the_state_dict_holds_the_quantized_weights_and_loads_back():
    ref = Stack(torch.bfloat16, True)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="int4")
    state = model.state_dict()
    assert state["a.weight"].dtype == torch.uint8 and state["a.weight"].shape == (384, 128)
    assert state["a.weight_scale"].shape == (384, 2)
    other = codegen.nn.offload(Stack(torch.bfloat16, True), device="cpu", quantize="int4")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
        other.load_state_dict(state)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(other(x), model(x))


def test_a_budget_keeps_residents_as_they_are_and_streams_the_rest_quantized():
    ref = tiny_llama(dtype=torch.bfloat16, seed=8, layers=3, hidden=128, intermediate=256)
    total = sum(m.weight.numel() * 2 for n, m in ref.named_modules()
                if type(m) is nn.Linear and n != "lm_head")
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="fp8",
                               gpu_budget=total // 2, filter=lambda n, m: n != "lm_head")
    plan = codegen.nn.offload_plan(model)
    assert plan.resident and plan.layouts and plan.gpu_bytes <= total // 2
    assert all(lay.quant == "fp8" for lay in plan.layouts)
    resident = {r.name for r in plan.resident}
    want = quantized_reference(ref, "fp8", keep=lambda n: n != "lm_head" and n not in resident)
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want(ids).logits, rtol=2e-2, atol=2e-2)


def test_quantize_needs_the_copy_plan_and_a_known_format():
    with pytest.raises(ValueError, match="quantize must be None, 'fp8' or 'int4', got 'nf4'"):
        codegen.nn.offload(Stack(torch.float32, False), device="cpu", quantize="nf4")
    with pytest.raises(ValueError, match="quantize needs prefetch=True"):
        codegen.nn.offload(Stack(torch.float32, False), device="cpu", quantize="fp8",
                           prefetch=False)


def test_the_plan_prints_each_piece_dequantized():
    model = codegen.nn.offload(Stack(torch.bfloat16, False), device="cpu", quantize="int4")
    text = str(codegen.nn.offload_plan(model))
    assert "  a: [384, 256] bfloat16, streamed as int4" in text
    assert re.search(r"Linear\(x, Dequantize\(ring\[\d+:\d+\] as \[\d+, 256\] int4\), "
                     r"out=y\[:, 0:\d+\]\)", text)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_zeros_and_tiny_rows_quantize_to_numbers(kind, dtype):
    torch.manual_seed(9)
    w = torch.randn(8, 256, dtype=dtype)
    w[2] = 0
    w[5] = w[5] * 1e-6  # below what a scale in fp16's normal range divides
    q, scale = codegen.nn.quantize_weight(w, kind)
    assert torch.all(scale > 0)
    w_hat = dequantize_reference(q, scale, dtype)
    assert torch.isfinite(w_hat).all()
    assert torch.equal(w_hat[2], torch.zeros(256, dtype=dtype))
    # Each row within a step of its values (int4: its largest over 7, half of it by
    # rounding; fp8: an eighth of the largest), the tiny row included.
    err = (w_hat.float() - w.float()).abs().amax(dim=1)
    assert torch.all(err <= w.float().abs().amax(dim=1) / 7)


def test_a_backward_that_reaches_only_the_bias_is_refused_too():
    ref = Stack(torch.float32, True)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="fp8")
    x = torch.randn(2, 256)  # needs no gradient; the biases do
    y = model(x)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="backward through a weight quantized to fp8"):
        y.sum().backward()


def test_an_in_place_op_after_a_quantized_linear_works_in_grad_mode():
    torch.manual_seed(10)
    ref = nn.Sequential(nn.Linear(128, 128), nn.ReLU(inplace=True), nn.Linear(128, 8))
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="fp8")
    x = torch.randn(3, 128, requires_grad=True)
    want = F.linear(torch.relu(F.linear(x, reference_weight(ref[0].weight, "fp8"), ref[0].bias)),
                    reference_weight(ref[2].weight, "fp8"), ref[2].bias)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_an_unquantized_checkpoint_loads_quantized_and_a_wrong_one_is_refused(kind):
    ref = Stack(torch.bfloat16, True)
    want = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind)
    other = Stack(torch.bfloat16, True)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    model = codegen.nn.offload(other, device="cpu", quantize=kind)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # the next forward's first spans are queued: the load must be seen
        result = model.load_state_dict(ref.state_dict())
        assert not result.missing_keys and not result.unexpected_keys
        assert torch.equal(model(x), want(x))
    bad = {**ref.state_dict(), "b.weight": torch.zeros(5, 5)}
    with pytest.raises(ValueError, match=rf"b.weight is stored quantized to {kind}: .* got "
                                         r"torch.float32 \(5, 5\)"):
        model.load_state_dict(bad)


def test_scales_written_in_place_are_read_by_the_next_forward():
    torch.manual_seed(13)
    ref = nn.Sequential(nn.Linear(256, 128, bias=False), nn.Linear(128, 64, bias=False))
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="fp8")
    x = torch.randn(2, 256)
    with torch.no_grad():
        before = model(x)
        model[0].weight_scale.mul_(2)  # the next forward's first spans were queued already
        torch.testing.assert_close(model(x), 2 * before)


def test_a_budget_sizes_the_default_ring_from_the_quantized_bytes():
    ref = tiny_llama(dtype=torch.bfloat16, seed=11, layers=4, hidden=256, intermediate=512)
    total = sum(m.weight.numel() * 2 for n, m in ref.named_modules()
                if type(m) is nn.Linear and n != "lm_head")
    plans = {}
    for budget in (None, total // 2):
        model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize="int4",
                                   gpu_budget=budget, filter=lambda n, m: n != "lm_head")
        plans[budget] = codegen.nn.offload_plan(model)
    assert plans[total // 2].ring_bytes <= plans[None].ring_bytes + 512


def test_weights_quantize_in_blocks_of_rows_as_they_do_whole():
    from codegen.nn.offload import Arena, _quantized_into

    torch.manual_seed(12)
    w = torch.randn(300, 256, dtype=torch.bfloat16)
    for kind in KINDS:
        arenas = []
        for limit in (10**9, 16 * 256 * 7):  # whole, and blocks of 7 rows
            arena = Arena(torch.zeros(300 * row_bytes(kind, 256, torch.bfloat16),
                                      dtype=torch.uint8), pinned=False)
            _quantized_into(arena, 0, w, kind, torch.device("cpu"), limit)
            arenas.append(arena.storage)
        assert torch.equal(arenas[0], arenas[1])
        assert torch.equal(arenas[0].view(300, -1), pack_rows(*codegen.nn.quantize_weight(
            w, kind), kind))


def test_a_kernel_that_does_not_build_falls_back_to_torchs_ops_and_says_so_once(
        monkeypatch, caplog):
    """Where Triton cannot build the GPU's dequantization (here: cannot be imported), the
    pieces are dequantized with torch's elementwise ops, and a warning says so once per
    format and dtype."""
    from codegen.nn import quantize

    monkeypatch.setattr(quantize, "_KERNELS", {})
    monkeypatch.setitem(sys.modules, "codegen.nn.kernels", None)
    with caplog.at_level("WARNING", logger="codegen.nn"):
        for _ in range(2):
            assert quantize._kernel("int4", torch.bfloat16, torch.device("cpu")) is None
    assert [r.getMessage() for r in caplog.records] == [
        "codegen.nn.offload: the int4 dequantization kernel (Triton) did not build "
        "(ModuleNotFoundError: import of codegen.nn.kernels halted; None in sys.modules); "
        "dequantizing with torch's elementwise ops instead"]


_INTERPRETED = """
import torch
from codegen.nn import quantize
from codegen.nn.quantize import _launcher, pack_rows, row_bytes, unpack_rows_eager

torch.manual_seed(5)
# Rows of one block and of two, the second partial (fp8: 2048 bytes a block; int4: 1024).
for kind, features in (("fp8", 14), ("fp8", 40), ("int4", 384), ("fp8", 2050),
                       ("int4", 17 * 128)):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if features % dtype.itemsize:
            continue
        assert quantize._kernel(kind, dtype, torch.device("cpu")) is not None  # built, kept
        rows, width = 6, row_bytes(kind, features, dtype)
        w = torch.randn(rows, features, dtype=dtype) * 3
        q, scale = quantize.quantize_weight(w, kind)
        packed = pack_rows(q, scale, kind)
        values = features if kind == "fp8" else features // 2
        # Every byte pattern of the values: fp8's NaNs and subnormals, every nibble pair.
        packed[:, :values] = torch.randperm(256)[torch.arange(rows * values) % 256].view(
            rows, values).to(torch.uint8)
        ring = torch.zeros(256 + packed.numel(), dtype=torch.uint8)
        ring[256:] = packed.flatten()
        raw = ring[256:].view(rows, width)  # a piece at an offset in a ring
        for piece in (raw, raw[1:4]):
            got = _launcher(piece, kind, features, dtype)()
            want = unpack_rows_eager(piece, kind, features, dtype)
            assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
            same = (got == want) | (got.isnan() & want.isnan())
            assert same.all(), (kind, features, dtype, (got - want).abs().max())
            if features * dtype.itemsize % 16 == 0:  # into rows of a scratch, at an offset
                scratch = torch.full((piece.shape[0] + 2, features), 5, dtype=dtype)
                into = scratch[1:-1]
                _launcher(piece, kind, features, dtype)(into)
                same = (into == want) | (into.isnan() & want.isnan())
                assert same.all() and (scratch[0] == 5).all() and (scratch[-1] == 5).all()
        got = _launcher(pack_rows(q, scale, kind), kind, features, dtype)()
        assert torch.equal(got, quantize.dequantize_reference(q, scale, dtype)), (kind, dtype)
print("ok")
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_dequantizer_writes_into_given_rows_and_refuses_others(kind):
    """Into rows of a scratch weight (at an offset): the same values, the rows around
    untouched; rows of another shape, dtype or layout, or not at a multiple of 16 bytes,
    are refused by name rather than broadcast or cast."""
    from codegen.nn.quantize import dequantizer

    torch.manual_seed(6)
    q, scale = codegen.nn.quantize_weight(torch.randn(24, 256), kind)
    raw = pack_rows(q, scale, kind)
    run = dequantizer(raw, kind, 256, torch.float32)
    scratch = torch.full((26, 256), 7.0)
    into = scratch[1:25]
    assert run(into).data_ptr() == into.data_ptr()
    assert torch.equal(into, dequantize_reference(q, scale, torch.float32))
    assert (scratch[0] == 7).all() and (scratch[25] == 7).all()
    flat = torch.empty(24 * 256 + 4)
    for bad in (scratch[:23], scratch[:24].to(torch.float64), scratch[:24].t().contiguous().t(),
                flat[1:1 + 24 * 256].view(24, 256)):
        with pytest.raises(codegen.InternalError, match="dequantizing into"):
            run(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_no_rows_dequantize_to_no_rows(kind):
    from codegen.nn.quantize import unpack_rows_eager

    raw = torch.zeros(0, row_bytes(kind, 256, torch.bfloat16), dtype=torch.uint8)
    out = unpack_rows_eager(raw, kind, 256, torch.bfloat16)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_the_gpu_dequantization_launch_puts_rows_on_the_grids_first_axis(monkeypatch):
    """A weight of more rows than a CUDA grid's second axis takes (65535; an lm_head has
    128256) launches: rows go on the first axis, byte blocks on the second."""
    from codegen.nn import quantize

    grids = []

    class Kernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setitem(quantize._KERNELS, ("int4", torch.bfloat16), Kernel())
    monkeypatch.setitem(quantize._KERNELS, ("fp8", torch.bfloat16), Kernel())
    for kind, features, blocks in (("int4", 4096, 2), ("fp8", 14336, 7)):
        raw = torch.zeros(128256, row_bytes(kind, features, torch.bfloat16),
                          dtype=torch.uint8)
        out = quantize._launcher(raw, kind, features, torch.bfloat16)()
        assert out.shape == (128256, features) and out.dtype == torch.bfloat16
        assert grids.pop() == (128256, blocks)


def test_the_gpu_dequantization_kernels_equal_torchs_ops_bit_for_bit_interpreted():
    """The Triton kernels the GPU dequantizes arena rows with, run by Triton's CPU
    interpreter: every value byte (fp8's NaNs and subnormals, every int4 nibble), rows at
    an offset and a slice of them, each dtype, equal to torch's ops and the reference bit
    for bit (bfloat16's rounding is the kernel's own, as on the GPU)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("staging, copy_size, runs", [("24KiB", "4KiB", True),
                                                      ("24KiB", "4KiB", False),
                                                      (None, None, True)])
def test_long_and_short_calls_on_quantized_weights_match_the_reference(kind, staging,
                                                                      copy_size, runs,
                                                                      monkeypatch):
    """Calls of more than MERGED_ROWS rows (runs of pieces, or with ``dequant_runs`` off
    pieces, dequantized into a scratch weight, a GEMM per scratch) and of one row (a GEMM
    per merged run), mixed across forwards under rings that wrap: the logits are the
    dequantized reference's, every read of the ring checked against its copy, and each
    forward dequantizes every piece of every call once, in plan order, in runs: each run
    pieces of the call back to back in the ring, and the longest such run unless the end
    of a prefill's scratch (a GEMM) cuts it. At 192 or 200 rows a scratch holds a whole
    weight (one GEMM a call); at 65, a weight of 256 rows of 128 takes two or more (a
    scratch holds whole pieces of at most 130 rows). With ``dequant_runs`` off a
    prefill dequantizes piece by piece (its default is by runs)."""
    from codegen.nn import streamer as streamer_module
    from codegen.nn.streamer import MERGED_ROWS

    log: list[tuple[int, int] | None] = []  # (ring offset, rows) of each dequantization;
    make, gemm = streamer_module.dequantizer, streamer_module._gemm  # None: a GEMM

    def dequantizer(raw, *args):
        run = make(raw, *args)
        return lambda *into, **stream: (
            log.append((raw.data_ptr() - s.ring.data_ptr(), raw.shape[0])),
            run(*into, **stream))[1]

    monkeypatch.setattr(streamer_module, "dequantizer", dequantizer)
    monkeypatch.setattr(streamer_module, "_gemm", lambda *a: (log.append(None), gemm(*a))[1])
    ref = tiny_llama(dtype=torch.bfloat16, seed=8, hidden=128, intermediate=256,
                     max_positions=256)
    want = quantized_reference(ref, kind)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               staging=staging, copy_size=copy_size,
                               filter=lambda n, m: n != "lm_head")
    s = model._codegen_offload.streamer
    s.dequant_runs = runs
    plan = s.plan
    assert staging is None or len(plan.spans) > 2 * len(plan.calls)  # pieces, wraps
    longest = 0
    with torch.no_grad():
        for rows in (MERGED_ROWS + 1, 1, 192, 192, 200):
            log.clear()
            ids = torch.randint(0, 97, (1, rows))
            torch.testing.assert_close(model(ids).logits, want(ids).logits, rtol=2e-2,
                                       atol=2e-2)
            at = 0
            for call in plan.calls:
                row_bytes = plan.layouts[call.linear].row_bytes
                back_to_back = [a.ring_offset + (a.rows[1] - a.rows[0]) * row_bytes
                                == b.ring_offset for a, b in zip(call.pieces, call.pieces[1:])]
                k, gemms = 0, 0
                while k < len(call.pieces):
                    lo, n = log[at]
                    assert lo == call.pieces[k].ring_offset, (rows, call, k)
                    m = k  # the run: pieces k..m
                    while n > call.pieces[m].rows[1] - call.pieces[k].rows[0]:
                        assert back_to_back[m], (rows, call, m)
                        m += 1
                    assert n == call.pieces[m].rows[1] - call.pieces[k].rows[0]
                    longest = max(longest, m - k + 1)
                    at += 1
                    cut = log[at] is None
                    while at < len(log) and log[at] is None:
                        gemms += 1
                        at += 1
                    if rows > MERGED_ROWS and not runs:
                        assert m == k, (rows, call, k)
                    elif m + 1 < len(call.pieces) and back_to_back[m]:
                        assert cut and rows > MERGED_ROWS, (rows, call, m)  # a scratch's end
                    k = m + 1
                if rows >= 192:
                    assert gemms == 1
                elif rows == MERGED_ROWS + 1 and plan.layouts[call.linear].out_features == 256:
                    assert gemms >= 2
            assert at == len(log)
    assert codegen.nn.report(model).unplanned_calls == 0
    if staging is not None:  # the ring cuts weights into pieces, some dequantized as runs
        assert longest > 1  # (by a decode step's merged runs, at least)
    # The runs' views are kept by the way a call is cut, not by row count: 192 and 200
    # rows cut every call the same way (whole weights).
    assert len(s.scratch_plans) <= 2 * len(plan.calls)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("runs", [False, True])
def test_quantized_prefills_whose_call_order_changes_match_the_reference(kind, runs):
    """Prefills of more than MERGED_ROWS rows through a ring that wraps, calling the
    Linears in another order every few forwards: the plan is learnt again, and the
    scratches of the old plan are not reused (its calls' pieces lie elsewhere in the
    ring; the order check raises where a dequantization reads bytes its copy did not
    order). Pieces dequantized one by one, and by runs (``dequant_runs``)."""

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.ls = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
            self.order = [0, 1, 2, 3]

        def forward(self, x):
            for i in self.order:
                x = torch.relu(self.ls[i](x))
            return x

    ref = Chain()
    weights = [reference_weight(m.weight, kind) for m in ref.ls]
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind,
                               staging="40KiB", copy_size="8KiB")
    model._codegen_offload.streamer.dequant_runs = runs
    torch.manual_seed(1)
    with torch.no_grad():
        for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 0, 2], [3, 0, 2], [3, 0, 2], [1, 3],
                      [1, 3], [1, 3]):
            model.order = order
            x = want = torch.randn(100, 256)
            for i in order:
                want = torch.relu(F.linear(want, weights[i], ref.ls[i].bias))
            torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)
    s = model._codegen_offload.streamer
    assert [c.linear for c in s.plan.calls] == [1, 3]
    assert s.scratch_plans and len(s.plan.spans) > len(s.plan.calls)  # pieces in a ring


def test_a_dequantizer_launches_the_compiled_kernel_after_its_first_launch():
    """After the JIT's first launch (which returns the kernel it compiled), a dequantizer
    launches that kernel directly, as Triton's ``CompiledKernel[grid](*args)``: a grid of
    three axes and every argument in order, the block size last. A stand-in for Triton
    records the launches."""
    from codegen.nn.quantize import _launcher

    launches = []

    class Compiled:
        def run(self):  # Triton's launcher: present on a compiled kernel
            raise AssertionError("not called directly")

        def __getitem__(self, grid):
            assert len(grid) == 3, grid
            return lambda *args: launches.append(("compiled", grid, args))

    class Jit:
        def __getitem__(self, grid):
            def launch(*args, BLOCK):
                launches.append(("jit", grid, (*args, BLOCK)))
                return Compiled()
            return launch

    raw = torch.zeros(3, row_bytes("int4", 256, torch.bfloat16), dtype=torch.uint8)
    run = _launcher(raw, "int4", 256, torch.bfloat16, Jit())
    first = run()
    assert first.shape == (3, 256) and first.dtype == torch.bfloat16
    second = run()
    assert [k for k, _, _ in launches] == ["jit", "compiled"]
    (_, jit_grid, jit_args), (_, grid, args) = launches
    assert grid == (*jit_grid, 1) and jit_grid[0] == 3
    assert len(args) == len(jit_args) and args[-1] == jit_args[-1]  # BLOCK, last
    assert args[0] is jit_args[0] and args[3:] == jit_args[3:]  # raw; strides, sizes
    assert args[2].data_ptr() == second.data_ptr()  # into the rows it returns
