"""Golden traces: the seeded simulations drive the core exactly as they always did.

Each simulation (membership churn, collectives through churn, topology optimizations in
random interleavings) runs for fixed seeds, and the digest of everything it fed the
core and got back (``MasterHarness.trace``) must equal the one recorded in
``golden_traces.json``. The simulations choose their next step from what the core
answered, so an equal digest means the core took the same decisions, emitted the
same actions in the same order, and kept the same clock, event for event.

A change that alters the core's behaviour on purpose changes these digests too:
record the new ones with ``python -m tests.core.test_golden_traces`` and say in the
commit why they changed.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import pytest

from .master_harness import MasterHarness
from .sim_collectives import SEEDS as COLLECTIVE_SEEDS
from .sim_collectives import simulate
from .sim_membership import SEEDS as CHURN_SEEDS
from .sim_membership import STEPS as CHURN_STEPS
from .sim_membership import Simulation
from .sim_topology import SEEDS as CHAOS_SEEDS
from .sim_topology import Chaos

GOLDEN = pathlib.Path(__file__).with_name("golden_traces.json")


def churn(seed: int) -> MasterHarness:
    sim = Simulation(seed)
    for _ in range(CHURN_STEPS):
        sim.random_step()
    sim.final_round()
    return sim.h


def collectives(seed: int) -> MasterHarness:
    return simulate(seed).h


def chaos(seed: int) -> MasterHarness:
    sim = Chaos(seed)
    sim.run()
    return sim.h


SIMULATIONS: dict[str, tuple[Callable[[int], MasterHarness], range]] = {
    "churn": (churn, CHURN_SEEDS),
    "collectives": (collectives, COLLECTIVE_SEEDS),
    "chaos": (chaos, CHAOS_SEEDS),
}


def digests(name: str) -> dict[str, str]:
    run, seeds = SIMULATIONS[name]
    return {str(seed): run(seed).trace.hexdigest() for seed in seeds}


@pytest.mark.parametrize("name", sorted(SIMULATIONS))
def test_the_core_acts_as_recorded(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    found = digests(name)
    differing = sorted((s for s in golden if found.get(s) != golden[s]), key=int)
    assert found.keys() == golden.keys(), "the seeds changed: record the traces again"
    assert not differing, f"{name}: seeds {differing} act differently than recorded"


def test_traces_tell_runs_apart() -> None:
    # Guards the digest itself: long runs from different seeds never coincide. (Some
    # chaos seeds do: a short run of two peers, for one, can play out the same way.)
    for name in ("churn", "collectives"):
        values = json.loads(GOLDEN.read_text())[name].values()
        assert len(set(values)) == len(values), name


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({name: digests(name) for name in sorted(SIMULATIONS)}, indent=1) + "\n")
    print(f"recorded {GOLDEN}")
