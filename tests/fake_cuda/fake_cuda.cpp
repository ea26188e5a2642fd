// The fake CUDA runtime and torch shim of fake_cuda.h: the definitions of the cuda* and
// aoti_torch_* / torch_* functions the runtime headers call, so that a test program
// links with neither libcudart nor libtorch.
#include "fake_cuda/fake_cuda.h"

#include <torch/csrc/stable/c/shim.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// The opaque handle types of the CUDA runtime and torch's shim, defined here (the headers
// only declare them): a handle is its index in the fake's tables.
struct CUstream_st {
  int id;
};
struct CUevent_st {
  int id;
};
struct AtenTensorOpaque {
  int block = -1;  // the device block it owns, or -1 (undefined, or host memory)
  bool deleted = false;
};

namespace fake {
namespace {

struct OpRec {
  Op op;
  std::string what;
  std::vector<Access> accesses;
  Clock clock;
};

struct StreamRec {
  std::string name;
  std::unique_ptr<CUstream_st> handle;  // null for the legacy default stream (id 0)
  Clock clock;                          // what its next operation is ordered after
  std::vector<size_t> ops;              // indices in State::ops
  bool capturing = false;
};

struct EventRec {
  std::unique_ptr<CUevent_st> handle;
  bool recorded = false;
  int stream = -1;
  int64_t position = 0;
  Clock clock;
  bool destroyed = false;
};

struct State {
  std::mutex mutex;
  std::vector<StreamRec> streams;
  std::vector<EventRec> events;
  std::vector<OpRec> ops;
  std::vector<Wait> waits;
  std::vector<Record> records;
  std::vector<Block> blocks;
  std::vector<std::unique_ptr<AtenTensorOpaque>> tensors;  // kept: deletion is observed
  std::vector<std::string> violations;
  Clock done;  // what the host has seen complete
  int fail_allocation_in = 0;  // > 0: the allocation that many from now fails
  int fail_wait_in = 0;        // > 0: the cudaStreamWaitEvent that many from now fails
  int64_t streams_created = 0, events_created = 0, host_waits = 0;

  State() {
    streams.emplace_back();
    streams.back().name = "the default stream";
  }
};

// Never destroyed: thread-local objects of the runtime call into it at thread exit.
State& state() {
  static State* s = new State();
  return *s;
}

constexpr int kDevices = 8;
thread_local cudaStream_t current_streams[kDevices] = {};
thread_local cudaError_t last_error = cudaSuccess;
thread_local cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;

int64_t at(const Clock& c, int stream) {
  return static_cast<size_t>(stream) < c.size() ? c[static_cast<size_t>(stream)] : 0;
}

void join(Clock& into, const Clock& other) {
  if (into.size() < other.size()) into.resize(other.size(), 0);
  for (size_t k = 0; k < other.size(); ++k) into[k] = std::max(into[k], other[k]);
}

int stream_id(cudaStream_t s) { return s == nullptr ? 0 : s->id; }

std::string describe(const State& st, const OpRec& o) {
  return "'" + o.what + "' (" + st.streams[static_cast<size_t>(o.op.stream)].name + " #" +
         std::to_string(o.op.position) + ")";
}

bool overlap(const Access& a, const Access& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.begin), a1 = reinterpret_cast<uintptr_t>(a.end);
  const auto b0 = reinterpret_cast<uintptr_t>(b.begin), b1 = reinterpret_cast<uintptr_t>(b.end);
  return a0 < b1 && b0 < a1;
}

int block_at(const State& st, uintptr_t p) {
  for (size_t k = 0; k < st.blocks.size(); ++k) {
    const auto b = reinterpret_cast<uintptr_t>(st.blocks[k].data);
    if (p >= b && p < b + static_cast<uintptr_t>(std::max<int64_t>(st.blocks[k].bytes, 1))) {
      return static_cast<int>(k);
    }
  }
  return -1;
}

const OpRec& op_rec(const State& st, Op op) {
  const StreamRec& s = st.streams.at(static_cast<size_t>(op.stream));
  return st.ops.at(s.ops.at(static_cast<size_t>(op.position - 1)));
}

// Queues an operation on `stream`, checking its device accesses against earlier ones.
Op queue(cudaStream_t stream, const std::string& what, std::vector<Access> accesses) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const int sid = stream_id(stream);
  StreamRec& s = st.streams.at(static_cast<size_t>(sid));
  OpRec o;
  o.op = {sid, static_cast<int64_t>(s.ops.size()) + 1};
  o.what = what;
  if (s.clock.size() <= static_cast<size_t>(sid)) s.clock.resize(static_cast<size_t>(sid) + 1);
  s.clock[static_cast<size_t>(sid)] = o.op.position;
  o.clock = s.clock;
  // Only device memory is checked; host pointers (a copy's source) are not the runtime's.
  std::erase_if(accesses, [&](const Access& a) {
    return a.begin == a.end || block_at(st, reinterpret_cast<uintptr_t>(a.begin)) < 0;
  });
  o.accesses = accesses;
  for (const Access& a : o.accesses) {
    const int b = block_at(st, reinterpret_cast<uintptr_t>(a.begin));
    if (st.blocks[static_cast<size_t>(b)].freed) {
      st.violations.push_back(describe(st, o) + " touches block " + std::to_string(b) +
                              " after it was freed");
    }
    for (const OpRec& p : st.ops) {
      for (const Access& q : p.accesses) {
        if (!overlap(a, q) || !(a.write || q.write)) continue;
        if (at(o.clock, p.op.stream) < p.op.position) {
          st.violations.push_back("race: " + describe(st, o) + " is not ordered after " +
                                  describe(st, p) + ", which touches the same bytes");
        }
      }
    }
  }
  s.ops.push_back(st.ops.size());
  st.ops.push_back(std::move(o));
  return st.ops.back().op;
}

AtenTensorHandle new_handle(int block) {
  State& st = state();
  st.tensors.push_back(std::make_unique<AtenTensorOpaque>());
  st.tensors.back()->block = block;
  return st.tensors.back().get();
}

int64_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case 5: case 15: return 2;  // float16, bfloat16
    case 6: return 4;           // float32
    case 7: return 8;           // float64
    default: return 1;
  }
}

}  // namespace

Access reads(const void* data, int64_t bytes) {
  return {data, static_cast<const char*>(data) + bytes, false};
}
Access writes(const void* data, int64_t bytes) {
  return {data, static_cast<const char*>(data) + bytes, true};
}

cudaStream_t new_stream(const std::string& stream_name) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.streams.emplace_back();
  StreamRec& s = st.streams.back();
  s.name = stream_name;
  s.handle = std::make_unique<CUstream_st>(CUstream_st{static_cast<int>(st.streams.size()) - 1});
  return s.handle.get();
}

int id(cudaStream_t stream) { return stream_id(stream); }
int id(cudaEvent_t event) { return event->id; }

std::string name(int stream) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return st.streams.at(static_cast<size_t>(stream)).name;
}

int64_t streams_created() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().streams_created;
}

int64_t events_created() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().events_created;
}

void set_capturing(cudaStream_t stream, bool capturing) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().streams.at(static_cast<size_t>(stream_id(stream))).capturing = capturing;
}

Op kernel(cudaStream_t stream, const std::string& what, const std::vector<Access>& accesses) {
  return queue(stream, what, accesses);
}

std::vector<Op> ops() {
  std::lock_guard<std::mutex> lock(state().mutex);
  std::vector<Op> out;
  for (const OpRec& o : state().ops) out.push_back(o.op);
  return out;
}

std::vector<Op> ops_on(cudaStream_t stream) {
  std::vector<Op> out;
  for (const Op& o : ops()) {
    if (o.stream == stream_id(stream)) out.push_back(o);
  }
  return out;
}

std::string what(Op op) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return op_rec(state(), op).what;
}

std::vector<Access> accesses(Op op) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return op_rec(state(), op).accesses;
}

bool before(Op a, Op b) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return !(a.stream == b.stream && a.position == b.position) &&
         at(op_rec(state(), b).clock, a.stream) >= a.position;
}

bool before(Op a, const Clock& clock) { return at(clock, a.stream) >= a.position; }

Clock now(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().streams.at(static_cast<size_t>(stream_id(stream))).clock;
}

std::vector<Wait> waits() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().waits;
}

std::vector<Wait> waits_on(cudaStream_t stream) {
  std::vector<Wait> out;
  for (const Wait& w : waits()) {
    if (w.stream == stream_id(stream)) out.push_back(w);
  }
  return out;
}

std::vector<Record> records() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().records;
}

std::vector<Block> blocks() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().blocks;
}

int block_of(const void* data) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return block_at(state(), reinterpret_cast<uintptr_t>(data));
}

void fail_allocation_after(int successes) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().fail_allocation_in = successes + 1;
}

void fail_wait_after(int successes) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().fail_wait_in = successes + 1;
}

AtenTensorHandle host_tensor() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return new_handle(-1);
}

bool deleted(AtenTensorHandle tensor) {
  std::lock_guard<std::mutex> lock(state().mutex);
  return tensor->deleted;
}

void finish_all() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.done.assign(st.streams.size(), 0);
  for (size_t k = 0; k < st.streams.size(); ++k) {
    st.done[k] = static_cast<int64_t>(st.streams[k].ops.size());
  }
}

int64_t host_waits() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().host_waits;
}

std::vector<std::string> violations() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().violations;
}

std::vector<std::string> take_violations() {
  std::lock_guard<std::mutex> lock(state().mutex);
  std::vector<std::string> out;
  out.swap(state().violations);
  return out;
}

}  // namespace fake

// ---------------------------------------------------------------- the CUDA runtime

using fake::state;

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  std::string stream_name;
  {
    std::lock_guard<std::mutex> lock(state().mutex);
    stream_name = "runtime stream " + std::to_string(state().streams_created++);
  }
  *stream = fake::new_stream(stream_name);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  std::lock_guard<std::mutex> lock(state().mutex);
  const bool capturing =
      state().streams.at(static_cast<size_t>(fake::stream_id(stream))).capturing;
  *status = capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(state().mutex);
  ++state().host_waits;
  fake::join(state().done, state().streams.at(static_cast<size_t>(fake::stream_id(stream))).clock);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  ++st.events_created;
  st.events.emplace_back();
  st.events.back().handle =
      std::make_unique<CUevent_st>(CUevent_st{static_cast<int>(st.events.size()) - 1});
  *event = st.events.back().handle.get();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().events.at(static_cast<size_t>(event->id)).destroyed = true;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  fake::EventRec& e = st.events.at(static_cast<size_t>(event->id));
  const int sid = fake::stream_id(stream);
  const fake::StreamRec& s = st.streams.at(static_cast<size_t>(sid));
  if (e.destroyed) st.violations.push_back("an event is recorded after its destruction");
  e.recorded = true;
  e.stream = sid;
  e.position = static_cast<int64_t>(s.ops.size());
  e.clock = s.clock;
  st.records.push_back({event->id, sid, e.position, e.clock});
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.fail_wait_in > 0 && --st.fail_wait_in == 0) return cudaErrorUnknown;
  const fake::EventRec& e = st.events.at(static_cast<size_t>(event->id));
  const int sid = fake::stream_id(stream);
  if (e.destroyed) st.violations.push_back("a stream waits for a destroyed event");
  fake::Wait w;
  w.stream = sid;
  w.event = event->id;
  if (e.recorded) {
    w.recorded_on = e.stream;
    w.recorded_at = e.position;
    w.clock = e.clock;
    fake::join(st.streams.at(static_cast<size_t>(sid)).clock, e.clock);
  }
  st.waits.push_back(std::move(w));
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const fake::EventRec& e = st.events.at(static_cast<size_t>(event->id));
  for (size_t k = 0; k < e.clock.size(); ++k) {
    if (fake::at(st.done, static_cast<int>(k)) < e.clock[k]) return cudaErrorNotReady;
  }
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  ++st.host_waits;
  fake::join(st.done, st.events.at(static_cast<size_t>(event->id)).clock);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind,
                            cudaStream_t stream) {
  const auto bytes = static_cast<int64_t>(count);
  fake::queue(stream, "cudaMemcpyAsync", {fake::writes(dst, bytes), fake::reads(src, bytes)});
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind,
                              cudaStream_t stream) {
  std::vector<fake::Access> rows;
  for (size_t h = 0; h < height; ++h) {
    rows.push_back(fake::writes(static_cast<char*>(dst) + h * dpitch,
                                static_cast<int64_t>(width)));
    rows.push_back(fake::reads(static_cast<const char*>(src) + h * spitch,
                               static_cast<int64_t>(width)));
  }
  fake::queue(stream, "cudaMemcpy2DAsync", rows);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int, size_t count, cudaStream_t stream) {
  fake::queue(stream, "cudaMemsetAsync", {fake::writes(dst, static_cast<int64_t>(count))});
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  std::swap(*mode, fake::capture_mode);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = fake::last_error;
  fake::last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t) { return "an error of the fake CUDA runtime"; }

// ---------------------------------------------------------------- torch's shim

uint64_t aoti_torch_abi_version() { return 0; }  // older than any version-gated shim
int32_t aoti_torch_device_type_cpu() { return 0; }
int32_t aoti_torch_device_type_cuda() { return 1; }
int32_t aoti_torch_dtype_float16() { return 5; }
int32_t aoti_torch_dtype_float32() { return 6; }
int32_t aoti_torch_dtype_float64() { return 7; }
int32_t aoti_torch_dtype_bfloat16() { return 15; }
int32_t aoti_torch_dtype_int8() { return 1; }
int32_t aoti_torch_dtype_float8_e4m3fn() { return 24; }

AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device, void** ret) {
  if (device < 0 || device >= fake::kDevices) return 1;
  *ret = fake::current_streams[device];
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError torch_set_current_cuda_stream(void* stream, int32_t device) {
  if (device < 0 || device >= fake::kDevices) return 1;
  fake::current_streams[device] = static_cast<cudaStream_t>(stream);
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_new_uninitialized_tensor(AtenTensorHandle* ret) {
  std::lock_guard<std::mutex> lock(state().mutex);
  *ret = fake::new_handle(-1);
  return AOTI_TORCH_SUCCESS;
}

// PyTorch's caching allocator, on this thread's current stream of `device`.
AOTITorchError aoti_torch_empty_strided(int64_t ndim, const int64_t* sizes,
                                        const int64_t* strides, int32_t dtype, int32_t,
                                        int32_t device, AtenTensorHandle* ret) {
  if (device < 0 || device >= fake::kDevices) return 1;
  const int sid = fake::stream_id(fake::current_streams[device]);
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.fail_allocation_in > 0 && --st.fail_allocation_in == 0) return 1;
  int64_t elements = 1;
  for (int64_t d = 0; d < ndim; ++d) {
    if (sizes[d] == 0) elements = 0;
  }
  if (elements > 0) {
    for (int64_t d = 0; d < ndim; ++d) elements += (sizes[d] - 1) * strides[d];
  }
  fake::Block b;
  b.bytes = elements * fake::dtype_size(dtype);
  // Never freed, so that no address is handed out twice (see fake_cuda.h).
  const size_t rounded = (static_cast<size_t>(std::max<int64_t>(b.bytes, 1)) + 511) / 512 * 512;
  b.data = static_cast<char*>(std::aligned_alloc(512, rounded));
  b.stream = sid;
  st.blocks.push_back(b);
  *ret = fake::new_handle(static_cast<int>(st.blocks.size()) - 1);
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle tensor, void** ret) {
  std::lock_guard<std::mutex> lock(state().mutex);
  *ret = tensor->block < 0 ? nullptr
                           : state().blocks.at(static_cast<size_t>(tensor->block)).data;
  return AOTI_TORCH_SUCCESS;
}

// The block goes back to the caching allocator: work queued later on its stream may get
// it, so everything that touched it must be ordered before the stream's position now.
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle tensor) {
  fake::State& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (tensor->deleted) {
    st.violations.push_back("a tensor is deleted twice");
    return AOTI_TORCH_SUCCESS;
  }
  tensor->deleted = true;
  if (tensor->block < 0) return AOTI_TORCH_SUCCESS;
  fake::Block& b = st.blocks.at(static_cast<size_t>(tensor->block));
  b.freed = true;
  b.free_point = st.streams.at(static_cast<size_t>(b.stream)).clock;
  b.freed_after_ops = static_cast<int64_t>(st.ops.size());
  for (const fake::OpRec& o : st.ops) {  // the first offender only: one free, one message
    for (const fake::Access& a : o.accesses) {
      if (fake::block_at(st, reinterpret_cast<uintptr_t>(a.begin)) != tensor->block) continue;
      if (!fake::before(o.op, b.free_point)) {
        st.violations.push_back("block " + std::to_string(tensor->block) + " is freed on " +
                                st.streams.at(static_cast<size_t>(b.stream)).name +
                                " before " + fake::describe(st, o) + " is ordered there");
        return AOTI_TORCH_SUCCESS;
      }
    }
  }
  return AOTI_TORCH_SUCCESS;
}
