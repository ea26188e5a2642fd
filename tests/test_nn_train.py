"""Training an offloaded model: ``loss.backward()`` through codegen.nn.offload fills every
offloaded Linear's weight and bias gradient in host memory, equal to the gradients of the
same model left resident (exactly on integer-valued fp32 data, within rounding
otherwise), the resident parameters' gradients too; one SGD step updates the weights in
place in the arena, and the next forward reads the updated weights. On the CPU the
offloaded Linears run through the evaluator; on the GPU (``gpu`` tests) through the
compiled programs, against the GPU-resident model."""

import copy

import pytest
import torch
from conftest import ints
from helpers import tiny_llama
from torch import nn

import codegen.nn


def mlp(dtype=torch.float32, integers=False, seed=0):
    """Linear(bias) -> GELU -> Linear(bias); with ``integers``, integer-valued weights and
    ReLU instead of GELU, so every product and sum of a step is exact in fp32."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU() if integers else nn.GELU(),
                          nn.Linear(32, 8))
    if integers:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(ints(*p.shape, lo=-2, hi=3))
    return model.to(dtype)


def loss_of(model, x):
    out = model(x)
    return getattr(out, "logits", out).float().pow(2).mean()


def gradients(model, x):
    model.zero_grad(set_to_none=True)
    loss_of(model, x).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def offloaded_names(model):
    return {f"{n}.{k}" if n else k for n, m in model.named_modules()
            if isinstance(m, codegen.nn.OffloadedLinear)
            for k in ("weight", "bias") if getattr(m, k) is not None}


def in_arena(model, p):
    """``p``'s bytes as the arena holds them (read through the arena's storage), and
    their offset there."""
    storage = codegen.nn.arena(model).storage
    offset = p.data_ptr() - storage.data_ptr()
    nbytes = p.numel() * p.element_size()
    assert 0 <= offset and offset + nbytes <= storage.numel(), "not a view of the arena"
    return storage[offset:offset + nbytes].view(p.dtype).view(p.shape), offset


def rel_err(got, want):
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_gradients(model, ref, x, tol):
    """Backward of both; every parameter of ``model`` has a gradient, the offloaded ones
    in host memory, matching ``ref``'s (``tol``: None for exact, else a relative error
    of the whole tensor)."""
    got, want = gradients(model, x), gradients(ref, x)
    host = offloaded_names(model)
    assert host and got.keys() == want.keys()
    for name, g in got.items():
        assert g is not None, f"{name} has no gradient"
        p = model.get_parameter(name)
        assert g.shape == p.shape and g.dtype == p.dtype, name
        if name in host:
            assert g.device.type == "cpu", f"{name}'s gradient is on {g.device}"
            in_arena(model, p)
        else:
            assert g.device == x.device, f"{name}'s gradient is on {g.device}"
        if tol is None:
            torch.testing.assert_close(g.cpu(), want[name].cpu(), rtol=0, atol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
        else:
            err = rel_err(g, want[name])
            assert err < tol, (name, err)


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def check_sgd_step(model, ref, x, lr, forward_tol):
    """One SGD step over every parameter of ``model`` (after ``check_gradients``): each
    offloaded weight and bias is updated in place where it lies in the arena, by exactly
    ``-lr * grad``, and the next forward equals ``ref`` (the resident model) loaded with
    the updated values (within ``forward_tol``, a relative error)."""
    arena = codegen.nn.arena(model)
    before = arena.storage.clone()
    host = offloaded_names(model)
    params = dict(model.named_parameters())
    where = {n: in_arena(model, params[n])[1] for n in host}
    expect = {n: p.detach().clone().add_(p.grad, alpha=-lr) for n, p in params.items()}
    old_out = logits(model, x)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    assert not torch.equal(arena.storage, before), "the step left the arena unchanged"
    for n, p in params.items():
        assert model.get_parameter(n) is p, f"{n} was replaced"
        if n in host:
            view, offset = in_arena(model, p)
            assert offset == where[n], f"{n} moved in the arena"
            assert torch.equal(view, expect[n]), f"{n}: the arena does not hold the update"
        else:
            torch.testing.assert_close(p.detach(), expect[n])
    plain = copy.deepcopy(ref)
    plain.load_state_dict({n: p.detach() for n, p in params.items()}, strict=False)
    got, want = logits(model, x), logits(plain, x)
    assert rel_err(got, want) < forward_tol, rel_err(got, want)
    assert rel_err(old_out, want) > 10 * forward_tol, "the step changed nothing"


# ---------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_gradients_match_the_original(slices, dtype):
    ref = tiny_llama(dtype, max_positions=128)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=slices, device="cpu")
    assert len(offloaded_names(model)) == 2 * 7 + 1
    ids = torch.randint(0, 97, (2, 9))
    check_gradients(model, ref, ids, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("resident_second", [False, True], ids=["all", "first_only"])
def test_mlp_gradients_exact_on_integers(resident_second):
    """Integer-valued fp32 weights and inputs, ReLU, a mean over 256 outputs: every
    gradient is exact, so it must equal torch's bit for bit (both Linears offloaded, or
    the second left resident)."""
    ref = mlp(integers=True)
    keep = (lambda name, m: name == "0") if resident_second else None
    model = codegen.nn.offload(copy.deepcopy(ref), slices=3, device="cpu", filter=keep)
    assert offloaded_names(model) == ({"0.weight", "0.bias"} if resident_second else
                                      {"0.weight", "0.bias", "2.weight", "2.bias"})
    x = ints(2, 16, 16, lo=-2, hi=3)
    check_gradients(model, ref, x, None)


def test_mlp_gelu_gradients_match_the_original():
    ref = mlp()
    model = codegen.nn.offload(copy.deepcopy(ref), slices=4, device="cpu")
    x = torch.randn(3, 5, 16)
    check_gradients(model, ref, x, 1e-5)


def test_mlp_sgd_step_updates_the_arena_in_place():
    ref = mlp(integers=True)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=3, device="cpu")
    x = ints(2, 16, 16, lo=-2, hi=3)
    check_gradients(model, ref, x, None)
    check_sgd_step(model, ref, x, lr=2**-6, forward_tol=1e-5)
    torch.optim.SGD(ref.parameters(), lr=2**-6).step()  # the resident model's own step
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref.get_parameter(n).detach()), n


def test_llama_sgd_step_updates_the_arena_in_place():
    ref = tiny_llama(max_positions=128)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=3, device="cpu")
    ids = torch.randint(0, 97, (2, 9))
    check_gradients(model, ref, ids, 1e-5)
    check_sgd_step(model, ref, ids, lr=0.1, forward_tol=1e-5)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_llama_trains_like_the_gpu_model(dtype, cache_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(dtype, hidden=128, intermediate=352, vocab=101, max_positions=128)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=4)
    ref = ref.cuda()
    assert codegen.nn.arena(model).pinned
    ids = torch.randint(0, 101, (2, 11), device="cuda")
    bf16 = dtype == torch.bfloat16
    check_gradients(model, ref, ids, 5e-2 if bf16 else 1e-4)
    check_sgd_step(model, ref, ids, lr=0.1, forward_tol=2e-2 if bf16 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("resident_second", [False, True], ids=["all", "first_only"])
def test_mlp_trains_exactly_like_the_gpu_model(resident_second, cache_dir):
    """Integer-valued fp32: the GPU gradients and the step are exact (the next forward,
    on weights no longer integers, within rounding)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = mlp(integers=True)
    keep = (lambda name, m: name == "0") if resident_second else None
    model = codegen.nn.offload(copy.deepcopy(ref), slices=3, filter=keep)
    ref = ref.cuda()
    x = ints(2, 16, 16, lo=-2, hi=3, device="cuda")
    check_gradients(model, ref, x, None)
    check_sgd_step(model, ref, x, lr=2**-6, forward_tol=1e-5)


@pytest.mark.gpu
def test_mlp_gelu_bf16_gradients_match_the_gpu_model(cache_dir):
    ref = mlp(torch.bfloat16)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=4)
    ref = ref.cuda()
    x = torch.randn(4, 32, 16, dtype=torch.bfloat16, device="cuda")
    check_gradients(model, ref, x, 5e-2)


@pytest.mark.gpu
def test_fp32_master_weights_under_bf16_autocast_match_the_gpu_model(cache_dir):
    """fp32 weights in host memory under bf16 autocast: each Linear computes in bf16 (its
    weight copied to the GPU whole and cast there), and the gradients reach the fp32
    weights in host memory, equal to the GPU-resident model's within bf16 rounding."""
    ref = mlp()
    model = codegen.nn.offload(copy.deepcopy(ref), slices=4)
    ref = ref.cuda()
    x = torch.randn(4, 32, 16, device="cuda")
    outs = []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
        outs.append(out)
    assert rel_err(*outs) < 2e-2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and p.grad.device.type == "cpu", name
        in_arena(model, p)
        assert rel_err(p.grad, q.grad) < 2e-2, name
