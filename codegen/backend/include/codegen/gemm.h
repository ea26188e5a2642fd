// codegen runtime: row-major GEMMs on strided views through column-major cuBLAS, on the
// current stream with PyTorch's cuBLAS handle and workspace for that stream.
#pragma once

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_aten.h>
#include <torch/csrc/stable/c/shim.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "codegen/check.h"
#include "codegen/epilogue.h"
#include "codegen/math_mode.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// Data and accumulate types of a program's GEMMs, decided once per call.
struct GemmType {
  cudaDataType_t data;
  cublasComputeType_t compute;
  Reduction reduction = Reduction::ReducedPrecisionWithSplitK;  // fp16/bf16 split-K

  // cublasGemmEx can forbid 16-bit partial sums but not split-K itself (torch.matmul's
  // cuBLAS path refuses allow_splitk=False; here both non-default options mean the same).
  bool disallow_reduced_precision() const {
    return reduction != Reduction::ReducedPrecisionWithSplitK;
  }
};

inline GemmType gemm_type(DType dtype, const MathMode& mode) {
  switch (dtype) {
    case DType::Float32:
      return {CUDA_R_32F, mode.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::Float16:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F, mode.fp16};
    case DType::BFloat16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, mode.bf16};
    case DType::Float64:
      return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::Float8E4M3FN:
    case DType::Int8:
      break;  // quantized values are dequantized before a GEMM reads them
  }
  fail("codegen: no GEMM of this dtype (bug)");
}

inline void check_cublas(cublasStatus_t status, const char* op) {
  CG_CHECK(status == CUBLAS_STATUS_SUCCESS, op, ": cuBLAS failed with ",
           cublasGetStatusString(status));
}

// Test-only fault injection: with CODEGEN_TEST_FAIL_GEMM=N in the environment, the N-th
// GEMM of the process (counting from 1, across calls) throws as a cuBLAS error would,
// so tests can check what an exception mid-loop leaves behind.
inline void test_fault_point(const char* op) {
  static const long fail_at = [] {
    const char* v = std::getenv("CODEGEN_TEST_FAIL_GEMM");
    return v != nullptr ? std::atol(v) : 0L;
  }();
  if (fail_at <= 0) return;
  static std::atomic<long> count{0};
  if (++count == fail_at) fail(msg(op, ": injected fault (CODEGEN_TEST_FAIL_GEMM)"));
}

// How cuBLAS (column-major) reads the transpose of a row-major-indexed matrix of
// [rows, cols] with strides (sr, sc): if the columns are contiguous, memory holds that
// transpose with leading dimension sr (op N); if the rows are contiguous, memory holds
// the matrix itself with leading dimension sc (op T).
struct Operand {
  cublasOperation_t op;
  int64_t ld;
};

inline bool as_operand(int64_t rows, int64_t cols, int64_t sr, int64_t sc, Operand* out) {
  const int64_t r = std::max<int64_t>(rows, 1), c = std::max<int64_t>(cols, 1);
  if (sc == 1 || cols <= 1) {
    const int64_t ld = rows <= 1 ? c : sr;
    if (ld >= c) {
      *out = {CUBLAS_OP_N, ld};
      return true;
    }
  }
  if (sr == 1 || rows <= 1) {
    const int64_t ld = cols <= 1 ? r : sc;
    if (ld >= r) {
      *out = {CUBLAS_OP_T, ld};
      return true;
    }
  }
  return false;
}

// Argument layout check, once per call: every slice of a readable matrix is readable.
inline void check_matrix(const View& t, const char* op, const char* arg) {
  Operand o;
  const bool ok = t.dim == 1 ? as_operand(1, t.sizes[0], t.sizes[0], t.strides[0], &o)
                             : as_operand(t.sizes[t.dim - 2], t.sizes[t.dim - 1],
                                          t.strides[t.dim - 2], t.strides[t.dim - 1], &o);
  CG_CHECK(ok, op, ": argument ", arg, " has sizes ", t.shape(), " and strides ",
           Dims{t.strides, t.dim},
           "; cuBLAS needs its last two dims row-major or column-major (stride 1 in one, a "
           "leading dimension at least the other's size). Pass ", arg, ".contiguous()");
}

inline int to_int(int64_t v, const char* op, const char* what) {
  CG_CHECK(v <= std::numeric_limits<int>::max(), op, ": ", what, " = ", v,
           " exceeds cuBLAS's int range");
  return static_cast<int>(v);
}

// Row-major c[B?, M, N] = a[B?, M, K] @ b[B?, K, N] as cuBLAS sees it: column-major
// c^T = b^T a^T, so b is cuBLAS's first operand. A batch of row-major [M, K] slabs times
// one shared b folds into one tall GEMM of batch * M rows.
struct GemmArgs {
  int64_t rows = 0, N = 0, K = 0, ldc = 0;
  int64_t batch = 1, sa = 0, sb = 0, sc = 0;  // batch strides; 0 = shared by every batch
  Operand oa{}, ob{};
};

inline GemmArgs gemm_args(const View& c, const View& a, const View& b, const char* op) {
  GemmArgs g;
  const int64_t M = c.sizes[c.dim - 2];
  g.rows = M;
  g.N = c.sizes[c.dim - 1];
  g.K = a.sizes[a.dim - 1];
  g.ldc = M <= 1 ? g.N : c.strides[c.dim - 2];
  g.batch = c.dim == 3 ? c.sizes[0] : 1;
  g.sa = a.dim == 3 ? a.strides[0] : 0;
  g.sb = b.dim == 3 ? b.strides[0] : 0;
  g.sc = c.dim == 3 ? c.strides[0] : 0;
  const int64_t ar = a.strides[a.dim - 2], ac = a.strides[a.dim - 1];
  if (g.batch > 1 && g.sb == 0 && ac == 1 && g.sa == M * ar && g.sc == M * g.ldc) {
    g.rows = g.batch * M;
    g.batch = 1;
  }
  CG_CHECK(as_operand(g.rows, g.K, ar, ac, &g.oa), op, ": unreadable layout of a (bug)");
  CG_CHECK(as_operand(g.K, g.N, b.strides[b.dim - 2], b.strides[b.dim - 1], &g.ob), op,
           ": unreadable layout of b (bug)");
  return g;
}

// alpha or beta as cuBLAS reads it: a double for fp64 accumulation, else a float.
struct Scalar {
  float f;
  double d;
  const void* as(cublasComputeType_t compute) const {
    return compute == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&d) : &f;
  }
};

// ---- cuBLAS (the fallback) ---------------------------------------------------------

// n ones on `device` for broadcasting a bias through a rank-1 GEMM, shared read-only by
// every stream and call: a process cache per (device, dtype) that only grows (a smaller
// buffer is kept alive, since kernels queued earlier may still read it). Made ready
// with one host wait when it grows, which never happens during graph capture.
inline View ones_column(int64_t n, DType dtype, int32_t device, cudaStream_t stream,
                        const char* op) {
  static std::mutex mutex;
  static auto* cache = new std::vector<std::pair<std::pair<int32_t, int>, Buffer>>();
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& [key, buffer] : *cache) {
    if (key == std::make_pair(device, static_cast<int>(dtype)) && buffer.sizes[0] >= n) {
      return buffer;
    }
  }
  CG_CHECK(!capturing(stream, op), op,
           ": a bias this GEMM cannot fuse, or a sum of rows, needs a column of ", n,
           " ones, made outside graph capture: call the op once before capturing it");
  const int64_t rows = std::max<int64_t>(n, 1024);
  Buffer b = empty({rows}, dtype, device, op);
  check_shim(aoti_torch_aten_fill__Scalar(b.tensor.get(), 1.0), op, "filling ones");
  check_cuda(cudaStreamSynchronize(stream), op, "cudaStreamSynchronize");
  cache->push_back({{device, static_cast<int>(dtype)}, b});
  return b;
}

// c = a @ b (+ c when accumulating) through cublasGemmEx on PyTorch's handle, bound to
// the current stream (with PyTorch's workspace for it).
inline void gemm_cublas(const GemmArgs& g, const View& c, const View& a, const View& b,
                        const GemmType& type, bool accumulate, const char* op) {
  void* raw_handle = nullptr;
  CG_CHECK(torch_get_current_cuda_blas_handle(&raw_handle) == AOTI_TORCH_SUCCESS, op,
           ": getting PyTorch's cuBLAS handle failed");
  cublasHandle_t handle = static_cast<cublasHandle_t>(raw_handle);
  const Scalar alpha{1.f, 1.0}, beta{accumulate ? 1.f : 0.f, accumulate ? 1.0 : 0.0};
  const int n = to_int(g.N, op, "N"), m = to_int(g.rows, op, "M"), k = to_int(g.K, op, "K");
  const int lda = to_int(g.oa.ld, op, "lda"), ldb = to_int(g.ob.ld, op, "ldb");
  const int ldc = to_int(g.ldc, op, "ldc");
  if (type.disallow_reduced_precision()) {
    check_cublas(cublasSetMathMode(handle, static_cast<cublasMath_t>(
                                               CUBLAS_DEFAULT_MATH |
                                               CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
                 op);
  }
  cublasStatus_t status;
  if (g.batch == 1) {
    status = cublasGemmEx(handle, g.ob.op, g.oa.op, n, m, k, alpha.as(type.compute), b.data,
                          type.data, ldb, a.data, type.data, lda, beta.as(type.compute), c.data,
                          type.data, ldc, type.compute, CUBLAS_GEMM_DEFAULT);
  } else {
    status = cublasGemmStridedBatchedEx(
        handle, g.ob.op, g.oa.op, n, m, k, alpha.as(type.compute), b.data, type.data, ldb, g.sb,
        a.data, type.data, lda, g.sa, beta.as(type.compute), c.data, type.data, ldc, g.sc,
        to_int(g.batch, op, "batch"), type.compute, CUBLAS_GEMM_DEFAULT);
  }
  if (type.disallow_reduced_precision()) (void)cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);
  check_cublas(status, op);
}

// ---- the program's GEMMs ------------------------------------------------------------

// A GEMM that adds its product onto out (out += a @ b: one slice of a contraction split
// over a stream loop) instead of overwriting it.
struct Accumulate {};
inline constexpr Accumulate kAccumulate{};

// One call's GEMMs: the types and flags are read once per call. With cuBLASLt (the
// program's gemm_library, the default), each GEMM runs as one cublasLtMatmul from a
// cached plan (gemm_plan.h) with its stream's workspace (stream.h), a bias fused as its
// epilogue; otherwise (gemm_library="cublas", a stream without a workspace, graph
// capture of a shape never planned or on a stream that has no workspace yet, a bias
// cuBLASLt cannot fuse, an empty contraction) through cublasGemmEx, a bias by a rank-1
// GEMM.
class Gemms {
 public:
  Gemms(DType dtype, int32_t device, bool cublaslt, int sm_count, const char* op)
      : dtype_(dtype), device_(device), cublaslt_(cublaslt), sm_count_(sm_count), op_(op),
        type_(gemm_type(dtype, math_mode(op))) {}

  // out = epilogue(a @ b)
  void matmul(const View& out, const View& a, const View& b, const Stream& stream) {
    gemm(out, a, b, nullptr, Epilogue::None, stream);
  }
  void matmul(const View& out, const View& a, const View& b, Epilogue epilogue,
              const Stream& stream) {
    gemm(out, a, b, nullptr, epilogue, stream);
  }

  void matmul(const View& out, const View& a, const View& b, Accumulate,
              const Stream& stream) {
    gemm(out, a, b, nullptr, Epilogue::None, stream, /*accumulate=*/true);
  }

  // out = epilogue(x @ w^T (+ bias))
  void linear(const View& out, const View& x, const View& w, const Stream& stream) {
    gemm(out, x, transposed(w), nullptr, Epilogue::None, stream);
  }
  void linear(const View& out, const View& x, const View& w, Epilogue epilogue,
              const Stream& stream) {
    gemm(out, x, transposed(w), nullptr, epilogue, stream);
  }
  void linear(const View& out, const View& x, const View& w, Accumulate,
              const Stream& stream) {
    gemm(out, x, transposed(w), nullptr, Epilogue::None, stream, /*accumulate=*/true);
  }
  void linear(const View& out, const View& x, const View& w, const View& bias,
              const Stream& stream) {
    gemm(out, x, transposed(w), &bias, Epilogue::None, stream);
  }
  void linear(const View& out, const View& x, const View& w, const View& bias,
              Epilogue epilogue, const Stream& stream) {
    gemm(out, x, transposed(w), &bias, epilogue, stream);
  }

  // out = epilogue(a^T @ b), a [B?, K, M], b [B?, K, N]: the weight gradients (x^T dy,
  // dy^T x; batched, a batched matmul's db), a's transpose read in place.
  void matmul_tn(const View& out, const View& a, const View& b, const Stream& stream) {
    gemm(out, transposed(a), b, nullptr, Epilogue::None, stream);
  }
  void matmul_tn(const View& out, const View& a, const View& b, Epilogue epilogue,
                 const Stream& stream) {
    gemm(out, transposed(a), b, nullptr, epilogue, stream);
  }
  void matmul_tn(const View& out, const View& a, const View& b, Accumulate,
                 const Stream& stream) {
    gemm(out, transposed(a), b, nullptr, Epilogue::None, stream, /*accumulate=*/true);
  }

  // out = epilogue(a @ b^T), a [B?, M, K], b [B?, N, K]: a batched matmul's da.
  void matmul_nt(const View& out, const View& a, const View& b, const Stream& stream) {
    gemm(out, a, transposed(b), nullptr, Epilogue::None, stream);
  }
  void matmul_nt(const View& out, const View& a, const View& b, Epilogue epilogue,
                 const Stream& stream) {
    gemm(out, a, transposed(b), nullptr, epilogue, stream);
  }
  void matmul_nt(const View& out, const View& a, const View& b, Accumulate,
                 const Stream& stream) {
    gemm(out, a, transposed(b), nullptr, Epilogue::None, stream, /*accumulate=*/true);
  }

  // out[M, N] = the sum over the batch of a[i]^T @ b[i] (a [B, K, M], b [B, K, N]): the
  // gradient of a weight every batch shares. One GEMM over B * K rows where both fold
  // into rows (a contiguous batch), else one GEMM per batch accumulating into out.
  void matmul_tn_sum(const View& out, const View& a, const View& b, const Stream& stream) {
    tn_sum(out, a, b, stream, /*accumulate=*/false);
  }
  void matmul_tn_sum(const View& out, const View& a, const View& b, Accumulate,
                     const Stream& stream) {
    tn_sum(out, a, b, stream, /*accumulate=*/true);
  }

  // out[N] = the sum of x's rows (x [B?, M, N]: every row of every batch): a row of ones
  // times x, accumulated in fp32 (and never in TF32), as torch sums.
  void sum_rows(const View& out, const View& x, const Stream& stream) {
    View rows = x;
    if (x.dim == 3 && !fold_batch(x, &rows)) {
      for (int64_t i = 0; i < x.sizes[0]; ++i) sum_rows_2d(out, batch(x, i), i > 0, stream);
      return;
    }
    sum_rows_2d(out, rows, false, stream);
  }

 private:
  void tn_sum(const View& out, const View& a, const View& b, const Stream& stream,
              bool accumulate) {
    View fa, fb;
    if (fold_batch(a, &fa) && fold_batch(b, &fb)) {
      gemm(out, transposed(fa), fb, nullptr, Epilogue::None, stream, accumulate);
      return;
    }
    for (int64_t i = 0; i < a.sizes[0]; ++i) {  // batch 0 overwrites unless accumulating
      gemm(out, transposed(batch(a, i)), batch(b, i), nullptr, Epilogue::None, stream,
           accumulate || i > 0);
    }
  }

  // x [M, N] summed over its rows into out [N], or onto out (accumulate).
  void sum_rows_2d(const View& out, const View& x, bool accumulate, const Stream& stream) {
    const int64_t M = x.sizes[0], N = x.sizes[1];
    if (N == 0 || (M == 0 && accumulate)) return;
    if (M == 0) {
      check_cuda(cudaMemsetAsync(out.data, 0, N * out.itemsize, stream.handle), op_,
                 "cudaMemsetAsync");
      return;
    }
    test_fault_point(op_);
    View c = out;  // [1, N]
    c.dim = 2;
    c.sizes[0] = 1;
    c.sizes[1] = N;
    c.strides[1] = out.strides[0];
    c.strides[0] = N * out.strides[0];
    View ones = ones_column(M, dtype_, device_, stream.handle, op_);  // [1, M]
    ones.dim = 2;
    ones.sizes[0] = 1;
    ones.sizes[1] = M;
    ones.strides[0] = M;
    ones.strides[1] = 1;
    GemmType exact = type_;
    if (exact.compute == CUBLAS_COMPUTE_32F_FAST_TF32) exact.compute = CUBLAS_COMPUTE_32F_PEDANTIC;
    gemm_cublas(gemm_args(c, ones, x, op_), c, ones, x, exact, accumulate, op_);
  }

  // Batch i of a 3-D view: a 2-D view.
  static View batch(const View& v, int64_t i) {
    View b = v;
    b.data += i * v.strides[0] * v.itemsize;
    b.dim = 2;
    b.sizes[0] = v.sizes[1];
    b.sizes[1] = v.sizes[2];
    b.strides[0] = v.strides[1];
    b.strides[1] = v.strides[2];
    return b;
  }

  // [B, K, N] as [B * K, N] when each batch's rows follow the previous batch's (a batch
  // stride of K rows, at most one batch, or one row per batch: rows a batch stride
  // apart) and cuBLAS can read the result; otherwise the callers loop over the batch.
  static bool fold_batch(const View& v, View* out) {
    const int64_t B = v.sizes[0], K = v.sizes[1];
    if (B > 1 && K > 1 && v.strides[0] != K * v.strides[1]) return false;
    *out = batch(v, 0);
    out->sizes[0] = B * K;
    if (K == 1) out->strides[0] = v.strides[0];
    Operand readable;  // an expanded batch of single rows (stride 0) folds unreadably
    return as_operand(out->sizes[0], out->sizes[1], out->strides[0], out->strides[1],
                      &readable);
  }

  // c = epilogue(a @ b (+ bias)) for views of rank 2 or 3 (c: [B?, M, N], a: [B?, M, K],
  // b: [B?, K, N]; a rank-2 operand is shared by every batch; bias: [N]). c must be
  // row-major, which holds for the outputs codegen allocates and their slices. cuBLASLt
  // applies the epilogue to the fp32 result before rounding; every other path applies it
  // afterwards, in place, with a pointwise kernel (one rounding more).
  void gemm(const View& c, const View& a, const View& b, const View* bias, Epilogue epilogue,
            const Stream& stream, bool accumulate = false) {
    if (gemm_into(c, a, b, bias, epilogue, stream, accumulate)) return;
    if (epilogue != Epilogue::None) apply_epilogue(epilogue, dtype_, c, stream, op_);
  }

  // The GEMM; true when its epilogue ran with it (cuBLASLt), false when it is still to run.
  // Accumulating (c += a @ b; no bias, no epilogue), an empty contraction adds nothing.
  bool gemm_into(const View& c, const View& a, const View& b, const View* bias,
                 Epilogue epilogue, const Stream& stream, bool accumulate = false) {
    const char* op = op_;
    const int64_t M = c.sizes[c.dim - 2], N = c.sizes[c.dim - 1];
    const int64_t K = a.sizes[a.dim - 1];
    const int64_t batches = c.dim == 3 ? c.sizes[0] : 1;
    if (M == 0 || N == 0 || batches == 0) return true;  // an empty slice: nothing to do
    if (accumulate && K == 0) return true;
    test_fault_point(op);
    if (K == 0 && bias == nullptr) {  // a sum over nothing: zeros
      const int64_t ldc = M <= 1 ? N : c.strides[c.dim - 2];
      for (int64_t bi = 0; bi < batches; ++bi) {
        char* base = c.data + (c.dim == 3 ? bi * c.strides[0] * c.itemsize : 0);
        check_cuda(cudaMemset2DAsync(base, ldc * c.itemsize, 0, N * c.itemsize, M,
                                     stream.handle),
                   op, "cudaMemset2DAsync");
      }
      return false;
    }
    GemmArgs g;
    if (K > 0) {
      g = gemm_args(c, a, b, op);
      if (cublaslt_ && stream.workspace != nullptr && fusable(bias) &&
          gemm_lt(g, c, a, b, bias, epilogue, stream, accumulate)) {
        return true;
      }
      if (bias == nullptr) {
        gemm_cublas(g, c, a, b, type_, accumulate, op);
        return false;
      }
    }
    // The bias first, by a rank-1 GEMM (ones[M, 1] @ bias[1, N]), then the product
    // accumulates onto it.
    View col = ones_column(M, dtype_, device_, stream.handle, op);  // [B?, M, 1]
    col.dim = c.dim;
    col.sizes[col.dim - 2] = M;
    col.sizes[col.dim - 1] = 1;
    col.strides[col.dim - 2] = 1;
    col.strides[col.dim - 1] = 1;
    if (c.dim == 3) {
      col.sizes[0] = c.sizes[0];
      col.strides[0] = 0;
    }
    View row = *bias;  // [1, N]
    row.dim = 2;
    row.sizes[1] = bias->sizes[0];
    row.strides[1] = bias->strides[0];
    row.sizes[0] = 1;
    row.strides[0] = row.sizes[1];
    // Exactly: a TF32 GEMM would round the bias to 10 mantissa bits, where torch adds it
    // in fp32 (addmm's epilogue).
    GemmType exact = type_;
    if (exact.compute == CUBLAS_COMPUTE_32F_FAST_TF32) exact.compute = CUBLAS_COMPUTE_32F_PEDANTIC;
    gemm_cublas(gemm_args(c, col, row, op), c, col, row, exact, /*accumulate=*/false, op);
    if (K > 0) gemm_cublas(g, c, a, b, type_, /*accumulate=*/true, op);
    return false;
  }

  // cuBLASLt's bias epilogue reads a contiguous, 16-byte aligned vector.
  static bool fusable(const View* bias) {
    if (bias == nullptr) return true;
    return (bias->strides[0] == 1 || bias->sizes[0] <= 1) &&
           reinterpret_cast<uintptr_t>(bias->data) % 16 == 0;
  }

  // c = a @ b (+ bias) as one cublasLtMatmul from a cached plan (gemm_plan.h); false
  // where there is no plan, for cublasGemmEx to take.
  bool gemm_lt(const GemmArgs& g, const View& c, const View& a, const View& b,
               const View* bias, Epilogue epilogue, const Stream& stream, bool accumulate);

  DType dtype_;
  int32_t device_;
  bool cublaslt_;
  int sm_count_;
  const char* op_;
  GemmType type_;
};

}  // namespace codegen_rt

#include "codegen/gemm_plan.h"
