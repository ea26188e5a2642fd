"""Host-resident operands through the evaluator on a GPU. Marked `gpu`; run on
the H200 with `PYTHONPATH=. python3 -m pytest -m gpu -q tests/test_copy_gpu.py`."""

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples as ex

pytestmark = [pytest.mark.gpu, pytest.mark.build, pytest.mark.usefixtures("no_tf32")]
CUDA = "cuda"
MiB = 1 << 20



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


# ---------------------------------------------------------------------------- compiled op

_ops: dict = {}


def op_of(make, dtype=torch.float32, slices=8, **lower_args):
    """The compiled op of ``make(dtype, slices)`` (or ``make()``), built once per run."""
    key = (make.__name__, dtype, slices, tuple(sorted(lower_args.items())))
    if key not in _ops:
        fusion = make(dtype, slices) if make in (ex.stream_weights, ex.offload_activations) \
            else make()
        _ops[key] = cg.compile(fusion, **lower_args)
    return _ops[key]


@pytest.fixture(autouse=True)
def _cache(cache_dir):
    return cache_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("slices", [1, 3, 8])
def test_op_stream_weights_exact(slices, pinned, dtype):
    op = op_of(ex.stream_weights, dtype, slices)
    x = ints(64, 32, dtype=dtype, device=CUDA, lo=-2, hi=3)
    w = host(ints(32, 1000, dtype=dtype, lo=-2, hi=3), pinned)
    out = op(x, w)
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), x.cpu() @ w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("slices", [1, 3, 8])
def test_op_offload_activations_exact(slices, pinned, dtype):
    op = op_of(ex.offload_activations, dtype, slices)
    x = host(ints(1000, 32, dtype=dtype, lo=-2, hi=3), pinned)
    w = ints(32, 80, dtype=dtype, device=CUDA, lo=-2, hi=3)
    out = op(x, w)
    assert out.device.type == "cpu" and out.is_pinned()
    assert torch.equal(out, x @ w.cpu())  # no synchronize: complete on return


def test_op_bf16_random_close_to_torch():
    op = op_of(ex.stream_weights, torch.bfloat16, 8)
    x = torch.randn(300, 512, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(512, 1000, dtype=torch.bfloat16).pin_memory()
    ref = x.double() @ w.to(CUDA).double()
    out = op(x, w).double()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("layout", ["transposed", "column block", "padded transposed",
                                    "every other column", "expanded column"])
def test_op_host_weight_layouts(layout):
    """Column-major (a transposed nn.Linear weight) and row-padded host weights: slots
    take the host order, one 1-D or 2-D copy per slice, no .contiguous() needed. Layouts
    cuBLAS could not read in place (no stride 1: every other column, an expanded
    column) are copied too, a 2-D copy of one-element rows or a copy per column."""
    op = op_of(ex.stream_weights, torch.float32, 3)
    x = ints(20, 24, device=CUDA)
    if layout == "transposed":
        w = ints(50, 24).pin_memory().t()
    elif layout == "column block":
        w = ints(24, 80).pin_memory()[:, 7:57]
    elif layout == "padded transposed":
        w = ints(50, 30).pin_memory()[:, 3:27].t()
    elif layout == "every other column":
        w = ints(24, 100).pin_memory()[:, ::2]
    else:
        w = ints(24, 1).pin_memory().expand(24, 50)
    assert not w.is_contiguous()
    assert torch.equal(op(x, w).cpu(), x.cpu() @ w)


def test_op_batched_host_operand_and_output():
    from test_copy import batched_host_operand

    op = op_of(batched_host_operand)
    a = ints(7, 5, 6).pin_memory()
    w = ints(7, 6, 4, device=CUDA)
    out = op(a, w)
    assert out.device.type == "cpu" and torch.equal(out, a @ w.cpu())


def test_op_host_operand_its_copies_cannot_move_is_refused_by_name():
    """A 3-D host operand strided in all three dims, none dense across the next, would
    need a 2-D copy per row of each matrix: refused before anything is queued, naming
    the argument; the same values made contiguous run."""
    from test_copy import batched_host_operand

    op = op_of(batched_host_operand)
    a = ints(14, 10, 12).pin_memory()[::2, ::2, ::2]
    w = ints(7, 6, 4, device=CUDA)
    assert a.shape == (7, 5, 6) and a.stride() == (240, 24, 2)
    with pytest.raises(RuntimeError, match=r"argument T0 has sizes \[7, 5, 6\] and strides "
                                           r"\[240, 24, 2\].*Pass T0\.contiguous\(\)"):
        op(a, w)
    good = a.contiguous().pin_memory()
    assert torch.equal(op(good, w), good @ w.cpu())


def test_op_all_inputs_in_host_memory_run_on_the_current_gpu():
    from test_copy import host_reads_whole

    op = op_of(host_reads_whole)
    x, w = ints(5, 6).pin_memory(), ints(6, 7).pin_memory()
    out = op(x, w)
    assert out.device == torch.device(CUDA, torch.cuda.current_device())
    assert torch.equal(out.cpu(), x @ w)
    xt = ints(6, 5).pin_memory().t()  # read whole, column-major: copied in its order
    assert torch.equal(op(xt, w).cpu(), xt @ w)


def test_op_without_a_stream_loop():
    from test_copy import matmul_without_a_loop

    op = op_of(matmul_without_a_loop)
    x, w = ints(9, 4, device=CUDA), ints(4, 3).pin_memory()
    assert torch.equal(op(x, w).cpu(), x.cpu() @ w)


@pytest.mark.parametrize("m,k,n", [(0, 8, 13), (9, 0, 13), (9, 8, 0), (9, 8, 5)])
def test_op_empty_and_more_slices_than_columns(m, k, n):
    weights, offload = op_of(ex.stream_weights, torch.float32, 8), \
        op_of(ex.offload_activations, torch.float32, 8)
    x, w = ints(m, k, device=CUDA), ints(k, n).pin_memory()
    assert torch.equal(weights(x, w).cpu(), x.cpu() @ w)
    xh, wd = ints(m, k).pin_memory(), ints(k, n, device=CUDA)
    assert torch.equal(offload(xh, wd), xh @ wd.cpu())


def test_op_cuda_tensor_where_host_memory_was_declared():
    op = op_of(ex.stream_weights, torch.float32, 2)
    x, w = torch.zeros(4, 3, device=CUDA), torch.zeros(3, 5, device=CUDA)
    with pytest.raises(RuntimeError, match=r'stream_weights: argument T1 was declared '
                                           r'device="cpu" .* but is on cuda:0; pass a CPU '
                                           r"tensor \(T1.cpu\(\)"):
        op(x, w)
    with pytest.raises(RuntimeError, match="argument T0 must be a CUDA tensor, got a tensor "
                                           "on cpu"):
        op(x.cpu(), w.cpu())


def test_op_host_input_checks_dtype_and_size():
    op = op_of(ex.stream_weights, torch.float32, 2)
    x = torch.zeros(4, 3, device=CUDA)
    with pytest.raises(RuntimeError, match="argument T1 must be float32, got float64"):
        op(x, torch.zeros(3, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argument T1 axis 0 must have size k = 3, got 2"):
        op(x, torch.zeros(2, 5))


PAGEABLE_ONCE = """
import warnings, torch, codegen as cg
from codegen import examples as ex
a = cg.compile(ex.stream_weights(torch.float32, 2))
b = cg.compile(ex.offload_activations(torch.float32, 2))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x, w = torch.ones(4, 3, device="cuda"), torch.ones(3, 5)
    a(x, w.pin_memory())
    for _ in range(2):
        a(x, w)
        b(torch.ones(5, 4), torch.ones(4, 3, device="cuda"))
    torch.cuda.synchronize()
print("WARNINGS", [(c.category.__name__, str(c.message)) for c in caught])
"""


def test_pageable_input_warns_once_per_process(cache_dir):
    """Two programs, four calls with pageable inputs: one warning on stderr (TORCH_WARN
    through aoti_torch_warn; torch.ops calls print it, no Python warning); none for
    pinned inputs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "CODEGEN_CACHE_DIR": str(cache_dir)}
    run = subprocess.run([sys.executable, "-c", PAGEABLE_ONCE], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    text = run.stdout + run.stderr
    assert text.count("is in pageable host memory") == 1, text
    assert "stream_weights: argument T1 is in pageable host memory" in run.stderr, text
    assert "T1.pin_memory() to overlap them" in run.stderr, text


def test_op_stream_weights_never_holds_the_whole_weight():
    m, k, n, slices, pool = 256, 1024, 8192, 8, 4
    op = op_of(ex.stream_weights, torch.float32, slices, pool_size=pool)
    x = ints(m, k, device=CUDA, lo=-2, hi=3)
    w = ints(k, n, lo=-2, hi=3).pin_memory()  # 32 MiB
    extra, out = peak_extra_bytes_op(op, [x, w])
    slots = pool * k * (n // slices) * 4  # 16 MiB
    assert extra <= slots + out.numel() * 4 + MiB, f"{extra / MiB:.1f} MiB"
    assert torch.equal(out, x @ w.to(CUDA))


def test_op_offload_activations_holds_only_staging_slots():
    m, k, n, slices, pool = 8192, 1024, 1024, 8, 4
    op = op_of(ex.offload_activations, torch.float32, slices, pool_size=pool)
    x = ints(m, k, lo=-2, hi=3).pin_memory()  # 32 MiB in, 32 MiB out
    w = ints(k, n, device=CUDA, lo=-2, hi=3)
    extra, out = peak_extra_bytes_op(op, [x, w])
    slots = pool * (m // slices) * (k + n) * 4  # 32 MiB
    assert extra <= slots + MiB, f"{extra / MiB:.1f} MiB"
    assert torch.equal(out, (x.to(CUDA) @ w).cpu())


def peak_extra_bytes_op(op, inputs):
    op(*inputs)  # warm-up: streams, workspaces
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = op(*inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def test_op_host_output_is_complete_when_it_returns():
    m, k, n = 8192, 4096, 4096
    op = op_of(ex.offload_activations, torch.float32, 8)
    x = ints(m, k, lo=-2, hi=3).pin_memory()
    w = ints(k, n, device=CUDA, lo=-2, hi=3)
    ref = (x.to(CUDA) @ w).cpu()
    for _ in range(3):
        assert torch.equal(op(x, w), ref)  # no synchronize before reading


def test_pinned_input_dropped_right_after_the_call_is_not_reused_under_the_copies():
    """PyTorch's caching host allocator hands a freed pinned block out again at once
    (the op's raw copies record no event with it); the op keeps its pinned inputs until
    the caller's stream is past the call, so a new pinned tensor filled right away gets
    other memory and the copies still read the old weights."""
    m, k, n = 8192, 4096, 8192
    op = op_of(ex.stream_weights, torch.float32, 8)
    x = ints(m, k, device=CUDA, lo=-2, hi=3)
    w = ints(k, n, lo=-2, hi=3).pin_memory()
    ref = x @ w.to(CUDA)
    torch.cuda.synchronize()
    out = op(x, w)  # a GEMM of ~10 ms: later slices' copies are still queued
    address = w.data_ptr()
    del w
    reused = torch.empty(k, n, pin_memory=True)
    reused.fill_(1e6)
    assert reused.data_ptr() != address
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_profiler_shows_a_host_copy_under_a_gemm():
    from codegen.tools.timeline import measure_overlap, profile_gpu

    # bf16: 64 MiB of weights, each slice's copy ~0.2 ms (2-D, ~40 GB/s) and its GEMM
    # (2.2e11 flop) ~0.2-0.3 ms: copy ~ GEMM, so most of each copy can hide.
    m, k, n = 32768, 4096, 8192
    op = op_of(ex.stream_weights, torch.bfloat16, 8)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(k, n, dtype=torch.bfloat16).pin_memory()
    events = profile_gpu(lambda: op(x, w))
    copies = [e for e in events if e.kind == "HtoD"]
    gemms = [e for e in events if e.kind == "kernel"]
    assert len(copies) == 8 and len(gemms) >= 8, [(e.kind, e.name) for e in events]
    assert len({e.stream for e in copies}) == 4  # on the slices' worker streams
    assert {e.stream for e in copies} == {e.stream for e in gemms}
    # A copy overlaps a GEMM on another stream for at least half of the shorter of the two.
    overlapping = [(c, g) for c in copies for g in gemms if c.stream != g.stream
                   and min(c.end_us, g.end_us) - max(c.start_us, g.start_us)
                   > 0.5 * min(c.duration_us, g.duration_us)]
    assert overlapping, events
    o = measure_overlap(events)
    assert o.measured > 0.3, o


@pytest.mark.parametrize("slices,copy_stream", [(4, False), (8, True)])
def test_cuda_graph_capture_with_pinned_inputs(slices, copy_stream):
    """Also with a copy stream (8 slices: its slots are reused), which must be rejoined to
    the capturing stream like the workers."""
    op = op_of(ex.stream_weights, torch.float32, slices, copy_stream=copy_stream)
    x = ints(300, 64, device=CUDA)
    w = ints(64, 500).pin_memory()
    op(x, w)  # warm up: streams, workspaces, GEMM plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, w)
    for _ in range(3):
        x.copy_(ints(300, 64, device=CUDA))
        w.copy_(ints(64, 500))  # new data in the same pinned memory
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), x.cpu() @ w)


def test_cuda_graph_capture_refuses_pageable_inputs_and_host_outputs():
    import re

    weights = op_of(ex.stream_weights, torch.float32, 4)
    offload = op_of(ex.offload_activations, torch.float32, 4)
    x, w, w_pinned = ints(30, 64, device=CUDA), ints(64, 50), ints(64, 50).pin_memory()
    xh, wd = ints(30, 64).pin_memory(), ints(64, 50, device=CUDA)
    weights(x, w_pinned)
    offload(xh, wd)
    torch.cuda.synchronize()
    cases = [
        (lambda: weights(x, w), "argument T1 is in pageable host memory, which a CUDA graph "
                                "cannot copy from; pass T1.pin_memory()"),
        (lambda: offload(xh, wd), "a program with host outputs .* cannot be captured in a "
                                  "CUDA graph"),
    ]
    for call, match in cases:
        graph = torch.cuda.CUDAGraph()
        caught = ""
        with torch.cuda.graph(graph):
            try:  # the op refuses before it queues anything: the capture stays valid
                call()
            except RuntimeError as e:
                caught = str(e)
        assert re.search(match, caught), caught
        torch.cuda.synchronize()
    assert torch.equal(weights(x, w_pinned).cpu(), x.cpu() @ w_pinned)  # still usable


NVTX_RUN = """
import torch, codegen as cg
from codegen import examples as ex
op = cg.compile(ex.stream_weights(torch.float32, 4))
op(torch.ones(8, 3, device="cuda"), torch.ones(3, 20).pin_memory())
torch.cuda.synchronize()
"""


def test_nvtx_ranges_name_each_slice_for_a_profiler(tmp_path, cache_dir):
    """Run under an NVTX tool (the tests' injection library, attached as Nsight Systems
    attaches): each copy and GEMM of each slice is a range named for its host-IR line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_copy import nvtx_logger

    log = tmp_path / "nvtx.log"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "CODEGEN_CACHE_DIR": str(cache_dir),
           "NVTX_INJECTION64_PATH": str(nvtx_logger(tmp_path)), "CODEGEN_NVTX_LOG": str(log)}
    run = subprocess.run([sys.executable, "-c", NVTX_RUN], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = [s for s in log.read_text().splitlines() if "stream_weights" in s or s == "pop"]
    pushes = [s.removeprefix("push ") for s in lines if s.startswith("push stream_weights")]
    assert pushes == [f"stream_weights: i={i} {stmt}" for i in range(4) for stmt in
                      ("Copy(T1_i, out=T1_s)", "Matmul(T0, T1_s, out=T2_i)")], lines
    assert lines.count("pop") >= len(pushes)


# ---------------------------------------------------------------------------- copy stream
# copy_stream=True (hostir.queue_copies_in).


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("slices", [3, 8])
@pytest.mark.parametrize("make", [ex.stream_weights, ex.offload_activations])
def test_copy_stream_exact_op_and_evaluator(make, slices, pinned):
    op = op_of(make, torch.float32, slices, copy_stream=True)
    program = cg.lower(make(torch.float32, slices), copy_stream=True)
    if make is ex.stream_weights:
        x, w = ints(64, 32, device=CUDA), host(ints(32, 1000), pinned)
    else:
        x, w = host(ints(1000, 32), pinned), ints(32, 80, device=CUDA)
    expect = x.cpu() @ w.cpu()
    for _ in range(3):  # the slots are reused across slices and calls
        assert torch.equal(op(x, w).cpu(), expect)
        assert torch.equal(cg.evaluate(program, [x, w])[0].cpu(), expect)


def test_copy_stream_queues_every_copy_in_on_one_stream_under_the_gemms():
    from codegen.tools.timeline import profile_gpu

    op = op_of(ex.stream_weights, torch.bfloat16, 8, copy_stream=True)
    x = torch.randn(32768, 4096, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(4096, 8192, dtype=torch.bfloat16).pin_memory()
    op(x, w)
    events = profile_gpu(lambda: op(x, w))
    copies = sorted((e for e in events if e.kind == "HtoD"), key=lambda e: e.start_us)
    gemms = [e for e in events if e.kind == "kernel"]
    assert len(copies) == 8 and len(gemms) >= 8, [(e.kind, e.name) for e in events]
    (copier,) = {e.stream for e in copies}
    assert copier not in {e.stream for e in gemms} and len({e.stream for e in gemms}) == 4
    assert all(a.end_us <= b.start_us + 1 for a, b in zip(copies, copies[1:]))  # in order
    assert any(min(c.end_us, g.end_us) - max(c.start_us, g.start_us)
               > 0.5 * min(c.duration_us, g.duration_us) for c in copies for g in gemms)
