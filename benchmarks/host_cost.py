"""Where the op's host time goes, on one GPU.

    python -m benchmarks.host_cost [--out benchmarks/results] [--size 2048]

Host microseconds per call, every sample taken with the GPU kept busy by a sleep kernel
queued ahead (launches are only queued, never waited for; common.host_sample), the
variants interleaved sample by sample, medians over --samples:

- ``torch.matmul``: one ATen GEMM, the reference host cost;
- ``step0`` .. ``step4``: the prologue of a program (built like one: runtime.h,
  TORCH_BOX) cut after each part (``LADDER``): step 0 returns its first input (the
  torch.ops dispatcher and the stable ABI's boxing, nothing else), step 4 forks and joins
  four workers without GEMMs; the differences are each part's host µs;
- for S = 1, 2, 4, 8 and both GEMM libraries, the program ``matmul_rows`` called as
  ``CompiledOp`` (``op(a, b)``, the public path) and as its ``torch.ops`` overload
  (``op.op.default(a, b)``; the difference is the Python wrapper);
- ``inference: ...``: ``torch.matmul`` and the op at S = 1 under
  ``torch.inference_mode()``, where the dispatcher skips autograd kernels (torch's and
  the op's): the pair shows what the autograd kernels cost per call;
- a least-squares line through the overload's times over S: ``fixed_us`` (intercept, the
  cost of one call with no slices) and ``per_slice_us`` (slope), to compare with
  ``launch_floor_us`` (one cached cublasLtMatmul launch in a C++ loop, benchmarks.launch_floor).

Then, for the op at S = 4 (cuBLASLt), the CUDA runtime and driver calls it makes per call
and their host µs, from torch.profiler (CUPTI): what a host-cost cut would remove.

Writes host_cost.json to --out and prints a table; about 30 s on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import codegen as cg
from benchmarks import launch_floor
from benchmarks.common import RESULTS, host_sample, rotated, warm_up
from codegen import examples
from codegen.jit import build_library

SLICES = (1, 2, 4, 8)
LIBRARIES = ("cublaslt", "cublas")
# The prologue of matmul_rows_bf16 (csrc_gen/) cut after each part: step N does parts
# 1..N and returns. Step 0 does nothing; the full op (S = 4) adds the four GEMMs.
LADDER = ("dispatcher + boxing", "read and check the arguments",
          "device guard + GEMM types (precision flags)", "Streams + allocate the output",
          "fork and join 4 workers (events, current stream)")
LADDER_SOURCE = """\
#include "codegen/runtime.h"
namespace {
namespace rt = codegen_rt;
template <int Step>
torch::stable::Tensor step(torch::stable::Tensor T0_arg, torch::stable::Tensor T1_arg) {
  const char* const op = "host_cost_step";
  if constexpr (Step == 0) return T0_arg;
  const rt::Buffer T0 = rt::input(T0_arg, op, "T0", rt::DType::BFloat16, 2, "bfloat16[m, k]");
  const rt::Buffer T1 = rt::input(T1_arg, op, "T1", rt::DType::BFloat16, 2, "bfloat16[k, n]");
  const int32_t device = T0.device;
  rt::same_device(T1, "T1", T0, "T0", op);
  const int64_t m = T0.size(0);
  const int64_t n = T1.size(1);
  rt::check_matrix(T0, op, "T0");
  rt::check_matrix(T1, op, "T1");
  if constexpr (Step == 1) return T0_arg;
  const torch::stable::accelerator::DeviceGuard device_guard(device);
  rt::Gemms gemms(rt::DType::BFloat16, device, /*cublaslt=*/true, /*sm_count=*/0, op);
  if constexpr (Step == 2) return T0_arg;
  rt::Streams streams(device);
  const rt::Stream main_stream = streams.current();
  rt::Buffer T2 = streams.keep(rt::empty({m, n}, rt::DType::BFloat16, device, op));
  if constexpr (Step == 3) return T2.tensor;
  for (int64_t j = 0; j < 4; ++j) {
    streams.set_current(streams.worker(j));
    streams.wait(main_stream);
  }
  streams.set_current(main_stream);
  for (int64_t j = 0; j < 4; ++j) streams.wait(streams.worker(j));
  return T2.tensor;
}
}  // namespace
STABLE_TORCH_LIBRARY_FRAGMENT(codegen_bench, m) {
""" + "".join(f'  m.def("host_cost_step{i}(Tensor a, Tensor b) -> Tensor");\n'
              for i in range(len(LADDER))) + """}
STABLE_TORCH_LIBRARY_IMPL(codegen_bench, CUDA, m) {
""" + "".join(f'  m.impl("host_cost_step{i}", TORCH_BOX(&step<{i}>));\n'
              for i in range(len(LADDER))) + "}\n"


INFERENCE = "inference: "  # variants named so are sampled under torch.inference_mode()


def measure(variants: dict[str, Callable[[], Any]], samples: int) -> dict[str, float]:
    """Median host µs per call of each variant, sampled in rotated order; a variant whose
    name starts with ``INFERENCE`` is sampled inside ``torch.inference_mode()`` (entered
    once per sample, outside the timed calls)."""
    got: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(samples):
        for v in rotated(names, r):
            with torch.inference_mode(v.startswith(INFERENCE)):
                got[v].append(host_sample(variants[v]))
    return {v: statistics.median(s) for v, s in got.items()}


def api_calls(fn: Callable[[], Any], calls: int = 20) -> list[dict[str, Any]]:
    """CUDA API calls made by ``fn`` (runtime and driver, as CUPTI records them): per
    name, calls per ``fn`` call and host µs per ``fn`` call, largest first. CUPTI's
    callbacks lengthen every call, so the µs are an upper bound; the counts are exact."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        # cudaX (runtime) and cuX (driver) calls; not kernels such as cutlass_*.
        if re.match(r"cu(da)?[A-Z]", e.key) and "Synchronize" not in e.key:
            rows.append({"name": e.key, "per_call": e.count / calls,
                         "us_per_call": e.cpu_time_total / calls})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--size", type=int, default=2048, help="m = n = k (bf16)")
    parser.add_argument("--samples", type=int, default=25)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost: needs a CUDA GPU", file=sys.stderr)
        return 1
    build_library("codegen_bench_host_cost_ladder", LADDER_SOURCE)
    steps = [getattr(torch.ops.codegen_bench, f"host_cost_step{i}").default
             for i in range(len(LADDER))]
    a, b = (torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    variants: dict[str, Callable[[], Any]] = {"torch.matmul": lambda: torch.matmul(a, b)}
    for i, fn in enumerate(steps):
        variants[f"step{i}"] = lambda fn=fn: fn(a, b)
    for lib in LIBRARIES:
        for s in SLICES:
            op = cg.compile(examples.matmul_rows(torch.bfloat16, s, f"host_cost_s{s}"),
                            gemm_library=lib)
            variants[f"{lib} S={s} op()"] = lambda op=op: op(a, b)
            variants[f"{lib} S={s} overload"] = lambda op=op: op.op.default(a, b)
            if s == 1 and lib == "cublaslt":
                variants[f"{INFERENCE}{lib} S={s} op()"] = lambda op=op: op(a, b)
    # Under inference mode the dispatcher skips autograd kernels: torch's and the op's
    # (both C++; build._no_backward).
    variants[f"{INFERENCE}torch.matmul"] = lambda: torch.matmul(a, b)
    warm_up(lambda: [fn() for fn in variants.values()], 1.0, batch=3)
    us = measure(variants, args.samples)
    floor = launch_floor.measure()["launch_floor_us"]
    lines = [f"{v:>28} {t:8.1f}" for v, t in us.items()]
    fits = {}
    for lib in LIBRARIES:
        per_slice, fixed = statistics.linear_regression(
            SLICES, [us[f"{lib} S={s} overload"] for s in SLICES])
        fits[lib] = {"fixed_us": fixed, "per_slice_us": per_slice,
                     "per_slice_over_floor": per_slice / floor if floor else None,
                     "python_wrapper_us": statistics.median(
                         us[f"{lib} S={s} op()"] - us[f"{lib} S={s} overload"] for s in SLICES)}
        lines.append(f"{lib}: fixed {fixed:.1f} us + {per_slice:.1f} us per slice "
                     f"({per_slice / floor:.2f} x launch floor {floor:.1f} us); Python wrapper "
                     f"{fits[lib]['python_wrapper_us']:.1f} us; dispatcher + boxing "
                     f"(step0) {us['step0']:.1f} us")
    parts = {LADDER[0]: us["step0"]}
    parts |= {LADDER[i]: us[f"step{i}"] - us[f"step{i - 1}"] for i in range(1, len(LADDER))}
    parts["4 GEMMs (cuBLASLt plans)"] = us["cublaslt S=4 overload"] - us[f"step{len(LADDER) - 1}"]
    s1 = {"grad mode": us["cublaslt S=1 op()"] / us["torch.matmul"],
          "inference_mode": us[f"{INFERENCE}cublaslt S=1 op()"] / us[f"{INFERENCE}torch.matmul"]}
    lines.append("S = 1, op() / one torch.matmul: " +
                 ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in s1.items()))
    lines.append("The op at S = 4 (cuBLASLt), part by part (differences of medians):")
    lines += [f"  {name:>48} {value:7.1f} us" for name, value in parts.items()]
    traced = api_calls(variants["cublaslt S=4 overload"])
    lines.append("CUDA API calls per op call (cuBLASLt, S=4), from torch.profiler:")
    lines += [f"  {r['name']:>36} x{r['per_call']:<5.1f} {r['us_per_call']:7.1f} us"
              for r in traced]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_cost.json").write_text(json.dumps({
        "meta": {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "size": args.size, "samples": args.samples,
                 "launch_floor_us": floor, "method": host_sample.__doc__},
        "host_us": us, "fits": fits, "s1_over_torch_matmul": s1, "parts_cublaslt_s4": parts,
        "api_calls_cublaslt_s4": traced}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
