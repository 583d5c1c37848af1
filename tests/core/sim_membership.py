"""A seeded discrete-event simulation of many peers around one MasterCore: membership.

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

from pccl_trio._core.messages import P2PEstablishResult, P2PInfo, WorldSizes
from pccl_trio._core.ring import ring_edges

from .simulator import ChurnSimulator, Option, SimPeer

SEEDS = range(8)
STEPS = 1500

NO_RING = "no ring can include this peer"


@dataclasses.dataclass
class MemberPeer(SimPeer):
    accept_new: bool = True  # its latest VoteEstablish
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


class Simulation(ChurnSimulator[MemberPeer]):
    KICKS = {"no ring": NO_RING}

    def __init__(self, seed: int, *, max_peers: int = 20, groups: int = 3) -> None:
        super().__init__(seed)
        self.max_peers = max_peers
        self.groups = groups
        self.rounds: dict[int, RoundRecord] = {}
        self.finished: set[int] = set()
        self.blocked: set[tuple[int, int]] = set()  # edges reported unreachable
        # What the current delivery saw (``delivered`` checks it and starts afresh):
        # rounds ended -> the peer ids expected to hear the verdict; voters a round
        # start removes because no ring fits them (the votes were cast, and decided
        # whether waiting peers join, before the removal).
        self.verdicts: dict[int, set[int]] = {}
        self.unplaceable: list[MemberPeer] = []
        self.handlers |= {P2PInfo: self.on_info, P2PEstablishResult: self.on_result}

    def new_peer(self, conn: int, group: int) -> MemberPeer:
        return MemberPeer(conn=conn, group=group)

    # --- the choices ---------------------------------------------------------------------

    def options(self) -> list[Option]:
        found: list[Option] = [("advance", 0, 2.0), ("lurk", 0, 0.1)]
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

    def do(self, name: str, conn: int) -> None:
        self.step += 1
        h, rng = self.h, self.rng
        match name:
            case "join":
                self.join(min(rng.randrange(4), self.groups - 1))
            case "lurk":
                conn = self.new_conn()
                self.lurkers.add(conn)
                self.deliver(h.open(conn))
            case "report" | "report_ok":
                peer = self.peers[conn]
                ok = name == "report_ok" or rng.random() < 0.95
                failed = [] if ok else [n for n in peer.neighbours if rng.random() < 0.5]
                if not ok:
                    self.rounds[h.last(conn, P2PInfo).round].failure_reported = True
                    alive = {p.peer_id for p in self.peers.values()}
                    self.blocked |= {(peer.peer_id, n) for n in failed if n in alive}
                self.report(peer, ok, failed)
            case "vote" | "vote_yes":
                peer = self.peers[conn]
                peer.accept_new = name == "vote_yes" or rng.random() < 0.8
                self.vote(peer, peer.accept_new)
            case "pending":
                self.ask_pending(self.peers[conn])
            case "die":
                self.die(conn)
            case "silence":
                self.peers[conn].silent = True
            case "advance":
                self.advance()
            case _:  # pragma: no cover
                raise AssertionError(name)
        self.check()

    # --- what the master said ----------------------------------------------------------

    def on_kick(self, conn: int, reason: str) -> None:
        super().on_kick(conn, reason)
        if reason.startswith(NO_RING):
            self.unplaceable.append(self.peers[conn])

    def on_info(self, peer: MemberPeer, info: P2PInfo) -> None:
        if info.round not in self.rounds:
            voters = [p for p in [*self.peers.values(), *self.unplaceable] if p.member]
            self.rounds[info.round] = RoundRecord(
                number=info.round,
                step=self.step,
                participants={},
                rings={},
                accept_new=all(p.accept_new for p in voters),
            )
        record = self.rounds[info.round]
        # Every P2PInfo of a round goes out in the step that starts it.
        assert record.step == self.step
        peer.enters_round()
        record.participants[peer.peer_id] = peer.group
        ring = record.rings.setdefault(peer.group, info.ring)
        assert info.ring == ring and peer.peer_id in ring
        assert not set(ring_edges(ring)) & self.blocked
        index = ring.index(peer.peer_id)
        expected = list(dict.fromkeys((ring[index - 1], ring[(index + 1) % len(ring)])))
        assert [n.peer_id for n in info.neighbours] == ([] if len(ring) == 1 else expected)
        peer.neighbours = tuple(n.peer_id for n in info.neighbours)

    def on_result(self, peer: MemberPeer, result: P2PEstablishResult) -> None:
        record = self.rounds[result.round]
        if result.round not in self.verdicts:
            assert result.round not in self.finished, f"round {result.round} ended twice"
            self.verdicts[result.round] = set(record.participants) - record.departed
        survivors = {p: g for p, g in record.participants.items() if p not in record.departed}
        # (b) one verdict, one ring per group: the round's ring less the departed.
        assert result.success == (not record.failure_reported and not record.departed)
        assert result.ring == tuple(p for p in record.rings[peer.group] if p in survivors)
        # (c) the world is the surviving participants.
        check_world(result.world, peer.group, survivors)
        record.results[peer.peer_id] = result
        peer.hears_result(result.success)

    def delivered(self) -> None:
        for number, expected in self.verdicts.items():
            record = self.rounds[number]
            # (b) every surviving participant heard the verdict, in this one step.
            assert set(record.results) == expected
            self.finished.add(number)
        self.verdicts, self.unplaceable = {}, []

    def left(self, peer: MemberPeer) -> None:
        self.blocked = {edge for edge in self.blocked if peer.peer_id not in edge}
        for number, record in self.rounds.items():
            if number not in self.finished and peer.peer_id in record.participants:
                record.departed.add(peer.peer_id)

    # --- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        # Only the latest round begun this step: an earlier one may have started and
        # ended within it (every participant gone), admitting the waiting peers.
        started = [n for n, r in self.rounds.items() if r.step == self.step]
        if started:
            self.check_round_start(self.rounds[max(started)])
        peers = list(self.peers.values())
        # (a) no stuck consensus.
        members = self.members()
        if self.h.core.round_in_progress:
            assert any(p.status == "in_round" for p in peers)
        else:
            assert not any(p.status.startswith(("in_round", "reported")) for p in peers)
            if members:
                assert not all(p.status == "voted" for p in members)
            else:
                assert not peers, "peers wait but there is nobody to ask"
        if members:
            assert not all(p.pending_out for p in members), "a complete pending vote is unanswered"

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
