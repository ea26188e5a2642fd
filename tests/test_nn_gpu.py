"""codegen.nn.offload on the GPU: a tiny transformers Llama against the GPU-resident model,
greedy generate, GPU and pinned memory, the report, graph capture (a forward without a
KV cache, and a decode step over a static KV cache)."""

import copy

import helpers
import pytest
import torch
from torch import nn

import codegen.nn

pytestmark = pytest.mark.gpu


def tiny_llama(dtype, seed=0):
    return helpers.tiny_llama(dtype, seed, hidden=128, intermediate=352, vocab=101,
                              max_positions=128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_and_generate_match_the_gpu_model(dtype, cache_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(dtype)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=4)
    ref = ref.cuda()
    ids = torch.randint(0, 101, (2, 11), device="cuda")
    with torch.no_grad():
        got, expect = model(ids).logits.float(), ref(ids).logits.float()
    err = ((got - expect).norm() / expect.norm()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err
    if dtype == torch.float32:
        mask = torch.ones_like(ids)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                          do_sample=False),
                           ref.generate(ids, attention_mask=mask, max_new_tokens=8,
                                        do_sample=False))


def test_memory_report_and_pinned_arena(cache_dir):
    model = tiny_llama(torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    offloaded_bytes = sum(m.weight.numel() * 2 for m in linears)
    kept = sum(p.numel() * 2 for p in model.parameters()) - offloaded_bytes
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    codegen.nn.offload(model, slices=4)
    on_gpu = torch.cuda.memory_allocated() - before
    assert on_gpu <= kept + 2**20, (on_gpu, kept)  # the measurement buffer is freed
    arena = codegen.nn.arena(model)
    assert arena.pinned and arena.storage.is_pinned()
    assert all(m.weight.is_pinned() for m in linears)  # each a storage of its own in it
    assert arena.nbytes <= 1.02 * offloaded_bytes + codegen.nn.ALIGN * len(linears)
    with torch.no_grad():
        model(torch.randint(0, 101, (1, 16), device="cuda"))
    r = codegen.nn.report(model)
    assert r.linears == len(linears) and r.bytes_moved == offloaded_bytes
    assert r.forward_ms > 0 and r.copy_gbps > 1 and 0 < r.floor_share
    assert "Linear calls moved" in r.line()


def test_a_one_token_forward_is_captured_and_replayed(cache_dir):
    from codegen.nn import capture_graph

    model = codegen.nn.offload(tiny_llama(torch.bfloat16), slices=2)
    ids = torch.randint(0, 101, (1, 1), device="cuda")
    with torch.no_grad():
        expect = model(ids, use_cache=False).logits.clone()
        graph, out = capture_graph(lambda: model(ids, use_cache=False).logits)
        out.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("staging", [None, "64KiB"])
def test_a_static_cache_decode_step_is_captured_and_replayed(staging, cache_dir):
    """One decode step captured, then replayed at successive positions (the static token
    and position rewritten in place between replays): each replay's logits are those of
    the eager step of the same model over a fresh cache, bit for bit (fp32 without TF32:
    the same GEMMs on the same values, whether the weights are staged per call, as in a
    graph, or in the staging ring, as eagerly), and close to the GPU-resident model's."""
    from codegen.nn import StaticDecodeStep, capture_graph

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(torch.float32)
    model = codegen.nn.offload(copy.deepcopy(ref), slices=2, staging=staging,
                               copy_size="16KiB" if staging else None)
    ref = ref.cuda()
    prompt = torch.randint(0, 101, (1, 9), device="cuda")
    tokens = torch.randint(0, 101, (1, 4), device="cuda")
    positions = torch.arange(9, 13, device="cuda")

    def eager(m):
        step = StaticDecodeStep(m, prompt, tokens[:, :1], max_len=16)
        logits = []
        for i in range(tokens.shape[1]):
            step.token.copy_(tokens[:, i:i + 1])
            step.position.copy_(positions[i:i + 1])
            logits.append(step().clone())
        return torch.cat(logits, dim=1)

    expect, resident = eager(model), eager(ref)
    # The warm-up calls before the capture write token 0 at position 9, as replay 0 does.
    step = StaticDecodeStep(model, prompt, tokens[:, :1], max_len=16)
    graph, out = capture_graph(step)
    replayed = []
    for i in range(tokens.shape[1]):
        step.token.copy_(tokens[:, i:i + 1])
        step.position.copy_(positions[i:i + 1])
        graph.replay()
        replayed.append(out.clone())
    torch.cuda.synchronize()
    got = torch.cat(replayed, dim=1)
    assert torch.equal(got, expect)
    err = ((got - resident).norm() / resident.norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("calls", ["runtime", "torch"])
def test_streamed_forwards_under_a_small_ring_match_the_gpu_model(calls, cache_dir):
    """Copies that wrap a small ring many times a forward, queued ahead of GEMM pieces,
    forwards back to back without a host synchronization: each forward's logits are the
    GPU-resident model's (fp32 without TF32), and the report counts the plan. The events,
    waits and copies made on the CUDA runtime directly, and through torch's wrappers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(torch.float32, seed=3)
    model = codegen.nn.offload(copy.deepcopy(ref), staging="96KiB", copy_size="16KiB")
    backend = model._codegen_offload.streamer.backend
    if calls == "torch":
        backend.runtime = None
    else:
        assert backend.runtime is not None  # torch's libcudart was found
    ref = ref.cuda()
    ids = [torch.randint(0, 101, (2, 17), device="cuda") for _ in range(6)]
    with torch.no_grad():
        got = [model(i, use_cache=False).logits for i in ids]
        expect = [ref(i, use_cache=False).logits for i in ids]
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert (backend.raw is not None) == (calls == "runtime")
    r = codegen.nn.report(model)
    assert r.unplanned_calls == 0 and r.copies == len(r.plan.spans) > 15
    assert r.staging_bytes == 96 * 1024 and 0 <= r.exposed_copy_ms <= r.forward_ms


def test_the_staging_bounds_what_offloaded_weights_take_on_the_gpu(cache_dir):
    """GPU memory: the staging ring (and the bias block) beyond the resident part of the
    model, and a forward's peak above it no more than the GPU-resident model's forward's
    peak above its weights."""
    ref = tiny_llama(torch.bfloat16, seed=4)
    offloaded_bytes = sum(m.weight.numel() * 2 for m in ref.modules() if isinstance(m, nn.Linear))
    kept = sum(p.numel() * 2 for p in ref.parameters()) - offloaded_bytes
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = codegen.nn.offload(copy.deepcopy(ref), staging="48KiB", copy_size="8KiB")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= kept + 48 * 1024 + 2 * 4096
    ids = torch.randint(0, 101, (1, 33), device="cuda")

    def peak(m):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            m(ids, use_cache=False)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak(model)
    ref = ref.cuda()
    assert peak(model) <= peak(ref) + 64 * 1024


def test_a_weight_written_on_the_gpu_between_forwards_is_read_new(cache_dir):
    """The next forward's first spans are copied when a forward ends; a weight written
    since by a non-blocking copy from the GPU (queued on the caller's stream) is copied
    again after that write."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = tiny_llama(torch.float32, seed=5)
    model = codegen.nn.offload(copy.deepcopy(ref), staging="64KiB", copy_size="16KiB")
    ref = ref.cuda()
    ids = torch.randint(0, 101, (1, 9), device="cuda")
    with torch.no_grad():
        model(ids, use_cache=False)
        new = torch.randn_like(ref.model.layers[0].self_attn.q_proj.weight)
        torch.cuda._sleep(50_000_000)  # the copy below lands well after the host moves on
        model.model.layers[0].self_attn.q_proj.weight.copy_(new, non_blocking=True)
        ref.model.layers[0].self_attn.q_proj.weight.copy_(new)
        got = model(ids, use_cache=False).logits
        torch.testing.assert_close(got, ref(ids, use_cache=False).logits, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("share,optimize_for", [(0.4, "decode"), (0.6, "decode"),
                                                (0.6, "prefill"), (0.75, "prefill")])
def test_a_gpu_budget_bounds_the_offloaded_weights_on_the_gpu(share, optimize_for):
    """A budget that holds the default staging (half a decoder layer: a quarter of this
    model's Linear bytes; planned for prefill, a whole layer) and some weights besides:
    both resident and streamed weights, and the GPU memory offload() takes beyond the rest
    of the model, held and at its peak, within the budget."""
    torch.manual_seed(0)
    ref = tiny_llama(torch.bfloat16)
    linears = [(n, m) for n, m in ref.named_modules() if isinstance(m, nn.Linear)]
    weights = {id(m.weight) for _, m in linears}
    total = sum(m.weight.numel() * 2 for _, m in linears)
    # The rest of the model moves to the GPU too, each tensor as the allocator rounds it.
    rest = sum(helpers.allocated(t.nbytes) for t in (*ref.parameters(), *ref.buffers())
               if id(t) not in weights)
    budget = int(share * total)
    model = copy.deepcopy(ref)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    codegen.nn.offload(model, gpu_budget=budget, optimize_for=optimize_for)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - rest
    peak = torch.cuda.max_memory_allocated() - before - rest
    plan = codegen.nn.offload_plan(model)
    assert plan.resident and plan.streamed and plan.optimize_for == optimize_for
    assert held <= budget and peak <= budget, (held, peak, budget)
    ids = torch.randint(0, 101, (2, 11), device="cuda")
    ref = ref.cuda()
    with torch.no_grad():
        for _ in range(2):
            got, expect = model(ids).logits.float(), ref(ids).logits.float()
            assert ((got - expect).norm() / expect.norm()).item() < 2e-2
    assert codegen.nn.report(model).unplanned_calls == 0
    assert codegen.nn.arena(model).nbytes <= 1.02 * plan.streamed_bytes + 256 * len(linears)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_linears_match_the_dequantized_reference_on_the_gpu(kind):
    from codegen.nn.quantize import dequantize_reference

    # Every Linear's in_features a multiple of int4's group of 128 input features.
    ref = helpers.tiny_llama(torch.bfloat16, hidden=128, intermediate=256, vocab=101)
    want = copy.deepcopy(ref)
    for m in want.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = dequantize_reference(
                *codegen.nn.quantize_weight(m.weight.data.cuda(), kind)).cpu()
    model = codegen.nn.offload(copy.deepcopy(ref), quantize=kind)
    want = want.cuda()
    ids = torch.randint(0, 101, (2, 11), device="cuda")
    with torch.no_grad():
        for _ in range(2):
            got, expect = model(ids).logits.float(), want(ids).logits.float()
            assert ((got - expect).norm() / expect.norm()).item() < 2e-2
    r = codegen.nn.report(model, reference=ref.cuda(), inputs=ids)
    assert r.quantize == kind and r.unplanned_calls == 0 and 0 < r.logits_error < 0.5


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("runs", [True, False])
def test_long_and_short_quantized_calls_match_the_dequantized_reference_on_the_gpu(kind,
                                                                                   runs):
    """Calls of more than MERGED_ROWS rows (each run of pieces back to back in the ring,
    or with ``dequant_runs`` off each piece, dequantized into a scratch weight, one GEMM
    per scratch; at 90 rows several, as the activations bound the scratch) and
    of one row (per merged run) under a ring that wraps, forwards back to back with no
    host synchronization between them: each forward's logits are the dequantized
    reference's (fp32 without TF32: exact arithmetic up to summation order)."""
    from codegen.nn.quantize import dequantize_reference

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = helpers.tiny_llama(torch.float32, seed=4, hidden=128, intermediate=256,
                             vocab=101, max_positions=256)
    want = copy.deepcopy(ref)
    for n, m in want.named_modules():
        if isinstance(m, nn.Linear) and n != "lm_head":
            m.weight.data = dequantize_reference(
                *codegen.nn.quantize_weight(m.weight.data.cuda(), kind), torch.float32).cpu()
    model = codegen.nn.offload(copy.deepcopy(ref), quantize=kind, staging="48KiB",
                               copy_size="8KiB", filter=lambda n, m: n != "lm_head")
    model._codegen_offload.streamer.dequant_runs = runs
    want = want.cuda()
    ids = [torch.randint(0, 101, (1, rows), device="cuda") for rows in (150, 1, 200, 200, 1, 90)]
    with torch.no_grad():
        got = [model(i, use_cache=False).logits for i in ids]
        expect = [want(i, use_cache=False).logits for i in ids]
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    r = codegen.nn.report(model)
    assert r.unplanned_calls == 0 and len(r.plan.spans) > 15


def test_a_failed_runtime_call_leaves_no_error_for_torchs_next_launch():
    """A raw CUDA call that fails raises with CUDA's message and clears the runtime's
    last error, which torch checks after its own kernel launches."""
    from codegen.nn import cudart

    rt = cudart.runtime()
    assert rt is not None
    with pytest.raises(RuntimeError, match="cudaEventRecord failed"):
        rt.record(0, 0)  # no such event
    assert rt.lib.cudaGetLastError() == 0
    x = torch.arange(4.0, device="cuda")
    assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_dequantization_given_a_stream_runs_on_it(kind):
    """A dequantizer called with a stream's raw handle (as the streamer calls it) launches
    its kernel there, not on the current stream: behind a sleep queued on that stream its
    rows are not written yet, and then they are torch's elementwise dequantization's, bit
    for bit."""
    from codegen.nn.quantize import dequantizer, pack_rows, quantize_weight, unpack_rows_eager

    torch.manual_seed(0)
    w = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    raw = pack_rows(*quantize_weight(w, kind), kind)
    rows = dequantizer(raw, kind, 512, torch.bfloat16)
    rows()  # the first launch compiles the kernel
    want = unpack_rows_eager(raw, kind, 512, torch.bfloat16)
    side = torch.cuda.Stream()
    into = torch.zeros_like(w)
    # The read below, once first: its kernels loaded (CUDA loads a kernel lazily at its
    # first launch, which waits for the device to be idle, the sleep included).
    assert into.abs().max().item() == 0
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s at 2 GHz
    rows(into, side.cuda_stream)  # the current stream is the default one
    assert into.abs().max().item() == 0  # read on the default stream: not written yet
    side.synchronize()
    assert torch.equal(into, want)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("features", [512, 4480])
def test_the_dequantization_kernel_equals_torchs_ops_bit_for_bit(kind, dtype, features):
    """The GPU's one-kernel (Triton) dequantization of arena rows (a piece at an offset in a
    ring, as the streamer reads them; rows of one block and of several with a partial
    last) equals the eager torch ops and the reference exactly: every byte pattern of the
    values (fp8's NaNs and subnormals, every nibble), scales from quantize_weight."""
    from codegen.nn.quantize import (
        _kernel,
        dequantize_reference,
        dequantizer,
        pack_rows,
        row_bytes,
        unpack_rows,
        unpack_rows_eager,
    )

    assert _kernel(kind, dtype, torch.device("cuda")) is not None  # Triton built it
    torch.manual_seed(3)
    rows = 96
    w = torch.randn(rows, features, dtype=dtype, device="cuda")
    q, scale = codegen.nn.quantize_weight(w, kind)
    packed = pack_rows(q, scale, kind)
    values = features if kind == "fp8" else features // 2
    packed[:, :values] = torch.arange(rows * values, device="cuda").view(rows, values) % 256
    ring = torch.zeros(512 + packed.numel(), dtype=torch.uint8, device="cuda")
    ring[512:] = packed.flatten()
    raw = ring[512:].view(rows, row_bytes(kind, features, dtype))
    run = dequantizer(raw, kind, features, dtype)
    got, eager = run(), unpack_rows_eager(raw, kind, features, dtype)
    assert got.dtype == dtype and got.shape == (rows, features) and got.is_contiguous()
    torch.testing.assert_close(got, eager, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(unpack_rows(raw[10:50], kind, features, dtype), eager[10:50],
                               rtol=0, atol=0, equal_nan=True)
    # And against the definition, for quantize_weight's own values.
    raw = pack_rows(q, scale, kind)
    assert torch.equal(unpack_rows(raw, kind, features, dtype),
                       dequantize_reference(q, scale, dtype))
    # A dequantizer reads its rows as they are when it is called (the ring's next lap),
    # from its second launch on through the kernel Triton compiled at its first, into new
    # rows each call.
    assert run.compiled is not None
    ring[512:] = torch.flip(ring[512:], (0,))
    want = unpack_rows_eager(ring[512:].view(raw.shape), kind, features, dtype)
    first = run()
    torch.testing.assert_close(first, want, rtol=0, atol=0, equal_nan=True)
    second = run()
    assert second.data_ptr() != first.data_ptr()
    torch.testing.assert_close(second, want, rtol=0, atol=0, equal_nan=True)
    # Into given rows (a scratch weight's, at an offset), the rows around them untouched.
    scratch = torch.full((rows + 3, features), 7, dtype=dtype, device="cuda")
    into = scratch[2:2 + rows]
    assert run(into).data_ptr() == into.data_ptr()
    torch.testing.assert_close(into, want, rtol=0, atol=0, equal_nan=True)
    assert (scratch[:2] == 7).all() and (scratch[2 + rows:] == 7).all()
    with pytest.raises(codegen.InternalError, match="dequantizing into"):
        run(scratch[1:1 + rows].t().contiguous().t())
