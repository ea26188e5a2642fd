"""Runs every bundled example once on the GPU against the evaluator on the CPU (exactly,
where integer inputs give exact results); exit status 1 on a mismatch.
Small enough to run under `compute-sanitizer --tool memcheck`."""

import sys

import torch

import codegen as cg
from codegen.examples import EXAMPLES

torch.backends.cuda.matmul.allow_tf32 = False
failed = []
for name, ex in EXAMPLES.items():
    fusion = ex.make()
    dtype = fusion.inputs[0].dtype
    xs = [torch.randint(-2, 3, s, device=d).to(dtype) for s, d in zip(ex.shapes, ex.devices())]
    out = cg.compile(fusion)(*xs)
    ref = cg.evaluate(cg.lower(fusion), [x.cpu() for x in xs])[0].double()
    if ex.exact:
        good = torch.equal(out.double().cpu(), ref)
    else:  # SiLU and GELU: the GPU's and the CPU's exp and erf differ in the last bits
        good = ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item() < 2e-2
    print(f"{name:28} {'ok' if good else 'MISMATCH'}")
    if not good:
        failed.append(name)
sys.exit(1 if failed else 0)
