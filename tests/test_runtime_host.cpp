// The host logic of the runtime's state across calls -- the staging ring (ring.h), the
// leased streams and the join on every exit (stream.h), the events and pinned tensors
// kept between calls (stream.h, host.h) -- run against the fake CUDA runtime of
// fake_cuda/ (streams as queues, events as snapshots, waits as edges, the caching
// allocator's free as a point on a stream). The programs below are written as the
// generator writes them (templates/program.cpp.j2) with a kernel of the fake in place of
// each GEMM. Every case runs in its own process (a fresh lease pool and fake); besides its
// own checks, a case fails on any race or early free the fake saw.
//
// Usage: test_runtime_host [CASE...]; no argument runs every case. Prints "PASS name" or
// "FAIL name: why" per case; exits non-zero if one failed.
#include "codegen/host.h"
#include "codegen/ring.h"
#include "fake_cuda/fake_cuda.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace rt = codegen_rt;

namespace {

// ------------------------------------------------------------------ cases and checks

struct Case {
  const char* name;
  void (*run)();
};

std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

std::vector<std::string> failures;

#define CASE(fn)                                                                     \
  void fn();                                                                         \
  [[maybe_unused]] const bool fn##_registered = (cases().push_back({#fn, fn}), true); \
  void fn()

#define EXPECT(cond, ...)                                                          \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      failures.push_back(rt::msg("line ", __LINE__, ": ", #cond, " -- ", __VA_ARGS__)); \
    }                                                                              \
  } while (0)

int64_t as_int(size_t n) { return static_cast<int64_t>(n); }

// Every operation queued on `stream` so far.
std::vector<fake::Op> on(cudaStream_t stream) { return fake::ops_on(stream); }

// ------------------------------------------------------------------ a ring program

// w: float32 [n, k] in host memory (row-major), `operands` of them per slice, staged
// slice by slice in the ring and read by one GEMM per slice on worker i % pool, which
// writes rows of the output. k = 64 floats by default: a row is 256 bytes, the ring's
// alignment.
struct Shape {
  int64_t n = 32, k = 64;
  int64_t slices = 8, pool = 4, slots = 5;
  int operands = 1;
};

int64_t chunk(const Shape& s) { return rt::ceil_div(s.n, s.slices); }
// A slot's bytes: a slice of w, rounded up to the ring's alignment.
int64_t slot_bytes(const Shape& s) {
  return rt::ceil_div(chunk(s) * s.k * 4, rt::kSlotAlignment) * rt::kSlotAlignment;
}

std::vector<float>& host_memory() {
  static std::vector<float> memory(1 << 20);
  return memory;
}

rt::View host_weight(const Shape& s, int operand) {
  rt::View v;
  v.data = reinterpret_cast<char*>(host_memory().data()) + operand * s.n * s.k * 4;
  v.dim = 2;
  v.itemsize = 4;
  v.sizes[0] = s.n;
  v.sizes[1] = s.k;
  v.strides[0] = s.k;
  v.strides[1] = 1;
  return v;
}

enum class Throw { Never, BeforeGemm, AfterGemm };

struct Slice {
  std::vector<fake::Op> copies;
  std::vector<const char*> slots;
  fake::Op gemm;  // position 0: not queued
  int worker = -1;
};

struct Call {
  std::vector<Slice> slices;
  bool threw = false;
  cudaStream_t ring = nullptr;
  std::vector<cudaStream_t> workers;
  fake::Op reader;  // the caller's read of the output, after a call that returned
  int64_t ops_at_join = 0;  // operations queued when the loop ended (or threw)
  const char* ring_base = nullptr;  // the ring's block after the call
};

// One call of a program lowered with staging="ring", as the generator writes it (see
// tests/test_ring.py's RING_LINEAR); `throw_at` >= 0 throws in that slice.
Call ring_call(const Shape& s, cudaStream_t caller, int64_t throw_at = -1,
               Throw where = Throw::Never) {
  Call call;
  (void)torch_set_current_cuda_stream(caller, 0);
  rt::Buffer result;
  try {
    const char* op = "ring_program";
    rt::RingCall ring(0, op);
    rt::Streams streams(0);
    const rt::Stream main_stream = streams.current();
    rt::Buffer out = streams.keep(rt::empty({s.n, s.n}, rt::DType::Float32, 0, op));
    call.ring = streams.ring_stream().handle;
    for (int64_t j = 0; j < s.pool; ++j) {
      streams.set_current(streams.worker(j));
      streams.wait(main_stream);
      call.workers.push_back(streams.current().handle);
    }
    for (int64_t i = 0; i < s.slices; ++i) {
      Slice slice;
      std::vector<rt::View> slots;
      try {
        streams.set_current(streams.ring_stream());
        for (int w = 0; w < s.operands; ++w) {
          const rt::View w_i = rt::shard(host_weight(s, w), 0, i, chunk(s));
          const rt::View w_s = ring.slot(streams, w_i, s.slots);
          rt::copy(w_s, w_i, cudaMemcpyHostToDevice, streams.current(), op);
          slice.copies.push_back(on(streams.current().handle).back());
          slice.slots.push_back(w_s.data);
          slots.push_back(w_s);
        }
        streams.set_current(streams.worker(i % s.pool));
        streams.wait(streams.ring_stream());
        slice.worker = static_cast<int>(i % s.pool);
        if (i == throw_at && where == Throw::BeforeGemm) throw std::runtime_error("before");
        const rt::View out_i = rt::shard(out, 0, i, chunk(s));
        std::vector<fake::Access> touched;
        for (const rt::View& w_s : slots) {
          touched.push_back(fake::reads(w_s.data, w_s.sizes[0] * s.k * 4));  // the slice's bytes
        }
        touched.push_back(fake::writes(out_i.data, out_i.sizes[0] * s.n * 4));
        slice.gemm = fake::kernel(streams.current().handle, rt::msg("GEMM ", i), touched);
        if (i == throw_at && where == Throw::AfterGemm) throw std::runtime_error("after");
        for (const rt::View& w_s : slots) ring.release(streams, w_s);
      } catch (...) {
        call.slices.push_back(slice);
        call.ops_at_join = as_int(fake::ops().size());
        throw;
      }
      call.slices.push_back(slice);
    }
    call.ops_at_join = as_int(fake::ops().size());
    streams.set_current(main_stream);
    for (int64_t j = 0; j < s.pool; ++j) streams.wait(streams.worker(j));
    streams.wait(streams.ring_stream());
    result = out;
  } catch (const std::runtime_error&) {
    call.threw = true;
  }
  call.ring_base = rt::thread_lease(0).ring.buffer.data;
  if (!call.threw) {
    call.reader = fake::kernel(caller, "reader of the output",
                               {fake::reads(result.data, s.n * s.n * 4)});
  }
  return call;
}

// The waits queued on `stream` for events recorded on other streams (the ring's waits
// for its ranges' readers), oldest first.
std::vector<fake::Wait> recorded_waits(cudaStream_t stream) {
  std::vector<fake::Wait> out;
  for (const fake::Wait& w : fake::waits_on(stream)) {
    if (w.recorded_on >= 0) out.push_back(w);
  }
  return out;
}

// The point just after `op` on its stream: where an event recorded then would stand.
bool wait_is_right_after(const fake::Wait& w, fake::Op op) {
  return w.recorded_on == op.stream && w.recorded_at == op.position;
}

void run_in_thread(const std::function<void()>& fn) {
  std::thread t(fn);
  t.join();
}

// ------------------------------------------------------------------ the fake itself

CASE(fake_orders_by_events_and_catches_races_and_early_frees) {
  // The checker the other cases rely on: a read on another stream without a wait races
  // the write; an event's wait orders what was queued before its record, not after; a
  // wait for an event never recorded orders nothing; a free on the allocating stream
  // before a reader elsewhere is ordered there is early; a touch after the free is late.
  const cudaStream_t s1 = fake::new_stream("s1"), s2 = fake::new_stream("s2");
  (void)torch_set_current_cuda_stream(s1, 0);
  cudaEvent_t e = nullptr, never = nullptr;
  (void)cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  (void)cudaEventCreateWithFlags(&never, cudaEventDisableTiming);
  {
    rt::Buffer b = rt::empty({128}, rt::DType::Float32, 0, "op");
    const fake::Op w = fake::kernel(s1, "write", {fake::writes(b.data, 256)});
    (void)fake::kernel(s2, "racing read", {fake::reads(b.data, 256)});
    EXPECT(fake::take_violations().size() == 1, "an unordered read races the write");
    (void)cudaStreamWaitEvent(s2, never, 0);
    (void)fake::kernel(s2, "read after a wait for nothing", {fake::reads(b.data, 4)});
    EXPECT(fake::take_violations().size() == 1, "a wait for an unrecorded event orders nothing");
    (void)cudaEventRecord(e, s1);
    const fake::Op later = fake::kernel(s1, "later write", {fake::writes(b.data + 256, 256)});
    (void)cudaStreamWaitEvent(s2, e, 0);
    (void)cudaEventRecord(e, s1);  // a record after the wait changes nothing for it
    const fake::Op r = fake::kernel(s2, "ordered read", {fake::reads(b.data, 128)});
    EXPECT(fake::take_violations().empty() && fake::before(w, r) && !fake::before(later, r),
           "the wait orders what came before the record, only");
  }  // b is freed on s1, where the reads on s2 are not ordered
  EXPECT(fake::take_violations().size() == 1, "a free before the readers is early");
  const int block = 0;
  (void)fake::kernel(s1, "use after free", {fake::writes(fake::blocks()[block].data, 4)});
  bool late = false;
  for (const std::string& v : fake::take_violations()) {
    late = late || v.find("after it was freed") != std::string::npos;
  }
  EXPECT(late, "a touch after the free");
}

// ------------------------------------------------------------------ ring: ranges

CASE(ring_slot_takes_the_next_bytes) {
  // Slices of 1024 bytes, 5 slots: one block of 5 * 1024 bytes on the ring stream, and
  // slice i at byte (i % 5) * 1024 (the fifth ends exactly at the end: no wrap yet).
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller);
  EXPECT(!c.threw, "the call returned");
  const std::vector<fake::Block> blocks = fake::blocks();
  const int ring_block = fake::block_of(c.slices[0].slots[0]);
  EXPECT(ring_block >= 0 && blocks[ring_block].bytes == s.slots * slot_bytes(s),
         "the ring is one block of slots * slice bytes");
  EXPECT(ring_block >= 0 && blocks[ring_block].stream == fake::id(c.ring),
         "the ring is allocated on the ring stream");
  for (int64_t i = 0; i < s.slices; ++i) {
    const int64_t offset = c.slices[i].slots[0] - c.ring_base;
    EXPECT(offset == (i % s.slots) * slot_bytes(s), "slice ", i, " at byte ", offset);
  }
  // Each copy is queued on the ring stream, and each GEMM after its copy.
  for (const Slice& x : c.slices) {
    EXPECT(x.copies[0].stream == fake::id(c.ring), "copies go to the ring stream");
    EXPECT(fake::before(x.copies[0], x.gemm), "a GEMM is ordered after its slice's copy");
  }
}

CASE(ring_wraps_to_the_start_when_the_next_slice_does_not_fit) {
  // 3 slots of 1024 bytes, 7 slices whose last is ragged (512 bytes): slice 2 ends
  // exactly at the end of the ring (no wrap), slices 3 and 6 wrap to byte 0. Then slices
  // of 768 bytes, which do not divide the ring, wrap where the next one does not fit.
  Shape s;
  s.n = 26;  // chunk 4 rows: 6 slices of 1024 bytes, the last 2 rows: 512 bytes
  s.slices = 7;
  s.slots = 3;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller);
  const int64_t expected[] = {0, 1024, 2048, 0, 1024, 2048, 0};
  for (int64_t i = 0; i < s.slices; ++i) {
    const int64_t offset = c.slices[i].slots[0] - c.ring_base;
    EXPECT(offset == expected[i], "slice ", i, " at byte ", offset, ", expected ",
           expected[i]);
  }
  // The next call's slices of 768 bytes (3 rows) in the 3072-byte ring: after the ragged
  // slice ends at 512, they take 512, 1280, 2048 (ends at 2816), then wrap to 0.
  Shape t = s;
  t.n = 15;
  t.slices = 5;
  t.slots = 3;  // 3 * 768 <= 3072: the ring does not grow
  const Call d = ring_call(t, caller);
  EXPECT(d.ring_base == c.ring_base, "the ring was not replaced");
  const int64_t next[] = {512, 1280, 2048, 0, 768};
  for (int64_t i = 0; i < t.slices; ++i) {
    const int64_t offset = d.slices[i].slots[0] - d.ring_base;
    EXPECT(offset == next[i], "slice ", i, " at byte ", offset, ", expected ", next[i]);
  }
}

CASE(ring_reused_range_waits_for_exactly_its_last_reader) {
  // 8 slices in 5 slots on 4 workers: slices 5, 6, 7 reuse the bytes of 0, 1, 2, and
  // before each copy the ring stream waits for one event: the one recorded right after
  // the GEMM that read those bytes (worker i % 4), not for later work on that worker nor
  // for any other GEMM. So copy i is ordered after GEMMs 0 .. i - 5 (the ring stream's
  // waits so far) and runs ahead of the others.
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller);
  const std::vector<fake::Wait> waits = recorded_waits(c.ring);
  EXPECT(as_int(waits.size()) == 3, "the ring stream waited ", as_int(waits.size()),
         " times for other streams' events, expected 3 (slices 5, 6, 7)");
  for (int64_t i = 5; i < 8 && as_int(waits.size()) == 3; ++i) {
    const fake::Op reader = c.slices[i - 5].gemm;
    EXPECT(wait_is_right_after(waits[i - 5], reader), "slice ", i,
           "'s wait is for the event recorded right after GEMM ", i - 5);
    EXPECT(fake::before(reader, c.slices[i].copies[0]), "slice ", i,
           "'s copy is ordered after GEMM ", i - 5, ", the last reader of its bytes");
    for (int64_t j = 0; j < i; ++j) {
      EXPECT(fake::before(c.slices[j].gemm, c.slices[i].copies[0]) == (j <= i - 5),
             "slice ", i, "'s copy is ordered after GEMM ", j, " iff ", j, " <= ", i - 5);
    }
  }
  // The ring stream is not forked from the caller's stream: a caller's kernel queued
  // before the call does not order the copies.
  const fake::Op before_call = fake::kernel(caller, "caller's work", {});
  const Call d = ring_call(s, caller);
  EXPECT(!fake::before(before_call, d.slices[0].copies[0]),
         "the ring's copies are not ordered after the caller's stream");
  // Call 1 ended with slice 7 at 2048: call 2's slice 0 takes 3072, slice 3's bytes, and
  // waits for GEMM 3 of call 1, not for the join of call 1.
  EXPECT(d.slices[0].slots[0] == c.slices[3].slots[0], "the second call continues the ring");
  EXPECT(fake::before(c.slices[3].gemm, d.slices[0].copies[0]),
         "call 2's first copy is ordered after call 1's reader of its bytes");
  EXPECT(!fake::before(c.slices[7].gemm, d.slices[0].copies[0]),
         "call 2's first copy is not ordered after call 1's last GEMM on that worker");
}

CASE(ring_release_is_by_address_on_the_current_stream) {
  // Two slots a, b taken on the ring stream; a's reader runs on worker 0 and releases a
  // there, b's reader on worker 1 after it. The next slots wrap onto a's bytes, then b's:
  // each copy waits for the event of the range it reuses, recorded on the stream that
  // released that range right after its reader (a release that took the newest or the
  // oldest range instead of a's would order c after b's reader only), and a release of
  // bytes not in the ring records nothing.
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  {
    rt::RingCall ring(0, "op");
    rt::Streams streams(0);
    const rt::View like = rt::shard(host_weight(s, 0), 0, 0, chunk(s));
    streams.set_current(streams.ring_stream());
    const rt::View a = ring.slot(streams, like, 2);
    rt::copy(a, like, cudaMemcpyHostToDevice, streams.current(), "op");
    const rt::View b = ring.slot(streams, like, 2);
    rt::copy(b, like, cudaMemcpyHostToDevice, streams.current(), "op");
    const cudaStream_t ring_stream = streams.current().handle;
    streams.set_current(streams.worker(0));
    streams.wait(streams.ring_stream());
    const fake::Op reads_a = fake::kernel(streams.current().handle, "reader of a",
                                          {fake::reads(a.data, slot_bytes(s))});
    ring.release(streams, a);
    streams.set_current(streams.worker(1));
    streams.wait(streams.ring_stream());
    const fake::Op reads_b = fake::kernel(streams.current().handle, "reader of b",
                                          {fake::reads(b.data, slot_bytes(s))});
    ring.release(streams, b);
    const size_t records = fake::records().size();
    rt::View elsewhere = a;
    elsewhere.data = reinterpret_cast<char*>(host_memory().data());
    ring.release(streams, elsewhere);
    EXPECT(fake::records().size() == records, "releasing bytes not in the ring records nothing");
    streams.set_current(streams.ring_stream());
    const rt::View c = ring.slot(streams, like, 2);
    rt::copy(c, like, cudaMemcpyHostToDevice, streams.current(), "op");
    const rt::View d = ring.slot(streams, like, 2);
    rt::copy(d, like, cudaMemcpyHostToDevice, streams.current(), "op");
    EXPECT(c.data == a.data && d.data == b.data, "c, d wrap onto a, b");
    const std::vector<fake::Wait> waits = recorded_waits(ring_stream);
    EXPECT(as_int(waits.size()) == 2, "one wait per reused range, got ", as_int(waits.size()));
    if (waits.size() == 2) {
      EXPECT(wait_is_right_after(waits[0], reads_a), "c waits for a's reader");
      EXPECT(wait_is_right_after(waits[1], reads_b), "d waits for b's reader");
    }
    const std::vector<fake::Op> ring_ops = on(ring_stream);
    EXPECT(fake::before(reads_a, ring_ops[2]) && !fake::before(reads_b, ring_ops[2]),
           "c's copy follows a's reader, not b's");
    EXPECT(fake::before(reads_b, ring_ops[3]), "d's copy follows b's reader");
    streams.set_current(streams.caller());
    streams.wait(streams.worker(0));
    streams.wait(streams.worker(1));
    streams.wait(streams.ring_stream());
  }
  // c and d were never released: RingCall's destructor released them.
  for (const rt::RingRange& r : rt::thread_lease(0).ring.ranges) {
    EXPECT(r.released, "range [", r.begin, ", ", r.end, ") was released");
  }
}

// ------------------------------------------------------------------ ring: growth

CASE(ring_grows_when_its_capacity_is_below_slots_times_the_slice) {
  // Call 1: slices of 1024 bytes in a ring of 5 * 1024. Call 2: slices of 2048 bytes
  // (8 rows): a ring of 5 * 2048 replaces it. The old block goes back to the caching
  // allocator on the ring stream once it has waited for every reader of it: every GEMM
  // of call 1 is ordered before the free (the fake checks every access at the free), and
  // the free is queued in call 2, before its first copy.
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller);
  Shape t = s;
  t.n = 64;
  const Call d = ring_call(t, caller);
  const int old_block = fake::block_of(c.ring_base);
  const int new_block = fake::block_of(d.ring_base);
  const std::vector<fake::Block> blocks = fake::blocks();
  EXPECT(old_block != new_block, "the ring was replaced");
  EXPECT(blocks[new_block].bytes == t.slots * slot_bytes(t), "the new ring holds 5 slices");
  EXPECT(blocks[old_block].freed, "the old block was freed");
  EXPECT(blocks[old_block].stream == fake::id(c.ring), "on the ring stream");
  for (const Slice& x : c.slices) {
    EXPECT(fake::before(x.gemm, blocks[old_block].free_point),
           "every reader of the old block is ordered before its free");
  }
  EXPECT(blocks[old_block].freed_after_ops < d.ops_at_join, "freed during call 2");
  EXPECT(d.slices[0].slots[0] == d.ring_base, "call 2 starts at the new ring's start");
  // A smaller slice later does not shrink it.
  const Call e = ring_call(s, caller);
  EXPECT(e.ring_base == d.ring_base, "a smaller slice keeps the larger ring");
}

CASE(ring_grows_when_the_next_bytes_are_held_in_this_call) {
  // Two operands per slice and 1 slot: operand a takes the whole ring, operand b's bytes
  // wrap onto a's, still held (its GEMM has not run). The ring doubles; the old block,
  // which GEMM 0 still reads, is retired: kept until the end of the call, then freed on
  // the ring stream after the ring stream waited for the caller's stream past the join.
  Shape s;
  s.operands = 2;
  s.slots = 1;
  s.slices = 4;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller);
  const int old_block = fake::block_of(c.slices[0].slots[0]);
  const int new_block = fake::block_of(c.slices[0].slots[1]);
  const std::vector<fake::Block> blocks = fake::blocks();
  EXPECT(old_block != new_block, "operand b of slice 0 is in a new block");
  EXPECT(blocks[new_block].bytes == 2 * slot_bytes(s), "twice the old capacity");
  EXPECT(blocks[old_block].freed, "the old block was freed at the end of the call");
  EXPECT(blocks[old_block].freed_after_ops >= c.ops_at_join,
         "the retired block was kept until the end of the call");
  EXPECT(fake::before(c.slices[0].gemm, blocks[old_block].free_point),
         "GEMM 0, which read the retired block, is ordered before its free");
  bool waited_for_caller = false;
  for (const fake::Wait& w : recorded_waits(c.ring)) {
    waited_for_caller = waited_for_caller || w.recorded_on == fake::id(caller);
  }
  EXPECT(waited_for_caller, "the ring stream waited for the caller's stream");
  // The caller's join point is in the free point: all of the call's GEMMs.
  for (const Slice& x : c.slices) {
    EXPECT(fake::before(x.gemm, blocks[old_block].free_point), "GEMM before the free");
  }
  EXPECT(rt::thread_lease(0).ring.retired.empty(), "nothing stays retired after the call");
  // Later slices fit in the doubled ring without growing again.
  for (size_t i = 1; i < c.slices.size(); ++i) {
    for (const char* slot : c.slices[i].slots) {
      EXPECT(fake::block_of(slot) == new_block, "slice ", as_int(i), " is in the new ring");
    }
  }
}

CASE(ring_allocation_failure_leaves_an_empty_ring) {
  // The larger ring's allocation fails while a range of this call is held: the call throws,
  // the retired block is still freed after the join, and the next call starts afresh.
  Shape s;
  s.operands = 2;
  s.slots = 1;
  s.slices = 2;
  const cudaStream_t caller = fake::new_stream("caller");
  const Shape first{};
  const Call a = ring_call(first, caller);  // a ring of 5 * 1024 bytes
  fake::fail_allocation_after(1);  // the output's allocation succeeds, the ring's fails
  Shape big = s;
  big.n = 128;  // 8 slices of 16 rows: 4096 bytes, above the ring: it grows, and fails
  big.slices = 8;
  const Call b = ring_call(big, caller);
  EXPECT(b.threw, "the failed allocation throws");
  const rt::Ring& ring = rt::thread_lease(0).ring;
  EXPECT(ring.capacity == 0 && ring.head == 0 && ring.ranges.empty() && ring.retired.empty(),
         "an empty ring after the failure");
  const int old_block = fake::block_of(a.ring_base);
  EXPECT(fake::blocks()[old_block].freed, "the old block was freed");
  const Call c = ring_call(first, caller);
  EXPECT(!c.threw && c.slices[0].slots[0] == c.ring_base, "the next call starts a new ring");
}

// ------------------------------------------------------------------ ring: exceptions

CASE(ring_range_left_by_an_exception_is_released_on_the_callers_stream) {
  // An exception after GEMM 2 was queued and before its range was released: RingCall's
  // destructor releases it on the caller's stream, after the workers joined it; the next
  // call that reuses those bytes waits for that event, so its copy is ordered after
  // GEMM 2 (the fake checks the write against the read).
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller, 2, Throw::AfterGemm);
  EXPECT(c.threw, "the call threw");
  const rt::Ring& ring = rt::thread_lease(0).ring;
  bool all_released = true;
  for (const rt::RingRange& r : ring.ranges) all_released = all_released && r.released;
  EXPECT(all_released, "every range is released after the call");
  const std::vector<fake::Record> records = fake::records();
  const fake::Record* release = nullptr;
  for (const rt::RingRange& r : ring.ranges) {
    if (r.begin == 2 * slot_bytes(s)) {
      for (const fake::Record& x : records) {
        if (x.event == fake::id(r.freed)) release = &x;
      }
    }
  }
  EXPECT(release != nullptr && release->stream == fake::id(caller),
         "slice 2's range was released on the caller's stream");
  if (release != nullptr) {
    for (const Slice& x : c.slices) {
      if (x.gemm.position > 0) {
        EXPECT(fake::before(x.gemm, release->clock), "the release follows the join");
      }
    }
  }
  // Call 2 starts at 3072 and wraps: its slice 4 reuses slice 2's bytes (at 2048).
  const Call d = ring_call(s, caller);
  const Slice* reuse = nullptr;
  for (const Slice& x : d.slices) {
    if (x.slots[0] == c.slices[2].slots[0] && reuse == nullptr) reuse = &x;
  }
  EXPECT(reuse != nullptr, "call 2 reuses slice 2's bytes");
  if (reuse != nullptr) {
    EXPECT(fake::before(c.slices[2].gemm, reuse->copies[0]),
           "the copy into them is ordered after GEMM 2");
  }
  EXPECT(d.ring_base == c.ring_base, "the ring did not grow (no range stayed held)");
}

CASE(ring_range_taken_before_an_exception_before_its_gemm) {
  // The exception falls between slice 2's copy and its GEMM: the range is released on
  // the caller's stream (past the join, so past the copy), and every block the call
  // allocated is freed only after every operation that touched it.
  const Shape s;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call c = ring_call(s, caller, 2, Throw::BeforeGemm);
  EXPECT(c.threw, "the call threw");
  for (const rt::RingRange& r : rt::thread_lease(0).ring.ranges) {
    EXPECT(r.released, "range [", r.begin, ", ", r.end, ") is released");
  }
  const fake::Op after = fake::kernel(caller, "caller's next kernel", {});
  EXPECT(fake::before(c.slices[2].copies[0], after),
         "the caller's stream is ordered after the ring stream's copy");
  // The program's output, kept by Streams, was freed on the caller's stream after the
  // join: the fake saw no early free (checked for every case), and it is freed.
  int freed = 0;
  for (const fake::Block& b : fake::blocks()) freed += b.freed ? 1 : 0;
  EXPECT(freed == 1, "the output was freed, the ring kept: ", freed, " blocks freed");
}

// Every event of the ring is in one place: a range's or spare, never both nor twice (a
// range given a spare event that another range still holds would share its record, and
// the ring stream would wait for the wrong reader of one of them).
void expect_each_ring_event_owned_once(const std::string& when) {
  const rt::Ring& ring = rt::thread_lease(0).ring;
  std::vector<cudaEvent_t> all(ring.spare);
  for (const rt::RingRange& r : ring.ranges) all.push_back(r.freed);
  const std::set<cudaEvent_t> distinct(all.begin(), all.end());
  EXPECT(distinct.size() == all.size(), when, ": ", as_int(all.size() - distinct.size()),
         " of the ring's events are held twice (by ranges or as spare)");
}

CASE(ring_wait_failing_while_the_ring_grows_leaves_each_event_owned_once) {
  // Call 1 leaves 5 released ranges in a ring of 5 * 1024 bytes. Call 2's slices of
  // 2048 bytes replace the ring, whose stream first waits for each range's reader; the
  // second of those waits fails (the fork's 4 waits come before it). The call throws and
  // the ring keeps its ranges, each with its own event, none of them also spare. Later
  // calls of other slice sizes and pools, then one that grows the ring, keep every event
  // owned once, so no copy waits for another range's reader in place of its own (with
  // an event shared, the third of them races a GEMM of the first).
  const Shape s;
  Shape big = s;
  big.n = 64;
  const cudaStream_t caller = fake::new_stream("caller");
  const Call first = ring_call(s, caller);
  EXPECT(!first.threw, "call 1 returned");
  expect_each_ring_event_owned_once("after call 1");
  const size_t waits_before = fake::waits().size();
  fake::fail_wait_after(as_int(s.pool) + 1);
  const Call failed = ring_call(big, caller);
  EXPECT(failed.threw, "the failed wait throws");
  int64_t ring_waits = 0;
  const std::vector<fake::Wait> waits = fake::waits();
  for (size_t k = waits_before; k < waits.size(); ++k) {
    ring_waits += waits[k].stream == fake::id(first.ring) ? 1 : 0;
  }
  EXPECT(ring_waits == 1 && failed.slices.size() == 1 && failed.slices[0].copies.empty(),
         "the failure is the growth's second wait, before the first copy: ", ring_waits,
         " waits on the ring stream");
  EXPECT(rt::thread_lease(0).ring.ranges.size() == 5 &&
             failed.ring_base == first.ring_base,
         "the ring keeps its block and its 5 ranges");
  expect_each_ring_event_owned_once("after the failed wait");
  auto shape = [](int64_t n, int64_t slices, int64_t pool, int64_t slots) {
    Shape x;
    x.n = n;
    x.slices = slices;
    x.pool = pool;
    x.slots = slots;
    return x;
  };
  const Shape later[] = {shape(7, 7, 4, 5), shape(12, 6, 1, 4), shape(12, 6, 4, 5), big};
  for (size_t k = 0; k < std::size(later); ++k) {
    const size_t violations = fake::violations().size();
    const Call c = ring_call(later[k], caller);
    EXPECT(!c.threw, "later call ", as_int(k), " returned");
    expect_each_ring_event_owned_once(rt::msg("after later call ", as_int(k)));
    EXPECT(fake::violations().size() == violations, "later call ", as_int(k), " races");
  }
}

CASE(ring_capture_is_refused_before_anything_is_queued) {
  const cudaStream_t caller = fake::new_stream("caller");
  fake::set_capturing(caller, true);
  (void)torch_set_current_cuda_stream(caller, 0);
  bool refused = false;
  try {
    rt::RingCall ring(0, "ring_program");
  } catch (const std::runtime_error& e) {
    refused = std::strstr(e.what(), "staging=\"slots\"") != nullptr;
  }
  EXPECT(refused, "RingCall refuses a capturing stream, naming staging=\"slots\"");
  EXPECT(fake::ops().empty() && fake::records().empty() && fake::waits().empty() &&
             fake::blocks().empty(),
         "nothing was queued, recorded or allocated");
}

CASE(ring_goes_with_the_lease_to_the_next_thread) {
  // A thread's ring goes back with its lease at the thread's exit; the next thread takes
  // both, and its copies wait for the other thread's GEMMs on the bytes they reuse.
  const Shape s;
  Call first, second;
  const cudaStream_t a = fake::new_stream("thread A's stream");
  const cudaStream_t b = fake::new_stream("thread B's stream");
  run_in_thread([&] { first = ring_call(s, a); });
  run_in_thread([&] { second = ring_call(s, b); });
  EXPECT(first.ring == second.ring && first.ring_base == second.ring_base,
         "thread B has thread A's ring stream and ring");
  EXPECT(second.slices[0].slots[0] == first.slices[3].slots[0], "B continues A's ring");
  EXPECT(fake::before(first.slices[3].gemm, second.slices[0].copies[0]),
         "B's copy waits for A's GEMM that read those bytes");
}

CASE(ring_random_calls_never_race) {
  // 300 calls of random shapes (slice sizes, ragged slices, slots, workers, 1 to 3
  // operands per slice, growth both ways), from two caller streams and, now and then, a
  // new thread that takes the lease back; a fifth of them throw between a copy and its
  // GEMM or after it. The fake checks every copy against the last readers of its bytes,
  // every free against every access, and each call's output against its GEMMs.
  uint64_t seed = 12345;
  auto next = [&](int64_t bound) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int64_t>((seed >> 33) % static_cast<uint64_t>(bound));
  };
  const cudaStream_t callers[2] = {fake::new_stream("caller 1"), fake::new_stream("caller 2")};
  for (int call = 0; call < 300; ++call) {
    Shape s;
    s.k = 64 * (1 + next(3));
    s.slices = 1 + next(8);
    s.n = s.slices * (1 + next(4)) - next(2);
    s.pool = 1 + next(4);
    s.slots = 1 + next(6);
    s.operands = 1 + static_cast<int>(next(3));
    const int64_t throw_at = next(5) == 0 ? next(s.slices) : -1;
    const Throw where = next(2) == 0 ? Throw::BeforeGemm : Throw::AfterGemm;
    const cudaStream_t caller = callers[next(2)];
    if (next(10) == 0) {
      run_in_thread([&] { (void)ring_call(s, caller, throw_at, where); });
    } else {
      (void)ring_call(s, caller, throw_at, where);
    }
    for (const rt::RingRange& r : rt::thread_lease(0).ring.ranges) {
      EXPECT(r.released, "call ", call, ": every range is released after the call");
    }
    EXPECT(rt::thread_lease(0).ring.retired.empty(), "call ", call, ": nothing retired after");
    if (!failures.empty() || !fake::violations().empty()) {
      failures.push_back(rt::msg("first seen in call ", call));
      return;
    }
  }
}

// ------------------------------------------------------------------ leases

CASE(lease_pool_is_bounded_by_threads_alive_at_once) {
  // 4 threads alive at once take 4 leases; 12 later threads, one after another, and then
  // 4 at once again, take those back: the pool never holds more than 4, and nothing new
  // is created (streams, events) after the first round.
  constexpr int kAlive = 4;
  std::vector<const rt::Lease*> leases;
  std::mutex mutex;
  auto round = [&](int threads) {
    std::vector<std::thread> pool;
    std::atomic<int> arrived{0};
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        rt::Lease& lease = rt::thread_lease(0);
        (void)lease.worker(1);
        {
          std::lock_guard<std::mutex> lock(mutex);
          leases.push_back(&lease);
        }
        ++arrived;
        while (arrived.load() < threads) std::this_thread::yield();  // all alive at once
      });
    }
    for (std::thread& t : pool) t.join();
  };
  round(kAlive);
  const int64_t streams = fake::streams_created(), events = fake::events_created();
  for (int k = 0; k < 12; ++k) round(1);
  round(kAlive);
  const std::set<const rt::Lease*> distinct(leases.begin(), leases.end());
  EXPECT(as_int(distinct.size()) == kAlive, as_int(distinct.size()), " leases for ", kAlive,
         " threads alive at once");
  EXPECT(fake::streams_created() == streams && fake::events_created() == events,
         "later threads create no streams or events");
}

CASE(lease_is_not_shared_by_live_threads_and_reused_after_exit) {
  cudaStream_t a0 = nullptr, b0 = nullptr, c0 = nullptr;
  std::atomic<int> arrived{0};
  std::thread a([&] {
    a0 = rt::thread_lease(0).worker(0).handle;
    ++arrived;
    while (arrived.load() < 2) std::this_thread::yield();
  });
  std::thread b([&] {
    b0 = rt::thread_lease(0).worker(0).handle;
    ++arrived;
    while (arrived.load() < 2) std::this_thread::yield();
  });
  a.join();
  b.join();
  EXPECT(a0 != b0, "two live threads have different worker streams");
  run_in_thread([&] { c0 = rt::thread_lease(0).worker(0).handle; });
  EXPECT(c0 == a0 || c0 == b0, "a later thread reuses a lease given back at exit");
  // Another device is another lease, even in the same thread.
  run_in_thread([&] {
    EXPECT(&rt::thread_lease(0) != &rt::thread_lease(1), "one lease per device");
    EXPECT(rt::thread_lease(1).device == 1, "the lease knows its device");
  });
}

CASE(lease_holds_at_most_its_streams_and_events_per_call) {
  rt::Lease& lease = rt::thread_lease(0);
  (void)lease.worker(2 * rt::kMaxWorkers - 1);
  (void)lease.worker(rt::kRingStream);
  for (const int64_t k : {rt::kRingStream + 1, int64_t{-1}}) {
    bool refused = false;
    try {
      (void)lease.worker(k);
    } catch (const std::runtime_error& e) {
      refused = std::strstr(e.what(), "out of range") != nullptr;
    }
    EXPECT(refused, "stream ", k, " is refused");
  }
  EXPECT(as_int(lease.workers.size()) == rt::kRingStream + 1, "at most ",
         rt::kRingStream + 1, " streams in a lease");
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  rt::Streams streams(0);
  bool refused = false;
  try {
    (void)streams.events(4097);
  } catch (const std::runtime_error&) {
    refused = true;
  }
  EXPECT(refused, "more than 4096 events per call are refused");
}

CASE(lease_creates_only_the_streams_it_uses) {
  // A pool of 4 workers and the ring stream (position 64): 5 streams, 5 events, not
  // every position up to the ring stream's. A stream is created on its first use, kept
  // for the next, and one at a position below another taken earlier (a copy stream at
  // `pool`) is created then, in its own place.
  (void)rt::thread_lease(0);  // creates the lease's caller event
  const int64_t streams = fake::streams_created(), events = fake::events_created();
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  std::vector<rt::Stream> used;
  {
    rt::Streams call(0);
    for (int64_t j = 0; j < 4; ++j) used.push_back(call.worker(j));
    used.push_back(call.ring_stream());
  }
  EXPECT(fake::streams_created() - streams == 5, "a pool of 4 and the ring stream create ",
         fake::streams_created() - streams, " streams, expected 5");
  EXPECT(fake::events_created() - events == 5, "and ", fake::events_created() - events,
         " events, expected 5");
  std::set<cudaStream_t> handles;
  std::set<cudaEvent_t> stream_events;
  std::set<const rt::Workspace*> workspaces;
  for (size_t k = 0; k < used.size(); ++k) {
    const int64_t position = k < 4 ? as_int(k) : rt::kRingStream;
    EXPECT(used[k].handle != nullptr && used[k].event != nullptr &&
               used[k].workspace != nullptr && used[k].worker == position,
           "stream ", position, " has its handle, event, workspace and position");
    handles.insert(used[k].handle);
    stream_events.insert(used[k].event);
    workspaces.insert(used[k].workspace);
  }
  EXPECT(handles.size() == 5 && stream_events.size() == 5 && workspaces.size() == 5,
         "each stream its own handle, event and workspace");
  {
    rt::Streams call(0);
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT(call.worker(j).handle == used[static_cast<size_t>(j)].handle,
             "worker ", j, " is reused");
    }
    EXPECT(call.ring_stream().handle == used[4].handle, "the ring stream is reused");
    EXPECT(fake::streams_created() - streams == 5, "reuse creates nothing");
    const rt::Stream copy = call.copy_stream(4);
    EXPECT(copy.worker == 4 && handles.count(copy.handle) == 0 &&
               fake::streams_created() - streams == 6 && fake::events_created() - events == 6,
           "the copy stream of a pool of 4 is one more stream, at position 4");
  }
}

CASE(lease_caller_workspaces_are_bounded_and_kept_per_stream) {
  // A call that runs GEMMs on the caller's stream claims that stream's workspace: the same
  // one call after call, one per stream, and none past kCallerWorkspaces streams.
  std::vector<cudaStream_t> callers;
  std::vector<const rt::Workspace*> claimed;
  for (size_t k = 0; k <= rt::Lease::kCallerWorkspaces; ++k) {
    callers.push_back(fake::new_stream(rt::msg("caller ", as_int(k))));
    (void)torch_set_current_cuda_stream(callers.back(), 0);
    const rt::Streams streams(0, /*caller_gemms=*/true);
    claimed.push_back(streams.caller().workspace);
  }
  const std::set<const rt::Workspace*> distinct(claimed.begin(), claimed.end() - 1);
  EXPECT(as_int(distinct.size()) == as_int(rt::Lease::kCallerWorkspaces) &&
             distinct.count(nullptr) == 0,
         "one workspace per caller stream up to the bound");
  EXPECT(claimed.back() == nullptr, "none past the bound: those GEMMs take cublasGemmEx");
  (void)torch_set_current_cuda_stream(callers[1], 0);
  {
    const rt::Streams again(0, /*caller_gemms=*/true);
    EXPECT(again.caller().workspace == claimed[1], "a stream keeps its workspace");
    const rt::Streams no_gemms(0);
    EXPECT(no_gemms.caller().workspace == nullptr, "a call without caller GEMMs claims none");
  }
}

// ------------------------------------------------------------------ Streams: fork and join

// A loop over `pool` workers as the generator writes it: fork (each worker waits for the
// caller's stream), one kernel per slice writing its rows of a kept output and reading an
// input the caller's stream wrote first; throws in slice `throw_at` (-1: never).
struct Loop {
  std::vector<fake::Op> kernels;
  std::vector<cudaStream_t> workers;
  fake::Op producer, after;
  bool threw = false;
  cudaStream_t current_after = nullptr;
};

Loop loop(int64_t pool, int64_t slices, int64_t throw_at, bool second_loop = false) {
  Loop l;
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  try {
    rt::Streams streams(0);
    const rt::Stream main_stream = streams.current();
    rt::Buffer in = streams.keep(rt::empty({slices * 64}, rt::DType::Float32, 0, "loop"));
    rt::Buffer out = streams.keep(rt::empty({slices * 64}, rt::DType::Float32, 0, "loop"));
    l.producer = fake::kernel(caller, "producer of the input",
                              {fake::writes(in.data, slices * 256)});
    for (int rep = 0; rep < (second_loop ? 2 : 1); ++rep) {
      for (int64_t j = 0; j < pool; ++j) {
        streams.set_current(streams.worker(j));
        streams.wait(main_stream);
        if (rep == 0) l.workers.push_back(streams.current().handle);
      }
      for (int64_t i = 0; i < slices; ++i) {
        streams.set_current(streams.worker(i % pool));
        if (rep == 1 && i == throw_at) throw std::runtime_error("mid-loop");
        l.kernels.push_back(fake::kernel(
            streams.current().handle, rt::msg("kernel ", i),
            {fake::reads(in.data + i * 256, 256), fake::writes(out.data + i * 256, 256)}));
        if (rep == 0 && !second_loop && i == throw_at) throw std::runtime_error("mid-loop");
      }
      streams.set_current(main_stream);
      for (int64_t j = 0; j < pool; ++j) streams.wait(streams.worker(j));
      // The caller's stream gets work between the loops: the second fork must order the
      // workers after it.
      if (rep == 0 && second_loop) {
        l.producer = fake::kernel(caller, "caller's work between loops",
                                  {fake::writes(in.data, slices * 256)});
      }
    }
  } catch (const std::runtime_error&) {
    l.threw = true;
  }
  void* current = nullptr;
  (void)aoti_torch_get_current_cuda_stream(0, &current);
  l.current_after = static_cast<cudaStream_t>(current);
  l.after = fake::kernel(caller, "caller's next kernel", {});
  return l;
}

void expect_joined(const Loop& l) {
  for (const fake::Op& k : l.kernels) {
    EXPECT(fake::before(k, l.after), "'", fake::what(k),
           "' is ordered before the caller's next kernel");
  }
  EXPECT(fake::id(l.current_after) == l.after.stream, "the caller's stream is current again");
}

CASE(streams_fork_orders_workers_after_the_callers_stream) {
  const Loop l = loop(4, 8, -1);
  EXPECT(!l.threw, "the loop returned");
  for (const fake::Op& k : l.kernels) {
    EXPECT(fake::before(l.producer, k), "'", fake::what(k), "' follows the caller's work");
  }
  // The caller's event is recorded once for the 4 workers of the fork.
  int caller_records = 0;
  for (const fake::Record& r : fake::records()) caller_records += r.stream == l.after.stream;
  EXPECT(caller_records == 1, "one record of the caller's event per fork, got ",
         caller_records);
  expect_joined(l);
}

CASE(streams_join_on_return) {
  const Loop l = loop(4, 8, -1);
  EXPECT(!l.threw, "the loop returned");
  expect_joined(l);
}

CASE(streams_join_when_an_exception_is_thrown_mid_loop) {
  // Slice 5 throws on worker 1 after its kernel: workers 0..3 have work the caller's
  // stream has not waited for. After ~Streams: every kernel is ordered before the caller's
  // next kernel, the caller's stream is current, and the kept tensors were freed after the
  // join (the fake checks their free against the kernels).
  const Loop l = loop(4, 8, 5);
  EXPECT(l.threw, "the loop threw");
  EXPECT(as_int(l.kernels.size()) == 6, "6 kernels queued");
  expect_joined(l);
  for (const fake::Block& b : fake::blocks()) {
    EXPECT(b.freed, "the kept tensors are freed");
    for (const fake::Op& k : l.kernels) EXPECT(fake::before(k, b.free_point), "after the join");
  }
}

CASE(streams_join_after_the_caller_waited_and_a_second_loop_threw) {
  // The first loop joins; the caller's stream gets work; the second fork orders the
  // workers after it (the caller's event recorded again) and its slice 2 throws: the
  // second loop's kernels are joined too.
  const Loop l = loop(2, 4, 2, /*second_loop=*/true);
  EXPECT(l.threw, "the second loop threw");
  EXPECT(as_int(l.kernels.size()) == 6, "4 + 2 kernels queued, got ", as_int(l.kernels.size()));
  for (size_t k = 4; k < l.kernels.size(); ++k) {
    EXPECT(fake::before(l.producer, l.kernels[k]),
           "the second loop's kernels follow the caller's work between the loops");
  }
  expect_joined(l);
}

CASE(streams_release_frees_on_the_callers_stream_only) {
  // Streams::release while the caller's stream is current frees now (the host IR frees
  // only past the join of the tensor's users); while a worker is current the tensor stays
  // kept until the exit, after the join.
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  fake::Op kernel;
  int64_t ops_before_exit = 0;
  {
    rt::Streams streams(0);
    const rt::Stream main_stream = streams.current();
    rt::Buffer a = streams.keep(rt::empty({64}, rt::DType::Float32, 0, "op"));
    rt::Buffer b = streams.keep(rt::empty({64}, rt::DType::Float32, 0, "op"));
    const char* a_data = a.data;
    streams.set_current(streams.worker(0));
    streams.wait(main_stream);
    kernel = fake::kernel(streams.current().handle, "worker kernel",
                          {fake::writes(a.data, 256), fake::writes(b.data, 256)});
    streams.release(b);  // a worker is current: kept
    streams.set_current(main_stream);
    streams.wait(streams.worker(0));
    streams.release(a);  // the caller's stream, past the join of its user: freed now
    EXPECT(fake::blocks()[fake::block_of(a_data)].freed, "a is freed at its release");
    EXPECT(!fake::blocks()[1].freed, "b stays kept");
    ops_before_exit = as_int(fake::ops().size());
  }
  EXPECT(fake::blocks()[1].freed && fake::blocks()[1].freed_after_ops == ops_before_exit,
         "b is freed at the exit");
  EXPECT(fake::before(kernel, fake::blocks()[1].free_point), "after the worker's kernel");
}

CASE(streams_events_are_fresh_in_each_call) {
  // The lease's events are reused call after call, but a wait for an event not recorded
  // in this call is no wait at all (the record of an earlier call must not order it).
  const cudaStream_t caller = fake::new_stream("caller");
  (void)torch_set_current_cuda_stream(caller, 0);
  cudaEvent_t first = nullptr;
  {
    rt::Streams streams(0);
    rt::Events e = streams.events(2);
    streams.set_current(streams.worker(0));
    (void)fake::kernel(streams.current().handle, "call 1's kernel", {});
    streams.record(e, 1);
    first = rt::thread_lease(0).events[e.base + 1];
    rt::Events more = streams.events(3);
    EXPECT(more.base == 2, "a second array of the call follows the first: base ",
           as_int(more.base));
  }
  const size_t waits_before = fake::waits().size();
  {
    rt::Streams streams(0);
    rt::Events e = streams.events(2);
    EXPECT(rt::thread_lease(0).events[e.base + 1] == first, "the lease's event is reused");
    streams.set_current(streams.worker(1));
    streams.wait(e, 1);  // not recorded in this call: no wait
    const std::vector<fake::Wait> waits = fake::waits();
    bool waited = false;
    for (size_t k = waits_before; k < waits.size(); ++k) {
      waited = waited || waits[k].event == fake::id(first);
    }
    EXPECT(!waited, "no wait for the event's record in the previous call");
    streams.record(e, 1);
    streams.set_current(streams.worker(2));
    streams.wait(e, 1);
    EXPECT(fake::waits().back().event == fake::id(first), "a wait once it was recorded");
  }
  EXPECT(rt::thread_lease(0).events.size() == 5, "the lease kept the 5 events of call 1");
}

// ------------------------------------------------------------------ host.h: pinned inputs

// One call keeping a pinned host tensor, whose last reference the caller then drops.
AtenTensorHandle call_with_pinned_input(cudaStream_t caller, bool synchronized = false) {
  (void)torch_set_current_cuda_stream(caller, 0);
  AtenTensorHandle handle = fake::host_tensor();
  {
    rt::HostTensors host_tensors(0, "op");
    {
      rt::HostBuffer w;
      w.tensor = torch::stable::Tensor(handle);
      w.pinned = true;
      host_tensors.keep(w);
    }
    rt::Streams streams(0);
    const rt::Stream main_stream = streams.current();
    streams.set_current(streams.worker(0));
    streams.wait(main_stream);
    (void)fake::kernel(streams.current().handle, "copy from the pinned input", {});
    if (synchronized) {
      streams.set_current(main_stream);
      streams.wait(streams.worker(0));
      rt::synchronize(main_stream, "op");
      host_tensors.synchronized();
    }
  }
  return handle;
}

CASE(pinned_inputs_are_kept_until_the_callers_stream_passes_the_call) {
  const cudaStream_t caller = fake::new_stream("caller");
  const AtenTensorHandle w = call_with_pinned_input(caller);
  EXPECT(!fake::deleted(w), "kept after the call");
  const std::vector<fake::Record> records = fake::records();
  EXPECT(!records.empty() && records.back().stream == fake::id(caller),
         "its event is recorded on the caller's stream");
  const AtenTensorHandle w2 = call_with_pinned_input(caller);
  EXPECT(!fake::deleted(w), "still kept while its event has not passed");
  fake::finish_all();
  { rt::HostTensors next(0, "op"); }
  EXPECT(fake::deleted(w) && fake::deleted(w2), "released once the event passed");
  const AtenTensorHandle w3 = call_with_pinned_input(caller, /*synchronized=*/true);
  EXPECT(fake::deleted(w3), "not kept after the host waited for the caller's stream");
}

CASE(pinned_inputs_pending_are_bounded) {
  // Past 64 pending calls the oldest is waited for (one host wait) and released.
  const cudaStream_t caller = fake::new_stream("caller");
  std::vector<AtenTensorHandle> inputs;
  for (size_t k = 0; k < rt::PendingHostTensors::kMaxPending; ++k) {
    inputs.push_back(call_with_pinned_input(caller));
  }
  EXPECT(fake::host_waits() == 0, "no host wait up to the bound");
  inputs.push_back(call_with_pinned_input(caller));
  EXPECT(fake::host_waits() == 1, "one host wait past it, got ", fake::host_waits());
  EXPECT(fake::deleted(inputs[0]) && !fake::deleted(inputs[1]), "the oldest is released");
}

}  // namespace

// ------------------------------------------------------------------ driver

static int run_case(const Case& c) {
  c.run();
  for (const std::string& v : fake::violations()) failures.push_back("the fake saw: " + v);
  if (failures.empty()) {
    std::printf("PASS %s\n", c.name);
    return 0;
  }
  std::printf("FAIL %s:", c.name);
  for (const std::string& f : failures) std::printf(" [%s]", f.c_str());
  std::printf("\n");
  return 1;
}

int main(int argc, char** argv) {
  std::vector<const Case*> selected;
  for (const Case& c : cases()) {
    bool wanted = argc < 2;
    for (int a = 1; a < argc; ++a) wanted = wanted || std::strcmp(argv[a], c.name) == 0;
    if (wanted) selected.push_back(&c);
  }
  if (argc >= 2 && as_int(selected.size()) != argc - 1) {
    std::printf("FAIL unknown case among the arguments\n");
    return 2;
  }
  int failed = 0;
  for (const Case* c : selected) {
    std::fflush(stdout);
    const pid_t pid = fork();  // a fresh lease pool and fake per case
    if (pid == 0) {
      const int rc = run_case(*c);
      std::fflush(stdout);
      _exit(rc);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failed;
      if (!WIFEXITED(status)) std::printf("FAIL %s: crashed (status %d)\n", c->name, status);
    }
  }
  std::printf("%d of %d cases failed\n", failed, static_cast<int>(selected.size()));
  return failed == 0 ? 0 : 1;
}
