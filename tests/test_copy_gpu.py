"""Host-resident operands through the evaluator on a GPU (issue 10). Marked `gpu`; run on
the H200 with `PYTHONPATH=. python3 -m pytest -m gpu -q tests/test_copy_gpu.py`."""

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples as ex

pytestmark = pytest.mark.gpu
CUDA = "cuda"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def host(t, pinned):
    return t.pin_memory() if pinned else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("slices", [1, 3, 8])
def test_stream_weights_exact(slices, pinned, dtype):
    program = cg.lower(ex.stream_weights(dtype, slices))
    x = ints(64, 32, dtype=dtype, device=CUDA, lo=-2, hi=3)
    w = host(ints(32, 1000, dtype=dtype, lo=-2, hi=3), pinned)
    (out,) = cg.evaluate(program, [x, w])
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), x.cpu() @ w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("slices", [1, 3, 8])
def test_offload_activations_exact(slices, pinned, dtype):
    program = cg.lower(ex.offload_activations(dtype, slices))
    x = host(ints(1000, 32, dtype=dtype, lo=-2, hi=3), pinned)
    w = ints(32, 80, dtype=dtype, device=CUDA, lo=-2, hi=3)
    (out,) = cg.evaluate(program, [x, w])
    assert out.device.type == "cpu" and out.is_pinned()
    assert torch.equal(out, x @ w.cpu())


def peak_extra_bytes(program, inputs):
    """Peak device memory of one evaluate beyond what was allocated before it, after a
    warm-up call (which creates the pool's streams and their cuBLAS workspaces)."""
    cg.evaluate(program, inputs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = cg.evaluate(program, inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, outs


def test_stream_weights_never_holds_the_whole_weight():
    m, k, n, slices, pool = 256, 1024, 8192, 8, 4
    program = cg.lower(ex.stream_weights(torch.float32, slices), pool_size=pool)
    x = ints(m, k, device=CUDA, lo=-2, hi=3)
    w = ints(k, n, lo=-2, hi=3).pin_memory()  # 32 MiB
    extra, (out,) = peak_extra_bytes(program, [x, w])
    slots = pool * k * (n // slices) * 4  # 16 MiB
    assert extra <= slots + out.numel() * 4 + MiB, f"{extra / MiB:.1f} MiB"
    assert torch.equal(out, x @ w.to(CUDA))


def test_offload_activations_holds_only_staging_slots():
    m, k, n, slices, pool = 8192, 1024, 1024, 8, 4
    program = cg.lower(ex.offload_activations(torch.float32, slices), pool_size=pool)
    x = ints(m, k, lo=-2, hi=3).pin_memory()  # 32 MiB in, 32 MiB out
    w = ints(k, n, device=CUDA, lo=-2, hi=3)
    extra, (out,) = peak_extra_bytes(program, [x, w])
    slots = pool * (m // slices) * (k + n) * 4  # 32 MiB
    assert extra <= slots + MiB, f"{extra / MiB:.1f} MiB"
    assert torch.equal(out, (x.to(CUDA) @ w).cpu())


def test_host_output_is_complete_when_evaluate_returns():
    """A GEMM of several ms per call: the copies of the last slices would still be in
    flight if evaluate returned without waiting."""
    m, k, n = 8192, 4096, 4096
    program = cg.lower(ex.offload_activations(torch.float32, 8))
    x = ints(m, k, lo=-2, hi=3).pin_memory()
    w = ints(k, n, device=CUDA, lo=-2, hi=3)
    ref = (x.to(CUDA) @ w).cpu()
    for _ in range(3):
        (out,) = cg.evaluate(program, [x, w])
        assert torch.equal(out, ref)  # no synchronize before reading


def test_cuda_tensor_where_host_memory_was_declared():
    program = cg.lower(ex.stream_weights(torch.float32, 2))
    x, w = torch.zeros(4, 3, device=CUDA), torch.zeros(3, 5, device=CUDA)
    with pytest.raises(ValueError, match=r'argument T1 was declared device="cpu" .* but is '
                                         r"on cuda:0; pass a CPU tensor \(T1.cpu\(\)"):
        cg.evaluate(program, [x, w])


def test_all_host_inputs_run_on_the_current_gpu():
    with cg.Fusion("all_host") as fusion:
        out = cg.matmul(cg.input(["m", "k"], device="cpu"), cg.input(["k", "n"], device="cpu"))
        cg.output(out)
    out.outer_split(1, 3)
    out.axis(1).parallelize(cg.ParallelType.Stream)
    x, w = ints(5, 6), ints(6, 7)
    (y,) = cg.evaluate(cg.lower(fusion), [x, w])
    assert y.device == torch.device(CUDA, torch.cuda.current_device())
    assert torch.equal(y.cpu(), x @ w)
