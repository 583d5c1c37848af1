"""Topology optimization: measure the links, search for faster rings, install them.

Theory of operation
-------------------
An optimization is a vote of the whole run (``VoteOptimizeTopology``: VOTE_OPTIMIZE).
A peer that waits in ``update_topology`` blocks it (``peers.BLOCKED_BY``): the voters
are refused, and told to *rejoin* when that peer only re-establishes its ring after an
aborted all-reduce; so are they when some peer has not voted within the master's stall
timeout (``waiting``, see ``stalls``). Once every accepted peer voted and no round
runs, it starts (OPTIMIZING):

1. **Measure.** The links of each group not measured yet, nor known unreachable, are
   split into steps in which no peer takes part twice (``measurement_rounds``); the
   steps of all groups run side by side. In each step every receiver is asked to
   measure one link (``MeasureLink``) and reports it (``LinkMeasured``); a receiver
   silent for ``round_timeout`` seconds is kicked. The sender is told first whom to
   expect and how many bytes to serve (``ExpectBenchmark``): a peer serves benchmark
   bytes to nobody the master did not announce. What is measured is kept per group
   (``BandwidthStore``) until a member leaves.
2. **Solve.** Per group of three or more, a ``Solve`` job searches the ring whose
   slowest hop is fastest, for ``reference_bytes``, starting from the best ring known;
   the shell runs it off the event loop and answers ``SolveFinished``.
3. **Install.** Each group keeps its ring unless the new one is clearly faster
   (``KEEP_MARGIN``: rings within measurement noise are not worth re-connecting for).
   Every participant gets its group's report (``TopologyOptimized``), and a round
   installs the rings; the optimization is then over.

A first ring not proven optimal is followed by a *background search*
(``search_seconds``). A better ring it finds becomes the group's *candidate*, which the
next round installs if the group still has exactly those members and the ring is still
clearly faster (``adopt_candidate``). A change of membership cancels the search and
drops the candidate: they were for the old members.

What is known of the links, and what a ring over them costs, is ``links.Links``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence

import numpy

from .bandwidth import MEASUREMENT_BYTES, measurement_rounds, ring_cost
from .errors import RemoteProtocolError
from .events import CancelSolve, Solve, SolveFinished, TopologyView
from .links import Links
from .messages import (
    ExpectBenchmark,
    LinkMeasured,
    MeasureLink,
    TopologyOptimized,
    VoteOptimizeTopology,
)
from .peers import (
    Call,
    Peer,
    PeerEvent,
    PeerPhase,
    PeerState,
    PeerTable,
    check_member_vote,
    find_blocker,
    groups,
    out_of_order,
)
from .report import KickCause, RunKind
from .rounds import RingBook
from .stalls import Waiting, run_vote

__all__ = ["KEEP_MARGIN", "Optimizer"]


#: A solved ring replaces the installed one only if predicted faster by this fraction:
#: rings within measurement noise of each other are not worth re-connecting for.
KEEP_MARGIN = 0.05


@dataclasses.dataclass(kw_only=True, slots=True)
class _Optimization:
    """A topology optimization, from the vote to the round that installs its rings."""

    number: int
    participants: set[int]
    steps: list[list[tuple[int, int]]]  # links (sender, receiver) measured together
    step: int = -1  # the step being measured (-1: none yet)
    solving: bool = False  # every step is measured; the solver jobs were started
    outstanding: dict[int, int] = dataclasses.field(default_factory=dict)  # receiver -> sender
    step_started: float = 0.0
    jobs: dict[int, _Job] = dataclasses.field(default_factory=dict)  # solver jobs running
    # Group -> its ring in peer ids (empty: none found) and whether it is proven optimal.
    solved: dict[int, tuple[tuple[int, ...], bool]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Job:
    """A solver job: the group and members it was asked for, over which costs."""

    number: int
    group: int
    peers: tuple[int, ...]
    cost: numpy.ndarray
    background: bool


@dataclasses.dataclass(kw_only=True, slots=True)
class _Candidate:
    """A better ring found in the background, for the group's next round."""

    members: frozenset[int]
    ring: tuple[int, ...]
    cost: numpy.ndarray
    peers: tuple[int, ...]


def _clearly_faster(new: float, old: float) -> bool:
    """Whether a ring whose slowest hop costs ``new`` is worth replacing one at ``old``
    (``KEEP_MARGIN``)."""
    return math.isfinite(new) and new * (1 + KEEP_MARGIN) < old


class Optimizer:
    """Topology optimizations and background searches (see the module docstring).

    Args:
        table: the registry and outbox.
        book: the installed rings (an optimization replaces them) and unreachable edges.
        round_timeout: seconds a receiver has to report a link measurement.
        solve_seconds: time budget of an optimization's ring search.
        search_seconds: time budget of a background search (0: none).
        reference_bytes: the all-reduce size rings are optimized and predicted for.
    """

    def __init__(
        self,
        table: PeerTable,
        book: RingBook,
        *,
        round_timeout: float,
        solve_seconds: float,
        search_seconds: float,
        reference_bytes: int,
    ) -> None:
        self._table = table
        self._book = book
        self._round_timeout = round_timeout
        self._solve_seconds = solve_seconds
        self._search_seconds = search_seconds
        self._links = Links(book, reference_bytes=reference_bytes)
        self.reference_bytes = reference_bytes
        self._current: _Optimization | None = None
        self._next_optimization = 1
        self._next_job = 1
        self._searches: dict[int, _Job] = {}  # group -> background job
        self._candidates: dict[int, _Candidate] = {}  # group -> better ring

    def continue_above(self, number: int) -> None:
        """Number what comes next above ``number`` (a master that took over a run)."""
        self._next_optimization = max(self._next_optimization, number + 1)

    @property
    def running(self) -> bool:
        """Whether an optimization runs (until it hands its rings to a round)."""
        return self._current is not None

    # --- messages and solver answers -------------------------------------------------

    def on_vote(self, peer: Peer, message: VoteOptimizeTopology) -> None:
        """A member votes to optimize the topology."""
        check_member_vote(peer, message)
        peer.apply(PeerEvent.VOTE_OPTIMIZE)
        peer.voted_at = self._table.now

    def on_link_measured(self, peer: Peer, message: LinkMeasured) -> None:
        """A receiver reports the link it was asked to measure."""
        current = self._current
        if (
            current is None
            or message.optimization != current.number
            or current.outstanding.get(peer.peer_id) != message.sender
        ):
            raise RemoteProtocolError(
                f"LinkMeasured for the link from peer {message.sender} in optimization "
                f"{message.optimization}, which this peer was not asked to measure"
            )
        del current.outstanding[peer.peer_id]
        if message.sender not in self._table.peers:
            return  # the sender left: its links are forgotten
        store = self._links.store(peer.peer_group)
        if message.error:
            store.mark_unreachable(message.sender, peer.peer_id)
            self._table.report(
                RunKind.LINK_FAILED,
                f"optimization {current.number}: link {message.sender} -> {peer.peer_id} could "
                f"not be measured: {message.error}",
                level=logging.WARNING, number=current.number, sender=message.sender,
                receiver=peer.peer_id, group=peer.peer_group, reason=message.error,
            )
        else:
            store.record(message.sender, peer.peer_id, message.bandwidth, message.latency)
            self._table.report(
                RunKind.LINK_MEASURED,
                f"optimization {current.number}: link {message.sender} -> {peer.peer_id}: "
                f"{message.bandwidth * 8e-6:.1f} Mbit/s, {message.latency * 1e3:.3f} ms",
                level=logging.DEBUG, number=current.number, sender=message.sender,
                receiver=peer.peer_id, group=peer.peer_group,
                bytes_per_second=message.bandwidth, latency_seconds=message.latency,
            )

    def on_solved(self, event: SolveFinished) -> None:
        """A solver job ended: record an optimization's ring, or keep a background
        search's ring as the group's candidate if it is clearly faster."""
        current = self._current
        if current is not None and event.job in current.jobs:
            job = current.jobs.pop(event.job)
            order = self._solution(job, event)
            current.solved[job.group] = (order, event.optimal) if order else ((), False)
            return  # advance() goes on with the optimization
        search = next((j for j in self._searches.values() if j.number == event.job), None)
        if search is None:
            return  # cancelled meanwhile: membership changed
        del self._searches[search.group]
        order = self._solution(search, event)
        members = {p.peer_id for p in self._table.accepted() if p.peer_group == search.group}
        installed = self._book.rings.get(search.group, [])
        if not order or members != set(search.peers) or set(installed) != members:
            return
        index = {p: i for i, p in enumerate(search.peers)}
        found = ring_cost(search.cost, [index[p] for p in order])
        before = ring_cost(search.cost, [index[p] for p in installed])
        if _clearly_faster(found[0], before[0]):
            self._candidates[search.group] = _Candidate(
                members=frozenset(members), ring=order, cost=search.cost, peers=search.peers
            )
            scale = 2 * (len(order) - 1)
            self._table.report(
                RunKind.OPTIMIZED,
                f"peer group {search.group}: the background search found a ring {list(order)} "
                f"predicted {scale * found[0]:.3f} s (installed: {scale * before[0]:.3f} s); "
                "the next update_topology installs it",
                group=search.group, ring=tuple(order), predicted_seconds=scale * found[0],
                installed_seconds=scale * before[0], background=True,
            )

    # --- consensus -------------------------------------------------------------------

    def advance(self, *, round_running: bool) -> bool:
        """Refuse, start or go on with the optimization.

        Returns:
            True when an optimization just ended: its rings are in the ring book, and a
            round must install them now.
        """
        current = self._current
        if current is not None:
            return self._step(current)
        accepted = self._table.accepted()
        voters = [p for p in accepted if p.state is PeerState.VOTE_OPTIMIZE]
        if not voters:
            return False
        blocker = find_blocker(Call.OPTIMIZE_TOPOLOGY, voters[0].peer_group, accepted)
        if blocker is not None:
            # Both votes span every group and neither can complete: refuse this one. Peers
            # that only re-establish their ring (after an aborted all-reduce, before their
            # own optimize_topology) are joined, not fought: the voters take part in that
            # round, then vote again.
            rejoin = not any(
                p.accept_new_peers for p in accepted if p.state is PeerState.VOTE_ESTABLISH
            )
            if rejoin:
                error = (
                    f"peer {blocker.peer_id} re-establishes the ring (after an aborted "
                    "all-reduce): join that round, then vote again"
                )
            else:
                error = out_of_order(blocker, Call.OPTIMIZE_TOPOLOGY)
            self._refuse(voters, error, rejoin=rejoin)
            return False
        if len(voters) == len(accepted) and not round_running:
            return self._start(voters)
        return False

    def waiting(self) -> Iterator[Waiting]:
        """The vote, while some members voted and others did not."""
        if self._current is not None:
            return
        yield from run_vote(
            self._table, Call.OPTIMIZE_TOPOLOGY,
            voted=lambda p: p.state is PeerState.VOTE_OPTIMIZE,
            since=lambda p: p.voted_at,
            fail=lambda reason: self._refuse(
                [p for p in self._table.accepted() if p.state is PeerState.VOTE_OPTIMIZE],
                reason,
            ),
        )

    def _refuse(self, voters: Sequence[Peer], error: str, *, rejoin: bool = False) -> None:
        """End the vote of ``voters`` with ``error``; no optimization runs."""
        for peer in voters:
            peer.apply(PeerEvent.OPTIMIZE_REFUSED)
            self._table.send(peer, TopologyOptimized(optimization=0, error=error, rejoin=rejoin))

    def _start(self, voters: Sequence[Peer]) -> bool:
        """Plan the measurement steps of every group, then take the first."""
        number = self._next_optimization
        self._next_optimization += 1
        steps: list[list[tuple[int, int]]] = []
        for group, members in sorted(groups(voters).items()):
            store = self._links.store(group)
            for edge in store.missing(members):
                if edge in self._book.unreachable:  # a ring could not use it: nothing to measure
                    store.mark_unreachable(*edge)
            self._cancel_search(group)  # the new answer starts from the best ring known
            for index, links in enumerate(measurement_rounds(store.missing(members))):
                if index == len(steps):
                    steps.append([])
                steps[index].extend(links)
        current = _Optimization(
            number=number,
            participants={p.peer_id for p in voters},
            steps=steps,
        )
        self._current = current
        self._table.report(
            RunKind.OPTIMIZING,
            f"optimization {current.number}: measuring {sum(map(len, steps))} links in "
            f"{len(steps)} steps",
            number=current.number, links=sum(map(len, steps)), steps=len(steps),
        )
        for peer in voters:
            peer.apply(PeerEvent.OPTIMIZE_START)
        return self._step(current)

    def _step(self, current: _Optimization) -> bool:
        """Start the next measurement step once the last one is reported, then the
        solvers once every step is, then finish once every group is solved; whether it
        finished."""
        while not current.outstanding and current.step + 1 < len(current.steps):
            current.step += 1
            current.step_started = self._table.now
            for sender, receiver in current.steps[current.step]:
                if sender in current.participants and receiver in current.participants:
                    current.outstanding[receiver] = sender
                    self._table.send(
                        self._table.peers[sender],
                        ExpectBenchmark(
                            optimization=current.number,
                            measurer=self._table.endpoint(receiver),
                            nbytes=MEASUREMENT_BYTES,
                        ),
                    )
                    self._table.send(
                        self._table.peers[receiver],
                        MeasureLink(
                            optimization=current.number,
                            source=self._table.endpoint(sender),
                            nbytes=MEASUREMENT_BYTES,
                        ),
                    )
        if current.outstanding:
            return False
        if not current.solving:
            current.solving = True
            self._start_solves(current)
        if current.jobs:
            return False
        self._finish(current)
        return True

    def _start_solves(self, current: _Optimization) -> None:
        """A solver job per group of three or more; smaller groups have one ring only."""
        participants = (self._table.peers[p] for p in current.participants)
        for group, members in sorted(groups(participants).items()):
            if len(members) < 3:  # one ring only
                current.solved[group] = (tuple(members), True)
                continue
            job = self._solve(group, members, background=False, start=self._best_known(group, members))
            current.jobs[job.number] = job

    def _finish(self, current: _Optimization) -> None:
        """Choose each group's ring, report it to the participants, and start the
        background searches; the caller starts the round that installs the rings."""
        self._current = None
        participants = [self._table.peers[p] for p in sorted(current.participants)]
        reports: dict[int, TopologyOptimized] = {}
        searches: list[tuple[int, list[int], list[int]]] = []
        for group, members in sorted(groups(participants).items()):
            solved, proven = current.solved.get(group, ((), False))
            ring = [p for p in solved if p in members]
            cost = self._links.cost(group, members)
            index = {p: i for i, p in enumerate(members)}
            # What the round would install otherwise: a better ring the background search
            # found for these members, else the installed ring (newcomers appended).
            kept = self._best_known(group, members)
            if kept is None:
                kept = [p for p in self._book.rings.get(group, ()) if p in index]
                kept += [p for p in members if p not in kept]
            self._candidates.pop(group, None)
            new = math.inf
            if len(ring) == len(members):
                new = ring_cost(cost, [index[p] for p in ring])[0]
            old = ring_cost(cost, [index[p] for p in kept])[0]
            optimal = proven and math.isfinite(new)
            if not _clearly_faster(new, old):
                # Not clearly faster (measurement noise): keep the connections we have.
                optimal = optimal and old <= new
                ring = kept
            self._book.install(self._table, group, ring, f"optimization {current.number}")
            reports[group] = self._links.report(
                self._table, current.number, group, members, ring, optimal
            )
            if not proven and len(members) >= 3 and self._search_seconds > 0:
                searches.append((group, members, ring))
        for peer in participants:
            self._table.send(peer, reports[peer.peer_group])
        for group, members, ring in searches:
            self._searches[group] = self._solve(group, members, background=True, start=ring)

    # --- solver jobs and background searches -----------------------------------------

    def _solve(
        self, group: int, members: Sequence[int], *, background: bool,
        start: Sequence[int] | None,
    ) -> _Job:
        """Emit a ``Solve`` for ``members`` over what is known of their links now."""
        cost = self._links.cost(group, members)
        job = _Job(
            number=self._next_job, group=group, peers=tuple(members), cost=cost,
            background=background,
        )
        self._next_job += 1
        index = {p: i for i, p in enumerate(members)}
        self._table.actions.append(
            Solve(
                job=job.number,
                group=group,
                peers=job.peers,
                cost=cost,
                start=None if start is None else tuple(index[p] for p in start),
                seconds=self._search_seconds if background else self._solve_seconds,
                background=background,
            )
        )
        return job

    def _solution(self, job: _Job, event: SolveFinished) -> tuple[int, ...]:
        """The job's ring in peer ids, or () if it failed."""
        if event.error or not event.order:
            self._table.report(
                RunKind.SEARCH_FAILED,
                f"peer group {job.group}: the ring search failed ({event.error or 'no ring'}); "
                "keeping the installed ring",
                level=logging.WARNING, group=job.group, reason=event.error or "no ring",
            )
            return ()
        if sorted(event.order) != list(range(len(job.peers))):
            self._table.report(
                RunKind.SEARCH_FAILED,
                f"peer group {job.group}: the ring search returned {list(event.order)}, not a "
                f"ring of {len(job.peers)} peers",
                level=logging.ERROR, group=job.group, reason="not a ring",
            )
            return ()
        return tuple(job.peers[i] for i in event.order)

    def _best_known(self, group: int, members: Sequence[int]) -> list[int] | None:
        """The ring to improve on: the background search's, else the installed one
        (None if neither has exactly these members)."""
        member_set = set(members)
        candidate = self._candidates.get(group)
        if candidate is not None and candidate.members == member_set:
            return list(candidate.ring)
        ring = self._book.rings.get(group, [])
        return list(ring) if set(ring) == member_set and len(ring) == len(members) else None

    def _cancel_search(self, group: int) -> None:
        """Stop the group's background search, if one runs."""
        search = self._searches.pop(group, None)
        if search is not None:
            self._table.actions.append(CancelSolve(job=search.number))

    def adopt_candidate(self, group: int, members: set[int]) -> None:
        """Before a round: install the background search's better ring if the group
        still has exactly the members it was found for; otherwise drop it."""
        search = self._searches.get(group)
        if search is not None and set(search.peers) != members:
            self._cancel_search(group)
        candidate = self._candidates.pop(group, None)
        if candidate is None or candidate.members != members:
            return
        # Judge it on what is known now: a round may have found one of its links
        # unreachable since the search began.
        peers = sorted(members)
        index = {p: i for i, p in enumerate(peers)}
        cost = self._links.cost(group, peers)
        installed = [p for p in self._book.rings.get(group, ()) if p in index]
        found = ring_cost(cost, [index[p] for p in candidate.ring])[0]
        if len(installed) == len(peers):
            before = ring_cost(cost, [index[p] for p in installed])[0]
            if not _clearly_faster(found, before):
                return
        self._book.install(self._table, group, candidate.ring, "found by the background search")

    def topology(self, peer_group: int) -> TopologyView:
        """The links measured among ``peer_group``'s accepted peers and its ring."""
        members, ring = self._members_and_ring(peer_group)
        return self._links.view(peer_group, members, ring)

    def ring(self, peer_group: int) -> tuple[tuple[int, ...], float]:
        """``peer_group``'s ring among its accepted peers, and its predicted seconds for
        the reference size (``inf``: some link of it unmeasured); no link matrices."""
        members, ring = self._members_and_ring(peer_group)
        return ring, self._links.predicted(peer_group, members, ring)

    def _members_and_ring(self, peer_group: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        members = tuple(sorted(
            p.peer_id for p in self._table.accepted() if p.peer_group == peer_group
        ))
        return members, tuple(p for p in self._book.rings.get(peer_group, ()) if p in members)

    # --- removal and time ------------------------------------------------------------

    def peer_left(self, peer: Peer) -> None:
        """Forget what was measured and searched for the peer's group; go on with the
        optimization without it (or cancel it when nobody is left)."""
        if peer.phase is PeerPhase.ACCEPTED:
            # The group's links and rings change: what was measured or searched for
            # its old membership no longer applies.
            self._links.forget(peer.peer_group, peer.peer_id)
            self._cancel_search(peer.peer_group)
            self._candidates.pop(peer.peer_group, None)
        current = self._current
        if current is not None and peer.peer_id in current.participants:
            current.participants.discard(peer.peer_id)
            current.outstanding.pop(peer.peer_id, None)  # nothing to wait for
            if not current.participants:
                for job in current.jobs:
                    self._table.actions.append(CancelSolve(job=job))
                self._current = None

    def deadline(self) -> float:
        """When the measurement step times out (``inf``: none is outstanding)."""
        current = self._current
        if current is None or not current.outstanding:
            return math.inf
        return current.step_started + self._round_timeout

    def kick_late(self) -> bool:
        """Kick the receivers that did not report in time; whether any was late."""
        current = self._current
        if (
            current is None
            or not current.outstanding
            or self._table.now < current.step_started + self._round_timeout
        ):
            return False
        for receiver in sorted(current.outstanding):
            self._table.kick_peer(
                self._table.peers[receiver],
                f"did not report its link measurement within {self._round_timeout}s",
                KickCause.LATE,
            )
        return True
