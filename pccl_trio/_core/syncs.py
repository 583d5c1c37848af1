"""Shared-state syncs: one peer group's vote, election, distribution and completion.

Theory of operation
-------------------
A sync is a vote of one peer group. Each member votes ``SharedStateVote`` (VOTE_SYNC)
with its *ballot*: revision, strategy and one entry per tensor. A vote whose revision
skips ahead of the one the group expects next is refused at once (the peer is kicked:
a revision is one above the last sync's, or that one again, or behind), and so is a
vote whose entries do not carry content digests exactly as the run requires
(``content_digest``: a BLAKE2b-256 digest on every entry whose content must match, none
elsewhere; without it, none at all). Once
every accepted member of the group voted, :func:`shared_state.elect` decides, as a pure
function of the ballots: who is kicked, which revision everyone holds afterwards, who
fetches which keys, and who may distribute them. Every remaining voter gets its
``SharedStatePlan`` (SYNCING), fetches from the distributors peer to peer, and reports
``SharedStateDone`` (SYNC_DONE); when all have, each gets ``SharedStateComplete`` (IDLE)
and the group expects the next revision. When nobody fetches anything (every member
holds the popular state, the common case of a training loop's every step), there is
nothing to wait for: the plan says ``complete`` and every voter is IDLE at once, so
the sync costs one round trip to the master instead of two.

A vote the group cannot complete is refused rather than left waiting: when a member
waits in a topology vote (``peers.BLOCKED_BY``), or when the election left nobody who
may send the popular state, or when some member has not voted within the master's
stall timeout (``waiting``, see ``stalls``). Refused voters get a plan with ``error``
and are IDLE.
A peer that leaves is no longer waited for; when a group's last member leaves, its
expected revision is forgotten (a new group may start from any revision).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence

from .errors import RemoteProtocolError
from .messages import (
    SharedStateComplete,
    SharedStateDone,
    SharedStateFetcher,
    SharedStatePlan,
    SharedStateVote,
    bounded,
)
from .nested import DTYPE_SIZES
from .peers import (
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
from .shared_state import Ballot, Election, elect, tensor_spans
from .stalls import Waiting

__all__ = ["Syncs", "check_digests"]



@dataclasses.dataclass(kw_only=True, slots=True)
class _Sync:
    """A peer group's shared-state sync, from the election to the last peer's report."""

    number: int
    members: set[int]
    started: float
    planned_bytes: int  # what its fetchers were told to fetch
    done: set[int] = dataclasses.field(default_factory=set)


def _planned_bytes(election: Election, ballots: Mapping[int, Ballot]) -> int:
    """The bytes a sync's fetchers must fetch, by the distributors' entries."""
    if not election.distributors:
        return 0
    sizes = {
        entry.key: entry.count * DTYPE_SIZES[entry.dtype]
        for entry in ballots[election.distributors[0]].entries
        if 0 <= entry.dtype < len(DTYPE_SIZES)
    }
    return sum(sizes.get(f.key, 0) for fetches in election.fetches.values() for f in fetches)


def check_digests(vote: SharedStateVote, *, required: bool) -> None:
    """Raise ``RemoteProtocolError`` (the peer is kicked) unless every entry of ``vote``
    whose content must match carries a content digest when ``required``, and no other
    entry carries one."""
    for entry in vote.entries:
        wanted = required and not entry.allow_content_inequality
        if wanted and not entry.digest:
            raise RemoteProtocolError(
                f"shared-state tensor {entry.key!r:.100} carries no content digest, but this "
                "run requires a BLAKE2b-256 digest of every tensor whose content must match "
                "(the master runs with --content-digest)"
            )
        if entry.digest and not wanted:
            raise RemoteProtocolError(
                f"shared-state tensor {entry.key!r:.100} carries a content digest, but "
                + ("its content may differ (allow_content_inequality)" if required else
                   "this run uses none (the master runs without --content-digest)")
            )


class Syncs:
    """The shared-state syncs of every peer group."""

    def __init__(self, table: PeerTable, *, content_digest: bool = False) -> None:
        self._table = table
        self._content_digest = content_digest
        # Per peer group: the revision the next sync expects (absent before the first
        # sync), and the sync in its distribution phase.
        self._expected_revision: dict[int, int] = {}
        self._running: dict[int, _Sync] = {}
        self._next_sync = 1

    def expect(self, group: int, revision: int) -> None:
        """Peer group ``group`` expects ``revision`` next (its members said so)."""
        self._expected_revision[group] = max(self._expected_revision.get(group, 0), revision)

    def expected(self, group: int) -> int | None:
        """The revision peer group ``group``'s next sync expects (None: not known)."""
        return self._expected_revision.get(group)

    def continue_above(self, number: int) -> None:
        """Number what comes next above ``number`` (a master that took over a run)."""
        self._next_sync = max(self._next_sync, number + 1)

    def on_vote(self, peer: Peer, message: SharedStateVote) -> None:
        """A member votes its shared state."""
        check_member_vote(peer, message)
        check_digests(message, required=self._content_digest)
        peer.apply(PeerEvent.VOTE_SYNC)
        peer.voted_at = self._table.now
        expected = self._expected_revision.get(peer.peer_group)
        if expected is not None and message.revision > expected:
            self._table.kick_peer(
                peer,
                f"shared-state revision {message.revision} skips ahead of revision "
                f"{expected}, the next one of peer group {peer.peer_group}: each sync must "
                "advance the revision by at most one",
                KickCause.SHARED_STATE,
            )
            return
        peer.ballot = Ballot(
            revision=message.revision, strategy=message.strategy, entries=message.entries
        )

    def on_done(self, peer: Peer, message: SharedStateDone) -> None:
        """A member finished its part of the running sync (fetched, or failed to)."""
        number = message.sync
        sync = self._running.get(peer.peer_group)
        if sync is None or sync.number != number or peer.peer_id not in sync.members:
            raise RemoteProtocolError(f"SharedStateDone for sync {number}, which is not running")
        peer.apply(PeerEvent.REPORT_SYNCED)
        sync.done.add(peer.peer_id)
        if not message.success:
            self._table.report(
                RunKind.SYNC_FAILED,
                f"sync {number}: peer {peer.peer_id} could not fetch the shared state: "
                f"{message.reason}",
                level=logging.WARNING, sync=number, peer=peer.peer_id, group=peer.peer_group,
                reason=message.reason,
            )

    def advance(self) -> None:
        """Complete the syncs every member reported, then refuse or start the votes
        that can no longer wait or are complete."""
        for group, sync in list(self._running.items()):
            if sync.members <= sync.done:
                del self._running[group]
                for peer_id in sorted(sync.members):
                    peer = self._table.peers[peer_id]
                    peer.apply(PeerEvent.SYNC_COMPLETE)
                    self._table.send(peer, SharedStateComplete(sync=sync.number))
                self._report_synced(group, sync)
        groups: dict[int, list[Peer]] = {}
        for peer in self._table.accepted():
            groups.setdefault(peer.peer_group, []).append(peer)
        for group, members in groups.items():
            voters = [p for p in members if p.state is PeerState.VOTE_SYNC]
            if not voters:
                continue
            blocker = find_blocker(Call.SYNC_SHARED_STATE, group, members)
            if blocker is not None:
                self._refuse(voters, out_of_order(blocker, Call.SYNC_SHARED_STATE))
            elif len(voters) == len(members):
                self._start(group, voters)

    def _report_synced(self, group: int, sync: _Sync) -> None:
        self._table.report(
            RunKind.SYNCED, f"sync {sync.number} of peer group {group} complete",
            level=logging.DEBUG, sync=sync.number, group=group,
            peers=len(sync.members), seconds=self._table.now - sync.started,
            planned_bytes=sync.planned_bytes,
        )

    def waiting(self) -> Iterator[Waiting]:
        """Each group's sync vote, while some members voted and others did not."""
        groups: dict[int, list[Peer]] = {}
        for peer in self._table.accepted():
            groups.setdefault(peer.peer_group, []).append(peer)
        for group, members in groups.items():
            voters = [p for p in members if p.state is PeerState.VOTE_SYNC]
            if voters and len(voters) < len(members):
                yield Waiting(
                    key=("sync_shared_state", group),
                    call=Call.SYNC_SHARED_STATE.value,
                    where=f"peer group {group}",
                    since=min(p.voted_at for p in voters),
                    missing=functools.partial(self._missing, group),
                    fail=functools.partial(self._refuse_group, group),
                )

    def _missing(self, group: int) -> list[Peer]:
        return [
            p for p in self._table.accepted()
            if p.peer_group == group and p.state is not PeerState.VOTE_SYNC
        ]

    def _refuse_group(self, group: int, reason: str) -> None:
        self._refuse(
            [
                p for p in self._table.accepted()
                if p.peer_group == group and p.state is PeerState.VOTE_SYNC
            ],
            reason,
        )

    def peer_left(self, peer: Peer) -> None:
        """Stop waiting for ``peer``'s report; forget the group's revision if it was the
        group's last member."""
        sync = self._running.get(peer.peer_group)
        if sync is not None:
            sync.members.discard(peer.peer_id)
            sync.done.discard(peer.peer_id)
        if not any(
            p.peer_group == peer.peer_group and p.phase is PeerPhase.ACCEPTED
            for p in self._table.peers.values()
        ):
            # Nobody is left to hold the group's state: a new group may start anywhere.
            self._expected_revision.pop(peer.peer_group, None)

    def _refuse(self, voters: Sequence[Peer], reason: str) -> None:
        """End the voters' vote with ``reason``; their shared state stays as it is."""
        for peer in voters:
            assert peer.ballot is not None
            peer.apply(PeerEvent.SYNC_REFUSED)
            self._table.send(
                peer,
                SharedStatePlan(
                    sync=0, revision=peer.ballot.revision, fetches=(), distributors=(),
                    error=bounded(reason),
                ),
            )
            peer.ballot = None

    def _start(self, group: int, voters: Sequence[Peer]) -> None:
        """Elect and send every remaining voter its plan (see the module docstring)."""
        ballots = {p.peer_id: p.ballot for p in voters if p.ballot is not None}
        election = elect(ballots, self._expected_revision.get(group))
        for peer_id, reason in sorted(election.kicks.items()):
            self._table.kick_peer(self._table.peers[peer_id], reason, KickCause.SHARED_STATE)
        remaining = [p for p in voters if p.peer_id in election.fetches]
        if not remaining:
            return
        if not election.distributors and any(election.fetches.values()):
            self._refuse(
                remaining,
                "no peer that holds the popular shared state may send it (the peers "
                "holding it were removed); synchronize again",
            )
            return
        number = self._next_sync
        self._next_sync += 1
        self._expected_revision[group] = election.revision + 1
        planned = _planned_bytes(election, ballots)
        self._running[group] = _Sync(
            number=number, members={p.peer_id for p in remaining}, started=self._table.now,
            planned_bytes=planned,
        )
        self._table.report(
            RunKind.SYNC_STARTED,
            f"sync {number} of peer group {group}: revision {election.revision}, distributors "
            f"{list(election.distributors)}, fetching "
            f"{ {p: len(f) for p, f in election.fetches.items() if f} }",
            level=logging.DEBUG, sync=number, group=group, revision=election.revision,
            planned_bytes=planned,
            distributors=tuple(election.distributors),
            fetchers=tuple(p for p, f in election.fetches.items() if f),
        )
        if not any(election.fetches.values()):
            for peer in remaining:
                peer.apply(PeerEvent.SYNC_OVER)
                peer.ballot = None
                self._table.send(
                    peer,
                    SharedStatePlan(sync=number, revision=election.revision, fetches=(),
                                    distributors=(), complete=True),
                )
            self._report_synced(group, self._running.pop(group))
            return
        position = {key: index for index, key in enumerate(election.keys)}
        fetchers = tuple(
            SharedStateFetcher(
                peer_id=peer.peer_id,
                host=peer.host,
                identity=peer.identity,
                tensors=tensor_spans(sorted(position[f.key] for f in election.fetches[peer.peer_id])),
            )
            for peer in remaining if election.fetches[peer.peer_id]
        )
        for peer in remaining:
            peer.apply(PeerEvent.SYNC_START)
            peer.ballot = None
            distributors = tuple(
                self._table.endpoint(d) for d in election.distributors if d != peer.peer_id
            )
            self._table.send(
                peer,
                SharedStatePlan(
                    sync=number,
                    revision=election.revision,
                    fetches=election.fetches[peer.peer_id],
                    distributors=distributors,
                    fetchers=fetchers if peer.peer_id in election.distributors else (),
                ),
            )
