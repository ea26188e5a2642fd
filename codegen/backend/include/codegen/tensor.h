// codegen runtime: tensors as the host program sees them -- strided views that cost a
// few integer operations to slice, the checks of the op's arguments, and allocation
// through PyTorch's caching allocator.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "codegen/check.h"

namespace codegen_rt {

constexpr int kMaxDims = 3;

// A strided view of a tensor or of one stream slice of it: cheap to copy and to narrow
// (no TensorImpl, no refcount, no calls into torch).
struct View {
  char* data = nullptr;
  int dim = 0;
  int64_t itemsize = 0;
  int64_t sizes[kMaxDims] = {0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0};

  int64_t size(int d) const { return sizes[d]; }
  Dims shape() const { return {sizes, dim}; }
};

// A tensor the program owns or was given, with its view read once.
struct Buffer : View {
  torch::stable::Tensor tensor;
  int32_t device = -1;

  void reset() { tensor = torch::stable::Tensor(); data = nullptr; }
};

// Element types, as the AOTI shim numbers them. Float8E4M3FN and Int8 are quantized
// values that only pointwise kernels read (dequantize's q), never a GEMM.
enum class DType { Float32, Float16, BFloat16, Float64, Float8E4M3FN, Int8 };

inline int32_t aoti_dtype(DType t) {
  switch (t) {
    case DType::Float32: return aoti_torch_dtype_float32();
    case DType::Float16: return aoti_torch_dtype_float16();
    case DType::BFloat16: return aoti_torch_dtype_bfloat16();
    case DType::Float64: return aoti_torch_dtype_float64();
    case DType::Float8E4M3FN: return aoti_torch_dtype_float8_e4m3fn();
    case DType::Int8: return aoti_torch_dtype_int8();
  }
  return -1;
}

inline int64_t itemsize(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Float64: return 8;
    case DType::Float8E4M3FN: return 1;
    case DType::Int8: return 1;
  }
  return 0;
}

inline const char* dtype_name(int32_t code) {
  if (code == aoti_torch_dtype_float32()) return "float32";
  if (code == aoti_torch_dtype_float16()) return "float16";
  if (code == aoti_torch_dtype_bfloat16()) return "bfloat16";
  if (code == aoti_torch_dtype_float64()) return "float64";
  if (code == aoti_torch_dtype_float8_e4m3fn()) return "float8_e4m3fn";
  if (code == aoti_torch_dtype_float8_e5m2()) return "float8_e5m2";
  if (code == aoti_torch_dtype_int8()) return "int8";
  if (code == aoti_torch_dtype_uint8()) return "uint8";
  if (code == aoti_torch_dtype_int64()) return "int64";
  if (code == aoti_torch_dtype_int32()) return "int32";
  if (code == aoti_torch_dtype_bool()) return "bool";
  return "a dtype codegen does not support";
}

inline const char* device_type_name(int32_t type) {
  if (type == aoti_torch_device_type_cuda()) return "cuda";
  if (type == aoti_torch_device_type_cpu()) return "cpu";
  if (type == aoti_torch_device_type_meta()) return "meta";
  return "a non-CUDA device";
}

inline void check_shim(AOTITorchError status, const char* op, const char* what) {
  CG_CHECK(status == AOTI_TORCH_SUCCESS, op, ": ", what, " failed in torch");
}

// Checks argument `arg`'s dtype and rank (`type` spells the declared type, e.g.
// "float32[m, k]", for the message) and reads its view into `b` (device checks are the
// caller's: a GPU argument and a host argument differ there).
inline void read_argument(const torch::stable::Tensor& t, const char* op, const char* arg,
                          DType dtype, int rank, const char* type, Buffer* b) {
  AtenTensorHandle h = t.get();
  int32_t code = 0;
  check_shim(aoti_torch_get_dtype(h, &code), op, "reading a dtype");
  CG_CHECK(code == aoti_dtype(dtype), op, ": argument ", arg, " must be ",
           dtype_name(aoti_dtype(dtype)), ", got ", dtype_name(code));
  int64_t dim = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  check_shim(aoti_torch_get_dim(h, &dim), op, "reading a rank");
  check_shim(aoti_torch_get_sizes(h, &sizes), op, "reading sizes");
  check_shim(aoti_torch_get_strides(h, &strides), op, "reading strides");
  CG_CHECK(dim == rank, op, ": argument ", arg, " must have rank ", rank, " ", type,
           ", got shape ", Dims{sizes, dim});
  void* data = nullptr;
  check_shim(aoti_torch_get_data_ptr(h, &data), op, "reading a data pointer");
  b->tensor = t;
  b->data = static_cast<char*>(data);
  b->dim = rank;
  b->itemsize = itemsize(dtype);
  for (int d = 0; d < rank; ++d) {
    b->sizes[d] = sizes[d];
    b->strides[d] = strides[d];
  }
}

// Argument `arg` of op: a CUDA tensor of dtype `dtype` and rank `rank` (`type` spells
// the declared type, e.g. "float32[m, k]", for the message). Reads its view once.
inline Buffer input(const torch::stable::Tensor& t, const char* op, const char* arg,
                    DType dtype, int rank, const char* type) {
  AtenTensorHandle h = t.get();
  CG_CHECK(h != nullptr, op, ": argument ", arg, " is an undefined tensor");
  int32_t device_type = 0, device = 0;
  check_shim(aoti_torch_get_device_type(h, &device_type), op, "reading a device");
  CG_CHECK(device_type == aoti_torch_device_type_cuda(), op, ": argument ", arg,
           " must be a CUDA tensor, got a tensor on ", device_type_name(device_type));
  check_shim(aoti_torch_get_device_index(h, &device), op, "reading a device");
  Buffer b;
  read_argument(t, op, arg, dtype, rank, type, &b);
  b.device = device;
  return b;
}

inline void same_device(const Buffer& t, const char* arg, const Buffer& first,
                        const char* first_arg, const char* op) {
  CG_CHECK(t.device == first.device, op, ": argument ", arg, " is on cuda:", t.device,
           " but ", first_arg, " is on cuda:", first.device,
           "; all inputs must be on one device");
}

// A new contiguous tensor of `sizes`: allocated by `allocate(sizes, strides, handle)`
// (one of the AOTI shim's empty_strided functions), its view read once.
template <size_t N, typename Allocate>
Buffer new_contiguous(const int64_t (&sizes)[N], DType dtype, int32_t device, const char* op,
                      const char* what, Allocate allocate) {
  int64_t strides[N];
  int64_t stride = 1;
  for (size_t d = N; d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  AtenTensorHandle h = nullptr;
  check_shim(allocate(sizes, strides, &h), op, what);
  Buffer b;
  b.tensor = torch::stable::Tensor(h);
  b.device = device;
  void* data = nullptr;
  check_shim(aoti_torch_get_data_ptr(h, &data), op, "reading a data pointer");
  b.data = static_cast<char*>(data);
  b.dim = static_cast<int>(N);
  b.itemsize = itemsize(dtype);
  for (size_t d = 0; d < N; ++d) {
    b.sizes[d] = sizes[d];
    b.strides[d] = strides[d];
  }
  return b;
}

// A new contiguous tensor from PyTorch's caching allocator, on the current stream.
template <size_t N>
Buffer empty(const int64_t (&sizes)[N], DType dtype, int32_t device, const char* op) {
  return new_contiguous(sizes, dtype, device, op, "allocating an output",
                        [&](const int64_t* s, const int64_t* st, AtenTensorHandle* h) {
                          return aoti_torch_empty_strided(
                              static_cast<int64_t>(N), s, st, aoti_dtype(dtype),
                              aoti_torch_device_type_cuda(), device, h);
                        });
}

// A new contiguous tensor of zeros: allocated like `empty`, cleared on `stream` (the
// start of a sum that a loop's slices accumulate into).
template <size_t N>
Buffer zeros(const int64_t (&sizes)[N], DType dtype, int32_t device, cudaStream_t stream,
             const char* op) {
  Buffer b = empty(sizes, dtype, device, op);
  int64_t bytes = b.itemsize;
  for (size_t d = 0; d < N; ++d) bytes *= sizes[d];
  if (bytes > 0) check_cuda(cudaMemsetAsync(b.data, 0, bytes, stream), op, "cudaMemsetAsync");
  return b;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Slice `index` of `v` along `axis`: [index*chunk, min((index+1)*chunk, n)), clamped to
// n, so the last slices may be short or empty.
inline View shard(View v, int axis, int64_t index, int64_t chunk) {
  const int64_t n = v.sizes[axis];
  const int64_t start = std::min(index * chunk, n);
  v.data += start * v.strides[axis] * v.itemsize;
  v.sizes[axis] = std::min(chunk, n - start);
  return v;
}

// Axis `axis` of `v` viewed as [outer, inner] (torch.unflatten).
inline View unflatten(View v, int axis, int64_t outer, int64_t inner) {
  CG_CHECK(v.dim < kMaxDims, "codegen: unflatten of a rank-", v.dim, " view (bug)");
  for (int d = v.dim; d > axis + 1; --d) {
    v.sizes[d] = v.sizes[d - 1];
    v.strides[d] = v.strides[d - 1];
  }
  v.sizes[axis] = outer;
  v.sizes[axis + 1] = inner;
  v.strides[axis + 1] = v.strides[axis];
  v.strides[axis] = v.strides[axis] * inner;
  ++v.dim;
  return v;
}

// `v` with a size-1 axis inserted at `axis` (torch.unsqueeze): a pointwise kernel reads it
// broadcast along that axis (a per-row scale [n] against [n, k] as [n, 1]).
inline View unsqueeze(View v, int axis) {
  CG_CHECK(v.dim < kMaxDims && axis >= 0 && axis <= v.dim, "codegen: unsqueeze of a rank-",
           v.dim, " view at axis ", axis, " (bug)");
  for (int d = v.dim; d > axis; --d) {
    v.sizes[d] = v.sizes[d - 1];
    v.strides[d] = v.strides[d - 1];
  }
  v.sizes[axis] = 1;
  v.strides[axis] = 0;
  ++v.dim;
  return v;
}

// The last two dims swapped: linear's weight [n, k] read as [k, n].
inline View transposed(View v) {
  std::swap(v.sizes[v.dim - 2], v.sizes[v.dim - 1]);
  std::swap(v.strides[v.dim - 2], v.strides[v.dim - 1]);
  return v;
}

}  // namespace codegen_rt
