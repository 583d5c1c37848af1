"""Honest mistakes and silent members end with an error, not a hang (both networks).

Peers that make different calls, or a member that makes none, used to wait forever.
The master's stall timeout (short here: 120 s of virtual time in memory, 1.5 s over
TCP) now refuses the waiting calls, naming each peer that did not make the call and
what it waits in; the run goes on afterwards.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import trio

import pccl_trio as pccl

from .conftest import MEMORY_CONFIG, RUN_SECRET, TCP_CONFIG, Cluster, form_run, unfused

MEMORY_STALL = dataclasses.replace(MEMORY_CONFIG, stall_timeout=120.0, stall_warning=10.0)
TCP_STALL = dataclasses.replace(TCP_CONFIG, stall_timeout=1.5, stall_warning=0.5)


@pytest.fixture
def master_config(network_kind: str) -> pccl.Config:
    if network_kind == "secret":
        return dataclasses.replace(MEMORY_STALL, run_secret=RUN_SECRET)
    return MEMORY_STALL if network_kind == "memory" else TCP_STALL


async def refused(call: object) -> tuple[pccl.PCCLError, float]:
    """The error ``call`` (an awaitable) raised, and after how long."""
    start = trio.current_time()
    with pytest.raises(pccl.PCCLError) as raised:
        await call  # type: ignore[misc]
    return raised.value, trio.current_time() - start


def on_time(cluster: Cluster, elapsed: float) -> None:
    """Refused at the stall timeout (in virtual time: to the heartbeat)."""
    if cluster.memory is not None:
        timeout = MEMORY_STALL.stall_timeout
        assert timeout <= elapsed <= timeout + MEMORY_STALL.heartbeat_interval, elapsed


async def still_reduces(comms: list[pccl.Communicator]) -> None:
    arrays = [np.full(64, float(i + 1), dtype=np.float32) for i in range(len(comms))]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    total = sum(range(1, len(comms) + 1))
    assert all((a == total).all() for a in arrays)


async def test_a_member_that_never_votes(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        silent = f"peer {comms[2].peer_id} is in no call"
        arrays = [np.full(64, 1.0, dtype=np.float32) for _ in range(2)]
        outcomes: list[tuple[pccl.PCCLError, float]] = []

        async def reduce(index: int) -> None:
            outcomes.append(await refused(comms[index].all_reduce(arrays[index])))

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(reduce, index)
        for error, elapsed in outcomes:
            assert isinstance(error, pccl.InvalidArgument), error
            assert "all_reduce(tag=0)" in str(error) and silent in str(error), error
            on_time(cluster, elapsed)
        assert all((a == 1.0).all() for a in arrays)  # untouched

        # The same for update_topology.
        outcomes.clear()

        async def update(index: int) -> None:
            outcomes.append(await refused(comms[index].update_topology()))

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(update, index)
        for error, elapsed in outcomes:
            assert isinstance(error, pccl.UpdateTopologyFailed), error
            assert "update_topology" in str(error) and silent in str(error), error
            on_time(cluster, elapsed)
        await still_reduces(comms)
        for comm in comms:
            await comm.aclose()


async def test_tag_0_against_tag_1(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        results: dict[int, tuple[pccl.PCCLError, float]] = {}

        async def reduce(index: int) -> None:
            array = np.ones(64, dtype=np.float32)
            results[index] = await refused(comms[index].all_reduce(array, tag=index))

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(reduce, index)
        for index, (error, elapsed) in results.items():
            assert isinstance(error, pccl.InvalidArgument), error
            other = comms[1 - index].peer_id
            assert f"all_reduce(tag={index})" in str(error), error
            waits = f"peer {other} waits in all_reduce(tag={1 - index})"
            if cluster.memory is not None:  # both voted at the same instant
                assert waits in str(error), error
            else:  # the later one may find the other refused already
                assert waits in str(error) or f"peer {other} is in no call" in str(error)
            on_time(cluster, elapsed)
        await still_reduces(comms)
        for comm in comms:
            await comm.aclose()


async def test_all_reduce_against_are_peers_pending(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        results: dict[str, tuple[pccl.PCCLError, float]] = {}

        async def reduce() -> None:
            results["reduce"] = await refused(comms[0].all_reduce(np.ones(8, np.float32)))

        async def ask() -> None:
            results["ask"] = await refused(comms[1].are_peers_pending())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reduce)
            nursery.start_soon(ask)
        error, elapsed = results["reduce"]
        assert isinstance(error, pccl.InvalidArgument), error
        assert f"peer {comms[1].peer_id} waits in are_peers_pending" in str(error), error
        on_time(cluster, elapsed)
        error, elapsed = results["ask"]
        assert isinstance(error, pccl.InvalidUsage), error
        assert f"peer {comms[0].peer_id} waits in all_reduce(tag=0)" in str(error), error
        on_time(cluster, elapsed)
        await still_reduces(comms)
        for comm in comms:
            await comm.aclose()


async def test_two_against_three_tensors(cluster: Cluster, clock: object) -> None:
    unfused(cluster)  # one all-reduce per tensor: the third waits for the other peer
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        tensors = [
            [np.full(32, float(i + 1), dtype=np.float32) for i in range(count)]
            for count in (2, 3)
        ]
        outcome: dict[int, object] = {}

        async def reduce(index: int) -> None:
            try:
                outcome[index] = await comms[index].all_reduce_multiple_with_retry(
                    tensors[index]
                )
            except pccl.PCCLError as exc:
                outcome[index] = exc

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(reduce, index)
        assert isinstance(outcome[0], pccl.ReduceInfo), outcome
        error = outcome[1]
        assert isinstance(error, pccl.InvalidArgument), error
        assert "tensors [2]" in str(error), error
        assert f"peer {comms[0].peer_id} is in no call" in str(error), error
        on_time(cluster, trio.current_time() - start)
        for index in range(2):
            assert (tensors[0][index] == tensors[1][index]).all()
            assert (tensors[1][index] == 2.0 * (index + 1)).all()
        assert (tensors[1][2] == 3.0).all()  # restored: never reduced
        await still_reduces(comms)
        for comm in comms:
            await comm.aclose()


async def test_a_joiner_the_members_never_admit(
    cluster: Cluster, clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pccl_trio.master")
    with trio.fail_after(600):
        (member,) = await form_run([], [cluster.communicator("member")])
        # The member is connected but never asks whether peers are pending.
        joiner = cluster.communicator("joiner")
        error, elapsed = await refused(joiner.connect())
        assert isinstance(error, pccl.Kicked), error
        assert "connect of peer" in str(error) and "did not admit it" in str(error), error
        assert f"peer {member.peer_id} is in no call" in str(error), error
        assert "update_topology()" in str(error), error
        on_time(cluster, elapsed)
        warnings = [
            r.getMessage() for r in caplog.records
            if r.getMessage().startswith("connect of peer") and "fails after" in r.getMessage()
        ]
        assert warnings and all(f"peer {member.peer_id} is in no call" in w for w in warnings)
        # The run goes on: a joiner the member admits takes part.
        comms = await form_run([member], [cluster.communicator("second")])
        await still_reduces(comms)
        for comm in comms:
            await comm.aclose()
