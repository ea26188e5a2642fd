"""How should the backward of a GPU-resident ``llama_mlp`` use its streams?

One training step is the saving forward then the backward (h 4096, i 14336, m 4096, bf16),
both built from ``codegen.transforms.gradient.derive``. The forward is always the user's split (S
slices, ``pool_size`` 4); the backward varies: split like the forward on 4, 2 or 1 worker
streams, split like an S = 1 forward (no loop), or built with cublasGemmEx instead of
cuBLASLt. The two programs are called directly (no autograd), next to torch autograd of
the same math and to the compiled op's own autograd step, all interleaved after a
warm-up. Also the forwards alone, to tell the forward's share from the backward's.

    python -m benchmarks.probes.backward_streams [--slices 4,8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import codegen as cg
from benchmarks.common import interleaved, parse_ints
from codegen import examples
from codegen.jit import build
from codegen.runtime import autograd
from codegen.transforms.lowering import lower


def llama(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def direct_step(slices: int, backward_slices: int, leaves: list[torch.Tensor],
                grad: torch.Tensor, **options: Any) -> Callable[[], Any]:
    """The saving forward at ``slices`` then the backward derived from the program at
    ``backward_slices``, lowered with ``options``, called directly."""
    tag = f"{slices}_{backward_slices}_" + "_".join(f"{k}{v}" for k, v in options.items())
    fwd_grad = autograd.derive(examples.llama_mlp(torch.bfloat16, slices, name=f"pf_{tag}"),
                               [True] * 4)
    bwd_grad = autograd.derive(examples.llama_mlp(torch.bfloat16, backward_slices,
                                                  name=f"pb_{tag}"), [True] * 4)
    if bwd_grad.saved_inputs != fwd_grad.saved_inputs or \
            bwd_grad.saved_outputs != fwd_grad.saved_outputs:
        raise SystemExit(f"{tag}: the two derivations save different tensors")
    forward = build(lower(fwd_grad.forward, pool_size=4))._overload
    backward = build(lower(bwd_grad.backward, **options).replace(source=None))._overload
    plain = [t.detach() for t in leaves]
    saved_in = [plain[k] for k in fwd_grad.saved_inputs]

    def run() -> None:
        outs = forward(*plain)
        backward(*saved_in, *[outs[k] for k in fwd_grad.saved_outputs], grad)

    return run


def autograd_step(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor],
                  grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", default="4,8")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("backward_streams needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    leaves = [torch.randn(*s, device="cuda", generator=g).mul_(0.02).bfloat16().requires_grad_()
              for s in shapes]
    grad = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    plain = [t.detach() for t in leaves]
    variants: dict[str, Callable[[], Any]] = {
        "torch step": autograd_step(llama, leaves, grad),
        "torch forward": lambda: llama(*plain),
        "S=1 step (autograd)": autograd_step(cg.compile(examples.llama_mlp(
            torch.bfloat16, 1, name="pa_1")), leaves, grad),
        "S=1 direct": direct_step(1, 1, leaves, grad),
    }
    for s in parse_ints(args.slices, "--slices"):
        op = cg.compile(examples.llama_mlp(torch.bfloat16, s, name=f"pa_{s}"))
        variants[f"S={s} forward"] = lambda op=op: op(*plain)
        variants[f"S={s} step (autograd)"] = autograd_step(op, leaves, grad)
        for pool in (4, 2, 1):
            variants[f"S={s} direct, backward pool {pool}"] = direct_step(
                s, s, leaves, grad, pool_size=pool)
        variants[f"S={s} direct, backward cublas"] = direct_step(
            s, s, leaves, grad, gemm_library="cublas")
        variants[f"S={s} direct, backward unsplit"] = direct_step(s, 1, leaves, grad)
    times = interleaved(variants, args.rounds)
    base = statistics.median(times["torch step"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{name:40s} {ms:8.3f} ms  {ms / base:6.3f} x torch step", flush=True)


if __name__ == "__main__":
    main()
