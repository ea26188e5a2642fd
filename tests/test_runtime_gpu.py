"""The C++ runtime's promises on the GPU: a throw mid-loop still joins the
workers into the caller's stream; threads never share worker streams (graph capture in
one thread, eager calls in another); thousands of short-lived threads grow nothing; the
precision flags reach cuBLAS. Marked `gpu`."""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples as ex

pytestmark = [pytest.mark.gpu, pytest.mark.build]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows_op(cache_dir):
    return cg.compile(ex.matmul_rows())


def run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)


def test_a_throw_mid_loop_still_joins_the_workers(cache_dir):
    # Slice 0's GEMM is long (K = 2^16, fp32); the GEMM of slice 1 throws (injected). The
    # output's memory goes back to the caller's stream, which zero-fills a new tensor in
    # it. Without the join, slice 0's GEMM would land on those zeros afterwards.
    code = """
        import torch, codegen as cg
        from codegen import examples as ex
        torch.backends.cuda.matmul.allow_tf32 = False
        op = cg.compile(ex.matmul_rows(torch.float32, 2))
        a = torch.ones(2048, 1 << 16, device="cuda")
        b = torch.ones(1 << 16, 2048, device="cuda")
        torch.cuda.synchronize()
        try:
            op(a, b)
            raise SystemExit("no error was raised")
        except RuntimeError as e:
            assert "injected fault" in str(e), e
        fresh = [torch.zeros(2048, 2048, device="cuda") for _ in range(4)]
        torch.cuda.synchronize()
        bad = sum(int(f.count_nonzero()) for f in fresh)
        print("nonzero", bad)
        assert bad == 0, bad
        # The caller's stream is current again, and the op still works.
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        x, y = torch.ones(64, 32, device="cuda"), torch.ones(32, 16, device="cuda")
        assert torch.equal(op(x, y), x @ y)
    """
    r = run_child(code, CODEGEN_TEST_FAIL_GEMM="2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nonzero 0" in r.stdout


def test_capture_in_one_thread_while_others_call_eagerly(rows_op):
    # Eight eager threads and the capturing main thread: with PyTorch's round-robin pool
    # (32 streams, 4 per thread here) the ninth user would share the first one's streams
    # and its capture would record, or break on, that thread's GEMMs.
    a, b = torch.randn(512, 256, device="cuda"), torch.randn(256, 128, device="cuda")
    x, y = ints(300, 64, device="cuda"), ints(64, 32, device="cuda")
    want = x @ y
    stop, errors, calls = threading.Event(), [], [0] * 8
    started = threading.Barrier(9)

    def eager(t: int) -> None:
        try:
            assert torch.equal(rows_op(x, y), want)
            started.wait()
            while not stop.is_set():
                if not torch.equal(rows_op(x, y), want):
                    errors.append(f"thread {t}: eager mismatch")
                calls[t] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {e!r}")
            started.abort()

    workers = [threading.Thread(target=eager, args=(t,)) for t in range(8)]
    for w in workers:
        w.start()
    try:
        started.wait()
        rows_op(a, b)
        torch.cuda.synchronize()
        for _ in range(20):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = rows_op(a, b)
            a.copy_(torch.randn_like(a))
            graph.replay()
            torch.cuda.synchronize()
            ref = a.double() @ b.double()
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors[:3]
    assert min(calls) > 0, calls


def test_2000_short_lived_threads_grow_nothing(rows_op):
    a, b = ints(256, 64, device="cuda"), ints(64, 32, device="cuda")

    def once() -> None:
        assert torch.equal(rows_op(a, b), a @ b)

    def run(n: int) -> None:
        for _ in range(n):
            t = threading.Thread(target=once)
            t.start()
            t.join()

    run(20)
    torch.cuda.synchronize()
    # Each new worker stream would get its own cuBLAS workspace from the caching
    # allocator: new streams per thread would show here, 2000 times over. A thread gives
    # its lease back from a thread-local destructor, which may run after join() returns;
    # a thread that starts in that window takes a new lease (and torch a new cuBLAS
    # handle): one seen on the H200 as 32 MiB, once. Bounded, not per thread.
    workspace = int(os.environ.get("CODEGEN_CUBLASLT_WORKSPACE_MIB", "32")) << 20
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    run(2000)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - reserved <= 2 * workspace
    assert torch.cuda.memory_allocated() - allocated <= 2 * workspace


def test_tf32_flag_is_read_at_every_call(cache_dir):
    op = cg.compile(ex.matmul_rows(torch.float32, 2))
    a = torch.randn(1024, 4096, device="cuda")
    b = torch.randn(4096, 1024, device="cuda")
    ref = a.double() @ b.double()
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        strict = ((op(a, b).double() - ref).norm() / ref.norm()).item()
        torch.backends.cuda.matmul.allow_tf32 = True
        loose = ((op(a, b).double() - ref).norm() / ref.norm()).item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert strict < 1e-6 and loose > 1e-5, (strict, loose)


def test_bias_is_added_exactly_under_tf32(cache_dir):
    # torch adds linear's bias in fp32 (addmm's epilogue); a TF32 rank-1 GEMM of ones and
    # the bias would round it to 10 mantissa bits. With x = 0 the output is the bias.
    op = cg.compile(ex.linear_bias())
    x = torch.zeros(9, 16, device="cuda")
    w = torch.randn(30, 16, device="cuda")
    bias = torch.randn(30, device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        out = op(x, w, bias)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert torch.equal(out, bias.expand(9, 30))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_reduction_flag_reaches_cublas(cache_dir, dtype):
    # A tall-K product that cuBLAS likes to split: with reduced-precision reduction
    # disallowed the result is within fp32-accumulation error of the exact product.
    op = cg.compile(ex.matmul_rows(dtype, 1, name=f"rp_{str(dtype)[6:]}"))
    torch.manual_seed(0)
    a = torch.rand(16, 1 << 17, device="cuda").to(dtype)
    b = torch.rand(1 << 17, 16, device="cuda").to(dtype)
    ref = a.double() @ b.double()
    flag = ("allow_fp16_reduced_precision_reduction" if dtype == torch.float16
            else "allow_bf16_reduced_precision_reduction")
    saved = getattr(torch.backends.cuda.matmul, flag)
    try:
        setattr(torch.backends.cuda.matmul, flag, False)
        out = op(a, b)
        torch_out = a @ b
    finally:
        setattr(torch.backends.cuda.matmul, flag, saved)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    torch_err = ((torch_out.double() - ref).abs().max() / ref.abs().max()).item()
    # Rounding the final result to 16 bits is the only large error left.
    assert err <= max(2 * torch_err, 8e-3), (err, torch_err)


# (program, input shapes at scale t): ragged slices at every t (4 slices of 3t + 1 rows).
LIBRARY_CASES = {
    "matmul_rows": (lambda: ex.matmul_rows(torch.float32, 4),
                    lambda t: [(3 * t + 1, 2 * t + 3), (2 * t + 3, t + 5)]),
    "linear_bias": (ex.linear_bias,
                    lambda t: [(3 * t + 2, 2 * t + 3), (4 * t + 1, 2 * t + 3), (4 * t + 1,)]),
    "batched": (ex.batched, lambda t: [(4 * t + 3, t + 2, 5), (4 * t + 3, 5, t + 4)]),
}


@pytest.mark.parametrize("case", LIBRARY_CASES)
def test_cublaslt_plans_and_cublas_gemmex_agree_with_torch(case, cache_dir):
    """Both GEMM libraries, exact on integer-valued fp32 inputs (no TF32), at two shapes
    (so a cached plan is not reused for a shape it was not made for), then at the first
    shape again (the cached plan)."""
    make, shapes = LIBRARY_CASES[case]
    ops = {lib: cg.compile(make(), gemm_library=lib) for lib in ("cublaslt", "cublas")}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for t in (8, 33, 8):
            inputs = [ints(*shape).cuda() for shape in shapes(t)]
            want = (torch.nn.functional.linear(*inputs) if case == "linear_bias"
                    else inputs[0] @ inputs[1])
            for lib, op in ops.items():
                assert torch.equal(op(*inputs), want), (case, lib, t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_one_slice_runs_on_the_callers_stream_from_many_streams(cache_dir):
    """S = 1 runs on the caller's stream: called from six streams (more than the four
    cuBLASLt workspaces a thread keeps, so some take cublasGemmEx; the test
    checks the results, not which library ran), each call ordered after the caller's
    earlier work on its stream and before its later work, without a host sync in
    between; then captured in a graph."""
    op = cg.compile(ex.matmul_rows(torch.float32, 1))
    assert "SetCurrentStream" not in str(op.host_ir)
    streams = [torch.cuda.Stream() for _ in range(6)]
    a = [ints(2048, 512, device="cuda") for _ in streams]
    b = ints(512, 384, device="cuda")
    outs = []
    for s, x in zip(streams, a):
        with torch.cuda.stream(s):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the op must wait for what precedes it
            x.add_(1)
            out = op(x, b)
            outs.append(out.sub_(0) * 1)  # later work on the same stream reads it
    torch.cuda.synchronize()
    for x, out in zip(a, outs):
        assert torch.equal(out, x @ b)
    x, out_ref = a[0], a[0] @ b
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = op(x, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out_ref)
