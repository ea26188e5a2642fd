"""On the GPU: after an exception mid-loop the caller's stream is ordered after the
workers; evaluate leaves the caller's current device and streams as they were. Marked
`gpu`; needs no C++ build."""

import pytest
import torch
from conftest import ints
from helpers import stream_matmul_rows

import codegen as cg
from codegen.interp import evaluator

pytestmark = [pytest.mark.gpu, pytest.mark.build]

SLEEP_CYCLES = 1_000_000_000  # about 0.5 s at the H200's clock: far longer than queuing


class Fault(Exception):
    pass


def fault_after_first_slice(monkeypatch, out_name):
    """Slice 0: its worker sleeps before its GEMM, and the output is filled with NaN on the
    caller's stream (not ordered before the GEMM, which overwrites it later). Slice 1:
    raises. Returns a dict that receives the output tensor."""
    state = {"calls": 0, "out": None}

    def hook(interp, node):
        state["calls"] += 1
        if state["calls"] == 1:
            torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is worker 0
            state["out"] = out = interp.values[out_name]
            with torch.cuda.stream(interp.streams._caller):
                out.fill_(float("nan"))
        else:
            raise Fault(f"fault in slice {state['calls'] - 1}")

    monkeypatch.setattr(evaluator, "_fault_hook", hook)
    return state


def test_fault_mid_loop_orders_the_callers_stream_after_the_workers(monkeypatch):
    program = cg.lower(stream_matmul_rows(slices=4))
    a, b = ints(64, 32, device="cuda"), ints(32, 16, device="cuda")
    # Warm-up: cuBLAS set up on every worker, and every kernel used below loaded (with
    # CUDA's lazy loading, the first launch of a kernel waits for the device to be idle).
    (expect,) = cg.evaluate(program, [a, b])
    assert torch.equal(expect, a @ b)
    expect[:16].clone().fill_(float("nan"))
    torch.cuda._sleep(1)
    caller = torch.cuda.current_stream()
    torch.cuda.synchronize()
    state = fault_after_first_slice(monkeypatch, "T2")
    with pytest.raises(Fault, match="fault in slice 1"):
        cg.evaluate(program, [a, b])
    assert torch.cuda.current_stream() == caller
    rows = state["out"][:16].clone()  # on the caller's stream: after slice 0's GEMM if joined
    after = torch.cuda.Event()
    after.record(caller)
    caller_waits = not after.query()  # worker 0 is still asleep
    torch.cuda.synchronize()
    assert torch.equal(rows, expect[:16]), "the caller's stream read slice 0 before its GEMM"
    assert caller_waits, "the caller's stream does not wait for worker 0"


def test_fault_mid_loop_keeps_the_current_device_and_stream(monkeypatch):
    """One GPU suffices to check the caller's stream is current again after a fault."""
    program = cg.lower(stream_matmul_rows(slices=2))
    caller, device = torch.cuda.current_stream(), torch.cuda.current_device()

    def hook(interp, node):
        raise Fault("fault")

    monkeypatch.setattr(evaluator, "_fault_hook", hook)
    with pytest.raises(Fault):
        cg.evaluate(program, [ints(4, 3, device="cuda"), ints(3, 5, device="cuda")])
    assert torch.cuda.current_device() == device and torch.cuda.current_stream() == caller


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: the current device can only be seen to change "
                           "when evaluating on another device than the current one")
@pytest.mark.parametrize("fault", [False, True])
def test_evaluate_on_another_device_keeps_the_current_device(monkeypatch, fault):
    """torch.cuda.set_stream(s) also makes s's device current; evaluate used to leave the
    inputs' device current."""
    program = cg.lower(stream_matmul_rows(slices=2))
    a, b = ints(6, 3, device="cuda:1"), ints(3, 5, device="cuda:1")
    if fault:
        def hook(interp, node):
            raise Fault("fault")

        monkeypatch.setattr(evaluator, "_fault_hook", hook)
    torch.cuda.set_device(0)
    streams = (torch.cuda.current_stream(0), torch.cuda.current_stream(1))
    if fault:
        with pytest.raises(Fault):
            cg.evaluate(program, [a, b])
    else:
        (out,) = cg.evaluate(program, [a, b])
        assert out.device == a.device and torch.equal(out, a @ b)
    assert torch.cuda.current_device() == 0
    assert (torch.cuda.current_stream(0), torch.cuda.current_stream(1)) == streams
