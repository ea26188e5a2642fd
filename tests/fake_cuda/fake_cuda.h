// A fake CUDA runtime and torch shim, enough to run the runtime headers' host logic
// (codegen/include/codegen/ring.h, stream.h, host.h) on a machine with no GPU.
//
// Nothing runs: every stream is a list of the operations queued on it, every event the
// snapshot of the stream it was last recorded on, and cudaStreamWaitEvent an edge. The
// order that CUDA guarantees is kept as a vector clock per stream: an operation's clock
// says, for every stream, how many of that stream's operations are ordered before it
// (itself included), so "A is ordered before B" is one comparison. Waiting for an event
// never recorded is a no-op, as in CUDA. The legacy default stream (a null handle) is an
// ordinary stream here: its implicit synchronization with blocking streams only adds
// order, and the runtime's streams are non-blocking.
//
// Memory: aoti_torch_empty_strided is PyTorch's caching allocator. A block belongs to the
// stream current at its allocation; when its last tensor is deleted it may be handed out
// again to work queued later on that stream, so every access to it must be ordered
// before the allocating stream's position at the free. The fake never hands an address
// out twice; it checks instead, at the free, that every access queued so far is ordered
// before that position, and that nothing touches the block afterwards. Every operation
// that writes device bytes must also be ordered after every earlier one that touched
// them, and one that reads them after every earlier write. What breaks a rule is kept in
// violations().
//
// Thread safe (one lock); the current stream is per thread and device, as in PyTorch.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fake {

// How many operations of each stream (by id) are ordered before a point, itself included.
using Clock = std::vector<int64_t>;

// Bytes [begin, end) of device memory read or written by an operation.
struct Access {
  const void* begin = nullptr;
  const void* end = nullptr;
  bool write = false;
};
Access reads(const void* data, int64_t bytes);
Access writes(const void* data, int64_t bytes);

// An operation queued on a stream: its stream id and 1-based position there.
struct Op {
  int stream = -1;
  int64_t position = 0;
};

// One cudaStreamWaitEvent: which stream waited, and the point of the event's last record
// (no record: stream -1, the wait was a no-op).
struct Wait {
  int stream = -1;
  int event = -1;
  int recorded_on = -1;
  int64_t recorded_at = 0;  // the recording stream's operation count at the record
  Clock clock;              // the event's snapshot that the wait joined
};

// One cudaEventRecord: which event, on which stream, after how many of its operations.
struct Record {
  int event = -1;
  int stream = -1;
  int64_t position = 0;
  Clock clock;  // the stream's clock at the record
};

// A new stream, as a caller would create one (torch.cuda.Stream()); named for messages.
cudaStream_t new_stream(const std::string& name);
int id(cudaStream_t stream);
int id(cudaEvent_t event);
std::string name(int stream);
// Streams created through cudaStreamCreateWithFlags, and events through
// cudaEventCreateWithFlags, so far.
int64_t streams_created();
int64_t events_created();
// Marks `stream` as being captured into a CUDA graph (cudaStreamIsCapturing says so).
void set_capturing(cudaStream_t stream, bool capturing);

// A kernel on `stream` (a GEMM, a reader of the op's output) touching `accesses`.
Op kernel(cudaStream_t stream, const std::string& what, const std::vector<Access>& accesses);
// Every operation queued so far, in host order; one stream's.
std::vector<Op> ops();
std::vector<Op> ops_on(cudaStream_t stream);
std::string what(Op op);
std::vector<Access> accesses(Op op);

// Whether `a` is ordered before `b` (a happens-before b), and before the point `clock`.
bool before(Op a, Op b);
bool before(Op a, const Clock& clock);
// What work queued next on `stream` is ordered after: its clock now.
Clock now(cudaStream_t stream);

std::vector<Wait> waits();
std::vector<Wait> waits_on(cudaStream_t stream);
std::vector<Record> records();

// Device allocations (aoti_torch_empty_strided), in order.
struct Block {
  char* data = nullptr;
  int64_t bytes = 0;
  int stream = -1;     // current at the allocation
  bool freed = false;
  Clock free_point;    // the allocating stream's clock at the free
  int64_t freed_after_ops = 0;  // operations queued (all streams) before the free
};
std::vector<Block> blocks();
// The block holding `data`, or -1.
int block_of(const void* data);
// Makes a device allocation fail (an out-of-memory error): the one after the next
// `successes` allocations.
void fail_allocation_after(int successes);
// Makes a cudaStreamWaitEvent fail (it returns an error and orders nothing): the one
// after the next `successes` waits.
void fail_wait_after(int successes);

// A tensor in host memory (as a pinned host input would be) whose deletion is observed.
AtenTensorHandle host_tensor();
bool deleted(AtenTensorHandle tensor);

// The host has run every operation queued so far (as after cudaDeviceSynchronize):
// cudaEventQuery then reports every recorded event complete.
void finish_all();
// Host waits: cudaStreamSynchronize and cudaEventSynchronize calls so far.
int64_t host_waits();

// Broken rules (see the top of this file), each a sentence; take_violations() forgets them.
std::vector<std::string> violations();
std::vector<std::string> take_violations();

}  // namespace fake
