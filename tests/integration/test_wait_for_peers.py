"""``Communicator.wait_for_peers``: the run's members wait for joiners and admit them
until the run has ``n`` peers, or all give up together with ``TooFewPeers``."""

from __future__ import annotations

import math

import pytest
import trio

import pccl_trio as pccl

from .conftest import Cluster, make_run, run_all

NETWORKS = ("memory", "tcp", "sync")


async def test_the_members_admit_joiners_as_they_come_until_the_run_has_n(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        first = cluster.communicator("p0")
        await first.connect()
        joiners = [cluster.communicator(f"p{i}") for i in (1, 2)]
        worlds: list[int] = []

        async def member(comm: pccl.Communicator) -> None:
            await comm.wait_for_peers(3, timeout=math.inf)
            worlds.append(comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE))

        async def join(comm: pccl.Communicator) -> None:
            await comm.connect()  # returns once a round admitted it
            await member(comm)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, first)
            for comm in joiners:  # one after the other: two rounds, or one
                await join_soon(nursery, join, comm)
        assert worlds == [3, 3, 3]
        everyone = [first, *joiners]
        # Enough already: every peer returns at once.
        await run_all(everyone, lambda i, c: c.wait_for_peers(2, timeout=0))
        await run_all(everyone, lambda i, c: c.barrier())
        await run_all(everyone, lambda i, c: c.aclose())


async def join_soon(nursery: trio.Nursery, join: object, comm: pccl.Communicator) -> None:
    nursery.start_soon(join, comm)  # type: ignore[arg-type]
    await trio.lowlevel.checkpoint()


async def test_every_member_gives_up_together_when_too_few_came(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, 2)
        # The shortest wait decides, for both.
        results = await run_all(
            comms, lambda i, c: c.wait_for_peers(3, timeout=0.5 if i else 30.0)
        )
        assert all(isinstance(r, pccl.TooFewPeers) for r in results), results
        assert "the run has 2 peer(s)" in str(results[0])
        # The run goes on.
        await run_all(comms, lambda i, c: c.barrier())
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_bad_arguments_are_refused(cluster: Cluster, clock: object) -> None:
    comm = cluster.communicator("p0")
    await comm.connect()
    for n, timeout, what in ((0, 1.0, "n must be"), (True, 1.0, "n must be"), (2.5, 1.0, "n must be"),
                             (2, -1.0, "timeout must be"), (2, math.nan, "timeout must be"),
                             (2, "1", "timeout must be")):
        with pytest.raises(pccl.InvalidArgument, match=what):
            await comm.wait_for_peers(n, timeout=timeout)  # type: ignore[arg-type]
    await comm.wait_for_peers(1, timeout=0)  # alone is enough for one
    await comm.aclose()
