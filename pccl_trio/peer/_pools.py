"""The ring's connection pools of one peer: to its successor (tx) and from its
predecessor (rx), by slot.

Theory of operation
-------------------
``P2PConnections`` opens the tx pool (``_open_pool``) and admits the rx pool's
connections (``_admit``); this module keeps them and answers what the data path asks
of them: the connections to send a step on (``successor_connections``), the one to
send completion notices back on (``back_connection``, rx slot 0), whether a
broken connection still belongs to the predecessor's pool (``receives_on``), and the
counts the status and metrics show. Pools change only in an establishment round
(``P2PConnections.rewire``): a pool to the successor is kept while ``healthy``, else
replaced whole (``install``); pools of peers that are no longer neighbours are taken
out (``stale``) and closed.

A tx pool's first connection also carries what the successor sends back; its reader
(``Pool.read_back``) runs for the connection's life. A tx connection nobody reads
shows its other end's close as readable bytes, so ``healthy`` asks it. The one with a
reader may hold bytes for the reader, so ``healthy`` asks the kernel whether its other
end closed it (``ended_by_peer``): the reader's own end comes later, in a worker thread
perhaps much later, and a round that trusted it alone would keep a pool the successor
had already cut (a cancelled attempt cuts the connection it was receiving on), on
which the next collective fails.

Notices go back only over a path whose round trip is at least ``NOTICES_BACK_FROM``
(the kernel's estimate on rx slot 0, taken when it was admitted; unknown counts as
long). They save a leased all-reduce hops (``_agreement``), and a hop on a LAN or
loopback costs less than the notices do: on loopback, back to back W=3 all-reduces of
1 MiB took 3.4 ms with them against 2.6 without. A ring may mix members that send
back with members that do not: the counts stay true either way, and the forward ones
alone reach agreement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from ..transport import Connection

__all__ = ["NOTICES_BACK_FROM", "Pool", "RingPools"]

#: The round trip (seconds) of the path from the predecessor from which this peer sends
#: its completion notices back to it too.
NOTICES_BACK_FROM = 1e-3


@dataclasses.dataclass(kw_only=True, slots=True)
class Pool:
    """The connections to (tx) or from (rx) one neighbour, by slot."""

    peer_id: int
    slots: dict[int, Connection] = dataclasses.field(default_factory=dict)
    size: int = 0  # the connections it was opened with (tx)
    read: set[int] = dataclasses.field(default_factory=set)  # tx slots a reader reads
    # rx: the kernel's round trip on slot 0 when it was admitted (None: not known).
    round_trip: float | None = None

    def healthy(self) -> bool:
        """All its connections open at both ends (see the module docstring)."""
        return len(self.slots) == self.size and not any(
            s.closed or (s.ended_by_peer() if slot in self.read else s.closed_by_peer())
            for slot, s in self.slots.items()
        )

    async def read_back(
        self, reader: Callable[[Connection, int], Awaitable[None]], first: Connection
    ) -> None:
        """Run ``reader`` on the ``first`` connection of this tx pool (``read`` holds
        its slot); once it ends, the connection counts as closed by its other end."""
        try:
            await reader(first, self.peer_id)
        finally:
            self.read.discard(0)

    async def aclose(self) -> None:
        streams = list(self.slots.values())
        self.slots.clear()
        for stream in streams:
            await stream.aclose()


class RingPools:
    """This peer's tx and rx pools, by neighbour (see the module docstring)."""

    def __init__(self) -> None:
        self._tx: dict[int, Pool] = {}
        self._rx: dict[int, Pool] = {}

    def healthy_to(self, successor: int) -> bool:
        """Whether the pool to ``successor`` exists and is healthy."""
        pool = self._tx.get(successor)
        return pool is not None and pool.healthy()

    def install(self, pool: Pool) -> Pool | None:
        """``pool`` is the tx pool to its peer from now on; the one it replaces (the
        caller closes it)."""
        old = self._tx.pop(pool.peer_id, None)
        self._tx[pool.peer_id] = pool
        return old

    def rx_pool(self, predecessor: int) -> Pool:
        """The pool from ``predecessor``, made empty if it has none."""
        return self._rx.setdefault(predecessor, Pool(peer_id=predecessor))

    def stale(self, successor: int | None, predecessor: int | None) -> list[Pool]:
        """Take out the pools to and from peers that are no longer ``successor`` and
        ``predecessor`` (the caller closes them)."""
        doomed = [self._tx.pop(p) for p in [p for p in self._tx if p != successor]]
        return doomed + [self._rx.pop(p) for p in [p for p in self._rx if p != predecessor]]

    def receives_on(self, predecessor: int, connection: Connection) -> bool:
        """Whether ``connection`` is in the pool from ``predecessor``. A connection
        leaves it only in a round: replaced in its slot by a newer one, or closed with
        the pool of a peer that is no longer the predecessor."""
        pool = self._rx.get(predecessor)
        return pool is not None and any(c is connection for c in pool.slots.values())

    def successor_connections(self, successor: int) -> list[Connection]:
        """The open connections to ``successor``, by slot."""
        pool = self._tx.get(successor)
        connections = [s for _, s in sorted(pool.slots.items())] if pool else []
        return [c for c in connections if not c.closed]

    def back_connection(self, predecessor: int) -> Connection | None:
        """The first connection from ``predecessor``, whose other end reads the
        completion notices this peer sends back on it; None if it is not open, or if
        the path is too short for notices back to pay (``NOTICES_BACK_FROM``)."""
        pool = self._rx.get(predecessor)
        first = pool.slots.get(0) if pool else None
        if first is None or first.closed:
            return None
        if pool is not None and pool.round_trip is not None and pool.round_trip < NOTICES_BACK_FROM:
            return None
        return first

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Open connections per peer: ``(tx, rx)``."""
        def count(pools: dict[int, Pool]) -> dict[int, int]:
            return {
                peer: sum(not s.closed for s in pool.slots.values())
                for peer, pool in pools.items()
                if pool.slots
            }

        return count(self._tx), count(self._rx)

    def connections(self) -> list[Connection]:
        """Every pooled connection, tx then rx."""
        return [s for pools in (self._tx, self._rx) for pool in pools.values()
                for s in pool.slots.values()]

    async def aclose(self) -> None:
        """Close every pool."""
        for pools in (self._tx, self._rx):
            doomed = list(pools.values())
            pools.clear()
            for pool in doomed:
                await pool.aclose()
