// codegen runtime: the caller's stream, worker streams, and the events between them.
//
// Worker streams come from a process-wide pool that LEASES them to threads: a thread
// takes a lease on its first call on a device and gives it back when the thread exits,
// so two live threads never share a worker stream (a graph capture in one thread can
// not record another thread's GEMMs), and short-lived threads reuse the streams and
// events of threads that ended: the pool never grows past the number of threads alive
// at once, and nothing is created per call. (PyTorch's own pool hands out its 32
// streams round-robin, so a ninth thread would share the first thread's streams.)
//
// What a lease holds at most: 2 * kMaxWorkers + 1 streams (positions 0 .. pool - 1 are the
// workers of a pool of up to kMaxWorkers, lower()'s pool_size limit; position `pool` is
// a program's copy stream, or positions pool .. 2 * pool - 1 the second set of workers
// of a loop whose copies run under the loop before it; position kRingStream the staging
// ring's, ring.h), each created on first use with one event and,
// from its first cuBLASLt GEMM, one workspace (gemm_plan.h: 32 MiB by default); plus
// one event and up to kCallerWorkspaces workspaces for the caller's streams, and the
// staging ring of the programs lowered with staging="ring" (ring.h). None of it
// is freed: a lease is given back to the pool when its thread exits and reused whole by
// the next thread that takes one on that device, so the process keeps, per device, at
// most one lease per thread alive at once, each of at most that size.
//
// `Streams` is the host program's view of them, one per call: it remembers the caller's
// stream, makes streams current for PyTorch (allocations, cuBLAS workspaces), and on
// every exit -- a return or an exception thrown mid-loop -- makes the caller's stream
// wait for every worker that got work since it last waited, then makes the caller's
// stream current again. Without that join, an exception would let the caller's stream
// free outputs and intermediates while worker GEMMs still write them.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "codegen/check.h"
#include "codegen/tensor.h"

namespace codegen_rt {

// Scratch memory of one stream (cuBLASLt's workspace), from PyTorch's caching allocator,
// used only on that stream by this thread's eager calls. Allocated on the stream's first
// cuBLASLt GEMM, never during graph capture: a GEMM captured on a stream with no
// workspace yet takes cublasGemmEx (torch.cuda.graph captures on its own stream, so a
// one-stream loop captured there does). A captured graph keeps the workspaces its GEMMs
// used: replay it ordered with this thread's eager calls (on their stream, or after a
// synchronize), as for any graph that shares memory with eager work.
struct Workspace {
  torch::stable::Tensor tensor;
  void* data = nullptr;
  size_t size = 0;
  bool ready = false;  // allocated (never during graph capture)
};

// A stream and the reusable event used to wait for it (no timing; recorded, then
// waited on right away, so one event per stream suffices).
struct Stream {
  cudaStream_t handle = nullptr;
  cudaEvent_t event = nullptr;
  int64_t worker = -1;  // index in the lease, or -1 for the caller's stream
  Workspace* workspace = nullptr;  // its own (Lease), or none: GEMMs then take cublasGemmEx
};

// The most worker streams of a pool (the Python side's lowering.MAX_POOL_SIZE); the copy
// stream is position `pool` and a second set of workers positions pool .. 2 * pool - 1,
// so a lease has at most 2 * kMaxWorkers streams, and the ring stream.
inline constexpr int64_t kMaxWorkers = 32;
// The lease position of the stream that queues the copies into the staging ring (ring.h;
// the host IR's RingStream, hostir.RING_POSITION): after every other stream of the lease.
inline constexpr int64_t kRingStream = 2 * kMaxWorkers;

// A new event for ordering streams (no timing).
inline cudaEvent_t new_event(const char* op) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op, "creating an event");
  return e;
}

// Bytes [begin, end) of the ring, held by a slice until its reader's event fires.
struct RingRange {
  int64_t begin = 0, end = 0;
  cudaEvent_t freed = nullptr;  // recorded by release(); the next user of the bytes waits
  bool released = false;
};

// The staging ring of a lease (ring.h): its memory, the ranges slices hold, their events.
struct Ring {
  Buffer buffer;  // float32 [capacity / 4], 256-byte aligned (the caching allocator's)
  int64_t capacity = 0;  // bytes
  int64_t head = 0;      // where the next slice starts, if it fits before the end
  std::deque<RingRange> ranges;   // taken, oldest first
  std::vector<cudaEvent_t> spare;  // events of ranges whose bytes were taken again
  std::vector<Buffer> retired;     // replaced blocks that ranges of this call still read

  cudaEvent_t event() {
    if (!spare.empty()) {
      cudaEvent_t e = spare.back();
      spare.pop_back();
      return e;
    }
    return new_event("codegen");
  }
};

// The streams one thread uses on one device.
struct Lease {
  int32_t device = 0;
  cudaEvent_t caller_event = nullptr;
  // By position; a position not used yet holds a placeholder (no handle), so a thread
  // that takes only a few workers and the ring stream creates only those.
  std::vector<Stream> workers;
  std::vector<std::unique_ptr<Workspace>> workspaces;  // by position, as `workers`
  // The caller's streams' workspaces, by stream (the GEMMs of a loop that runs on the
  // caller's stream, or outside loops, use them). A thread that calls from more streams
  // than kCallerWorkspaces gets none for the others: their GEMMs take cublasGemmEx. Slots
  // are never freed: PyTorch's streams live as long as the process, but an external
  // stream destroyed while its work runs, whose handle a new stream then gets, would
  // hand that work's workspace to the new stream's GEMMs.
  static constexpr size_t kCallerWorkspaces = 4;
  // Events for the host IR's CreateEvents, handed out anew to each call (Streams::events)
  // and reused by the thread's next call: as many as one call of the thread used at most.
  std::vector<cudaEvent_t> events;

  cudaEvent_t event(size_t k) {
    while (events.size() <= k) events.push_back(new_event("codegen"));
    return events[k];
  }
  std::vector<std::pair<cudaStream_t, std::unique_ptr<Workspace>>> caller_workspaces;
  // The staging ring (ring.h) of the programs lowered with staging="ring": its block of
  // GPU memory, allocated on stream kRingStream, and the events of its ranges.
  Ring ring;

  Workspace* caller_workspace(cudaStream_t stream) {
    for (auto& [handle, workspace] : caller_workspaces) {
      if (handle == stream) return workspace.get();
    }
    if (caller_workspaces.size() >= kCallerWorkspaces) return nullptr;
    caller_workspaces.emplace_back(stream, std::make_unique<Workspace>());
    return caller_workspaces.back().second.get();
  }

  // Stream `k` of the lease, created (with its event) on first use: 0 <= k < 2 kMaxWorkers,
  // or kRingStream.
  Stream& worker(int64_t k) {
    CG_CHECK(k >= 0 && k <= kRingStream, "codegen: worker stream ", k,
             " is out of range: a lease holds streams 0 to ", 2 * kMaxWorkers - 1, " (",
             kMaxWorkers, " workers and a second set, or the copy stream; lower() refuses "
             "pool_size > ", kMaxWorkers, ") and the ring stream, ", kRingStream);
    const auto at = static_cast<size_t>(k);
    if (workers.size() <= at) {
      workers.resize(at + 1);
      workspaces.resize(at + 1);
    }
    Stream& s = workers[at];
    // Each part kept as soon as it exists: a creation that throws leaves the others for
    // the next use, which creates only what is still missing.
    if (!workspaces[at]) workspaces[at] = std::make_unique<Workspace>();
    s.workspace = workspaces[at].get();
    if (s.handle == nullptr) {
      cudaStream_t handle = nullptr;
      check_cuda(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking), "codegen",
                 "creating a worker stream");
      s.handle = handle;
    }
    if (s.event == nullptr) s.event = new_event("codegen");
    s.worker = k;
    return s;
  }
};

// Leases not held by a live thread, per device. Never destroyed (it must outlive the
// thread-local holders that give leases back at exit), bounded by the number of threads
// alive at once.
class LeasePool {
 public:
  static LeasePool& get();

  std::unique_ptr<Lease> take(int32_t device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_for(device);
      if (!free.empty()) {
        std::unique_ptr<Lease> lease = std::move(free.back());
        free.pop_back();
        return lease;
      }
    }
    auto lease = std::make_unique<Lease>();
    lease->device = device;
    lease->caller_event = new_event("codegen");
    return lease;
  }

  void give_back(std::unique_ptr<Lease> lease) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_for(lease->device).push_back(std::move(lease));
  }

 private:
  std::vector<std::unique_ptr<Lease>>& free_for(int32_t device) {
    if (static_cast<size_t>(device) >= free_.size()) free_.resize(device + 1);
    return free_[static_cast<size_t>(device)];
  }
  std::mutex mutex_;
  std::vector<std::vector<std::unique_ptr<Lease>>> free_;
};

// One pool, and one lease per thread, for every program in the process built from these
// headers: each program is its own library with hidden symbols, but a default-visibility
// inline function's static (thread_local too) is a GNU unique symbol, which the dynamic
// linker binds to one object across libraries loaded RTLD_LOCAL. (Per-program pools
// would give each program its own worker streams, and PyTorch a cuBLAS workspace per
// stream.) The names carry CODEGEN_RT_ABI, a hash of the runtime headers set by the
// build, so programs built from other headers never share these objects' layouts.
#ifndef CODEGEN_RT_ABI
#define CODEGEN_RT_ABI unversioned
#endif
inline namespace CODEGEN_RT_ABI {

__attribute__((visibility("default"))) inline LeasePool& lease_pool() {
  static LeasePool* pool = new LeasePool();  // outlives the thread-local holders
  return *pool;
}

}  // namespace CODEGEN_RT_ABI

inline LeasePool& LeasePool::get() { return lease_pool(); }

inline namespace CODEGEN_RT_ABI {

// This thread's lease on `device`, returned to the pool when the thread exits.
__attribute__((visibility("default"))) inline Lease& thread_lease(int32_t device) {
  struct Held {
    std::vector<std::unique_ptr<Lease>> by_device;
    ~Held() {
      for (auto& lease : by_device) {
        if (lease) LeasePool::get().give_back(std::move(lease));
      }
    }
  };
  thread_local Held held;
  if (static_cast<size_t>(device) >= held.by_device.size()) held.by_device.resize(device + 1);
  auto& lease = held.by_device[static_cast<size_t>(device)];
  if (!lease) lease = LeasePool::get().take(device);
  return *lease;
}

}  // namespace CODEGEN_RT_ABI

// PyTorch's current stream on `device`.
inline cudaStream_t current_stream(int32_t device, const char* op) {
  void* handle = nullptr;
  CG_CHECK(aoti_torch_get_current_cuda_stream(device, &handle) == AOTI_TORCH_SUCCESS, op,
           ": getting the current CUDA stream failed");
  return static_cast<cudaStream_t>(handle);
}

// Whether `stream` is being captured into a CUDA graph.
inline bool capturing(cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), op, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

inline void set_torch_stream(cudaStream_t stream, int32_t device) {
  CG_CHECK(torch_set_current_cuda_stream(stream, device) == AOTI_TORCH_SUCCESS,
           "codegen: setting the current CUDA stream failed");
}

// The tensor a program value owns (a Buffer, or a Staging's buffer).
template <typename T>
const torch::stable::Tensor& tensor_of(const T& t) {
  if constexpr (requires { t.tensor; }) {
    return t.tensor;
  } else {
    return t.buffer.tensor;
  }
}

// A call's array of events (the host IR's CreateEvents): `recorded.size()` events of the
// thread's lease from `base` on, none recorded yet in this call.
struct Events {
  size_t base = 0;
  std::vector<char> recorded;
};

// One call's streams: see the comment at the top of this file.
class Streams {
 public:
  // `caller_gemms`: the program runs GEMMs on the caller's stream (a one-stream loop, or
  // a GEMM outside loops); only then does the call claim a workspace for that stream.
  explicit Streams(int32_t device, bool caller_gemms = false)
      : device_(device), lease_(&thread_lease(device)) {
    const cudaStream_t caller = current_stream(device, "codegen");
    caller_ = {caller, lease_->caller_event, -1,
               caller_gemms ? lease_->caller_workspace(caller) : nullptr};
    current_ = caller_;
  }
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;

  ~Streams() {
    // No throwing from here: on an error path the first error is the one to report.
    // `kept_` is released after the join below (members are destroyed after this body).
    for (size_t k = 0; k < dirty_.size(); ++k) {
      if (!dirty_[k]) continue;
      const Stream& w = lease_->workers[k];
      (void)cudaEventRecord(w.event, w.handle);
      (void)cudaStreamWaitEvent(caller_.handle, w.event, 0);
    }
    if (current_.handle != caller_.handle) {
      (void)torch_set_current_cuda_stream(caller_.handle, device_);
    }
  }

  // Keeps `t`'s tensor alive until the workers have joined the caller's stream, on every
  // exit: a tensor the program allocated goes back to the caching allocator (on the
  // caller's stream) only after the join is queued, so no other thread's allocation on
  // that stream can reuse memory that worker GEMMs may still write after an exception.
  template <typename T>
  T keep(T t) {
    kept_.push_back(tensor_of(t));
    return t;
  }

  // The host program's Deallocate: `t` gives its memory back to the caching allocator now
  // (on the caller's stream, where it was allocated) when the caller's stream is current.
  // The host IR frees a tensor only where every stream that used it is ordered before the
  // caller's stream (after the join of its loop; codegen.races checks it), while other
  // streams may still run work that does not touch it (a loop's copies running ahead, the
  // copy stream): waiting for every worker here would keep such tensors to the exit.
  // Anywhere else (never in the host IR's programs) the memory stays kept until the exit.
  template <typename T>
  void release(T& t) {
    if (current_.handle == caller_.handle) {
      const AtenTensorHandle handle = tensor_of(t).get();
      for (size_t k = 0; k < kept_.size(); ++k) {
        if (kept_[k].get() == handle) {
          kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(k));
          break;
        }
      }
    }
    t.reset();
  }

  // `count` events, none recorded in this call (the lease's, reused call after call).
  Events events(int64_t count) {
    CG_CHECK(count >= 0 && count <= kMaxEventsPerCall, "codegen: a program asks for ", count,
             " events; at most ", kMaxEventsPerCall, " per call (bug)");
    Events e{events_used_, std::vector<char>(static_cast<size_t>(count), 0)};
    if (count > 0) (void)lease_->event(events_used_ + static_cast<size_t>(count) - 1);
    events_used_ += static_cast<size_t>(count);
    return e;
  }

  // Event k of `e` marks the work queued on the current stream so far.
  void record(Events& e, int64_t k) {
    check_cuda(cudaEventRecord(lease_->events[e.base + static_cast<size_t>(k)],
                               current_.handle), "codegen", "cudaEventRecord");
    e.recorded[static_cast<size_t>(k)] = 1;
  }

  // The current stream waits for event k of `e`'s last record in this call (for nothing
  // if it was not recorded yet: the slot it guards was not used yet).
  void wait(const Events& e, int64_t k) {
    if (!e.recorded[static_cast<size_t>(k)]) return;
    check_cuda(cudaStreamWaitEvent(current_.handle,
                                   lease_->events[e.base + static_cast<size_t>(k)], 0),
               "codegen", "cudaStreamWaitEvent");
  }

  const Stream& caller() const { return caller_; }
  const Stream& current() const { return current_; }
  Stream worker(int64_t k) { return lease_->worker(k); }
  // The stream that queues a loop's host-to-device copies (the host IR's CopyStream): the
  // lease's stream after the `pool` workers a loop can use. A program with a larger pool
  // uses it as a worker; that is safe: a thread's calls run one after another, and each
  // call's fork orders the streams it uses after the caller's stream.
  Stream copy_stream(int64_t pool) { return lease_->worker(pool); }
  // The stream that queues the copies into the thread's staging ring (ring.h): one per
  // lease, used by nothing else, so its queue runs from one call into the next.
  Stream ring_stream() { return lease_->worker(kRingStream); }

  void set_current(const Stream& s) {
    if (s.handle == current_.handle) return;
    set_torch_stream(s.handle, device_);
    current_ = s;
    if (s.worker >= 0) mark(s.worker, true);
    if (s.handle == caller_.handle) caller_recorded_ = false;  // work may follow on it
  }

  // The current stream waits for the work queued so far on `target` (no host block).
  // The caller's stream gets work only while current, so the fork records its event once
  // and every worker waits on that one record.
  void wait(const Stream& target) {
    if (target.handle == current_.handle) return;
    const bool caller = target.handle == caller_.handle;
    if (!(caller && caller_recorded_)) {
      check_cuda(cudaEventRecord(target.event, target.handle), "codegen", "cudaEventRecord");
      caller_recorded_ = caller_recorded_ || caller;
    }
    check_cuda(cudaStreamWaitEvent(current_.handle, target.event, 0), "codegen",
               "cudaStreamWaitEvent");
    if (current_.handle == caller_.handle && target.worker >= 0) mark(target.worker, false);
  }

 private:
  void mark(int64_t k, bool dirty) {
    if (static_cast<int64_t>(dirty_.size()) <= k) dirty_.resize(static_cast<size_t>(k) + 1, 0);
    dirty_[static_cast<size_t>(k)] = dirty ? 1 : 0;
  }

  int32_t device_;
  Lease* lease_;
  Stream caller_;
  Stream current_;
  bool caller_recorded_ = false;  // caller_.event holds all the caller's work so far
  std::vector<char> dirty_;  // worker k has work the caller's stream has not waited for
  std::vector<torch::stable::Tensor> kept_;  // see keep()
  size_t events_used_ = 0;  // of the lease's events, by this call's Events
  // Staging slots of a call's loops, each with one event per slot: far below this.
  static constexpr int64_t kMaxEventsPerCall = 4096;
};

}  // namespace codegen_rt
