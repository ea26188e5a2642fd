// codegen runtime: the staging ring, the GPU memory that a program lowered with
// staging="ring" copies its host slices into (the host IR's RingSlot, ReleaseRingSlot).
//
// One ring per lease (a thread's streams on a device, stream.h), shared by every such
// program the thread calls: a block of GPU memory from PyTorch's caching allocator,
// allocated on the lease's ring stream, and the ranges of it that slices took, oldest
// first, each with the event its last reader recorded. It goes with the lease: a thread
// that takes a lease given back at another thread's exit takes its ring too, so its
// copies wait for the events of the ranges the other thread's GEMMs read. A slice takes
// the next bytes after the previous slice (wrapping to the start when they do not fit)
// and the ring stream waits for the events of the ranges it overlaps: a range is reused as soon as the one GEMM that read it has finished, not
// when the call that read it has joined. The ring stream is never forked from the
// caller's stream (its copies read only host inputs, which must be complete when the op
// is called: hostir.stage_in_ring), so the copies of the next call queue right behind
// this call's and run under its last GEMMs.
//
// Growth: a slice asks for room for `slots` slices of its size; a ring smaller than that
// (or one whose next bytes are still held in this call, which `slots` avoids) is replaced
// by a larger one. The old block goes back to the caching allocator on the ring stream
// once that stream has waited for every reader of it: at once if every range was
// released, else at the end of the call, after the join (RingCall's destructor).
//
// Eager only: a CUDA graph captured with the ring would replay copies into bytes that
// later eager calls reuse, and its ring stream would wait for events recorded outside
// the capture. RingCall refuses capture before anything is queued.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "codegen/check.h"
#include "codegen/copy.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// One call's use of the ring. Declared before the call's `Streams`, so that its
// destructor runs after their join, on every exit: a range taken but not released (an
// exception between a copy and its GEMM) is released on the caller's stream, and a
// retired block is freed once the ring stream has waited for the caller's stream.
class RingCall {
 public:
  RingCall(int32_t device, const char* op)
      : device_(device), op_(op), ring_(&thread_lease(device).ring) {
    CG_CHECK(!capturing(current_stream(device, op), op), op,
             ": this program stages host slices in the thread's staging ring "
             "(staging=\"ring\"), which runs eagerly only: under CUDA graph capture call "
             "the program lowered with staging=\"slots\"");
  }
  RingCall(const RingCall&) = delete;
  RingCall& operator=(const RingCall&) = delete;

  ~RingCall() {
    // No throwing from here (see ~Streams). The caller's stream has joined every worker.
    const cudaStream_t caller = current_stream_noexcept();
    for (RingRange& r : ring_->ranges) {
      if (!r.released) {
        (void)cudaEventRecord(r.freed, caller);
        r.released = true;
      }
    }
    if (!ring_->retired.empty() && stream_ != nullptr) {
      cudaEvent_t e = ring_->event();
      (void)cudaEventRecord(e, caller);
      (void)cudaStreamWaitEvent(stream_, e, 0);
      ring_->spare.push_back(e);
      ring_->retired.clear();  // back to the ring stream's pool, after the wait above
    }
  }

  // `like`'s shape, dense in its memory order, in the next bytes of the ring; the
  // current stream (the ring stream) first waits for their last readers. The ring grows
  // to hold at least `slots` slices of this size.
  View slot(Streams& streams, const View& like, int64_t slots) {
    stream_ = streams.current().handle;
    CG_CHECK(stream_ == streams.ring_stream().handle, op_,
             ": a ring slot is taken on the ring stream (bug)");
    int64_t bytes = like.itemsize;
    for (int d = 0; d < like.dim; ++d) bytes *= std::max<int64_t>(like.sizes[d], 0);
    bytes = std::max<int64_t>(ceil_div(bytes, kSlotAlignment), 1) * kSlotAlignment;
    Ring& r = *ring_;
    if (r.capacity < bytes * slots) grow(bytes * slots);
    for (;;) {
      const int64_t begin = r.head + bytes <= r.capacity ? r.head : 0;
      const int64_t end = begin + bytes;
      bool held = false;
      for (const RingRange& x : r.ranges) {
        held = held || (!x.released && x.begin < end && begin < x.end);
      }
      if (held) {  // this call still reads those bytes: a larger ring
        grow(r.capacity * 2);
        continue;
      }
      for (auto it = r.ranges.begin(); it != r.ranges.end();) {
        if (it->begin < end && begin < it->end) {
          check_cuda(cudaStreamWaitEvent(stream_, it->freed, 0), op_, "cudaStreamWaitEvent");
          r.spare.push_back(it->freed);
          it = r.ranges.erase(it);
        } else {
          ++it;
        }
      }
      r.ranges.push_back({begin, end, r.event(), false});
      r.head = end;
      View v = dense_like(like);
      v.data = r.buffer.data + begin;
      return v;
    }
  }

  // The bytes of `slot` are free once the current stream has run what is queued so far.
  void release(Streams& streams, const View& slot) {
    Ring& r = *ring_;
    for (auto it = r.ranges.rbegin(); it != r.ranges.rend(); ++it) {
      if (r.buffer.data + it->begin == slot.data && !it->released) {
        check_cuda(cudaEventRecord(it->freed, streams.current().handle), op_,
                   "cudaEventRecord");
        it->released = true;
        return;
      }
    }
    // Not found: the ring grew after the slot was taken; its old block is retired and
    // freed at the end of the call, after the join.
  }

 private:
  // A ring of at least `bytes`, on the ring stream (current). Released ranges are waited
  // for here; ranges this call still holds keep the old block alive (`retired`).
  void grow(int64_t bytes) {
    Ring& r = *ring_;
    bool held = false;
    for (const RingRange& x : r.ranges) {
      if (x.released) {
        check_cuda(cudaStreamWaitEvent(stream_, x.freed, 0), op_, "cudaStreamWaitEvent");
      } else {
        held = true;
      }
    }
    // Every wait queued: only now do the ranges give their events up (as slot() erases a
    // range with the move of its event). A wait that throws above leaves each event with
    // its range, none also spare, where a later range could take it while that range
    // still records it.
    r.spare.reserve(r.spare.size() + r.ranges.size());
    for (const RingRange& x : r.ranges) r.spare.push_back(x.freed);
    r.ranges.clear();
    if (held) {
      r.retired.push_back(r.buffer);
    }
    r.buffer.reset();  // back to the ring stream's pool, after the waits above
    r.capacity = r.head = 0;  // an empty ring if the allocation below throws
    const int64_t capacity = ceil_div(bytes, kSlotAlignment) * kSlotAlignment;
    r.buffer = empty({capacity / 4}, DType::Float32, device_, op_);
    r.capacity = capacity;
  }

  cudaStream_t current_stream_noexcept() const {
    void* handle = nullptr;
    (void)aoti_torch_get_current_cuda_stream(device_, &handle);
    return static_cast<cudaStream_t>(handle);
  }

  int32_t device_;
  const char* op_;
  Ring* ring_;
  cudaStream_t stream_ = nullptr;  // the ring stream, once a slot was taken
};

}  // namespace codegen_rt
