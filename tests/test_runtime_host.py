"""The runtime's state across calls on the CPU: the staging ring (ring.h), the leased
streams and the join on every exit (stream.h), the events and pinned host tensors kept
between calls (stream.h, host.h), run against a fake CUDA runtime and torch shim
(tests/fake_cuda/) that records streams as queues, events as snapshots and waits as edges,
and checks every access to device memory against them. The cases are C++
(test_runtime_host.cpp), each run in its own process; one test here per case."""

import subprocess
from pathlib import Path

import pytest
from test_copy import TESTS, cxx

CASES = [
    "fake_orders_by_events_and_catches_races_and_early_frees",
    "ring_slot_takes_the_next_bytes",
    "ring_wraps_to_the_start_when_the_next_slice_does_not_fit",
    "ring_reused_range_waits_for_exactly_its_last_reader",
    "ring_release_is_by_address_on_the_current_stream",
    "ring_grows_when_its_capacity_is_below_slots_times_the_slice",
    "ring_grows_when_the_next_bytes_are_held_in_this_call",
    "ring_allocation_failure_leaves_an_empty_ring",
    "ring_range_left_by_an_exception_is_released_on_the_callers_stream",
    "ring_range_taken_before_an_exception_before_its_gemm",
    "ring_wait_failing_while_the_ring_grows_leaves_each_event_owned_once",
    "ring_capture_is_refused_before_anything_is_queued",
    "ring_goes_with_the_lease_to_the_next_thread",
    "ring_random_calls_never_race",
    "lease_pool_is_bounded_by_threads_alive_at_once",
    "lease_is_not_shared_by_live_threads_and_reused_after_exit",
    "lease_holds_at_most_its_streams_and_events_per_call",
    "lease_creates_only_the_streams_it_uses",
    "lease_caller_workspaces_are_bounded_and_kept_per_stream",
    "streams_fork_orders_workers_after_the_callers_stream",
    "streams_join_on_return",
    "streams_join_when_an_exception_is_thrown_mid_loop",
    "streams_join_after_the_caller_waited_and_a_second_loop_threw",
    "streams_release_frees_on_the_callers_stream_only",
    "streams_events_are_fresh_in_each_call",
    "pinned_inputs_are_kept_until_the_callers_stream_passes_the_call",
    "pinned_inputs_pending_are_bounded",
]


def build(folder: Path) -> Path:
    """The cases and the fake, with the programs' flags; links neither libcudart nor
    libtorch (the fake defines what the headers call)."""
    return cxx(TESTS / "test_runtime_host.cpp", folder / "runtime_host",
               str(TESTS / "fake_cuda" / "fake_cuda.cpp"), f"-I{TESTS}", "-pthread")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's line of output ("PASS name" or "FAIL name: why"), by name."""
    binary = build(tmp_path_factory.mktemp("runtime_host"))
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    lines: dict[str, str] = {}
    for line in run.stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("PASS", "FAIL"):
            lines.setdefault(rest.partition(":")[0], line)
    assert lines, run.stdout + run.stderr
    return lines


def test_every_case_is_run_and_reported(verdicts: dict[str, str]) -> None:
    assert sorted(verdicts) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_runtime_host(verdicts: dict[str, str], case: str) -> None:
    line = verdicts.get(case, f"FAIL {case}: not run")
    assert line == f"PASS {case}", line
