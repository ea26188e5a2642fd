// codegen runtime: the user's matmul precision flags, as torch.matmul honours them.
//
// torch.backends.cuda.matmul's fp32 precision (allow_tf32 / fp32_precision) and
// allow_{fp16,bf16}_reduced_precision_reduction live in at::globalContext(), which the
// stable ABI does not expose. They are read through libtorch's exported symbols, resolved
// once with dlsym (no ATen headers, so the build stays fast); a torch without them fails
// the call with a message instead of guessing.
#pragma once

#include <dlfcn.h>

#include <cstdint>

#include "codegen/check.h"

namespace codegen_rt {

// at::CuBLASReductionOption (ATen/Context.h, torch >= 2.10): what fp16/bf16 GEMMs may do
// when they split the reduction (split-K).
enum class Reduction : uint8_t {
  ReducedPrecisionWithSplitK = 0,  // the default: partial sums may be kept in 16 bits
  FullPrecisionWithSplitK = 1,     // allow_*_reduced_precision_reduction = False
  FullPrecisionNoSplitK = 2,       // = (False, allow_splitk=False)
};

struct MathMode {
  bool tf32 = false;  // fp32 GEMMs may use TF32 tensor cores
  Reduction fp16 = Reduction::ReducedPrecisionWithSplitK;
  Reduction bf16 = Reduction::ReducedPrecisionWithSplitK;
};

namespace detail {
struct ContextSymbols {
  using GlobalContext = void* (*)();
  using BoolGetter = bool (*)(const void*);
  using ByteGetter = uint8_t (*)(const void*);  // at::CuBLASReductionOption
  // at::Context::float32Precision(Float32Backend, Float32Op) -> Float32Precision (all
  // three plain enums, passed and returned as int).
  using PrecisionGetter = int (*)(const void*, int, int);
  GlobalContext global_context = nullptr;
  PrecisionGetter fp32_precision = nullptr;
  BoolGetter allow_tf32 = nullptr;  // the legacy getter: only when the one above is absent
  ByteGetter allow_fp16_reduction = nullptr;
  ByteGetter allow_bf16_reduction = nullptr;

  static const ContextSymbols& get() {
    static const ContextSymbols symbols = [] {
      ContextSymbols s;
      void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
      void* scope = lib != nullptr ? lib : RTLD_DEFAULT;
      s.global_context = reinterpret_cast<GlobalContext>(dlsym(scope, "_ZN2at13globalContextEv"));
      s.fp32_precision = reinterpret_cast<PrecisionGetter>(
          dlsym(scope, "_ZNK2at7Context16float32PrecisionENS_14Float32BackendENS_9Float32OpE"));
      s.allow_tf32 = reinterpret_cast<BoolGetter>(
          dlsym(scope, "_ZNK2at7Context15allowTF32CuBLASEv"));
      s.allow_fp16_reduction = reinterpret_cast<ByteGetter>(
          dlsym(scope, "_ZNK2at7Context24allowFP16ReductionCuBLASEv"));
      s.allow_bf16_reduction = reinterpret_cast<ByteGetter>(
          dlsym(scope, "_ZNK2at7Context24allowBF16ReductionCuBLASEv"));
      return s;
    }();
    return symbols;
  }
};

inline Reduction reduction(uint8_t option) {
  return option <= 2 ? static_cast<Reduction>(option) : Reduction::FullPrecisionNoSplitK;
}
}  // namespace detail

// The flags now (they may change between calls; reading them costs three calls).
inline MathMode math_mode(const char* op) {
  const auto& s = detail::ContextSymbols::get();
  CG_CHECK(s.global_context && (s.fp32_precision || s.allow_tf32) && s.allow_fp16_reduction &&
               s.allow_bf16_reduction,
           op, ": this torch does not export at::Context's cuBLAS precision flags that codegen "
           "reads; please report your torch version");
  const void* context = s.global_context();
  MathMode m;
  // What torch's own CUDA matmul reads (CUDABlas.cpp, CublasHandlePool.cpp):
  // float32Precision(CUDA, MATMUL) == TF32. allowTF32CuBLAS() throws when the legacy and
  // the new API were both used (e.g. fp32_precision = "tf32" alone), where torch.matmul
  // runs. Enum values from ATen/Context.h: Float32Backend::CUDA = 1, Float32Op::MATMUL = 3,
  // Float32Precision::TF32 = 2.
  m.tf32 = s.fp32_precision ? s.fp32_precision(context, 1, 3) == 2 : s.allow_tf32(context);
  m.fp16 = detail::reduction(s.allow_fp16_reduction(context));
  m.bf16 = detail::reduction(s.allow_bf16_reduction(context));
  return m;
}

}  // namespace codegen_rt
