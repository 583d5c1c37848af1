"""Leases: a peer group's repeated all-reduces of one tag, run without the master.

Theory of operation
-------------------
A training loop all-reduces the same tags with the same descriptors over and over, and
two round trips to the master per all-reduce are most of what a small one costs. So a
successful all-reduce whose every member asked for it (``CollectiveInitiate.lease``)
*grants the group a lease* on its tag, in the verdict (``CollectiveVerdict.lease``): a
block of attempt numbers, ``first`` to ``last``. Each member then numbers its next
all-reduces of that tag itself, in order, as long as it passes the same descriptor on
the same ring, and runs them at once: no vote, no commence, no report, no verdict. The
members agree on the outcome among themselves (``peer/_agreement.py``): a member
returns success only once it knows every member holds the whole result.

The master hears of a lease again only when something is wrong, and then *ends* it:

- a member reports its lease on its own (``LeaseReport``): an attempt under it failed,
  or has run a long time (a member may be computing, in another call, or gone);
- a member votes for the tag through the master (another descriptor, or it could not
  use the lease);
- a member leaves the group (the ring is stale).

Ending a lease sends ``LeaseEnd`` to every member; each stops taking attempts from it
and answers with a report: the last attempt it started under the lease (``seq``, 0
for none) and where that attempt stands (running, complete, failed). Once every member
still in the run answered, the lease is *resolved* (``resolved``), with the rules
every member's agreement relies on:

- A member starts attempt ``S`` only after it knew that every member completed
  ``S - 1``. So the members' last attempts are at most one apart, and when some member
  started ``S``, attempt ``S - 1`` succeeded everywhere: the members still waiting in
  it (*stragglers*) are told so.
- Attempt ``S`` (the latest any member started) is handed to the collectives as an
  attempt already numbered and partly running (``Collectives.adopt``): the members that
  started it take part; the others are waited for like votes, and join it when they
  call the tag (a commence of ``S``), unless it must end first. It succeeds only if
  every member completed it, which is exactly when a member may have returned success
  on its own.

A master that took a run over knows no lease: the first report of one makes it end it
the same way, once the group's members are back (until then, nobody knows who they
are: ``announce``). A lease also ends when its group's ring is installed anew or goes
stale (``expire``): its members stop using it then on their own, but only their
reports say how many attempts ran under it, so it is ended like any other.

Every lease that ends is counted once it is resolved: the attempts before the latest
any member reported (those gone included) succeeded everywhere, and the latest one
too if every member completed it; an attempt the master settles itself (``adopt``) is
counted with its verdict instead. A member leaving the run on purpose reports its
leases first, so a run that ends by its peers leaving is counted in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from .messages import MAX_LEASE_SPAN, LeaseEnd, LeaseReport, LeaseState, bounded
from .peers import Peer, PeerPhase, PeerTable
from .report import KickCause
from .rounds import RingBook

__all__ = ["MAX_LEARNED", "Lease", "Leases", "Resolution"]

#: Most leases a master learns of from reports at once (granted by a master before it).
#: A member reports only the leases it has an attempt in flight under; a peer reporting
#: past this many is kicked, so reports cannot grow the master without bound.
MAX_LEARNED = 1 << 16


@dataclasses.dataclass(kw_only=True, slots=True)
class Lease:
    """One lease of a group on a tag, granted or learned of from a report."""

    group: int
    tag: int
    first: int
    last: int
    members: frozenset[int]  # the peers of the ring it was granted on
    epoch: int  # the group's ring installs when granted (-1: learned of from a report)
    ending: str = ""  # why it ends ("" while it stands)
    # Its members were told it ends (a lease learned of from a report: not before its
    # members are back and known, ``announce``).
    announced: bool = False
    reports: dict[int, LeaseReport] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Resolution:
    """A lease every member still in the run reported on (see the module docstring)."""

    lease: Lease
    members: frozenset[int]  # the lease's members still in the run
    latest: int  # the latest attempt a member started (0: none)
    starters: dict[int, LeaseReport]  # the members that started ``latest``
    stragglers: tuple[int, ...]  # members whose last attempt is ``latest - 1``, under the lease
    # The latest attempt any member reported starting, members gone included (0: none):
    # every attempt before it succeeded everywhere.
    reported: int


class Leases:
    """The leases of every group (see the module docstring).

    Args:
        span: how many attempt numbers a lease holds.
    """

    def __init__(self, table: PeerTable, book: RingBook, *, span: int) -> None:
        if not 0 < span <= MAX_LEASE_SPAN:
            raise ValueError(f"a lease holds 1 to {MAX_LEASE_SPAN} attempts")
        self.span = span
        self._table = table
        self._book = book
        self._leases: dict[tuple[int, int], Lease] = {}
        # (group, tag) -> the first number of the latest lease resolved: reports on it
        # or an older one come late, and are dropped.
        self._decided: dict[tuple[int, int], int] = {}
        self._learned = 0  # leases learned of from reports (epoch -1) not resolved yet

    def grant(self, group: int, tag: int, members: frozenset[int], first: int) -> Lease:
        """A lease on ``tag`` for ``members``, numbered from ``first``."""
        lease = Lease(
            group=group, tag=tag, first=first, last=first + self.span - 1, members=members,
            epoch=self._book.epochs.get(group, 0),
        )
        self._leases[(group, tag)] = lease
        return lease

    def standing(self, group: int, tag: int) -> Lease | None:
        """The group's lease on ``tag``, if one is granted and not ending."""
        lease = self._leases.get((group, tag))
        return lease if lease is not None and not lease.ending else None

    def ending(self, group: int, tag: int) -> bool:
        """Whether the group's lease on ``tag`` ends and waits for reports."""
        lease = self._leases.get((group, tag))
        return lease is not None and bool(lease.ending)

    def end(self, lease: Lease, reason: str) -> None:
        """Tell every member still in the run to stop using ``lease`` and report."""
        if lease.ending:
            return
        lease.ending = bounded(reason)
        if lease.epoch >= 0:
            self._announce(lease)

    def announce(self) -> None:
        """Tell the members of the leases learned of from reports that they end, once
        no group is coming back (the members are known then): those the run has now."""
        for lease in self._leases.values():
            if lease.ending and not lease.announced:
                lease.members = frozenset(
                    p.peer_id for p in self._table.accepted() if p.peer_group == lease.group
                )
                self._announce(lease)

    def _announce(self, lease: Lease) -> None:
        lease.announced = True
        for peer_id in sorted(lease.members):
            peer = self._table.peers.get(peer_id)
            if peer is not None:
                self._table.send(
                    peer, LeaseEnd(tag=lease.tag, lease=lease.first, reason=lease.ending)
                )

    def on_report(self, peer: Peer, message: LeaseReport) -> None:
        """A member says where it stands with a lease; this ends the lease, if it stood."""
        if peer.phase is not PeerPhase.ACCEPTED:
            return  # a report from before a round admitted it: nothing it holds
        key = (peer.peer_group, message.tag)
        if message.lease <= self._decided.get(key, 0):
            return  # about a lease resolved already
        lease = self._leases.get(key)
        if lease is None:
            # Granted by a master before this one: it ends, with the members this master
            # knows once its group is back (``announce``).
            if self._learned >= MAX_LEARNED:
                self._table.kick_peer(
                    peer, f"reported more than {MAX_LEARNED} leases this master never granted",
                    KickCause.PROTOCOL,
                )
                return
            lease = Lease(
                group=peer.peer_group, tag=message.tag, first=message.lease,
                last=message.lease + MAX_LEASE_SPAN - 1, members=frozenset(), epoch=-1,
            )
            self._leases[key] = lease
            self._learned += 1
        if message.lease != lease.first or lease.announced and peer.peer_id not in lease.members:
            return  # another lease, or a peer outside it: nothing to learn here
        if message.seq and message.seq > lease.last:
            self._table.kick_peer(
                peer, f"reported attempt {message.seq}, beyond its lease (to {lease.last})",
                KickCause.PROTOCOL,
            )
            return
        self.end(lease, f"peer {peer.peer_id} reported its lease on tag {message.tag}")
        lease.reports.setdefault(peer.peer_id, message)

    def completed(self, peer: Peer, tag: int, seq: int, state: LeaseState) -> bool:
        """A member's running attempt under an ending lease finished before the lease
        was resolved (its ``CollectiveComplete``); False if no report waits for it."""
        lease = self._leases.get((peer.peer_group, tag))
        if lease is None or not lease.ending:
            return False
        report = lease.reports.get(peer.peer_id)
        if report is None or report.seq != seq or report.state != LeaseState.RUNNING:
            return False
        lease.reports[peer.peer_id] = dataclasses.replace(report, state=state)
        return True

    def peer_left(self, peer: Peer) -> None:
        """End the leases of ``peer``'s group: their ring lost a member."""
        for lease in list(self._leases.values()):
            if lease.group == peer.peer_group and peer.peer_id in lease.members:
                self.end(lease, f"peer {peer.peer_id} left the run")

    def expire(self) -> None:
        """End the standing leases whose group's ring was installed again or went
        stale: every member stops using them then, and reports how far it got."""
        for lease in list(self._leases.values()):
            if lease.ending:
                continue
            if self._book.epochs.get(lease.group, 0) != lease.epoch:
                self.end(lease, "its ring was installed anew")
            elif lease.group in self._book.stale_groups:
                self.end(lease, "its ring went stale")

    def resolved(self) -> Iterator[Resolution]:
        """The ending leases every member still in the run reported on, each forgotten
        as it is yielded. A member whose report contradicts the others' is kicked (the
        lease waits for the rest then)."""
        liars: list[tuple[int, str]] = []
        live: set[int] | None = None
        for key, lease in list(self._leases.items()):
            if not lease.announced:
                continue
            if live is None:
                live = {p.peer_id for p in self._table.accepted()}
            members = lease.members & live
            if not members <= lease.reports.keys():
                continue
            reports = {p: lease.reports[p] for p in members}
            latest = max((r.seq for r in reports.values()), default=0)
            starters = {p: r for p, r in reports.items() if latest and r.seq == latest}
            stragglers = []
            contradicted = len(liars)
            for peer_id, report in reports.items():
                if peer_id in starters:
                    continue
                expected = latest - 1 if latest > lease.first else 0
                if report.seq != expected:
                    liars.append((peer_id, (
                        f"reported attempt {report.seq} of its lease on tag {lease.tag} "
                        f"while another member started {latest}"
                    )))
                elif expected and report.state != LeaseState.COMPLETE:
                    liars.append((peer_id, (
                        f"reported attempt {report.seq} of its lease on tag {lease.tag} "
                        f"{LeaseState(report.state).name.lower()}, after another member "
                        f"started {latest}"
                    )))
                elif expected:
                    stragglers.append(peer_id)
            if len(liars) > contradicted:
                continue
            del self._leases[key]
            if lease.epoch < 0:
                self._learned -= 1
            self._decided[key] = max(self._decided.get(key, 0), lease.first)
            yield Resolution(
                lease=lease, members=frozenset(members), latest=latest, starters=starters,
                stragglers=tuple(sorted(stragglers)),
                reported=max((r.seq for r in lease.reports.values()), default=0),
            )
        for peer_id, reason in liars:
            peer = self._table.peers.get(peer_id)
            if peer is not None:
                self._table.kick_peer(peer, reason, KickCause.PROTOCOL)
