"""Running communications: the waits a program must have (``verify_waits``), the process
group a call runs on (``resolve_group``), and the evaluator's handlers of the nodes with
torch.distributed (``CommunicationEvaluator``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import hostir as hir
from ..errors import InternalError
from .analysis import AxisLayout, Plan, analyze, is_distributed
from .lowering import build_host_program
from .nodes import CheckDivisible, Communication, CommunicationType, Unflatten, Wait

# ---------------------------------------------------------------------------- evaluation


def communications(program: hir.HostProgram) -> list[Communication]:
    return [n for n in program.nodes() if isinstance(n, Communication)]


def verify_waits(program: hir.HostProgram) -> hir.HostProgram:
    """Checks that every Communication is waited for, in its own block, before the next
    one is posted. The compiled op's Wait is ``_c10d_functional::wait_tensor``, which
    waits for every collective registered on the output's storage: were two slices
    posted before either waited, the first Wait would take both and the second would
    order nothing."""

    def check(nodes: list[hir.Node]) -> None:
        pending: Communication | None = None
        for n in nodes:
            if isinstance(n, Communication):
                if pending is not None:
                    raise InternalError(f"{n}: posted before {pending.out} was waited for\n"
                                        f"{program}")
                pending = n
            elif isinstance(n, Wait):
                if pending is None or n.communication != pending.out:
                    raise InternalError(f"{n}: waits for no pending communication of this "
                                        f"block\n{program}")
                pending = None
            check(n.children())
        if pending is not None:
            raise InternalError(f"{pending}: never waited for in its block\n{program}")

    check(program.body)
    return program


def resolve_group(program: hir.HostProgram, group: object | None) -> object | None:
    """The process group ``program`` communicates over: ``group``, or the default one.
    None if it does not communicate. Raises RuntimeError if torch.distributed is not
    initialized, ValueError if the group's size is not the program's world size."""
    comms = communications(program)
    if not comms:
        return None
    size = len(comms[0].team)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{program.name}: communicates over {size} ranks, but torch.distributed is not "
            f"initialized; call torch.distributed.init_process_group(backend, rank=..., "
            f"world_size={size}) first (gloo for CPU tensors, nccl for CUDA tensors)")
    pg = group if group is not None else dist.group.WORLD
    found = dist.get_world_size(pg)
    if found != size:
        raise ValueError(
            f"{program.name}: built for world size {size} (DeviceMesh({size})), but the "
            f"process group has {found} ranks; lower it again with world size {found}, or "
            f"pass group= a group of {size} ranks")
    if dist.get_rank(pg) < 0:
        raise ValueError(f"{program.name}: this process is not a member of the given group")
    return pg


class CommunicationEvaluator:
    """The evaluator's handlers of this module's nodes (mixed into its interpreter, which
    provides ``program``, ``env``, ``values`` and ``group``)."""

    program: hir.HostProgram
    env: dict[str, int]
    values: dict[str, torch.Tensor]
    group: object | None

    def CheckDivisible(self, n: CheckDivisible) -> None:
        size = self.values[n.tensor].shape[n.axis]
        if size % n.divisor:
            raise ValueError(
                f"{self.program.name}: argument {n.tensor} axis {n.axis} must have a size "
                f"divisible by {n.divisor} ({n.reason}), got {size} (shape "
                f"{list(self.values[n.tensor].shape)})")

    def Unflatten(self, n: Unflatten) -> None:
        sizes = [e.evaluate(self.env) for e in n.sizes]
        self.values[n.out] = self.values[n.tensor].unflatten(n.axis, sizes)

    def Communication(self, n: Communication) -> None:
        import torch.distributed as dist

        src, dst = self.values[n.input], self.values[n.output]
        if not dst.is_contiguous():
            raise InternalError(f"{n}: the output {n.output} is not contiguous")
        src = src.contiguous()  # the collectives need dense inputs; a copy only if not
        # gloo takes only the concatenated form of the D blocks ([D * rows, ..]; NCCL also
        # the stacked [D, rows, ..]), so stacked blocks are flattened (a view).
        if n.kind is CommunicationType.AllGather:
            if dst.dim() == src.dim() + 1:
                dst = dst.flatten(0, 1)
            # all_gather_into_tensor under its torch >= 2.14 name, where there is one
            gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            work = gather(dst, src, group=self.group, async_op=True)
        else:
            if src.dim() == dst.dim() + 1:
                src = src.flatten(0, 1)
            scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            work = scatter(dst, src, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.values[n.out] = work  # type: ignore[assignment]

    def Wait(self, n: Wait) -> None:
        self.values[n.communication].wait()  # type: ignore[attr-defined]


__all__: Sequence[str] = (
    "AxisLayout", "CheckDivisible", "Communication", "CommunicationEvaluator",
    "CommunicationType", "Plan", "Unflatten", "Wait", "analyze", "build_host_program",
    "is_distributed", "resolve_group",
)
