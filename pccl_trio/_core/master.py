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

import logging

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
    CollectiveComplete,
    CollectiveInitiate,
    Heartbeat,
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
        self._collectives = Collectives(self._table, self._book)
        self._syncs = Syncs(self._table)

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
                self._optimizer.on_solved(event)
                self._reevaluate()
            case _:  # pragma: no cover - exhaustive
                raise LocalProtocolError(f"unknown event {event!r}")
        return self._table.take_actions()

    def next_deadline(self) -> float:
        """When to deliver a ``Tick`` if no other event comes first (``inf``: never)."""
        return min(self._rounds.deadline(), self._optimizer.deadline(), self._table.deadline())

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
        return self._optimizer.running

    def topology(self, peer_group: int) -> TopologyView:
        """The links measured among ``peer_group``'s accepted peers and its ring."""
        return self._optimizer.topology(peer_group)

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
                    self._optimizer.on_vote(peer, message)
                case LinkMeasured():
                    self._optimizer.on_link_measured(peer, message)
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
        late_round = self._rounds.kick_late()
        late_measurement = self._optimizer.kick_late()
        if silent or late_round or late_measurement:
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
            if self._optimizer.advance(round_running=self._rounds.running):
                self._rounds.start(accept_new=False)  # installs the optimized rings
            self._syncs.advance()
            # An election may kick peers, which can complete any other consensus (a
            # round or a pending vote waiting for them): check everything again.
            if len(self._table.peers) == before:
                break

    # --- removal -------------------------------------------------------------------

    def _peer_left(self, peer: Peer, reason: str) -> None:
        """Every part forgets ``peer``, which the registry removed; pending consensus is
        re-checked by the caller."""
        self._rounds.peer_left(peer)
        self._optimizer.peer_left(peer)
        self._collectives.peer_left(peer, reason)
        self._book.forget_edges(peer.peer_id)
        self._syncs.peer_left(peer)
