"""Tensor parallelism: device meshes, sharding analysis, and the lowering of communications.

The model is nvFuser's. A fusion is defined on the *global* (unsharded) tensors; each
tensor lives on a :class:`~codegen.frontend.ir.DeviceMesh` of D ranks, and an axis cut by
``outer_split(axis, D)`` whose outer part is parallelized on ``ParallelType.DIDx`` is
sharded: rank r holds block r, and the op's argument (or result) on rank r is that local
block. Where an op needs unsharded what its producer has sharded, the lowering inserts a
communication; where the op's contraction is sharded (each rank holds a partial sum) and
its output is sharded, a reduce-scatter:

    x [m, k]:   x.outer_split(0, D); x.axis(0).parallelize(DIDx)     x_local [m/D, k]
    out = x @ w with out's rows not sharded                          -> AllGather(x)
    x [m, k], w [k, n] both sharded on k, out's rows sharded         -> ReduceScatter(out)

Stream slices of a sharded axis cut each rank's block: ``out.outer_split(0, D)`` then
``out.outer_split(1, S)`` with Stream on the S axis makes slice i take piece i of every
rank's block, which is exactly what one all-gather (or reduce-scatter) of piece i of every
rank's local block moves. So the communication is sliced into the stream loop: slice i
communicates on its stream while the GEMM of slice i-1 runs on another.

The stage is a package, one module per step: ``analysis`` (:func:`analyze`), ``nodes``
(the host-IR nodes of communication, ``Communication`` and ``Wait``, named as nvFuser's
host IR names them, and the views they need, ``Unflatten`` and ``CheckDivisible``),
``lowering`` (a distributed fusion to a host program: :func:`build_host_program`, called
by ``lowering.lower``) and ``evaluation`` (the waits a program must have, the process
group of a call, and the evaluator's handlers of these nodes with torch.distributed:
:class:`CommunicationEvaluator`). Everything is importable from ``codegen.distributed``.

Supported for now: one 2-D matmul ``out = a @ b`` of two fusion inputs, on a 1-D mesh;
all-gather of a's rows and reduce-scatter of out's rows, each sliced into the stream loop
when the rows carry the stream split (slices must divide each rank's block: checked when
called), or whole before/after the GEMM otherwise (the stream loop, if any, then slices
columns). Anything else is a ScheduleError that says so.

``print(cg.lower(examples.allgather_matmul(torch.float32, 4, 2)))``::

    HostProgram allgather_matmul(x: float32[m_local, k], w: float32[k, n_local]) -> (T2):
      main_stream = GetCurrentStream()
      CheckDivisible(x, axis=0, by=4)
      T2 = Allocate(float32[2 * m_local, n_local])
      x_gathered = Allocate(float32[8, ceilDiv(m_local, 4), k])
      T2_blocks = Unflatten(T2, axis=0, sizes=(2, m_local))
      for j in range(0, 4):
        SetCurrentStream(Stream(j))
        Synchronize(main_stream)
      for i in range(0, 4) [Stream]:
        SetCurrentStream(Stream(i))
        x_i = ShardByStream(x, axis=0, index=i, chunk=ceilDiv(m_local, 4))
        x_gathered_i = ShardByStream(x_gathered, axis=0, index=i, chunk=2)
        comm_i = Communication(AllGather, input=x_i, output=x_gathered_i, team=(0, 1), group=pg)
        Wait(comm_i)
        T2_blocks_i = ShardByStream(T2_blocks, axis=1, index=i, chunk=ceilDiv(m_local, 4))
        Matmul(x_gathered_i, w, out=T2_blocks_i)
      SetCurrentStream(main_stream)
      for j in range(0, 4):
        Synchronize(Stream(j))
      Deallocate(x_gathered)
      return T2

Staging: the gathered rows (all-gather) and the partial sums (reduce-scatter) get one
whole buffer ``[S*D, chunk, ...]``, slice i owning the contiguous ``[D, chunk, ...]`` at
rows ``i*D ..``, which is the layout a collective reads or writes (stacked rank blocks).
A per-stream slot reused every ``pool`` slices would save memory when S > pool, but the
reuse is then only safe because NCCL orders a collective after the current stream's
earlier work; a copy-engine ring backend (peers writing into our slot) would also need a
remote "slot free" signal. The whole buffer is what the no-overlap version allocates
anyway, and leaves that seam open.
"""

from __future__ import annotations

from .analysis import (  # noqa: F401
    AxisLayout,
    CommunicationPlan,
    Plan,
    analyze,
    is_distributed,
)
from .evaluation import (  # noqa: F401
    CommunicationEvaluator,
    communications,
    resolve_group,
    verify_waits,
)
from .lowering import (  # noqa: F401
    build_host_program,
)
from .nodes import (  # noqa: F401
    GROUP,
    CheckDivisible,
    Communication,
    CommunicationType,
    DIDx,
    Stream,
    Unflatten,
    Wait,
)
