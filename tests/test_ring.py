"""Host slices staged in the thread's staging ring (``lower(..., staging="ring")``): the
host IR, the evaluator against torch, the stream-order checker (with a release moved
before its reader caught), the C++ and its build, and bad options."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import ints

import codegen as cg
from codegen import examples
from codegen import hostir as hir
from codegen.frontend.ir import Const
from codegen.interp import races

RING_LINEAR = """\
HostProgram offload_linear(x: bfloat16[m, k], w: bfloat16[n, k] device=cpu) -> (T2) [staging=ring]:
  main_stream = GetCurrentStream()
  T2 = Allocate(bfloat16[m, n])
  for j in range(0, 4):
    SetCurrentStream(Stream(j))
    Synchronize(main_stream)
  for i in range(0, 8) [Stream]:
    SetCurrentStream(RingStream)
    w_i = ShardByStream(w, axis=0, index=i, chunk=ceilDiv(n, 8))
    w_s = RingSlot(like=w_i, slots=5)
    Copy(w_i, out=w_s)
    SetCurrentStream(Stream(i % 4))
    Synchronize(RingStream)
    T2_i = ShardByStream(T2, axis=1, index=i, chunk=ceilDiv(n, 8))
    Linear(x, w_s, out=T2_i)
    ReleaseRingSlot(w_s)
  SetCurrentStream(main_stream)
  for j in range(0, 4):
    Synchronize(Stream(j))
  Synchronize(RingStream)
  return T2"""


def host_linear(dtype=torch.bfloat16, slices=8, bias=False, name="offload_linear"):
    return examples.offload_linear(dtype, slices, bias, name=name)


def test_ring_linear_prints_as_expected():
    """No staging allocation, no fork of the ring stream (only its join), a slot taken on
    the ring stream and released right after its one reader, on the reader's stream."""
    assert str(cg.lower(host_linear(), staging="ring")) == RING_LINEAR


def test_slots_program_is_unchanged_by_the_option():
    assert cg.lower(host_linear()).staging == "slots"
    assert "RingSlot" not in str(cg.lower(host_linear()))
    assert "RingSlot" not in str(cg.lower(host_linear(), copy_stream=True))


@pytest.mark.parametrize("slices", [1, 2, 3, 8])
@pytest.mark.parametrize("pool", [1, 2, 4])
def test_mlps_with_host_weights_match_torch_and_are_ordered(slices, pool):
    torch.manual_seed(slices * 10 + pool)
    m, h, i = 6, 8, 20
    x, wg, wu, wd = ints(m, h), ints(i, h), ints(i, h), ints(h, i)
    program = cg.lower(examples.llama_mlp(torch.float32, slices, weights="cpu"),
                       pool_size=pool, staging="ring")
    (y,) = cg.evaluate(program, [x, wg, wu, wd])
    expect = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert torch.allclose(y, expect, rtol=1e-5, atol=1e-3)  # silu: not exact on integers
    assert races.find_races(program, [x, wg, wu, wd]) == []
    ringed = any(isinstance(n, hir.RingSlot) for n in program.nodes())
    assert ringed == (slices > 1 and pool > 1)  # a one-stream loop keeps its slots

    b1, w2, b2 = ints(i), ints(h, i), ints(h)
    program = cg.lower(examples.gpt_mlp(torch.float32, slices, weights="cpu"),
                       pool_size=pool, staging="ring")
    (y,) = cg.evaluate(program, [x, wg, b1, w2, b2])
    expect = F.linear(F.gelu(F.linear(x, wg, b1), approximate="tanh"), w2, b2)
    assert torch.allclose(y, expect, rtol=1e-5, atol=1e-4)
    assert races.find_races(program, [x, wg, b1, w2, b2]) == []


def test_linear_with_host_bias():
    x, w, b = ints(5, 16), ints(24, 16), ints(24)
    program = cg.lower(host_linear(torch.float32, bias=True), staging="ring")
    (y,) = cg.evaluate(program, [x, w, b])
    assert torch.equal(y, F.linear(x, w, b))
    assert races.find_races(program, [x, w, b]) == []
    assert sum(isinstance(n, hir.RingSlot) for n in program.nodes()) == 2


def _moved_release(program: hir.HostProgram) -> hir.HostProgram:
    """``program`` with each loop's first ReleaseRingSlot moved before the slot's reader."""

    def move(loop: hir.ForLoop) -> hir.ForLoop:
        body = list(loop.body)
        k = next(k for k, n in enumerate(body) if isinstance(n, hir.ReleaseRingSlot))
        release = body.pop(k)
        reader = next(k for k, n in enumerate(body) if isinstance(n, hir.Compute)
                      and release.slot in n.uses())
        body.insert(reader, release)
        return dataclasses.replace(loop, body=body)

    return program.replace(body=[move(n) if isinstance(n, hir.ForLoop) and any(
        isinstance(c, hir.ReleaseRingSlot) for c in n.body) else n for n in program.body])


def test_a_release_before_its_reader_is_caught():
    program = cg.lower(host_linear(torch.float32), staging="ring")
    x, w = ints(5, 16), ints(24, 16)
    broken = _moved_release(program)
    found = races.find_races(broken, [x, w])
    assert {r.kind for r in found} == {"use after release"}, found
    assert "w_s" in str(found[0])
    with pytest.raises(cg.InternalError, match="uses w_s before it is defined"):
        hir.verify(broken)


def test_a_missing_ring_wait_is_caught():
    """Without the worker's wait for the ring stream, the GEMM may read the slot before
    its copy lands."""
    program = cg.lower(host_linear(torch.float32), staging="ring")
    loop = next(n for n in program.body if isinstance(n, hir.ForLoop)
                and n.parallel is cg.ParallelType.Stream)
    body = [n for n in loop.body if not (isinstance(n, hir.Synchronize)
                                         and isinstance(n.stream, hir.RingStream))]
    broken = program.replace(body=[dataclasses.replace(n, body=body) if n is loop else n
                                   for n in program.body])
    found = races.find_races(broken, [ints(5, 16), ints(24, 16)])
    assert any(r.kind == "read before write" for r in found), found


def test_the_cpp_takes_and_releases_ring_slots():
    source = cg.render(cg.lower(host_linear(), staging="ring"))
    assert "rt::RingCall ring(device, op);" in source
    assert source.index("rt::RingCall ring") < source.index("rt::Streams streams")
    assert "const rt::View w_s = ring.slot(streams, w_i, 5);" in source
    assert "ring.release(streams, w_s);" in source
    assert "streams.set_current(streams.ring_stream());" in source
    assert "rt::staging(" not in source  # no per-call staging


@pytest.mark.build
def test_ring_program_builds_and_loads(cache_dir):
    op = cg.compile(host_linear(name="ring_build"), staging="ring")
    assert "RingSlot" in str(op.host_ir) and hasattr(torch.ops.codegen, op.name.split("::")[1])


def test_the_ring_is_part_of_the_op_name():
    from codegen.backend.renderer import op_name

    assert op_name(cg.lower(host_linear(), staging="ring")) != \
        op_name(cg.lower(host_linear(), copy_stream=True))


def test_a_backward_of_a_ring_program_stages_in_the_ring_and_is_ordered():
    x = ints(5, 16).requires_grad_()
    w = ints(24, 16).requires_grad_()
    program = cg.lower(host_linear(torch.float32), staging="ring")
    (y,) = cg.evaluate(program, [x, w])
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones(5, 24) @ w.detach())
    assert torch.equal(w.grad, torch.ones(5, 24).T @ x.detach())
    assert w.grad.device.type == "cpu"


@pytest.mark.parametrize("bad", ["rings", None, 1])
def test_bad_staging_is_a_schedule_error(bad):
    with pytest.raises(cg.ScheduleError, match=r"lower: staging must be one of 'slots', 'ring'"):
        cg.lower(host_linear(), staging=bad)


def _release_between_view_and_reader(program: hir.HostProgram) -> hir.HostProgram:
    """``program`` with the GEMM reading ``w_v``, a view of the ring slot ``w_s`` taken
    before the slot's release, and the release moved between the view and the GEMM."""
    loop = next(n for n in program.body if isinstance(n, hir.ForLoop)
                and n.parallel is cg.ParallelType.Stream)
    body = list(loop.body)
    release = next(n for n in body if isinstance(n, hir.ReleaseRingSlot))
    body.remove(release)
    k = next(k for k, n in enumerate(body) if isinstance(n, hir.Compute))
    shard = next(n for n in body if isinstance(n, hir.ShardByStream) and n.tensor == "w")
    view = dataclasses.replace(shard, out="w_v", tensor="w_s", index="z", chunk=shard.chunk)
    gemm = body[k].renamed({"w_s": "w_v"})
    inner = hir.ForLoop("z", Const(0), Const(1), [view, release, gemm])
    body[k] = inner
    return program.replace(body=[dataclasses.replace(n, body=body) if n is loop else n
                                 for n in program.body])


def test_a_use_through_a_view_after_the_release_is_caught():
    program = cg.lower(host_linear(torch.float32, slices=4), staging="ring")
    found = races.find_races(_release_between_view_and_reader(program),
                             [ints(5, 16), ints(4, 16)])
    assert [r.kind for r in found] == ["use after release"], found


def test_the_release_follows_readers_of_views_and_nested_loops():
    """The rule that places a slot's release (and, per-call, its RecordEvent) after its
    last reader: a node reading a view of the slot, or a loop nesting one, reads it; the
    view's definition, the slot's taking and its filling Copy do not."""
    program = cg.lower(host_linear(torch.float32, slices=4), staging="ring")
    loop = next(n for n in _release_between_view_and_reader(program).body
                if isinstance(n, hir.ForLoop) and n.parallel is cg.ParallelType.Stream)
    body = [n for n in loop.body if not isinstance(n, hir.ForLoop)]
    inner = next(n for n in loop.body if isinstance(n, hir.ForLoop))
    view = inner.body[0]
    body.append(view)
    nested = dataclasses.replace(inner, body=[inner.body[2]])
    body.append(nested)
    assert hir._reads(nested, "w_s", body)
    assert not hir._reads(view, "w_s", body)  # defines the view, reads nothing
    assert not any(hir._reads(n, "w_s", body) for n in body
                   if isinstance(n, (hir.RingSlot, hir.Copy)))
