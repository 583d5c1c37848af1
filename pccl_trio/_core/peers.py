"""The peers: their states and transitions, the calls they block, and the registry.

Theory of operation
-------------------
Each registered peer has a *phase* (REGISTERED until a round admits it, then
ACCEPTED) and a *state*. All state changes go through ``TRANSITIONS``, one table: an
event a peer caused that the table does not allow gets that peer kicked with the
reason (``RemoteProtocolError``); an event the master caused that the table does not
allow is a bug here (``LocalProtocolError``). One state enum serves rounds, syncs and
optimizations alike, so the whole machine is one table; each part of the master only
*reads* the states of the others, and only through the rules below.

A peer in a *vote state* (VOTE_ESTABLISH, VOTE_SYNC, VOTE_OPTIMIZE) waits for the
rest of its vote and makes no other call meanwhile. Peers waiting for it in another
call would wait forever, so ``BLOCKED_BY`` says, for each call, which votes block it
and where they are looked for, and ``find_blocker`` names the peer; the part running
that call then ends it with an error rather than deadlock. Calls that change no state
(an all-reduce, ``are_peers_pending``) may be made in ``FREE_STATES`` only.

:class:`PeerTable` is the registry of connections and peers and the master's one
outbox: every part appends its actions here, in the order it decides them, so the
shell carries them out in that order. It registers peers (``Welcome``), tracks
liveness (a connection silent for ``liveness_timeout`` is kicked; quiet links get a
heartbeat every ``heartbeat_interval``) and removes peers: every removal (close,
break, kick, silence) goes through :meth:`PeerTable.drop`, which tells the master
(``on_leave``), so that every part forgets the peer and no survivor waits for it.

It is also where the parts report what happens to the run (``report``, see
``report``): each run event is logged once, kept for the shell until the next event,
and counted by kind and label, with the latest kicks, for the run's status.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import LocalProtocolError, RemoteProtocolError
from .events import Action, Close, Send
from .identity import fingerprint
from .messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Kick,
    Message,
    PeerEndpoint,
    Register,
    Welcome,
    bounded,
)
from .report import KickCause, RunEvent, RunKind
from .shared_state import Ballot
from .status import MAX_KICKS, KickStatus

__all__ = [
    "BLOCKED_BY",
    "FREE_STATES",
    "REMOTE_EVENTS",
    "TRANSITIONS",
    "VOTES",
    "Vote",
    "Call",
    "Conn",
    "Peer",
    "PeerEvent",
    "PeerPhase",
    "PeerState",
    "PeerTable",
    "PeerView",
    "Scope",
    "check_member_vote",
    "find_blocker",
    "groups",
    "out_of_order",
    "pending_calls",
    "transition",
    "votes_blocking",
]


# --- states and transitions --------------------------------------------------------


class PeerPhase(enum.Enum):
    """Whether a peer is a member of the run yet."""

    REGISTERED = enum.auto()  # connected, waiting to be admitted by a round
    ACCEPTED = enum.auto()  # a member of the run


class PeerState(enum.Enum):
    """What a peer is doing, as far as the master's votes and rounds are concerned."""

    IDLE = enum.auto()
    VOTE_ESTABLISH = enum.auto()  # voted to (re-)establish the ring
    CONNECTING = enum.auto()  # in a round, connecting to its neighbours
    WAITING = enum.auto()  # in a round, connected; waiting for the others
    CONNECT_FAILED = enum.auto()  # its last round failed; must vote again
    VOTE_SYNC = enum.auto()  # voted to synchronize the shared state
    SYNCING = enum.auto()  # fetching (or serving) the shared state
    SYNC_DONE = enum.auto()  # done with its part; waiting for the group
    VOTE_OPTIMIZE = enum.auto()  # voted to optimize the topology
    OPTIMIZING = enum.auto()  # measuring links, then waiting for the new ring


class PeerEvent(enum.Enum):
    """What changes a peer's state."""

    # caused by the peer
    VOTE_ESTABLISH = enum.auto()
    REPORT_CONNECTED = enum.auto()
    REPORT_FAILED = enum.auto()
    VOTE_SYNC = enum.auto()
    REPORT_SYNCED = enum.auto()
    VOTE_OPTIMIZE = enum.auto()
    # caused by the master
    ROUND_START = enum.auto()
    ROUND_SUCCEEDED = enum.auto()
    ROUND_FAILED = enum.auto()
    ESTABLISH_REFUSED = enum.auto()  # the other members did not vote in time (stalls)
    SYNC_START = enum.auto()
    SYNC_REFUSED = enum.auto()
    SYNC_COMPLETE = enum.auto()
    SYNC_OVER = enum.auto()  # planned with nothing for anyone to fetch: over at once
    OPTIMIZE_START = enum.auto()
    OPTIMIZE_REFUSED = enum.auto()


#: The events a peer causes: one its state does not allow is the peer's fault.
REMOTE_EVENTS = frozenset(
    {
        PeerEvent.VOTE_ESTABLISH, PeerEvent.REPORT_CONNECTED, PeerEvent.REPORT_FAILED,
        PeerEvent.VOTE_SYNC, PeerEvent.REPORT_SYNCED, PeerEvent.VOTE_OPTIMIZE,
    }
)

#: Every legal state change, in one place.
TRANSITIONS: Mapping[tuple[PeerState, PeerEvent], PeerState] = {
    (PeerState.IDLE, PeerEvent.VOTE_ESTABLISH): PeerState.VOTE_ESTABLISH,
    (PeerState.CONNECT_FAILED, PeerEvent.VOTE_ESTABLISH): PeerState.VOTE_ESTABLISH,
    (PeerState.IDLE, PeerEvent.ROUND_START): PeerState.CONNECTING,  # a joiner
    (PeerState.VOTE_ESTABLISH, PeerEvent.ROUND_START): PeerState.CONNECTING,
    (PeerState.CONNECTING, PeerEvent.REPORT_CONNECTED): PeerState.WAITING,
    (PeerState.CONNECTING, PeerEvent.REPORT_FAILED): PeerState.CONNECT_FAILED,
    (PeerState.WAITING, PeerEvent.ROUND_SUCCEEDED): PeerState.IDLE,
    (PeerState.WAITING, PeerEvent.ROUND_FAILED): PeerState.CONNECT_FAILED,
    (PeerState.CONNECT_FAILED, PeerEvent.ROUND_FAILED): PeerState.CONNECT_FAILED,
    (PeerState.VOTE_ESTABLISH, PeerEvent.ESTABLISH_REFUSED): PeerState.IDLE,
    (PeerState.IDLE, PeerEvent.VOTE_SYNC): PeerState.VOTE_SYNC,
    (PeerState.VOTE_SYNC, PeerEvent.SYNC_START): PeerState.SYNCING,
    (PeerState.VOTE_SYNC, PeerEvent.SYNC_REFUSED): PeerState.IDLE,
    (PeerState.VOTE_SYNC, PeerEvent.SYNC_OVER): PeerState.IDLE,
    (PeerState.SYNCING, PeerEvent.REPORT_SYNCED): PeerState.SYNC_DONE,
    (PeerState.SYNC_DONE, PeerEvent.SYNC_COMPLETE): PeerState.IDLE,
    (PeerState.IDLE, PeerEvent.VOTE_OPTIMIZE): PeerState.VOTE_OPTIMIZE,
    (PeerState.VOTE_OPTIMIZE, PeerEvent.OPTIMIZE_START): PeerState.OPTIMIZING,
    (PeerState.VOTE_OPTIMIZE, PeerEvent.OPTIMIZE_REFUSED): PeerState.IDLE,
    # The optimization ends with a round that installs the new ring.
    (PeerState.OPTIMIZING, PeerEvent.ROUND_START): PeerState.CONNECTING,
}


def transition(state: PeerState, event: PeerEvent) -> PeerState:
    """The state after ``event``.

    Raises:
        RemoteProtocolError: the peer caused an event its state does not allow.
        LocalProtocolError: the master did (a bug).
    """
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        error = RemoteProtocolError if event in REMOTE_EVENTS else LocalProtocolError
        raise error(
            f"{event.name.lower().replace('_', ' ')} is not allowed in state {state.name}"
        ) from None


# --- calls and what blocks them ------------------------------------------------------


class Call(enum.Enum):
    """A call the peers make together through the master; the value is its name in
    the peer's API, as error messages spell it."""

    UPDATE_TOPOLOGY = "update_topology"
    SYNC_SHARED_STATE = "sync_shared_state"
    OPTIMIZE_TOPOLOGY = "optimize_topology"
    ALL_REDUCE = "all_reduce"
    ARE_PEERS_PENDING = "are_peers_pending"


class Scope(enum.Enum):
    """Where a call looks for the peers that block it."""

    GROUP = enum.auto()  # the accepted peers of the caller's peer group
    RUN = enum.auto()  # every accepted peer: rounds and optimizations span all groups


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Vote:
    """What a peer waiting in a vote state is doing, for error messages."""

    call: Call  # the call it made
    purpose: str  # what it voted to do


#: The vote states. A peer waiting in one makes no other call until the vote ends.
VOTES: Mapping[PeerState, Vote] = {
    PeerState.VOTE_ESTABLISH: Vote(call=Call.UPDATE_TOPOLOGY, purpose="re-establish the ring"),
    PeerState.VOTE_SYNC: Vote(call=Call.SYNC_SHARED_STATE, purpose="synchronize the shared state"),
    PeerState.VOTE_OPTIMIZE: Vote(call=Call.OPTIMIZE_TOPOLOGY, purpose="optimize the topology"),
}

_ESTABLISH, _SYNC, _OPTIMIZE = PeerState.VOTE_ESTABLISH, PeerState.VOTE_SYNC, PeerState.VOTE_OPTIMIZE

#: Which votes block which call, and where they are looked for. A peer waiting in a
#: vote will never make the call, so the peers that did would wait for it forever: the
#: master ends their call with an error naming the blocker instead. A call's rules are
#: tried in order, and within one the accepted peers in registration order; the first
#: peer found is the blocker. Nothing blocks update_topology: the other calls give way.
BLOCKED_BY: Mapping[Call, tuple[tuple[Scope, frozenset[PeerState]], ...]] = {
    Call.ALL_REDUCE: ((Scope.GROUP, frozenset({_ESTABLISH, _SYNC, _OPTIMIZE})),),
    Call.ARE_PEERS_PENDING: (
        (Scope.RUN, frozenset({_ESTABLISH, _OPTIMIZE})),
        (Scope.GROUP, frozenset({_SYNC})),
    ),
    Call.SYNC_SHARED_STATE: ((Scope.GROUP, frozenset({_ESTABLISH, _OPTIMIZE})),),
    Call.OPTIMIZE_TOPOLOGY: ((Scope.RUN, frozenset({_ESTABLISH})),),
}

#: States in which a peer may make a call that changes no state (all_reduce,
#: are_peers_pending): in no vote and no round. A failed round (CONNECT_FAILED) leaves
#: the ring stale; an all-reduce then ends at once with an ABORTED verdict.
FREE_STATES = frozenset({PeerState.IDLE, PeerState.CONNECT_FAILED})


def find_blocker(call: Call, group: int, accepted: Iterable[Peer]) -> Peer | None:
    """The peer whose vote blocks ``call`` for peer group ``group`` (``BLOCKED_BY``).

    Args:
        call: the call the waiting peers made.
        group: their peer group.
        accepted: the accepted peers, in registration order.
    """
    peers = list(accepted)
    for scope, states in BLOCKED_BY[call]:
        for peer in peers:
            if peer.state in states and (scope is Scope.RUN or peer.peer_group == group):
                return peer
    return None


def votes_blocking(call: Call) -> frozenset[Call]:
    """The calls whose votes block ``call`` somewhere (``BLOCKED_BY``, any scope), for
    a peer that would make ``call`` while it waits in one of its own votes: the master
    would end ``call`` with an error naming that peer, so the peer refuses it first."""
    return frozenset(
        VOTES[state].call for _scope, states in BLOCKED_BY.get(call, ()) for state in states
    )


def out_of_order(blocker: Peer, call: Call) -> str:
    """The error for the peers whose ``call`` the vote of ``blocker`` blocks."""
    return (
        f"peer {blocker.peer_id} called {VOTES[blocker.state].call.value} while this peer "
        f"called {call.value}; every peer must make the same calls in the same order"
    )


# --- bookkeeping -------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class Peer:
    """A registered peer. The fields after ``state`` belong to one part each."""

    peer_id: int
    conn: int
    peer_group: int
    host: str
    port: int
    pool_size: int = 1  # connections it opens to its successor
    identity: bytes = b""  # the node identity it proved (empty: none)
    phase: PeerPhase = PeerPhase.REGISTERED
    state: PeerState = PeerState.IDLE
    accept_new_peers: bool = False  # its VoteEstablish asked to admit waiting peers
    pending_vote: bool = False  # it asked whether peers are pending; not answered yet
    tags_in_flight: set[int] = dataclasses.field(default_factory=set)  # collectives
    ballot: Ballot | None = None  # its shared-state vote, while VOTE_SYNC
    # When it entered its vote state (a joiner: when it registered, its registration
    # being its vote), and when it asked whether peers are pending (the stall timer of
    # a waiting vote starts at its first voter's, see ``stalls``).
    voted_at: float = 0.0
    pending_since: float = 0.0
    # How long its pending-peers question may wait for a peer to arrive.
    pending_wait: float = 0.0

    def apply(self, event: PeerEvent) -> None:
        """Change the state by ``event`` (see ``transition``)."""
        self.state = transition(self.state, event)


@dataclasses.dataclass(kw_only=True, slots=True)
class Conn:
    """A connection, from ``ConnectionOpened`` to its removal; ``peer`` once registered."""

    conn: int
    host: str
    last_heard: float
    last_sent: float
    identity: bytes = b""
    peer: Peer | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerView:
    """A read-only snapshot of one peer, for tests, logs and tools."""

    peer_id: int
    peer_group: int
    host: str
    port: int
    phase: PeerPhase
    state: PeerState


#: What a peer in each state is busy with, as ``pending_calls`` names it.
_STATE_CALLS: Mapping[PeerState, str] = {
    PeerState.VOTE_ESTABLISH: Call.UPDATE_TOPOLOGY.value,
    PeerState.CONNECTING: "an establishment round",
    PeerState.WAITING: "an establishment round",
    PeerState.VOTE_SYNC: Call.SYNC_SHARED_STATE.value,
    PeerState.SYNCING: Call.SYNC_SHARED_STATE.value,
    PeerState.SYNC_DONE: Call.SYNC_SHARED_STATE.value,
    PeerState.VOTE_OPTIMIZE: Call.OPTIMIZE_TOPOLOGY.value,
    PeerState.OPTIMIZING: Call.OPTIMIZE_TOPOLOGY.value,
}

#: Tags ``pending_calls`` lists one by one before it only counts the rest.
_TAGS_LISTED = 3


def pending_calls(peer: Peer) -> str:
    """What ``peer`` waits in, as far as the master knows, for error messages: e.g.
    ``"peer 2 waits in all_reduce(tag=1)"``, ``"peer 3 waits in are_peers_pending"``,
    ``"peer 5 is in no call"``."""
    calls: list[str] = []
    if peer.phase is PeerPhase.REGISTERED:
        calls.append("connect (waiting to be admitted)")
    elif peer.state in _STATE_CALLS:
        calls.append(_STATE_CALLS[peer.state])
    if peer.pending_vote:
        calls.append(Call.ARE_PEERS_PENDING.value)
    tags = sorted(peer.tags_in_flight)
    calls.extend(f"{Call.ALL_REDUCE.value}(tag={tag})" for tag in tags[:_TAGS_LISTED])
    if len(tags) > _TAGS_LISTED:
        calls.append(f"{len(tags) - _TAGS_LISTED} more all-reduces")
    if not calls:
        return f"peer {peer.peer_id} is in no call"
    return f"peer {peer.peer_id} waits in {', '.join(calls)}"


def check_member_vote(peer: Peer, vote: Message) -> None:
    """A vote that changes the peer's state: only from a member with no collective in
    flight (it would stall the collective's other peers)."""
    name = type(vote).__name__
    if peer.phase is not PeerPhase.ACCEPTED:
        raise RemoteProtocolError(f"{name} before being accepted into the run")
    if peer.tags_in_flight:
        raise RemoteProtocolError(
            f"{name} with collectives in flight (tags {sorted(peer.tags_in_flight)})"
        )


def groups(peers: Iterable[Peer]) -> dict[int, list[int]]:
    """Peer ids by group, sorted."""
    found: dict[int, list[int]] = {}
    for peer in peers:
        found.setdefault(peer.peer_group, []).append(peer.peer_id)
    return {group: sorted(ids) for group, ids in found.items()}


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


# --- the registry ------------------------------------------------------------------


class PeerTable:
    """The connections and peers, the current time and the one outbox of actions.

    Args:
        heartbeat_interval: seconds between heartbeats on quiet links.
        liveness_timeout: a connection silent this long is kicked.
        on_leave: called with each peer removed (and why), after the registry forgot it.
        allowed_identities: the node identities that may register (None: any).
        content_digest: whether ``Welcome`` tells peers to vote content digests.
        first_peer_id: the id the first peer to register gets.
    """

    def __init__(
        self,
        *,
        heartbeat_interval: float,
        liveness_timeout: float,
        on_leave: Callable[[Peer, str], None],
        allowed_identities: frozenset[bytes] | None = None,
        content_digest: bool = False,
        first_peer_id: int = 1,
    ) -> None:
        if not 0 < first_peer_id < 1 << 47:
            raise ValueError(f"first_peer_id must be in [1, 2**47), got {first_peer_id}")
        self._allowed = allowed_identities
        self._content_digest = content_digest
        self._heartbeat_interval = heartbeat_interval
        self._liveness_timeout = liveness_timeout
        self._on_leave = on_leave
        self.conns: dict[int, Conn] = {}
        self.peers: dict[int, Peer] = {}  # by id, in registration order
        self._next_peer_id = first_peer_id
        # Every id this master gave out or took back (a rejoined member's): none of them
        # can be claimed by a member coming back after a restart (``recovery``).
        self.known_ids: set[int] = set()
        self.now = -math.inf
        self.actions: list[Action] = []
        self.reports: list[RunEvent] = []
        # Every report ever made, counted by kind and label, and the latest kicks
        # (``status``).
        self.counts: dict[tuple[str, str], tuple[int, int]] = {}
        self.kicks: collections.deque[KickStatus] = collections.deque(maxlen=MAX_KICKS)
        self.started = math.nan  # the time of the first event

    # --- time and the outbox ---------------------------------------------------------

    def begin(self, now: float) -> None:
        """Start handling an event at ``now`` (the clock never goes back)."""
        self.now = max(self.now, now)
        if math.isnan(self.started):
            self.started = self.now
        self.actions = []
        self.reports = []

    def take_actions(self) -> list[Action]:
        """The actions since ``begin``, in order."""
        actions, self.actions = self.actions, []
        return actions

    def take_reports(self) -> list[RunEvent]:
        """What happened in the run since ``begin``, in order (``report``)."""
        reports, self.reports = self.reports, []
        return reports

    def report(self, kind: RunKind, text: str, *, level: int = logging.INFO, **fields: Any) -> None:
        """Record and log one run event (see ``report``)."""
        event = RunEvent(kind=kind, text=text, level=level, fields=fields)
        event.emit()
        self.reports.append(event)
        label = fields.get("outcome", fields.get("cause", fields.get("call", "")))
        key = (kind.value, str(label.value if isinstance(label, enum.Enum) else label))
        count, total = self.counts.get(key, (0, 0))
        amount = fields.get("planned_bytes", fields.get("attempts", 0))  # what a sum counts
        self.counts[key] = (count + 1, total + int(amount))
        if kind is RunKind.KICKED:
            self.kicks.append(KickStatus(
                peer_id=fields.get("peer") or 0, cause=key[1], reason=fields.get("reason", ""),
                seconds_ago=self.now,  # the time of the kick, until ``status`` ages it
            ))

    def send(self, peer: Peer, message: Message) -> None:
        """Queue ``message`` to ``peer`` (which makes its link no longer quiet)."""
        conn = self.conns[peer.conn]
        conn.last_sent = self.now
        self.actions.append(Send(conn=conn.conn, message=message))

    # --- connections and registration ------------------------------------------------

    def open(self, conn_id: int, host: str, identity: bytes = b"") -> None:
        """A new connection, heard from now, whose handshake proved ``identity``."""
        if conn_id in self.conns:
            raise LocalProtocolError(f"connection {conn_id} opened twice")
        self.conns[conn_id] = Conn(
            conn=conn_id, host=host, last_heard=self.now, last_sent=self.now, identity=identity
        )

    def refusal(self, conn: Conn, message: Register) -> str:
        """Why ``conn`` may not register with ``message`` at all (empty: it may)."""
        if message.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version {message.protocol_version} is not supported; this master "
                f"speaks version {PROTOCOL_VERSION}: run the same pccl_trio version everywhere"
            )
        refusal = self._identity_refusal(conn.identity)
        if refusal:
            return refusal
        host = message.advertised_host or conn.host
        others = list(self.peers.values())
        if others and _is_loopback(host) != _is_loopback(others[0].host):
            return (
                f"address {host} mixes loopback and non-loopback peers (peer "
                f"{others[0].peer_id} is at {others[0].host}); peers could not reach each "
                "other: start the master and peers on real interfaces, or all on loopback"
            )
        return ""

    def register(self, conn: Conn, message: Register) -> None:
        """Admit a new peer to the registry (REGISTERED, IDLE) under the next id and
        welcome it, or kick the connection if it cannot take part."""
        refusal = self.refusal(conn, message)
        if refusal:
            self.kick(conn, refusal, KickCause.REFUSED)
            return
        self.admit(conn, message, self._next_peer_id, PeerPhase.REGISTERED)

    def admit(self, conn: Conn, message: Register, peer_id: int, phase: PeerPhase) -> Peer:
        """Enter the peer ``message`` describes into the registry as ``peer_id`` in
        ``phase`` and welcome it (the caller checked ``refusal`` and the id)."""
        host = message.advertised_host or conn.host
        peer = Peer(
            peer_id=peer_id,
            conn=conn.conn,
            peer_group=message.peer_group,
            host=host,
            port=message.p2p_port,
            pool_size=message.pool_size,
            identity=conn.identity,
            phase=phase,
            voted_at=self.now,
        )
        self.reserve_ids(peer_id)
        self.known_ids.add(peer_id)
        conn.peer = peer
        self.peers[peer.peer_id] = peer
        joined = phase is PeerPhase.REGISTERED
        self.report(
            RunKind.JOINED if joined else RunKind.RETURNED,
            f"peer {peer.peer_id} {'registered' if joined else 'came back'} from {host} "
            f"(group {peer.peer_group}, p2p port {peer.port}, identity "
            f"{fingerprint(peer.identity)})",
            peer=peer.peer_id, group=peer.peer_group, host=host, port=peer.port,
            identity=fingerprint(peer.identity),
        )
        self.send(
            peer,
            Welcome(
                peer_id=peer.peer_id,
                heartbeat_interval=self._heartbeat_interval,
                liveness_timeout=self._liveness_timeout,
                content_digest=self._content_digest,
            ),
        )
        return peer

    def reserve_ids(self, highest: int) -> None:
        """Ids up to ``highest`` are taken: new peers get higher ones."""
        self._next_peer_id = max(self._next_peer_id, highest + 1)

    def observer_refusal(self, conn: Conn) -> str:
        """Why a connection may not see the run's status (empty: it may): an observer
        passes the same identity check as a peer."""
        return self._identity_refusal(conn.identity)

    def _identity_refusal(self, identity: bytes) -> str:
        """Why a connection that proved ``identity`` may not register (empty: it may)."""
        if self._allowed is None or identity in self._allowed:
            return ""
        if not identity:
            return (
                "this master admits only listed node identities and this peer proved none: "
                "start it with Config(identity=PATH) and add the key `pccl-trio identity "
                "PATH` prints to the master's --allow-identities file"
            )
        return (
            f"node identity {identity.hex()} is not in this master's allowlist "
            "(--allow-identities)"
        )

    # --- queries ---------------------------------------------------------------------

    def accepted(self) -> list[Peer]:
        """The members of the run, in registration order."""
        return [p for p in self.peers.values() if p.phase is PeerPhase.ACCEPTED]

    def anyone_waiting(self) -> bool:
        """Whether some peer waits to be admitted by a round."""
        return any(p.phase is PeerPhase.REGISTERED for p in self.peers.values())

    def endpoint(self, peer_id: int) -> PeerEndpoint:
        """Where peer ``peer_id`` accepts p2p connections."""
        peer = self.peers[peer_id]
        return PeerEndpoint(
            peer_id=peer_id, host=peer.host, port=peer.port, pool_size=peer.pool_size,
            identity=peer.identity,
        )

    def views(self) -> list[PeerView]:
        """Every registered peer, by id."""
        return [
            PeerView(
                peer_id=p.peer_id,
                peer_group=p.peer_group,
                host=p.host,
                port=p.port,
                phase=p.phase,
                state=p.state,
            )
            for p in sorted(self.peers.values(), key=lambda p: p.peer_id)
        ]

    # --- removal ---------------------------------------------------------------------

    def kick(self, conn: Conn, reason: str, cause: KickCause) -> None:
        """Tell the peer why, close its connection, and remove it from the run."""
        reason = bounded(reason)
        peer = conn.peer
        self.report(
            RunKind.KICKED,
            f"kicking {f'peer {peer.peer_id}' if peer else f'connection {conn.conn}'} "
            f"from {conn.host}: {reason}",
            level=logging.WARNING, peer=peer.peer_id if peer else None,
            group=peer.peer_group if peer else None, cause=cause, reason=reason,
        )
        self.actions.append(Send(conn=conn.conn, message=Kick(reason=reason)))
        self.drop(conn, reason)

    def kick_peer(self, peer: Peer, reason: str, cause: KickCause) -> None:
        """``kick`` the connection of ``peer``."""
        self.kick(self.conns[peer.conn], reason, cause)

    def drop(self, conn: Conn, reason: str) -> None:
        """Forget a connection and its peer, then tell the master (``on_leave``);
        pending consensus is re-checked by the caller."""
        del self.conns[conn.conn]
        self.actions.append(Close(conn=conn.conn, reason=reason))
        peer = conn.peer
        if peer is None:
            return
        del self.peers[peer.peer_id]
        self.report(
            RunKind.LEFT, f"peer {peer.peer_id} left: {reason}",
            peer=peer.peer_id, group=peer.peer_group, reason=reason,
        )
        self._on_leave(peer, reason)

    # --- liveness --------------------------------------------------------------------

    def deadline(self) -> float:
        """When a connection falls silent or a quiet link is due a heartbeat."""
        deadline = math.inf
        for conn in self.conns.values():
            deadline = min(deadline, conn.last_heard + self._liveness_timeout)
            if conn.peer is not None:
                deadline = min(deadline, conn.last_sent + self._heartbeat_interval)
        return deadline

    def kick_silent(self) -> bool:
        """Kick every connection silent for the liveness timeout; whether any was."""
        silent = [
            c for c in self.conns.values()
            if self.now >= c.last_heard + self._liveness_timeout
        ]
        for conn in silent:
            self.kick(
                conn,
                f"no message for {self.now - conn.last_heard:.2f}s "
                f"(liveness timeout {self._liveness_timeout}s)",
                KickCause.LIVENESS,
            )
        return bool(silent)

    def send_heartbeats(self) -> None:
        """A heartbeat on every registered link quiet for the heartbeat interval."""
        for conn in self.conns.values():
            if conn.peer is not None and self.now >= conn.last_sent + self._heartbeat_interval:
                self.send(conn.peer, Heartbeat())
