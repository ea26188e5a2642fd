"""A 4-layer transformers Llama whose decoder Linear weights live in host memory.

    python -m benchmarks.offload_llama [--out benchmarks/results] [--rounds N]

h 4096, i 14336, 32 heads, 8 kv heads, vocab 32000, bf16, random weights; the decoder
layers' Linear weights (1.63 GiB) offloaded, embeddings, norms and lm_head on the GPU, as:

- codegen: ``codegen.nn.offload(model, slices=8)`` (one compiled program per Linear call,
  each streaming its weight in slices under its GEMMs; no prefetch across Linears);
- accelerate: ``accelerate.cpu_offload`` of each decoder layer (its hooks copy each weight
  from host memory when the layer runs), where accelerate is installed;
- gpu: the model with every weight on the GPU;
- copy: the offloaded bytes copied alone from pinned memory, back to back (the floor).

Prefills of 512 and 4096 tokens and one decode step (one token after a 512-token prompt,
with the KV cache), forwards back to back, the variants interleaved in rounds after a
warm-up; medians. Writes offload_llama.json (rows: tokens, variant, ms, ratio to the copy
floor, GPU and host memory) to --out and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import codegen.nn
from benchmarks.common import RESULTS, bind, interleaved


def llama() -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        tie_word_embeddings=False, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def decoder_linears(model: Any) -> list[torch.nn.Linear]:
    return [m for layer in model.model.layers for m in layer.modules()
            if isinstance(m, torch.nn.Linear)]


def forward(model: Any, ids: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


class DecodeStep:
    """One decode step after a prompt: the prompt's KV cache is made once (untimed); each
    call forwards one token at the next position on a copy of it (a few MB on the GPU; the
    cache's crop API differs across transformers versions)."""

    def __init__(self, model: Any, prompt: torch.Tensor, token: torch.Tensor) -> None:
        self.model, self.token, self.length = model, token, prompt.shape[1]
        with torch.no_grad():
            self.cache = model(prompt, use_cache=True).past_key_values

    def __call__(self) -> Any:
        with torch.no_grad():
            out = self.model(self.token, past_key_values=copy.deepcopy(self.cache),
                             use_cache=True)
        return out.logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offload_llama", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="512,4096")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_llama: needs a CUDA GPU", file=sys.stderr)
        return 1
    base = llama()
    offloaded_bytes = sum(m.weight.numel() * 2 for m in decoder_linears(base))
    models: dict[str, Any] = {"gpu": copy.deepcopy(base).cuda()}
    ours = codegen.nn.offload(copy.deepcopy(base), slices=8,
                              filter=lambda name, m: name.startswith("model.layers."))
    models["codegen"] = ours
    try:
        import accelerate

        acc = copy.deepcopy(base).cuda()
        for layer in acc.model.layers:
            layer.cpu()
            accelerate.cpu_offload(layer, execution_device=torch.device("cuda"))
        models["accelerate"] = acc
    except ImportError:
        print("offload_llama: accelerate is not installed; its rows are missing")
    host = [m.weight.detach().cpu().pin_memory() for m in decoder_linears(base)]
    dev = [torch.empty_like(w, device="cuda") for w in host]

    def copies() -> None:
        for w, d in zip(host, dev):
            d.copy_(w, non_blocking=True)

    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, 32000, (1, tokens), device="cuda")
        variants = {"copy": copies, **{k: bind(forward, m, ids) for k, m in models.items()}}
        rounds = max(2, args.rounds if tokens <= 512 else args.rounds - 2)
        times = interleaved({k: v for k, v in variants.items() if k != "accelerate"}, rounds)
        if "accelerate" in models:  # seconds a round: timed apart, fewer times
            times |= interleaved({"accelerate": variants["accelerate"]}, 2)
        floor = statistics.median(times["copy"])
        for k, t in times.items():
            rows.append({"tokens": tokens, "step": "prefill", "variant": k,
                         "ms": statistics.median(t), "ratio": statistics.median(t) / floor})
    prompt = torch.randint(0, 32000, (1, 512), device="cuda")
    token = torch.randint(0, 32000, (1, 1), device="cuda")
    variants = {"copy": copies, **{k: DecodeStep(m, prompt, token) for k, m in models.items()
                                   if k != "accelerate"}}
    times = interleaved(variants, args.rounds)
    floor = statistics.median(times["copy"])
    for k, t in times.items():
        rows.append({"tokens": 1, "step": "decode", "variant": k, "ms": statistics.median(t),
                     "ratio": statistics.median(t) / floor})
    report = codegen.nn.report(ours).as_dict()
    arena = codegen.nn.arena(ours).nbytes
    print(f"{'step':8}{'tokens':>7} {'variant':12}{'ms':>9}{'/ copy floor':>14}")
    for r in rows:
        print(f"{r['step']:8}{r['tokens']:7} {r['variant']:12}{r['ms']:9.2f}{r['ratio']:14.3f}")
    print(f"offloaded {offloaded_bytes / 2**30:.2f} GiB; pinned arena {arena / 2**30:.3f} GiB "
          f"({arena / offloaded_bytes:.4f} x); last codegen report: {report}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload_llama.json").write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "offloaded_bytes": offloaded_bytes,
        "arena_bytes": arena, "rows": rows, "last_report": report}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
