// codegen runtime: cuBLASLt plans -- the matmul descriptor, the matrix layouts and the
// heuristic's algorithm for one GEMM shape -- made once and cached for the process.
//
// A plan is keyed by everything cuBLASLt's choice depends on: device, types, flags,
// transposes, sizes, leading dimensions, batch and batch strides, epilogue, pointer
// alignments and SM budget; the slices of a loop share one plan (a ragged last slice has
// its own). The heuristic is never queried during graph capture: a shape first seen
// while capturing runs through cublasGemmEx. The cache is thread-safe and bounded: past
// kMaxPlans shapes, new shapes run through cublasGemmEx instead of growing it.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "codegen/gemm.h"

namespace codegen_rt {

struct PlanKey {
  int32_t device = 0;
  int data = 0, compute = 0, reduction = 0, epilogue = 0, sm_count = 0;
  int transa = 0, transb = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
  int align_a = 0, align_b = 0, align_c = 0, align_bias = 0;

  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull; };
    for (int64_t v : {int64_t{k.device}, int64_t{k.data}, int64_t{k.compute},
                      int64_t{k.reduction}, int64_t{k.epilogue}, int64_t{k.sm_count},
                      int64_t{k.transa}, int64_t{k.transb}, k.m, k.n, k.k, k.lda, k.ldb, k.ldc,
                      k.batch, k.stride_a, k.stride_b, k.stride_c, int64_t{k.align_a},
                      int64_t{k.align_b}, int64_t{k.align_c}, int64_t{k.align_bias}}) {
      mix(v);
    }
    return static_cast<size_t>(h);
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;   // the heuristic found an algorithm
  std::mutex bias_mutex;  // the bias pointer is set on `desc` per call

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

// The split-K reduction schemes cuBLASLt may use, as torch's bgemm_internal_cublaslt
// allows them: INPLACE and OUTPUT_TYPE add partial sums in the output's 16-bit type, so a
// full-precision reduction keeps only COMPUTE_TYPE (partials in fp32), or no split at all.
inline uint32_t reduction_scheme_mask(Reduction r) {
  switch (r) {
    case Reduction::ReducedPrecisionWithSplitK: return CUBLASLT_REDUCTION_SCHEME_MASK;
    case Reduction::FullPrecisionWithSplitK:
      return CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE;
    case Reduction::FullPrecisionNoSplitK: return CUBLASLT_REDUCTION_SCHEME_NONE;
  }
  return CUBLASLT_REDUCTION_SCHEME_NONE;
}

// The largest power of two up to 256 that divides a pointer's address.
inline int alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

// Bytes of cuBLASLt workspace per worker stream: CODEGEN_CUBLASLT_WORKSPACE_MIB, default
// 32 (cuBLAS's own default on Hopper).
inline size_t workspace_bytes() {
  static const size_t bytes = [] {
    const char* v = std::getenv("CODEGEN_CUBLASLT_WORKSPACE_MIB");
    const long mib = v != nullptr ? std::atol(v) : 32L;
    return static_cast<size_t>(mib > 0 ? mib : 0) << 20;
  }();
  return bytes;
}

class PlanCache {
 public:
  static constexpr size_t kMaxPlans = 4096;

  static PlanCache& get() {
    static PlanCache* cache = new PlanCache();  // outlives every thread that uses it
    return *cache;
  }

  // The plan of `key`: cached, or made now unless `may_query` is false (graph capture);
  // nullptr when there is none and none may be made. `bias` is this call's bias vector
  // (with the epilogue): the heuristic reads its alignment from the pointer.
  Plan* find(const PlanKey& key, cublasLtHandle_t handle, size_t workspace, const void* bias,
             bool may_query, const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second.get();
    if (!may_query || plans_.size() >= kMaxPlans) return nullptr;
    auto plan = make(key, handle, workspace, bias, op);
    Plan* p = plan.get();
    plans_.emplace(key, std::move(plan));
    return p;
  }

 private:
  static void check(cublasStatus_t status, const char* op, const char* what) {
    CG_CHECK(status == CUBLAS_STATUS_SUCCESS, op, ": ", what, " failed with ",
             cublasGetStatusString(status));
  }

  static std::unique_ptr<Plan> make(const PlanKey& key, cublasLtHandle_t handle,
                                    size_t workspace, const void* bias, const char* op) {
    auto plan = std::make_unique<Plan>();
    const auto data = static_cast<cudaDataType_t>(key.data);
    const auto compute = static_cast<cublasComputeType_t>(key.compute);
    const cudaDataType_t scale = compute == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F;
    check(cublasLtMatmulDescCreate(&plan->desc, compute, scale), op, "cublasLtMatmulDescCreate");
    const auto transa = static_cast<cublasOperation_t>(key.transa);
    const auto transb = static_cast<cublasOperation_t>(key.transb);
    check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                         sizeof transa), op, "setting TRANSA");
    check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                         sizeof transb), op, "setting TRANSB");
    if (key.epilogue != 0) {
      const auto epilogue = static_cast<cublasLtEpilogue_t>(key.epilogue);
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                           sizeof epilogue), op, "setting EPILOGUE");
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                           &data, sizeof data), op, "setting BIAS_DATA_TYPE");
      // "Routines that don't dereference this pointer, like cublasLtMatmulAlgoGetHeuristic()
      // depend on its value to determine expected pointer alignment" (cublasLt.h): left
      // NULL, the heuristic would assume 256-byte alignment; the key holds align_bias.
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof bias), op, "setting BIAS_POINTER");
    }
    if (key.sm_count > 0) {
      const int32_t sms = key.sm_count;
      check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                                           &sms, sizeof sms), op, "setting SM_COUNT_TARGET");
    }
    // Column-major A (k-by-m when not transposed... as stored), B, C.
    const uint64_t a_rows = transa == CUBLAS_OP_N ? key.m : key.k;
    const uint64_t a_cols = transa == CUBLAS_OP_N ? key.k : key.m;
    const uint64_t b_rows = transb == CUBLAS_OP_N ? key.k : key.n;
    const uint64_t b_cols = transb == CUBLAS_OP_N ? key.n : key.k;
    check(cublasLtMatrixLayoutCreate(&plan->a, data, a_rows, a_cols, key.lda), op, "layout A");
    check(cublasLtMatrixLayoutCreate(&plan->b, data, b_rows, b_cols, key.ldb), op, "layout B");
    check(cublasLtMatrixLayoutCreate(&plan->c, data, key.m, key.n, key.ldc), op, "layout C");
    if (key.batch > 1) {
      const int32_t count = static_cast<int32_t>(key.batch);
      const int64_t strides[3] = {key.stride_a, key.stride_b, key.stride_c};
      cublasLtMatrixLayout_t layouts[3] = {plan->a, plan->b, plan->c};
      for (int i = 0; i < 3; ++i) {
        check(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                               &count, sizeof count), op, "batch count");
        check(cublasLtMatrixLayoutSetAttribute(layouts[i],
                                               CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                               &strides[i], sizeof strides[i]), op,
              "batch stride");
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), op, "cublasLtMatmulPreferenceCreate");
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, cublasStatus_t (*)(
        cublasLtMatmulPreference_t)> pref_guard(pref, cublasLtMatmulPreferenceDestroy);
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &workspace, sizeof workspace), op, "workspace");
    if (key.reduction != 0) {
      const uint32_t mask = reduction_scheme_mask(static_cast<Reduction>(key.reduction));
      check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                 &mask, sizeof mask), op, "reduction mask");
    }
    const uint32_t aligns[3] = {static_cast<uint32_t>(key.align_a),
                                static_cast<uint32_t>(key.align_b),
                                static_cast<uint32_t>(key.align_c)};
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      const uint32_t value = aligns[i < 3 ? i : 2];
      check(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &value, sizeof value), op,
            "alignment");
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
    plan->usable = status == CUBLAS_STATUS_SUCCESS && found > 0;
    if (plan->usable) plan->algo = result.algo;
    return plan;
  }

  std::mutex mutex_;
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans_;
};

// PyTorch's cuBLAS handle of this thread and device (on CUDA it is a cuBLASLt handle);
// asked for once per thread and device: PyTorch keeps it for the thread's lifetime.
inline cublasLtHandle_t lt_handle(int32_t device, const char* op) {
  thread_local std::vector<void*> handles;
  if (static_cast<size_t>(device) >= handles.size()) handles.resize(device + 1, nullptr);
  void*& h = handles[static_cast<size_t>(device)];
  if (h == nullptr) {
    CG_CHECK(torch_get_current_cuda_blas_handle(&h) == AOTI_TORCH_SUCCESS, op,
             ": getting PyTorch's cuBLAS handle failed");
  }
  return static_cast<cublasLtHandle_t>(h);
}

// cuBLASLt's epilogue for an activation and a bias (0: none).
inline int lt_epilogue(Epilogue epilogue, bool bias) {
  switch (epilogue) {
    case Epilogue::None: return bias ? CUBLASLT_EPILOGUE_BIAS : 0;
    case Epilogue::Relu: return bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case Epilogue::GeluTanh: return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  }
  return 0;
}

// c = epilogue(a @ b (+ bias)), or c += a @ b (beta 1), as one cublasLtMatmul on `stream`
// with its workspace. In cuBLASLt's terms (column-major D = op(A) op(B) + bias): A is b,
// B is a, D is c^T, bias has one value per row of D. False when there is no plan (graph capture of a new shape, the
// cache full, no algorithm, an operand shared by every batch): cublasGemmEx then runs it.
inline bool Gemms::gemm_lt(const GemmArgs& g, const View& c, const View& a, const View& b,
                           const View* bias, Epilogue epilogue, const Stream& stream,
                           bool accumulate) {
  const char* op = op_;
  if (g.batch > 1 && (g.sa == 0 || g.sb == 0)) return false;
  Workspace& ws = *stream.workspace;
  if (!ws.ready) {
    if (capturing(stream.handle, op)) return false;  // no allocation during capture
    const int64_t size = static_cast<int64_t>(workspace_bytes());
    if (size > 0) {
      // Allocated while `stream` is PyTorch's current stream: the block belongs to it.
      const int64_t sizes[1] = {size}, strides[1] = {1};
      AtenTensorHandle h = nullptr;
      check_shim(aoti_torch_empty_strided(1, sizes, strides, aoti_torch_dtype_uint8(),
                                          aoti_torch_device_type_cuda(), device_, &h),
                 op, "allocating a cuBLASLt workspace");
      ws.tensor = torch::stable::Tensor(h);
      check_shim(aoti_torch_get_data_ptr(h, &ws.data), op, "reading a data pointer");
      ws.size = static_cast<size_t>(size);
    }
    ws.ready = true;
  }
  PlanKey key;
  key.device = device_;
  key.data = type_.data;
  key.compute = type_.compute;
  key.reduction = static_cast<int>(type_.reduction);
  key.epilogue = lt_epilogue(epilogue, bias != nullptr);
  key.sm_count = sm_count_;
  key.transa = g.ob.op;  // cuBLASLt's A is b
  key.transb = g.oa.op;
  key.m = to_int(g.N, op, "N"), key.n = to_int(g.rows, op, "M"), key.k = to_int(g.K, op, "K");
  key.lda = g.ob.ld, key.ldb = g.oa.ld, key.ldc = g.ldc;
  key.batch = g.batch, key.stride_a = g.sb, key.stride_b = g.sa, key.stride_c = g.sc;
  key.align_a = alignment(b.data), key.align_b = alignment(a.data);
  key.align_c = alignment(c.data);
  key.align_bias = bias != nullptr ? alignment(bias->data) : 0;
  thread_local PlanKey last_key;
  thread_local Plan* last_plan = nullptr;
  Plan* plan = last_plan;
  if (plan == nullptr || !(key == last_key)) {
    plan = PlanCache::get().find(key, lt_handle(device_, op), ws.size,
                                 bias != nullptr ? bias->data : nullptr,
                                 /*may_query=*/!capturing(stream.handle, op), op);
    if (plan == nullptr) return false;
    last_key = key;
    last_plan = plan;
  }
  if (!plan->usable) return false;
  const Scalar alpha{1.f, 1.0}, beta{accumulate ? 1.f : 0.f, accumulate ? 1.0 : 0.0};
  std::unique_lock<std::mutex> lock;  // the bias pointer is set on the shared descriptor
  if (bias != nullptr) {
    lock = std::unique_lock<std::mutex>(plan->bias_mutex);
    const void* pointer = bias->data;
    check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &pointer, sizeof pointer), op);
  }
  const cublasStatus_t status = cublasLtMatmul(
      lt_handle(device_, op), plan->desc, alpha.as(type_.compute), b.data, plan->a, a.data,
      plan->b, beta.as(type_.compute), c.data, plan->c, c.data, plan->c, &plan->algo, ws.data,
      ws.size, stream.handle);
  check_cublas(status, op);
  return true;
}

}  // namespace codegen_rt
