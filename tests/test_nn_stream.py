"""The copy plan of an offloaded model (codegen/nn/plan.py) and its runner
(codegen/nn/streamer.py), on the CPU: spans, ring places and waits against a brute-force
reading of the plan; forwards against the original model under rings that wrap, copies
that cut weights into pieces, call orders that change, forwards that stop half-way,
weights written between forwards and a second thread; every read and write of the
staging checked against the events by the CPU backend's vector clocks."""

import copy
import dataclasses
import math
import threading

import pytest
import torch
from helpers import assert_same_greedy_generate, tiny_llama
from torch import nn

import codegen
import codegen.nn
from codegen.nn.plan import ALIGN, Layout, format_bytes, parse_bytes, plan_stream, row_granule


def layouts(shapes, dtype=torch.float32, bias=False):
    """Layouts of Linears of weight ``shapes``, laid out as offload lays out its arena."""
    item = dtype.itemsize
    offset, out = 0, []
    bias_at = []
    for o, _ in shapes:
        bias_at.append(offset if bias else None)
        if bias:
            offset += -(-o * item // ALIGN) * ALIGN
    for (o, i), b in zip(shapes, bias_at):
        out.append(Layout(f"l{len(out)}", dtype, o, i, offset, b))
        offset += -(-o * i * item // ALIGN) * ALIGN
    return out, (offset if not bias else sum(-(-o * item // ALIGN) * ALIGN for o, _ in shapes))


def check_plan(plan, layouts_):
    """What a plan must hold, read the long way: the pieces of each call cover its rows
    in order, each inside its span's arena bytes and ring bytes; ring places keep the
    arena's alignment; each span waits for every span that used its ring bytes since its
    own previous copy; each span's last reader of a lap frees it."""
    spans = plan.spans
    for call in plan.calls:
        lay = layouts_[call.linear]
        at = 0
        for piece in call.pieces:
            r0, r1 = piece.rows
            assert r0 == at and r1 > r0
            assert r0 % row_granule(lay.row_bytes, plan.copy_bytes) == 0  # aligned columns
            at = r1
            s = spans[piece.span]
            lo = lay.weight_offset + r0 * lay.row_bytes
            hi = lo + (r1 - r0) * lay.row_bytes
            assert s.arena_begin <= lo and hi <= s.arena_begin + s.nbytes
            assert piece.ring_offset == s.ring_begin + lo - s.arena_begin
        assert at == (lay.out_features if lay.row_bytes else 0)
    ring = [s for s in spans if not s.is_bias_block]
    for s in ring:
        assert s.ring_begin % ALIGN == s.arena_begin % ALIGN
        assert 0 <= s.ring_begin and s.ring_begin + s.nbytes <= plan.ring_bytes
        assert s.nbytes <= plan.copy_bytes
    for j, s in enumerate(spans):
        if s.is_bias_block:
            assert s.waits == ((j, -1),)
            continue
        # Brute force over two laps, byte by byte (in blocks of the gcd of every ring
        # place and size: exact): the spans that last held each byte of s's ring bytes
        # before s's copy.
        g = math.gcd(*(v for t in ring for v in (t.ring_begin, t.nbytes)))
        owner: dict[int, tuple[int, int]] = {}
        for lap in (0, 1):
            for k, t in enumerate(spans):
                if t.is_bias_block:
                    continue
                blocks = range(t.ring_begin // g, (t.ring_begin + t.nbytes) // g)
                if lap == 1 and k == j:
                    need = {(o, lap_o - 1) for b in blocks if (b in owner)
                            for o, lap_o in [owner[b]]}
                    break
                for b in blocks:
                    owner[b] = (k, lap)
        assert set(s.waits) == need, (j, s.waits, need)
    last = {}
    for call in plan.calls:
        for p, piece in enumerate(call.pieces):
            last[piece.span] = (call.position, p)
        if call.bias_span is not None:
            last[call.bias_span] = (call.position, len(call.pieces) - 1)
    for call in plan.calls:
        for p, piece in enumerate(call.pieces):
            assert set(piece.frees) == {j for j, at in last.items() if at == (call.position, p)}


SHAPES = [(64, 64), (16, 64), (16, 64), (64, 64), (200, 64), (200, 64), (64, 200), (97, 64)]


@pytest.mark.parametrize("ring, copy_bytes", [(10**6, 10**6 - ALIGN), (40000, 16384),
                                              (9000, 4096), (3 * 800 + ALIGN, 800)])
@pytest.mark.parametrize("bias", [False, True])
def test_plans_hold_what_they_promise(ring, copy_bytes, bias):
    lays, bias_bytes = layouts(SHAPES, bias=bias)
    plan = plan_stream(lays, list(range(len(lays))), ring, copy_bytes,
                       bias_bytes if bias else 0)
    check_plan(plan, lays)
    assert plan.bytes_per_lap >= sum(lay.weight_bytes + lay.bias_bytes for lay in lays)
    assert any(s.is_bias_block for s in plan.spans) == bias


def test_spans_hold_whole_weights_where_asked_and_cut_only_those_larger_than_a_copy():
    lays, _ = layouts([(16, 64), (16, 64), (256, 64)])  # 4 KiB, 4 KiB, 64 KiB
    plan = plan_stream(lays, [0, 1, 2], ring_bytes=10**6, copy_bytes=16384, bias_bytes=0,
                       whole_weights=True)
    # Both small weights in one span; the big one starts its own, then 64 rows a span.
    assert [c.pieces[0].span for c in plan.calls[:2]] == [0, 0]
    assert [p.rows for p in plan.calls[2].pieces] == [(0, 64), (64, 128), (128, 192),
                                                       (192, 256)]
    assert [s.nbytes for s in plan.spans] == [8192] + [16384] * 4
    # A weight that does not fit whole in what is left of the open span starts a new one.
    lays, _ = layouts([(16, 64), (48, 64), (16, 64)])  # 4 KiB, 12 KiB, 4 KiB
    plan = plan_stream(lays, [0, 1, 2], ring_bytes=10**6, copy_bytes=14336, bias_bytes=0,
                       whole_weights=True)
    assert [[p.span for p in c.pieces] for c in plan.calls] == [[0], [1], [2]]
    assert [s.nbytes for s in plan.spans] == [4096, 12288, 4096]
    check_plan(plan, lays)


def test_spans_run_across_linears_and_cut_weights_at_rows():
    lays, _ = layouts([(16, 64), (16, 64), (256, 64)])  # 4 KiB, 4 KiB, 64 KiB
    plan = plan_stream(lays, [0, 1, 2], ring_bytes=10**6, copy_bytes=16384, bias_bytes=0)
    # Both small weights and the big one's first 32 rows in one span, then 64 rows a span.
    assert [c.pieces[0].span for c in plan.calls[:2]] == [0, 0]
    assert [p.rows for p in plan.calls[2].pieces] == [(0, 32), (32, 96), (96, 160),
                                                       (160, 224), (224, 256)]
    assert [s.nbytes for s in plan.spans] == [16384] * 4 + [8192]
    check_plan(plan, lays)
    # A weight starting with less than an eighth of a span left starts a span of its own.
    plan = plan_stream(lays, [2, 0, 1], ring_bytes=10**6, copy_bytes=65536 + 1024,
                       bias_bytes=0)
    assert plan.calls[1].pieces[0].span == 1


def test_pieces_start_at_multiples_of_128_rows_where_copies_hold_that_many():
    lays, _ = layouts([(100, 1024), (1000, 1024)])  # 4 KiB rows
    plan = plan_stream(lays, [0, 1], ring_bytes=10**7, copy_bytes=2 * 2**20, bias_bytes=0)
    assert [p.rows for p in plan.calls[1].pieces] == [(0, 384), (384, 896), (896, 1000)]
    check_plan(plan, lays)
    # A weight's rows that fit in what is left of the span stay whole, not cut at 128
    # (a copy of 160 rows; 150 left after the first weight's 10; the second has 140).
    lays, _ = layouts([(10, 1024), (140, 1024)])
    plan = plan_stream(lays, [0, 1], ring_bytes=10**7, copy_bytes=160 * 4096, bias_bytes=0)
    assert [(p.rows, p.span) for p in plan.calls[1].pieces] == [((0, 140), 0)]
    check_plan(plan, lays)


def test_the_ring_wraps_and_every_lap_reads_the_same_bytes():
    lays, _ = layouts([(64, 64)] * 5)  # 16 KiB each
    plan = plan_stream(lays, range(5), ring_bytes=40000, copy_bytes=16384, bias_bytes=0)
    assert [s.ring_begin for s in plan.spans] == [0, 16384, 0, 16384, 0]
    # Each waits for the readers of the span that last held its bytes, only.
    assert [s.waits for s in plan.spans] == [((4, -1),), ((3, -1),), ((0, 0),), ((1, 0),),
                                             ((2, 0),)]


def test_a_call_order_the_arena_does_not_follow_gets_a_span_per_run():
    lays, _ = layouts([(16, 64)] * 4)
    plan = plan_stream(lays, [0, 2, 1, 3], ring_bytes=10**6, copy_bytes=10**5, bias_bytes=0)
    assert len(plan.spans) == 4  # nothing adjacent in the arena in that order
    assert plan_stream(lays, [0, 1, 2, 3], 10**6, 10**5, 0).spans[0].nbytes == 4 * 4096


def test_a_ring_smaller_than_a_row_is_refused_with_what_it_needs():
    lays, _ = layouts([(4, 1024)])
    with pytest.raises(ValueError, match="staging ring of 2.0 KiB cannot hold one copy of "
                                         "4.0 KiB .* give staging at least 4352 bytes"):
        plan_stream(lays, [0], ring_bytes=2048, copy_bytes=100, bias_bytes=0)


def test_sizes_are_read_and_written_in_units():
    assert parse_bytes("x", "6GiB") == 6 * 2**30
    assert parse_bytes("x", "512 MiB") == 512 * 2**20
    assert parse_bytes("x", "6GB") == 6 * 10**9
    assert parse_bytes("x", "1.5gib") == 3 * 2**29
    assert parse_bytes("x", 1000) == 1000
    for bad in ("six GiB", "6 GiBs", "-1"):
        with pytest.raises(ValueError, match=r"x: cannot read .* as a size"):
            parse_bytes("x", bad)
    with pytest.raises(TypeError, match="x: expected bytes"):
        parse_bytes("x", 2.5)
    assert [format_bytes(n) for n in (512, 3 * 2**10, 208 * 2**20, 1.62 * 2**30)] == [
        "512 B", "3.0 KiB", "208.0 MiB", "1.6 GiB"]


# ---------------------------------------------------------------------------- forwards


def offloaded(ref, **kwargs):
    return codegen.nn.offload(copy.deepcopy(ref), device="cpu", **kwargs)


@pytest.mark.parametrize("staging, copy_size", [(None, None), (20000, 4096), ("12KiB", None)])
def test_forwards_and_generate_match_the_original(staging, copy_size):
    ref = tiny_llama(seed=3)
    model = offloaded(ref, staging=staging, copy_size=copy_size)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        for _ in range(3):  # the second and third forwards read what the first queued
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5,
                                       atol=1e-5)
    r = codegen.nn.report(model)
    assert r.unplanned_calls == 0 and r.linears == 15
    assert r.copies == sum(1 for s in r.plan.spans)
    assert r.staging_bytes == r.plan.ring_bytes
    assert_same_greedy_generate(model, ref, torch.randint(0, 97, (1, 6)), 6)


def test_the_default_staging_is_half_the_largest_layer():
    ref = tiny_llama()
    model = offloaded(ref)
    layer = sum(m.weight.numel() * 4 for m in ref.model.layers[0].modules()
                if isinstance(m, nn.Linear))
    plan = model._codegen_offload.streamer.plan
    assert layer // 2 <= plan.ring_bytes <= layer // 2 + plan.copy_bytes + 64 * 4 + 2 * ALIGN
    assert len(plan.spans) > 1


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_quantized_models_default_staging_holds_four_of_its_largest_weights(kind):
    """A prefill's GEMM reads its whole weight dequantized, so a quantized model's ring
    holds at least four of its largest streamed weights (or the whole lap), more than half
    of its largest layer."""
    from codegen.nn.offload import default_staging
    from codegen.nn.plan import round_up

    ref = tiny_llama(hidden=128, intermediate=512, layers=6)
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", quantize=kind)
    plan = model._codegen_offload.streamer.plan
    largest = max(round_up(lay.weight_bytes, ALIGN) for lay in plan.layouts)
    layer = sum(lay.weight_bytes for lay in plan.layouts if ".layers.0." in lay.name)
    lap = sum(round_up(lay.weight_bytes, ALIGN) for lay in plan.layouts)
    assert 4 * largest < lap and 4 * largest > layer // 2 + ALIGN
    assert default_staging(list(plan.layouts)) == round_up(4 * largest, ALIGN)
    assert plan.ring_bytes >= 4 * largest
    bf16 = dataclasses.replace(plan.layouts[0], quant=None)  # not quantized: half a layer
    assert default_staging([bf16]) == round_up(bf16.weight_bytes // 2, ALIGN)


def test_a_quantized_weight_larger_than_a_scratch_counts_one_scratch_of_rows():
    """An 8B-shaped layer and an untied lm_head of 128256 rows, in fp8: lm_head runs a
    prefill as several scratches of SCRATCH_BYTES dequantized (16384 of its 4096-wide bf16
    rows), so the ring holds four scratches' rows of it, not four lm_heads (2 GiB)."""
    from codegen.nn.offload import default_staging
    from codegen.nn.plan import round_up
    from codegen.nn.streamer import SCRATCH_BYTES

    shapes = [("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096),
              ("o_proj", 4096, 4096), ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096),
              ("down_proj", 4096, 14336)]
    layouts, at = [], 0
    for i in range(4):
        for name, out, inp in shapes:
            layouts.append(Layout(f"model.layers.{i}.{name}", torch.bfloat16, out, inp, at,
                                  None, "fp8"))
            at += round_up(layouts[-1].weight_bytes, ALIGN)
    gate = layouts[4].weight_bytes  # 14336 rows of 4096 values and a bf16 scale
    assert gate == 14336 * 4098 and SCRATCH_BYTES // (4096 * 2) >= 14336
    assert default_staging(layouts) == round_up(4 * round_up(gate, ALIGN), ALIGN)
    lm_head = Layout("lm_head", torch.bfloat16, 128256, 4096, at, None, "fp8")
    rows = SCRATCH_BYTES // (4096 * 2)
    assert rows == 16384
    assert default_staging([*layouts, lm_head]) == round_up(4 * round_up(rows * 4098, ALIGN),
                                                            ALIGN)


def test_biases_travel_in_one_block():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                        nn.Linear(48, 8, bias=False), nn.Linear(8, 24))
    model = offloaded(ref, staging=9000, copy_size=4096)
    plan = model._codegen_offload.streamer.plan
    assert plan.spans[0].is_bias_block and plan.bias_bytes >= (64 + 48 + 24) * 4
    check_plan(plan, plan.layouts)
    x = torch.randn(5, 40)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), ref(x))


class Reordered(nn.Module):
    """Registers its Linears in one order and calls them in another, conditionally."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.skip_b = False

    def forward(self, x):
        x = self.c(x)
        if not self.skip_b:
            x = self.b(x)
        return self.a(x)


def test_a_new_call_order_is_learnt_after_one_forward():
    ref = Reordered()
    model = offloaded(ref, staging=9000, copy_size=4096)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
        assert codegen.nn.report(model).unplanned_calls == 3  # off the plan from the start
        for _ in range(2):
            torch.testing.assert_close(model(x), ref(x))
            assert codegen.nn.report(model).unplanned_calls == 0
        model.skip_b = ref.skip_b = True  # the order changes again
        torch.testing.assert_close(model(x), ref(x))
        assert codegen.nn.report(model).unplanned_calls == 1
        torch.testing.assert_close(model(x), ref(x))
        assert codegen.nn.report(model).unplanned_calls == 0
    assert model._codegen_offload.streamer.plan.order == (2, 0)


def test_a_forward_that_raises_halfway_leaves_the_next_one_right():
    ref = tiny_llama(seed=2)
    model = offloaded(ref, staging=20000, copy_size=4096)
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        model(ids)
        boom = model.model.layers[1].mlp.register_forward_pre_hook(
            lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(ids)
        boom.remove()
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert codegen.nn.report(model).restart == (
            "the last forward did not end (it raised, or this one began inside it)")
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert codegen.nn.report(model).restart is None


def test_a_weight_written_in_place_between_forwards_is_read_new():
    """The next forward's first spans were copied when the last forward ended; a weight
    written since (its version counter moved) has them copied again."""
    ref = tiny_llama(seed=4)
    model = offloaded(ref, staging=20000, copy_size=4096)
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        model(ids)
        for m, r in ((model.model.layers[0].self_attn.q_proj,
                      ref.model.layers[0].self_attn.q_proj), (model.lm_head, ref.lm_head)):
            m.weight.mul_(-1)
            r.weight.mul_(-1)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert codegen.nn.report(model).restart == "a weight was written in place"
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert codegen.nn.report(model).restart is None


def test_a_second_threads_forward_runs_off_the_plan_and_right():
    ref = tiny_llama(seed=5)
    model = offloaded(ref, staging=20000, copy_size=4096)
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        expect = ref(ids).logits
        model(ids)
    results, inside = [], threading.Event()
    release = threading.Event()

    def hold(*args):  # the main thread's forward waits here, inside its forward
        inside.set()
        release.wait(30)

    hook = model.model.layers[1].register_forward_pre_hook(hold)

    def other():
        inside.wait(30)
        with torch.no_grad():
            results.append(model(ids).logits)
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with torch.no_grad():
        first = model(ids).logits
    t.join()
    hook.remove()
    torch.testing.assert_close(first, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0], expect, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expect, rtol=1e-5, atol=1e-5)


def test_gradients_take_the_compiled_programs():
    ref = tiny_llama(seed=6)
    model = offloaded(ref, staging=20000, copy_size=4096)
    ids = torch.randint(0, 97, (1, 5))
    model(ids).logits.sum().backward()
    ref(ids).logits.sum().backward()
    torch.testing.assert_close(model.lm_head.weight.grad, ref.lm_head.weight.grad,
                               rtol=1e-4, atol=1e-5)
    # The programs copy each weight in slices (8, the default), not by the copy plan.
    r = codegen.nn.report(model)
    assert r.copies == 15 * 8 and r.unplanned_calls == 0


def test_a_copy_without_its_waits_is_caught(monkeypatch):
    """The CPU backend's order check is what the tests above rely on: a plan whose copies
    do not wait for the readers of the bytes they overwrite is caught at the first such
    copy."""
    import dataclasses

    from codegen.nn import streamer as streamer_module

    ref = tiny_llama(seed=7)
    model = offloaded(ref, staging=20000, copy_size=4096)
    s = model._codegen_offload.streamer
    s.plan = dataclasses.replace(s.plan, spans=tuple(
        dataclasses.replace(span, waits=()) for span in s.plan.spans))
    s._set_plan(s.plan)
    ids = torch.randint(0, 97, (1, 5))
    with pytest.raises(codegen.InternalError, match="staging order: .* not ordered after"), \
            torch.no_grad():
        model(ids)
    assert streamer_module.OrderCheck  # the checker the message comes from


def test_a_read_before_its_copy_is_caught():
    from codegen.nn.streamer import OrderCheck

    check = OrderCheck()
    check.access("copy", "ring", 0, 100, write=True)
    with pytest.raises(codegen.InternalError, match="read of ring\\[50:60\\] on current is not "
                                                    "ordered after the copy"):
        check.access("current", "ring", 50, 60, write=False)
    check.wait("current", check.record("copy"))
    check.access("current", "ring", 50, 60, write=False)


def test_few_rows_run_a_calls_pieces_as_one_gemm_per_run_back_to_back_in_the_ring():
    """A call with at most MERGED_ROWS input rows (a decode step) runs one GEMM per run of
    its pieces that lie back to back in the ring, waiting for all of the run's spans
    first; a run ends where the ring wraps. Larger inputs run one GEMM per piece."""
    from codegen.nn.streamer import Streamer

    lays, total = layouts([(64, 64)] * 2)  # 16 KiB each, 4 KiB copies: 4 spans a weight
    plan = plan_stream(lays, [0, 1], ring_bytes=5 * 4096, copy_bytes=4096, bias_bytes=0)
    s = Streamer(plan, torch.zeros(total, dtype=torch.uint8), torch.device("cpu"), [])
    for call, pieces, merged in zip(plan.calls, s.piece_groups, s.merged_groups):
        assert [g[0] for g in pieces] == [(p.span,) for p in call.pieces]
        assert [g[7:9] for g in pieces] == [p.rows for p in call.pieces]
        # The runs cover the call's rows and spans in order, each back to back in the ring.
        assert [j for g in merged for j in g[0]] == [p.span for p in call.pieces]
        assert merged[0][7] == 0 and merged[-1][8] == 64
        assert all(a[8] == b[7] for a, b in zip(merged, merged[1:]))
        for g in merged:
            assert g[4] - g[3] == (g[8] - g[7]) * 64 * 4
            assert sorted(g[9]) == sorted(j for p in call.pieces if p.span in g[0]
                                          for j in p.frees)
    # The runs are the longest back to back in the ring: here the ring wraps inside both
    # calls (ring places 8448, 12544, 0, 4096, ...: each lap starts where the last one's
    # wrap ended).
    ring_at = [sp.ring_begin for sp in plan.spans]
    want: list[list[tuple[int, ...]]] = []
    for call in plan.calls:
        runs = [[call.pieces[0].span]]
        for p in call.pieces[1:]:
            if ring_at[p.span] == ring_at[runs[-1][-1]] + 4096:
                runs[-1].append(p.span)
            else:
                runs.append([p.span])
        want.append([tuple(r) for r in runs])
    assert [[g[0] for g in m] for m in s.merged_groups] == want
    assert want == [[(0, 1), (2, 3)], [(4, 5, 6), (7,)]]
    assert s.merged_groups[1][1] is s.piece_groups[1][3]  # a run of one is its piece


@pytest.mark.parametrize("rows", [1, 64, 65, 64 * 3])
@pytest.mark.parametrize("staging, copy_size", [(20000, 4096), ("12KiB", 2048), (None, None)])
def test_forwards_of_few_and_many_rows_match_the_original(rows, staging, copy_size):
    """Both ways a call runs (merged runs of pieces up to MERGED_ROWS input rows, a GEMM
    per piece beyond), under rings that wrap, every staging read checked against its copy
    by the CPU backend's order check."""
    from codegen.nn.streamer import MERGED_ROWS

    assert MERGED_ROWS == 64
    ref = tiny_llama(seed=11, max_positions=256)
    model = offloaded(ref, staging=staging, copy_size=copy_size)
    ids = torch.randint(0, 97, (1, rows))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5,
                                       atol=1e-5)
    r = codegen.nn.report(model)
    assert r.unplanned_calls == 0 and r.copies == len(r.plan.spans)


@pytest.mark.parametrize("rows", [1, 65])
def test_the_callers_stream_waits_once_for_each_span_it_reads(rows, monkeypatch):
    """Copies run in the order they were queued, so one wait orders the caller's stream
    after every copy queued before it: a span read by two pieces (a span across two
    Linears) or the bias block read by every call is waited for once a forward, and a
    merged run of pieces over several spans (a call of few rows) waits once, for its last
    span. Every read is still checked against its copy by the order check, which skipping
    one wait too many trips."""
    from codegen.nn.streamer import MERGED_ROWS

    ref = tiny_llama(seed=5, max_positions=128)
    model = offloaded(ref, staging=90000, copy_size=40000)  # spans of two and more weights
    s = model._codegen_offload.streamer
    # Where the stream must wait: at each GEMM (or the bias block) that reads a span past
    # every span read before it in the forward.
    expected, past = 0, -1
    groups = s.merged_groups if rows <= MERGED_ROWS else s.piece_groups
    for call, gemms in zip(s.plan.calls, groups):
        reads = ([(call.bias_span,)] if call.bias_span is not None else []) + [
            g[0] for g in gemms]
        for spans in reads:
            if max(spans) > past:
                expected, past = expected + 1, max(spans)
    assert past == len(s.plan.spans) - 1
    if rows > MERGED_ROWS:
        assert expected == len(s.plan.spans)  # a GEMM per piece: each span's first read
    else:
        assert expected < len(s.plan.spans)  # some run of pieces spans several copies
    waits: list[object] = []
    wait = s.backend.wait
    monkeypatch.setattr(s.backend, "wait", lambda stream, event: (
        waits.append(stream) if stream == "current" else None, wait(stream, event)))
    ids = torch.randint(0, 97, (1, rows))
    with torch.no_grad():
        for _ in range(3):
            waits.clear()
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5,
                                       atol=1e-5)
            assert len(waits) == expected
    pieces = sum(len(call.pieces) for call in s.plan.calls)
    assert pieces > len(s.plan.spans)  # some spans hold two Linears' weights
    monkeypatch.setattr(s, "settled", 10**9)  # every span taken as waited for
    with pytest.raises(codegen.InternalError, match="staging order: read of ring"), \
            torch.no_grad():
        model(ids)


@pytest.mark.parametrize("staging, copy_size", [(200000, 30000), (40000, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_forwards_on_two_caller_streams_in_turn(bias, staging, copy_size, monkeypatch):
    """Forwards on two caller streams in turn (as a server's per-request streams): a lap's
    copies wait for frees recorded on the last forward's stream and on this one's, each
    for its own. The CPU backend's order check gets a second stream."""
    ref = tiny_llama(seed=3 if bias else 8, max_positions=128, bias=bias)
    model = offloaded(ref, staging=staging, copy_size=copy_size)
    s = model._codegen_offload.streamer
    assert (s.plan.bias_bytes > 0) == bias
    s.backend.check.clock["other"] = {}
    current = ["current"]
    monkeypatch.setattr(s.backend, "current", lambda: current[0])
    for rows in (1, 65):
        ids = torch.randint(0, 97, (1, rows))
        with torch.no_grad():
            for name in ("current", "other", "current", "other"):
                current[0] = name
                torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5,
                                           atol=1e-5)


@pytest.mark.parametrize("staging, copy_size", [(60000, 8000), (90000, 20000), (40000, 4096)])
def test_a_restart_orders_the_copies_after_every_stream_that_read(staging, copy_size,
                                                                  monkeypatch):
    """A forward on another stream, then a weight written in place: the next forward
    starts the copies over, and they must wait for the other stream's reads as well as
    the current one's (the order check has both streams)."""
    ref = tiny_llama(seed=1, max_positions=128)
    model = offloaded(ref, staging=staging, copy_size=copy_size)
    s = model._codegen_offload.streamer
    s.backend.check.clock["other"] = {}
    current = ["current"]
    monkeypatch.setattr(s.backend, "current", lambda: current[0])
    ids = torch.randint(0, 97, (1, 65))
    with torch.no_grad():
        model(ids)
        current[0] = "other"
        model(ids)
        current[0] = "current"
        model.model.layers[0].mlp.up_proj.weight.mul_(1)  # written in place: a restart
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert codegen.nn.report(model).restart == "a weight was written in place"
