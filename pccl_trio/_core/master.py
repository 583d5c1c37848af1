"""The master's state machine: a thin dispatcher over one part per sub-machine.

Theory of operation
-------------------
``MasterCore.handle(event, now)`` takes one event (a connection opened, a message
arrived, a connection broke or closed, a ring search finished, or just time passing)
and returns the actions the shell must carry out, in order. It never does IO and never
reads a clock: ``now`` is an input, and ``next_deadline()`` tells the shell when to
call again with a ``Tick`` even if nothing arrives. Votes are unanimous, and every
event that removes a peer re-evaluates every pending consensus, so the survivors
never wait for a peer that is gone.

The parts, one module each; each owns its state, and all append to one outbox:

- ``events``: what goes in and comes out (events, actions, ``TopologyView``).
- ``peers``: peer phases and states, ``TRANSITIONS``, which vote blocks which call
  (``BLOCKED_BY``), and ``PeerTable``: connections, registration, liveness and
  heartbeats, kicks and removal, the clock, the outbox and the run's reports.
- ``report``: the run events the parts report (logged once, counted); ``status``:
  the read-only snapshot an observer gets (``MasterCore.status``).
- ``rounds``: establishment rounds; the ``RingBook`` (installed rings, unreachable
  edges, stale groups) the other parts read; the pending-peers vote.
- ``collectives``: all-reduces, from the initiate votes to the verdicts; ``leases``:
  the tags a group runs without the master, until something makes them end.
- ``syncs``: shared-state syncs, from the ballots to ``SharedStateComplete``.
- ``optimization``: link measurements, ring searches (``Solve``), background
  searches and their candidate rings; ``links`` holds what is known of the links
  (costs, predictions, reports, the topology view).
- ``stalls``: votes waiting for peers that do not make the call: a log line naming
  them, then, past the stall timeout, the vote refused for its voters.
- ``recovery``: members that lost their master registering again as who they were;
  while a group is coming back, no consensus is decided (``_reevaluate`` waits).

Each part answers the same small surface: one handler per message it owns (``handle``
routes a message by its type, ``_routes``), ``advance()`` to re-check its consensus,
``peer_left()`` to forget a removed peer, where it has a timer, ``deadline()`` and
``kick_late()``, and where it has votes that may wait for members, ``waiting()`` (the
stall timer's sources). ``next_deadline()`` is the earliest of the parts' deadlines.

Two orders are behaviour: they decide where ``CollectiveAbort``, ``CancelSolve`` and
the other actions land in the action list. Each is spelled out once, here:

- *Re-evaluation* (``_reevaluate``), after each event that may complete a consensus:
  rounds (finish the running one, start the next, until neither happens), the
  pending-peers vote, collectives, the optimization (and the round that installs its
  rings), syncs; all again while the last two removed peers (an installing round may
  kick a peer no ring can include, an election may kick voters).
- *Removal* (``_peer_left``), once the registry forgot a peer: the running round and
  the group's stale ring (rounds); the group's links, background search and candidate,
  then the running optimization; collectives; the peer's unreachable edges (ring
  book); the group's sync and expected revision (syncs).

A ``Tick`` kicks silent connections, then late round participants, then late link
measurements; re-evaluates if it kicked anyone; then logs the stall warnings due and
refuses the votes past the stall timeout (collectives, the pending-peers vote, the
establishment vote, syncs, the optimization vote), re-evaluating if it refused any;
re-evaluates if a held pending-peers answer is due (its askers' wait ran out); then
sends the heartbeats due.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

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
from .identity import fingerprint
from .messages import (
    C2M,
    CollectiveComplete,
    CollectiveInitiate,
    Heartbeat,
    Kick,
    LeaseReport,
    LinkMeasured,
    Message,
    P2PEstablished,
    Register,
    SharedStateDone,
    SharedStateVote,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
)
from .optimization import KEEP_MARGIN, Optimizer
from .peers import (
    REMOTE_EVENTS,
    TRANSITIONS,
    Conn,
    Peer,
    PeerEvent,
    PeerPhase,
    PeerState,
    PeerTable,
    PeerView,
    transition,
)
from .recovery import Recovery
from .report import KickCause, RunEvent
from .rounds import PendingVote, RingBook, Rounds
from .stalls import Stalls
from .status import (
    MAX_COLLECTIVES,
    MAX_PEERS,
    GroupStatus,
    PeerStatus,
    PeerTally,
    RunCount,
    StatusReply,
    StatusRequest,
    WaitStatus,
    fit,
)
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

_M = TypeVar("_M", bound=Message)
_Handler = Callable[[Peer, Message], None]


def _route(kind: type[_M], handler: Callable[[Peer, _M], None]) -> tuple[type[Message], _Handler]:
    """One row of the routing table; mypy checks that ``handler`` takes ``kind``."""
    # Safe: _on_message looks handlers up by the exact type of the message.
    return kind, cast(_Handler, handler)


def _registered_twice(peer: Peer, message: Register) -> None:
    """A peer registers once per connection."""
    raise RemoteProtocolError("Register on a connection already registered")


def _observers_only(peer: Peer, message: StatusRequest) -> None:
    """A member asks the master nothing outside its calls."""
    raise RemoteProtocolError("StatusRequest is for observers, not registered peers")


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
        stall_timeout: a vote that waited this long for members that did not vote is
            refused for its voters (``inf``: votes wait forever).
        stall_warning: a vote waiting this long for members is logged, naming them,
            then again after twice as long, four times, ...
        allowed_identities: the node identities that may register (None: anyone who
            reached the core, i.e. who completed the handshake).
        recovery_window: seconds the members of a group have to come back once the
            first did, after their master was lost (None: the liveness timeout).
        content_digest: require a BLAKE2b-256 content digest beside the simplehash in
            every shared-state vote (announced in ``Welcome``; a vote without kicks its
            peer), and compare content by both.
        first_peer_id: the id of the first peer to register (an elected master starts
            at a random one: ``_core.election``).
        lease_span: how many attempts a lease on a tag numbers (``leases``).
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
        stall_timeout: float = 1800.0,
        stall_warning: float = 60.0,
        allowed_identities: frozenset[bytes] | None = None,
        content_digest: bool = False,
        recovery_window: float | None = None,
        first_peer_id: int = 1,
        lease_span: int = 1 << 20,
    ) -> None:
        if not 0 < heartbeat_interval < liveness_timeout:
            raise ValueError("need 0 < heartbeat_interval < liveness_timeout")
        if not round_timeout > 0:
            raise ValueError("need round_timeout > 0")
        if not (solve_seconds > 0 and search_seconds >= 0 and reference_bytes > 0):
            raise ValueError("need solve_seconds > 0, search_seconds >= 0, reference_bytes > 0")
        if not (stall_timeout > 0 and stall_warning > 0):
            raise ValueError("need stall_timeout > 0 and stall_warning > 0")
        self._table = PeerTable(
            heartbeat_interval=heartbeat_interval,
            liveness_timeout=liveness_timeout,
            on_leave=self._peer_left,
            allowed_identities=allowed_identities,
            content_digest=content_digest,
            first_peer_id=first_peer_id,
        )
        self._book = RingBook()
        self._optimizer = Optimizer(
            self._table, self._book, round_timeout=round_timeout, solve_seconds=solve_seconds,
            search_seconds=search_seconds, reference_bytes=reference_bytes,
        )
        self._rounds = Rounds(
            self._table, self._book, round_timeout=round_timeout,
            adopt_candidate=self._optimizer.adopt_candidate,
        )
        self._pending = PendingVote(self._table)
        self._collectives = Collectives(self._table, self._book, lease_span=lease_span)
        self._syncs = Syncs(self._table, content_digest=content_digest)
        self._recovery = Recovery(
            self._table, self._book,
            window=liveness_timeout if recovery_window is None else recovery_window,
            continue_above=self._continue_above, expect_revision=self._syncs.expect,
        )
        self._stalls = Stalls(
            self._table,
            [
                self._collectives.waiting, self._pending.waiting, self._rounds.waiting,
                self._syncs.waiting, self._optimizer.waiting,
            ],
            timeout=stall_timeout,
            warning=stall_warning,
        )
        # Every message a registered peer may send, and the part that handles it.
        self._routes: Mapping[type[Message], _Handler] = dict([
            _route(Register, _registered_twice),
            _route(StatusRequest, _observers_only),
            _route(VoteEstablish, self._rounds.on_vote),
            _route(P2PEstablished, self._rounds.on_established),
            _route(VotePeersPending, self._pending.on_vote),
            _route(CollectiveInitiate, self._collectives.on_initiate),
            _route(CollectiveComplete, self._collectives.on_complete),
            _route(LeaseReport, self._collectives.leases.on_report),
            _route(SharedStateVote, self._syncs.on_vote),
            _route(SharedStateDone, self._syncs.on_done),
            _route(VoteOptimizeTopology, self._optimizer.on_vote),
            _route(LinkMeasured, self._optimizer.on_link_measured),
        ])

    # --- public surface ------------------------------------------------------------

    def take_reports(self) -> list[RunEvent]:
        """What happened in the run while handling the last event (``report``), in
        order; each was logged already."""
        return self._table.take_reports()

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
                        self._stalls.changed()
                        self._on_message(conn, message)
                        self._reevaluate()
            case ConnectionOpened(conn=conn_id, host=host, identity=identity):
                self._table.open(conn_id, host, identity)
            case ConnectionBroken(conn=conn_id, reason=reason):
                if conn_id in self._table.conns:
                    self._stalls.changed()
                    self._table.kick(
                        self._table.conns[conn_id], f"malformed input: {reason}", KickCause.PROTOCOL
                    )
                    self._reevaluate()
            case ConnectionClosed(conn=conn_id):
                if conn_id in self._table.conns:
                    self._stalls.changed()
                    self._table.drop(self._table.conns[conn_id], "connection closed")
                    self._reevaluate()
            case Tick():
                self._on_tick()
            case SolveFinished():
                self._stalls.changed()
                self._optimizer.on_solved(event)
                self._reevaluate()
            case _:  # pragma: no cover - exhaustive
                raise LocalProtocolError(f"unknown event {event!r}")
        return self._table.take_actions()

    def next_deadline(self) -> float:
        """When to deliver a ``Tick`` if no other event comes first (``inf``: never)."""
        return min(
            self._rounds.deadline(), self._optimizer.deadline(), self._table.deadline(),
            self._stalls.deadline(), self._recovery.deadline(), self._pending_deadline(),
        )

    def _pending_deadline(self) -> float:
        """When a held pending-peers answer is due (never while members come back: no
        vote is decided then)."""
        return math.inf if self._recovery.holding else self._pending.deadline()

    def status(self, now: float | None = None) -> StatusReply:
        """The run at ``now`` (default: the last event's time), read-only (``status``:
        the observers' snapshot)."""
        table = self._table
        now = table.now if now is None else max(now, table.now)
        accepted: dict[int, list[int]] = {}
        for peer in table.accepted():
            accepted.setdefault(peer.peer_group, []).append(peer.peer_id)
        groups = []
        for group, members in sorted(accepted.items()):
            ring, predicted = self._optimizer.ring(group)
            revision = self._syncs.expected(group)
            groups.append(GroupStatus(
                group=group, world=len(members), ring=ring,
                stale=group in self._book.stale_groups,
                predicted_seconds=predicted if math.isfinite(predicted) else -1.0,
                has_revision=revision is not None, revision=revision or 0,
            ))
        peers = [
            PeerStatus(
                peer_id=p.peer_id, group=p.peer_group, host=p.host, port=p.port,
                phase=p.phase.name.lower(), state=p.state.name.lower(),
                silent_seconds=max(0.0, now - table.conns[p.conn].last_heard),
                identity=fingerprint(p.identity) if p.identity else "",
            )
            for p in list(table.peers.values())[:MAX_PEERS]
        ]
        waiting = [
            WaitStatus(
                call=w.call, where=w.where, seconds=max(0.0, now - w.since),
                missing=tuple(p.peer_id for p in w.missing()),
            )
            for w in self._stalls.waiting()
        ]
        kicks = [
            dataclasses.replace(kick, seconds_ago=max(0.0, now - kick.seconds_ago))
            for kick in table.kicks
        ]
        tallies = collections.Counter((p.peer_group, p.phase.name.lower()) for p in table.peers.values())
        return fit(StatusReply(
            uptime_seconds=0.0 if math.isnan(table.started) else now - table.started,
            reference_bytes=self._optimizer.reference_bytes,
            peers_total=len(table.peers),
            tallies=tuple(
                PeerTally(group=group, phase=phase, count=count)
                for (group, phase), count in sorted(tallies.items())
            ),
            peers=tuple(peers), groups=tuple(groups), waiting=tuple(waiting),
            collectives=tuple(self._collectives.running()[:MAX_COLLECTIVES]),
            kicks=tuple(kicks),
            counts=tuple(
                RunCount(event=event, label=label, count=count, total=total)
                for (event, label), (count, total) in sorted(table.counts.items())
            ),
        ))

    def peers(self) -> list[PeerView]:
        """Every registered peer, by id."""
        return self._table.views()

    def ring(self, peer_group: int) -> list[int]:
        """The ring order last installed for ``peer_group`` (may name departed peers
        until the next round rebuilds it)."""
        return list(self._book.rings.get(peer_group, ()))

    @property
    def round_in_progress(self) -> bool:
        """Whether an establishment round runs."""
        return self._rounds.running

    @property
    def optimization_in_progress(self) -> bool:
        """Whether a topology optimization runs (until its round starts)."""
        return self._optimizer.running

    def topology(self, peer_group: int) -> TopologyView:
        """The links measured among ``peer_group``'s accepted peers and its ring."""
        return self._optimizer.topology(peer_group)

    # --- messages ------------------------------------------------------------------

    def _on_message(self, conn: Conn, message: Message) -> None:
        """Route a message to its part; kick the peer if the message is illegal."""
        if message.DIRECTION != C2M:
            self._table.kick(
                conn, f"{type(message).__name__} is not a message a peer may send",
                KickCause.PROTOCOL,
            )
            return
        peer = conn.peer
        if peer is None:
            if isinstance(message, StatusRequest):
                # An observer: one snapshot, then the connection ends.
                refusal = self._table.observer_refusal(conn)
                if refusal:  # told why, but no kick of the run: it was never a peer
                    self._table.actions.append(Send(conn=conn.conn, message=Kick(reason=refusal)))
                    self._table.drop(conn, refusal)
                    return
                self._table.actions.append(Send(conn=conn.conn, message=self.status()))
                self._table.drop(conn, "status sent")
            elif isinstance(message, Register) and message.rejoin:
                self._recovery.on_register(conn, message)
            elif isinstance(message, Register):
                self._table.register(conn, message)
            else:
                self._table.kick(conn, f"{type(message).__name__} before Register", KickCause.PROTOCOL)
            return
        handler = self._routes.get(type(message))
        if handler is None:  # pragma: no cover - every C2M kind has a route
            raise LocalProtocolError(f"unhandled message {message!r}")
        try:
            handler(peer, message)
        except RemoteProtocolError as exc:
            self._table.kick(conn, f"illegal {type(message).__name__}: {exc}", KickCause.PROTOCOL)

    # --- time ----------------------------------------------------------------------

    def _on_tick(self) -> None:
        """Kick who fell silent or is late, re-check if anyone was, refuse the stalled
        votes, send heartbeats."""
        # Each part compares against the very sums its deadline() returns: ``now - last
        # >= timeout`` can be false at ``now == last + timeout`` in floating point, and a
        # Tick at the deadline that does nothing would leave the deadline in the past (a
        # busy loop).
        silent = self._table.kick_silent()
        late_round = self._rounds.kick_late()
        late_measurement = self._optimizer.kick_late()
        recovered = self._recovery.kick_late()  # groups whose members did not all come back
        if silent or late_round or late_measurement or recovered:
            self._stalls.changed()
            self._reevaluate()
        if self._stalls.check():
            self._reevaluate()
        if self._pending_deadline() <= self._table.now:
            self._reevaluate()  # a held pending-peers answer is due
        self._table.send_heartbeats()

    def _continue_above(self, number: int) -> None:
        """Hand out only rounds, attempts, syncs and optimizations numbered above
        ``number`` from now on (a returning member saw numbers up to it)."""
        for part in (self._rounds, self._collectives, self._syncs, self._optimizer):
            part.continue_above(number)

    # --- consensus -----------------------------------------------------------------

    def _reevaluate(self) -> None:
        """Check every consensus that may have become complete, in the one order (see
        the module docstring)."""
        if self._recovery.holding:
            return  # members still coming back would be left out
        while True:
            self._rounds.advance()
            self._pending.advance()
            self._collectives.advance()
            before = len(self._table.peers)
            if self._optimizer.advance(round_running=self._rounds.running):
                self._rounds.start(accept_new=False)  # installs the optimized rings
            self._syncs.advance()
            # An election or a round may kick peers, which can complete any other
            # consensus (a round or a pending vote waiting for them): check again.
            if len(self._table.peers) == before:
                break

    # --- removal -------------------------------------------------------------------

    def _peer_left(self, peer: Peer, reason: str) -> None:
        """Every part forgets ``peer``, which the registry removed, in the one order (see
        the module docstring); pending consensus is re-checked by the caller."""
        self._rounds.peer_left(peer)  # the round fails; the group's ring is stale
        self._optimizer.peer_left(peer)  # CancelSolve for a search or a last solve
        self._collectives.peer_left(peer, reason)  # CollectiveAbort to the others
        self._book.forget_edges(peer.peer_id)
        self._syncs.peer_left(peer)
        self._recovery.peer_left(peer.peer_id, peer.peer_group)
