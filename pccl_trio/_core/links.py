"""What the master knows of each peer group's links, and what a ring over them costs.

Theory of operation
-------------------
Two sources describe a group's links. Topology optimizations measure them: a
``BandwidthStore`` per group keeps each link's rate and latency, or that it could not
be measured, until a member leaves (its links go with it). Establishment rounds
report the neighbours a peer could not reach (``RingBook.unreachable``). A link either
source calls unreachable, or that nobody measured, costs infinity.

Everything else is derived on demand, for ``reference_bytes`` (the all-reduce size
rings are optimized for): the cost matrix a ring search runs on (seconds per ring
chunk over each link, ``BandwidthStore.cost_matrix``), a ring's predicted all-reduce
time (``2 (W - 1)`` times its slowest hop, ``bandwidth.ring_cost``), and the two ways
the links leave the master: flat in a ``TopologyOptimized`` report, as matrices in a
``TopologyView``, with the unreachable links of both sources marked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy

from .bandwidth import BandwidthStore, link_matrices, ring_cost
from .events import TopologyView
from .messages import MATRIX_LIMIT, TopologyOptimized
from .peers import PeerTable
from .report import RunKind
from .rounds import RingBook

__all__ = ["Links"]



class Links:
    """The measured links of every peer group, with the rounds' unreachable edges.

    Args:
        book: where the rounds keep the edges they found unreachable.
        reference_bytes: the all-reduce size costs and predictions are for.
    """

    def __init__(self, book: RingBook, *, reference_bytes: int) -> None:
        self._book = book
        self._reference_bytes = reference_bytes
        self._stores: dict[int, BandwidthStore] = {}  # group -> its measurements

    def store(self, group: int) -> BandwidthStore:
        """The group's measurements, to read or to record into."""
        return self._stores.setdefault(group, BandwidthStore())

    def _known(self, group: int) -> BandwidthStore:
        """The group's measurements, to read (empty if nothing was ever measured)."""
        return self._stores.get(group) or BandwidthStore()

    def forget(self, group: int, peer_id: int) -> None:
        """``peer_id`` left ``group``: its links are no longer known."""
        store = self._stores.get(group)
        if store is not None:
            store.forget(peer_id)

    def cost(self, group: int, members: Sequence[int]) -> numpy.ndarray:
        """Seconds per chunk of a reference all-reduce over each link among ``members``;
        infinity where unknown, unmeasurable, or reported unreachable by a round."""
        cost = self._known(group).cost_matrix(members, nbytes=self._reference_bytes)
        index = {p: i for i, p in enumerate(members)}
        for a, b in self._book.unreachable:
            if a in index and b in index:
                cost[index[a], index[b]] = math.inf
        return cost

    def predicted(self, group: int, members: Sequence[int], ring: Sequence[int]) -> float:
        """The predicted seconds of a reference all-reduce over ``ring``."""
        if len(ring) < 2:
            return 0.0
        index = {p: i for i, p in enumerate(members)}
        bottleneck, _total = ring_cost(self.cost(group, members), [index[p] for p in ring])
        return 2 * (len(ring) - 1) * bottleneck

    def report(
        self, table: PeerTable, number: int, group: int, members: Sequence[int],
        ring: Sequence[int], optimal: bool,
    ) -> TopologyOptimized:
        """Report (``table.report``) and build the group's report of optimization
        ``number`` (the matrices left out beyond ``MATRIX_LIMIT`` members)."""
        predicted = self.predicted(group, members, ring)
        table.report(
            RunKind.OPTIMIZED,
            f"optimization {number}, peer group {group}: ring {list(ring)}, predicted "
            f"{f'{predicted:.3f} s' if math.isfinite(predicted) else 'unknown'} for "
            f"{self._reference_bytes >> 20} MiB{' (optimal)' if optimal else ''}; links "
            f"(Mbit/s, sender by row):\n{_format_links(members, self._known(group))}",
            number=number, group=group, ring=tuple(ring), optimal=optimal,
            predicted_seconds=predicted, reference_bytes=self._reference_bytes,
        )
        bandwidth: list[float] = []
        latency: list[float] = []
        unreachable: list[int] = []
        if len(members) <= MATRIX_LIMIT:
            bandwidth, latency, unreachable = self._known(group).matrices(members)
            unreachable = sorted(set(unreachable) | set(self._book.blocked_indices(members)))
        return TopologyOptimized(
            optimization=number,
            peers=tuple(members),
            bandwidth=tuple(bandwidth),
            latency=tuple(latency),
            unreachable=tuple(unreachable),
            ring=tuple(ring),
            predicted_seconds=predicted if math.isfinite(predicted) else -1.0,
            reference_bytes=self._reference_bytes,
            optimal=optimal,
        )

    def view(self, group: int, members: tuple[int, ...], ring: tuple[int, ...]) -> TopologyView:
        """The links among ``members`` and the group's ``ring``, as matrices."""
        bandwidth, latency, unreachable = self._known(group).matrices(members)
        rates, delays = link_matrices(
            len(members), bandwidth, latency, [*unreachable, *self._book.blocked_indices(members)]
        )
        return TopologyView(
            peers=members,
            bandwidth=rates,
            latency=delays,
            ring=ring,
            predicted_seconds=self.predicted(group, members, ring),
            reference_bytes=self._reference_bytes,
        )



def _format_links(members: Sequence[int], store: BandwidthStore) -> str:
    """A table of the measured rates (Mbit/s) among ``members``: ``-`` unknown, ``x``
    unreachable."""
    rows = []
    for a in members:
        cells = []
        for b in members:
            found = store.link(a, b)
            if a == b:
                cells.append("")
            elif found is not None:
                cells.append(f"{found.bandwidth * 8e-6:.1f}")
            else:
                cells.append("x" if store.unreachable(a, b) else "-")
        rows.append(cells)
    # Every column as wide as its widest entry, plus two spaces: never run together.
    width = 2 + max(len(text) for text in [*map(str, members), *(c for r in rows for c in r)])
    lines = [" " * width + "".join(f"{p:>{width}}" for p in members)]
    lines += [f"{a:>{width}}" + "".join(f"{c:>{width}}" for c in cells)
              for a, cells in zip(members, rows, strict=True)]
    return "\n".join(lines)
