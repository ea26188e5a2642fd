"""One NCCL rank on cuda:0 runs both tensor-parallel examples through the evaluator: a
smoke test of the collective code path on the GPU (with one rank the collective is a
device copy; overlap needs several GPUs)."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ints

import codegen as cg
from codegen import distributed
from codegen.examples import allgather_matmul, matmul_reduce_scatter

pytestmark = [pytest.mark.gpu, pytest.mark.build]


def _init_one_nccl_rank(store_path):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 1), rank=0, world_size=1,
                            device_id=device, timeout=datetime.timedelta(seconds=120))


def _cases():
    """(make, dtype, slices, x, w, x @ w) for both examples, fp32 and bf16, S = 1, 2, 4."""
    for dtype in (torch.float32, torch.bfloat16):
        x = ints(64, 32, dtype=dtype, device="cuda", lo=-2, hi=3)
        w = ints(32, 48, dtype=dtype, device="cuda", lo=-2, hi=3)
        for slices in (1, 2, 4):
            for make in (allgather_matmul, matmul_reduce_scatter):
                yield make, dtype, slices, x, w, x @ w


def _worker(rank, store_path):
    _init_one_nccl_rank(store_path)
    try:
        for make, dtype, slices, x, w, expect in _cases():
            program = cg.lower(make(dtype, slices, 1))
            assert len(distributed.communications(program)) == 1
            (out,) = cg.evaluate(program, [x, w])
            torch.cuda.synchronize()
            assert out.is_cuda and torch.equal(out, expect), (make.__name__, dtype, slices)
        # Ordered against the caller's stream: a result consumed right away, no sync.
        program = cg.lower(allgather_matmul(torch.float32, 4, 1))
        x, w = ints(4096, 64, device="cuda"), ints(64, 256, device="cuda")
        (out,) = cg.evaluate(program, [x, w])
        assert torch.equal(out.sum(dim=1), (x @ w).sum(dim=1))
        with pytest.raises(ValueError, match="argument x axis 0 must have a size divisible by 4"):
            cg.evaluate(program, [ints(6, 64, device="cuda"), w])
    finally:
        dist.destroy_process_group()


def test_one_nccl_rank_matches_torch():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, (os.path.join(tmp, "store"),), nprocs=1)


def _compiled_worker(rank, store_path, cache_dir):
    os.environ["CODEGEN_CACHE_DIR"] = cache_dir
    _init_one_nccl_rank(store_path)
    try:
        for make, dtype, slices, x, w, expect in _cases():
            op = cg.compile(make(dtype, slices, 1, name=f"{make.__name__}_{slices}"))
            assert torch.equal(op(x, w), expect), (make.__name__, dtype, slices)  # default
            out = op(x, w, group=dist.group.WORLD)
            assert torch.equal(out, expect), (make.__name__, dtype, slices)
            # torch.ops directly: the default group's name is "0"
            assert torch.equal(op.op(x, w), expect)
        op = cg.compile(allgather_matmul(torch.float32, 4, 1))
        x, w = ints(4096, 64, device="cuda"), ints(64, 256, device="cuda")
        assert torch.equal(op(x, w).sum(dim=1), (x @ w).sum(dim=1))  # no sync in between
        with pytest.raises(RuntimeError, match="argument x axis 0 must have a size divisible"):
            op(ints(6, 64, device="cuda"), w)
        two = cg.compile(allgather_matmul(torch.float32, 2, 2))
        with pytest.raises(ValueError, match="built for world size 2"):
            two(x, w)
    finally:
        dist.destroy_process_group()


def test_one_nccl_rank_compiled_op_matches_torch(cache_dir):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_compiled_worker, (os.path.join(tmp, "store"), str(cache_dir)), nprocs=1)
