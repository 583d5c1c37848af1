"""A thin driver around ``MasterCore`` that plays the shell: it keeps the clock, delivers
events by connection, and records what each connection was sent.

It also checks, on every action, the promises the core makes to any shell: nothing is
sent on a connection after its ``Close``, nothing is closed twice, and each peer gets at
most one ``P2PInfo`` and one ``P2PEstablishResult`` per round (the result after the info).
For collectives it checks, per connection: a ``CollectiveCommence`` or a seq-0 verdict
only for a tag the peer initiated and that is not running for it; a ``CollectiveAbort``
only for the attempt running there, at most once, and never after the peer completed it;
at most one ``CollectiveVerdict`` per initiate (seq 0 if it never ran, else the attempt's
seq); and commence seqs that only grow.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TypeVar

from pccl_trio._core.master import (
    Action,
    Close,
    ConnectionBroken,
    ConnectionClosed,
    ConnectionOpened,
    Event,
    MasterCore,
    MessageReceived,
    PeerPhase,
    PeerState,
    PeerView,
    Send,
    Tick,
)
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    Heartbeat,
    Kick,
    Message,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    Register,
    VoteEstablish,
    VotePeersPending,
    Welcome,
)

HEARTBEAT_INTERVAL = 1.0
LIVENESS_TIMEOUT = 5.0

#: Descriptor defaults for ``MasterHarness.initiate``: 16 FLOAT values summed, unquantized.
COUNT, FLOAT, SUM = 16, 10, 0

M = TypeVar("M", bound=Message)


class MasterHarness:
    """Drive a ``MasterCore`` by connection id; ``sent[conn]`` is all it was sent."""

    def __init__(
        self,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness_timeout: float = LIVENESS_TIMEOUT,
    ) -> None:
        self.core = MasterCore(
            heartbeat_interval=heartbeat_interval, liveness_timeout=liveness_timeout
        )
        self.now = 0.0
        self.sent: dict[int, list[Message]] = collections.defaultdict(list)
        self._taken: dict[int, int] = collections.defaultdict(int)  # conn -> len(sent) at take
        self.closed: dict[int, str] = {}  # conn -> reason of its Close
        self.peer_ids: dict[int, int] = {}  # conn -> peer id from its Welcome
        self._infos: set[tuple[int, int]] = set()  # (conn, round)
        self._results: set[tuple[int, int]] = set()
        # Collectives, per connection: tags initiated and not yet given a verdict (value:
        # the running attempt's seq, 0 before it commences), and attempts aborted or
        # completed there.
        self.in_flight: dict[int, dict[int, int]] = collections.defaultdict(dict)
        self._aborted: set[tuple[int, int]] = set()  # (conn, seq)
        self._completed: set[tuple[int, int]] = set()  # (conn, seq)
        self.seqs: list[int] = []  # every commenced seq, in order (once per attempt)

    # --- events ------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        actions = self.core.handle(event, self.now)
        for action in actions:
            assert action.conn not in self.closed, f"{action} after conn {action.conn} closed"
            match action:
                case Send(conn=conn, message=message):
                    self._record(conn, message)
                case Close(conn=conn, reason=reason):
                    self.closed[conn] = reason
        return actions

    def _record(self, conn: int, message: Message) -> None:
        self.sent[conn].append(message)
        match message:
            case Welcome(peer_id=peer_id):
                assert conn not in self.peer_ids, f"second Welcome on conn {conn}"
                self.peer_ids[conn] = peer_id
            case P2PInfo(round=number):
                assert (conn, number) not in self._infos, f"two P2PInfo for round {number}"
                self._infos.add((conn, number))
            case P2PEstablishResult(round=number):
                assert (conn, number) in self._infos, f"result of round {number} before its info"
                assert (conn, number) not in self._results, f"two results for round {number}"
                self._results.add((conn, number))
            case CollectiveCommence(tag=tag, seq=seq):
                tags = self.in_flight[conn]
                assert tags.get(tag) == 0, f"commence of tag {tag} on conn {conn}: {tags}"
                tags[tag] = seq
                if not self.seqs or seq > self.seqs[-1]:
                    self.seqs.append(seq)
                else:
                    assert seq == self.seqs[-1], f"seq {seq} after {self.seqs[-1]}"
            case CollectiveAbort(tag=tag, seq=seq):
                assert seq and self.in_flight[conn].get(tag) == seq, f"abort of {tag}/{seq}"
                assert (conn, seq) not in self._aborted, f"two aborts of {seq} on conn {conn}"
                assert (conn, seq) not in self._completed, f"abort of {seq} after its complete"
                self._aborted.add((conn, seq))
            case CollectiveVerdict(tag=tag, seq=seq):
                tags = self.in_flight[conn]
                assert tag in tags, f"verdict for tag {tag}, not in flight on conn {conn}"
                assert tags.pop(tag) == seq, f"verdict {message} for attempt {seq}"

    def open(self, conn: int, host: str = "127.0.0.1") -> list[Action]:
        return self.handle(ConnectionOpened(conn=conn, host=host))

    def send(self, conn: int, message: Message) -> list[Action]:
        match message:
            case CollectiveInitiate(tag=tag) if conn not in self.closed:
                # The first initiate of a tag opens it; a duplicate gets the peer kicked.
                self.in_flight[conn].setdefault(tag, 0)
            case CollectiveComplete(seq=seq):
                self._completed.add((conn, seq))
        return self.handle(MessageReceived(conn=conn, message=message))

    def register(
        self,
        conn: int,
        group: int = 0,
        *,
        host: str = "127.0.0.1",
        advertised_host: str = "",
        port: int | None = None,
        version: int = PROTOCOL_VERSION,
    ) -> list[Action]:
        """Open ``conn`` and register on it (p2p port ``10000 + conn`` unless given)."""
        actions = self.open(conn, host)
        return actions + self.send(
            conn,
            Register(
                protocol_version=version,
                peer_group=group,
                p2p_port=10000 + conn if port is None else port,
                advertised_host=advertised_host,
            ),
        )

    def vote(self, conn: int, accept: bool = True) -> list[Action]:
        return self.send(conn, VoteEstablish(accept_new_peers=accept))

    def report(
        self, conn: int, round: int | None = None, ok: bool = True, failed: Sequence[int] = ()
    ) -> list[Action]:
        """Report on the round of the last ``P2PInfo`` ``conn`` got (or on ``round``)."""
        number = self.last(conn, P2PInfo).round if round is None else round
        return self.send(
            conn, P2PEstablished(round=number, success=ok, failed_peers=tuple(failed))
        )

    def initiate(
        self,
        conn: int,
        tag: int,
        *,
        count: int = COUNT,
        dtype: int = FLOAT,
        op: int = SUM,
        quantized_dtype: int = 0,
        quantization: int = 0,
        distribution_hint: int = 0,
    ) -> list[Action]:
        return self.send(
            conn,
            CollectiveInitiate(
                tag=tag, count=count, dtype=dtype, op=op, quantized_dtype=quantized_dtype,
                quantization=quantization, distribution_hint=distribution_hint,
            ),
        )

    def complete(
        self, conn: int, tag: int, seq: int | None = None, aborted: bool = False,
        invalid: str = "",
    ) -> list[Action]:
        """Complete ``tag`` (by default the attempt ``conn`` was last told to commence)."""
        if seq is None:
            seq = max(m.seq for m in self.received(conn, CollectiveCommence) if m.tag == tag)
        return self.send(
            conn, CollectiveComplete(tag=tag, seq=seq, aborted=aborted, invalid=invalid)
        )

    def pending(self, conn: int) -> list[Action]:
        return self.send(conn, VotePeersPending())

    def heartbeat(self, conn: int) -> list[Action]:
        return self.send(conn, Heartbeat())

    def close(self, conn: int) -> list[Action]:
        return self.handle(ConnectionClosed(conn=conn))

    def broken(self, conn: int, reason: str = "bad frame") -> list[Action]:
        return self.handle(ConnectionBroken(conn=conn, reason=reason))

    def tick(self, now: float | None = None) -> list[Action]:
        """Let time pass to ``now`` (default: ``next_deadline()``) and deliver a Tick."""
        self.now = self.core.next_deadline() if now is None else now
        return self.handle(Tick())

    # --- observations --------------------------------------------------------------------

    def join(self, conn: int, group: int = 0) -> None:
        """Register ``conn`` as the only peer and complete its one-member round."""
        self.register(conn, group)
        self.report(conn)
        assert self.last(conn, P2PEstablishResult).success

    def received(self, conn: int, cls: type[M]) -> list[M]:
        return [m for m in self.sent[conn] if isinstance(m, cls)]

    def last(self, conn: int, cls: type[M]) -> M:
        messages = self.received(conn, cls)
        assert messages, f"conn {conn} got no {cls.__name__}"
        return messages[-1]

    def take(self, conn: int) -> list[Message]:
        """What ``conn`` was sent since the last ``take``."""
        messages = self.sent[conn][self._taken[conn] :]
        self._taken[conn] = len(self.sent[conn])
        return messages

    def take_all(self) -> None:
        for conn in list(self.sent):
            self.take(conn)

    @property
    def latest_round(self) -> int:
        """The number of the latest round any peer was told of (0: none yet)."""
        return max((number for (_conn, number) in self._infos), default=0)

    def kick_reason(self, conn: int) -> str | None:
        kicks = self.received(conn, Kick)
        return kicks[-1].reason if kicks else None

    def view(self, conn: int) -> PeerView | None:
        """The core's view of the peer on ``conn`` (None once it is gone)."""
        peer_id = self.peer_ids.get(conn)
        return next((p for p in self.core.peers() if p.peer_id == peer_id), None)

    def where(self, conn: int) -> tuple[PeerPhase, PeerState] | None:
        view = self.view(conn)
        return None if view is None else (view.phase, view.state)


def only(actions: Sequence[Action], conn: int) -> list[Action]:
    return [a for a in actions if a.conn == conn]


def was_kicked(actions: Sequence[Action], conn: int) -> bool:
    """``actions`` kick ``conn``: a Kick, then a Close, and nothing else for it."""
    mine = only(actions, conn)
    return (
        len(mine) == 2
        and isinstance(mine[0], Send)
        and isinstance(mine[0].message, Kick)
        and isinstance(mine[1], Close)
    )
