"""Pure ring math: ordering peers into a ring that avoids unreachable links.

A ring is a list of peer ids; member ``i`` sends to ``ring[(i + 1) % n]`` and
receives from ``ring[i - 1]``. Only those directed edges must be reachable.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["find_ring", "ring_edges"]

#: Bound on the search for a ring around blocked edges; past it we give up (and the
#: master removes a peer) rather than stall the master's event loop.
SEARCH_BUDGET = 200_000


def ring_edges(ring: Sequence[int]) -> list[tuple[int, int]]:
    """The directed edges ``(sender, receiver)`` a ring uses."""
    if len(ring) < 2:
        return []
    return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]


def find_ring(
    preferred: Sequence[int], blocked: Collection[tuple[int, int]]
) -> list[int] | None:
    """A ring of all of ``preferred`` that uses no edge in ``blocked``, or None.

    The preferred order is kept when it already avoids every blocked edge; otherwise
    a depth-first search for a Hamiltonian cycle tries successors in preferred order,
    so the result stays as close to it as the search finds.
    """
    members = list(preferred)
    if len(members) != len(set(members)):
        raise ValueError(f"ring members must be distinct: {members}")
    blocked_set = set(blocked)
    if not any(edge in blocked_set for edge in ring_edges(members)):
        return members
    if len(members) == 2:
        return None  # both directions are needed and one is blocked
    start = members[0]
    path = [start]
    used = {start}
    budget = SEARCH_BUDGET

    def extend() -> bool:
        nonlocal budget
        if len(path) == len(members):
            return (path[-1], start) not in blocked_set
        for candidate in members:
            budget -= 1
            if budget <= 0:
                return False
            if candidate in used or (path[-1], candidate) in blocked_set:
                continue
            path.append(candidate)
            used.add(candidate)
            if extend():
                return True
            path.pop()
            used.discard(candidate)
        return False

    return path if extend() else None
