// codegen runtime: tensors in host memory -- the checks of a host input, pinned host
// outputs, keeping pinned host memory alive until the GPU is done with it, and the host
// wait that completes host outputs.
//
// Copies from or to pinned (page-locked) memory are asynchronous for the host and can
// overlap GEMMs; from pageable memory cudaMemcpy*Async stages the data through a driver
// buffer and returns only when the source has been read, so results are right but the
// copies cannot overlap (a warning says so, once per process) and cannot be captured in
// a CUDA graph (an error says so).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "codegen/check.h"
#include "codegen/stream.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// A host input: its view, and whether its memory is pinned.
struct HostBuffer : Buffer {
  bool pinned = false;
};

// This thread's capture mode relaxed for the object's lifetime: during a global graph
// capture (PyTorch's default), in any thread, CUDA refuses "potentially unsafe" calls
// such as pointer and event queries; the ones made under it enqueue nothing.
class RelaxedCapture {
 public:
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Pinned (page-locked, registered with CUDA) or pageable.
inline bool is_pinned(const void* data) {
  const RelaxedCapture relaxed;
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, data);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

// One flag for every program in the process, shared as the stream pool is (stream.h).
inline namespace CODEGEN_RT_ABI {
__attribute__((visibility("default"))) inline std::atomic<bool>& pageable_warned() {
  static std::atomic<bool> warned{false};
  return warned;
}
}  // namespace CODEGEN_RT_ABI

// Through TORCH_WARN's C entry point (aoti_torch_warn): c10's warning handler prints it on
// stderr; torch.ops calls do not turn it into a Python warning (tests/test_copy.py).
inline void warn_pageable_once(const char* op, const char* arg) {
  if (pageable_warned().exchange(true)) return;
  const std::string message =
      msg(op, ": argument ", arg, " is in pageable host memory, so its copies to the GPU "
          "cannot overlap the GEMMs (the results are right). Pass ", arg,
          ".pin_memory() to overlap them. (codegen warns once per process.)");
  aoti_torch_warn(op, __FILE__, static_cast<uint32_t>(__LINE__), message.c_str());
}

// Argument `arg` of op, declared in host memory (device="cpu"): a CPU tensor of dtype
// `dtype` and rank `rank` (`type` spells the declared type). Reads its view once, and
// whether it is pinned; a pageable one warns (once) and cannot be captured.
inline HostBuffer host_input(const torch::stable::Tensor& t, const char* op, const char* arg,
                             DType dtype, int rank, const char* type, int32_t device) {
  AtenTensorHandle h = t.get();
  CG_CHECK(h != nullptr, op, ": argument ", arg, " is an undefined tensor");
  int32_t device_type = 0, index = 0;
  check_shim(aoti_torch_get_device_type(h, &device_type), op, "reading a device");
  if (device_type != aoti_torch_device_type_cpu()) {
    check_shim(aoti_torch_get_device_index(h, &index), op, "reading a device");
    const std::string where = device_type == aoti_torch_device_type_cuda()
                                  ? msg("cuda:", index) : msg(device_type_name(device_type));
    fail(msg(op, ": argument ", arg, " was declared device=\"cpu\" (host memory, copied to "
             "the GPU slice by slice) but is on ", where, "; pass a CPU tensor (", arg,
             ".cpu(), pinned with .pin_memory() for overlapped copies) or declare it "
             "cg.input(..., device=\"cuda\")"));
  }
  HostBuffer b;
  read_argument(t, op, arg, dtype, rank, type, &b);
  b.device = -1;
  int64_t numel = 1;
  for (int d = 0; d < rank; ++d) numel *= b.sizes[d];
  b.pinned = numel == 0 || is_pinned(b.data);  // nothing to copy: nothing to warn about
  if (!b.pinned) {
    CG_CHECK(!capturing(current_stream(device, op), op), op, ": argument ", arg,
             " is in pageable host memory, which a CUDA graph cannot copy from; pass ", arg,
             ".pin_memory()");
    warn_pageable_once(op, arg);
  }
  return b;
}

// A program with host outputs is refused during graph capture: the op waits for its
// stream before it returns so that host outputs are complete, which a graph cannot do.
// Called with the input checks, before anything is queued (a host output may be
// allocated after earlier GEMMs were captured).
inline void refuse_capture_of_host_outputs(int32_t device, const char* op) {
  CG_CHECK(!capturing(current_stream(device, op), op), op,
           ": a program with host outputs (cg.output(..., device=\"cpu\")) cannot be captured "
           "in a CUDA graph: the op waits until its host outputs are complete. Capture a "
           "program with GPU outputs and copy them out yourself");
}

// A new contiguous tensor in pinned host memory (PyTorch's caching host allocator), for
// a host output (refused during graph capture, as above).
template <size_t N>
Buffer empty_pinned(const int64_t (&sizes)[N], DType dtype, int32_t device, const char* op) {
  refuse_capture_of_host_outputs(device, op);
  Buffer b = new_contiguous(sizes, dtype, -1, op, "allocating a pinned host output",
                            [&](const int64_t* s, const int64_t* st, AtenTensorHandle* h) {
                              return aoti_torch_empty_strided_pinned(
                                  static_cast<int64_t>(N), s, st, aoti_dtype(dtype),
                                  aoti_torch_device_type_cpu(), 0, h);
                            });
  return b;
}

// The host waits until `stream` has finished everything queued on it: host outputs are
// complete when the op returns.
inline void synchronize(const Stream& stream, const char* op) {
  check_cuda(cudaStreamSynchronize(stream.handle), op, "cudaStreamSynchronize");
}

// Pinned host tensors whose copies were queued by calls of this thread and may still be
// running, each batch with an event recorded on the caller's stream after the call.
// PyTorch's caching host allocator reuses a freed pinned block at once unless an event
// was recorded with it (ATen's own copies do that; the runtime's raw cudaMemcpyAsync
// cannot), so a caller that drops its pinned input right after the op returns could see
// the block refilled while the op still reads it. Holding a reference until the event
// has passed closes that window. Bounded: past kMaxPending batches the oldest is waited
// for. Per thread, so no lock.
class PendingHostTensors {
 public:
  static constexpr size_t kMaxPending = 64;

  static PendingHostTensors& of_thread() {
    thread_local PendingHostTensors pending;
    return pending;
  }

  // Drops the batches whose events have passed (oldest first, in order).
  void release_finished() {
    if (batches_.empty()) return;
    const RelaxedCapture relaxed;
    while (!batches_.empty()) {
      const cudaError_t status = cudaEventQuery(batches_.front().event);
      if (status == cudaErrorNotReady) return;
      if (status != cudaSuccess) (void)cudaGetLastError();  // released anyway, below
      pop_front();
    }
  }

  // Takes `tensors` only once their event is recorded: on a throw they stay with the
  // caller (HostTensors then waits for the stream before releasing them).
  void add(int32_t device, cudaStream_t stream, std::vector<torch::stable::Tensor>& tensors,
           const char* op) {
    if (batches_.size() >= kMaxPending) {
      // Relaxed: another thread's global-mode capture would refuse the wait, and the
      // batch would be released while its copies may still run.
      const RelaxedCapture relaxed;
      if (cudaEventSynchronize(batches_.front().event) != cudaSuccess) {
        (void)cudaGetLastError();  // released anyway: the event can no longer tell
      }
      pop_front();
    }
    cudaEvent_t event = take_event(device, op);
    const cudaError_t status = cudaEventRecord(event, stream);
    if (status != cudaSuccess) free_events_.emplace_back(device, event);
    check_cuda(status, op, "cudaEventRecord");
    batches_.push_back(Batch{device, event, std::move(tensors)});
  }

  ~PendingHostTensors() {
    // Thread exit: wait for what may still read the tensors, then release them. Errors
    // are ignored (at process exit the CUDA runtime may already be gone).
    for (Batch& b : batches_) (void)cudaEventSynchronize(b.event);
    for (Batch& b : batches_) (void)cudaEventDestroy(b.event);
    for (auto& [device, event] : free_events_) (void)cudaEventDestroy(event);
  }

 private:
  struct Batch {
    int32_t device;
    cudaEvent_t event;
    std::vector<torch::stable::Tensor> tensors;
  };

  // An event of `device` (the current device here), reused after its batch was released.
  cudaEvent_t take_event(int32_t device, const char* op) {
    for (size_t k = 0; k < free_events_.size(); ++k) {
      if (free_events_[k].first == device) {
        cudaEvent_t e = free_events_[k].second;
        free_events_.erase(free_events_.begin() + static_cast<std::ptrdiff_t>(k));
        return e;
      }
    }
    return new_event(op);
  }

  void pop_front() {
    free_events_.emplace_back(batches_.front().device, batches_.front().event);
    batches_.pop_front();
  }

  std::deque<Batch> batches_;
  std::vector<std::pair<int32_t, cudaEvent_t>> free_events_;
};

// The pinned host tensors of one call: declared before the call's Streams, so that on
// every exit it runs after the workers have joined the caller's stream; then it records
// an event there and keeps the tensors until that event has passed (see above). During
// graph capture nothing is kept: a captured graph reads its host inputs at every replay,
// so the caller keeps them alive as long as the graph, as for any graph input.
class HostTensors {
 public:
  HostTensors(int32_t device, const char* op) : device_(device), op_(op) {
    // No event query during capture (a global capture refuses it); the next call will.
    if (!capturing(current_stream(device, op), op)) {
      PendingHostTensors::of_thread().release_finished();
    }
  }
  HostTensors(const HostTensors&) = delete;
  HostTensors& operator=(const HostTensors&) = delete;

  void keep(const HostBuffer& b) {
    if (b.pinned) tensors_.push_back(b.tensor);
  }
  void keep(const Buffer& b) { tensors_.push_back(b.tensor); }  // a pinned output

  // The host has waited for the caller's stream after the join (the host IR's final
  // StreamSynchronize of a program with host outputs): nothing queued reads or writes the
  // tensors any more, so they are not kept. A host output then leaves the op with one
  // reference, and autograd takes it as a gradient as it is (a second reference would
  // make AccumulateGrad copy it on the CPU).
  void synchronized() { tensors_.clear(); }

  ~HostTensors() {
    if (tensors_.empty()) return;
    cudaStream_t caller = nullptr;
    try {
      caller = current_stream(device_, op_);
      if (capturing(caller, op_)) return;
      PendingHostTensors::of_thread().add(device_, caller, tensors_, op_);
    } catch (...) {
      // No throwing from a destructor. Without an event, wait for the caller's stream
      // (past the join) before the tensors are released, so no copy still reads them.
      if (!tensors_.empty() && caller != nullptr) {
        const RelaxedCapture relaxed;
        if (cudaStreamSynchronize(caller) != cudaSuccess) (void)cudaGetLastError();
      }
    }
  }

 private:
  int32_t device_;
  const char* op_;
  std::vector<torch::stable::Tensor> tensors_;
};

}  // namespace codegen_rt
