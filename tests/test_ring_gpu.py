"""The staging ring on the GPU: ring programs called back to back (the ring's bytes reused
across calls and programs, grown when a larger slice comes) against torch, its memory,
the refusal under graph capture, and the ops of an offloaded model."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples

pytestmark = [pytest.mark.gpu, pytest.mark.build]


def host_linear(dtype, slices, name, bias=False):
    return examples.offload_linear(dtype, slices, bias, name=name)


def test_calls_back_to_back_reuse_the_ring_exactly(cache_dir):
    """Twelve Linears of four widths (the ring grows twice), then the MLP, queued without a
    host wait between them: every result exact, though each call's copies run ahead of
    the caller's stream into bytes the call before has just finished reading."""
    torch.backends.cuda.matmul.allow_tf32 = False
    linear = cg.compile(host_linear(torch.float32, 4, "ring_gpu_linear"), staging="ring")
    biased = cg.compile(host_linear(torch.float32, 3, "ring_gpu_bias", bias=True),
                        staging="ring")
    mlp = cg.compile(examples.llama_mlp(torch.float32, 4, weights="cpu", name="ring_gpu_mlp"),
                     staging="ring")
    x = ints(64, 256, device="cuda")
    widths = [128, 512, 2048, 4096] * 3
    weights = [ints(n, 256).pin_memory() for n in widths]
    biases = [ints(n).pin_memory() for n in widths]
    outs = []
    for k, (w, b) in enumerate(zip(weights, biases)):
        outs.append(biased(x, w, b) if k % 3 == 2 else linear(x, w))
    wg, wu, wd = (ints(*s).pin_memory() for s in [(512, 256), (512, 256), (256, 512)])
    y = mlp(x, wg, wu, wd)
    torch.cuda.synchronize()
    for k, (out, w, b) in enumerate(zip(outs, weights, biases)):
        expect = F.linear(x, w.cuda(), b.cuda() if k % 3 == 2 else None)
        assert torch.equal(out, expect), k
    expect = F.linear(F.silu(F.linear(x, wg.cuda())) * F.linear(x, wu.cuda()), wd.cuda())
    # fp32 sums of products near 1e5: compare against the norm, not element by element
    assert ((y - expect).norm() / expect.norm()).item() < 1e-6


def test_the_gemms_wait_for_a_busy_caller_stream(cache_dir):
    """The ring stream is not ordered after the caller's stream, the GEMMs are: with the
    caller's stream held by a long kernel and then writing the op's input, a ring op reads
    the written input (as a slots op does)."""
    ring = cg.compile(host_linear(torch.float32, 4, "ring_gpu_busy"), staging="ring")
    slots = cg.compile(host_linear(torch.float32, 4, "ring_gpu_busy"))
    x = ints(32, 128, device="cuda")
    w = ints(1024, 128).pin_memory()
    for op in (ring, slots):
        y = torch.empty_like(x)
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy while the op queues
        y.copy_(x * 2)  # written on the caller's stream after the sleep
        out = op(y, w)
        torch.cuda.synchronize()
        assert torch.equal(out, F.linear(x * 2, w.cuda()))


def test_ring_memory_is_bounded_by_its_slots(cache_dir):
    """The ring holds pool_size + 1 slices of the largest weight seen: no more after many
    calls."""
    op = cg.compile(host_linear(torch.bfloat16, 8, "ring_gpu_memory"), staging="ring",
                    pool_size=4)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16384, 1024, dtype=torch.bfloat16).pin_memory()  # 4 MiB slices
    out_bytes = 16 * 16384 * 2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = [op(x, w) for _ in range(20)]
    torch.cuda.synchronize()
    slice_bytes = 16384 // 8 * 1024 * 2
    grown = torch.cuda.memory_allocated() - before - 20 * out_bytes
    assert 0 <= grown <= 5 * slice_bytes, grown / slice_bytes  # the ring, if it grew
    peak = torch.cuda.max_memory_allocated() - before - 20 * out_bytes
    assert peak <= 5 * slice_bytes + 2 * out_bytes, peak / slice_bytes  # nothing per call
    assert torch.allclose(outs[-1].float(), F.linear(x, w.cuda()).float(), rtol=2e-2, atol=1)


def test_a_ring_program_refuses_capture_with_a_clear_message(cache_dir):
    op = cg.compile(host_linear(torch.float32, 2, "ring_gpu_capture"), staging="ring")
    x, w = ints(8, 64, device="cuda"), ints(64, 64).pin_memory()
    op(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"staging ring .*eagerly only.*staging=\"slots\""):
        with torch.cuda.graph(graph):
            op(x, w)
    torch.cuda.synchronize()
    assert torch.equal(op(x, w), F.linear(x, w.cuda()))  # the ring still works after
