"""The master shell's ring searches: worker threads, results back to the core as events,
cancellation, and failures that cost a search but never the master."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from pccl_trio import Config
from pccl_trio._core.master import CancelSolve, Solve, SolveFinished
from pccl_trio.master._server import _MasterServer

#: Bounds a hang only; every test here finishes in well under a second.
HANG = 60


def random_costs(n: int, seed: int) -> np.ndarray:
    cost = np.random.default_rng(seed).uniform(1.0, 100.0, size=(n, n))
    np.fill_diagonal(cost, np.inf)
    return cost


def job(number: int, cost: np.ndarray, *, seconds: float, background: bool) -> Solve:
    return Solve(job=number, group=0, peers=tuple(range(100, 100 + len(cost))), cost=cost,
                 start=None, seconds=seconds, background=background)


@pytest.mark.parametrize("threads", [True, False])
async def test_a_search_reports_its_ring(threads: bool) -> None:
    server = _MasterServer(Config())
    server.threads = threads
    cost = random_costs(8, seed=1)
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            server.nursery = nursery
            server.execute([job(1, cost, seconds=1.0, background=False)])
        result = server.ready.pop() if not threads else server.events_receive.receive_nowait()
    assert isinstance(result, SolveFinished) and result.job == 1 and not result.error
    assert sorted(result.order) == list(range(8)) and result.optimal  # exact at 8 peers


async def test_a_cancelled_search_stops_and_reports_nothing() -> None:
    server = _MasterServer(Config())
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            server.nursery = nursery
            # Ten minutes of budget: only the cancel can end it within the test.
            server.execute([job(7, random_costs(64, seed=2), seconds=600, background=True)])
            await trio.lowlevel.checkpoint()  # let the search start in its thread
            server.execute([CancelSolve(job=7)])
    with pytest.raises(trio.WouldBlock):
        server.events_receive.receive_nowait()
    assert server.solves == {}


async def test_cancelling_the_master_abandons_a_running_search() -> None:
    server = _MasterServer(Config())
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            server.nursery = nursery
            server.execute([job(3, random_costs(64, seed=3), seconds=600, background=True)])
            await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
    # The thread was told to stop as well (its stop switch is set on the way out).
    with pytest.raises(trio.WouldBlock):
        server.events_receive.receive_nowait()


@pytest.mark.parametrize("threads", [True, False])
async def test_a_failing_search_is_reported_as_an_error(threads: bool) -> None:
    server = _MasterServer(Config())
    server.threads = threads
    broken = np.ones((3, 4))  # not square: the solver raises
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            server.nursery = nursery
            server.execute([job(5, broken, seconds=1.0, background=False)])
        result = server.ready.pop() if not threads else server.events_receive.receive_nowait()
    assert isinstance(result, SolveFinished) and result.job == 5
    assert result.order == () and result.error
