"""The master's knowledge of the links of one peer group: measured, unreachable, missing.

Theory of operation
-------------------
A :class:`BandwidthStore` keeps, per directed link ``(sender, receiver)``, the measured
bandwidth (bytes per second) and one-way latency (seconds), or that the link could not
be measured (unreachable). A peer that leaves takes its row and column with it. The
links still to measure among the group's members are those with neither a measurement
nor an unreachable mark.

:func:`measurement_rounds` orders the links to measure into rounds in which no peer
takes part twice, neither as sender nor as receiver, so the measurements of one round
can run at once without sharing a link's endpoint (which would skew both rates). Each
round is built greedily, links of the busiest peers first. A full matrix of ``n`` peers
needs at least ``2 (n - 1)`` rounds (each peer takes part in that many links, one per
round), ``2 n`` for odd ``n``.

:meth:`BandwidthStore.cost_matrix` turns the store into the solver's input for a ring
of a given size (``topology.hop_costs``), unknown and unreachable links costing infinity.

The links travel flat (:meth:`BandwidthStore.matrices`, as ``TopologyOptimized``
carries them: row by row, 0 for unknown, unreachable links by flat index);
:func:`link_matrices` turns them back into the matrices readers see, on the master
and on the peers alike.

A measurement moves at most ``MEASUREMENT_BYTES``: the master announces that budget to
both ends of the link, the measuring peer stays within it and the measured peer serves
no more.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy

__all__ = [
    "MEASUREMENT_BYTES", "BandwidthStore", "Link", "link_matrices", "measurement_rounds",
    "ring_cost",
]

#: Most payload bytes one link measurement may move (the peers' schedule, three 1-byte
#: probes and transfers growing from 256 KiB by four up to 64 MiB, takes 85.3 MiB).
MEASUREMENT_BYTES = 96 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One measured directed link."""

    bandwidth: float  # bytes per second
    latency: float  # seconds, one way


class BandwidthStore:
    """Measurements of the directed links among one group's peers (by peer id)."""

    def __init__(self) -> None:
        self._links: dict[tuple[int, int], Link] = {}
        self._unreachable: set[tuple[int, int]] = set()

    def record(self, sender: int, receiver: int, bandwidth: float, latency: float) -> None:
        """A measurement of the link ``sender -> receiver``.

        Raises:
            ValueError: a link to itself, or a rate or latency that is not a finite,
                positive (non-negative for latency) number.
        """
        if sender == receiver:
            raise ValueError(f"peer {sender} cannot measure a link to itself")
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth must be positive and finite, got {bandwidth!r}")
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"latency must be non-negative and finite, got {latency!r}")
        self._links[(sender, receiver)] = Link(bandwidth, latency)
        self._unreachable.discard((sender, receiver))

    def mark_unreachable(self, sender: int, receiver: int) -> None:
        self._links.pop((sender, receiver), None)
        self._unreachable.add((sender, receiver))

    def forget(self, peer: int) -> None:
        """``peer`` left: drop every link it sends or receives on."""
        self._links = {k: v for k, v in self._links.items() if peer not in k}
        self._unreachable = {k for k in self._unreachable if peer not in k}

    def link(self, sender: int, receiver: int) -> Link | None:
        return self._links.get((sender, receiver))

    def unreachable(self, sender: int, receiver: int) -> bool:
        return (sender, receiver) in self._unreachable

    def missing(self, members: Iterable[int]) -> list[tuple[int, int]]:
        """The links among ``members`` neither measured nor marked unreachable."""
        peers = sorted(set(members))
        return [
            (a, b) for a in peers for b in peers
            if a != b and (a, b) not in self._links and (a, b) not in self._unreachable
        ]

    def cost_matrix(self, members: Sequence[int], *, nbytes: int) -> numpy.ndarray:
        """Seconds per ring chunk of an ``nbytes`` all-reduce over each link among
        ``members`` (in that order); infinity where nothing usable is known."""
        n = len(members)
        chunk = nbytes / max(n, 1)
        cost = numpy.full((n, n), math.inf)
        for i, a in enumerate(members):
            for j, b in enumerate(members):
                found = self._links.get((a, b))
                if found is not None and a != b:
                    cost[i, j] = found.latency + chunk / found.bandwidth
        return cost

    def matrices(
        self, members: Sequence[int]
    ) -> tuple[list[float], list[float], list[int]]:
        """The links among ``members`` flattened row by row (sender, then receiver):
        bandwidths (0: unknown), latencies, and the flat indices of unreachable links."""
        bandwidth: list[float] = []
        latency: list[float] = []
        unreachable: list[int] = []
        for a in members:
            for b in members:
                found = self._links.get((a, b))
                bandwidth.append(found.bandwidth if found is not None else 0.0)
                latency.append(found.latency if found is not None else 0.0)
                if (a, b) in self._unreachable:
                    unreachable.append(len(bandwidth) - 1)
        return bandwidth, latency, unreachable


def link_matrices(
    size: int, bandwidth: Sequence[float], latency: Sequence[float], unreachable: Iterable[int]
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The flat link lists of ``size`` peers as two ``size x size`` matrices.

    Args:
        size: how many peers order the rows and columns.
        bandwidth: bytes per second, row by row (sender, then receiver); 0: unknown.
            Empty: nothing was carried, and both matrices are NaN.
        latency: seconds, in the same order.
        unreachable: flat indices of the links that could not be measured.

    Returns:
        The bandwidths (NaN: not measured, 0: unreachable) and the latencies (NaN:
        unknown), NaN on both diagonals.
    """
    rates = numpy.full((size, size), math.nan)
    delays = numpy.full((size, size), math.nan)
    if bandwidth:
        rates = numpy.array(bandwidth, dtype=numpy.float64).reshape(size, size)
        delays = numpy.array(latency, dtype=numpy.float64).reshape(size, size)
        delays[rates == 0] = math.nan
        rates[rates == 0] = math.nan
        rates.flat[list(unreachable)] = 0.0
        numpy.fill_diagonal(rates, math.nan)
        numpy.fill_diagonal(delays, math.nan)
    return rates, delays


def ring_cost(cost: numpy.ndarray, order: Sequence[int]) -> tuple[float, float]:
    """The slowest hop and the sum of all hops of the ring ``order`` (indices into
    ``cost``); the ring's predicted all-reduce time is ``2 (W - 1)`` times the first."""
    if len(order) < 2:
        return 0.0, 0.0
    hops = [float(cost[a, b]) for a, b in zip(order, [*order[1:], order[0]], strict=True)]
    return max(hops), sum(hops)


def measurement_rounds(links: Iterable[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The links split into rounds in which every peer appears at most once (as sender
    or receiver); every link appears in exactly one round, in a deterministic order."""
    pending = sorted(set(links))
    rounds: list[list[tuple[int, int]]] = []
    waited: dict[int, int] = {}  # peer -> rounds it had links pending but none scheduled
    while pending:
        busy: set[int] = set()
        chosen: list[tuple[int, int]] = []
        # Peers with the most pending links first, then those that waited longest.
        load: dict[int, int] = {}
        for a, b in pending:
            load[a] = load.get(a, 0) + 1
            load[b] = load.get(b, 0) + 1
        order = sorted(
            pending,
            key=lambda e: (-(load[e[0]] + load[e[1]]), -(waited.get(e[0], 0) + waited.get(e[1], 0)), e),
        )
        for a, b in order:
            if a not in busy and b not in busy:
                chosen.append((a, b))
                busy.update((a, b))
        for peer in load:
            waited[peer] = 0 if peer in busy else waited.get(peer, 0) + 1
        chosen_set = set(chosen)
        pending = [e for e in pending if e not in chosen_set]
        rounds.append(sorted(chosen))
    return rounds
