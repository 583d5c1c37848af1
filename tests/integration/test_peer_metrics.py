"""A peer's Prometheus metrics (``Config(metrics=...)``): every call counted by its
outcome, bytes and durations, restores, retries, syncs and master reconnects; served
over HTTP by the communicator itself with ``"HOST:PORT"``."""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import pccl_trio as pccl

from .conftest import (
    TCP_CONFIG,
    Cluster,
    Masters,
    die_mid_all_reduce,
    form_run,
    run_all,
    start_cluster,
    sync_all,
)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def peers(cluster: Cluster, count: int) -> tuple[list[pccl.Communicator], list[CollectorRegistry]]:
    """``count`` communicators, each with its own registry."""
    registries = [CollectorRegistry() for _ in range(count)]
    comms = []
    for i, registry in enumerate(registries):
        cluster_config = cluster.config
        cluster.config = dataclasses.replace(cluster_config, metrics=registry, slice_bytes=4096)
        comms.append(cluster.communicator(f"p{i}", 0, 2))
        cluster.config = cluster_config
    return comms, registries


async def test_all_reduces_aborts_and_syncs_are_counted(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms, registries = peers(cluster, 4)
        comms = await form_run([], comms)
        data = [np.arange(100_000, dtype=np.float32) for _ in range(4)]
        infos = []
        for _ in range(2):
            infos.append(await run_all(comms, lambda i, c: c.all_reduce(data[i])))
        # Barriers are counted apart: they move no tensor. So are the other collectives,
        # by their call.
        await run_all(comms, lambda i, c: c.barrier(tag=9))
        broadcasts = await run_all(comms, lambda i, c: c.broadcast(data[i], root=1, tag=10))
        await run_all(comms, lambda i, c: c.all_gather(data[i][:i + 1], tag=11))
        await run_all(comms, lambda i, c: c.reduce_scatter(data[i], tag=12))
        for i, registry in enumerate(registries):
            for called in ("broadcast", "all_gather", "reduce_scatter"):
                assert sample(registry, "pccl_peer_collectives_total", collective=called,
                              outcome="success") == 1
                assert sample(registry, "pccl_peer_collective_seconds_count",
                              collective=called, outcome="success") == 1
                assert sum(sample(registry, "pccl_peer_collective_bytes_total", collective=called,
                                  direction=d) for d in ("sent", "received")) > 0
            for direction, field in (("sent", "tx_bytes"), ("received", "rx_bytes")):
                assert sample(registry, "pccl_peer_collective_bytes_total", collective="broadcast",
                              direction=direction) == getattr(broadcasts[i], field)
            # Every part but its own, of 1 + 2 + 3 + 4 float32 elements.
            assert sample(registry, "pccl_peer_collective_bytes_total", collective="all_gather",
                          direction="received") == 4 * (10 - (i + 1))
            assert sample(registry, "pccl_peer_collective_bytes_total",
                          collective="reduce_scatter", direction="received") > 0
            assert sample(registry, "pccl_peer_barriers_total", outcome="success") == 1
            assert sample(registry, "pccl_peer_barrier_seconds_count", outcome="success") == 1
            assert sample(registry, "pccl_peer_all_reduces_total", outcome="success") == 2
            assert sample(registry, "pccl_peer_all_reduce_seconds_count", outcome="success") == 2
            sent = sum(step[i].tx_bytes for step in infos)  # type: ignore[attr-defined]
            assert sample(registry, "pccl_peer_all_reduce_bytes_total", direction="sent") == sent
            assert sample(registry, "pccl_peer_all_reduces_total", outcome="aborted") == 0

        survivors = comms[:3]
        results = await die_mid_all_reduce(cluster, comms, 3, lambda i, c: c.all_reduce(data[i]))
        aborted = isinstance(results[0], pccl.CollectiveAborted)
        for registry in registries[:3]:
            assert sample(registry, "pccl_peer_all_reduces_total", outcome="aborted") == aborted
            assert sample(registry, "pccl_peer_all_reduces_total", outcome="success") == 3 - aborted
            if aborted:  # in place: the input was put back
                assert sample(registry, "pccl_peer_restore_seconds_count") == 1

        states = [pccl.SharedState([pccl.TensorInfo("w", np.full(5000, float(i == 0), np.float32))])
                  for i in range(3)]
        for state in states[1:]:
            state.tensors[0].data[:] = 0  # peers 1 and 2 agree: they are the popular state
        sync_infos = await sync_all(survivors, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in sync_infos), sync_infos
        for registry, info in zip(registries, sync_infos, strict=False):
            assert sample(registry, "pccl_peer_shared_state_syncs_total", outcome="success") == 1
            assert sample(registry, "pccl_peer_shared_state_bytes_total", direction="received") == (
                info.rx_bytes  # type: ignore[attr-defined]
            )
        assert sample(registries[0], "pccl_peer_shared_state_bytes_total", direction="received") == 20000
        for comm in survivors:
            await comm.aclose()


async def test_retries_are_counted(cluster: Cluster, clock: object) -> None:
    """all_reduce_multiple_with_retry runs an aborted all-reduce again: counted once."""
    with trio.fail_after(120):
        comms, registries = peers(cluster, 3)
        comms = await form_run([], comms)
        tensors = [[np.ones(50_000, dtype=np.float32)] for _ in range(3)]
        results = await die_mid_all_reduce(
            cluster, comms, 2, lambda i, c: c.all_reduce_multiple_with_retry(tensors[i])
        )
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        for registry in registries[:2]:
            aborted = sample(registry, "pccl_peer_all_reduces_total", outcome="aborted")
            assert sample(registry, "pccl_peer_all_reduce_retries_total") == aborted
        for comm in comms[:2]:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])  # in virtual time
async def test_master_reconnects_are_counted(masters: Masters, clock: object) -> None:
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        registries = [CollectorRegistry() for _ in range(2)]
        masters.config = dataclasses.replace(masters.config, metrics=registries[0])
        first = masters.communicator("p0", address)
        masters.config = dataclasses.replace(masters.config, metrics=registries[1])
        second = masters.communicator("p1", address)
        comms = await form_run([], [first, second])
        scope.cancel()
        await trio.sleep(1.0)
        await masters.start("master")
        data = [np.ones(10, dtype=np.float32) for _ in range(2)]
        infos = await run_all(comms, lambda i, c: c.all_reduce(data[i]))
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        for registry in registries:
            assert sample(registry, "pccl_peer_master_reconnects_total") == 1
        for comm in comms:
            await comm.aclose()


async def test_a_peer_serves_its_metrics_while_connected(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, "tcp", dataclasses.replace(TCP_CONFIG, metrics="127.0.0.1:0"))
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        addresses = [c.metrics_address for c in comms]
        assert all(a is not None and a[1] > 0 for a in addresses)
        assert addresses[0] != addresses[1]  # one endpoint (and registry) each
        data = [np.ones(1000, dtype=np.float32) for _ in range(2)]
        await run_all(comms, lambda i, c: c.all_reduce(data[i]))

        def scrape(address: tuple[str, int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as r:
                text = r.read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        for address in addresses:
            samples = await trio.to_thread.run_sync(scrape, address)
            assert samples[("pccl_peer_all_reduces_total", (("outcome", "success"),))] == 1
        for comm in comms:
            await comm.aclose()
        cluster.master_scope.cancel()
        with pytest.raises(urllib.error.URLError):  # closed with the communicator
            await trio.to_thread.run_sync(scrape, addresses[0])


async def test_syncs_that_never_ran_or_were_cancelled_are_told_apart(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(120):
        comms, registries = peers(cluster, 2)
        comms = await form_run([], comms)
        with pytest.raises(pccl.InvalidArgument):
            await comms[0].sync_shared_state("not a shared state")  # type: ignore[arg-type]
        state = pccl.SharedState([pccl.TensorInfo("w", np.zeros(10, np.float32))])
        with trio.move_on_after(1.0):  # the other peer never syncs: give up waiting
            await comms[0].sync_shared_state(state)
        registry = registries[0]
        assert sample(registry, "pccl_peer_shared_state_syncs_total", outcome="rejected") == 1
        assert sample(registry, "pccl_peer_shared_state_syncs_total", outcome="cancelled") == 1
        assert sample(registry, "pccl_peer_shared_state_syncs_total", outcome="success") == 0
        for comm in comms:
            await comm.aclose()
