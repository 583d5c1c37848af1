"""The driver of the seeded discrete-event simulations around one ``MasterCore``.

A ``Simulator`` owns a ``MasterHarness`` (the shell and its checks) and a
``random.Random(seed)``, and runs one step at a time: it lists the options open now
(``options``, each with a weight), draws one (``pick``) and does it (``do``). Every
action the core answers goes to the scenario's model (``deliver``): a ``Close`` to
``on_close``, a ``Kick`` to ``on_kick``, any other message to ``receive``, and
``delivered`` once the batch is through; a ``Solve`` or ``CancelSolve`` only where the
scenario ``optimizes``. Time passes by ``advance``: every talking peer says something,
then a ``Tick`` at each deadline up to the target (each must move the deadline), and a
last one at the target.

A ``ChurnSimulator`` adds well-behaved peers that join, vote, report on their rounds,
ask whether peers are pending, die and fall silent. Each keeps its own model of where the protocol stands
(a ``SimPeer``, from the messages it got, each handed to the handler of its class),
and after every step that model must agree with the master, peer by peer.

The simulations choose each step from what the core answered and from their rng, and
``golden_traces.json`` pins what they fed the core: a change here must keep the order
of every draw from the rng and of every harness call.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from pccl_trio._core.master import Action, CancelSolve, Close, PeerPhase, PeerState, Send, Solve
from pccl_trio._core.messages import Heartbeat, Kick, Message, PeersPendingResult, Welcome

from .master_harness import LIVENESS_TIMEOUT, MasterHarness

#: One thing a simulation may do next: (what, on which connection (0: a new one, or
#: none), weight).
Option = tuple[str, int, float]


class Simulator:
    """One harness, one rng, and the loop that picks steps and delivers what the core
    answered to the scenario's model."""

    #: Whether the scenario optimizes the topology: elsewhere no ring search may start
    #: or stop.
    optimizes: ClassVar[bool] = False

    def __init__(self, seed: int, harness: MasterHarness | None = None) -> None:
        self.rng = random.Random(seed)
        self.h = MasterHarness() if harness is None else harness
        self.stats: Counter[str] = Counter()  # what happened, to show the runs cover it

    def count(self, what: str) -> None:
        self.stats[what] += 1

    # --- the choices -------------------------------------------------------------------

    def options(self) -> list[Option]:
        """Every step possible now."""
        raise NotImplementedError

    def do(self, name: str, conn: int) -> None:
        """Take the step ``name`` (on ``conn``)."""
        raise NotImplementedError

    def pick(self, options: list[Option]) -> Option:
        """One of ``options``, drawn by weight."""
        (option,) = self.rng.choices(options, weights=[weight for *_, weight in options])
        return option

    def random_step(self) -> None:
        name, conn, _weight = self.pick(self.options())
        self.do(name, conn)

    def random_steps(self, count: int) -> None:
        for _ in range(count):
            self.random_step()

    # --- time --------------------------------------------------------------------------

    def talking(self) -> list[int]:
        """The connections that say something whenever time passes."""
        raise NotImplementedError

    def pause(self) -> float:
        """A random while for time to pass."""
        raise NotImplementedError

    def advance(self, seconds: float | None = None) -> None:
        """Every talking peer says something now; then time passes (``seconds``, else a
        ``pause``), deadline by deadline."""
        if seconds is None:
            seconds = self.pause()
        for conn in self.talking():
            self.deliver(self.h.heartbeat(conn))
        target = self.h.now + seconds
        while (deadline := self.h.core.next_deadline()) <= target:
            self.deliver(self.h.tick(deadline))
            assert self.h.core.next_deadline() > deadline, "a Tick at the deadline did nothing"
        self.deliver(self.h.tick(target))

    # --- what the core answered --------------------------------------------------------

    def deliver(self, actions: list[Action]) -> None:
        """Hand ``actions``, in order, to the model."""
        for action in actions:
            match action:
                case Solve() | CancelSolve():
                    assert self.optimizes, f"{action}: nobody here optimizes the topology"
                case Close(conn=conn):
                    self.on_close(conn)
                case Send(conn=conn, message=Kick(reason=reason)):
                    self.on_kick(conn, reason)
                case Send(conn=conn, message=message):
                    self.receive(conn, message)
                case _:  # pragma: no cover
                    raise AssertionError(action)
        self.delivered()

    def on_close(self, conn: int) -> None:
        """The core closed ``conn``."""
        raise NotImplementedError

    def on_kick(self, conn: int, reason: str) -> None:
        """``conn`` was kicked (its ``Close`` follows)."""
        raise NotImplementedError

    def receive(self, conn: int, message: Message) -> None:
        """``conn`` was sent ``message`` (anything but a ``Kick``)."""
        raise NotImplementedError

    def delivered(self) -> None:
        """Every action of one answer is through: check what needs all of them."""


# --- well-behaved peers, each with its own model --------------------------------------

#: The peer's own view of its protocol state -> the master's (phase-free) state.
MASTER_STATE = {
    "waiting": PeerState.IDLE,  # registered, not yet in a round
    "in_round": PeerState.CONNECTING,
    "reported_ok": PeerState.WAITING,
    "reported_failed": PeerState.CONNECT_FAILED,
    "idle": PeerState.IDLE,
    "voted": PeerState.VOTE_ESTABLISH,
    "failed": PeerState.CONNECT_FAILED,  # its last round failed: it must vote again
}


@dataclasses.dataclass
class SimPeer:
    conn: int
    group: int = 0
    peer_id: int = 0
    status: str = "waiting"  # a key of MASTER_STATE
    member: bool = False  # received a round result, so the master has accepted it
    silent: bool = False  # alive but sends nothing any more
    pending_out: bool = False  # asked whether peers are pending; no answer yet

    def enters_round(self) -> None:
        """It got a ``P2PInfo``: it takes part in a round now."""
        assert self.status in ("waiting", "voted"), self
        self.status, self.pending_out = "in_round", False

    def hears_result(self, success: bool) -> None:
        """It got its round's verdict: a member now, idle, or failed (it must vote again)."""
        assert self.status in ("reported_ok", "reported_failed"), self
        self.member = True
        self.status = "idle" if success else "failed"


P = TypeVar("P", bound=SimPeer)


class ChurnSimulator(Simulator, Generic[P]):
    """Peers (``P``, by conn) that join, vote, report on their rounds, ask whether peers
    are pending, die and fall silent; the scenario adds what else they do. They are
    kicked only for silence, for a connection the simulation broke, or for a reason in
    ``KICKS``."""

    #: The other kicks a well-behaved peer may get: kind -> how the reason starts.
    KICKS: ClassVar[dict[str, str]] = {}

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.peers: dict[int, P] = {}  # live peers by conn
        self.lurkers: set[int] = set()  # connections that never register
        self.next_conn = 1
        self.step = 0  # steps taken
        self.breaking = 0  # the connection the simulation is breaking
        self.kicks: Counter[str] = Counter()  # by kind: "silence", "broken", or of KICKS
        #: Message class -> what a peer does with it (``receive``).
        self.handlers: dict[type[Message], Callable[[P, Any], None]] = {
            Welcome: self.on_welcome,
            Heartbeat: self.on_heartbeat,
            PeersPendingResult: self.on_pending_result,
        }

    def new_peer(self, conn: int, group: int) -> P:
        raise NotImplementedError

    def members(self, group: int | None = None) -> list[P]:
        """The live accepted peers (of ``group``, if given)."""
        return [p for p in self.peers.values() if p.member and group in (None, p.group)]

    # --- steps -------------------------------------------------------------------------

    def new_conn(self) -> int:
        conn = self.next_conn
        self.next_conn += 1
        return conn

    def join(self, group: int) -> None:
        """A new peer registers in ``group``."""
        conn = self.new_conn()
        self.peers[conn] = self.new_peer(conn, group)
        self.deliver(self.h.register(conn, group))

    def report(self, peer: P, ok: bool, failed: Sequence[int] = ()) -> None:
        """``peer`` reports on its round: connected, or not (to ``failed``)."""
        peer.status = "reported_ok" if ok else "reported_failed"
        self.deliver(self.h.report(peer.conn, ok=ok, failed=failed))

    def vote(self, peer: P, accept: bool) -> None:
        """``peer`` votes to establish the ring (admitting waiting peers if ``accept``)."""
        peer.status = "voted"
        self.deliver(self.h.vote(peer.conn, accept))

    def ask_pending(self, peer: P) -> None:
        """``peer`` asks whether peers are pending (a vote of every member)."""
        peer.pending_out = True
        self.deliver(self.h.pending(peer.conn))

    def die(self, conn: int) -> None:
        """The peer on ``conn`` is gone: its connection breaks (now and then) or closes."""
        if self.rng.random() < 0.3:
            self.breaking = conn
            self.deliver(self.h.broken(conn))
        else:
            self.deliver(self.h.close(conn))

    def talking(self) -> list[int]:
        return [conn for conn, peer in self.peers.items() if not peer.silent]

    def pause(self) -> float:
        return self.rng.uniform(0.05, 0.6) * LIVENESS_TIMEOUT

    # --- what the master said ----------------------------------------------------------

    def receive(self, conn: int, message: Message) -> None:
        peer = self.peers.get(conn)
        assert peer is not None, f"{message} sent to conn {conn}, which never registered"
        handler = self.handlers.get(type(message))
        assert handler is not None, f"{message}: no peer here expects it"
        handler(peer, message)

    def on_welcome(self, peer: P, welcome: Welcome) -> None:
        peer.peer_id = welcome.peer_id

    def on_heartbeat(self, peer: P, heartbeat: Heartbeat) -> None:
        """The master keeps a quiet link alive: nothing to do."""

    def on_pending_result(self, peer: P, result: PeersPendingResult) -> None:
        assert peer.member and peer.pending_out
        peer.pending_out = False
        if result.error:
            # Refused: some member is blocked in a topology vote, so the pending vote
            # could never complete.
            assert any(p.status == "voted" for p in self.members())
            assert "update_topology" in result.error
            self.count("pending-refused")
        else:
            assert result.pending == any(not p.member for p in self.peers.values())
            self.count(f"pending-{'yes' if result.pending else 'no'}")

    def on_kick(self, conn: int, reason: str) -> None:
        peer = self.peers.get(conn)
        if reason.startswith("no message for"):
            assert conn in self.lurkers or (peer is not None and peer.silent), reason
            kind = "silence"
        elif reason.startswith("malformed input"):
            assert conn == self.breaking, reason
            kind = "broken"
        else:
            kind = next((k for k, start in self.KICKS.items() if reason.startswith(start)), "")
            assert kind, reason
        self.kicks[kind] += 1

    def on_close(self, conn: int) -> None:
        if conn in self.lurkers:
            self.lurkers.discard(conn)
        else:
            self.left(self.peers.pop(conn))

    def left(self, peer: P) -> None:
        """``peer`` is gone (its connection closed)."""

    # --- invariants --------------------------------------------------------------------

    def check(self) -> None:
        """Each peer's own model agrees with the master; the next deadline lies ahead."""
        views = {v.peer_id: v for v in self.h.core.peers()}
        by_id = {p.peer_id: p for p in self.peers.values()}
        assert views.keys() == by_id.keys()
        for peer_id, peer in by_id.items():
            view = views[peer_id]
            assert view.phase is (PeerPhase.ACCEPTED if peer.member else PeerPhase.REGISTERED)
            assert view.state is MASTER_STATE[peer.status], (peer, view)
        assert self.h.core.next_deadline() > self.h.now
