"""A GPU memory budget for an offloaded model (``offload(..., gpu_budget=...)``), on the CPU:
which Linears the placement keeps resident and how evenly, the budget held by the resident
weights and the staging together, the least budget refused with what it needs, the plan
readable and printed, and forwards and generate equal to the original model's at every
budget."""

import copy

import pytest
import torch
from helpers import allocated, assert_same_greedy_generate, tiny_llama
from torch import nn

import codegen.nn
from codegen.nn.plan import ALIGN, Resident, format_bytes, least_staging, place


def linears(n, out=64, inp=32, dtype=torch.float32, bias=False, name="layers"):
    return [Resident(f"{name}.{i}.proj", dtype, out, inp, bias) for i in range(n)]


def offloadable_bytes(model):
    return sum(t.numel() * t.element_size() for m in model.modules() if type(m) is nn.Linear
               for t in (m.weight, m.bias) if t is not None and m is not model.lm_head)


def offloaded(ref, **kwargs):
    # lm_head left out: tied or not, it is what a budget would keep first in practice.
    return codegen.nn.offload(copy.deepcopy(ref), device="cpu",
                              filter=lambda n, m: n != "lm_head", **kwargs)


# ---------------------------------------------------------------------------- placement


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99])
def test_the_placement_holds_the_budget_and_spreads_the_resident_bytes(share):
    lins = linears(40)
    total = sum(lay.nbytes for lay in lins)
    staging = 3 * lins[0].weight_bytes
    budget = staging + int(share * (total - staging))
    kept, ring = place(lins, budget, None, staging)
    assert ring == staging
    used = sum(lins[i].weight_bytes for i in kept)
    assert used + ring <= budget
    # Nothing left out that would still fit (the placement fills the budget)...
    assert budget - ring - used < lins[0].weight_bytes
    # ... the forward's ends streamed (the three Linears a full ring holds at its start,
    # and the last) unless every other Linear is resident...
    middle = range(3, 39)
    if not set(middle) <= kept:
        assert not kept & {0, 1, 2, 39}, sorted(kept)
    # ... and the rest spread: each quarter of the middle keeps about a quarter of them.
    in_middle = len(kept & set(middle))
    for q in range(4):
        in_quarter = sum(1 for i in kept if 3 + q * 9 <= i < 3 + (q + 1) * 9)
        assert abs(in_quarter - in_middle / 4) <= 1.5, (q, sorted(kept))


def test_the_forwards_ends_are_resident_only_where_everything_else_is():
    """The ends (here Linear 0, which a ring of a few rows holds, and Linear 9) are the
    last choice, not barred: a budget with room for nine Linears beside the ring keeps
    the eight between the ends and one end; with room for eight, the eight between."""
    lins = linears(10)
    each, ring = lins[0].weight_bytes, 512
    kept, got = place(lins, 9 * each + ring, None, ring)
    assert got == ring and kept == set(range(9))
    kept, got = place(lins, 8 * each + ring, None, ring)
    assert got == ring and kept == set(range(1, 9))


def test_linears_of_different_sizes_are_placed_within_the_budget_as_allocated():
    """Each GPU tensor counted as the allocator hands it out: every resident weight and
    bias, the ring, the bias buffer (small odd sizes, so that the rounding matters)."""
    lins = [Resident(f"l.{i}", torch.bfloat16, out, 96, bias=i % 3 == 0)
            for i, out in enumerate([500, 61, 67, 509, 1341, 1345, 515] * 3)]
    total = sum(allocated(lay.weight_bytes) + allocated(lay.nbytes - lay.weight_bytes)
                for lay in lins)
    biases = allocated(sum(-(-(lay.nbytes - lay.weight_bytes) // ALIGN) * ALIGN
                           for lay in lins))
    for budget in range(least_staging(lins), total + 4096, 997):
        kept, ring = place(lins, budget, None, 200_000)
        if len(kept) == len(lins):
            assert ring == 0 and total <= budget
            continue
        resident = sum(allocated(lins[i].weight_bytes)
                       + allocated(lins[i].nbytes - lins[i].weight_bytes) for i in kept)
        assert resident + allocated(ring) + biases <= budget, budget


def test_a_budget_of_the_unrounded_bytes_does_not_keep_every_linear():
    lins = [Resident(f"l.{i}", torch.float32, 100, 10, bias=False) for i in range(3)]
    assert sum(lay.nbytes for lay in lins) == 12000  # 4096 each, as allocated
    kept, ring = place(lins, 12000, None, 4096)
    assert len(kept) < 3 and ring > 0
    kept, ring = place(lins, 3 * 4096, None, 4096)
    assert len(kept) == 3 and ring == 0


def test_a_budget_that_holds_every_linear_streams_none():
    lins = linears(5)
    kept, ring = place(lins, sum(lay.nbytes for lay in lins), None, 4096)
    assert kept == frozenset(range(5)) and ring == 0


def test_a_budget_below_the_least_staging_is_refused_with_the_minimum():
    lins = linears(5, bias=True)
    least = least_staging(lins)
    # A ring of one row of 32 floats (and ALIGN), five biases of ALIGN, each as allocated.
    assert least == allocated(32 * 4 + ALIGN) + allocated(5 * ALIGN)
    with pytest.raises(ValueError, match=rf"gpu_budget of {least - 1} bytes .* needs: "
                                         rf"{least} bytes"):
        place(lins, least - 1, None, 4096)
    kept, ring = place(lins, least, None, 4096)
    assert not kept and 32 * 4 + ALIGN <= ring and allocated(ring) + allocated(5 * ALIGN) <= least


def test_a_staging_larger_than_the_budget_or_below_a_row_is_refused_by_name():
    with pytest.raises(ValueError, match=r"staging=9000 bytes .* exceed gpu_budget=8000"):
        place(linears(5), 8000, 9000, 4096)
    with pytest.raises(ValueError, match=r"staging=100 bytes cannot hold one copy of the "
                                         r"widest streamed weight row; give staging >= 384"):
        place(linears(5), 8000, 100, 4096)


# ---------------------------------------------------------------------------- the model


def assert_forwards_match(model, ref, ids):
    """Three forwards of the offloaded ``model`` equal ``ref``'s, all planned; the report."""
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5,
                                       atol=1e-5)
    r = codegen.nn.report(model)
    assert r.unplanned_calls == 0
    return r


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_forwards_and_generate_match_the_original_at_every_budget(share):
    ref = tiny_llama(seed=5, layers=3)
    total = offloadable_bytes(ref)
    budget = max(int(share * total), 8192)
    model = offloaded(ref, gpu_budget=budget)
    plan = codegen.nn.offload_plan(model)
    assert plan.gpu_bytes <= budget and plan.budget == budget
    assert plan.resident_bytes + plan.streamed_bytes == total
    streamed = {lay.name for lay in plan.streamed}
    resident = {r.name for r in plan.resident}
    assert not streamed & resident and len(streamed | resident) == 21
    for name, m in model.named_modules():
        if name in resident:
            assert type(m) is nn.Linear  # on the device, plain; not in the arena
        elif name in streamed:
            assert isinstance(m, codegen.nn.OffloadedLinear)
    # The arena holds the streamed weights only.
    assert codegen.nn.arena(model).nbytes <= plan.streamed_bytes + 2 * 21 * ALIGN
    r = assert_forwards_match(model, ref, torch.randint(0, 97, (2, 9)))
    assert r.linears == len(streamed)
    assert r.bytes_moved == plan.streamed_bytes
    assert_same_greedy_generate(model, ref, torch.randint(0, 97, (1, 5)), 5)


def test_the_plan_says_what_is_resident_and_streamed_and_what_a_forward_costs():
    ref = tiny_llama(seed=1, layers=4)
    total = offloadable_bytes(ref)
    model = offloaded(ref, gpu_budget=f"{total // 2}B")
    plan = codegen.nn.offload_plan(model)
    text = plan.placement()
    assert text.startswith(f"placement (gpu_budget {format_bytes(total // 2)}): resident ")
    for r in plan.resident:
        assert f"resident  {r.name}: [{r.out_features}, {r.in_features}]" in text
    for lay in plan.streamed:
        assert f"streamed  {lay.name}: [{lay.out_features}, {lay.in_features}]" in text
    assert text.index("layers.2.") < text.index("layers.3.")  # in the model's order
    assert text in str(plan)  # printing the plan prints the placement, then the copies
    # Decode is bound by the copies: the streamed bytes at the copy rate.
    assert plan.expected_ms(1) == pytest.approx(plan.streamed_bytes / 55.3e6)
    assert plan.expected_ms(10**7) > plan.expected_ms(1)  # a huge prefill: the GEMMs


@pytest.mark.parametrize("optimize_for", ["decode", "prefill"])
def test_the_budget_keeps_its_split_when_the_call_order_is_learnt_again(optimize_for):
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    model = codegen.nn.offload(copy.deepcopy(ref), device="cpu", gpu_budget=6 * 64 * 64 * 4,
                               optimize_for=optimize_for)
    before = codegen.nn.offload_plan(model)
    assert before.resident and before.streamed
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
        model.forward = lambda t: nn.Sequential(*reversed(list(model)))(t)  # another order
        reversed_ref = nn.Sequential(*reversed(list(ref)))
        for _ in range(2):
            torch.testing.assert_close(model(x), reversed_ref(x))
    after = codegen.nn.offload_plan(model)
    assert after is not before and after.order != before.order  # planned again
    assert after.resident == before.resident and after.budget == before.budget
    assert after.optimize_for == optimize_for and after.ring_bytes == before.ring_bytes


def test_bad_budgets_are_refused_by_name():
    ref = tiny_llama(seed=2)
    with pytest.raises(ValueError, match="gpu_budget: cannot read 'lots'"):
        offloaded(ref, gpu_budget="lots")
    with pytest.raises(ValueError, match="gpu_budget needs prefetch=True"):
        offloaded(ref, gpu_budget="1MiB", prefetch=False)
    with pytest.raises(ValueError, match=r"gpu_budget of 100 bytes .* give gpu_budget >= "):
        offloaded(ref, gpu_budget=100)
    assert type(ref.model.layers[0].mlp.up_proj) is nn.Linear  # refused before any change


# ---------------------------------------------------------------------------- optimize_for


def layer_bytes(model, layer=0):
    """The arena bytes of one decoder layer's Linears, each at a multiple of ALIGN."""
    return sum(-(-m.weight.numel() * m.weight.element_size() // ALIGN) * ALIGN
               for n, m in model.named_modules()
               if type(m) is nn.Linear and n.startswith(f"model.layers.{layer}."))


def test_a_plan_for_prefill_stages_a_whole_layer_where_decode_stages_half():
    ref = tiny_llama(seed=6, layers=3)
    whole = layer_bytes(ref)
    decode = codegen.nn.offload_plan(offloaded(ref))
    prefill = codegen.nn.offload_plan(offloaded(ref, optimize_for="prefill"))
    assert decode.ring_bytes == whole // 2 and decode.optimize_for == "decode"
    assert prefill.ring_bytes == whole and prefill.optimize_for == "prefill"
    assert prefill.streamed_bytes == decode.streamed_bytes  # no budget: everything streamed
    assert "optimized for prefill" in prefill.placement()
    assert "optimized for" not in decode.placement()


@pytest.mark.parametrize("share", [0.5, 0.75])
def test_a_plan_for_prefill_under_a_budget_holds_it_and_matches_the_original(share):
    ref = tiny_llama(seed=7, layers=3)
    budget = int(share * offloadable_bytes(ref))
    decode = codegen.nn.offload_plan(offloaded(ref, gpu_budget=budget))
    model = offloaded(ref, gpu_budget=budget, optimize_for="prefill")
    plan = codegen.nn.offload_plan(model)
    # The larger ring comes out of the resident weights: more is streamed, within budget.
    assert plan.ring_bytes == layer_bytes(ref) == 2 * decode.ring_bytes
    assert plan.gpu_bytes <= budget and decode.gpu_bytes <= budget
    assert plan.streamed_bytes > decode.streamed_bytes
    r = assert_forwards_match(model, ref, torch.randint(0, 97, (2, 11)))
    assert r.bytes_moved == plan.streamed_bytes
    assert r.plan.optimize_for == "prefill"
    # A budget smaller than a whole layer's ring holds: the ring is what it leaves (no
    # biases here), in the allocator's 512-byte steps; the decode plan's is half a layer.
    budget = layer_bytes(ref) // 2 + 4096
    small = codegen.nn.offload_plan(offloaded(ref, gpu_budget=budget, optimize_for="prefill"))
    assert small.ring_bytes == budget // 512 * 512 and small.gpu_bytes <= budget
    assert codegen.nn.offload_plan(offloaded(ref, gpu_budget=budget)).ring_bytes == (
        layer_bytes(ref) // 2)


def test_a_quantized_plan_for_prefill_stages_a_whole_layer_above_the_quantized_floors():
    from codegen.nn.offload import default_staging

    # Two layers of four int4 16384 x 16384 weights: a layer (512 MiB and its scales) is
    # more than four copies or four scratches' rows, so it sizes the ring; half for decode.
    q = [Resident(f"layers.{i}.w{j}", torch.bfloat16, 16384, 16384, False, "int4")
         for i in range(2) for j in range(4)]
    layer = sum(-(-lay.streamed_weight_bytes // ALIGN) * ALIGN for lay in q[:4])
    assert layer > 2**29
    assert default_staging(q, "prefill") == layer
    assert default_staging(q, "decode") == layer // 2
    with pytest.raises(ValueError, match="optimize_for must be one of .* got 'fast'"):
        default_staging(q, "fast")


def test_bad_optimize_for_is_refused_by_name():
    ref = tiny_llama(seed=2)
    with pytest.raises(ValueError, match="optimize_for must be 'decode' or 'prefill', got "
                                         "'fast'"):
        offloaded(ref, optimize_for="fast")
    with pytest.raises(ValueError, match=r"staging='64MiB' sets the ring that "
                                         r"optimize_for='prefill' would size; give one"):
        offloaded(ref, optimize_for="prefill", staging="64MiB")
    with pytest.raises(ValueError, match="optimize_for='prefill' needs prefetch=True"):
        offloaded(ref, optimize_for="prefill", prefetch=False)
    assert type(ref.model.layers[0].mlp.up_proj) is nn.Linear  # refused before any change
