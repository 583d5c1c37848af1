"""A seeded simulation of one topology optimization in random interleavings.

Measurements (some failing), deaths, lazy receivers and the step deadline, solver
answers (good, not optimal, failed, bogus, unknown), newcomers and stray measurements
happen in any order until the optimization ends. Half the runs start after an earlier
optimization and a round that admitted newcomers, so only some links are measured. In
the end every live participant has exactly one report and then one ``P2PInfo`` of the
new ring's round, which succeeds; newcomers got neither, unless every participant left
(then a round admits them).
"""

from __future__ import annotations

from pccl_trio._core.messages import LinkMeasured, Message, P2PInfo, TopologyOptimized

from .master_harness import MasterHarness, default_solver
from .scenarios import (
    ACC,
    CONN,
    FAST,
    LATENCY,
    MEDIUM,
    REFERENCE,
    SLOW,
    finish_round,
    measure_all,
    optimize_all,
    run_with,
)
from .simulator import Option, Simulator

SEEDS = range(150)


class Chaos(Simulator):
    optimizes = True

    def __init__(self, seed: int) -> None:
        super().__init__(
            seed,
            MasterHarness(
                heartbeat_interval=1.0, liveness_timeout=5.0, round_timeout=3.0,
                reference_bytes=REFERENCE,
            ),
        )
        h, rng = self.h, self.rng
        self.rate = {(a, b): rng.choice((SLOW, MEDIUM, FAST))
                     for a in range(1, 30) for b in range(1, 30)}
        # Two peers up: a lone peer's optimization ends at once, the same way every
        # time (``test_a_lone_peer_optimizes_at_once``). A draw of one becomes two,
        # so that every other seed keeps the stream of draws it was recorded with.
        size = max(2, rng.randint(1, 7))
        self.groups = {c: rng.randrange(2) for c in range(1, size + 1)}
        self.groups[1] = 0
        run_with(h, self.groups)
        if rng.random() < 0.5:
            # An earlier optimization (exact answers: no background search), then
            # newcomers admitted by a round.
            optimize_all(h, self.groups)
            measure_all(h, lambda a, b: self.rate[(a, b)])
            h.finish_solves()
            finish_round(h, self.groups)
            joiners = {c: rng.randrange(2) for c in range(size + 1, size + 1 + rng.randint(0, 2))}
            for conn, group in joiners.items():
                h.register(conn, group)
            if joiners:
                for conn in self.groups:
                    h.vote(conn)
                self.groups |= joiners
                finish_round(h, self.groups)
            self.count("earlier")
        self.alive = set(self.groups)
        self.lazy: set[int] = set()  # alive, but never reports a measurement
        self.newcomers: set[int] = set()  # registered during this optimization
        self.next_conn = max(self.groups) + 1
        self.asked: set[int] = set()  # receivers asked to measure when the step began

    def run(self) -> None:
        """Every group member votes (some die meanwhile); then random steps until the
        optimization ends, and the check."""
        h, rng = self.h, self.rng
        voters = list(self.groups)
        rng.shuffle(voters)
        h.take_all()
        for index, conn in enumerate(voters):
            if conn in self.alive:
                self.deliver(h.optimize(conn))
            # Someone may leave during the vote (before the last voter completes it).
            if index < len(voters) - 1 and self.alive and rng.random() < 0.1:
                self.kill(rng.choice(sorted(self.alive)))
        for _ in range(2000):
            if not h.core.optimization_in_progress:
                break
            self.random_step()
        else:  # pragma: no cover
            raise AssertionError("the optimization never ended")
        self.check()

    # --- the choices ---------------------------------------------------------------------

    def answerable(self) -> list[int]:
        return sorted(c for c in self.h.unanswered if c not in self.lazy)

    def options(self) -> list[Option]:
        found: list[Option] = [("tick", 0, 1)]
        if self.answerable():
            found.append(("measure", 0, 6))
        if self.h.pending_solves():
            found.append(("solve", 0, 3))
        return found + [(name, 0, 1) for name in ("kill", "lazy", "join", "stray", "unknown-job")]

    def pick(self, options: list[Option]) -> Option:
        """Each option repeated as often as its (whole) weight says, and one of them
        drawn uniformly: one ``rng.choice``, the draw the recorded traces were made with
        (``rng.choices`` would draw differently)."""
        return self.rng.choice([option for option in options for _ in range(int(option[2]))])

    def do(self, name: str, conn: int) -> None:
        h, rng = self.h, self.rng
        self.asked = set(h.unanswered)
        match name:
            case "measure":
                conn = rng.choice(self.answerable())
                sender = h.unanswered[conn].source.peer_id
                late = sender not in self.alive
                if rng.random() < 0.15:
                    self.deliver(h.measure(conn, error="refused"))
                    self.count("measure-error")
                else:
                    self.deliver(h.measure(conn, bandwidth=self.rate[(sender, conn)], latency=LATENCY))
                    self.count("measure")
                if late:
                    self.count("late-report")
            case "solve":
                job = rng.choice(h.pending_solves())
                if len(self.alive & set(job.peers)) < len(job.peers):
                    self.count("solve-after-death")
                kind = rng.random()
                if kind < 0.5:
                    result = default_solver(job)
                    optimal = result.optimal and rng.random() < 0.7
                    self.deliver(h.answer(job.job, order=result.order, optimal=optimal))
                    self.count("solve" if optimal else "solve-not-optimal")
                elif kind < 0.7:
                    self.deliver(h.answer(job.job, error="boom"))
                    self.count("solve-error")
                elif kind < 0.85:
                    order = tuple(rng.choices(range(len(job.peers) + 1), k=len(job.peers)))
                    self.deliver(h.answer(job.job, order=order))
                    self.count("solve-bogus")
                else:
                    order = list(range(len(job.peers)))
                    rng.shuffle(order)
                    self.deliver(h.answer(job.job, order=order, optimal=rng.random() < 0.5))
                    self.count("solve-shuffled")
            case "kill" if self.alive and rng.random() < 0.3:
                self.kill(rng.choice(sorted(self.alive)))
            case "lazy" if self.alive and rng.random() < 0.2:
                self.lazy.add(rng.choice(sorted(self.alive)))
            case "join" if rng.random() < 0.3:
                conn = self.next_conn
                self.next_conn += 1
                self.newcomers.add(conn)
                self.alive.add(conn)
                self.deliver(h.register(conn, rng.randrange(2)))
                self.count("join")
            case "stray" if self.alive and rng.random() < 0.3:
                conn = rng.choice(sorted(self.alive))
                self.deliver(h.send(conn, LinkMeasured(optimization=rng.randrange(3),
                                                       sender=rng.randrange(1, 9), bandwidth=SLOW)))
                self.count("stray-kicked" if h.view(conn) is None else "stray-accepted")
            case "unknown-job":
                assert h.answer(1000 + rng.randrange(100), order=(0,)) == []
            case _:  # "tick", and a step whose chance did not come
                self.advance()

    def kill(self, conn: int) -> None:
        if self.rng.random() < 0.3:
            self.deliver(self.h.broken(conn))
        else:
            self.deliver(self.h.close(conn))
        self.count("kill-measuring" if self.h.unanswered else "kill")

    def talking(self) -> list[int]:
        return sorted(self.alive)

    def pause(self) -> float:
        return self.rng.uniform(0.2, 1.5)

    # --- what the core answered --------------------------------------------------------

    def on_close(self, conn: int) -> None:
        self.alive.discard(conn)

    def on_kick(self, conn: int, reason: str) -> None:
        if "did not report its link" in reason:
            assert conn in self.asked  # only a receiver that was asked
            self.count("step-deadline")

    def receive(self, conn: int, message: Message) -> None:
        """Nothing to do now: ``check`` reads what each peer got in the end."""

    def check(self) -> None:
        h = self.h
        participants = {c for c in self.groups if c in self.alive}
        infos = {c: [m for m in h.take(c) if isinstance(m, TopologyOptimized | P2PInfo)]
                 for c in self.alive}
        for conn in participants:
            report, info = infos[conn]  # exactly one of each, the report first
            assert isinstance(report, TopologyOptimized) and isinstance(info, P2PInfo)
            assert report.error == "" and report.optimization == h.latest_optimization
            members = tuple(sorted(c for c in participants if self.groups[c] == self.groups[conn]))
            assert report.peers == members and sorted(report.ring) == list(members)
            assert info.ring == report.ring
            assert h.where(conn) == (ACC, CONN)
        for conn in self.newcomers & self.alive:
            # Never a report; admitted (one round) only if every participant left.
            assert [type(m) for m in infos[conn]] == ([] if participants else [P2PInfo])
        if participants:
            self.count("reported")
            finish_round(h, sorted(participants))
        elif self.newcomers & self.alive:
            self.count("newcomers-admitted")
        if any(j.background for j in h.pending_solves()):
            self.count("background")
