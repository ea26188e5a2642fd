"""The host-IR nodes of tensor parallelism: ``Communication`` and ``Wait`` (named as
nvFuser's host IR names them), and the views they need (``Unflatten``,
``CheckDivisible``)."""

from __future__ import annotations

import dataclasses
import enum

from .. import hostir as hir
from ..frontend.ir import Expr, ParallelType

DIDx = ParallelType.DIDx
Stream = ParallelType.Stream
GROUP = "pg"  # the process group the program is called with (the default group otherwise)

# ---------------------------------------------------------------------------- host-IR nodes


class CommunicationType(enum.Enum):
    AllGather = "AllGather"
    ReduceScatter = "ReduceScatter"


@dataclasses.dataclass(eq=False)
class Communication(hir.Node):
    """Posts a collective over ``team`` on the current stream's side; ``out`` names its
    handle, for :class:`Wait`. Nothing waits for it here (no host block).

    AllGather: ``output`` holds the team's ``input``s stacked along the leading axis, in
    rank order (``[D, *input.shape]`` or ``[D * rows, ...]``). ReduceScatter: ``input``
    is D stacked blocks, ``output`` the sum over ranks of block ``rank``. ``output`` is
    contiguous; ``input`` is made contiguous if it is not (torch's contract)."""

    out: str
    kind: CommunicationType
    input: str
    output: str
    team: tuple[int, ...]
    group: str = GROUP

    def uses(self) -> list[str]:
        return [self.input, self.output]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        team = "(" + ", ".join(map(str, self.team)) + (",)" if len(self.team) == 1 else ")")
        return (f"{self.out} = Communication({self.kind.value}, input={self.input}, "
                f"output={self.output}, team={team}, group={self.group})")


@dataclasses.dataclass(eq=False)
class Wait(hir.Node):
    """The current stream waits for the communication ``communication`` (no host block
    with NCCL; gloo, on the CPU, blocks the host)."""

    communication: str

    def uses(self) -> list[str]:
        return [self.communication]

    def __str__(self) -> str:
        return f"Wait({self.communication})"


@dataclasses.dataclass(eq=False)
class Unflatten(hir.Node):
    """``out`` = ``tensor`` with axis ``axis`` viewed as ``sizes`` (outer, inner), as
    ``torch.unflatten``: always a view, whatever the strides."""

    out: str
    tensor: str
    axis: int
    sizes: tuple[Expr, Expr]

    def uses(self) -> list[str]:
        return [self.tensor]

    def defines(self) -> list[str]:
        return [self.out]

    def __str__(self) -> str:
        sizes = ", ".join(map(str, self.sizes))
        return f"{self.out} = Unflatten({self.tensor}, axis={self.axis}, sizes=({sizes}))"


@dataclasses.dataclass(eq=False)
class CheckDivisible(hir.Node):
    """Raises ValueError naming the argument unless ``tensor``'s size on ``axis`` is a
    multiple of ``divisor`` (``reason`` says why: world size, stream slices)."""

    tensor: str
    axis: int
    divisor: int
    reason: str

    def uses(self) -> list[str]:
        return [self.tensor]

    def __str__(self) -> str:
        return f"CheckDivisible({self.tensor}, axis={self.axis}, by={self.divisor})"
