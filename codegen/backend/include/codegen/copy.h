// codegen runtime: copies between host memory and the GPU, and the staging slots that
// streamed host operands pass through.
//
// A copy moves a strided view into another of the same shape with as few cudaMemcpy
// calls as the layouts allow: a dense block is one cudaMemcpyAsync; rows of a block (a
// column block of a row-major matrix, a padded or transposed one) are one
// cudaMemcpy2DAsync; a view whose outer dim is not dense across the rows (an expanded
// or permuted batch, a broadcast column, a matrix with no stride-1 dim such as
// w[:, ::2]) takes one copy per entry of that dim -- for w[:, ::2], one 2-D copy of
// one-element rows per row: right, and slow. A view that would need more than that (a
// 3-D one strided in all three dims) is refused: check_copyable names the argument
// before anything is queued. Memcpy
// cannot transpose, so the GPU side of a copy keeps the memory order of the host side:
// a staging slot, or the GPU copy of a host input read whole, is dense in the order of
// the host tensor (a column-major host weight gives a column-major slot; the GEMMs read
// either). Everything is queued on the given stream; nothing here waits.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "codegen/check.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// The largest pitch cudaMemcpy2D accepts: it "returns an error if dpitch or spitch
// exceeds the maximum allowed" (cudaDevAttrMaxPitch, memPitch: 2^31 - 1 bytes on every
// CUDA GPU so far).
constexpr int64_t kMaxPitch = 2147483647;

// A copy as `count` blocks of `height` rows of `width` bytes each.
struct CopyShape {
  int64_t count = 0;  // 0: nothing to copy (an empty slice)
  int64_t height = 0;
  int64_t width = 0;
  int64_t src_pitch = 0, dst_pitch = 0;  // bytes from a row to the next
  int64_t src_step = 0, dst_step = 0;    // bytes from a block to the next
};

// Whether the last two dims of `v` are stored column by column (stride 1 down a column
// and more than one column); row-major otherwise, which is also the choice when either
// extent is 1 (then both orders are the same memory).
inline bool column_major(const View& v) {
  if (v.dim < 2) return false;
  const int r = v.dim - 2, c = v.dim - 1;
  return v.sizes[r] > 1 && v.sizes[c] > 1 && v.strides[c] != 1 && v.strides[r] == 1;
}

// Dense strides for `v`'s sizes: the batch dim outermost, the last two in `v`'s order.
inline void dense_strides(View& v, bool transposed) {
  int order[kMaxDims] = {0, 1, 2};  // outermost first
  if (transposed) std::swap(order[v.dim - 2], order[v.dim - 1]);
  int64_t stride = 1;
  for (int k = v.dim; k-- > 0;) {
    v.strides[order[k]] = stride;
    stride *= std::max<int64_t>(v.sizes[order[k]], 1);
  }
}

// `v` made dense in its own memory order (see the top of this file): the GPU side of a
// copy of `v` (a staging slot, the GPU copy of a host input read whole).
inline View dense_like(const View& v) {
  View d = v;
  dense_strides(d, column_major(v));
  return d;
}

// The plan of a copy from `src` to `dst` (same shape) into `*out`; false if it would need
// more than one 2-D copy per block (a 3-D view strided in all three dims, none of them
// dense across the next).
inline bool plan_copy(const View& dst, const View& src, CopyShape* out, const char* op) {
  CopyShape& c = *out;
  c = CopyShape{};
  CG_CHECK(dst.dim == src.dim && dst.itemsize == src.itemsize, op,
           ": copy between views of different ranks or dtypes (a bug in codegen)");
  struct Dim {
    int64_t size, s, d;  // elements
  };
  int order[kMaxDims] = {0, 1, 2};
  if (column_major(src)) std::swap(order[src.dim - 2], order[src.dim - 1]);
  Dim dims[kMaxDims];
  int n = 0;
  for (int k = 0; k < src.dim; ++k) {
    const int a = order[k];
    CG_CHECK(dst.sizes[a] == src.sizes[a], op, ": copy between views of shapes ", dst.shape(),
             " and ", src.shape(), " (a bug in codegen)");
    if (src.sizes[a] == 0) return true;  // count 0: nothing to copy
    if (src.sizes[a] > 1) dims[n++] = {src.sizes[a], src.strides[a], dst.strides[a]};
  }
  // Broadcast dims (stride 0: an expanded host input, or the test's copy back into it)
  // go outermost: each of their entries is a block copied again from or to the same
  // place, and the dims inside them can still merge into rows.
  std::stable_partition(dims, dims + n, [](const Dim& d) { return d.s == 0 || d.d == 0; });
  // Merge a dim into the next inner one where both views are dense across them.
  int m = 0;
  for (int k = 0; k < n; ++k) {
    if (m > 0 && dims[m - 1].s == dims[k].size * dims[k].s &&
        dims[m - 1].d == dims[k].size * dims[k].d) {
      dims[m - 1] = {dims[m - 1].size * dims[k].size, dims[k].s, dims[k].d};
    } else {
      dims[m++] = dims[k];
    }
  }
  const int64_t item = src.itemsize;
  c.width = item;
  if (m > 0 && dims[m - 1].s == 1 && dims[m - 1].d == 1) c.width = dims[--m].size * item;
  // The innermost remaining dim are the rows of a 2-D copy, unless its pitch is below
  // the row width (an expanded dim: stride 0) or above the device's maximum pitch (the
  // batch of a 3-D tensor whose matrices exceed 2 GiB), which cudaMemcpy2D refuses; then
  // it counts blocks instead, as does a dim outside the rows.
  const auto pitch_ok = [&](int64_t stride) {
    return stride * item >= c.width && stride * item <= kMaxPitch;
  };
  const bool rows = m > 0 && pitch_ok(dims[m - 1].s) && pitch_ok(dims[m - 1].d);
  if (m - (rows ? 1 : 0) > 1) {
    c = CopyShape{};
    return false;
  }
  c.count = 1;
  c.height = 1;
  c.src_pitch = c.dst_pitch = c.width;
  if (rows) {
    c.height = dims[m - 1].size;
    c.src_pitch = dims[m - 1].s * item;
    c.dst_pitch = dims[m - 1].d * item;
    --m;
  }
  if (m == 1) {
    c.count = dims[0].size;
    c.src_step = dims[0].s * item;
    c.dst_step = dims[0].d * item;
  }
  return true;
}

inline CopyShape copy_shape(const View& dst, const View& src, const char* op) {
  CopyShape c;
  CG_CHECK(plan_copy(dst, src, &c, op), op, ": copy of a view with sizes ", src.shape(),
           " and strides ", Dims{src.strides, src.dim}, " needs more than one 2-D copy per "
           "block; pass a .contiguous() tensor");
  return c;
}

// Whether copy() can move `t` into dense GPU memory in its own order (a staging slot, or
// the GPU copy of a host input read whole) with at most one 2-D copy per block.
inline bool copyable(const View& t, const char* op) {
  CopyShape c;
  return plan_copy(dense_like(t), t, &c, op);
}

// A host input is read only through its copies, not by cuBLAS, so its layout must be one
// they can move (every 2-D layout is, short of strides over 2 GiB). Checked before
// anything is queued, so that the error names the argument. Read whole (axis < 0): the
// whole tensor. Read in slices of `chunk` along `axis` (ShardByStream): every full slice
// has one shape and the last may be shorter; whether dims merge depends on their sizes,
// so both are checked (the whole tensor may pass where its slices do not, and the other
// way round).
inline void check_copyable(const View& t, const char* op, const char* arg, int axis = -1,
                           int64_t chunk = 0) {
  View shapes[2] = {t, t};  // what is copied: the whole tensor, or a full and the last slice
  int count = 1;
  if (axis >= 0) {
    const int64_t size = t.sizes[axis];
    if (size == 0 || chunk <= 0) return;  // no slice has elements: nothing is copied
    shapes[0].sizes[axis] = std::min(chunk, size);
    shapes[1].sizes[axis] = size - (size - 1) / chunk * chunk;
    count = 2;
  }
  for (int k = 0; k < count; ++k) {
    const View& v = shapes[k];
    CG_CHECK(copyable(v, op), op, ": argument ", arg, " has sizes ", t.shape(), " and strides ",
             Dims{t.strides, t.dim}, "; copying it to the GPU",
             axis < 0 ? std::string() : msg(" in slices along axis ", axis, " (sizes ",
                                            v.shape(), ")"),
             " needs at most one 2-D copy per matrix, and this layout needs one per row. "
             "Pass ", arg, ".contiguous()");
  }
}

// dst = src on `stream`; `kind` says which side is on the host.
inline void copy(const View& dst, const View& src, cudaMemcpyKind kind, const Stream& stream,
                 const char* op) {
  const CopyShape c = copy_shape(dst, src, op);
  for (int64_t b = 0; b < c.count; ++b) {
    const char* from = src.data + b * c.src_step;
    char* to = dst.data + b * c.dst_step;
    if (c.height == 1) {
      check_cuda(cudaMemcpyAsync(to, from, static_cast<size_t>(c.width), kind, stream.handle),
                 op, "cudaMemcpyAsync");
    } else {
      check_cuda(cudaMemcpy2DAsync(to, static_cast<size_t>(c.dst_pitch), from,
                                   static_cast<size_t>(c.src_pitch),
                                   static_cast<size_t>(c.width),
                                   static_cast<size_t>(c.height), kind, stream.handle),
                 op, "cudaMemcpy2DAsync");
    }
  }
}

// A new dense GPU tensor with the sizes and memory order of host tensor `like`: the GPU
// copy of a host input read whole.
inline Buffer empty_like(const View& like, DType dtype, int32_t device, const char* op) {
  const View v = dense_like(like);
  AtenTensorHandle h = nullptr;
  check_shim(aoti_torch_empty_strided(v.dim, v.sizes, v.strides, aoti_dtype(dtype),
                                      aoti_torch_device_type_cuda(), device, &h),
             op, "allocating a GPU copy of a host input");
  Buffer b;
  static_cast<View&>(b) = v;
  b.tensor = torch::stable::Tensor(h);
  b.device = device;
  void* data = nullptr;
  check_shim(aoti_torch_get_data_ptr(h, &data), op, "reading a data pointer");
  b.data = static_cast<char*>(data);
  b.itemsize = itemsize(dtype);
  return b;
}

// GPU memory for `slots` slices of a streamed host operand, one slot per worker stream
// (StagingSlot in the host IR): shape = {slots, chunk sizes...}, any rank.
// Every slot starts 256-byte aligned (as PyTorch's allocations do), so all slots of a
// loop have the alignment that keys a cached GEMM plan (gemm_plan.h) and get one plan.
struct Staging {
  Buffer buffer;            // slots * slot_stride elements, 1-D
  int64_t slot_stride = 0;  // elements from a slot to the next: a whole slice, rounded up

  void reset() { buffer.reset(); }
};

constexpr int64_t kSlotAlignment = 256;  // bytes

template <size_t N>
Staging staging(const int64_t (&shape)[N], DType dtype, int32_t device, const char* op) {
  static_assert(N >= 2, "a staging tensor is [slots, *chunk]");
  int64_t bytes = itemsize(dtype);
  for (size_t d = 1; d < N; ++d) bytes *= std::max<int64_t>(shape[d], 0);
  Staging s;
  s.slot_stride = ceil_div(bytes, kSlotAlignment) * kSlotAlignment / itemsize(dtype);
  s.buffer = empty({std::max<int64_t>(shape[0], 0) * s.slot_stride}, dtype, device, op);
  return s;
}

// Slot `k` of `stage`, viewed with the shape of `like` (a slice, maybe ragged), dense in
// like's memory order (see the top of this file).
inline View slot(const Staging& stage, int64_t k, const View& like) {
  View v = dense_like(like);
  v.data = stage.buffer.data + k * stage.slot_stride * like.itemsize;
  return v;
}

}  // namespace codegen_rt
