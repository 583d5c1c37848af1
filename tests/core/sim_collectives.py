"""A seeded discrete-event simulation of a peer group running many tagged all-reduces
through churn.

One peer group of 3 to 6 accepted peers, plus joiners now and then, next to a bystander
group (one peer at first) that takes part in rounds, reports slowly and runs no
collective. Each simulated peer behaves like the shipped client: it initiates tags
(sometimes with a descriptor that disagrees), completes what commenced (sometimes
failing), and once it has nothing in flight votes to re-establish the ring (without
admitting anyone) after an ABORTED verdict or a failed round, or now and then calls
update_topology (admitting joiners). Unlike the shipped client, a member whose own
report failed sometimes initiates before the round is over (legal; this found a bug).
Some rounds are doomed (every report fails). Peers die, break their connections and
fall silent. After every step the simulation checks, from the messages alone:
  - every participant (seq 0: every live initiator) gets exactly one verdict, in the
    step that decides it, and all of them the same one;
  - the outcome is the one the protocol prescribes (an oracle from the model);
  - no commence while the group's ring is stale or a round runs; a commence goes to
    every live member, on a ring of exactly the live members;
  - an abort reaches each unfinished live participant once, only after a failure;
  - nothing is stuck: no collective waits once every live member initiated it, or
    once every live participant completed it, or while a member votes;
  - seqs are unique and increasing;
and in the end, with churn over, everyone settles, re-establishes and runs one more
collective that succeeds.
"""

from __future__ import annotations

import dataclasses
import functools

from pccl_trio._core.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveInitiate,
    CollectiveVerdict,
    Outcome,
    P2PEstablishResult,
    P2PInfo,
)

from .master_harness import COUNT, FLOAT, LIVENESS_TIMEOUT, SUM
from .simulator import ChurnSimulator, Option, SimPeer

SEEDS = range(16)
STEPS = 1500

TAGS = range(4)
DOUBLE, AVG = 11, 1
STALE_REASON = "must be re-established"


def canonical(tag: int) -> CollectiveInitiate:
    return CollectiveInitiate(
        tag=tag, count=COUNT + tag, dtype=FLOAT, op=SUM, quantized_dtype=0, quantization=0
    )


def key(message: CollectiveInitiate) -> tuple[int, ...]:
    return (message.count, message.dtype, message.op, message.quantized_dtype,
            message.quantization)


@dataclasses.dataclass
class SimTag:
    seq: int = 0  # 0 until it commences here
    completed: bool = False
    abort_seen: bool = False


@dataclasses.dataclass
class CollectivePeer(SimPeer):
    # group 1: a bystander, in rounds but in no collective
    ring_stale: bool = False  # an ABORTED verdict or a failed round since its last good one
    tags: dict[int, SimTag] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Epoch:
    """One use of a tag, from its first initiate to its verdicts."""

    tag: int
    initiates: dict[int, CollectiveInitiate] = dataclasses.field(default_factory=dict)
    seq: int = 0
    participants: set[int] = dataclasses.field(default_factory=set)  # live ones
    completed: set[int] = dataclasses.field(default_factory=set)
    cause: str = ""  # why the running attempt aborts
    cause_step: int = -1
    aborts: set[int] = dataclasses.field(default_factory=set)  # sent CollectiveAbort
    expected: set[int] | None = None  # who must hear this step's commence or verdict
    heard: set[int] = dataclasses.field(default_factory=set)
    verdict: CollectiveVerdict | None = None


class CollectiveSimulation(ChurnSimulator[CollectivePeer]):
    KICKS = {"round deadline": "did not report on its p2p connections"}

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.size = 3 + seed % 4
        self.epochs: dict[int, Epoch] = {}  # open ones by tag
        self.stale = False  # group 0's ring is stale (our model of the master)
        self.max_seq = 0
        self.mismatch = 0.06
        self.round = 0
        self.doomed = False  # every report of the current round fails
        # What the current delivery saw (``delivered`` checks it and starts afresh):
        # the epochs a commence or verdict went out for, and the round verdicts.
        self.touched: list[Epoch] = []
        self.results: set[bool] = set()
        self.handlers |= {
            P2PInfo: self.on_info,
            P2PEstablishResult: self.on_result,
            CollectiveCommence: self.on_commence,
            CollectiveAbort: self.on_abort,
            CollectiveVerdict: self.on_verdict,
        }
        for _ in range(self.size):
            self.do("join", 0, group=0)
        self.do("join", 0, group=1)
        self.settle()
        assert len(self.members(0)) == self.size and len(self.members(1)) == 1

    def new_peer(self, conn: int, group: int) -> CollectivePeer:
        return CollectivePeer(conn=conn, group=group)

    # --- choices -------------------------------------------------------------------

    def options(self) -> list[Option]:
        found: list[Option] = [("advance", 0, 1.0)]
        if len(self.peers) < 8:
            found.append(("join", 0, 0.15))
        polling = any(p.pending_out for p in self.peers.values())
        voting = any(p.status == "voted" for p in self.peers.values())
        for conn, peer in self.peers.items():
            if peer.silent:
                continue
            found += [("die", conn, 0.03), ("silence", conn, 0.01)]
            if peer.status == "in_round":  # a bystander is slow: others report first
                found.append(("report", conn, 0.25 if peer.group else 3.0))
            for tag, state in peer.tags.items():
                if state.seq and not state.completed:
                    found.append((f"complete:{tag}", conn, 3.0 if state.abort_seen else 1.0))
            collective = peer.member and peer.group == 0 and len(peer.tags) < len(TAGS)
            if collective and peer.status == "reported_failed":
                # Legal, if not what the shipped client does: its own report failed, the
                # round is not over. The ring is stale already: this must not commence.
                found.append(("initiate", conn, 1.5))
            if not peer.member or peer.status not in ("idle", "failed"):
                continue
            if collective:
                found.append(("initiate", conn, 0.4 if peer.ring_stale else 2.5))
            if not peer.tags and not peer.pending_out:
                must = peer.ring_stale or voting or peer.status == "failed"
                found.append(("vote", conn, 4.0 if must else 0.08))
                found.append(("pending", conn, 2.0 if polling else 0.05))
        return found

    def do(
        self,
        name: str,
        conn: int,
        *,
        group: int | None = None,
        ok: bool | None = None,
        accept: bool | None = None,
        tag: int | None = None,
        descriptor: CollectiveInitiate | None = None,
        aborted: bool | None = None,
        seconds: float | None = None,
    ) -> None:
        """One step; the keywords fix what is otherwise left to chance."""
        self.step += 1
        h, rng = self.h, self.rng
        peer = self.peers.get(conn)
        match name.split(":"):
            case ["join"]:
                if group is None:
                    group = 1 if rng.random() < 0.15 else 0
                self.join(group)
            case ["report"]:
                assert peer is not None
                if ok is None:
                    ok = not self.doomed and rng.random() < 0.9
                if not ok:
                    self.stale = True  # the round has failed, whoever reports next
                self.report(peer, ok)
            case ["vote"]:
                assert peer is not None and not peer.tags
                # After an abort or a failed round: re-establish only; else update_topology.
                if accept is None:
                    accept = not peer.ring_stale and peer.status != "failed"
                self.count("vote")
                self.vote(peer, accept)
            case ["pending"]:
                assert peer is not None
                self.ask_pending(peer)
            case ["initiate"]:
                assert peer is not None
                self.initiate(peer, tag, descriptor)
            case ["complete", which]:
                assert peer is not None
                tag = int(which)
                state = peer.tags[tag]
                if aborted is None:
                    aborted = rng.random() < (0.5 if state.abort_seen else 0.07)
                epoch = self.epochs[tag]
                state.completed = True
                epoch.completed.add(peer.peer_id)
                if aborted and not epoch.cause:
                    epoch.cause, epoch.cause_step = f"peer {peer.peer_id} failed", self.step
                self.deliver(h.complete(conn, tag, state.seq, aborted=aborted))
            case ["die"]:
                self.die(conn)
            case ["silence"]:
                assert peer is not None
                peer.silent = True
            case ["advance"]:
                self.advance(seconds)
            case _:  # pragma: no cover
                raise AssertionError(name)
        self.check()

    def initiate(
        self, peer: CollectivePeer, tag: int | None, descriptor: CollectiveInitiate | None
    ) -> None:
        if tag is None:
            free = [t for t in TAGS if t not in peer.tags]
            # Mostly join what the others started (they wait for us).
            joined = [t for t in free if t in self.epochs]
            tag = self.rng.choice(joined if joined and self.rng.random() < 0.8 else free)
        if descriptor is None:
            descriptor = canonical(tag)
            if self.rng.random() < self.mismatch:
                change = self.rng.choice(["count", "dtype", "op"])
                descriptor = dataclasses.replace(
                    descriptor, **{change: {"count": COUNT + 40, "dtype": DOUBLE, "op": AVG}[change]}
                )
        epoch = self.epochs.setdefault(tag, Epoch(tag=tag))
        assert epoch.seq == 0 and peer.peer_id not in epoch.initiates
        epoch.initiates[peer.peer_id] = descriptor
        peer.tags[tag] = SimTag()
        self.count("initiate")
        if peer.status == "reported_failed":
            self.count("initiate-mid-round")
        self.deliver(self.h.send(peer.conn, descriptor))

    # --- what the master said -------------------------------------------------------

    def live_members(self) -> set[int]:
        """The collective's group: the live accepted peers of group 0."""
        return {p.peer_id for p in self.members(0)}

    def on_info(self, peer: CollectivePeer, info: P2PInfo) -> None:
        if info.round != self.round:  # a new round: sometimes a network split dooms it
            self.round, self.doomed = info.round, self.rng.random() < 0.2
        assert not peer.tags
        peer.enters_round()

    def on_result(self, peer: CollectivePeer, result: P2PEstablishResult) -> None:
        self.results.add(result.success)
        peer.hears_result(result.success)
        peer.ring_stale = not result.success
        self.stale = not result.success
        self.count(f"round-{'ok' if result.success else 'failed'}")

    def on_commence(self, peer: CollectivePeer, message: CollectiveCommence) -> None:
        epoch = self.epochs[message.tag]
        if epoch.expected is None:  # the first of them
            members = self.live_members()
            assert epoch.seq == 0 and not self.stale, "commence on a stale ring"
            assert not self.h.core.round_in_progress
            assert members <= epoch.initiates.keys()
            assert len({key(epoch.initiates[p]) for p in members}) == 1
            assert sorted(message.ring) == sorted(members)
            assert message.ring == tuple(self.h.core.ring(0))
            assert message.seq > self.max_seq, "seqs unique and increasing"
            self.max_seq = message.seq
            epoch.seq, epoch.participants, epoch.expected = message.seq, set(members), set(members)
            self.count("commence")
        assert message.seq == epoch.seq and peer.peer_id not in epoch.heard
        epoch.heard.add(peer.peer_id)
        peer.tags[message.tag].seq = message.seq
        self.touched.append(epoch)

    def on_abort(self, peer: CollectivePeer, message: CollectiveAbort) -> None:
        epoch = self.epochs[message.tag]
        assert epoch.cause and message.seq == epoch.seq
        assert epoch.cause_step == self.step, "aborts go out when the failure happens"
        assert peer.peer_id in epoch.participants - epoch.completed
        assert peer.peer_id not in epoch.aborts
        epoch.aborts.add(peer.peer_id)
        peer.tags[message.tag].abort_seen = True
        self.count("abort")

    def on_verdict(self, peer: CollectivePeer, verdict: CollectiveVerdict) -> None:
        epoch = self.epochs[verdict.tag]
        if epoch.expected is None:  # the first of them: was it due, and is it right?
            members = self.live_members()
            assert verdict.seq == epoch.seq
            if epoch.seq:
                assert epoch.participants <= epoch.completed, "verdict before all completed"
                expected = Outcome.ABORTED if epoch.cause else Outcome.SUCCESS
                assert verdict.outcome == expected, (epoch, verdict)
                epoch.expected = set(epoch.participants)
            else:
                everyone = members <= epoch.initiates.keys()
                agree = len({key(d) for d in epoch.initiates.values()}) == 1
                voting = any(p.status == "voted" for p in self.members(0))
                if verdict.outcome == Outcome.REJECTED:
                    assert everyone and not agree, epoch
                else:
                    assert verdict.outcome == Outcome.ABORTED, verdict
                    if STALE_REASON in verdict.reason:
                        assert everyone and agree and self.stale, epoch
                    else:
                        assert voting and "voted to re-establish" in verdict.reason, verdict
                epoch.expected = set(epoch.initiates)
            epoch.verdict = verdict
            self.count(f"verdict-{verdict.outcome}-{'ran' if verdict.seq else 'seq0'}")
            if STALE_REASON in verdict.reason:
                self.count("stale-abort")
            elif "voted to re-establish" in verdict.reason:
                self.count("vote-abort")
        assert verdict == epoch.verdict, "everyone hears the same verdict"
        assert peer.peer_id not in epoch.heard
        epoch.heard.add(peer.peer_id)
        del peer.tags[verdict.tag]
        if verdict.outcome == Outcome.ABORTED:
            peer.ring_stale = True
        self.touched.append(epoch)

    def delivered(self) -> None:
        assert len(self.results) <= 1, "one round, one verdict"
        for epoch in dict.fromkeys(self.touched):
            assert epoch.heard == epoch.expected, (epoch, "not everyone heard it")
            epoch.expected, epoch.heard = None, set()
            if epoch.verdict is not None:
                del self.epochs[epoch.tag]
        self.touched, self.results = [], set()

    def left(self, peer: CollectivePeer) -> None:
        if peer.member and peer.group == 0:
            self.stale = True
        self.count("left")
        for epoch in self.epochs.values():
            epoch.initiates.pop(peer.peer_id, None)
            if peer.peer_id in epoch.participants:
                epoch.participants.discard(peer.peer_id)
                epoch.completed.discard(peer.peer_id)
                if not epoch.cause:
                    epoch.cause, epoch.cause_step = f"peer {peer.peer_id} left", self.step

    # --- invariants ----------------------------------------------------------------

    def check(self) -> None:
        super().check()
        by_id = {p.peer_id: p for p in self.peers.values()}
        members = self.live_members()
        voting = any(p.status == "voted" for p in self.members(0))
        for tag, epoch in list(self.epochs.items()):
            if epoch.seq == 0:
                if not epoch.initiates:  # every initiator left: nobody to tell
                    del self.epochs[tag]
                    continue
                assert epoch.initiates.keys() <= members
                assert not members <= epoch.initiates.keys(), f"tag {tag} stuck at consensus"
                assert not voting, f"tag {tag} waits for a member that votes"
            else:
                if not epoch.participants:  # every participant left: nobody to tell
                    del self.epochs[tag]
                    continue
                assert epoch.participants <= members
                assert not epoch.participants <= epoch.completed, f"tag {tag} stuck, all done"
                if epoch.cause_step == self.step:
                    # Each unfinished participant got the abort (one may since have left).
                    assert epoch.participants - epoch.completed <= epoch.aborts
            for peer_id in epoch.participants or epoch.initiates:
                assert tag in by_id[peer_id].tags
        for peer in self.peers.values():
            assert peer.tags.keys() <= self.epochs.keys()
            assert self.h.in_flight[peer.conn].keys() == peer.tags.keys()

    # --- the end ---------------------------------------------------------------------

    def settle(self) -> None:
        """No more churn: everything in flight ends, the ring is re-established, joiners
        are admitted."""
        for _ in range(400):
            peers = list(self.peers.values())
            if any(p.silent for p in peers):
                self.do("advance", 0, seconds=0.6 * LIVENESS_TIMEOUT)
            elif in_round := [p for p in peers if p.status == "in_round"]:
                self.do("report", in_round[0].conn, ok=True)
            elif running := [(p, t) for p in peers for t, s in p.tags.items()
                             if s.seq and not s.completed]:
                peer, tag = running[0]
                self.do(f"complete:{tag}", peer.conn, aborted=False)
            elif waiting := [(p, e) for e in self.epochs.values() if not e.seq
                             for p in self.members(0) if p.peer_id not in e.initiates]:
                peer, epoch = waiting[0]
                descriptor = next(iter(epoch.initiates.values()))
                self.do("initiate", peer.conn, tag=epoch.tag, descriptor=descriptor)
            elif any(p.tags for p in peers):  # pragma: no cover
                raise AssertionError("collectives stuck while settling")
            elif (self.stale or any(p.ring_stale or p.status != "idle" for p in peers)
                  or not self.peers):
                if not self.peers:
                    self.do("join", 0, group=0)
                    continue
                voters = [p for p in self.members() if p.status != "voted" and not p.pending_out]
                if not voters:  # pragma: no cover
                    raise AssertionError("stuck: nobody can vote while settling")
                self.do("vote", voters[0].conn, accept=True)
            else:
                return
        raise AssertionError("did not settle")  # pragma: no cover

    def final_collective(self) -> None:
        self.settle()
        assert not self.stale and not self.epochs
        if not self.members(0):
            self.do("join", 0, group=0)
            self.settle()
        assert len(self.members()) == len(self.peers)
        members = self.members(0)
        tag = max(TAGS) + 1
        for peer in members:
            self.do("initiate", peer.conn, tag=tag, descriptor=canonical(tag))
        seq = self.h.last(members[0].conn, CollectiveCommence).seq
        for peer in members:
            self.do(f"complete:{tag}", peer.conn, aborted=False)
        for peer in members:
            assert self.h.last(peer.conn, CollectiveVerdict) == CollectiveVerdict(
                tag=tag, seq=seq, outcome=Outcome.SUCCESS
            )
        assert not self.epochs


@functools.cache
def simulate(seed: int) -> CollectiveSimulation:
    """The simulation for ``seed``, run to its end (once: the tests share it)."""
    sim = CollectiveSimulation(seed)
    sim.random_steps(STEPS)
    sim.final_collective()
    return sim
