"""codegen.nn.offload on the CPU: a tiny transformers Llama built from a config (random
weights), its Linears offloaded and run through the evaluator, against the original."""

import copy
import pickle
import time

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
    with pytest.raises(ValueError, match="weight is torch.float32, the input torch.float64"):
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


# ---------------------------------------------------------------------------- what users do


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4, bias=False),
                         nn.LayerNorm(4)).to(dtype)


def test_an_optimizer_made_before_offloading_trains_the_offloaded_weights():
    """offload keeps each Parameter (its data moves into the arena): an optimizer, a
    tensor hook and a .grad made before it still act on the weights the forward reads."""
    ref = _mlp()
    model = copy.deepcopy(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in (ref, model)]
    params = list(model.parameters())
    hooked = []
    model[0].weight.register_hook(lambda g: hooked.append(g.shape))
    codegen.nn.offload(model, device="cpu")
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    base = codegen.nn.arena(model).storage.data_ptr()
    assert base <= model[0].weight.data_ptr() < base + codegen.nn.arena(model).nbytes
    x, target = torch.randn(3, 6), torch.randn(3, 4)
    for _ in range(2):
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            (m(x) * target).sum().backward()
            opt.step()
    assert hooked == [(5, 6), (5, 6)]
    for (name, want), got in zip(ref.named_parameters(), model.parameters()):
        assert not torch.equal(want, _mlp().state_dict()[name]), name  # it did train
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_autocast_computes_in_its_dtype_where_that_is_the_weights():
    ref = _mlp(torch.bfloat16)
    model = offloaded(ref)
    x = torch.randn(3, 6)  # fp32, as a norm under autocast gives
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    fp32 = offloaded(_mlp())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"codegen.nn.offload: 0: torch.autocast computes this Linear in "
                              r"torch.bfloat16, and its weight is torch.float32 in host memory"
                              r".*model.to\(torch.bfloat16\) before offloading"):
        fp32(x)


def test_a_model_with_nothing_to_offload_is_refused():
    class Conv1D(nn.Module):  # transformers' GPT-2 projection: not an nn.Linear
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4))

    with pytest.raises(ValueError, match=r"no Linear of this Sequential to offload: it has 0 "
                                         r"nn.Linear module\(s\).*Conv1D modules"):
        codegen.nn.offload(nn.Sequential(Conv1D()), device="cpu")
    with pytest.raises(ValueError, match="it has 2 nn.Linear module.*the filter kept none"):
        offloaded(_mlp(), filter=lambda name, m: False)


def test_state_dicts_save_each_weight_alone_in_mixed_dtypes(tmp_path):
    """Each offloaded weight has a storage of its own in the arena: a state dict with two
    dtypes saves (views of one storage as two dtypes would not), and one weight saves
    its own bytes, not the arena's; the values round-trip."""
    ref = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64).to(torch.bfloat16))
    model = offloaded(ref)
    path = tmp_path / "state.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path)
    for name, want in ref.state_dict().items():
        assert torch.equal(loaded[name], want), name
    torch.save(model[1].weight, tmp_path / "w.pt")
    assert (tmp_path / "w.pt").stat().st_size < 64 * 64 * 2 + 2048
    assert codegen.nn.arena(model).nbytes > 3 * 64 * 64 * 2


def test_device_moves_keep_the_arena_and_dtype_changes_are_refused():
    """A conversion that keeps the dtype (a device move) leaves the offloaded weights in
    the arena and converts the rest; one that changes it is refused before any module is
    converted."""
    model = offloaded(_mlp())
    held = model[0].weight.data_ptr()
    norm = model[3].weight.data_ptr()
    assert model.to("cpu") is model and model.cpu() is model and model.float() is model
    model._apply(lambda t: t.clone())  # what a device move does to every other tensor
    assert model[0].weight.data_ptr() == held and model[3].weight.data_ptr() != norm
    with pytest.raises(ValueError, match=r"codegen.nn.offload: 0.weight is torch.float32 in "
                                         r"the offloaded model's pinned arena; converting it to "
                                         r"torch.float16 would take it out"):
        model.half()
    with pytest.raises(ValueError, match="converting it to torch.float64"):
        model[:2].double()  # a part of the model refuses it too
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # nothing converted
    first = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 3))
    codegen.nn.offload(first, device="cpu")
    with pytest.raises(ValueError, match="1.weight is torch.float32"):
        first.half()
    assert first[0].weight.dtype == torch.float32  # the LayerNorm before it, unconverted
    state = {k: v + 1 for k, v in _mlp().state_dict().items()}
    model.load_state_dict(state, assign=True)  # into the arena, not in place of it
    assert model[0].weight.data_ptr() == held
    assert torch.equal(model[0].weight, state["0.weight"])


def test_the_report_is_the_last_root_forward_that_ended(monkeypatch):
    """The forward's time ends with the forward (not at report()); Linears called outside
    a root forward (checkpointing's recomputation in backward) are not counted; a forward
    that raises leaves the report at the last one that ended. The clock is the test's: each
    run of the inner module takes 250 ms of it, backward and the wait before report() 10 s
    more, whatever the machine's speed (the first checkpoint imports torch._dynamo)."""
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def takes_250_ms(module, args):
        clock[0] += 0.25

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _mlp()
            self.inner.register_forward_pre_hook(takes_250_ms)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    model = offloaded(Checkpointed())
    x = torch.randn(3, 6, requires_grad=True)
    model(x).sum().backward()  # the inner module runs again here: the clock is at 100.5
    assert clock[0] == pytest.approx(100.5)
    clock[0] += 10.0
    r = codegen.nn.report(model)
    assert r.linears == 2 and r.bytes_moved == (5 * 6 + 5 + 4 * 5) * 4
    assert r.forward_ms == pytest.approx(250.0)
    with pytest.raises(ValueError, match="last dim is 5"):
        model(torch.randn(3, 5))
    assert codegen.nn.report(model) == r


def test_what_users_get_wrong_is_named():
    model = offloaded(_mlp())
    with pytest.raises(ValueError, match=r"codegen.nn.offload: 2: the input's last dim is 4, "
                                         r"the Linear takes in_features = 5"):
        model[2](torch.randn(3, 4))
    with pytest.raises(TypeError, match=r"an offloaded model cannot be pickled .* save "
                                        r"model.state_dict\(\)"):
        pickle.dumps(model)
    for bad in (0, 2.5, None, True):
        with pytest.raises(codegen.ScheduleError, match="codegen.nn.offload: pool_size must be "
                                                        "an int >= 1, got"):
            offloaded(_mlp(), pool_size=bad)
    with pytest.raises(codegen.ScheduleError, match="codegen.nn.offload: pool_size must be at "
                                                    "most 32 .*, got 33"):
        offloaded(_mlp(), pool_size=33)
    for bad in ("gpu", "meta", 3.5):
        with pytest.raises(ValueError, match="device must be 'cuda' .* or 'cpu'"):
            codegen.nn.offload(_mlp(), device=bad)
    whole = nn.Sequential(_mlp(), nn.Linear(4, 4))
    codegen.nn.offload(whole[0], device="cpu")
    with pytest.raises(ValueError, match=r"0 is offloaded already \(offload was called on a "
                                         r"part of this model\)"):
        codegen.nn.offload(whole, device="cpu")
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="0.weight is on the meta device"):
        codegen.nn.offload(lazy, device="cpu")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_edge_shapes():
    """A Linear with no input features (its output is the bias) and inputs of one dim and
    of no rows."""
    ref = nn.Linear(0, 3)
    model = offloaded(ref)
    for shape in [(2, 0), (0,), (4, 1, 0)]:
        x = torch.zeros(shape)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    ref = nn.Linear(4, 3)
    model = offloaded(ref)
    for shape in [(4,), (0, 4), (2, 0, 4)]:
        x = torch.randn(shape)
        torch.testing.assert_close(model(x), ref(x))
