"""The master's metrics and status over real TCP: scraped with an HTTP client while peers
join, all-reduce, abort and leave, the counters move by exactly what happened; an
observer's status shows the run and changes nothing."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import pccl_trio as pccl
from pccl_trio._status import fetch_status
from pccl_trio.transport import TcpNetwork, format_address, listener_address

from .conftest import TCP_CONFIG, Cluster, die_mid_all_reduce, form_run, run_all


@pytest.fixture
def network_kind() -> str:
    return "tcp"


@pytest.fixture
async def observed(nursery: trio.Nursery) -> AsyncIterator[tuple[Cluster, str]]:
    """A master on loopback TCP serving metrics; the cluster and the metrics URL."""
    listener = await TcpNetwork().listen("127.0.0.1", 0)
    host, port = listener_address(listener)
    bound: list[tuple[str, int]] = []
    scope = trio.CancelScope()

    async def run_master(*, task_status: trio.TaskStatus[object]) -> None:
        with scope:
            await pccl.serve_master(
                [listener], config=TCP_CONFIG, metrics=("127.0.0.1", 0),
                metrics_started=bound.append, task_status=task_status,
            )

    await nursery.start(run_master)
    cluster = Cluster(kind="tcp", master_address=format_address(host, port), config=TCP_CONFIG,
                      memory=None, master_scope=scope)
    yield cluster, f"http://{format_address(*bound[0])}/metrics"
    scope.cancel()


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the endpoint serves, by name and labels."""

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            return str(response.read().decode())

    text = await trio.to_thread.run_sync(get)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_move_by_exactly_what_happened(
    observed: tuple[Cluster, str], clock: object
) -> None:
    cluster, url = observed
    with trio.fail_after(120):
        before = await scrape(url)
        assert value(before, "pccl_master_peers_joined_total") == 0
        assert value(before, "pccl_master_kicks_total", cause="liveness") == 0
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(4)])
        joined = await scrape(url)
        assert value(joined, "pccl_master_peers_joined_total") == 4
        assert value(joined, "pccl_master_peers", group="0", phase="accepted") == 4
        assert value(joined, "pccl_master_world_size", group="0") == 4
        rounds = value(joined, "pccl_master_rounds_total", outcome="succeeded")
        assert rounds >= 1

        data = [np.arange(200_000, dtype=np.float32) for _ in range(4)]
        for _ in range(3):
            infos = await run_all(comms, lambda i, c: c.all_reduce(data[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos)
        reduced = await scrape(url)
        # The first went through the master and leased the tag; the next two did not.
        assert value(reduced, "pccl_master_collectives_total", outcome="success") == 1
        assert value(reduced, "pccl_master_leases_total") == 1
        assert value(reduced, "pccl_master_leases_ended_total") == 0
        assert value(reduced, "pccl_master_collective_aborts_total") == 0

        # A peer dies mid-all-reduce: the lease ends, and the master settles the attempt
        # the survivors started under it: aborted, or it finished. Or the attempt ran
        # to its end under the lease before the kill (over TCP its data and the
        # members' agreement move in worker threads): then the master settles nothing.
        survivors = comms[:3]
        results = await die_mid_all_reduce(cluster, comms, 3, lambda i, c: c.all_reduce(data[i]))
        aborted = isinstance(results[0], pccl.CollectiveAborted)
        after = await scrape(url)
        assert value(after, "pccl_master_peers_left_total") == 1
        assert value(after, "pccl_master_leases_ended_total") == 1
        succeeded = value(after, "pccl_master_collectives_total", outcome="success")
        assert succeeded in ((1,) if aborted else (1, 2)), succeeded
        assert value(after, "pccl_master_collectives_total", outcome="aborted") == int(aborted)
        # Each of the four all-reduces counted once: the first through the master, the
        # next two under the lease, the last under the lease unless the master settled it.
        leased = value(after, "pccl_master_leased_collectives_total")
        assert leased + succeeded + aborted == 4, (leased, succeeded, aborted)
        assert value(after, "pccl_master_collective_aborts_total") >= int(aborted)
        assert value(after, "pccl_master_kicks_total", cause="liveness") == 0
        # The survivors go on: re-established, one more all-reduce (through the master:
        # the lease ended). After an attempt that succeeded, the survivors may not know
        # yet that the ring changed: then the master's verdict on this call tells them
        # (aborted, inputs restored), and the retry runs on the new ring.
        infos = await run_all(survivors, lambda i, c: c.all_reduce(data[i]))
        told = not aborted and all(
            isinstance(info, pccl.CollectiveAborted) and "ring changed" in str(info)
            for info in infos
        )
        if told:
            infos = await run_all(survivors, lambda i, c: c.all_reduce(data[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        final = await scrape(url)
        assert value(final, "pccl_master_collectives_total", outcome="success") == succeeded + 1
        assert value(final, "pccl_master_collectives_total", outcome="aborted") == aborted + told
        assert value(final, "pccl_master_world_size", group="0") == 3
        changes = "pccl_master_ring_changes_total"
        assert value(final, changes) > value(joined, changes)
        for comm in survivors:
            await comm.aclose()


async def test_a_run_that_ends_by_its_peers_leaving_counts_every_all_reduce(
    observed: tuple[Cluster, str], clock: object
) -> None:
    cluster, url = observed
    steps = 40
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        data = [np.arange(1000, dtype=np.float32) for _ in range(3)]
        for step in range(steps):
            if step == steps // 2:  # a joiner: its ring ends the first lease
                comms = await form_run(comms, [cluster.communicator("p2")])
            infos = await run_all(comms, lambda i, c: c.all_reduce(data[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        for comm in comms:
            await comm.aclose()
        samples = await scrape(url)
        while value(samples, "pccl_master_peers_left_total") < 3:
            samples = await scrape(url)  # until the master saw every peer leave
    successes = value(samples, "pccl_master_collectives_total", outcome="success")
    leased = value(samples, "pccl_master_leased_collectives_total")
    assert (successes, leased) == (2, steps - 2)
    assert value(samples, "pccl_master_leases_total") == 2
    assert value(samples, "pccl_master_leases_ended_total") == 2


async def test_status_shows_the_run_and_changes_nothing(
    observed: tuple[Cluster, str], clock: object
) -> None:
    cluster, url = observed
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        host, port = cluster.master_address.rsplit(":", 1)
        reply = await fetch_status(host, int(port), TCP_CONFIG)
        assert sorted(p.peer_id for p in reply.peers) == sorted(c.peer_id for c in comms)
        assert [(g.group, g.world, sorted(g.ring)) for g in reply.groups] == [
            (0, 3, sorted(c.peer_id for c in comms))
        ]
        assert all(p.phase == "accepted" for p in reply.peers)
        # Observers are not members: the run is as it was, and works.
        assert comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 3
        data = [np.ones(1000, dtype=np.float32) for _ in range(3)]
        infos = await run_all(comms, lambda i, c: c.all_reduce(data[i]))
        assert all(isinstance(info, pccl.ReduceInfo) and info.world_size == 3 for info in infos)
        samples = await scrape(url)
        assert value(samples, "pccl_master_peers_joined_total") == 3
        assert value(samples, "pccl_master_peers_left_total") == 0  # the observers do not count
        for comm in comms:
            await comm.aclose()
