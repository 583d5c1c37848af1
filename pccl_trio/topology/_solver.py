"""Ring orders from link measurements: the cost model, an exact solver and a heuristic.

Theory of operation
-------------------
A ring all-reduce of ``S`` bytes over ``W`` peers runs ``2 (W - 1)`` steps; in each,
every peer sends one chunk of ``S / W`` bytes to its successor, and the step ends when
the slowest hop is done. So with ``cost[i, j] = latency[i, j] + (S / W) / bandwidth[i, j]``
(seconds for one chunk from ``i`` to ``j``; links are directed and need not be
symmetric), a ring's predicted time is

    ``2 (W - 1) * max over its hops of cost[i, j]``

and the best ring minimizes its slowest hop: a directed *bottleneck* travelling-salesman
problem, not the usual sum. Among rings with the same slowest hop, the one with the
smallest total is preferred (it is also faster when chunks queue, and it makes the
answer unique enough to compare). Unknown or unreachable links cost infinity.

* :func:`solve_exact` computes the optimum by dynamic programming over subsets
  (Held-Karp), twice: first the minimal bottleneck (``min over i of max(path, hop)``),
  then the minimal total among rings within it. ``O(2^n n^2)``; ``EXACT_LIMIT`` peers
  take well under a second.
* :func:`solve_heuristic`, for larger groups, bisects thresholds: starting from a
  greedy ring (or the installed one), it asks for a ring whose every hop is at most a
  threshold, by local moves (relocate a segment of 1-3 peers, or swap two) that never
  add a hop above it, mostly around the hops that exceed it; a threshold met becomes
  the new upper end, one missed the lower end, and when they meet the bisection starts
  again with twice the effort. Deterministic for a seed and a move budget; ``should_stop`` lets a
  caller bound it in time or cancel it from another thread. It optimizes the
  bottleneck first. It starts from a lower bound: the smallest threshold
  under which every peer still has a distinct successor (a bottleneck cycle cover,
  found by bipartite matching), whose cycles, patched into one ring by the cheapest
  successor exchanges, usually give a ring close to it; a ring that meets the bound is
  reported optimal, and the search stops there. Its ring's total is then shortened by
  the same moves, none adding a hop above that bottleneck (``_shorten``): the exact
  solver's tie-break, which makes a ring over two continents cross the ocean twice
  rather than at every other hop.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import numpy

__all__ = [
    "EXACT_LIMIT",
    "Ring",
    "bottleneck_lower_bound",
    "hop_costs",
    "predicted_seconds",
    "ring_of",
    "solve",
    "solve_exact",
    "solve_heuristic",
]

#: Largest group solved exactly by :func:`solve`.
EXACT_LIMIT = 12

Matrix = numpy.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class Ring:
    """A ring order (indices into the cost matrix, starting at 0) and its costs.

    Attributes:
        order: the peers in ring order; ``order[k]`` sends to ``order[k + 1]`` (the last to
            the first).
        bottleneck: the slowest hop's cost, seconds per chunk.
        total: the sum of the hops' costs.
        optimal: whether no ring has a smaller bottleneck (which decides the predicted
            time); from the exact solver also: none with the same bottleneck has a
            smaller total.
    """

    order: tuple[int, ...]
    bottleneck: float
    total: float
    optimal: bool

    def key(self) -> tuple[float, float]:
        return (self.bottleneck, self.total)


def hop_costs(bandwidth: Matrix, latency: Matrix | None, *, nbytes: int) -> Matrix:
    """Seconds to move one ring chunk over each directed link.

    Args:
        bandwidth: ``bandwidth[i, j]``, bytes per second from ``i`` to ``j`` (0, negative
            or NaN: unknown or unreachable).
        latency: seconds per message from ``i`` to ``j``, or None for zero.
        nbytes: the all-reduce's size; a chunk is ``nbytes / W``.
    """
    bandwidth = numpy.asarray(bandwidth, dtype=numpy.float64)
    world = bandwidth.shape[0]
    if bandwidth.shape != (world, world):
        raise ValueError(f"the bandwidth matrix must be square, got {bandwidth.shape}")
    chunk = nbytes / max(world, 1)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        cost = numpy.where(bandwidth > 0, chunk / bandwidth, math.inf)
    if latency is not None:
        cost = cost + numpy.asarray(latency, dtype=numpy.float64)
    numpy.fill_diagonal(cost, math.inf)
    return cost


def _square(cost: Matrix) -> Matrix:
    """``cost`` as a float64 array, checked square."""
    cost = numpy.asarray(cost, dtype=numpy.float64)
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"the cost matrix must be square, got shape {cost.shape}")
    return cost


def predicted_seconds(cost: Matrix, order: Sequence[int]) -> float:
    """Predicted all-reduce time of the ring ``order`` (see the module docstring)."""
    world = len(order)
    if world < 2:
        return 0.0
    return 2 * (world - 1) * ring_of(cost, order, optimal=False).bottleneck


def ring_of(cost: Matrix, order: Sequence[int], *, optimal: bool = False) -> Ring:
    """``order`` rotated to start at its smallest index, with its costs."""
    order = list(order)
    start = order.index(min(order))
    order = order[start:] + order[:start]
    hops = [float(cost[a, b]) for a, b in zip(order, order[1:] + order[:1], strict=True)]
    if len(order) < 2:
        hops = [0.0]
    return Ring(order=tuple(order), bottleneck=max(hops), total=sum(hops), optimal=optimal)


def solve(
    cost: Matrix,
    *,
    iterations: int = 200_000,
    seed: int = 0,
    start: Sequence[int] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Ring:
    """The exact optimum up to ``EXACT_LIMIT`` peers, the heuristic's best beyond
    (improving on ``start``, if given)."""
    if len(cost) <= EXACT_LIMIT:
        return solve_exact(cost, start=start, should_stop=should_stop)
    return solve_heuristic(
        cost, iterations=iterations, seed=seed, start=start, should_stop=should_stop
    )


class _Stopped(Exception):
    """The caller's ``should_stop`` said stop."""


def solve_exact(
    cost: Matrix,
    *,
    start: Sequence[int] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Ring:
    """The ring with the smallest ``(bottleneck, total)`` (see the module docstring).

    ``should_stop`` is polled every 256 subsets; True returns ``start`` (or the
    identity order) at once, not marked optimal.
    """
    cost = _square(cost)
    n = len(cost)
    if n <= 3:  # one ring (two for three peers, compared directly)
        candidates = [ring_of(cost, range(n))]
        if n == 3:
            candidates.append(ring_of(cost, (0, 2, 1)))
        return dataclasses.replace(min(candidates, key=Ring.key), optimal=True)
    try:
        bottleneck, bottleneck_order = _held_karp(cost, numpy.maximum, should_stop)
        allowed = numpy.where(cost <= bottleneck, cost, math.inf)
        total, order = _held_karp(allowed, numpy.add, should_stop)
    except _Stopped:
        return ring_of(cost, range(n) if start is None else start)
    if not math.isfinite(total):
        # Every ring uses an unusable link: keep the bottleneck order found first.
        order = bottleneck_order
    return dataclasses.replace(ring_of(cost, order), optimal=True)


def _held_karp(
    cost: Matrix,
    combine: Callable[[Matrix, Matrix], Matrix],
    should_stop: Callable[[], bool] | None = None,
) -> tuple[float, list[int]]:
    """The best Hamiltonian cycle through node 0 under ``combine`` (``maximum`` for the
    bottleneck, ``add`` for the total); returns its value and order.

    Raises:
        _Stopped: ``should_stop`` returned True.
    """
    n = len(cost)
    size = 1 << (n - 1)  # subsets of the nodes 1..n-1
    best = numpy.full((size, n), math.inf)
    parent = numpy.full((size, n), -1, dtype=numpy.int64)
    for j in range(1, n):
        best[1 << (j - 1), j] = cost[0, j]
    nodes = numpy.arange(n)
    for mask in range(1, size):
        if should_stop is not None and mask % 256 == 0 and should_stop():
            raise _Stopped
        members = [j for j in range(1, n) if mask >> (j - 1) & 1]
        if len(members) < 2:
            continue
        for j in members:
            previous = mask ^ (1 << (j - 1))
            values = combine(best[previous], cost[:, j])
            values[0] = math.inf
            values[j] = math.inf
            i = int(numpy.argmin(values))
            best[mask, j] = values[i]
            parent[mask, j] = nodes[i]
    full = size - 1
    closing = combine(best[full], cost[:, 0])
    closing[0] = math.inf
    last = int(numpy.argmin(closing))
    value = float(closing[last])
    if not math.isfinite(value):  # no ring avoids an unusable link: any order will do
        return value, list(range(n))
    order = [0] * n
    mask, j = full, last
    for position in range(n - 1, 0, -1):
        order[position] = j
        i = int(parent[mask, j])
        mask ^= 1 << (j - 1)
        j = i
    return value, order


def solve_heuristic(
    cost: Matrix,
    *,
    iterations: int = 200_000,
    seed: int = 0,
    start: Sequence[int] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Ring:
    """A good ring by threshold search (see the module docstring).

    Args:
        iterations: moves to try in all; deterministic for a seed and this budget.
        start: a ring to start from (e.g. the installed one); a greedy ring otherwise.
        should_stop: polled every few hundred moves; True ends the search early.
    """
    cost = _square(cost)
    n = len(cost)
    if n <= 3:
        return solve_exact(cost)
    rng = random.Random(seed)
    c = cost.tolist()
    best = list(start) if start is not None else _greedy(c, n)
    best_bottleneck = ring_of(cost, best).bottleneck
    floor = _floor(c)
    values = sorted({v for row in c for v in row if floor <= v < best_bottleneck})
    budget = Budget(iterations, should_stop)
    # The smallest threshold that admits a cycle cover (every peer one successor, one
    # predecessor) bounds every ring from below; patching the cover's cycles into one
    # ring gives a good start near it.
    low = 0
    if values:
        low, patched = _patched_ring(c, n, values)
        if patched is not None:
            bottleneck = _slowest_hop(c, patched)
            if bottleneck < best_bottleneck:
                best, best_bottleneck = patched, bottleneck
    # Bisect the thresholds below the current slowest hop: a target met lowers the upper
    # end to the new ring's slowest hop; a target missed (with this effort) raises the
    # lower end. When the two meet, start again from the bottom with twice the effort.
    effort = 5_000
    floor_index = low
    high = bisect.bisect_left(values, best_bottleneck)
    while high > floor_index and not budget.spent():
        if low >= high:
            effort *= 2
            low = floor_index
            if effort > 4 * max(budget.left, 1):
                break
        middle = (low + high) // 2
        attempt = _repair(c, best, values[middle], budget, rng, moves=effort)
        if attempt is None:
            low = middle + 1
            continue
        best = attempt
        best_bottleneck = _slowest_hop(c, best)
        high = bisect.bisect_left(values, best_bottleneck)
    # The cycle-cover threshold is a lower bound: a ring that meets it is optimal.
    bound = values[floor_index] if floor_index < len(values) else best_bottleneck
    # A share of the moves of its own (a tenth, at most 20 000): the bisection may spend
    # every move it was given on thresholds no ring meets.
    share = min(iterations // 10, 20_000)
    best = _shorten(c, best, best_bottleneck, Budget(share, should_stop), rng, moves=share)
    return ring_of(cost, best, optimal=best_bottleneck <= bound)


def _shorten(
    c: list[list[float]],
    order: list[int],
    bottleneck: float,
    budget: Budget,
    rng: random.Random,
    *,
    moves: int,
) -> list[int]:
    """``order`` with a smaller total, by moves that add no hop above ``bottleneck``
    (the tie-break of the exact solver: among rings as slow at their slowest hop, the
    one with the least in all, which crosses a slow divide as few times as it can)."""
    n = len(order)
    ring = order[:]

    def cost(a: int, b: int) -> float:
        return c[a][b]

    for _ in range(moves):
        if not budget.take():
            break
        delta, moved, touched = _propose(ring, rng.randrange(n), rng, cost)
        if moved is None or not delta < 0:
            continue
        position = {peer: index for index, peer in enumerate(moved)}
        if all(c[a][moved[(position[a] + 1) % n]] <= bottleneck for a in touched):
            ring = moved
    return ring


def bottleneck_lower_bound(cost: Matrix) -> float:
    """No ring's slowest hop is cheaper than this: the smallest threshold under which
    every peer still has a distinct successor (a bottleneck cycle cover)."""
    c = numpy.asarray(cost, dtype=numpy.float64).tolist()
    n = len(c)
    if n < 2:
        return 0.0
    floor = _floor(c)
    values = sorted({v for row in c for v in row if floor <= v and math.isfinite(v)})
    index = _cover_index(c, n, values)
    return math.inf if index is None else float(values[index])


def _floor(c: list[list[float]]) -> float:
    """No ring beats the worst of the peers' cheapest outgoing and incoming links."""
    return float(max(max(min(row) for row in c), max(min(col) for col in zip(*c, strict=True))))


def _slowest_hop(c: list[list[float]], ring: Sequence[int]) -> float:
    return max(c[a][b] for a, b in zip(ring, [*ring[1:], ring[0]], strict=True))


def _cover_index(c: list[list[float]], n: int, values: list[float]) -> int | None:
    """The index in ``values`` (sorted) of the smallest threshold that admits a cycle
    cover, or None if even the largest does not."""
    if not values or _cycle_cover(c, n, values[-1]) is None:
        return None
    low, high = 0, len(values) - 1
    while low < high:
        middle = (low + high) // 2
        if _cycle_cover(c, n, values[middle]) is None:
            low = middle + 1
        else:
            high = middle
    return low


def _patched_ring(c: list[list[float]], n: int, values: list[float]) -> tuple[int, list[int] | None]:
    """The index in ``values`` of the smallest threshold with a cycle cover, and the best
    ring made by patching the cycles of covers at that threshold and a few above it
    (``len(values)`` and None if no cover exists)."""
    low = _cover_index(c, n, values)
    if low is None:
        return len(values), None  # no cover below the given ring's slowest hop
    best: list[int] | None = None
    best_bottleneck = math.inf
    # Looser covers have other cycles, which sometimes patch into a better ring.
    for index in sorted({min(len(values) - 1, low + step) for step in (0, 1, 2, 4, 8, 16, 32)}):
        cover = _cycle_cover(c, n, values[index])
        if cover is None:
            continue
        ring = _patch(c, cover)
        bottleneck = _slowest_hop(c, ring)
        if bottleneck < best_bottleneck:
            best, best_bottleneck = ring, bottleneck
    return low, best


def _cycle_cover(c: list[list[float]], n: int, threshold: float) -> list[int] | None:
    """Successors forming a cycle cover with every hop at most ``threshold`` (a perfect
    matching of senders to receivers), or None."""
    # Imported here, not with the module: every peer process imports this solver (a
    # peer may host an elected master), and networkx takes a tenth of a second to load.
    import networkx  # type: ignore[import-untyped]

    # Integer nodes (senders 0..n-1, receivers n..2n-1): their hashes, and so the
    # matching found, do not change between processes.
    graph = networkx.Graph()
    graph.add_nodes_from(range(2 * n))
    graph.add_edges_from(
        (i, n + j) for i in range(n) for j in range(n) if i != j and c[i][j] <= threshold
    )
    matching = networkx.bipartite.hopcroft_karp_matching(graph, top_nodes=range(n))
    if any(i not in matching for i in range(n)):
        return None
    return [int(matching[i]) - n for i in range(n)]


def _patch(c: list[list[float]], successor: list[int]) -> list[int]:
    """Merge the cycles of ``successor`` into one ring, each time by the exchange of two
    successors (one in each of two cycles) whose new hops have the smallest maximum."""
    n = len(successor)
    succ = successor[:]
    while True:
        cycle_of = [-1] * n
        cycles = 0
        for start in range(n):
            if cycle_of[start] < 0:
                node = start
                while cycle_of[node] < 0:
                    cycle_of[node] = cycles
                    node = succ[node]
                cycles += 1
        if cycles == 1:
            break
        best: tuple[float, int, int] | None = None
        for a in range(n):
            for b in range(n):
                if cycle_of[a] < cycle_of[b]:
                    worst = max(c[a][succ[b]], c[b][succ[a]])
                    if best is None or worst < best[0]:
                        best = (worst, a, b)
        assert best is not None
        _, a, b = best
        succ[a], succ[b] = succ[b], succ[a]
    order = [0]
    while len(order) < n:
        order.append(succ[order[-1]])
    return order


class Budget:
    """Moves left to the search, and the caller's stop switch."""

    def __init__(self, moves: int, should_stop: Callable[[], bool] | None) -> None:
        self.left = moves
        self._taken = 0
        self._should_stop = should_stop
        self._stopped = False

    def take(self) -> bool:
        """Spend one move; False when none is left or the caller said stop (asked
        before the first move and every 256 moves)."""
        if self.left <= 0 or self._stopped:
            return False
        if self._should_stop is not None and self._taken % 256 == 0 and self._should_stop():
            self._stopped = True
            return False
        self.left -= 1
        self._taken += 1
        return True

    def spent(self) -> bool:
        return self.left <= 0 or self._stopped


def _repair(
    c: list[list[float]],
    order: list[int],
    threshold: float,
    budget: Budget,
    rng: random.Random,
    *,
    moves: int,
) -> list[int] | None:
    """A ring with every hop at most ``threshold``, found by moving peers out of the way
    of the hops above it (a move is kept when it does not add such hops), or None."""
    n = len(order)
    ring = order[:]

    def bad(a: int, b: int) -> int:
        return 1 if c[a][b] > threshold else 0

    # The peers whose outgoing hop is above the threshold, kept up to date per move.
    senders = {a for a, b in zip(ring, ring[1:] + ring[:1], strict=True) if bad(a, b)}
    for _ in range(moves):
        if not senders:
            return ring
        if not budget.take():
            return None
        if rng.random() < 0.8:  # mostly next to a hop above the threshold
            k = ring.index(rng.choice(sorted(senders))) + rng.randint(0, 1)
        else:
            k = rng.randrange(n)
        k %= n
        delta, moved, touched = _propose(ring, k, rng, bad)
        if moved is None or delta > 0:
            continue
        ring = moved
        for a in touched:
            if bad(a, ring[(ring.index(a) + 1) % n]):
                senders.add(a)
            else:
                senders.discard(a)
    return ring if not senders else None


def _propose(
    ring: list[int], k: int, rng: random.Random, bad: Callable[[int, int], float]
) -> tuple[float, list[int] | None, list[int]]:
    """A random move around position ``k``: a swap with another peer (3 in 10), else
    a segment of 1-3 peers from ``k`` moved elsewhere; as :func:`_swap` returns it
    (no ring when the move changes nothing)."""
    n = len(ring)
    if rng.random() < 0.3:
        j = rng.randrange(n)
        if j == k:
            return 0, None, []
        return _swap(ring, k, j, bad)
    length = rng.randint(1, min(3, n - 2))
    return _relocate(ring, k, length, rng.randrange(n), bad)


def _swap(
    ring: list[int], i: int, j: int, bad: Callable[[int, int], float]
) -> tuple[float, list[int] | None, list[int]]:
    """Swap the peers at ``i`` and ``j``: the change in the sum of ``bad`` over the hops
    (hops above a threshold, or their cost), the new ring, and the peers whose outgoing
    hop changed."""
    n = len(ring)
    positions = {(i - 1) % n, i, (j - 1) % n, j}  # positions whose outgoing hop changes
    before = sum(bad(ring[p], ring[(p + 1) % n]) for p in positions)
    result = ring[:]
    result[i], result[j] = result[j], result[i]
    after = sum(bad(result[p], result[(p + 1) % n]) for p in positions)
    return after - before, result, [result[p] for p in positions]


def _relocate(
    ring: list[int], start: int, length: int, to: int, bad: Callable[[int, int], float]
) -> tuple[float, list[int] | None, list[int]]:
    """Move ``ring[start:start + length]`` (wrapping) in front of the peer at ``to``; the
    same results as :func:`_swap`."""
    rotated = ring[start:] + ring[:start]  # the segment first
    segment, rest = rotated[:length], rotated[length:]
    target = ring[to]
    if target in segment:
        return 0, None, []
    at = rest.index(target)
    if at == 0:  # in front of rest[0]: the same ring
        return 0, None, []
    before = (bad(rest[-1], segment[0]) + bad(segment[-1], rest[0])
              + bad(rest[at - 1], target))
    after = (bad(rest[-1], rest[0]) + bad(rest[at - 1], segment[0])
             + bad(segment[-1], target))
    return after - before, rest[:at] + segment + rest[at:], [rest[-1], segment[-1], rest[at - 1]]


def _greedy(c: list[list[float]], n: int) -> list[int]:
    """Nearest-successor ring from node 0 (cheapest outgoing link first)."""
    order = [0]
    left = set(range(1, n))
    while left:
        here = order[-1]
        nxt = min(left, key=lambda j: (c[here][j], j))
        order.append(nxt)
        left.remove(nxt)
    return order
