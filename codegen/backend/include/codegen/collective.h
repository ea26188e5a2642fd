// codegen runtime: collectives of a stream slice through torch.distributed.
//
// A slice's all-gather or reduce-scatter is posted on the slice's stream (PyTorch's
// current stream) through the dispatcher op codegen::collective, which codegen registers
// from Python (codegen/collectives.py) over torch's functional collectives
// (_c10d_functional::*_out): the process group is resolved by name when called, and with
// NCCL the collective runs on its own stream after the work already queued on the
// slice's stream. Wait makes the slice's stream wait for it (_c10d_functional::
// wait_tensor; no host block). The stable ABI cannot call _c10d_functional directly: its
// group argument has schema type Any in torch 2.14, which the stable dispatcher does not
// convert. The Python hop costs tens of microseconds per collective, small next to a
// tensor-parallel collective; a copy-engine ring (symmetric memory) would replace it.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>

#include <array>
#include <string>

#include "codegen/check.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// The storage offset of `base`, in elements.
inline int64_t base_offset(const Buffer& base) {
  int64_t offset = 0;
  check_shim(aoti_torch_get_storage_offset(base.tensor.get(), &offset), "codegen",
             "reading a storage offset");
  return offset;
}

// A tensor for a view of `base` (the dispatcher takes tensors, not views); with
// `merge_leading`, the two leading dims as one (a stack of blocks as [D * rows, ...]).
inline torch::stable::Tensor as_tensor(const Buffer& base, const View& v, const char* op,
                                       bool merge_leading = false) {
  int64_t sizes[kMaxDims], strides[kMaxDims];
  int dim = v.dim;
  for (int d = 0; d < dim; ++d) {
    sizes[d] = v.sizes[d];
    strides[d] = v.strides[d];
  }
  if (merge_leading && dim >= 2) {
    CG_CHECK(v.strides[0] == v.sizes[1] * v.strides[1], op,
             ": a stacked collective buffer is not contiguous (bug)");
    sizes[1] *= sizes[0];
    for (int d = 0; d + 1 < dim; ++d) {
      sizes[d] = sizes[d + 1];
      strides[d] = strides[d + 1];
    }
    --dim;
  }
  const int64_t offset = (v.data - base.data) / v.itemsize;
  AtenTensorHandle h = nullptr;
  check_shim(aoti_torch__reinterpret_tensor(base.tensor.get(), dim, sizes, strides,
                                            base_offset(base) + offset, &h),
             op, "viewing a slice as a tensor");
  return torch::stable::Tensor(h);
}

// The pending collective of one slice: its output, which Wait waits for.
struct Communication {
  torch::stable::Tensor output;
};

enum class Collective { AllGather, ReduceScatter };

// Posts `kind` from `input` into `output` over `group_size` ranks of group `group_name`
// on the current stream.
inline Communication post(Collective kind, const torch::stable::Tensor& input,
                          const torch::stable::Tensor& output, int64_t group_size,
                          const std::string& group_name, const char* op) {
  namespace sd = torch::stable::detail;
  std::array<StableIValue, 5> stack{
      sd::from(std::string(kind == Collective::AllGather ? "all_gather" : "reduce_scatter")),
      sd::from(input), sd::from(output), sd::from(group_size), sd::from(group_name)};
  CG_CHECK(torch_call_dispatcher("codegen::collective", "", stack.data(), TORCH_ABI_VERSION) ==
               AOTI_TORCH_SUCCESS,
           op, ": the collective failed (see the error above)");
  return {output};
}

// The current stream waits for `c` (no host block with NCCL).
inline void wait(const Communication& c, const char* op) {
  namespace sd = torch::stable::detail;
  std::array<StableIValue, 1> stack{sd::from(c.output)};
  CG_CHECK(torch_call_dispatcher("_c10d_functional::wait_tensor", "", stack.data(),
                                 TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS,
           op, ": waiting for a collective failed");
  (void)sd::to<torch::stable::Tensor>(stack[0]);  // release the returned reference
}

}  // namespace codegen_rt
