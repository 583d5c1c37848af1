"""Membership churn: the seeded simulation of ``sim_membership``, for fixed seeds and
with Hypothesis choosing (and shrinking) the steps."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from .sim_membership import SEEDS, STEPS, Simulation
from .support import DETERMINISTIC


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_random_churn(seed: int) -> None:
    sim = Simulation(seed)
    sim.random_steps(STEPS)
    assert len(sim.finished) >= 20, "too few rounds to mean much"
    sim.final_round()


def test_simulation_exercises_every_kind_of_event() -> None:
    # Guards the simulation itself: across the seeds, every legitimate kick reason
    # occurs, rounds both succeed and fail, and pending polls get both answers.
    kicks: set[str] = set()
    outcomes: set[bool] = set()
    stats: Counter[str] = Counter()
    for seed in SEEDS:
        sim = Simulation(seed)
        sim.random_steps(STEPS)
        kicks |= sim.kicks.keys()
        outcomes |= {r.success for rec in sim.rounds.values() for r in rec.results.values()}
        stats += sim.stats
    assert stats["pending-refused"] > 0
    assert kicks == {"silence", "no ring", "broken"}
    assert outcomes == {True, False}
    assert stats["pending-yes"] > 0 and stats["pending-no"] > 0


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
