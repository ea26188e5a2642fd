"""How fast is the dequantization of a streamed piece, on the GPU and on the host, and how
long does the host take to queue a quantized decode forward?

1. GPU time (CUDA events, median of interleaved rounds) and bandwidth (bytes read and
   written) of dequantizing one weight's arena rows into bf16, for the 8B model's two
   Linear shapes: the Triton kernel offload uses (``codegen.nn.quantize.dequantizer``),
   torch's elementwise ops (its fallback), and the torch jiterator kernel offload used
   before (kept here to compare). A device-to-device copy of the output's bytes is the
   memory system's yardstick.
2. Host µs per call of each, the GPU held by a sleep kernel (``host_sample``).
3. Host ms per forward of the 4-layer Llama of ``offload_llama`` (one token, no cache),
   offloaded at bf16, fp8 and int4 (each with its calls' pieces merged, as a one-token
   forward runs them, and one GEMM per piece; the streamer's events, waits and copies made
   on the CUDA runtime directly, as offload makes them, and through torch's wrappers) and
   GPU-resident: a decode forward must be queued faster than its copies run, or the host,
   not the copy engine, sets its time.

    python -m benchmarks.probes.dequant_kernels [--forwards]   (--forwards: part 3 only)
"""

from __future__ import annotations

import statistics
import sys

import torch

import codegen.nn
from benchmarks.common import (
    build,
    host_sample,
    is_decoder_linear,
    llama_config,
    python_profile,
)
from codegen.nn import streamer
from codegen.nn.quantize import (
    INT4_GROUP,
    dequantizer,
    pack_rows,
    quantize_weight,
    row_bytes,
    unpack_rows_eager,
)

# The jiterator kernels offload used before the Triton ones (inputs promoted to the
# weight's dtype on load; see codegen/nn/kernels.py for the format).
_JITERATOR = {
    "fp8": """
template <typename T> T cg_dequantize_fp8(T bits, T scale) {
  const int b = static_cast<int>(static_cast<float>(bits));
  const int e = (b >> 3) & 15, m = b & 7;
  float f = e == 0 ? m * 0.001953125f : __int_as_float(((e + 120) << 23) | (m << 20));
  if (e == 15 && m == 7) f = __int_as_float(0x7fc00000);
  return T(b & 128 ? -f : f) * scale;
}""",
    "int4": """
template <typename T> T cg_dequantize_int4(T packed, T high, T scale) {
  const int b = static_cast<int>(static_cast<float>(packed));
  const int v = (static_cast<float>(high) != 0.0f ? b >> 4 : b) & 15;
  return T(static_cast<float>(v - ((v & 8) << 1))) * scale;
}"""}


def jiterator(raw: torch.Tensor, kind: str, features: int, dtype: torch.dtype):
    """The old one-kernel dequantization of ``raw``'s rows, as a function of no arguments."""
    fn = torch.cuda.jiterator._create_jit_fn(_JITERATOR[kind])
    rows = raw.shape[0]
    n = features if kind == "fp8" else features // 2
    scale = raw[:, n:].view(dtype)
    if kind == "fp8":
        return lambda: fn(raw[:, :n], scale)
    high = torch.tensor([0, 1], dtype=dtype, device=raw.device)
    groups = scale.shape[1]
    packed = raw[:, :n].view(rows, groups, INT4_GROUP // 2, 1)
    return lambda: fn(packed, high, scale.view(rows, groups, 1, 1)).reshape(rows, features)


def gpu_ms(fns: dict[str, object], rounds: int = 15, reps: int = 5) -> dict[str, float]:
    """Median ms per call of each function, timed with events, interleaved by round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def kernels() -> None:
    dtype = torch.bfloat16
    for out_f, in_f in ((14336, 4096), (4096, 14336)):
        for kind in ("fp8", "int4"):
            w = torch.randn(out_f, in_f, dtype=dtype, device="cuda")
            raw = pack_rows(*quantize_weight(w, kind), kind)
            assert raw.shape[1] == row_bytes(kind, in_f, dtype)
            triton = dequantizer(raw, kind, in_f, dtype)
            old = jiterator(raw, kind, in_f, dtype)
            want = unpack_rows_eager(raw, kind, in_f, dtype)
            assert torch.equal(triton(), want) and torch.equal(old(), want)
            dst = torch.empty_like(want)
            fns = {"triton": triton, "torch ops": lambda raw=raw, kind=kind, in_f=in_f:
                   unpack_rows_eager(raw, kind, in_f, dtype),
                   "jiterator": old, "d2d copy": lambda dst=dst, want=want: dst.copy_(want)}
            ms = gpu_ms(fns)
            out_bytes = want.numel() * want.element_size()
            moved = {name: raw.numel() + out_bytes for name in fns}
            moved["d2d copy"] = 2 * out_bytes  # the output's bytes read and written
            host = {name: host_sample(fn, calls=20, busy_ms=20) for name, fn in fns.items()}
            print(f"{kind} [{out_f}, {in_f}] -> bf16 ({moved['triton'] / 2**20:.0f} MiB read "
                  "+ written): " + "; ".join(
                      f"{name} {ms[name]:.3f} ms, {moved[name] / ms[name] / 1e6:.0f} GB/s, "
                      f"{host[name]:.1f} µs host" for name in fns))


def forwards() -> None:
    ids = torch.randint(0, 32000, (1, 1), device="cuda")
    for kind in ("bf16", "fp8", "int4", None):
        model = build(llama_config())
        if kind is not None:
            codegen.nn.offload(model, filter=is_decoder_linear,
                               quantize=None if kind == "bf16" else kind)
        # Offloaded: its calls' pieces merged into one GEMM per run (as a one-token forward
        # runs them) or one GEMM per piece (as a forward of more than MERGED_ROWS rows);
        # events, waits and copies made on the CUDA runtime directly or through torch's
        # wrappers.
        backend = model._codegen_offload.streamer.backend if kind is not None else None
        runtime = backend.runtime if backend is not None else None
        conditions = ([(True, True), (True, False), (False, True)] if kind is not None
                      else [(True, True)])
        for merged, direct in conditions:
            streamer.MERGED_ROWS = 64 if merged else 0
            if backend is not None:
                backend.runtime = runtime if direct else None
            with torch.no_grad():
                for _ in range(3):
                    model(ids)
                torch.cuda.synchronize()
                ms = [host_sample(lambda model=model: model(ids), calls=1, busy_ms=200) / 1e3
                      for _ in range(5)]
            label = "GPU-resident" if kind is None else (
                f"offloaded, {kind}, " + ("pieces merged" if merged else "a GEMM per piece")
                + (", runtime calls" if direct and runtime is not None else ", torch's calls"))
            print(f"4-layer Llama, 1 token, {label}: host {statistics.median(ms):.2f} ms "
                  f"per forward (of 5: {min(ms):.2f}-{max(ms):.2f})")
        if backend is not None:
            backend.runtime = runtime
        streamer.MERGED_ROWS = 64
        if kind == "int4":  # where its host time goes, in Python
            with torch.no_grad():
                _, table = python_profile(lambda model=model: [model(ids) for _ in range(5)])
            torch.cuda.synchronize()
            print(table)
        del model
        torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("dequant_kernels needs a CUDA GPU")
    print(torch.cuda.get_device_name(), torch.__version__)
    if "--forwards" not in sys.argv:
        kernels()
    forwards()


if __name__ == "__main__":
    main()
