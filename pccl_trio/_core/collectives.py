"""Collectives: each peer group's all-reduces, from the initiate votes to the verdicts.

Theory of operation
-------------------
A collective is keyed by its peer group and *tag*. Every accepted member of the group
votes ``CollectiveInitiate`` with a descriptor (count, dtype, op, quantization,
distribution hint); the vote changes no state, so it is allowed only in
``peers.FREE_STATES``, and a peer may have several tags in flight. Once every member
voted and all descriptors agree, the collective *commences*: it gets a fresh attempt
number ``seq`` (they only grow) and every member is told the ring to run on
(``CollectiveCommence``). Each participant then reports ``CollectiveComplete``; when
all have, each gets the one verdict (``CollectiveVerdict``): SUCCESS, ABORTED (a peer
failed or left: an ``CollectiveAbort`` stopped the others at once) or REJECTED (a
peer's data could not be reduced).

A collective that cannot commence ends at once, with a verdict of seq 0, rather than
wait: BLOCKED when a member waits in a shared-state sync (the ring is intact; the
voters sync next), ABORTED when a member waits in a topology vote that blocks
all-reduces (``peers.BLOCKED_BY``) or when the group's ring is stale (it must be
re-established first), REJECTED when the descriptors disagree. A collective some member never
votes for ends REJECTED after the master's stall timeout (``stalls``: ``waiting``
lists the collectives waiting for members). Every voter gets exactly one verdict per
initiate.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence

from .errors import RemoteProtocolError
from .messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    Outcome,
    bounded,
)
from .peers import FREE_STATES, VOTES, Call, Peer, PeerPhase, PeerState, PeerTable, find_blocker
from .report import RunKind
from .rounds import RingBook
from .stalls import Waiting
from .status import CollectiveStatus

__all__ = ["Collectives"]



@dataclasses.dataclass(kw_only=True, slots=True)
class _Collective:
    """One all-reduce of a peer group, from the first initiate vote to the verdicts."""

    group: int
    tag: int
    descriptors: dict[int, CollectiveInitiate]  # peer id -> its initiate vote
    since: float  # when the first member voted
    seq: int = 0  # 0 until commenced
    commenced: float = 0.0  # when it did
    participants: set[int] = dataclasses.field(default_factory=set)
    completed: set[int] = dataclasses.field(default_factory=set)
    aborted: bool = False
    reason: str = ""
    # A peer's data could not be reduced: the verdict is REJECTED, not ABORTED.
    rejected: bool = False


def _descriptor_key(message: CollectiveInitiate) -> tuple[int, ...]:
    """What every member of a collective must agree on."""
    return (
        message.count, message.dtype, message.op, message.quantized_dtype, message.quantization,
        message.distribution_hint, message.slice_bytes,
    )


class Collectives:
    """The collectives of every peer group (see the module docstring)."""

    def __init__(self, table: PeerTable, book: RingBook) -> None:
        self._table = table
        self._book = book
        self._running: dict[tuple[int, int], _Collective] = {}  # (group, tag) -> it
        self._next_seq = 1

    def continue_above(self, number: int) -> None:
        """Number what comes next above ``number`` (a master that took over a run)."""
        self._next_seq = max(self._next_seq, number + 1)

    def on_initiate(self, peer: Peer, message: CollectiveInitiate) -> None:
        """A member votes to run the collective ``message.tag``."""
        if peer.phase is not PeerPhase.ACCEPTED:
            raise RemoteProtocolError("CollectiveInitiate before being accepted into the run")
        if peer.state not in FREE_STATES:
            raise RemoteProtocolError(f"CollectiveInitiate is not allowed in state {peer.state.name}")
        if message.tag in peer.tags_in_flight:
            raise RemoteProtocolError(f"tag {message.tag} is already in flight for this peer")
        key = (peer.peer_group, message.tag)
        collective = self._running.get(key)
        if collective is None:
            collective = _Collective(
                group=peer.peer_group, tag=message.tag, descriptors={}, since=self._table.now
            )
            self._running[key] = collective
        elif collective.seq:
            # Others are already running this tag without us: our vote is for the
            # next use of the tag, which cannot start before this one ends.
            raise RemoteProtocolError(
                f"CollectiveInitiate for tag {message.tag} while its attempt {collective.seq} "
                "runs without this peer"
            )
        peer.tags_in_flight.add(message.tag)
        collective.descriptors[peer.peer_id] = message

    def on_complete(self, peer: Peer, message: CollectiveComplete) -> None:
        """A participant finished its part of a running attempt (or failed it)."""
        tag, seq = message.tag, message.seq
        collective = self._running.get((peer.peer_group, tag))
        if collective is None or not collective.seq or peer.peer_id not in collective.participants:
            raise RemoteProtocolError(f"CollectiveComplete for tag {tag}, which is not running")
        if seq != collective.seq:
            raise RemoteProtocolError(
                f"CollectiveComplete for attempt {seq} of tag {tag}; attempt {collective.seq} runs"
            )
        if peer.peer_id in collective.completed:
            raise RemoteProtocolError(f"CollectiveComplete twice for tag {tag}")
        collective.completed.add(peer.peer_id)
        if message.invalid and not collective.aborted:
            collective.rejected = True
            self._abort(collective, f"peer {peer.peer_id}: {message.invalid}")
        elif message.aborted:
            self._abort(collective, f"peer {peer.peer_id} failed during the collective")

    def advance(self) -> None:
        """Send the verdicts of the attempts every participant completed; commence, or
        end at once, the collectives every member voted for or that cannot wait."""
        for collective in list(self._running.values()):
            if collective.seq:
                if collective.participants <= collective.completed:
                    outcome = (
                        Outcome.REJECTED if collective.rejected
                        else Outcome.ABORTED if collective.aborted else Outcome.SUCCESS
                    )
                    self._end(collective, outcome, collective.reason)
                continue
            members = [
                p for p in self._table.accepted() if p.peer_group == collective.group
            ]
            blocker = find_blocker(Call.ALL_REDUCE, collective.group, members)
            if blocker is not None:
                # That peer is blocked in a vote and will never initiate: waiting would
                # deadlock the group. Behind a sync vote the ring stays as it is (the
                # voters re-establish nothing before their sync, which the syncing peer
                # could not join); behind a topology vote, they take part in one.
                self._end(
                    collective,
                    Outcome.BLOCKED if blocker.state is PeerState.VOTE_SYNC else Outcome.ABORTED,
                    f"peer {blocker.peer_id} voted to {VOTES[blocker.state].purpose} instead of "
                    f"joining the all-reduce with tag {collective.tag}",
                )
                continue
            if not all(p.peer_id in collective.descriptors for p in members):
                continue
            descriptors = {p.peer_id: collective.descriptors[p.peer_id] for p in members}
            if len({_descriptor_key(d) for d in descriptors.values()}) > 1:
                views = "; ".join(
                    f"peer {peer_id}: {d.describe()}" for peer_id, d in sorted(descriptors.items())
                )
                self._end(
                    collective,
                    Outcome.REJECTED,
                    f"peers disagree on the all-reduce with tag {collective.tag} ({views}); "
                    "every peer must pass the same count, dtype, op, quantization and "
                    "distribution hint, and configure the same Config.slice_bytes",
                )
                continue
            if collective.group in self._book.stale_groups:
                self._end(
                    collective,
                    Outcome.ABORTED,
                    "the peer group's ring changed (a peer left or a round failed) and must "
                    "be re-established first",
                )
                continue
            self._commence(collective, members)

    def waiting(self) -> Iterator[Waiting]:
        """The collectives not commenced that some member has not voted for."""
        sizes: dict[int, int] = {}
        for peer in self._table.accepted():
            sizes[peer.peer_group] = sizes.get(peer.peer_group, 0) + 1
        for collective in self._running.values():
            if not collective.seq and len(collective.descriptors) < sizes.get(collective.group, 0):
                yield Waiting(
                    key=("all_reduce", collective.group, collective.tag),
                    call=f"{Call.ALL_REDUCE.value}(tag={collective.tag})",
                    where=f"peer group {collective.group}",
                    since=collective.since,
                    missing=functools.partial(self._missing, collective),
                    fail=functools.partial(self._end, collective, Outcome.REJECTED),
                )

    def running(self) -> list[CollectiveStatus]:
        """The attempts commenced and not ended, with who has not completed them."""
        return [
            CollectiveStatus(
                group=c.group, tag=c.tag, seq=c.seq,
                seconds=max(0.0, self._table.now - c.commenced),
                incomplete=tuple(sorted(c.participants - c.completed)),
            )
            for c in self._running.values() if c.seq
        ]

    def _missing(self, collective: _Collective) -> list[Peer]:
        """The members of the collective's group that have not voted for it."""
        return [
            p for p in self._table.accepted()
            if p.peer_group == collective.group and p.peer_id not in collective.descriptors
        ]

    def peer_left(self, peer: Peer, reason: str) -> None:
        """Forget ``peer``'s votes; abort the attempts it took part in."""
        for collective in list(self._running.values()):
            if collective.group != peer.peer_group:
                continue
            collective.descriptors.pop(peer.peer_id, None)
            if peer.peer_id in collective.participants:
                collective.participants.discard(peer.peer_id)
                collective.completed.discard(peer.peer_id)
                self._abort(collective, f"peer {peer.peer_id} left the run ({reason})")
            if not collective.seq and not collective.descriptors:
                del self._running[(collective.group, collective.tag)]

    def _abort(self, collective: _Collective, reason: str) -> None:
        """Stop a running collective everywhere; its verdict will be ABORTED."""
        if collective.aborted:
            return
        collective.aborted = True
        collective.reason = reason = bounded(reason)
        self._table.report(
            RunKind.ABORTED,
            f"collective tag {collective.tag} attempt {collective.seq} of peer group "
            f"{collective.group} aborted: {reason}",
            group=collective.group, tag=collective.tag, seq=collective.seq, reason=reason,
        )
        for peer_id in sorted(collective.participants - collective.completed):
            self._table.send(
                self._table.peers[peer_id],
                CollectiveAbort(tag=collective.tag, seq=collective.seq, reason=reason),
            )

    def _end(self, collective: _Collective, outcome: Outcome, reason: str) -> None:
        """Send every voter its one verdict and forget the collective."""
        reason = bounded(reason)  # it may list every peer, or quote what one sent
        del self._running[(collective.group, collective.tag)]
        voters = collective.participants if collective.seq else set(collective.descriptors)
        self._table.report(
            RunKind.COMPLETED,
            f"collective tag {collective.tag} attempt {collective.seq} of peer group "
            f"{collective.group}: {outcome.name}{f' ({reason})' if reason else ''}",
            level=logging.DEBUG, group=collective.group, tag=collective.tag,
            seq=collective.seq, outcome=outcome.name.lower(), peers=len(voters),
            seconds=self._table.now - collective.since, reason=reason,
        )
        for peer_id in sorted(voters):
            peer = self._table.peers.get(peer_id)
            if peer is None:
                continue
            peer.tags_in_flight.discard(collective.tag)
            self._table.send(
                peer,
                CollectiveVerdict(
                    tag=collective.tag, seq=collective.seq, outcome=outcome, reason=reason
                ),
            )

    def _commence(self, collective: _Collective, members: Sequence[Peer]) -> None:
        """Start attempt ``seq`` of the collective on the group's installed ring."""
        collective.seq = self._next_seq
        collective.commenced = self._table.now
        self._next_seq += 1
        collective.participants = {p.peer_id for p in members}
        ring = tuple(self._book.rings.get(collective.group, ()))
        for peer in members:
            self._table.send(peer, CollectiveCommence(tag=collective.tag, seq=collective.seq, ring=ring))
