// codegen runtime: the activation a GEMM applies to its result (the host IR's
// `Relu(Linear(...))`, `Gelu(Linear(...), approximate=tanh)`): in cuBLASLt's epilogue
// where the GEMM runs through cuBLASLt, otherwise by a pointwise kernel over the result,
// in place, right after the GEMM on the same stream.
#pragma once

#include <string>

#include "codegen/check.h"
#include "codegen/pointwise.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

namespace codegen_rt {

enum class Epilogue { None, Relu, GeluTanh };

// The kernel that applies `epilogue` to a tensor of `dtype` (its C expression as the code
// generator writes it for the same op), built once per process.
inline const PointwiseKernel& epilogue_kernel(Epilogue epilogue, DType dtype, const char* op) {
  static const auto* kernels = [] {
    static const char* const names[] = {"relu", "gelu_tanh"};
    static const char* const types[] = {"float", "f16", "bf16", "double"};  // DType order
    auto* sources = new std::string[2][4];
    auto* table = new PointwiseKernel[2][4];
    for (int e = 0; e < 2; ++e) {
      for (int t = 0; t < 4; ++t) {
        const std::string type = types[t];
        const std::string compute = t == 3 ? "double" : "float";
        sources[e][t] = "using out_t = " + type + ";\nusing in0_t = " + type +
                        ";\nusing compute_t = " + compute +
                        ";\n__device__ __forceinline__ compute_t expr(compute_t x0) { return " +
                        names[e] + "(x0); }\n";
        table[e][t] = PointwiseKernel{names[e], sources[e][t].c_str(), 1};
      }
    }
    return table;
  }();
  CG_CHECK(epilogue != Epilogue::None, op, ": no epilogue kernel for Epilogue::None (bug)");
  return kernels[epilogue == Epilogue::Relu ? 0 : 1][static_cast<int>(dtype)];
}

// c = epilogue(c), queued on `stream`.
inline void apply_epilogue(Epilogue epilogue, DType dtype, const View& c, const Stream& stream,
                           const char* op) {
  pointwise(epilogue_kernel(epilogue, dtype, op), c, {c}, stream, op);
}

}  // namespace codegen_rt
