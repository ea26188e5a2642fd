"""The pass driver: Fusion -> HostProgram, through three pass lists.

``passes.FUSION_PASSES`` (Fusion -> Fusion: the schedule validated, propagated and
normalized), ``passes.LOWERING_PASSES`` (a ``passes.Lowering`` state, each pass adding
one thing: the loops, the contraction choice, the allocation plan, the host program) and
``hostir.HOSTIR_PASSES`` (HostProgram -> HostProgram). ``CODEGEN_DUMP=ir,hostir`` prints
the fusion after each fusion pass and the host program after each host-IR pass (to
stderr). ``verify`` runs after every host-IR pass.
"""

from __future__ import annotations

import os
import sys

from .. import distributed
from .. import hostir as hir
from ..errors import ScheduleError
from ..frontend.ir import Fusion
from . import cost, passes

# The most worker streams a program may use (``lower``'s pool_size), as many as PyTorch's
# own pool has per priority. Each thread that calls an op leases worker streams, each with
# an event and, from its first cuBLASLt GEMM, a workspace (32 MiB by default), which are
# kept for the process: a lease goes back to a pool when its thread exits and a later
# thread reuses it. The copy stream is the lease's stream after the pool's, and a loop
# whose copies run ahead uses a second set of pool_size workers after them, so a lease
# holds at most 2 * MAX_POOL_SIZE streams. The runtime enforces the same bound
# (``kMaxWorkers`` in codegen/backend/include/codegen/stream.h; a test keeps the two equal).
MAX_POOL_SIZE = 32


def _dump_stages() -> set[str]:
    return {s.strip() for s in os.environ.get("CODEGEN_DUMP", "").split(",") if s.strip()}


def _dump(title: str, text: str) -> None:
    print(f"=== {title} ===\n{text}", file=sys.stderr)


def check_pool_size(where: str, pool_size: object) -> None:
    """Refuses a ``pool_size`` that is not an int from 1 to ``MAX_POOL_SIZE``."""
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise ScheduleError(f"{where}: pool_size must be an int >= 1, got {pool_size!r}")
    if pool_size > MAX_POOL_SIZE:
        raise ScheduleError(f"{where}: pool_size must be at most {MAX_POOL_SIZE} (worker "
                            f"streams per thread, kept for the process), got {pool_size}")


def lower(fusion: Fusion, *, pool_size: int = 4, gemm_sm_count: int = 0,
          gemm_library: str = "cublaslt", copy_stream: bool = False,
          staging: str = "slots", split_contraction: bool | str = False) -> hir.HostProgram:
    """Runs the fusion passes on a copy of ``fusion``, builds the host program and runs the
    host-IR passes. ``pool_size`` (1 to ``MAX_POOL_SIZE``) bounds the number of worker
    streams; ``gemm_sm_count`` (0 = all) caps the SMs each GEMM may use, leaving the rest
    to copies and collectives that overlap it; ``gemm_library`` picks cached cuBLASLt
    plans ("cublaslt", the default) or one cublasGemmEx per GEMM ("cublas");
    ``copy_stream`` queues the host-to-device copies of host inputs read in slices on one
    stream of their own, in slice order, instead of on the slices' worker streams
    (``hostir.queue_copies_in``); ``staging="ring"`` (which implies ``copy_stream``) lands
    those copies in the thread's staging ring instead of per-call staging, so that they
    run ahead of the caller's stream, under the previous call's GEMMs
    (``hostir.stage_in_ring``): for ops called one after another on host-resident weights,
    eagerly (a program staged in the ring refuses CUDA graph capture). Its host inputs
    must be complete when it is called: nothing orders its copies after work queued on the
    caller's stream (a pinned tensor filled by a non-blocking copy from the GPU must be
    synchronized first). ``split_contraction`` streams a row-major host operand that a
    matmul reads by column blocks (strided 2-D copies) by blocks of rows instead, the
    loop splitting the contraction and each slice accumulating onto the output
    (``passes.split_contractions``); ``split_contraction="auto"`` streams by whichever
    blocks ``codegen.transforms.cost`` estimates faster: chosen here where every extent is known,
    else by the call, from its extents, between this program (columns) and its
    ``alternative`` (rows), both printed."""
    if not isinstance(fusion, Fusion):
        raise ScheduleError(f"lower expects a cg.Fusion, got {type(fusion).__name__}")
    check_pool_size("lower", pool_size)
    if isinstance(gemm_sm_count, bool) or not isinstance(gemm_sm_count, int) or gemm_sm_count < 0:
        raise ScheduleError(f"lower: gemm_sm_count must be an int >= 0 (0 = all SMs), got "
                            f"{gemm_sm_count!r}")
    if gemm_library not in hir.GEMM_LIBRARIES:
        choices = ", ".join(map(repr, hir.GEMM_LIBRARIES))
        raise ScheduleError(f"lower: gemm_library must be one of {choices}, got {gemm_library!r}")
    if gemm_sm_count and gemm_library != "cublaslt":
        raise ScheduleError(f"lower: gemm_sm_count={gemm_sm_count} needs gemm_library='cublaslt' "
                            f"(cublasGemmEx has no SM budget), got gemm_library={gemm_library!r}")
    if not isinstance(copy_stream, bool):
        raise ScheduleError(f"lower: copy_stream must be True or False, got {copy_stream!r}")
    if not isinstance(split_contraction, bool) and split_contraction != "auto":
        raise ScheduleError(f"lower: split_contraction must be True, False or 'auto', got "
                            f"{split_contraction!r}")
    if staging not in hir.STAGINGS:
        choices = ", ".join(map(repr, hir.STAGINGS))
        raise ScheduleError(f"lower: staging must be one of {choices}, got {staging!r}")
    copy_stream = copy_stream or staging == "ring"
    if not fusion.outputs:
        raise ScheduleError(f"Fusion {fusion.name} has no outputs; call cg.output(t)")
    dump = _dump_stages()
    work = fusion.clone()
    choice: hir.ContractionChoice | None = None
    if distributed.is_distributed(work):  # tensor parallel: its own analysis and lowering
        split_contraction = split_contraction is True
        if "ir" in dump:
            _dump("ir (distributed)", str(work))
        program = hir.verify(distributed.build_host_program(work, pool_size))
    else:
        for fusion_pass in passes.FUSION_PASSES:
            work = fusion_pass(work)
            if "ir" in dump:
                _dump(f"ir after {fusion_pass.__name__}", str(work))
        state = passes.Lowering(work, pool_size, split_contraction)
        for lowering_pass in passes.LOWERING_PASSES:
            state = lowering_pass(state)
        assert state.program is not None and not isinstance(state.split_contraction, str)
        program, choice, split_contraction = state.program, state.choice, \
            state.split_contraction
    options = hir.Options(pool_size=pool_size, gemm_sm_count=gemm_sm_count,
                          gemm_library=gemm_library, copy_stream=copy_stream, staging=staging,
                          split_contraction=split_contraction)
    program = program.replace(options=options,
                              source=None if distributed.is_distributed(work) else fusion.clone())
    if "hostir" in dump:
        _dump("hostir after build_host_program", str(program))
    for host_pass in hir.HOSTIR_PASSES:
        program = distributed.verify_waits(hir.verify(host_pass(program)))
        if "hostir" in dump:
            _dump(f"hostir after {host_pass.__name__}", str(program))
    if choice is None:
        return program
    # split_contraction="auto": the column loop, with the row loop as its alternative for
    # the call to pick (by its extents and the host operands' layouts); where every extent
    # is known and the columns are estimated faster, the column loop alone (a host operand
    # that is not row-major keeps its columns too).
    if choice.known() and not cost.prefers_rows(choice, {}):
        return program.replace(choice=choice)
    rows = lower(fusion, pool_size=pool_size, gemm_sm_count=gemm_sm_count,
                 gemm_library=gemm_library, copy_stream=copy_stream, staging=staging,
                 split_contraction=True)
    return program.replace(choice=choice, alternative=rows)


def schedule(fusion: Fusion) -> Fusion:
    """The fusion after the fusion passes (propagated and validated), for printing."""
    if not isinstance(fusion, Fusion):
        raise ScheduleError(f"schedule expects a cg.Fusion, got {type(fusion).__name__}")
    work = fusion.clone()
    if distributed.is_distributed(work):
        distributed.analyze(work)  # validates; sets every tensor's mesh
        return work
    for fusion_pass in passes.FUSION_PASSES:
        work = fusion_pass(work)
    return work
