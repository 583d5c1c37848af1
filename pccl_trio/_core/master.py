"""The master's state machine: who is in the run, votes, rounds, kicks and liveness.

Theory of operation
-------------------
``MasterCore.handle(event, now)`` takes one event (a connection opened, a message
arrived, a connection broke or closed, or just time passing) and returns the actions
the shell must carry out (send a message on a connection, close a connection). It
never does IO and never reads a clock: ``now`` is an input, and ``next_deadline()``
tells the shell when to call again with a ``Tick`` even if nothing arrives.

Each registered peer has a *phase* (REGISTERED until a round admits it, then
ACCEPTED) and a *state*. All state changes go through ``TRANSITIONS``, one table:
an event a peer caused that the table does not allow gets that peer kicked with the
reason; an event the master caused that the table does not allow is a bug here
(``LocalProtocolError``).

Votes are unanimous. An *establishment round* (the ring is (re-)built and every
participant connects to its neighbours) starts once every ACCEPTED peer, in every
peer group, voted ``VoteEstablish``; REGISTERED peers count as yes. If all voters
asked to accept new peers, the REGISTERED peers join the round; a peer registering
while a round runs waits for the next one. When no ACCEPTED peer is left (the first
peer, or everyone else died), waiting peers are admitted at once. A round succeeds
if every participant reports its neighbours reachable and none left meanwhile; every
participant receives the same verdict, and after a failure they vote again. Edges a
peer could not reach are remembered, and the next ring avoids them; when no ring can,
the peer with the most unreachable edges is kicked so the run can go on.

The pending-peers vote is orthogonal to the state: when every ACCEPTED peer asked,
each gets whether anyone waits to be admitted.

Any event that removes a peer (close, break, kick, silence) re-evaluates every
pending consensus, so the survivors never wait for a peer that is gone. A connection
that delivers nothing for ``liveness_timeout`` seconds is treated as gone; the
master sends heartbeats on quiet links every ``heartbeat_interval`` seconds so that
the peers can judge the master the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import numpy

from .bandwidth import BandwidthStore, link_matrices, measurement_rounds, ring_cost
from .collectives import Collectives
from .errors import LocalProtocolError, RemoteProtocolError
from .events import (
    Action,
    CancelSolve,
    Close,
    ConnectionBroken,
    ConnectionClosed,
    ConnectionOpened,
    Event,
    MessageReceived,
    Send,
    Solve,
    SolveFinished,
    Tick,
    TopologyView,
)
from .messages import (
    C2M,
    MATRIX_LIMIT,
    CollectiveComplete,
    CollectiveInitiate,
    Heartbeat,
    LinkMeasured,
    MeasureLink,
    Message,
    P2PEstablished,
    PeerEndpoint,
    Register,
    SharedStateDone,
    SharedStateVote,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
)
from .peers import (
    REMOTE_EVENTS,
    TRANSITIONS,
    Call,
    Conn,
    Peer,
    PeerEvent,
    PeerPhase,
    PeerState,
    PeerTable,
    PeerView,
    check_member_vote,
    find_blocker,
    groups,
    out_of_order,
    transition,
)
from .rounds import PendingVote, RingBook, Rounds
from .syncs import Syncs

__all__ = [
    "KEEP_MARGIN",
    "REMOTE_EVENTS",
    "TRANSITIONS",
    "Action",
    "CancelSolve",
    "Close",
    "ConnectionBroken",
    "ConnectionClosed",
    "ConnectionOpened",
    "Event",
    "MasterCore",
    "MessageReceived",
    "PeerEvent",
    "PeerPhase",
    "PeerState",
    "PeerView",
    "Send",
    "Solve",
    "SolveFinished",
    "Tick",
    "TopologyView",
    "transition",
]

log = logging.getLogger("pccl_trio.master")


#: A solved ring replaces the installed one only if predicted faster by this fraction:
#: rings within measurement noise of each other are not worth re-connecting for.
KEEP_MARGIN = 0.05


# --- internal bookkeeping ----------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class _Optimization:
    """A topology optimization, from the vote to the round that installs its rings."""

    number: int
    participants: set[int]
    steps: list[list[tuple[int, int]]]  # links (sender, receiver) measured together
    step: int = -1
    solving: bool = False
    outstanding: dict[int, int] = dataclasses.field(default_factory=dict)  # receiver -> sender
    step_started: float = 0.0
    jobs: dict[int, _Job] = dataclasses.field(default_factory=dict)  # solver jobs running
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


def _format_links(members: Sequence[int], store: BandwidthStore) -> str:
    """A table of the measured rates (Mbit/s) among ``members``: ``-`` unknown, ``x``
    unreachable."""
    width = max(7, *(len(str(p)) + 1 for p in members))
    lines = [" " * width + "".join(f"{p:>{width}}" for p in members)]
    for a in members:
        cells = []
        for b in members:
            found = store.link(a, b)
            if a == b:
                cells.append("")
            elif found is not None:
                cells.append(f"{found.bandwidth * 8e-6:.1f}")
            else:
                cells.append("x" if store.unreachable(a, b) else "-")
        lines.append(f"{a:>{width}}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


class MasterCore:
    """The master's state machine. Feed it events; carry out the actions it returns.

    Args:
        heartbeat_interval: seconds between heartbeats the master sends on quiet links.
        liveness_timeout: a connection silent this long is dropped (its peer removed).
        round_timeout: a participant that has not reported on its p2p connections
            this long after a round started is removed (it would stall the run); the
            same bound applies to a link measurement during a topology optimization.
        solve_seconds: time budget of the first ring search of an optimization.
        search_seconds: time budget of the background search that follows a first
            ring not provably optimal.
        reference_bytes: the all-reduce size rings are optimized (and predicted) for.
    """

    def __init__(
        self,
        *,
        heartbeat_interval: float,
        liveness_timeout: float,
        round_timeout: float = 30.0,
        solve_seconds: float = 1.0,
        search_seconds: float = 60.0,
        reference_bytes: int = 64 << 20,
    ) -> None:
        if not 0 < heartbeat_interval < liveness_timeout:
            raise ValueError("need 0 < heartbeat_interval < liveness_timeout")
        if not round_timeout > 0:
            raise ValueError("need round_timeout > 0")
        if not (solve_seconds > 0 and search_seconds >= 0 and reference_bytes > 0):
            raise ValueError("need solve_seconds > 0, search_seconds >= 0, reference_bytes > 0")
        self._table = PeerTable(
            heartbeat_interval=heartbeat_interval,
            liveness_timeout=liveness_timeout,
            on_leave=self._peer_left,
        )
        self._round_timeout = round_timeout
        self._solve_seconds = solve_seconds
        self._search_seconds = search_seconds
        self._reference_bytes = reference_bytes
        self._book = RingBook()
        self._rounds = Rounds(
            self._table, self._book, round_timeout=round_timeout,
            adopt_candidate=self._adopt_candidate,
        )
        self._pending = PendingVote(self._table)
        self._collectives = Collectives(self._table, self._book)
        self._syncs = Syncs(self._table)
        # Topology: what is known of each group's links, the optimization running, the
        # background searches and the better rings they found.
        self._bandwidth: dict[int, BandwidthStore] = {}
        self._optimization: _Optimization | None = None
        self._optimization_counter = 0
        self._job_counter = 0
        self._searches: dict[int, _Job] = {}  # group -> background job
        self._candidates: dict[int, _Candidate] = {}  # group -> better ring

    # --- public surface ------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        """Process one event at time ``now``; return the actions to carry out, in order."""
        self._table.begin(now)
        match event:
            case MessageReceived(conn=conn_id, message=message):
                conn = self._table.conns.get(conn_id)
                if conn is not None:
                    conn.last_heard = self._table.now
                    # Heartbeats only prove a registered peer alive; before Register
                    # they are refused like any other message.
                    if conn.peer is None or not isinstance(message, Heartbeat):
                        self._on_message(conn, message)
                        self._reevaluate()
            case ConnectionOpened(conn=conn_id, host=host):
                self._table.open(conn_id, host)
            case ConnectionBroken(conn=conn_id, reason=reason):
                if conn_id in self._table.conns:
                    self._table.kick(self._table.conns[conn_id], f"malformed input: {reason}")
                    self._reevaluate()
            case ConnectionClosed(conn=conn_id):
                if conn_id in self._table.conns:
                    self._table.drop(self._table.conns[conn_id], "connection closed")
                    self._reevaluate()
            case Tick():
                self._on_tick()
            case SolveFinished():
                self._on_solved(event)
                self._reevaluate()
            case _:  # pragma: no cover - exhaustive
                raise LocalProtocolError(f"unknown event {event!r}")
        return self._table.take_actions()

    def next_deadline(self) -> float:
        """When to deliver a ``Tick`` if no other event comes first (``inf``: never)."""
        deadline = self._rounds.deadline()
        if self._optimization is not None and self._optimization.outstanding:
            deadline = min(deadline, self._optimization.step_started + self._round_timeout)
        return min(deadline, self._table.deadline())

    def peers(self) -> list[PeerView]:
        """Every registered peer, by id."""
        return self._table.views()

    def ring(self, peer_group: int) -> list[int]:
        """The ring order last installed for ``peer_group`` (may name departed peers
        until the next round rebuilds it)."""
        return list(self._book.rings.get(peer_group, ()))

    @property
    def round_in_progress(self) -> bool:
        return self._rounds.running

    @property
    def optimization_in_progress(self) -> bool:
        return self._optimization is not None

    def topology(self, peer_group: int) -> TopologyView:
        """The links measured among ``peer_group``'s accepted peers and its ring."""
        members = tuple(sorted(
            p.peer_id for p in self._table.accepted() if p.peer_group == peer_group
        ))
        store = self._bandwidth.get(peer_group, BandwidthStore())
        bandwidth, latency, unreachable = store.matrices(members)
        rates, delays = link_matrices(
            len(members), bandwidth, latency, [*unreachable, *self._book.blocked_indices(members)]
        )
        ring = tuple(p for p in self._book.rings.get(peer_group, ()) if p in members)
        return TopologyView(
            peers=members,
            bandwidth=rates,
            latency=delays,
            ring=ring,
            predicted_seconds=self._predicted(peer_group, members, ring),
            reference_bytes=self._reference_bytes,
        )

    # --- messages ------------------------------------------------------------------

    def _on_message(self, conn: Conn, message: Message) -> None:
        if message.DIRECTION != C2M:
            self._table.kick(conn, f"{type(message).__name__} is not a message a peer may send")
            return
        peer = conn.peer
        if peer is None:
            if isinstance(message, Register):
                self._table.register(conn, message)
            else:
                self._table.kick(conn, f"{type(message).__name__} before Register")
            return
        try:
            match message:
                case Register():
                    raise RemoteProtocolError("Register on a connection already registered")
                case VoteEstablish():
                    self._rounds.on_vote(peer, message)
                case P2PEstablished():
                    self._rounds.on_established(peer, message)
                case VotePeersPending():
                    self._pending.on_vote(peer, message)
                case CollectiveInitiate():
                    self._collectives.on_initiate(peer, message)
                case CollectiveComplete():
                    self._collectives.on_complete(peer, message)
                case SharedStateVote():
                    self._syncs.on_vote(peer, message)
                case SharedStateDone():
                    self._syncs.on_done(peer, message)
                case VoteOptimizeTopology():
                    check_member_vote(peer, message)
                    peer.apply(PeerEvent.VOTE_OPTIMIZE)
                case LinkMeasured():
                    self._on_link_measured(peer, message)
                case _:  # pragma: no cover - every C2M kind is handled above
                    raise LocalProtocolError(f"unhandled message {message!r}")
        except RemoteProtocolError as exc:
            self._table.kick(conn, f"illegal {type(message).__name__}: {exc}")

    # --- time ----------------------------------------------------------------------

    def _on_tick(self) -> None:
        # Compare against the same sums next_deadline() returns: ``now - last >= timeout``
        # can be false at ``now == last + timeout`` in floating point, and a Tick at the
        # deadline that does nothing would leave the deadline in the past (a busy loop).
        silent = self._table.kick_silent()
        late = self._rounds.kick_late()
        optimization = self._optimization
        if (
            optimization is not None
            and optimization.outstanding
            and self._table.now >= optimization.step_started + self._round_timeout
        ):
            late = True
            for receiver in sorted(optimization.outstanding):
                self._table.kick_peer(
                    self._table.peers[receiver],
                    f"did not report its link measurement within {self._round_timeout}s",
                )
        if silent or late:
            self._reevaluate()
        self._table.send_heartbeats()

    # --- consensus -----------------------------------------------------------------

    def _reevaluate(self) -> None:
        """Check every consensus that may have become complete."""
        # A round can end because of an event, and the end of a round can make a new
        # one startable (e.g. all voters died): loop until nothing changes.
        while True:
            self._rounds.advance()
            self._pending.advance()
            self._collectives.advance()
            before = len(self._table.peers)
            self._try_optimize()
            self._syncs.advance()
            # An election may kick peers, which can complete any other consensus (a
            # round or a pending vote waiting for them): check everything again.
            if len(self._table.peers) == before:
                break

    # --- topology optimization -------------------------------------------------------

    def _try_optimize(self) -> None:
        current = self._optimization
        if current is not None:
            self._advance_optimization(current)
            return
        accepted = self._table.accepted()
        voters = [p for p in accepted if p.state is PeerState.VOTE_OPTIMIZE]
        if not voters:
            return
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
            for peer in voters:
                peer.apply(PeerEvent.OPTIMIZE_REFUSED)
                self._table.send(peer, TopologyOptimized(optimization=0, error=error, rejoin=rejoin))
            return
        if len(voters) == len(accepted) and not self._rounds.running:
            self._start_optimization(voters)

    def _start_optimization(self, voters: Sequence[Peer]) -> None:
        self._optimization_counter += 1
        steps: list[list[tuple[int, int]]] = []
        for group, members in sorted(groups(voters).items()):
            store = self._bandwidth.setdefault(group, BandwidthStore())
            for edge in store.missing(members):
                if edge in self._book.unreachable:  # a ring could not use it: nothing to measure
                    store.mark_unreachable(*edge)
            self._cancel_search(group)  # the new answer starts from the best ring known
            for index, links in enumerate(measurement_rounds(store.missing(members))):
                if index == len(steps):
                    steps.append([])
                steps[index].extend(links)
        current = _Optimization(
            number=self._optimization_counter,
            participants={p.peer_id for p in voters},
            steps=steps,
        )
        self._optimization = current
        log.info(
            "optimization %d: measuring %d links in %d steps",
            current.number, sum(map(len, steps)), len(steps),
        )
        for peer in voters:
            peer.apply(PeerEvent.OPTIMIZE_START)
        self._advance_optimization(current)

    def _advance_optimization(self, current: _Optimization) -> None:
        """Start the next measurement step once the last one is reported, then the
        solvers once every step is, then the round once every group is solved."""
        while not current.outstanding and current.step + 1 < len(current.steps):
            current.step += 1
            current.step_started = self._table.now
            for sender, receiver in current.steps[current.step]:
                if sender in current.participants and receiver in current.participants:
                    current.outstanding[receiver] = sender
                    source = self._table.peers[sender]
                    self._table.send(
                        self._table.peers[receiver],
                        MeasureLink(
                            optimization=current.number,
                            source=PeerEndpoint(
                                peer_id=sender, host=source.host, port=source.port
                            ),
                        ),
                    )
        if current.outstanding:
            return
        if not current.solving:
            current.solving = True
            self._start_solves(current)
        if not current.jobs:
            self._finish_optimization(current)

    def _on_link_measured(self, peer: Peer, message: LinkMeasured) -> None:
        current = self._optimization
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
        store = self._bandwidth.setdefault(peer.peer_group, BandwidthStore())
        if message.error:
            store.mark_unreachable(message.sender, peer.peer_id)
            log.warning(
                "optimization %d: link %d -> %d could not be measured: %s",
                current.number, message.sender, peer.peer_id, message.error,
            )
        else:
            store.record(message.sender, peer.peer_id, message.bandwidth, message.latency)
            log.debug(
                "optimization %d: link %d -> %d: %.1f Mbit/s, %.3f ms",
                current.number, message.sender, peer.peer_id, message.bandwidth * 8e-6,
                message.latency * 1e3,
            )

    def _start_solves(self, current: _Optimization) -> None:
        for group, members in sorted(groups(self._table.peers[p] for p in current.participants).items()):
            if len(members) < 3:  # one ring only
                current.solved[group] = (tuple(members), True)
                continue
            job = self._solve(group, members, background=False, start=self._best_known(group, members))
            current.jobs[job.number] = job

    def _solve(
        self, group: int, members: Sequence[int], *, background: bool,
        start: Sequence[int] | None,
    ) -> _Job:
        self._job_counter += 1
        cost = self._cost(group, members)
        job = _Job(
            number=self._job_counter, group=group, peers=tuple(members), cost=cost,
            background=background,
        )
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

    def _best_known(self, group: int, members: Sequence[int]) -> list[int] | None:
        """The ring to improve on: the background search's, else the installed one
        (None if neither has exactly these members)."""
        member_set = set(members)
        candidate = self._candidates.get(group)
        if candidate is not None and candidate.members == member_set:
            return list(candidate.ring)
        ring = self._book.rings.get(group, [])
        return list(ring) if set(ring) == member_set and len(ring) == len(members) else None

    def _on_solved(self, event: SolveFinished) -> None:
        current = self._optimization
        if current is not None and event.job in current.jobs:
            job = current.jobs.pop(event.job)
            order = self._solution(job, event)
            current.solved[job.group] = (order, event.optimal) if order else ((), False)
            return  # _reevaluate advances the optimization
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
            log.info(
                "peer group %d: the background search found a ring %s predicted %.3f s "
                "(installed: %.3f s); the next update_topology installs it",
                search.group, list(order), scale * found[0], scale * before[0],
            )

    def _solution(self, job: _Job, event: SolveFinished) -> tuple[int, ...]:
        """The job's ring in peer ids, or () if it failed."""
        if event.error or not event.order:
            log.warning(
                "peer group %d: the ring search failed (%s); keeping the installed ring",
                job.group, event.error or "no ring",
            )
            return ()
        if sorted(event.order) != list(range(len(job.peers))):
            log.error("peer group %d: the ring search returned %s, not a ring of %d peers",
                      job.group, list(event.order), len(job.peers))
            return ()
        return tuple(job.peers[i] for i in event.order)

    def _finish_optimization(self, current: _Optimization) -> None:
        self._optimization = None
        participants = [self._table.peers[p] for p in sorted(current.participants)]
        reports: dict[int, TopologyOptimized] = {}
        searches: list[tuple[int, list[int], list[int]]] = []
        for group, members in sorted(groups(participants).items()):
            solved, proven = current.solved.get(group, ((), False))
            ring = [p for p in solved if p in members]
            cost = self._cost(group, members)
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
            self._book.rings[group] = ring
            reports[group] = self._report(current.number, group, members, ring, optimal)
            if not proven and len(members) >= 3 and self._search_seconds > 0:
                searches.append((group, members, ring))
        for peer in participants:
            self._table.send(peer, reports[peer.peer_group])
        for group, members, ring in searches:
            self._searches[group] = self._solve(group, members, background=True, start=ring)
        self._rounds.start(accept_new=False)

    def _report(
        self, number: int, group: int, members: Sequence[int], ring: Sequence[int], optimal: bool
    ) -> TopologyOptimized:
        store = self._bandwidth.get(group) or BandwidthStore()
        predicted = self._predicted(group, members, ring)
        log.info(
            "optimization %d, peer group %d: ring %s, predicted %s for %d MiB%s; links "
            "(Mbit/s, sender by row):\n%s",
            number, group, list(ring),
            f"{predicted:.3f} s" if math.isfinite(predicted) else "unknown",
            self._reference_bytes >> 20, " (optimal)" if optimal else "",
            _format_links(members, store),
        )
        bandwidth: list[float] = []
        latency: list[float] = []
        unreachable: list[int] = []
        if len(members) <= MATRIX_LIMIT:
            bandwidth, latency, unreachable = store.matrices(members)
            unreachable = sorted(set(unreachable) | set(self._book.blocked_indices(members)))
        return TopologyOptimized(
            optimization=number,
            peers=tuple(members),
            bandwidth=tuple(bandwidth),
            latency=tuple(latency),
            unreachable=tuple(unreachable),
            ring=tuple(ring),
            predicted_seconds=predicted if math.isfinite(predicted) else -1.0,
            reference_bytes=self._reference_bytes,
            optimal=optimal,
        )

    def _cost(self, group: int, members: Sequence[int]) -> numpy.ndarray:
        """Seconds per chunk of a reference all-reduce over each link among ``members``;
        infinity where unknown, unmeasurable, or reported unreachable by a round."""
        store = self._bandwidth.get(group) or BandwidthStore()
        cost = store.cost_matrix(members, nbytes=self._reference_bytes)
        index = {p: i for i, p in enumerate(members)}
        for a, b in self._book.unreachable:
            if a in index and b in index:
                cost[index[a], index[b]] = math.inf
        return cost

    def _predicted(self, group: int, members: Sequence[int], ring: Sequence[int]) -> float:
        if len(ring) < 2:
            return 0.0
        index = {p: i for i, p in enumerate(members)}
        bottleneck, _total = ring_cost(self._cost(group, members), [index[p] for p in ring])
        return 2 * (len(ring) - 1) * bottleneck

    def _cancel_search(self, group: int) -> None:
        search = self._searches.pop(group, None)
        if search is not None:
            self._table.actions.append(CancelSolve(job=search.number))

    def _adopt_candidate(self, group: int, members: set[int]) -> None:
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
        cost = self._cost(group, peers)
        installed = [p for p in self._book.rings.get(group, ()) if p in index]
        found = ring_cost(cost, [index[p] for p in candidate.ring])[0]
        if len(installed) == len(peers):
            before = ring_cost(cost, [index[p] for p in installed])[0]
            if not _clearly_faster(found, before):
                return
        log.info(
            "peer group %d: installing the ring %s found by the background search",
            group, list(candidate.ring),
        )
        self._book.rings[group] = list(candidate.ring)

    # --- removal -------------------------------------------------------------------

    def _peer_left(self, peer: Peer, reason: str) -> None:
        """Every part forgets ``peer``, which the registry removed; pending consensus is
        re-checked by the caller."""
        self._rounds.peer_left(peer)
        if peer.phase is PeerPhase.ACCEPTED:
            # The group's links and rings change: what was measured or searched for
            # its old membership no longer applies.
            store = self._bandwidth.get(peer.peer_group)
            if store is not None:
                store.forget(peer.peer_id)
            self._cancel_search(peer.peer_group)
            self._candidates.pop(peer.peer_group, None)
        current = self._optimization
        if current is not None and peer.peer_id in current.participants:
            current.participants.discard(peer.peer_id)
            current.outstanding.pop(peer.peer_id, None)  # nothing to wait for
            if not current.participants:
                for job in current.jobs:
                    self._table.actions.append(CancelSolve(job=job))
                self._optimization = None
        self._collectives.peer_left(peer, reason)
        self._book.forget_edges(peer.peer_id)
        self._syncs.peer_left(peer)
