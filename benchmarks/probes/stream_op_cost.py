"""What does each stream operation an offloaded call queues between its kernels cost the
GPU: an event record after a GEMM, a wait for an event another stream recorded long ago,
the timing events around a wait, and the driver's stream memory operations (a stream
waiting for a 32-bit value in device memory, and writing one) that could stand in for
events?

A call here is what an offloaded Linear of the 8B-shaped model queues at 4096 tokens:
``--pieces`` GEMMs of 4096 rows against 4096 x 4096 weight pieces (32 MiB, the copy
size), each into its columns of the output, then one elementwise kernel on the output,
as the model's next op. Each variant adds its operations around every piece; the calls
are timed interleaved (``benchmarks.common.interleaved``) and the cost of an operation
is the variant's time over ``plain``'s, per piece, in microseconds. The host queues far
ahead of the GPU (a piece's GEMM takes about 200 µs, its Python tens).

Variants: ``plain``; ``record`` (an event recorded after each GEMM, as a span's free);
``wait`` (the stream waits, before each GEMM, for an event the copy stream recorded
before the block); ``wait_record``; ``wait_record_probes`` (with timing events recorded
before and after each wait, as the report's ``exposed_copy_ms`` does); ``values`` (a
wait for a value already written, before each GEMM, and a value written after it:
``cuStreamWaitValue32`` / ``cuStreamWriteValue32``); ``copying`` (plain, with an 8 MiB
host-to-device copy queued on another stream per piece, not ordered with the GEMMs);
``ring_events`` and ``ring_values``: a two-stream pipeline through a ring of four 8 MiB
slots (each GEMM waits for its slot's copy, each copy until the GEMM of the slot's last
use is done: the ordering of a read, though the GEMM reads its own weight, not the
slot), ordered with events, or with values.

    python -m benchmarks.probes.stream_op_cost [--pieces 4] [--rows 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from collections.abc import Callable

import torch

from benchmarks.common import interleaved
from codegen.nn.cudart import runtime

WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: after the stream's work, with a barrier


class Values:
    """``cuStreamWaitValue32`` and ``cuStreamWriteValue32`` from the driver."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait, self._write = lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2
        for f in (self._wait, self._write):
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            f.restype = ctypes.c_int

    def wait(self, stream: int, addr: int, value: int) -> None:
        if status := self._wait(stream, addr, value & 0xFFFFFFFF, WAIT_GEQ):
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUDA driver error {status}")

    def write(self, stream: int, addr: int, value: int) -> None:
        if status := self._write(stream, addr, value & 0xFFFFFFFF, WRITE_DEFAULT):
            raise RuntimeError(f"cuStreamWriteValue32 failed: CUDA driver error {status}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pieces", type=int, default=4)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stream_op_cost needs a CUDA GPU")
    print(torch.cuda.get_device_name(), torch.__version__)
    values = Values()
    dev, bf16, k = torch.device("cuda"), torch.bfloat16, 4096
    x = torch.randn(args.rows, k, device=dev, dtype=bf16)
    w = torch.randn(k, k, device=dev, dtype=bf16) / 64
    out = torch.empty(args.rows, k * args.pieces, device=dev, dtype=bf16)
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    cs, ks = compute.cuda_stream, copy.cuda_stream
    rt = runtime()  # the calls the streamer makes, on the runtime torch loaded
    if rt is None:
        raise SystemExit("stream_op_cost: the CUDA runtime torch loaded was not found")

    def event(timing: bool = False) -> int:
        e = torch.cuda.Event(enable_timing=timing)
        e.record(copy)  # creates it
        keep.append(e)
        return e.cuda_event

    keep: list[torch.cuda.Event] = []
    done = event()  # recorded on the copy stream now: long complete when waited for
    frees = [event() for _ in range(args.pieces)]
    probes = [event(timing=True) for _ in range(2 * args.pieces)]
    flags = torch.zeros(64, dtype=torch.int32, device=dev)
    flag = flags.data_ptr()
    values.write(ks, flag, 1)  # the flag waited for: already written
    src = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(8 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()  # copying's copies: a stream of their own
    torch.cuda.synchronize()

    def call(before: Callable[[int], None] | None = None,
             after: Callable[[int], None] | None = None) -> None:
        for i in range(args.pieces):
            if before is not None:
                before(i)
            torch.mm(x, w.t(), out=out[:, i * k:(i + 1) * k])
            if after is not None:
                after(i)
        torch.nn.functional.silu(out, inplace=True)

    def record(i: int) -> None:
        rt.record(frees[i], cs)

    def wait(i: int) -> None:
        rt.wait(cs, done)

    def probed_wait(i: int) -> None:
        rt.record(probes[2 * i], cs)
        rt.wait(cs, done)
        rt.record(probes[2 * i + 1], cs)

    def copying(i: int) -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    # The ring: four 8 MiB slots, a copy of 8 MiB (0.15 ms) per piece, which its GEMM (the
    # same as plain's, 0.2 ms) waits for, and which waits until the GEMM of the slot's last
    # use is done; generation numbers (per variant) order the two streams with values.
    slots, slot_bytes = 4, 8 << 20
    ring = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=dev)
    ring_src = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=True).fill_(0)
    copied_ev = [event() for _ in range(slots)]
    freed_ev = [event() for _ in range(slots)]
    state = {False: 0, True: 0}  # pieces queued, per variant
    copied_flags, freed_flags = flag + 64, flag + 128  # int32 arrays of `slots` each

    def ring_call(use_values: bool) -> None:
        for i in range(args.pieces):
            n = state[use_values]
            s, gen = n % slots, n // slots + 1
            view = ring[s * slot_bytes:(s + 1) * slot_bytes]
            if use_values:
                values.wait(ks, freed_flags + 4 * s, gen - 1)
            elif n >= slots:
                rt.wait(ks, freed_ev[s])
            rt.copy(view.data_ptr(), ring_src[s * slot_bytes:].data_ptr(), slot_bytes, ks)
            if use_values:
                values.write(ks, copied_flags + 4 * s, gen)
                values.wait(cs, copied_flags + 4 * s, gen)
            else:
                rt.record(copied_ev[s], ks)
                rt.wait(cs, copied_ev[s])
            torch.mm(x, w.t(), out=out[:, i * k:(i + 1) * k])
            if use_values:
                values.write(cs, freed_flags + 4 * s, gen)
            else:
                rt.record(freed_ev[s], cs)
            state[use_values] = n + 1
        torch.nn.functional.silu(out, inplace=True)

    variants: dict[str, Callable[[], None]] = {
        "plain": lambda: call(),
        "record": lambda: call(after=record),
        "wait": lambda: call(before=wait),
        "wait_record": lambda: call(before=wait, after=record),
        "wait_record_probes": lambda: call(before=probed_wait, after=record),
        "values": lambda: call(before=lambda i: values.wait(cs, flag, 1),
                               after=lambda i: values.write(cs, flag + 4, i)),
        "copying": lambda: call(after=copying),
        "ring_events": lambda: ring_call(False),
        "ring_values": lambda: ring_call(True),
    }
    times = interleaved(variants, args.rounds, block_ms=60.0, max_reps=100)
    base = statistics.median(times["plain"])
    print(f"{args.pieces} GEMM pieces of {args.rows} x {k} x {k} and a silu a call; "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'variant':>20} {'ms a call':>10} {'vs plain':>9} {'µs a piece':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>20} {med:10.4f} {med / base:8.4f}x "
              f"{(med - base) * 1e3 / args.pieces:10.2f}")
    ring_gap = statistics.median(times["ring_values"]) - statistics.median(times["ring_events"])
    print(f"ring with values against events: {ring_gap * 1e3 / args.pieces:+.2f} µs a piece")


if __name__ == "__main__":
    main()
