"""Diagnostics on the GPU machine: where the generated op's host time goes, and which
TORCH_CHECK message parts are safe with the installed torch.

    PYTHONPATH=. python3 tools/host_costs.py probe   # one error path per process
    PYTHONPATH=. python3 tools/host_costs.py costs
"""

import subprocess
import sys

import torch

from codegen.build import build_library

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <cstdio>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublas_v2.h>
#include <torch/library.h>
#include <chrono>
#include <string>
namespace {
int64_t sizes_no_throw(const at::Tensor& t) { return static_cast<int64_t>(t.sizes().size()); }
int64_t throw_int(const at::Tensor& t) { TORCH_CHECK(false, "probe: dim ", t.dim()); return 0; }
int64_t throw_sizes(const at::Tensor& t) { TORCH_CHECK(false, "probe: sizes ", t.sizes()); return 0; }
int64_t throw_string(const at::Tensor& t) {
  std::string s = "[" + std::to_string(t.size(0)) + "]";
  TORCH_CHECK(false, "probe: string ", s); return 0; }
int64_t throw_single_string(const at::Tensor& t) {
  TORCH_CHECK(false, std::string("probe: single string")); return 0; }
int64_t throw_own_format(const at::Tensor& t) {
  char buf[64]; std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(t.size(0)));
  std::string s = std::string("probe: own format ") + buf;
  TORCH_CHECK(false, s); return 0; }
int64_t throw_after_guard(const at::Tensor& t) {
  const c10::cuda::CUDAGuard g(t.device());
  TORCH_CHECK(false, "probe: after guard ", t.dim()); return 0; }

using clk = std::chrono::steady_clock;
double ns(clk::time_point a, clk::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count(); }

// Per-call nanoseconds of the host steps of one slice, GPU kept busy by the caller.
at::Tensor costs(const at::Tensor& a, int64_t iters) {
  auto out = at::empty({6}, at::TensorOptions().dtype(at::kDouble));
  double* r = out.data_ptr<double>();
  auto dev = a.get_device();
  auto main = c10::cuda::getCurrentCUDAStream(dev);
  auto w = c10::cuda::getStreamFromPool(false, dev);
  cudaEvent_t ev; cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  float alpha = 1, beta = 0;
  auto t0 = clk::now();
  for (int64_t i = 0; i < iters; ++i) c10::cuda::setCurrentCUDAStream(i % 2 ? w : main);
  auto t1 = clk::now();
  for (int64_t i = 0; i < iters; ++i) { c10::cuda::setCurrentCUDAStream(i % 2 ? w : main); at::cuda::getCurrentCUDABlasHandle(); }
  auto t2 = clk::now();
  for (int64_t i = 0; i < iters; ++i) { cudaEventRecord(ev, main.stream()); cudaStreamWaitEvent(w.stream(), ev, 0); }
  auto t3 = clk::now();
  c10::cuda::setCurrentCUDAStream(w);
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  void* p = a.data_ptr();
  auto t4 = clk::now();
  for (int64_t i = 0; i < iters; ++i)
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 64, 64, 64, &alpha, p, CUDA_R_16BF, 64, p, CUDA_R_16BF, 64, &beta, p, CUDA_R_16BF, 64, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  auto t5 = clk::now();
  for (int64_t i = 0; i < iters; ++i) at::empty({64, 64}, a.options());
  auto t6 = clk::now();
  c10::cuda::setCurrentCUDAStream(main);
  r[0] = ns(t0, t1) / iters; r[1] = (ns(t1, t2) - ns(t0, t1)) / iters; r[2] = ns(t2, t3) / iters;
  r[3] = ns(t4, t5) / iters; r[4] = ns(t5, t6) / iters; r[5] = 0;
  return out;
}
}
TORCH_LIBRARY_FRAGMENT(probe, m) {
  for (const char* f : {"sizes_no_throw", "throw_int", "throw_sizes", "throw_string", "throw_after_guard", "throw_single_string", "throw_own_format"})
    m.def((std::string(f) + "(Tensor t) -> int").c_str());
  m.def("costs(Tensor a, int iters) -> Tensor");
}
TORCH_LIBRARY_IMPL(probe, CUDA, m) {
  m.impl("sizes_no_throw", &sizes_no_throw); m.impl("throw_int", &throw_int);
  m.impl("throw_sizes", &throw_sizes); m.impl("throw_string", &throw_string);
  m.impl("throw_after_guard", &throw_after_guard); m.impl("costs", &costs);
  m.impl("throw_single_string", &throw_single_string); m.impl("throw_own_format", &throw_own_format);
}
"""

if __name__ == "__main__":
    build_library("host_probe", SOURCE)
    if sys.argv[1] == "one":
        try:
            print(sys.argv[2], "returned", getattr(torch.ops.probe, sys.argv[2])(
                torch.ones(3, 4, device="cuda")))
        except RuntimeError as e:
            print(sys.argv[2], "raised:", str(e).splitlines()[0])
    elif sys.argv[1] == "probe":
        for f in ("sizes_no_throw", "throw_int", "throw_sizes", "throw_string",
                  "throw_after_guard", "throw_single_string", "throw_own_format"):
            r = subprocess.run([sys.executable, __file__, "one", f], capture_output=True,
                               text=True)
            print(f"{f:20} rc={r.returncode} {r.stdout.strip()[-100:]}")
    else:
        a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        torch.ops.probe.costs(a, 100)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))
        r = torch.ops.probe.costs(a, 200).tolist()
        torch.cuda.synchronize()
        names = ["setCurrentCUDAStream", "getCurrentCUDABlasHandle (after a stream switch)",
                 "cudaEventRecord + cudaStreamWaitEvent", "cublasGemmEx 64^3 bf16",
                 "at::empty 64x64"]
        for n, v in zip(names, r):
            print(f"{n:50} {v / 1000:8.2f} us")
