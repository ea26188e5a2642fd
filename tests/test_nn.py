"""codegen.nn.offload on the CPU: a tiny transformers Llama built from a config (random
weights), its Linears offloaded and run through the evaluator, against the original."""

import copy

import pytest
import torch
from helpers import tiny_llama
from torch import nn

import codegen.nn


def offloaded(ref, **kwargs):
    model = copy.deepcopy(ref)
    return codegen.nn.offload(model, device="cpu", **kwargs)


@pytest.mark.parametrize("slices", [1, 3, 8])
def test_logits_match_the_original(slices):
    ref = tiny_llama()
    model = offloaded(ref, slices=slices)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_greedy_generate_is_identical():
    ref = tiny_llama(seed=1)
    model = offloaded(ref, slices=4)
    ids = torch.randint(0, 97, (1, 7))
    mask = torch.ones_like(ids)
    expect = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expect)


def test_every_untied_linear_is_offloaded_into_one_exact_arena():
    ref = tiny_llama()
    model = offloaded(ref)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; lm_head
    assert all(isinstance(m, codegen.nn.OffloadedLinear) for m in linears)
    arena = codegen.nn.arena(model)
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert weights <= arena.nbytes <= weights + codegen.nn.ALIGN * len(linears)
    base = arena.storage.data_ptr()
    for m in linears:  # every weight is a view of the arena
        assert base <= m.weight.data_ptr() < base + arena.nbytes
        assert (m.weight.data_ptr() - base) % codegen.nn.ALIGN == 0


def test_a_tied_lm_head_stays_with_its_embedding():
    model = offloaded(tiny_llama(tie=True))
    assert not isinstance(model.lm_head, codegen.nn.OffloadedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="lm_head.weight is shared with another module"):
        offloaded(tiny_llama(tie=True), filter=lambda name, m: True)


def test_filter_narrows_and_the_report_counts_what_ran():
    ref = tiny_llama()
    model = offloaded(ref, filter=lambda name, m: name.endswith("mlp.down_proj"))
    kinds = [n for n, m in model.named_modules() if isinstance(m, codegen.nn.OffloadedLinear)]
    assert kinds == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    r = codegen.nn.report(model)
    down = model.model.layers[0].mlp.down_proj
    assert r.linears == 2 and r.bytes_moved == 2 * down.weight.numel() * 4
    assert set(r.as_dict()) == {"linears", "bytes_moved", "forward_ms", "gbps", "copy_floor_ms",
                                "copy_gbps", "floor_share", "beyond_floor_ms"}
    assert "2 Linear calls read 0.000 GB" in r.line()


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects an nn.Module, got int"):
        codegen.nn.offload(3)
    with pytest.raises(codegen.ScheduleError, match="slices must be an int >= 1, got 0"):
        codegen.nn.offload(tiny_llama(), slices=0, device="cpu")
    model = offloaded(tiny_llama())
    with pytest.raises(ValueError, match="offloaded already"):
        codegen.nn.offload(model, device="cpu")
    with pytest.raises(ValueError, match="has not run a forward yet"):
        codegen.nn.report(model)
    with pytest.raises(ValueError, match="was not offloaded"):
        codegen.nn.report(tiny_llama())
    lin = codegen.nn.offload(nn.Sequential(nn.Linear(4, 3)), device="cpu")
    with pytest.raises(ValueError, match="weight is torch.float32, its input torch.float64"):
        lin(torch.zeros(2, 4, dtype=torch.float64))


def test_linear_subclasses_attention_and_tied_linears_stay():
    """Exactly nn.Linear is offloaded: a subclass keeps its own forward, the Linear inside
    nn.MultiheadAttention (whose weight attention reads itself) stays, and two Linears
    sharing one weight stay tied."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight
    model = nn.ModuleDict({"scaled": Scaled(8, 8), "mha": nn.MultiheadAttention(8, 2),
                           "a": a, "b": b, "plain": nn.Linear(8, 4)})
    codegen.nn.offload(model, device="cpu")
    offloaded = [n for n, m in model.named_modules()
                 if isinstance(m, codegen.nn.OffloadedLinear)]
    assert offloaded == ["plain"]
    assert type(model["scaled"]) is Scaled and model["a"].weight is model["b"].weight
    with pytest.raises(ValueError, match="scaled is a Scaled, not an nn.Linear"):
        codegen.nn.offload(nn.ModuleDict({"scaled": Scaled(8, 8)}), device="cpu",
                           filter=lambda name, m: True)
    with pytest.raises(ValueError, match="a.weight is shared with another module"):
        codegen.nn.offload(nn.ModuleDict({"a": a, "b": b}), device="cpu",
                           filter=lambda name, m: name == "a")


def test_an_offloaded_model_refuses_a_deep_copy_by_name():
    model = codegen.nn.offload(nn.Sequential(nn.Linear(8, 4)), slices=2, device="cpu")
    with pytest.raises(ValueError, match=r"codegen.nn.offload: an offloaded model cannot be "
                                         r"deep-copied .* deep-copy the model before"):
        copy.deepcopy(model)
