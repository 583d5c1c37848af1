"""Leases at a peer: the tags its group all-reduces without the master, and what this
peer tells the master when one ends.

Theory of operation
-------------------
A successful all-reduce may come with a lease on its tag (``_core/leases.py`` says
why and how the master grants and ends them): the numbers ``first`` to ``last`` for
the tag's next attempts, on the ring it ran on, with the descriptor it had. While the
lease *stands*, an all-reduce of that tag with that descriptor on that ring takes the
next number (``take``, then ``start``) and runs at once: nothing goes to the master
and nothing comes back; its members agree on success among themselves
(``_agreement``). Each peer takes numbers in the order of its own calls, which is the
same on every member, since every member passes the same calls.

A lease stops standing here (``_close``: no more numbers are taken from it) when the
master ends it (``LeaseEnd``), when this peer cannot or should not go on with it (its
attempt failed, or has run for a liveness timeout, or its notices cannot be sent, a
call of the tag with another descriptor, the numbers ran out), or when a master takes
this peer back after it lost one (the new master knows no lease). The master's mere
absence ends nothing: attempts under a lease need it only when they fail. Once a lease
stops standing, the master must hear where this peer stands: ``LeaseReport`` says the
last number it started and where that attempt is (running, complete, failed, or none
started). If it was still running, a ``CollectiveComplete`` follows when its part ends,
and from then on the attempt waits for the master's verdict: once a member told the
master that its part runs, the master decides, and may stop it. Whatever this peer must
tell the master waits in one queue, sent in order by one task (``_flush``), each
message made when it is sent, from the state at that moment.

The master's verdicts about leased attempts come back through ``_on_verdict``: to the
attempt they are about, if it waits here; and about an attempt this peer never
started, they close its number here, so the data path drops its frames. A lease is
forgotten when its ring is installed anew, or a new lease on the tag replaces it. The
master ends a lease whose ring was installed anew too, and only the members' reports
tell it how many attempts ran under it: so a lease forgotten with attempts started
under it is kept aside (``_forgotten``) until the master heard how far this peer got,
to answer its ``LeaseEnd`` and take its verdict. A master that takes the run over
knows no lease: every lease with an attempt in flight here is reported to it again;
the others answer when asked.

A peer leaving the run on purpose (``leave``, from ``Communicator.aclose``) first
reports every lease it started attempts under, so that the master counts them even
when every member leaves before it could ask.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math

import trio

from .._core.messages import (
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    LeaseEnd,
    LeaseReport,
    LeaseState,
    Message,
    bounded,
)
from .._errors import PCCLError
from ._attempt import RingAttempt
from ._context import PeerContext
from ._membership import Membership
from ._receiver import DataReceiver
from ._session import MasterLost

__all__ = ["Lease", "Leases"]

log = logging.getLogger("pccl_trio.peer")


class _Told(enum.Enum):
    """What the master knows of the last attempt started under a lease."""

    NOTHING = enum.auto()
    RUNNING = enum.auto()  # that its part runs: a CollectiveComplete is due when it ends
    FINAL = enum.auto()  # how its part ended


@dataclasses.dataclass(eq=False, kw_only=True)
class Lease:
    """A lease on one tag, as this peer holds it."""

    tag: int
    first: int
    last: int
    vote: CollectiveInitiate  # the descriptor every attempt under it has
    ring: tuple[int, ...]
    next: int  # the number the next attempt takes
    standing: bool = True  # numbers may still be taken from it
    told: _Told = _Told.NOTHING
    # The last attempt started under it while it runs here, and how it ended once it
    # did (COMPLETE or FAILED).
    attempt: RingAttempt | None = None
    ended: LeaseState = LeaseState.NONE
    report_at: float = math.inf  # when its running attempt is reported as running long


class Leases:
    """This peer's leases (see the module docstring)."""

    def __init__(
        self, context: PeerContext, *, receiver: DataReceiver, membership: Membership
    ) -> None:
        self._config = context.config
        self._life = context.lifecycle
        self._session = context.session
        self._receiver = receiver
        self._membership = membership
        self._by_tag: dict[int, Lease] = {}
        # Leases forgotten with attempts started under them, until the master's verdict
        # after hearing how far this peer got (by tag).
        self._forgotten: dict[int, Lease] = {}
        self._reports = _Reports(context)
        self._watching = False
        self._watch_lot = trio.lowlevel.ParkingLot()
        self._session.route(LeaseEnd, self._on_end)
        self._session.route(CollectiveVerdict, self._on_verdict)
        self._session.on_back(self._on_back)
        membership.follow(self._on_ring)

    # --- the attempts ------------------------------------------------------------------

    def grant(self, vote: CollectiveInitiate, verdict: CollectiveVerdict, ring: tuple[int, ...]) -> None:
        """The master leased the tag of a successful all-reduce (``vote``: its
        descriptor, ``ring``: the ring it ran on)."""
        self._forget(verdict.tag)
        lease = Lease(
            tag=verdict.tag, first=verdict.lease, last=verdict.lease_last,
            vote=dataclasses.replace(vote, lease=True), ring=ring, next=verdict.lease,
        )
        self._by_tag[verdict.tag] = lease
        self._receiver.lease_granted(lease.first, lease.last)

    def standing(self, tag: int) -> bool:
        """Whether a lease on ``tag`` stands here."""
        lease = self._by_tag.get(tag)
        return lease is not None and lease.standing

    def take(self, vote: CollectiveInitiate, ring: tuple[int, ...]) -> Lease | None:
        """The lease an all-reduce of ``vote``'s descriptor on ``ring`` may run under
        now (None: ask the master)."""
        lease = self._by_tag.get(vote.tag)
        if lease is None or not lease.standing:
            return None
        if self._membership.stale or ring != lease.ring:
            return None
        asked = vote if vote.lease else dataclasses.replace(vote, lease=True)
        if asked != lease.vote or lease.next > lease.last:
            # Another descriptor, or no number left: this call asks the master, which
            # ends the lease for everyone.
            self._close(lease)
            return None
        return lease

    def start(self, lease: Lease, attempt: RingAttempt) -> None:
        """``attempt`` runs under ``lease``, with its next number."""
        seq = lease.next
        lease.next += 1
        attempt.under_lease(seq)
        lease.attempt, lease.ended = attempt, LeaseState.NONE
        self._receiver.start_leased(attempt, lease.first, seq)
        lease.report_at = trio.current_time() + self._session.liveness_timeout
        if not self._watching:
            self._watching = True
            self._life.spawn(self._watch)
        self._watch_lot.unpark_all()

    def told_running(self, attempt: RingAttempt) -> bool:
        """Whether the master was told that ``attempt``'s part runs: then only its
        verdict ends it."""
        lease = self._lease_of(attempt)
        return lease is not None and lease.told is _Told.RUNNING

    def part_ended(self, attempt: RingAttempt) -> None:
        """``attempt``'s part ended (complete or not): the master hears it if it must."""
        lease = self._lease_of(attempt)
        if lease is None:
            return
        if lease.told is _Told.RUNNING:
            self._reports.tell(lease)
        elif not attempt.complete and lease.told is _Told.NOTHING:
            self._close(lease)
            self._reports.tell(lease)

    def unsure(self, attempt: RingAttempt, why: str) -> None:
        """``attempt``'s part is complete, but it cannot learn (or tell) whether every
        member's is: the master must settle it."""
        lease = self._lease_of(attempt)
        if lease is not None and lease.told is _Told.NOTHING:
            log.info("peer %s: tag %d attempt %d: %s; asking the master",
                     self._session.peer_id, attempt.tag, attempt.seq, why)
            self._close(lease)
            self._reports.tell(lease)

    def ended(self, attempt: RingAttempt) -> None:
        """``attempt`` is over here (its caller has its outcome)."""
        lease = self._lease_of(attempt)
        if lease is not None:
            lease.attempt = None
            lease.ended = LeaseState.COMPLETE if attempt.complete else LeaseState.FAILED
            lease.report_at = math.inf

    def _lease_of(self, attempt: RingAttempt) -> Lease | None:
        lease = self._by_tag.get(attempt.tag)
        return lease if lease is not None and lease.attempt is attempt else None

    # --- what the master says ----------------------------------------------------------

    def _held(self, tag: int, first: int) -> Lease | None:
        """The lease on ``tag`` numbered from ``first`` this peer holds, or forgot with
        attempts the master has not heard of."""
        for lease in (self._by_tag.get(tag), self._forgotten.get(tag)):
            if lease is not None and lease.first == first:
                return lease
        return None

    def _on_end(self, message: LeaseEnd) -> None:
        """The master ends a lease: report where this peer stands (once)."""
        lease = self._held(message.tag, message.lease)
        if lease is None:
            # Not one this peer holds: it started nothing under it.
            self._reports.tell(_report_of(None, message.tag, message.lease))
            return
        log.info("peer %s: the lease on tag %d ends: %s", self._session.peer_id, message.tag,
                 message.reason)
        self._close(lease)
        if lease.told is _Told.NOTHING:
            self._reports.tell(lease)

    def _on_verdict(self, verdict: CollectiveVerdict) -> bool:
        """A verdict about an attempt under a lease goes to that attempt; one about an
        attempt this peer never started closes its number. True: it is taken."""
        forgotten = self._forgotten.get(verdict.tag)
        if forgotten is not None and forgotten.first <= verdict.seq <= forgotten.last:
            # About its last attempt, which this peer returned from before the ring
            # changed: the master heard how far it got.
            del self._forgotten[verdict.tag]
            return True
        lease = self._by_tag.get(verdict.tag)
        if lease is None or not lease.first <= verdict.seq <= lease.last:
            return False
        attempt = lease.attempt
        if attempt is not None and attempt.seq == verdict.seq and attempt.agreement is not None:
            attempt.agreement.deliver(verdict)
            return True
        if self._receiver.running(verdict.seq):
            return False  # commenced here by the master after all: its caller waits
        if verdict.seq == lease.next and not lease.standing:
            # It never started here, and never will: its frames are stale now.
            self._receiver.lease_closed(lease.first, settled=True)
        return True

    def _on_ring(self, ring: tuple[int, ...]) -> None:
        """A round installed a ring: every lease ends (the master forgets them too)."""
        for tag in list(self._by_tag):
            self._forget(tag)

    def _on_back(self) -> None:
        """A master took this peer back: it knows no lease. Those with an attempt in
        flight are reported to it; the others answer when it asks."""
        self._reports.clear()  # all of it was for the master that was lost
        self._forgotten.clear()  # the new master never asks about them
        for lease in self._by_tag.values():
            self._close(lease)
            lease.told = _Told.NOTHING
            if lease.attempt is not None:
                self._reports.tell(lease)

    # --- telling the master ------------------------------------------------------------

    def _close(self, lease: Lease) -> None:
        if lease.standing:
            lease.standing = False
            self._receiver.lease_closed(lease.first)

    def _forget(self, tag: int) -> None:
        lease = self._by_tag.pop(tag, None)
        if lease is None:
            return
        lease.standing = False
        self._receiver.lease_forgotten(lease.first)
        if lease.next > lease.first and lease.told is not _Told.FINAL:
            self._forgotten[tag] = lease  # the master asks how far this peer got

    async def leave(self) -> None:
        """This peer leaves the run: report every lease it started attempts under that
        the master has not heard of, and return once they went out (or could not)."""
        if self._session.away or not self._session.member:
            return
        for lease in [*self._by_tag.values(), *self._forgotten.values()]:
            if lease.next > lease.first and lease.told is _Told.NOTHING:
                self._close(lease)
                self._reports.tell(lease)
        # Shielded and bounded: a healthy link takes it at once, and a closing peer
        # must not wait long for a master that does not read.
        with trio.CancelScope(shield=True), trio.move_on_after(self._config.connect_timeout):
            await self._reports.sent()

    # --- attempts that run long ---------------------------------------------------------

    async def _watch(self) -> None:
        """Report to the master every attempt still running a liveness timeout after it
        started: a member may be computing, or in another call, or gone; the master
        then knows who waits for whom (and tells it after its stall timeout)."""
        while True:
            now = trio.current_time()
            soonest = math.inf
            for lease in self._by_tag.values():
                if lease.attempt is None or not lease.standing:
                    continue
                if lease.report_at <= now:
                    log.info(
                        "peer %s: tag %d attempt %d still runs after %gs; telling the master",
                        self._session.peer_id, lease.tag, lease.next - 1,
                        self._session.liveness_timeout,
                    )
                    self._close(lease)
                    self._reports.tell(lease)
                else:
                    soonest = min(soonest, lease.report_at)
            if math.isinf(soonest):
                await self._watch_lot.park()
            else:
                await trio.sleep_until(soonest)


class _Reports:
    """What this peer must tell the master about its leases, in one queue sent in order
    by one task (``_flush``), each message made when it is sent, from the state at that
    moment (see the module docstring)."""

    def __init__(self, context: PeerContext) -> None:
        self._life = context.lifecycle
        self._session = context.session
        self._due: list[Lease | Message] = []  # for the master, in order
        self._flushing = False
        self._flushed = trio.lowlevel.ParkingLot()  # woken when ``_due`` is empty

    def tell(self, item: Lease | Message) -> None:
        """The master must hear ``item``: a message, or about a lease (what, is decided
        when it is sent)."""
        self._due.append(item)
        if not self._flushing:
            self._flushing = True
            self._life.spawn(self._flush)

    def clear(self) -> None:
        """Drop what is queued (for a master that was lost)."""
        self._due.clear()

    async def sent(self) -> None:
        """Return once everything queued went out (or could not)."""
        while self._flushing:
            await self._flushed.park()

    async def _flush(self) -> None:
        try:
            while self._due:
                item = self._due.pop(0)
                message = _message(item) if isinstance(item, Lease) else item
                if message is None:
                    continue
                try:
                    await self._session.send(message)
                except MasterLost:
                    continue  # the master that comes back hears it again (``_on_back``)
        except PCCLError:
            return  # the run is over for this peer
        finally:
            self._flushing = False
            self._flushed.unpark_all()


def _message(lease: Lease) -> Message | None:
    """What the master must hear about ``lease`` now (None: nothing new)."""
    if lease.told is _Told.NOTHING:
        report = _report_of(lease, lease.tag, lease.first)
        lease.told = _Told.RUNNING if report.state == LeaseState.RUNNING else _Told.FINAL
        agreement = lease.attempt.agreement if lease.attempt is not None else None
        if lease.told is _Told.RUNNING and agreement is not None:
            # Its CollectiveComplete is due when the part ends, agreed or not.
            agreement.wake_on_completion()
        return report
    if lease.told is _Told.RUNNING:
        state = _state(lease)
        if state != LeaseState.RUNNING:
            lease.told = _Told.FINAL
            attempt = lease.attempt
            return CollectiveComplete(
                tag=lease.tag, seq=lease.next - 1, aborted=state == LeaseState.FAILED,
                invalid=bounded(attempt.invalid or "") if attempt is not None else "",
            )
    return None


def _state(lease: Lease) -> LeaseState:
    """Where the last attempt started under ``lease`` is (NONE: none was)."""
    if lease.next == lease.first:
        return LeaseState.NONE
    attempt = lease.attempt
    if attempt is None:
        return lease.ended
    if attempt.complete:
        return LeaseState.COMPLETE
    if attempt.failure is not None or not attempt.live:
        return LeaseState.FAILED
    return LeaseState.RUNNING


def _report_of(lease: Lease | None, tag: int, first: int) -> LeaseReport:
    """This peer's ``LeaseReport`` on the lease on ``tag`` numbered from ``first``
    (``lease`` None: one it does not hold, so it started nothing under it)."""
    vote = lease.vote if lease is not None else None
    state = LeaseState.NONE if lease is None else _state(lease)
    attempt = lease.attempt if lease is not None else None
    invalid = attempt.invalid if attempt is not None and state == LeaseState.FAILED else None
    return LeaseReport(
        tag=tag, lease=first,
        seq=0 if state == LeaseState.NONE or lease is None else lease.next - 1,
        state=state,
        count=vote.count if vote else 0, dtype=vote.dtype if vote else 0,
        op=vote.op if vote else 0,
        quantized_dtype=vote.quantized_dtype if vote else 0,
        quantization=vote.quantization if vote else 0,
        distribution_hint=vote.distribution_hint if vote else 0,
        slice_bytes=vote.slice_bytes if vote else 0,
        invalid=bounded(invalid or ""),
        kind=vote.kind if vote else 0,
        root=vote.root if vote else 0,
        topk=vote.topk if vote else 0,
        topk_chunk=vote.topk_chunk if vote else 0,
        topk_bits=vote.topk_bits if vote else 0,
    )
