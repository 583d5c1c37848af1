"""Membership: joining, establishment rounds, and keeping the ring up to date.

Theory of operation
-------------------
The master changes the ring in *establishment rounds*. A round starts once every
member voted (``VoteEstablish``; a joiner's registration is its vote). Each participant
gets the round's ``P2PInfo`` (the ring, its neighbours' addresses), rewires its
connection pools to its new successor (``P2PConnections.rewire``), reports whether it
reached it (``P2PEstablished``) and waits for the round's verdict, which is the same for
every participant (``P2PEstablishResult``). A successful round installs the ring and
the world sizes; the parts that follow the ring (the topology view) are told. A failed
round is voted again, up to ``Config.establish_attempts`` times.

The master refuses a vote that other members did not join within its stall timeout
(a ``P2PEstablishResult`` of round 0 saying who they are): the call raises
``UpdateTopologyFailed`` with that reason, and the ring stays as it was.

An aborted all-reduce leaves the ring *stale*: one of its peers may be gone. Before
its next collective call, every survivor re-establishes the ring (a round that admits
nobody) once no attempt is in flight on it and no other membership call runs, so all of
them vote in the same rounds, whatever the timing (``ensure_ring``). ``generation``
counts the times the ring went stale: a caller that launches several all-reduces
compares it to tell whether a re-establishment may have come between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .._core.messages import (
    MAX_PENDING_WAIT,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
    VoteEstablish,
    VotePeersPending,
    WorldSizes,
)
from .._core.ring import neighbours
from .._errors import InvalidUsage, MasterConnectionError, UpdateTopologyFailed
from ._context import PeerContext
from ._lifecycle import Call
from ._receiver import DataReceiver

__all__ = ["Membership"]

log = logging.getLogger("pccl_trio.peer")


class Membership:
    """This peer's view of the run: its ring and world sizes, and the rounds."""

    def __init__(self, context: PeerContext, *, receiver: DataReceiver) -> None:
        self._config = context.config
        self._life = context.lifecycle
        self._session = context.session
        self._p2p = context.p2p
        self._receiver = receiver
        self.ring: tuple[int, ...] = ()
        #: The most connections any pool of the ring has (the round's ``stripes``): how
        #: finely all-reduces on this ring cut a step (``_core.ring.striped_slice``).
        self.stripes = 1
        #: The node identities the master named for this peer's ring neighbours.
        self.neighbour_identities: dict[int, bytes] = {}
        self.world: WorldSizes | None = None
        # The ring must be re-established (a collective was aborted, or rounds failed)
        # before the next collective; ``ensure_ring`` does it once nothing is in flight.
        self._stale = False
        #: How many times the ring went stale (see ``stale``).
        self.generation = 0
        self._followers: list[Callable[[tuple[int, ...]], None]] = []

    @property
    def stale(self) -> bool:
        """Whether the ring must be re-established before the next collective."""
        return self._stale

    @stale.setter
    def stale(self, value: bool) -> None:
        if value and not self._stale:
            self.generation += 1
        self._stale = value

    def follow(self, follower: Callable[[tuple[int, ...]], None]) -> None:
        """Call ``follower`` with every ring a successful round installs."""
        self._followers.append(follower)

    async def join(self) -> None:
        """Take part in the rounds that admit this peer (its registration was its vote).

        Raises:
            UpdateTopologyFailed: every one of ``Config.establish_attempts`` rounds failed.
        """
        self._life.voted = True
        for _attempt in range(self._config.establish_attempts):
            if await self.establish_round():
                return
            await self._session.vote(VoteEstablish(accept_new_peers=True))
        raise UpdateTopologyFailed(
            f"joined the run, but its ring failed {self._config.establish_attempts} "
            "times in a row; this peer left again: check that the other peers can "
            "reach its p2p port, then connect a new Communicator"
        )

    async def establish_round(self) -> bool:
        """Take part in the next establishment round; True if it succeeded.

        Raises:
            UpdateTopologyFailed: the master refused this peer's vote (others did not
                vote in time); no round ran.
        """
        info: P2PInfo | P2PEstablishResult = await self._session.wait_for(
            (P2PInfo, P2PEstablishResult),
            lambda m: isinstance(m, P2PInfo) or m.round == 0,
        )
        if isinstance(info, P2PEstablishResult):
            raise UpdateTopologyFailed(
                f"the master refused the vote to establish the ring: {info.error}; the ring "
                "is unchanged"
            )
        epoch = self._session.epoch  # of the master running this round (P2PInfo is not kept)
        me = self._session.peer_id
        assert me is not None
        ring = info.ring
        if me not in ring:
            raise MasterConnectionError(
                f"the master's ring {list(ring)} does not include this peer ({me})"
            )
        predecessor, successor = neighbours(ring, me) or (None, None)
        failed = await self._p2p.rewire(
            successor, predecessor, {e.peer_id: e for e in info.neighbours}
        )
        pool = 0 if failed or successor is None else len(self._p2p.pools.successor_connections(successor))
        await self._session.send(
            P2PEstablished(round=info.round, success=not failed, failed_peers=tuple(failed),
                           pool=pool),
            epoch=epoch,
        )
        result = await self._session.wait_for(P2PEstablishResult, lambda r: r.round == info.round)
        if result.success:
            self.ring = result.ring
            self.world = result.world
            self.stripes = result.stripes
            self.neighbour_identities = {e.peer_id: e.identity for e in info.neighbours}
            for follower in self._followers:
                follower(result.ring)
            self._p2p.expect_only(predecessor)
            log.info(
                "peer %d: round %d done, ring %s, world %d",
                me, result.round, list(result.ring), result.world.global_world_size,
            )
        return result.success

    async def establish_rounds(self, *, accept_new_peers: bool, voted: bool = False) -> bool:
        """Vote and take part in establishment rounds until one succeeds, at most
        ``Config.establish_attempts`` of them (``voted``: the first needs no vote).

        On failure the ring stays stale: the master holds this peer as CONNECT_FAILED,
        where only a topology vote is allowed, so every other collective call
        re-establishes first.
        """
        for attempt in range(self._config.establish_attempts):
            if attempt or not voted:
                await self._session.vote(VoteEstablish(accept_new_peers=accept_new_peers))
            try:
                succeeded = await self.establish_round()
            except UpdateTopologyFailed:
                # Refused: the ring is as it was, unless a round of this call failed.
                self.stale = self.stale or attempt > 0
                raise
            if succeeded:
                self.stale = False
                return True
        self.stale = True
        return False

    async def ensure_ring(self) -> None:
        """Re-establish the ring (without admitting peers) if an abort left it stale.

        Runs once no collective is in flight on this peer and no membership call runs:
        every survivor of an aborted collective does the same, so the vote completes.

        Raises:
            UpdateTopologyFailed: the rounds kept failing.
        """
        while self.stale:
            self._life.raise_if_failed()
            if self._receiver.in_flight or self._life.busy is not None:
                await self._life.wait_changed()
                continue
            with self._life.operation(Call.REESTABLISH):
                if await self.establish_rounds(accept_new_peers=False):
                    return
            raise UpdateTopologyFailed(
                "the ring could not be re-established after an aborted collective; "
                "call update_topology()"
            )

    async def update_topology(self) -> None:
        """``Communicator.update_topology``, once the communicator is idle."""
        # Bring a ring left stale by an abort up to date first, as every survivor does
        # before its next collective call (some did it already, at the end of the abort):
        # the peers then vote in the same rounds, whatever the timing.
        await self.ensure_ring()
        with self._life.operation(Call.UPDATE_TOPOLOGY):
            if await self.establish_rounds(accept_new_peers=True):
                return
            raise UpdateTopologyFailed(
                f"the ring could not be established in {self._config.establish_attempts} "
                "rounds (peers kept failing or leaving); call update_topology() again"
            )

    async def are_peers_pending(self, deadline: float) -> bool:
        """``Communicator.are_peers_pending``, its answer held by the master until a peer
        waits or ``deadline`` (trio time) passes; asked again with what is left of the
        wait when the master was lost meanwhile (see ``Communicator``)."""
        await self.ensure_ring()
        with self._life.operation(Call.ARE_PEERS_PENDING):
            wait = min(max(0.0, deadline - trio.current_time()), MAX_PENDING_WAIT)
            await self._session.vote(VotePeersPending(wait=wait))
            result = await self._session.wait_for(PeersPendingResult)
            if result.error:
                raise InvalidUsage(result.error)
            return result.pending
