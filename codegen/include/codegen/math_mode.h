// codegen runtime: the user's matmul precision flags, as torch.matmul honours them.
//
// torch.backends.cuda.matmul.allow_tf32 and allow_{fp16,bf16}_reduced_precision_reduction
// live in at::globalContext(), which the stable ABI does not expose. They are read through
// libtorch's exported symbols, resolved once with dlsym (no ATen headers, so the build
// stays fast); a torch without them fails the call with a message instead of guessing.
#pragma once

#include <dlfcn.h>

#include <cstdint>

#include "codegen/check.h"

namespace codegen_rt {

struct MathMode {
  bool tf32 = false;          // fp32 GEMMs may use TF32 tensor cores
  bool fp16_reduced = true;   // fp16 GEMMs may reduce in reduced precision (split-K)
  bool bf16_reduced = true;   // bf16 likewise
};

namespace detail {
struct ContextSymbols {
  using GlobalContext = void* (*)();
  using BoolGetter = bool (*)(const void*);
  using ByteGetter = uint8_t (*)(const void*);  // at::CuBLASReductionOption
  GlobalContext global_context = nullptr;
  BoolGetter allow_tf32 = nullptr;
  ByteGetter allow_fp16_reduction = nullptr;
  ByteGetter allow_bf16_reduction = nullptr;

  static const ContextSymbols& get() {
    static const ContextSymbols symbols = [] {
      ContextSymbols s;
      void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
      void* scope = lib != nullptr ? lib : RTLD_DEFAULT;
      s.global_context = reinterpret_cast<GlobalContext>(dlsym(scope, "_ZN2at13globalContextEv"));
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
}  // namespace detail

// The flags now (they may change between calls; reading them costs three calls).
inline MathMode math_mode(const char* op) {
  const auto& s = detail::ContextSymbols::get();
  CG_CHECK(s.global_context && s.allow_tf32 && s.allow_fp16_reduction && s.allow_bf16_reduction,
           op, ": this torch does not export at::Context's cuBLAS precision flags that codegen "
           "reads; please report your torch version");
  const void* context = s.global_context();
  MathMode m;
  m.tf32 = s.allow_tf32(context);
  // 0 is CuBLASReductionOption::AllowReducedPrecisionWithSplitK.
  m.fp16_reduced = s.allow_fp16_reduction(context) == 0;
  m.bf16_reduced = s.allow_bf16_reduction(context) == 0;
  return m;
}

}  // namespace codegen_rt
