"""The stream-order checker (codegen.interp.races): every bundled program is ordered, at every
pool size, with ragged slices and more slices than streams; and each way of breaking the
order that the passes guard against is caught and named (so the checker can fail)."""

import dataclasses

import pytest
import torch

import codegen as cg
from codegen import distributed
from codegen import hostir as hir
from codegen.examples import DISTRIBUTED_EXAMPLES, EXAMPLES
from codegen.frontend.ir import Const, ParallelType
from codegen.interp import races


def zeros(example, shapes=None):
    program = cg.lower(example.make())
    return [torch.zeros(s, dtype=t.dtype) for t, s in zip(program.inputs, shapes or example.shapes)]


def rewrite(nodes, fn):
    """``nodes`` with ``fn(node)`` (a list of nodes) in place of each node, loop bodies
    included (a loop's body is rewritten before ``fn`` sees the loop)."""
    out = []
    for n in nodes:
        if isinstance(n, hir.ForLoop):
            n = dataclasses.replace(n, body=rewrite(n.body, fn))
        out += fn(n)
    return out


def without(program, drop):
    return program.replace(body=rewrite(program.body, lambda n: [] if drop(n) else [n]))


def is_fork(n):
    return isinstance(n, hir.ForLoop) and any(isinstance(c, hir.SetCurrentStream) for c in n.body) \
        and n.parallel is ParallelType.Serial


def is_join(n):
    return isinstance(n, hir.ForLoop) and n.parallel is ParallelType.Serial and \
        all(isinstance(c, hir.Synchronize) for c in n.body)


def kinds(program, inputs):
    return {r.kind for r in races.find_races(program, inputs)}


@pytest.mark.parametrize("pool", [1, 2, 3, 4])
@pytest.mark.parametrize("name", [*EXAMPLES, *DISTRIBUTED_EXAMPLES])
def test_bundled_programs_are_ordered(name, pool):
    example = {**EXAMPLES, **DISTRIBUTED_EXAMPLES}[name]
    program = cg.lower(example.make(), pool_size=pool)
    races.check(program, zeros(example))


@pytest.mark.parametrize("slices,pool", [(8, 3), (7, 2), (16, 4), (5, 8)])
def test_host_staging_with_more_slices_than_slots_is_ordered(slices, pool):
    """Slot reuse (slot i % pool, on stream i % pool) in both directions, ragged."""
    from codegen import examples

    for fusion in (examples.stream_weights(torch.float32, slices),
                   examples.offload_activations(torch.float32, slices)):
        program = cg.lower(fusion, pool_size=pool)
        races.check(program, [torch.zeros(11, 6), torch.zeros(6, 13)])


OFFLOAD = EXAMPLES["offload_activations"]


def offload(pool=4):
    return cg.lower(OFFLOAD.make(), pool_size=pool)


def test_missing_fork_leaves_inputs_and_new_allocations_unordered():
    """Without the fork, the workers are ordered neither after the caller's writes of the
    GPU input nor after the staging allocations (made on the caller's stream)."""
    program = without(offload(), is_fork)
    races_ = races.find_races(program, zeros(OFFLOAD))
    assert {r.kind for r in races_} == {"read before write", "use before allocation"}
    assert any(r.tensor == "T1" and "T1 written by main_stream before the call" in str(r)
               and "Matmul(T0_s, T1, out=T2_s) on Stream(1) [i=1]" in str(r) for r in races_)
    assert any(r.tensor == "T0_stage" and r.kind == "use before allocation"
               and "Copy(T0_i, out=T0_s) on Stream(2) [i=2]" in str(r) for r in races_)


def test_missing_join_leaves_outputs_temporaries_and_inputs_unordered():
    program = without(offload(), is_join)
    found = races.find_races(program, zeros(OFFLOAD))
    assert {r.kind for r in found} == {"free while in use", "output not ready",
                                       "still read at the return", "stream not joined"}
    assert sorted(str(r) for r in found if r.kind == "stream not joined") == [
        f"stream not joined: Stream({k}) got work, and main_stream never waits for it after "
        "its last work" for k in range(4)]


def test_missing_host_wait_leaves_a_host_output_unready():
    program = without(offload(), lambda n: isinstance(n, hir.StreamSynchronize))
    races_ = races.find_races(program, zeros(OFFLOAD))
    assert {r.kind for r in races_} == {"output not ready"}
    assert all("T2 read by the host after the return" in str(r) for r in races_)


def test_a_slot_shared_by_two_streams_races_between_its_users():
    """Iterations i and i + 4 share slot i % 4: on 8 streams nothing orders them."""
    program = offload()

    def eight_streams(n):
        if isinstance(n, hir.SetCurrentStream) and isinstance(n.stream, hir.Stream) \
                and n.stream.index == "i":
            return [hir.SetCurrentStream(hir.Stream("i", 8))]
        if is_fork(n) or is_join(n):
            return [dataclasses.replace(n, stop=Const(8))]
        return [n]

    program = program.replace(body=rewrite(program.body, eight_streams))
    races_ = races.find_races(program, zeros(OFFLOAD))
    assert {r.kind for r in races_} == {"write after read", "write after write"}
    assert any(r.tensor == "T0_stage" and r.kind == "write after read"
               and "Copy(T0_i, out=T0_s) on Stream(4) [i=4]" in str(r)
               and "Matmul(T0_s, T1, out=T2_s) on Stream(0) [i=0]" in str(r) for r in races_)


def test_a_staging_buffer_freed_before_the_join_is_in_use():
    program = offload()
    frees = [n for n in program.body if isinstance(n, hir.Deallocate)]
    rest = [n for n in program.body if not isinstance(n, hir.Deallocate)]
    loop = next(k for k, n in enumerate(rest) if isinstance(n, hir.ForLoop)
                and n.parallel is ParallelType.Stream)
    program = program.replace(body=rest[:loop + 1] + frees + rest[loop + 1:])
    races_ = races.find_races(program, zeros(OFFLOAD))
    assert {r.kind for r in races_} == {"free while in use"}
    assert {r.tensor for r in races_} == {"T0_stage", "T2_stage"}


def test_a_slot_read_before_its_copy_and_an_output_never_written():
    no_copy_in = without(offload(), lambda n: isinstance(n, hir.Copy) and n.src == "T0_i")
    assert kinds(no_copy_in, zeros(OFFLOAD)) == {"uninitialized read"}
    no_gemm = without(offload(), lambda n: isinstance(n, hir.Matmul))
    races_ = races.find_races(no_gemm, zeros(OFFLOAD))
    assert "uninitialized read" in {r.kind for r in races_}  # the copies out read nothing
    assert "T2 read by the host after the return, but nothing wrote them" in str(races.find_races(
        without(offload(), lambda n: isinstance(n, hir.Copy) and n.out == "T2_i"),
        zeros(OFFLOAD))[0])


def test_a_collective_not_waited_for_is_read_unordered():
    example = DISTRIBUTED_EXAMPLES["allgather_matmul_2x4"]
    program = without(cg.lower(example.make()), lambda n: isinstance(n, distributed.Wait))
    races_ = races.find_races(program, zeros(example))
    assert {r.kind for r in races_} == {"read before write", "free while in use",
                                        "still read at the return"}
    assert any("collective stream of comm_i" in str(r) and r.tensor == "x_gathered"
               for r in races_)


def test_check_names_the_program_the_shapes_and_the_first_races():
    with pytest.raises(cg.InternalError) as e:
        races.check(without(offload(), is_fork), zeros(OFFLOAD))
    text = str(e.value)
    # 13 rows in 8 slices of 2: slices 0-5 full, 6 one row, 7 empty. Slices 0-6 make four
    # unordered uses of the staging buffers each, and all 8 read T1 unordered.
    assert "offload_activations: 36 unordered accesses for inputs T0: [13, 16], T1: [16, 10]" \
        in text, text
    assert "read before write on T1 (160 elements)" in text
    assert "... and 28 more" in text
