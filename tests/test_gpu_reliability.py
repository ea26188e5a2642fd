"""Long runs and concurrency on the GPU. Marked `gpu`."""

import threading

import pytest
import torch
from conftest import ints

import codegen as cg
from codegen import examples as ex

pytestmark = [pytest.mark.gpu, pytest.mark.build]


@pytest.fixture(scope="module")
def rows_op(cache_dir):
    return cg.compile(ex.matmul_rows())


def test_10000_calls_leave_memory_flat(rows_op):
    a, b = torch.randn(256, 64, device="cuda"), torch.randn(64, 32, device="cuda")
    for _ in range(10):
        rows_op(a, b)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(10_000):
        rows_op(a, b)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved


def test_same_streams_every_call(rows_op):
    from codegen.tools.timeline import profile_kernels

    a, b = torch.randn(1024, 512, device="cuda"), torch.randn(512, 256, device="cuda")
    first = {k.stream for k in profile_kernels(lambda: rows_op(a, b))}
    second = {k.stream for k in profile_kernels(lambda: rows_op(a, b))}
    assert first == second and len(first) >= 2


def test_four_threads_at_once(rows_op, cache_dir):
    linear = cg.compile(ex.linear_bias())
    errors: list[str] = []

    def work(seed: int) -> None:
        torch.manual_seed(seed)
        for it in range(100):
            m = 1 + (seed * 37 + it * 11) % 300
            a, b = ints(m, 48, device="cuda"), ints(48, 20, device="cuda")
            if not torch.equal(rows_op(a, b), a @ b):
                errors.append(f"thread {seed} iteration {it}: matmul_rows mismatch")
            x, w, bias = ints(m, 16, device="cuda"), ints(30, 16, device="cuda"), ints(30,
                                                                                   device="cuda")
            if not torch.equal(linear(x, w, bias), torch.nn.functional.linear(x, w, bias)):
                errors.append(f"thread {seed} iteration {it}: linear_bias mismatch")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
