"""codegen.nn.offload on the CPU: a tiny transformers Llama built from a config (random
weights), its Linears offloaded and run through the evaluator, against the original; and
one ``gpu`` test of what only a GPU shows (the ring's copies against a write queued on the
caller's stream)."""

import copy
import pickle
import sys
import threading
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
                                "copy_gbps", "floor_share", "beyond_floor_ms", "copies",
                                "mean_copy_bytes", "exposed_copy_ms", "staging_bytes",
                                "unplanned_calls", "restart", "quantize", "logits_error"}
    assert r.copies == len(r.plan.spans) and r.unplanned_calls == 0
    assert (f"2 Linear calls read 81.920 KB of host weights in {r.copies} copies"  # 2*64*160*4
            in r.line())


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (512, "512 B"), (2048, "2.048 KB"),
                                          (3_500_000, "3.500 MB"), (1_620_000_000, "1.620 GB")])
def test_the_report_line_gives_bytes_in_a_unit_that_fits(nbytes, text):
    """A tiny model's report reads in bytes or KB, not "0.000 GB"; decimal units, as the
    line's GB/s are."""
    cpu = codegen.nn.Report(linears=3, bytes_moved=nbytes, forward_ms=1.5, gbps=float("nan"),
                            copy_floor_ms=float("nan"), copy_gbps=0.0,
                            floor_share=float("nan"), beyond_floor_ms=float("nan"))
    assert f"3 Linear calls read {text} of host weights in 1.50 ms" in cpu.line()
    gpu = codegen.nn.Report(linears=3, bytes_moved=nbytes, forward_ms=2.0, gbps=1.0,
                            copy_floor_ms=1.0, copy_gbps=50.0, floor_share=0.5,
                            beyond_floor_ms=1.0)
    assert f"3 Linear calls moved {text} in 2.00 ms" in gpu.line()


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


def test_a_bias_in_another_dtype_than_its_weight_is_refused_by_name():
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    model[2].bias.data = model[2].bias.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"codegen.nn.offload: 2.bias is torch.bfloat16, and an "
                                         r"offloaded Linear needs it in its weight's dtype "
                                         r"\(torch.float32\); convert it before offloading"):
        codegen.nn.offload(model, device="cpu")
    assert not any(isinstance(m, codegen.nn.OffloadedLinear) for m in model.modules())


def test_slices_and_pool_size_take_any_integer_type():
    """A numpy integer (a size computed with numpy) is an integer like an int; a bool is
    not."""
    np = pytest.importorskip("numpy")
    ref = _mlp()
    model = offloaded(ref, slices=np.int64(2), pool_size=np.int32(3))
    state = model._codegen_offload
    assert (state.slices, state.pool_size) == (2, 3)
    assert type(state.slices) is int and type(state.pool_size) is int
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x))
    for bad in (True, np.bool_(True), 2.0):
        with pytest.raises(codegen.ScheduleError, match="slices must be an int >= 1"):
            offloaded(_mlp(), slices=bad)
        with pytest.raises(codegen.ScheduleError, match="pool_size must be an int >= 1"):
            offloaded(_mlp(), pool_size=bad)


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


def test_weights_tied_by_their_memory_stay_tied():
    """Two Parameters over one storage (``nn.Parameter(a.weight.data)``) or overlapping
    bytes of it are shared, as one Parameter held twice is: left resident, still sharing
    their memory, and refused by name where a filter picks one. Disjoint views of one
    storage share nothing, and are offloaded."""
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = nn.Parameter(a.weight.data)
    flat = torch.randn(20, 8)
    c, d = nn.Linear(8, 8), nn.Linear(8, 8)
    c.weight, d.weight = nn.Parameter(flat[:8]), nn.Parameter(flat[4:12])  # rows 4-7 both
    e, f = nn.Linear(8, 4), nn.Linear(8, 4)
    e.weight, f.weight = nn.Parameter(flat[12:16]), nn.Parameter(flat[16:20])  # disjoint
    g, h = nn.Linear(8, 8), nn.Linear(8, 8)
    h.bias = g.bias  # a shared bias alone keeps both resident too
    model = nn.ModuleDict({"a": a, "b": b, "c": c, "d": d, "e": e, "f": f, "g": g, "h": h})
    codegen.nn.offload(model, device="cpu")
    kept = [n for n, m in model.named_modules() if isinstance(m, codegen.nn.OffloadedLinear)]
    assert kept == ["e", "f"]
    assert a.weight.data_ptr() == b.weight.data_ptr()
    assert d.weight.data_ptr() == c.weight.data_ptr() + 4 * 8 * 4
    with torch.no_grad():
        a.weight[0, 0] = 7.0
    assert b.weight[0, 0] == 7.0
    for name, other in (("a", "b"), ("b", "a"), ("c", "d"), ("d", "c")):
        linears = {"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "c": nn.Linear(8, 8),
                   "d": nn.Linear(8, 8)}
        linears["b"].weight = nn.Parameter(linears["a"].weight.data)
        linears["d"].weight = nn.Parameter(linears["c"].weight.data[2:])
        with pytest.raises(ValueError, match=rf"{name}.weight is shared with another module "
                                             rf"\({other}.weight: .*leave {name} out with"):
            codegen.nn.offload(nn.ModuleDict(linears), device="cpu",
                               filter=lambda n, m, name=name: n == name)


def _as_it_is(model):
    """Everything of ``model`` that offload changes: classes, attributes, tensors (the
    objects, where their data lies, their values) and hooks."""
    def values(t):
        return t.detach().clone() if not t.is_meta else None

    return ({n: (type(m), sorted(m.__dict__)) for n, m in model.named_modules()},
            {n: (id(p), p.data_ptr(), p.device, values(p)) for n, p in model.named_parameters()},
            {n: (id(b), b.data_ptr(), b.device, values(b)) for n, b in model.named_buffers()},
            (dict(model._forward_pre_hooks), dict(model._forward_hooks)))


def _assert_unchanged(model, before):
    after = _as_it_is(model)
    assert after[0] == before[0] and after[3] == before[3]
    for got, want in zip(after[1:3], before[1:3]):
        assert got.keys() == want.keys()
        for name in got:
            assert got[name][:3] == want[name][:3], name
            assert want[name][3] is None or torch.equal(got[name][3], want[name][3]), name
    assert not any(isinstance(m, codegen.nn.OffloadedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="was not offloaded"):
        codegen.nn.report(model)


def test_offload_checks_every_tensor_before_it_changes_the_model():
    """A tensor that cannot move (on the meta device) anywhere in the model is refused by
    name before any Linear is converted; once it has values, offload succeeds."""
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6, device="meta"))
    before = _as_it_is(model)
    with pytest.raises(ValueError, match=r"codegen.nn.offload: 1.weight is on the meta device "
                                         r"\(no values yet\), and would move to cpu with the "
                                         r"rest of the model; load or initialize"):
        codegen.nn.offload(model, device="cpu")
    _assert_unchanged(model, before)
    model[1] = nn.LayerNorm(6)
    ref = copy.deepcopy(model)
    codegen.nn.offload(model, device="cpu")
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), ref(x))


class _Unmovable(torch.Tensor):
    """A buffer whose move fails as a move onto a full GPU does."""

    def to(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where", ["measuring", "copying", "moving"])
def test_a_failed_offload_leaves_the_model_as_it_was(where, monkeypatch):
    """A step that fails part-way (the copy bandwidth's measurement, a copy into the
    arena, a move of the rest of the model) is undone: the Linears stay nn.Linear with
    their original tensors, every other tensor is where it was, no attribute or hook is
    left, and the error names the step and what happened; offloading again then works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 4), nn.Identity())
    model[3].register_buffer("stuck", torch.zeros(3).as_subclass(_Unmovable))
    module = sys.modules["codegen.nn.offload"]
    if where == "measuring":
        def fail(arena, device, limit=None):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 256 MiB")

        monkeypatch.setattr(module, "_measure_copy_gbps", fail)
        match = r"measuring the copy bandwidth to cpu failed \(OutOfMemoryError: CUDA out"
    elif where == "copying":
        real, calls = codegen.nn.Arena.tensor, []

        def tensor(self, offset, dtype, shape):
            calls.append(offset)
            if len(calls) == 3:  # the biases come first in the arena: 0.weight
                raise RuntimeError("the copy failed")
            return real(self, offset, dtype, shape)

        monkeypatch.setattr(codegen.nn.Arena, "tensor", tensor)
        match = r"copying 0.weight into the host arena failed \(RuntimeError: the copy failed\)"
    else:
        match = r"moving 3.stuck to cpu failed \(OutOfMemoryError: CUDA out of memory"
    before = _as_it_is(model)
    error = torch.cuda.OutOfMemoryError if where != "copying" else RuntimeError
    with pytest.raises(error, match=match + r".*the model is as it was before the call "
                                            r"\(nothing offloaded, every tensor where it was\)"):
        codegen.nn.offload(model, device="cpu")
    _assert_unchanged(model, before)
    monkeypatch.undo()
    del model[3].stuck
    ref = copy.deepcopy(model).eval()
    codegen.nn.offload(model.eval(), device="cpu")
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), ref(x))
    assert codegen.nn.report(model).linears == 2


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


def test_autocast_trains_fp32_master_weights_in_its_dtype():
    """fp32 weights under bf16 autocast (mixed-precision training): each Linear computes in
    bf16, as the resident model does, and the gradients reach the fp32 weights in host
    memory, equal to the resident model's within bf16 rounding; the report counts the fp32
    bytes each call copies."""
    ref = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16),
                        nn.Linear(16, 4, bias=False))
    model = copy.deepcopy(ref)
    codegen.nn.offload(model, device="cpu")
    x, target = torch.randn(5, 6), torch.randn(5, 4)
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16  # the last Linear's, in autocast's dtype
        ((out.float() - target) ** 2).mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(x), ref(x), rtol=1.6e-2, atol=1e-2)
    for (name, want), got in zip(ref.named_parameters(), model.parameters()):
        assert got.grad.dtype == torch.float32 and got.grad.device.type == "cpu", name
        torch.testing.assert_close(got.grad, want.grad, rtol=1.6e-2, atol=1e-3, msg=name)
    r = codegen.nn.report(model)
    assert r.linears == 3
    assert r.bytes_moved == 4 * (6 * 32 + 32 + 32 * 16 + 16 + 16 * 4)


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


def test_threads_running_forwards_of_one_model_each_count_their_own():
    """Forwards of one offloaded model in several threads at once: each counts the Linear
    calls of its own thread, so every report is one whole forward's (15 Linears: 7 per
    layer and lm_head), whichever thread's ended last."""
    ref = tiny_llama()
    model = offloaded(ref)
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        want = ref(ids).logits
    weights = sum(p.numel() * p.element_size() for m in model.modules()
                  if isinstance(m, codegen.nn.OffloadedLinear) for p in m.parameters())
    start = threading.Barrier(2)
    reports, errors = [], []

    def forwards():
        try:
            start.wait()
            for _ in range(3):
                with torch.no_grad():
                    got = model(ids).logits
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                reports.append(codegen.nn.report(model))
        except Exception as error:  # raised in a thread, it would not fail the test
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-3)  # threads switch often: their forwards interleave
    try:
        threads = [threading.Thread(target=forwards) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(reports) == 6
    assert {(r.linears, r.bytes_moved) for r in reports} == {(15, weights)}


def test_a_forward_after_an_in_place_write_waits_for_the_callers_stream(monkeypatch):
    """With prefetch, a forward whose offloaded weights were written in place since the last
    one (their version counters moved) first waits for the caller's stream, once per
    change; a write through ``.data`` has a counter of its own and is not seen; with
    prefetch=False the copies are ordered after the caller's stream, and nothing waits."""
    model = offloaded(_mlp())
    waits = []
    monkeypatch.setattr(model._codegen_offload, "_synchronize", lambda: waits.append(1))
    x = torch.randn(3, 6)
    model(x)
    model(x)
    assert waits == []
    with torch.no_grad():
        model[2].weight.copy_(torch.randn(4, 5), non_blocking=True)
    model(x)
    assert waits == [1]
    model(x)
    assert waits == [1]  # unchanged since
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    opt.step()
    want = _mlp()
    want.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), want(x))  # reads the stepped weights
    assert len(waits) == 2
    model.load_state_dict(_mlp(seed=1).state_dict())
    model(x)
    assert len(waits) == 3
    model[0].weight.data.add_(1.0)
    model(x)
    assert len(waits) == 3
    unordered = offloaded(_mlp(), prefetch=False)
    monkeypatch.setattr(unordered._codegen_offload, "_synchronize", lambda: waits.append(1))
    with torch.no_grad():
        unordered[0].weight.add_(1.0)
    unordered(x)
    assert len(waits) == 3


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


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_a_weight_filled_by_a_non_blocking_copy_is_read_once_it_has_landed(cache_dir):
    """A weight written by a non-blocking copy from the GPU, queued on the caller's stream
    behind 0.1 s of other work: the ring's copies (not ordered after that stream) must not
    read it before it has landed; the forward waits for the stream, as the weight's
    version counter moved."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = codegen.nn.offload(nn.Sequential(nn.Linear(2048, 2048, bias=False)), slices=4)
    x = torch.randn(8, 2048, device="cuda")
    model(x)  # builds the program
    for _ in range(3):
        new = torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the copy below lands about 0.1 s from now
        with torch.no_grad():
            model[0].weight.copy_(new, non_blocking=True)
        got = model(x)
        torch.testing.assert_close(got, x @ new.T, rtol=1e-4, atol=1e-3)


def test_a_weight_or_bias_of_the_wrong_shape_is_refused_by_name():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    model[1].bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"1.bias has shape \(3,\); the Linear's out_features "
                                         r"say \(2,\)"):
        codegen.nn.offload(model, device="cpu")
    model[1].bias = nn.Parameter(torch.zeros(2))
    model[0].weight = nn.Parameter(torch.zeros(4, 9))
    with pytest.raises(ValueError, match=r"0.weight has shape \(4, 9\); the Linear's "
                                         r"out_features and in_features say \(4, 8\)"):
        codegen.nn.offload(model, device="cpu")
