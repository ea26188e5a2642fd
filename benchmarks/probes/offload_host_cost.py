"""How much host time does an offloaded Linear cost per call, and a forward of the offloaded
4-layer Llama (the ``offload_llama`` benchmark's model, 512 tokens)?

With the caller's stream held by a long sleep kernel, nothing the host queues can run, so
the wall time of the calls is host time alone. Printed: µs per call of one offloaded
``nn.Linear(4096, 14336)`` (bf16, 512 tokens, S = 8) with and without prefetch, and of the
compiled op called directly; ms per forward of the offloaded Llama with and without
prefetch and of the GPU-resident one; then the profiler's CPU table of one offloaded
forward (what the host spends it on).

    python -m benchmarks.probes.offload_host_cost
"""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import codegen.nn
from benchmarks.common import build, host_sample, is_decoder_linear, llama_config


def llama(prefetch: bool | None) -> nn.Module:
    """The offload_llama benchmark's model, offloaded as there (``None``: GPU-resident)."""
    model = build(llama_config())
    if prefetch is None:
        return model
    return codegen.nn.offload(model, slices=8, prefetch=prefetch, filter=is_decoder_linear)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("offload_host_cost needs a CUDA GPU")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    for prefetch in (True, False):
        layer = nn.Linear(4096, 14336, bias=False).to(torch.bfloat16)
        codegen.nn.offload(layer, slices=8, prefetch=prefetch)
        with torch.no_grad():
            layer(x)  # builds the program
            us = host_sample(lambda layer=layer: layer(x), calls=10, busy_ms=50)
        op = next(iter(layer._codegen.ops.values()))
        direct = host_sample(lambda op=op, layer=layer: op(x, layer.weight.detach()),
                             calls=10, busy_ms=50)
        print(f"Linear(4096, 14336), 512 tokens, S = 8, prefetch={prefetch}: "
              f"{us:.0f} µs host per call through nn, {direct:.0f} µs per op call")
    ids = torch.randint(0, 32000, (1, 512), device="cuda")
    for prefetch in (True, False, None):
        model = llama(prefetch)
        with torch.no_grad():
            model(ids)  # builds the programs
            ms = host_sample(lambda model=model: model(ids), calls=1, busy_ms=100) / 1e3
        print(f"4-layer Llama, 512 tokens, prefetch={prefetch} (None: GPU-resident): "
              f"{ms:.2f} ms host per forward")
        if prefetch:
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                model(ids)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                            max_name_column_width=50))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
