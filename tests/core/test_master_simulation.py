"""A seeded discrete-event simulation of many peers around one MasterCore.

Well-behaved peers join, vote, report on their rounds, ask whether peers are pending,
die and go silent in random order, while time advances through the master's deadlines.
Each simulated peer keeps its own model of where the protocol stands (from the messages
it received), and after every step the simulation checks that model and the invariants
against the master:

(a) no stuck consensus: without a round, not every member has voted (and no peer waits
    while there are no members); with a round, someone has yet to report; no pending
    vote is complete and unanswered; the next deadline lies in the future;
(b) every surviving participant of a round gets the same verdict, in one step, and
    within a peer group the same ring: the round's ring less the departed;
(c) world sizes agree with the participants (global, per group, groups, largest);
    rings avoid every edge a peer reported unreachable;
(d), (e) no message after Close, at most one P2PInfo and one result per round per peer
    (checked by the harness on every action);
and well-behaved peers are kicked only for silence or because no ring can hold them.
After the random steps the survivors settle, and one last round must succeed.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pccl_trio._core.master import Action, CancelSolve, Close, PeerPhase, PeerState, Send, Solve
from pccl_trio._core.messages import (
    Kick,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
    Welcome,
    WorldSizes,
)
from pccl_trio._core.ring import ring_edges

from .master_harness import LIVENESS_TIMEOUT, MasterHarness
from .support import DETERMINISTIC

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
    group: int
    peer_id: int = 0
    status: str = "waiting"
    member: bool = False  # received a round result, so the master has accepted it
    silent: bool = False  # alive but sends nothing any more
    accept_new: bool = True  # its latest VoteEstablish
    pending_out: bool = False  # asked whether peers are pending; no answer yet
    neighbours: tuple[int, ...] = ()


@dataclasses.dataclass
class RoundRecord:
    number: int
    step: int  # the step in which it started
    participants: dict[int, int]  # peer id -> group
    rings: dict[int, tuple[int, ...]]  # group -> ring
    accept_new: bool  # whether the votes that started it admit waiting peers
    departed: set[int] = dataclasses.field(default_factory=set)
    failure_reported: bool = False
    results: dict[int, P2PEstablishResult] = dataclasses.field(default_factory=dict)


def check_world(world: WorldSizes, group: int, groups: dict[int, int]) -> None:
    """``groups``: peer id -> group, of every peer the world should count."""
    sizes: dict[int, int] = {}
    for g in groups.values():
        sizes[g] = sizes.get(g, 0) + 1
    assert world == WorldSizes(
        global_world_size=len(groups),
        peer_group_world_size=sizes[group],
        num_distinct_peer_groups=len(sizes),
        largest_peer_group_world_size=max(sizes.values()),
    )


class Simulation:
    def __init__(self, seed: int, *, max_peers: int = 20, groups: int = 3) -> None:
        self.rng = random.Random(seed)
        self.h = MasterHarness()
        self.max_peers = max_peers
        self.groups = groups
        self.peers: dict[int, SimPeer] = {}  # live peers by conn
        self.lurkers: set[int] = set()  # connections that never register
        self.rounds: dict[int, RoundRecord] = {}
        self.finished: set[int] = set()
        self.next_conn = 1
        self.step_count = 0
        self.kicks: dict[str, int] = {}
        self.blocked: set[tuple[int, int]] = set()  # edges reported unreachable
        self.breaking = 0  # the connection the simulation is breaking
        self.pending_answers: set[bool] = set()
        self.pending_refused = 0

    # --- the choices ---------------------------------------------------------------------

    def options(self) -> list[tuple[str, int, float]]:
        """Every action possible now: (name, conn, weight)."""
        found: list[tuple[str, int, float]] = [("advance", 0, 2.0), ("lurk", 0, 0.1)]
        if len(self.peers) < self.max_peers:
            found.append(("join", 0, 3.0))
        # Peers ask whether others are pending together (it is a collective call), so
        # once one asks, the others tend to follow before they vote on anything else.
        polling = any(p.pending_out for p in self.peers.values())
        pending_weight, vote_weight = (4.0, 0.05) if polling else (0.3, 2.0)
        for conn, peer in self.peers.items():
            if peer.silent:
                continue
            if peer.status == "in_round":
                found.append(("report", conn, 3.0))
            if peer.member and peer.status in ("idle", "failed") and not peer.pending_out:
                # A client makes one membership call at a time.
                found.append(("vote", conn, vote_weight))
                if not peer.pending_out:
                    found.append(("pending", conn, pending_weight))
            found += [("die", conn, 0.04), ("silence", conn, 0.015)]
        return found

    def random_step(self) -> None:
        options = self.options()
        (name, conn, _weight), = self.rng.choices(options, weights=[w for *_, w in options])
        self.do(name, conn)

    def do(self, name: str, conn: int) -> None:
        self.step_count += 1
        h, rng = self.h, self.rng
        match name:
            case "join":
                conn = self.next_conn
                self.next_conn += 1
                self.peers[conn] = SimPeer(conn=conn, group=min(rng.randrange(4), self.groups - 1))
                self.deliver(h.register(conn, self.peers[conn].group))
            case "lurk":
                conn = self.next_conn
                self.next_conn += 1
                self.lurkers.add(conn)
                self.deliver(h.open(conn))
            case "report" | "report_ok":
                peer = self.peers[conn]
                ok = name == "report_ok" or rng.random() < 0.95
                failed = [] if ok else [n for n in peer.neighbours if rng.random() < 0.5]
                peer.status = "reported_ok" if ok else "reported_failed"
                if not ok:
                    self.rounds[h.last(conn, P2PInfo).round].failure_reported = True
                    alive = {p.peer_id for p in self.peers.values()}
                    self.blocked |= {(peer.peer_id, n) for n in failed if n in alive}
                self.deliver(h.report(conn, ok=ok, failed=failed))
            case "vote" | "vote_yes":
                peer = self.peers[conn]
                peer.status, peer.accept_new = "voted", name == "vote_yes" or rng.random() < 0.8
                self.deliver(h.vote(conn, peer.accept_new))
            case "pending":
                self.peers[conn].pending_out = True
                self.deliver(h.pending(conn))
            case "die" if rng.random() < 0.3:
                self.breaking = conn
                self.deliver(h.broken(conn))
            case "die":
                self.deliver(h.close(conn))
            case "silence":
                self.peers[conn].silent = True
            case "advance":
                self.advance(rng.uniform(0.05, 0.6) * LIVENESS_TIMEOUT)
            case _:  # pragma: no cover
                raise AssertionError(name)
        self.check()

    def advance(self, seconds: float) -> None:
        """Every talking peer says something now; then time passes, deadline by deadline."""
        for conn, peer in list(self.peers.items()):
            if not peer.silent:
                self.deliver(self.h.heartbeat(conn))
        target = self.h.now + seconds
        while (deadline := self.h.core.next_deadline()) <= target:
            self.deliver(self.h.tick(deadline))
            assert self.h.core.next_deadline() > deadline, "a Tick at the deadline did nothing"
        self.deliver(self.h.tick(target))

    # --- what the master said ----------------------------------------------------------

    def deliver(self, actions: list[Action]) -> None:
        """Let each peer take in its messages, in order, and check every round verdict."""
        verdicts: dict[int, set[int]] = {}  # round -> peer ids expected to hear it
        # Voters a round start removes because no ring fits them: the votes were cast
        # (and decided whether waiting peers join) before the removal.
        unplaceable: list[SimPeer] = []
        for action in actions:
            # Nobody here optimizes the topology, so no ring search may start or stop.
            assert not isinstance(action, Solve | CancelSolve), action
            if isinstance(action, Close):
                self.on_close(action.conn)
                continue
            assert isinstance(action, Send)
            message = action.message
            if isinstance(message, Kick):
                if self.on_kick(action.conn, message.reason) == "no ring":
                    unplaceable.append(self.peers[action.conn])
                continue
            if action.conn in self.lurkers:  # pragma: no cover - would be a bug
                raise AssertionError(f"{message} sent to an unregistered connection")
            peer = self.peers[action.conn]
            match message:
                case Welcome(peer_id=peer_id):
                    peer.peer_id = peer_id
                case P2PInfo(round=number) if number not in self.rounds:
                    voters = [p for p in [*self.peers.values(), *unplaceable] if p.member]
                    self.rounds[number] = RoundRecord(
                        number=number,
                        step=self.step_count,
                        participants={},
                        rings={},
                        accept_new=all(p.accept_new for p in voters),
                    )
                    self.on_info(peer, message)
                case P2PInfo():
                    self.on_info(peer, message)
                case P2PEstablishResult(round=number):
                    record = self.rounds[number]
                    if number not in verdicts:
                        assert number not in self.finished, f"round {number} ended twice"
                        verdicts[number] = set(record.participants) - record.departed
                    self.on_result(peer, message, record)
                case PeersPendingResult(error=error) if error:
                    # Refused: some member is blocked in a topology vote, so the
                    # pending vote could never complete.
                    assert peer.member and peer.pending_out
                    assert any(p.member and p.status == "voted" for p in self.peers.values())
                    assert "update_topology" in error
                    peer.pending_out = False
                    self.pending_refused += 1
                case PeersPendingResult(pending=pending):
                    assert peer.member and peer.pending_out
                    assert pending == any(not p.member for p in self.peers.values())
                    peer.pending_out = False
                    self.pending_answers.add(pending)
        for number, expected in verdicts.items():
            record = self.rounds[number]
            # (b) every surviving participant heard the verdict, in this one step.
            assert set(record.results) == expected
            self.finished.add(number)

    def on_info(self, peer: SimPeer, info: P2PInfo) -> None:
        record = self.rounds[info.round]
        # Every P2PInfo of a round goes out in the step that starts it.
        assert record.step == self.step_count
        assert peer.status in ("waiting", "voted"), peer
        record.participants[peer.peer_id] = peer.group
        ring = record.rings.setdefault(peer.group, info.ring)
        assert info.ring == ring and peer.peer_id in ring
        assert not set(ring_edges(ring)) & self.blocked
        index = ring.index(peer.peer_id)
        expected = list(dict.fromkeys((ring[index - 1], ring[(index + 1) % len(ring)])))
        assert [n.peer_id for n in info.neighbours] == ([] if len(ring) == 1 else expected)
        peer.status, peer.pending_out = "in_round", False
        peer.neighbours = tuple(n.peer_id for n in info.neighbours)

    def check_round_start(self, record: RoundRecord) -> None:
        """A round that started this step: who is in it, rings and world sizes."""
        for peer in self.peers.values():
            joining = not peer.member
            assert (peer.peer_id in record.participants) == (not joining or record.accept_new)
        for group, ring in record.rings.items():
            assert set(ring) == {p for p, g in record.participants.items() if g == group}
        for conn, peer in self.peers.items():
            if peer.peer_id in record.participants:
                info = self.h.last(conn, P2PInfo)
                check_world(info.world, peer.group, record.participants)

    def on_result(self, peer: SimPeer, result: P2PEstablishResult, record: RoundRecord) -> None:
        assert peer.status in ("reported_ok", "reported_failed"), peer
        survivors = {p: g for p, g in record.participants.items() if p not in record.departed}
        # (b) one verdict, one ring per group: the round's ring less the departed.
        assert result.success == (not record.failure_reported and not record.departed)
        assert result.ring == tuple(p for p in record.rings[peer.group] if p in survivors)
        # (c) the world is the surviving participants.
        check_world(result.world, peer.group, survivors)
        record.results[peer.peer_id] = result
        peer.member = True
        peer.status = "idle" if result.success else "failed"

    def on_close(self, conn: int) -> None:
        self.lurkers.discard(conn)
        peer = self.peers.pop(conn, None)
        if peer is None:
            return
        self.blocked = {edge for edge in self.blocked if peer.peer_id not in edge}
        for number, record in self.rounds.items():
            if number not in self.finished and peer.peer_id in record.participants:
                record.departed.add(peer.peer_id)

    def on_kick(self, conn: int, reason: str) -> str:
        peer = self.peers.get(conn)
        if reason.startswith("no message for"):
            assert conn in self.lurkers or (peer is not None and peer.silent), reason
            kind = "silence"
        elif reason.startswith("malformed input"):
            assert conn == self.breaking, reason
            kind = "broken"
        else:
            assert reason.startswith("no ring can include this peer"), reason
            kind = "no ring"
        self.kicks[kind] = self.kicks.get(kind, 0) + 1
        return kind

    # --- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        core = self.h.core
        # Only the latest round begun this step: an earlier one may have started and
        # ended within it (every participant gone), admitting the waiting peers.
        started = [n for n, r in self.rounds.items() if r.step == self.step_count]
        if started:
            self.check_round_start(self.rounds[max(started)])
        views = {v.peer_id: v for v in core.peers()}
        by_id = {p.peer_id: p for p in self.peers.values()}
        # Each peer's own model agrees with the master.
        assert views.keys() == by_id.keys()
        for peer_id, peer in by_id.items():
            view = views[peer_id]
            assert view.phase is (PeerPhase.ACCEPTED if peer.member else PeerPhase.REGISTERED)
            assert view.state is MASTER_STATE[peer.status], (peer, view)
        # (a) no stuck consensus.
        members = [p for p in by_id.values() if p.member]
        if core.round_in_progress:
            assert any(p.status == "in_round" for p in by_id.values())
        else:
            assert not any(p.status.startswith(("in_round", "reported")) for p in by_id.values())
            if members:
                assert not all(p.status == "voted" for p in members)
            else:
                assert not by_id, "peers wait but there is nobody to ask"
        if members:
            assert not all(p.pending_out for p in members), "a complete pending vote is unanswered"
        assert core.next_deadline() > self.h.now

    # --- the end -------------------------------------------------------------------------

    def settle(self) -> None:
        """No more churn: silent peers time out, rounds finish, everyone waiting joins."""
        for _ in range(10 * self.max_peers + 20):
            statuses = {p.status for p in self.peers.values()}
            round_wanted = bool(statuses & {"waiting", "voted", "failed"})
            if any(p.silent for p in self.peers.values()) or self.lurkers:
                self.do("advance", 0)
            elif conn := self.first("in_round"):
                self.do("report_ok", conn)
            elif round_wanted and (conn := self.first("idle", "failed")):
                self.do("vote_yes", conn)
            elif self.h.core.round_in_progress or round_wanted:  # pragma: no cover
                raise AssertionError("stuck while settling")
            else:
                return
        raise AssertionError("did not settle")  # pragma: no cover

    def first(self, *statuses: str) -> int:
        """A live peer in one of ``statuses`` (members only past "in_round"), or 0."""
        return next(
            (c for c, p in self.peers.items()
             if p.status in statuses and (p.member or p.status == "in_round")), 0
        )

    def final_round(self) -> None:
        """Every survivor takes part in one more round, and it succeeds."""
        self.settle()
        if not self.peers:
            self.do("join", 0)  # the master still admits a newcomer
            self.settle()
        for conn in list(self.peers):
            self.do("vote_yes", conn)
        self.settle()
        numbers = {self.h.last(conn, P2PEstablishResult).round for conn in self.peers}
        assert len(numbers) == 1
        record = self.rounds[numbers.pop()]
        assert set(record.results) == {p.peer_id for p in self.peers.values()}
        for peer in self.peers.values():
            result = record.results[peer.peer_id]
            assert result.success
            assert set(result.ring) == {p.peer_id for p in self.peers.values()
                                        if p.group == peer.group}


SEEDS = range(8)
STEPS = 1500


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_random_churn(seed: int) -> None:
    sim = Simulation(seed)
    for _ in range(STEPS):
        sim.random_step()
    assert len(sim.finished) >= 20, "too few rounds to mean much"
    sim.final_round()


def test_simulation_exercises_every_kind_of_event() -> None:
    # Guards the simulation itself: across the seeds, every legitimate kick reason
    # occurs, rounds both succeed and fail, and pending polls get both answers.
    kicks: set[str] = set()
    outcomes: set[bool] = set()
    pending_answers: set[bool] = set()
    refused = 0
    for seed in SEEDS:
        sim = Simulation(seed)
        for _ in range(STEPS):
            sim.random_step()
        kicks |= sim.kicks.keys()
        outcomes |= {r.success for rec in sim.rounds.values() for r in rec.results.values()}
        pending_answers |= sim.pending_answers
        refused += sim.pending_refused
    assert refused > 0
    assert kicks == {"silence", "no ring", "broken"}
    assert outcomes == {True, False}
    assert pending_answers == {True, False}


class ChurnMachine(RuleBasedStateMachine):
    """The same simulation, with Hypothesis choosing (and shrinking) the steps."""

    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        self.sim = Simulation(seed, max_peers=8)

    @rule(pick=st.integers(0, 255))
    def act(self, pick: int) -> None:
        options = self.sim.options()
        name, conn, _weight = options[pick % len(options)]
        self.sim.do(name, conn)

    @rule()
    def wait(self) -> None:
        self.sim.do("advance", 0)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self) -> None:
        if hasattr(self, "sim"):
            self.sim.final_round()


ChurnMachine.TestCase.settings = settings(DETERMINISTIC, max_examples=60, stateful_step_count=40)
test_churn_machine = ChurnMachine.TestCase
