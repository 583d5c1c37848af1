"""Establishment rounds, the rings they install, and the pending-peers vote.

Theory of operation
-------------------
An *establishment round* (re-)builds one ring per peer group and has every
participant connect to its ring neighbours. It starts once every ACCEPTED peer, in
every peer group, voted ``VoteEstablish``; REGISTERED peers count as yes. If all
voters asked to accept new peers, the REGISTERED peers join the round; a peer
registering while a round runs waits for the next one. When no ACCEPTED peer is left
(the first peer, or everyone else died), waiting peers are admitted at once.

Each participant gets its ring, neighbours and world sizes (``P2PInfo``, CONNECTING),
connects, and reports (``P2PEstablished``: WAITING, or CONNECT_FAILED). The round
succeeds if every participant reports its neighbours reachable and none left
meanwhile; every participant receives the same verdict (``P2PEstablishResult``) and
is ACCEPTED from then on; after a failure they vote again. Each report also says how
many connections the participant's pool to its successor has, and the verdict tells
every member of a group the most of its ring (``stripes``): all-reduces cut each ring
step into at least two slices per connection of that (``ring.striped_slice``), the
same cut at every member, so that a pool sized for a long link is kept busy by every
step. A participant that has not
reported ``round_timeout`` seconds after the start is kicked, so that one stuck peer
cannot stall the run.

The :class:`RingBook` keeps what rounds learn for the other parts: the ring last
installed per group, the edges a peer reported it could not reach (the next ring
avoids them; when no ring can, the peer with the most unreachable edges is kicked),
and the groups whose ring is *stale* (it lost a member, or its round failed) until a
round succeeds: their collectives cannot run before.

Before it builds a group's ring, a round lets the optimizer install a better ring
found by a background search (``adopt_candidate``); otherwise the installed order is
kept and newcomers are appended.

The *pending-peers vote* is orthogonal to the states: when every ACCEPTED peer asked
(``VotePeersPending``, only in ``peers.FREE_STATES``), each gets whether anyone waits
to be admitted. A peer that waits in a vote blocking it (``peers.BLOCKED_BY``) will
never ask: those who did are answered with an error instead. A question may *wait*
(``VotePeersPending.wait``): while nobody waits to be admitted, the answer is held
until a peer registers (True) or the shortest wait of the askers, counted from each
one's question, ran out (False; ``deadline``). That is how a peer alone in the run
waits for company: one question, answered when the company arrives.

Both votes list themselves while they wait for members (``waiting``, see ``stalls``):
past the master's stall timeout the voters are refused, establishment voters with a
``P2PEstablishResult`` of round 0 carrying the reason (and IDLE again), askers with a
``PeersPendingResult`` carrying it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from .errors import RemoteProtocolError
from .messages import (
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    VoteEstablish,
    VotePeersPending,
    WorldSizes,
)
from .peers import (
    FREE_STATES,
    Call,
    Peer,
    PeerEvent,
    PeerPhase,
    PeerState,
    PeerTable,
    check_member_vote,
    find_blocker,
    out_of_order,
)
from .report import KickCause, RunKind
from .ring import find_ring, neighbours
from .stalls import Waiting, run_vote

__all__ = ["PendingVote", "RingBook", "Rounds"]



@dataclasses.dataclass(kw_only=True, slots=True)
class RingBook:
    """What the rounds learned about the rings, read by collectives and optimization."""

    # Peer group -> the ring last installed (may name departed peers until the next
    # round rebuilds it).
    rings: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # (sender, receiver) links a round found unreachable, among peers still present.
    unreachable: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # Groups whose ring lost a member or failed to connect since its last successful
    # round: their collectives cannot run until they re-establish.
    stale_groups: set[int] = dataclasses.field(default_factory=set)
    # Peer group -> how many rings were installed for it (the same ring again counts:
    # its members connected anew; leases end with it).
    epochs: dict[int, int] = dataclasses.field(default_factory=dict)

    def install(self, table: PeerTable, group: int, ring: Sequence[int], why: str) -> None:
        """Make ``ring`` the group's ring, reporting it if it changed (``why``: what
        installed it)."""
        ring = list(ring)
        previous = self.rings.get(group)
        self.rings[group] = ring
        self.epochs[group] = self.epochs.get(group, 0) + 1
        if previous != ring:
            table.report(
                RunKind.RING, f"peer group {group}: ring {ring} ({why})",
                group=group, ring=tuple(ring), previous=tuple(previous or ()), why=why,
            )

    def forget_edges(self, peer_id: int) -> None:
        """``peer_id`` left: its unreachable links no longer constrain any ring."""
        self.unreachable = {edge for edge in self.unreachable if peer_id not in edge}

    def blocked_indices(self, members: Sequence[int]) -> list[int]:
        """Flat matrix indices of the links among ``members`` a round found unreachable."""
        index = {p: i for i, p in enumerate(members)}
        return [
            index[a] * len(members) + index[b]
            for a, b in self.unreachable if a in index and b in index
        ]


@dataclasses.dataclass(kw_only=True, slots=True)
class _Round:
    """The establishment round running: who takes part, which rings, since when."""

    number: int
    participants: set[int]
    rings: dict[int, list[int]]
    started_at: float
    failed: bool = False  # a participant could not reach a neighbour
    dropped: bool = False  # a participant left
    # The connections each participant reported in its pool to its successor.
    pools: dict[int, int] = dataclasses.field(default_factory=dict)


class Rounds:
    """Establishment rounds (see the module docstring).

    Args:
        table: the registry and outbox.
        book: the rings, unreachable edges and stale groups this part maintains.
        round_timeout: seconds a participant has to report after a round starts.
        adopt_candidate: called before a group's ring is built, with the group and its
            participants, so that a better ring found meanwhile can be installed.
    """

    def __init__(
        self,
        table: PeerTable,
        book: RingBook,
        *,
        round_timeout: float,
        adopt_candidate: Callable[[int, set[int]], None],
    ) -> None:
        self._table = table
        self._book = book
        self._round_timeout = round_timeout
        self._adopt_candidate = adopt_candidate
        self._current: _Round | None = None
        self._next_round = 1

    def continue_above(self, number: int) -> None:
        """Number what comes next above ``number`` (a master that took over a run)."""
        self._next_round = max(self._next_round, number + 1)

    @property
    def running(self) -> bool:
        """Whether a round runs (until its verdict is sent)."""
        return self._current is not None

    # --- messages --------------------------------------------------------------------

    def on_vote(self, peer: Peer, message: VoteEstablish) -> None:
        """A member votes to (re-)establish the ring."""
        check_member_vote(peer, message)
        if self._current is not None and peer.peer_id in self._current.participants:
            # CONNECT_FAILED allows a vote, but only once the verdict is out: a
            # participant leaving CONNECT_FAILED early would stall the round.
            raise RemoteProtocolError(
                "VoteEstablish before the result of its establishment round"
            )
        peer.apply(PeerEvent.VOTE_ESTABLISH)
        peer.accept_new_peers = message.accept_new_peers
        peer.voted_at = self._table.now

    def on_established(self, peer: Peer, message: P2PEstablished) -> None:
        """A participant reports on connecting to its neighbours."""
        number, failed = message.round, message.failed_peers
        current = self._current
        if current is None or peer.peer_id not in current.participants:
            raise RemoteProtocolError("P2PEstablished outside an establishment round")
        if number != current.number:
            raise RemoteProtocolError(
                f"P2PEstablished for round {number}, but round {current.number} is running"
            )
        if message.success:
            peer.apply(PeerEvent.REPORT_CONNECTED)
            current.pools[peer.peer_id] = message.pool
            return
        peer.apply(PeerEvent.REPORT_FAILED)
        current.failed = True
        # The round has failed already: from now on its rings are stale, not only once
        # its verdict is out (peers whose report failed may initiate meanwhile).
        self._book.stale_groups.update(current.rings)
        for other in failed:
            if other in self._table.peers and other != peer.peer_id:
                self._book.unreachable.add((peer.peer_id, other))
        self._table.report(
            RunKind.UNREACHABLE, f"round {number}: peer {peer.peer_id} could not reach {list(failed)}",
            level=logging.WARNING, round=number, peer=peer.peer_id, group=peer.peer_group,
            unreachable=tuple(failed),
        )

    # --- consensus -------------------------------------------------------------------

    def advance(self) -> None:
        """Finish the running round once every participant reported, and start the next
        once every member voted; repeat while either happens (the end of a round can
        make a new one startable, e.g. when all voters died)."""
        while True:
            if self._current is not None:
                if not self._try_finish():
                    break
            elif not self._try_start():
                break

    def start(self, accept_new: bool) -> None:
        """Start a round of every ACCEPTED peer, and of the REGISTERED ones if
        ``accept_new``; first kick any peer no ring can include."""
        while True:
            participants = [
                p for p in self._table.peers.values()
                if p.phase is PeerPhase.ACCEPTED
                or (accept_new and p.phase is PeerPhase.REGISTERED)
            ]
            rings, unplaceable = self._build_rings(participants)
            if unplaceable is None:
                break
            # No ring avoids the edges reported unreachable: remove the peer most of
            # them touch so the rest of the run can go on.
            self._table.kick_peer(
                unplaceable,
                "no ring can include this peer: it could not reach, or be reached by, "
                "enough peers (check firewalls and the address it advertises)",
                KickCause.UNREACHABLE,
            )
        current = _Round(
            number=self._next_round,
            participants={p.peer_id for p in participants},
            rings=rings,
            started_at=self._table.now,
        )
        self._next_round += 1
        self._current = current
        self._table.report(
            RunKind.ROUND_STARTED,
            f"round {current.number}: establishing rings {rings} (accepting new peers: "
            f"{accept_new})",
            level=logging.DEBUG, round=current.number, rings=rings, accept_new=accept_new,
        )
        worlds = _world_sizes(participants)
        for peer in participants:
            peer.apply(PeerEvent.ROUND_START)
            peer.pending_vote = False
            ring = rings[peer.peer_group]
            self._table.send(
                peer,
                P2PInfo(
                    round=current.number,
                    ring=tuple(ring),
                    neighbours=self._neighbours(peer.peer_id, ring),
                    world=worlds[peer.peer_group],
                ),
            )

    def waiting(self) -> Iterator[Waiting]:
        """The establishment vote, while some members voted and others did not; and
        each peer waiting to be admitted, while some member has not voted."""
        if self._current is not None:
            return
        yield from run_vote(
            self._table, Call.UPDATE_TOPOLOGY,
            voted=lambda p: p.state is PeerState.VOTE_ESTABLISH,
            since=lambda p: p.voted_at, fail=self._refuse,
        )
        accepted = self._table.accepted()
        if all(p.state is PeerState.VOTE_ESTABLISH for p in accepted):
            return  # nobody to wait for (the next round starts, or nobody is a member)
        for joiner in self._table.peers.values():
            if joiner.phase is PeerPhase.REGISTERED:
                yield self._admission(joiner)

    def _admission(self, joiner: Peer) -> Waiting:
        """A peer's wait to be admitted: its registration (or its vote after a round
        that failed) is its vote; the members admit it with theirs."""
        table = self._table
        return Waiting(
            key=("admission", joiner.peer_id),
            call="connect",
            where=f"peer {joiner.peer_id}",
            since=joiner.voted_at,
            missing=lambda: [
                p for p in table.accepted() if p.state is not PeerState.VOTE_ESTABLISH
            ],
            fail=lambda reason: table.kick_peer(joiner, reason, KickCause.REFUSED),
            awaited="the members that did not admit it (by update_topology)",
            rule=(
                "the members admit a waiting peer when every one of them calls "
                "update_topology(); a training loop asks are_peers_pending() between "
                "steps and calls update_topology() when it says True"
            ),
        )

    def _refuse(self, reason: str) -> None:
        """End the establishment vote without a round: every voter is told why."""
        for peer in self._table.accepted():
            if peer.state is PeerState.VOTE_ESTABLISH:
                peer.apply(PeerEvent.ESTABLISH_REFUSED)
                self._table.send(
                    peer,
                    P2PEstablishResult(
                        round=0, success=False, ring=(), world=_NO_WORLD, error=reason
                    ),
                )

    def _try_start(self) -> bool:
        """Start a round once every member voted (with no member, at once if a peer
        waits to be admitted); whether one started."""
        accepted = self._table.accepted()
        if accepted:
            if not all(p.state is PeerState.VOTE_ESTABLISH for p in accepted):
                return False
            accept_new = all(p.accept_new_peers for p in accepted)
        elif self._table.anyone_waiting():
            accept_new = True  # nobody to ask: admit the waiting peers
        else:
            return False
        self.start(accept_new)
        return True

    def _build_rings(
        self, participants: Iterable[Peer]
    ) -> tuple[dict[int, list[int]], Peer | None]:
        """One ring per peer group, or the peer to remove if some group has none."""
        groups: dict[int, list[int]] = {}
        for peer in participants:
            groups.setdefault(peer.peer_group, []).append(peer.peer_id)
        rings: dict[int, list[int]] = {}
        for group, members in groups.items():
            member_set = set(members)
            self._adopt_candidate(group, member_set)
            kept = [p for p in self._book.rings.get(group, ()) if p in member_set]
            preferred = kept + sorted(member_set.difference(kept))
            blocked = {
                (a, b) for (a, b) in self._book.unreachable
                if a in member_set and b in member_set
            }
            ring = find_ring(preferred, blocked)
            if ring is None:
                touches: dict[int, int] = {}
                for a, b in blocked:
                    touches[a] = touches.get(a, 0) + 1
                    touches[b] = touches.get(b, 0) + 1
                worst = max(touches, key=lambda p: (touches[p], p))
                return rings, self._table.peers[worst]
            rings[group] = ring
        return rings, None

    def _neighbours(self, peer_id: int, ring: Sequence[int]) -> tuple[PeerEndpoint, ...]:
        """Where ``peer_id``'s ring neighbours listen (once each; none when alone)."""
        around = neighbours(ring, peer_id)
        return () if around is None else tuple(self._table.endpoint(i) for i in dict.fromkeys(around))

    def _try_finish(self) -> bool:
        """Send the verdict once every participant reported; whether it was sent."""
        current = self._current
        assert current is not None
        members = [self._table.peers[p] for p in current.participants]
        if not all(p.state in (PeerState.WAITING, PeerState.CONNECT_FAILED) for p in members):
            return False
        self._current = None
        success = not current.failed and not current.dropped
        # A group none of whose participants is left teaches nothing about its ring (and
        # its ids may belong to others by now: members that came back, ``recovery``).
        touched = []
        for group, ring in current.rings.items():
            present = [p for p in ring if p in current.participants]
            if present:
                self._book.install(
                    self._table, group, present,
                    f"round {current.number} {'succeeded' if success else 'failed'}",
                )
                touched.append(group)
        worlds = _world_sizes(members)
        if success:
            self._book.stale_groups.difference_update(touched)
        else:
            self._book.stale_groups.update(touched)
        event = PeerEvent.ROUND_SUCCEEDED if success else PeerEvent.ROUND_FAILED
        stripes: dict[int, int] = {}
        for peer in members:
            group = peer.peer_group
            stripes[group] = max(stripes.get(group, 1), current.pools.get(peer.peer_id, 1))
        for peer in members:
            peer.phase = PeerPhase.ACCEPTED
            peer.apply(event)
            self._table.send(
                peer,
                P2PEstablishResult(
                    round=current.number,
                    success=success,
                    ring=tuple(self._book.rings[peer.peer_group]),
                    world=worlds[peer.peer_group],
                    stripes=stripes[peer.peer_group],
                ),
            )
        self._table.report(
            RunKind.ROUND,
            f"round {current.number} {'succeeded' if success else 'failed'}: {len(members)} "
            f"peers in {len(worlds)} groups",
            level=logging.INFO if success else logging.WARNING, round=current.number,
            outcome="succeeded" if success else "failed", peers=len(members),
            groups=len(worlds),
        )
        return True

    # --- removal and time ------------------------------------------------------------

    def peer_left(self, peer: Peer) -> None:
        """The running round fails without ``peer``; a member's group ring is stale."""
        if self._current is not None and peer.peer_id in self._current.participants:
            self._current.participants.discard(peer.peer_id)
            self._current.dropped = True
        if peer.phase is PeerPhase.ACCEPTED:
            self._book.stale_groups.add(peer.peer_group)

    def deadline(self) -> float:
        """When the running round times out (``inf``: none runs)."""
        if self._current is None:
            return math.inf
        return self._current.started_at + self._round_timeout

    def kick_late(self) -> bool:
        """Kick the participants that did not report in time; whether any was late."""
        current = self._current
        if current is None or self._table.now < current.started_at + self._round_timeout:
            return False
        late = [
            self._table.peers[p] for p in sorted(current.participants)
            if self._table.peers[p].state is PeerState.CONNECTING
        ]
        for peer in late:
            self._table.kick_peer(
                peer,
                f"did not report on its p2p connections within {self._round_timeout}s "
                f"of round {current.number}'s start",
                KickCause.LATE,
            )
        return bool(late)


#: The world of a refused establishment vote (no round ran).
_NO_WORLD = WorldSizes(
    global_world_size=0, peer_group_world_size=0, num_distinct_peer_groups=0,
    largest_peer_group_world_size=0,
)


def _world_sizes(participants: Sequence[Peer]) -> dict[int, WorldSizes]:
    """Each group's view of the run's sizes, by group."""
    sizes: dict[int, int] = {}
    for peer in participants:
        sizes[peer.peer_group] = sizes.get(peer.peer_group, 0) + 1
    return {
        group: WorldSizes(
            global_world_size=len(participants),
            peer_group_world_size=size,
            num_distinct_peer_groups=len(sizes),
            largest_peer_group_world_size=max(sizes.values()),
        )
        for group, size in sizes.items()
    }


class PendingVote:
    """The pending-peers vote (see the module docstring)."""

    def __init__(self, table: PeerTable) -> None:
        self._table = table

    def on_vote(self, peer: Peer, message: VotePeersPending) -> None:
        """A member asks whether peers wait to be admitted."""
        if peer.phase is not PeerPhase.ACCEPTED:
            raise RemoteProtocolError("VotePeersPending before being accepted into the run")
        if peer.pending_vote:
            raise RemoteProtocolError("VotePeersPending twice in one vote")
        if peer.state not in FREE_STATES:
            raise RemoteProtocolError(
                f"VotePeersPending is not allowed in state {peer.state.name}"
            )
        peer.pending_vote = True
        peer.pending_since = self._table.now
        peer.pending_wait = message.wait

    @staticmethod
    def _answer_at(askers: Sequence[Peer]) -> float:
        """When a question every one of ``askers`` asked is answered with nobody waiting."""
        return min(p.pending_since + p.pending_wait for p in askers)

    def deadline(self) -> float:
        """When a held answer is due (``inf``: no answer is held)."""
        accepted = self._table.accepted()
        if not accepted or not all(p.pending_vote for p in accepted):
            return math.inf
        return self._answer_at(accepted)

    def waiting(self) -> Iterator[Waiting]:
        """The vote, while some members asked and others did not."""
        yield from run_vote(
            self._table, Call.ARE_PEERS_PENDING, voted=lambda p: p.pending_vote,
            since=lambda p: p.pending_since, fail=self._refuse,
        )

    def _refuse(self, reason: str) -> None:
        """Answer every asker with ``reason`` instead of the answer."""
        for peer in self._table.accepted():
            if peer.pending_vote:
                peer.pending_vote = False
                self._table.send(peer, PeersPendingResult(pending=False, error=reason))

    def advance(self) -> None:
        """Refuse the askers a vote blocks; answer everyone once every member asked."""
        accepted = self._table.accepted()
        refused = False
        for peer in accepted:
            if not peer.pending_vote:
                continue
            # A peer blocked in a topology vote (any group's: rounds are global) or a
            # sync vote (its own group's) will never ask: answer those who did with an
            # error rather than leave both sides waiting for each other.
            blocker = find_blocker(Call.ARE_PEERS_PENDING, peer.peer_group, accepted)
            if blocker is None:
                continue
            refused = True
            peer.pending_vote = False
            self._table.send(
                peer,
                PeersPendingResult(
                    pending=False, error=out_of_order(blocker, Call.ARE_PEERS_PENDING)
                ),
            )
        if refused or not accepted or not all(p.pending_vote for p in accepted):
            return
        pending = self._table.anyone_waiting()
        if not pending and self._table.now < self._answer_at(accepted):
            return  # held: a peer may still arrive within the askers' wait
        for peer in accepted:
            peer.pending_vote = False
            self._table.send(peer, PeersPendingResult(pending=pending))
