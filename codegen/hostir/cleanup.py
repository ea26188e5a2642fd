"""Dead code: what a program's values are views of (``view_roots``) and
``remove_dead_code``."""

from __future__ import annotations

import dataclasses

from .nodes import (
    Allocate,
    Compute,
    Copy,
    Deallocate,
    ForLoop,
    HostProgram,
    Node,
    RingSlot,
    ShardByStream,
    StagingSlot,
)


def view_roots(program: HostProgram) -> dict[str, str]:
    """Each view (a slice, a staging slot, an unflattened block) -> the tensor it views."""
    root: dict[str, str] = {}
    for n in program.nodes():
        if isinstance(n, (Allocate, RingSlot)) or not n.defines() or not n.uses():
            continue
        viewed = n.uses()[0]
        for d in n.defines():
            root[d] = root.get(viewed, viewed)
    return root


def _live_values(program: HostProgram) -> set[str]:
    """The tensors whose values the program's outputs depend on: the outputs, what each
    compute node or copy that writes a live tensor reads, and what every other node
    uses (communications, views and stream nodes are kept as they are)."""
    root = view_roots(program)
    live = set(program.outputs)
    nodes = [n for n in program.nodes() if not isinstance(n, (ForLoop, Deallocate))]
    while True:
        before = len(live)
        for n in nodes:
            if isinstance(n, (Compute, Copy)):
                if any(root.get(w, w) in live for w in n.writes()):
                    live.update(v for r in n.uses() for v in (r, root.get(r, r)))
            elif not isinstance(n, (ShardByStream, StagingSlot, RingSlot, Allocate)):
                live.update(v for u in n.uses() for v in (u, root.get(u, u)))
        if len(live) == before:
            return live


def remove_dead_code(program: HostProgram) -> HostProgram:
    """Drops compute nodes and copies whose results no output depends on, then views and
    allocations that nothing reads (and their Deallocate).

    Before:  T3 = Allocate(...); Matmul(T0, T1, out=T3)   # T3 never read, not an output
             T4_i = ShardByStream(T4, ...)                  # T4_i never used
    After:   (gone)
    Repeated until nothing changes (a view dropped can leave its tensor unread).
    """
    while True:
        smaller = _remove_dead_code_once(program)
        if len(list(smaller.nodes())) == len(list(program.nodes())):
            return smaller
        program = smaller


def _remove_dead_code_once(program: HostProgram) -> HostProgram:
    live_values = _live_values(program)
    root = view_roots(program)

    def dead_write(n: Node) -> bool:
        return isinstance(n, (Compute, Copy)) and \
            not any(root.get(w, w) in live_values for w in n.writes())

    def used_names(nodes: list[Node]) -> set[str]:
        names: set[str] = set()
        for n in nodes:
            if not isinstance(n, Deallocate) and not dead_write(n):
                names.update(n.uses())
            names |= used_names(n.children())
        return names

    live = used_names(program.body) | set(program.outputs)

    def keep(nodes: list[Node], scope: set[str]) -> list[Node]:
        """``scope``: the names read by live nodes where ``nodes`` can be seen. A loop's
        views are its own (``T0_i`` in two loops are two values): each loop judges them
        by what its own body reads."""
        kept: list[Node] = []
        for n in nodes:
            views = (ShardByStream, StagingSlot, RingSlot, Allocate)
            if dead_write(n):
                continue
            if isinstance(n, views) and not set(n.defines()) & scope:
                continue
            if isinstance(n, Deallocate) and n.tensor not in live:
                continue
            if isinstance(n, ForLoop):
                n = dataclasses.replace(n, body=keep(n.body, used_names(n.body)))
                if not n.body:  # a loop left with nothing to do goes too
                    continue
            kept.append(n)
        return kept

    return program.replace(body=keep(program.body, live))
