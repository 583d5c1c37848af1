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
peer's data could not be reduced). A success whose every voter asked for it grants the
group a lease on the tag (``leases``): its next attempts run without the master.

A collective that cannot commence ends at once, with a verdict of seq 0, rather than
wait: BLOCKED when a member waits in a shared-state sync (the ring is intact; the
voters sync next), ABORTED when a member waits in a topology vote that blocks
all-reduces (``peers.BLOCKED_BY``) or when the group's ring is stale (it must be
re-established first), REJECTED when the descriptors disagree. A collective some member never
votes for ends REJECTED after the master's stall timeout (``stalls``: ``waiting``
lists the collectives waiting for members). Every voter gets exactly one verdict per
initiate.

*Adopted* collectives come from a resolved lease (``adopt``): the latest attempt some
members started under it, numbered already and possibly running. Its starters are its
participants; the members that did not start it are waited for like votes, and join it
when they vote for the tag (a commence of that number), unless the same rules end it
first. Ending one that has participants running aborts them first, and the verdict
follows once they completed, as for any running attempt; members that neither voted nor
ran it are told its outcome too (their data path drops its frames then).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence

from .errors import RemoteProtocolError
from .leases import Leases, Resolution
from .messages import (
    COLLECTIVE_NAMES,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveKind,
    CollectiveVerdict,
    LeaseReport,
    LeaseState,
    Outcome,
    bounded,
)
from .peers import FREE_STATES, VOTES, Call, Peer, PeerPhase, PeerState, PeerTable, find_blocker
from .report import RunKind
from .rounds import RingBook
from .stalls import Waiting, call_name
from .status import CollectiveStatus

__all__ = ["Collectives"]


@dataclasses.dataclass(kw_only=True, slots=True)
class _Collective:
    """One all-reduce of a peer group, from the first initiate vote to the verdicts."""

    group: int
    tag: int
    descriptors: dict[int, CollectiveInitiate]  # peer id -> its initiate vote
    since: float  # when the first member voted
    seq: int = 0  # 0 until commenced (or adopted)
    commenced: float = 0.0  # when it was numbered
    participants: set[int] = dataclasses.field(default_factory=set)
    completed: set[int] = dataclasses.field(default_factory=set)
    aborted: bool = False
    reason: str = ""
    # Participants whose part failed (an adopted attempt succeeds unless one did).
    failed: set[int] = dataclasses.field(default_factory=set)
    # A peer's data could not be reduced: the verdict is REJECTED, not ABORTED.
    rejected: bool = False
    # Every member takes part (commenced, or adopted with every member a starter).
    full: bool = False
    # Decided before it could run everywhere: the verdict, once the participants running
    # it completed (they were aborted).
    outcome: Outcome | None = None
    # Adopted from a lease: the members that started it under the lease, and those
    # that neither voted for it nor run it yet.
    leased: set[int] = dataclasses.field(default_factory=set)
    informed: set[int] = dataclasses.field(default_factory=set)


def _descriptor_key(message: CollectiveInitiate | LeaseReport) -> tuple[int, ...]:
    """What every member of a collective must agree on: all of the descriptor, but an
    all-gather's count, which is each member's own part."""
    return (
        message.kind, message.root,
        -1 if message.kind == CollectiveKind.ALL_GATHER else message.count,
        message.dtype, message.op,
        message.quantized_dtype, message.quantization, message.distribution_hint,
        message.slice_bytes, message.topk, message.topk_chunk, message.topk_bits,
    )


def _call_name(collective: _Collective) -> str:
    """The call the collective's voters made, as the API names it (``all_reduce``
    before any voted: an adopted attempt)."""
    kinds = {d.kind for d in collective.descriptors.values()}
    kind = min(kinds) if kinds else CollectiveKind.ALL_REDUCE
    return call_name(COLLECTIVE_NAMES[kind])


class Collectives:
    """The collectives of every peer group (see the module docstring).

    Args:
        lease_span: how many attempts a lease numbers (``leases``).
    """

    def __init__(self, table: PeerTable, book: RingBook, *, lease_span: int) -> None:
        self._table = table
        self._book = book
        self.leases = Leases(table, book, span=lease_span)
        self._running: dict[tuple[int, int], _Collective] = {}  # (group, tag) -> it
        # (group, tag) -> the attempt adopted from a lease, until its verdicts. Beside
        # ``_running``: a member that completed it may already vote for the tag again.
        self._adopted: dict[tuple[int, int], _Collective] = {}
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
        lease = self.leases.standing(*key)
        if lease is not None:
            self.leases.end(
                lease,
                f"peer {peer.peer_id} called tag {message.tag} outside the "
                f"group's lease on it ({message.describe()})",
            )
        adopted = self._adopted.get(key)
        if adopted is not None and not adopted.full:
            if peer.peer_id in adopted.participants:
                raise RemoteProtocolError(
                    f"CollectiveInitiate for tag {message.tag} while running its attempt "
                    f"{adopted.seq} under the lease"
                )
            # It did not start the attempt: this vote is its call of it.
            peer.tags_in_flight.add(message.tag)
            adopted.descriptors[peer.peer_id] = message
            adopted.informed.discard(peer.peer_id)
            return
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
        key = (peer.peer_group, tag)
        collective = self._running.get(key)
        adopted = self._adopted.get(key)
        if adopted is not None and adopted.seq == seq:
            collective = adopted
        elif self.leases.completed(
            peer, tag, seq, LeaseState.FAILED if message.aborted else LeaseState.COMPLETE
        ):
            return  # its lease waits for reports: the report it sent now says this
        if collective is None or not collective.seq or peer.peer_id not in collective.participants:
            raise RemoteProtocolError(f"CollectiveComplete for tag {tag}, which is not running")
        if seq != collective.seq:
            raise RemoteProtocolError(
                f"CollectiveComplete for attempt {seq} of tag {tag}; attempt {collective.seq} runs"
            )
        if peer.peer_id in collective.completed:
            raise RemoteProtocolError(f"CollectiveComplete twice for tag {tag}")
        collective.completed.add(peer.peer_id)
        self._failed(collective, peer.peer_id, aborted=message.aborted, invalid=message.invalid)

    def _failed(self, collective: _Collective, peer_id: int, *, aborted: bool, invalid: str) -> None:
        """What a participant's end of its part means for the others."""
        if aborted:
            collective.failed.add(peer_id)
        if invalid and not collective.aborted:
            collective.rejected = True
            self._abort(collective, f"peer {peer_id}: {invalid}")
        elif aborted:
            self._abort(collective, f"peer {peer_id} failed during the collective")

    def advance(self) -> None:
        """Resolve the leases every member reported on; send the verdicts of the
        attempts every participant completed; commence, or end at once, the collectives
        every member voted for or that cannot wait."""
        self.leases.expire()
        self.leases.announce()
        while True:
            peers = len(self._table.peers)
            for resolution in self.leases.resolved():
                self.adopt(resolution)
            if len(self._table.peers) == peers:
                break  # else a contradicting report was kicked: the rest may settle now
        for key, collective in [*self._adopted.items(), *self._running.items()]:
            if collective.seq and (collective.full or collective.outcome is not None):
                if collective.participants <= collective.completed:
                    self._end(collective, self._outcome(collective), collective.reason)
                continue
            if not collective.seq and self.leases.ending(*key):
                continue  # a member may be running this tag under the lease: wait for it
            members = [
                p for p in self._table.accepted() if p.peer_group == collective.group
            ]
            blocker = find_blocker(Call.ALL_REDUCE, collective.group, members)
            if blocker is not None:
                # That peer is blocked in a vote and will never initiate: waiting would
                # deadlock the group. Behind a sync vote the ring stays as it is (the
                # voters re-establish nothing before their sync, which the syncing peer
                # could not join); behind a topology vote, they take part in one.
                self._decide(
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
                self._decide(
                    collective,
                    Outcome.REJECTED,
                    f"peers disagree on the collective with tag {collective.tag} ({views}); "
                    "every peer must make the same call (all_reduce, barrier, reduce_scatter, "
                    "broadcast from the same root, all_gather) of a tag, "
                    "pass the same count (an all_gather's may differ), dtype, op, "
                    "quantization, distribution hint and compression, and "
                    "configure the same Config.slice_bytes",
                )
                continue
            if collective.group in self._book.stale_groups:
                self._decide(
                    collective,
                    Outcome.ABORTED,
                    "the peer group's ring changed (a peer left or a round failed) and must "
                    "be re-established first",
                )
                continue
            if collective.aborted:  # adopted, and a participant failed before all came
                self._decide(
                    collective, Outcome.REJECTED if collective.rejected else Outcome.ABORTED,
                    collective.reason,
                )
                continue
            self._commence(collective, members)

    @staticmethod
    def _outcome(collective: _Collective) -> Outcome:
        """The verdict of an attempt every participant completed. One adopted from a
        lease succeeds if every participant's part did, aborted or not: a member that
        completed it may have returned success on its own, and then every member did
        complete it (``leases``)."""
        if collective.outcome is not None:
            return collective.outcome
        if collective.rejected:
            return Outcome.REJECTED
        failed = collective.failed if collective.leased else collective.aborted
        return Outcome.ABORTED if failed else Outcome.SUCCESS

    def adopt(self, resolution: Resolution) -> None:
        """Carry on from a resolved lease (``leases``): tell the stragglers that the
        attempt before the latest succeeded, and take the latest one over."""
        lease = resolution.lease
        tag, latest = lease.tag, resolution.latest
        starters = resolution.starters
        others = resolution.members - starters.keys()
        done = bool(latest) and not others and all(
            r.state == LeaseState.COMPLETE for r in starters.values()
        )
        # Counted here: the attempts before the latest any member started, and that one
        # if every member completed it; one adopted below is counted with its verdict.
        succeeded = resolution.reported - lease.first if resolution.reported else 0
        succeeded += done and latest == resolution.reported
        self._table.report(
            RunKind.LEASE_ENDED,
            f"peer group {lease.group}'s lease on tag {tag} ended after {succeeded} "
            f"all-reduces ({lease.ending})",
            group=lease.group, tag=tag, attempts=succeeded, reason=lease.ending,
        )
        for peer_id in resolution.stragglers:
            self._table.send(
                self._table.peers[peer_id],
                CollectiveVerdict(tag=tag, seq=latest - 1, outcome=Outcome.SUCCESS),
            )
        if not latest:
            return
        key = (lease.group, tag)
        if done:
            # Every member holds the result: what each may have returned on its own.
            for peer_id in sorted(starters):
                self._table.send(
                    self._table.peers[peer_id],
                    CollectiveVerdict(tag=tag, seq=latest, outcome=Outcome.SUCCESS),
                )
            return
        collective = _Collective(
            group=lease.group, tag=tag, since=self._table.now, seq=latest,
            commenced=self._table.now,
            descriptors={p: r.initiate() for p, r in starters.items()},
            participants=set(starters), full=not others, leased=set(starters),
            informed=set(others),
        )
        if others:
            # Their votes so far are their calls of this attempt (a member that started
            # it cannot have voted: it waits in it).
            votes = self._running.pop(key, None)
            if votes is not None:
                for peer_id, vote in votes.descriptors.items():
                    collective.descriptors[peer_id] = vote
                    collective.informed.discard(peer_id)
        self._adopted[key] = collective
        collective.completed.update(
            p for p, r in starters.items() if r.state != LeaseState.RUNNING
        )
        for peer_id, report in sorted(starters.items()):
            if report.state == LeaseState.FAILED:
                self._failed(collective, peer_id, aborted=True, invalid=report.invalid)
        gone = sorted(lease.members - resolution.members)
        if gone:
            # Whoever waits for their data would wait forever: stop the parts still
            # running (one complete by now says so, and the attempt may still succeed).
            self._abort(collective, f"peer {', '.join(map(str, gone))} left the run")

    def waiting(self) -> Iterator[Waiting]:
        """The collectives not commenced that some member has not voted for."""
        sizes: dict[int, int] = {}
        for peer in self._table.accepted():
            sizes[peer.peer_group] = sizes.get(peer.peer_group, 0) + 1
        for collective in [*self._running.values(), *self._adopted.values()]:
            if collective.full or collective.outcome is not None:
                continue
            if len(collective.descriptors) < sizes.get(collective.group, 0):
                yield Waiting(
                    key=("all_reduce", collective.group, collective.tag, collective.seq),
                    call=f"{_call_name(collective)}(tag={collective.tag})",
                    where=f"peer group {collective.group}",
                    since=collective.since,
                    missing=functools.partial(self._missing, collective),
                    fail=functools.partial(self._decide, collective, Outcome.REJECTED),
                )

    def running(self) -> list[CollectiveStatus]:
        """The attempts commenced and not ended, with who has not completed them."""
        return [
            CollectiveStatus(
                group=c.group, tag=c.tag, seq=c.seq, call=_call_name(c),
                seconds=max(0.0, self._table.now - c.commenced),
                incomplete=tuple(sorted(c.participants - c.completed)),
            )
            for c in [*self._running.values(), *self._adopted.values()] if c.seq
        ]

    def _missing(self, collective: _Collective) -> list[Peer]:
        """The members of the collective's group that have not voted for it."""
        return [
            p for p in self._table.accepted()
            if p.peer_group == collective.group and p.peer_id not in collective.descriptors
        ]

    def peer_left(self, peer: Peer, reason: str) -> None:
        """Forget ``peer``'s votes; abort the attempts it took part in; end its group's
        leases."""
        for table in (self._running, self._adopted):
            for collective in list(table.values()):
                if collective.group != peer.peer_group:
                    continue
                collective.descriptors.pop(peer.peer_id, None)
                collective.informed.discard(peer.peer_id)
                if peer.peer_id in collective.participants:
                    collective.participants.discard(peer.peer_id)
                    collective.completed.discard(peer.peer_id)
                    self._abort(collective, f"peer {peer.peer_id} left the run ({reason})")
                if not collective.seq and not collective.descriptors:
                    del table[(collective.group, collective.tag)]
        self.leases.peer_left(peer)

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

    def _decide(self, collective: _Collective, outcome: Outcome, reason: str) -> None:
        """End a collective that cannot run everywhere with ``outcome``: at once, or,
        if some participants run it (adopted), once they stopped."""
        if collective.participants <= collective.completed:
            self._end(collective, outcome, reason)
            return
        collective.outcome = outcome
        self._abort(collective, reason)
        collective.reason = bounded(reason)

    def _end(self, collective: _Collective, outcome: Outcome, reason: str) -> None:
        """Send every voter its one verdict and forget the collective."""
        reason = bounded(reason)  # it may list every peer, or quote what one sent
        key = (collective.group, collective.tag)
        if self._adopted.get(key) is collective:
            del self._adopted[key]
        else:
            del self._running[key]
        voters = collective.participants if collective.seq else set(collective.descriptors)
        self._table.report(
            RunKind.COMPLETED,
            f"collective tag {collective.tag} attempt {collective.seq} of peer group "
            f"{collective.group}: {outcome.name}{f' ({reason})' if reason else ''}",
            level=logging.DEBUG, group=collective.group, tag=collective.tag,
            seq=collective.seq, outcome=outcome.name.lower(), peers=len(voters),
            seconds=self._table.now - collective.since, reason=reason,
        )
        lease = self._grant(collective) if outcome == Outcome.SUCCESS else None
        # Members of an adopted attempt that voted for it and were never commenced get
        # a verdict of seq 0 (it never ran for them), those that neither voted nor ran it
        # its outcome for their data path.
        waiting = set(collective.descriptors) - collective.participants if collective.seq else set()
        for peer_id in sorted(voters | waiting | collective.informed):
            peer = self._table.peers.get(peer_id)
            if peer is None:
                continue
            if peer_id not in collective.informed and peer_id not in collective.leased:
                peer.tags_in_flight.discard(collective.tag)
            seq = 0 if peer_id in waiting else collective.seq
            self._table.send(
                peer,
                CollectiveVerdict(
                    tag=collective.tag, seq=seq, outcome=outcome, reason=reason,
                    lease=lease[0] if lease else 0, lease_last=lease[1] if lease else 0,
                ),
            )

    def _grant(self, collective: _Collective) -> tuple[int, int] | None:
        """A lease on the tag of a successful collective, if every member asked for it
        and the ring it ran on stands: ``(first, last)``."""
        group = collective.group
        members = {p.peer_id for p in self._table.accepted() if p.peer_group == group}
        if (
            not collective.full or collective.leased
            or collective.participants != members or len(members) < 2
            or group in self._book.stale_groups
            or not all(collective.descriptors[p].lease for p in collective.participants)
        ):
            return None
        first = self._next_seq
        lease = self.leases.grant(group, collective.tag, frozenset(members), first)
        self._next_seq = lease.last + 1
        self._table.report(
            RunKind.LEASED,
            f"peer group {group} leases tag {collective.tag}: attempts {lease.first} to "
            f"{lease.last}", level=logging.DEBUG, group=group, tag=collective.tag,
            first=lease.first, last=lease.last,
        )
        return lease.first, lease.last

    def _commence(self, collective: _Collective, members: Sequence[Peer]) -> None:
        """Start attempt ``seq`` of the collective on the group's installed ring (an
        adopted one: at the members that did not start it under the lease)."""
        ring = tuple(self._book.rings.get(collective.group, ()))
        if not collective.seq:
            collective.seq = self._next_seq
            collective.commenced = self._table.now
            self._next_seq += 1
        joining = [p for p in members if p.peer_id not in collective.participants]
        collective.participants = {p.peer_id for p in members}
        collective.informed.clear()
        collective.full = True
        sizes: tuple[int, ...] = ()
        if any(d.kind == CollectiveKind.ALL_GATHER for d in collective.descriptors.values()):
            # (A ring that is not the group's fails at every member: ``on_commence``.)
            sizes = tuple(
                d.count if (d := collective.descriptors.get(peer_id)) is not None else 0
                for peer_id in ring
            )
        commence = CollectiveCommence(tag=collective.tag, seq=collective.seq, ring=ring, sizes=sizes)
        for peer in joining:
            self._table.send(peer, commence)
