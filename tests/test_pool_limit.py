"""A program's pool of worker streams is bounded: ``lower`` refuses pool_size above
MAX_POOL_SIZE, and the runtime's lease refuses a stream past that pool, its copy stream
and second set, and the ring stream (the two limits are one number)."""

import ctypes
import re

import pytest

import codegen as cg
from codegen import examples as ex
from codegen.backend.renderer import include_dir
from codegen.jit import build_library
from codegen.transforms.lowering import MAX_POOL_SIZE


def test_limit_is_pytorchs_stream_pool_size():
    assert MAX_POOL_SIZE == 32


def test_python_and_runtime_limits_agree():
    header = (include_dir() / "codegen" / "stream.h").read_text()
    (found,) = re.findall(r"inline constexpr int64_t kMaxWorkers = (\d+);", header)
    assert int(found) == MAX_POOL_SIZE


def test_pool_at_the_limit_lowers():
    program = cg.lower(ex.stream_weights(slices=2 * MAX_POOL_SIZE), pool_size=MAX_POOL_SIZE,
                       copy_stream=True)
    assert program.pool_size == MAX_POOL_SIZE
    assert f"SetCurrentStream(Stream(i % {MAX_POOL_SIZE}))" in str(program)
    source = cg.render(program)
    assert f"streams.worker(i % {MAX_POOL_SIZE})" in source
    assert f"streams.copy_stream({MAX_POOL_SIZE})" in source  # the lease's last stream


@pytest.mark.parametrize("pool", [MAX_POOL_SIZE + 1, 10**6])
@pytest.mark.parametrize("entry", [cg.lower, cg.compile])
def test_larger_pools_are_refused(entry, pool):
    with pytest.raises(cg.ScheduleError, match=re.escape(
            f"lower: pool_size must be at most {MAX_POOL_SIZE} (worker streams per thread, "
            f"kept for the process), got {pool}")):
        entry(ex.matmul_rows(slices=4), pool_size=pool)


HARNESS = r"""
#include "codegen/runtime.h"

#include <cstring>
#include <exception>

#define EXPORT extern "C" __attribute__((visibility("default")))

// kMaxWorkers; asks a fresh lease for stream k, which throws before any CUDA call when k
// is out of range: 1 and its message in out[0..size) if it threw, 0 if it did not.
EXPORT int64_t rtcheck_max_workers() { return codegen_rt::kMaxWorkers; }

EXPORT int rtcheck_worker_refused(int64_t k, char* out, int64_t size) {
  codegen_rt::Lease lease;
  try {
    (void)lease.worker(k);
    return 0;
  } catch (const std::exception& e) {
    std::strncpy(out, e.what(), static_cast<size_t>(size) - 1);
    out[size - 1] = '\0';
    return 1;
  }
}
"""


@pytest.fixture(scope="module")
def harness(cache_dir):
    lib = ctypes.CDLL(str(build_library("rtcheck_pool_limit", HARNESS)))
    lib.rtcheck_max_workers.restype = ctypes.c_int64
    lib.rtcheck_worker_refused.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    return lib


@pytest.mark.build
def test_runtime_limit_is_the_compiled_constant(harness):
    assert harness.rtcheck_max_workers() == MAX_POOL_SIZE


def test_the_ring_stream_is_the_position_after_both_sets():
    from codegen import hostir

    header = (include_dir() / "codegen" / "stream.h").read_text()
    assert "inline constexpr int64_t kRingStream = 2 * kMaxWorkers;" in header
    assert hostir.RING_POSITION == 2 * MAX_POOL_SIZE


@pytest.mark.parametrize("k", [2 * MAX_POOL_SIZE + 1, 10**6, -1])
@pytest.mark.build
def test_lease_refuses_streams_past_its_two_sets_of_workers(harness, k):
    out = ctypes.create_string_buffer(512)
    assert harness.rtcheck_worker_refused(k, out, len(out)) == 1
    assert out.value.decode() == (
        f"codegen: worker stream {k} is out of range: a lease holds streams 0 to "
        f"{2 * MAX_POOL_SIZE - 1} ({MAX_POOL_SIZE} workers and a second set, or the copy "
        f"stream; lower() refuses pool_size > {MAX_POOL_SIZE}) and the ring stream, "
        f"{2 * MAX_POOL_SIZE}")
