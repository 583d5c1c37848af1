"""The membership part of a wrapper's boundary: admit, order the ring, sync, wait for company.

Theory of operation
-------------------
At each boundary (DiLoCo's outer round, DataParallel's step), on every peer alike, and
when no collective is in flight:

1. the peers waiting to join are admitted (``are_peers_pending``, ``update_topology``)
   and the ring re-ordered (``optimize_topology``); a communicator that just
   connected makes ``optimize_topology`` its first call, since ``connect()`` returned
   at the end of the members' ``update_topology``;
2. the shared state is synced: a joiner receives it here; between peers that stepped
   together nothing moves;
3. before the run's first step (revision 0, which every peer holds after the sync),
   with fewer than ``min_peers`` in the run, it waits for company
   (``are_peers_pending(wait=inf)``: the master answers when one asks) and goes back
   to 1; later the run goes on with whoever is left, a lone peer on its own, unless
   the boundary was asked to hold for ``company`` peers (the wrappers' ``hold``, which
   every peer asks for at the same step): then it waits alike until the run has them.

Every decision branches only on what every peer shares (the verdicts, the world size
after a membership call, the revision after a sync), so every peer makes the same
calls. ``TooFewPeers``, ``UpdateTopologyFailed`` and ``TopologyOptimizationFailed``
come to every voter alike and start step 1 over; ``SharedStateSyncFailed`` repeats
the sync (``sync``). The boundary reports whether the sync changed this peer's state:
a joiner's, or a peer's that was behind, whose local work was then relative to a
state the run no longer has.
"""

from __future__ import annotations

import math

from .._errors import (
    InvalidArgument,
    SharedStateSyncFailed,
    TooFewPeers,
    TopologyOptimizationFailed,
    UpdateTopologyFailed,
)
from .._types import Attribute, SharedState, SharedStateSyncInfo
from ..peer import Communicator

__all__ = ["Admission", "check_peers"]


def check_peers(peers: int, what: str) -> None:
    """A count of peers the trainer asks for (``what`` names the argument)."""
    if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
        raise InvalidArgument(f"{what} must be a positive int, not {peers!r}")


class Admission:
    """One peer's admissions and syncs with one communicator (see the module docstring)."""

    def __init__(self, min_peers: int) -> None:
        self.min_peers = min_peers
        self.fresh = True  # the communicator just connected: its next call is optimize

    def connected(self) -> None:
        """A new communicator connected: its first boundary starts at the ring."""
        self.fresh = True

    async def admit_and_sync(self, comm: Communicator, shared: SharedState, *,
                             company: int = 0) -> bool:
        """Steps 1 to 3 of the module docstring for ``shared``, holding for ``company``
        peers; whether a sync changed the state."""
        waiting, changed = False, False
        while True:
            try:
                if self.fresh or await comm.are_peers_pending(wait=math.inf if waiting else 0):
                    if not self.fresh:
                        await comm.update_topology()
                    self.fresh = False
                    if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) >= 2:
                        await comm.optimize_topology()
                changed |= (await self.sync(comm, shared)).rx_bytes > 0
            except (TooFewPeers, UpdateTopologyFailed, TopologyOptimizationFailed):
                continue  # every voter got the same verdict: start over
            # After the sync every peer holds the run's revision: the same branch for all.
            world = comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE)
            waiting = (shared.revision == 0 and world < self.min_peers) or world < company
            if not waiting:
                return changed

    async def sync(self, comm: Communicator, shared: SharedState) -> SharedStateSyncInfo:
        """Sync ``shared`` until a sync succeeds."""
        while True:
            try:
                return await comm.sync_shared_state(shared)
            except SharedStateSyncFailed:
                continue
