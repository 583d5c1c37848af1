"""When an all-reduce may be launched: each call is checked once, as it is launched,
and a state that forbids it is reported before the arguments are looked at."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl

from .conftest import Cluster, form_run


async def test_not_connected_comes_before_bad_arguments(cluster: Cluster, clock: object) -> None:
    comm = cluster.communicator("p0")
    bad = np.ones(4, np.complex64)  # no dtype of the wire
    with pytest.raises(pccl.InvalidUsage, match=r"call connect\(\) first"):
        await comm.all_reduce(bad)
    with pytest.raises(pccl.InvalidUsage, match=r"call connect\(\) first"):
        comm.all_reduce_async(bad)
    with pytest.raises(pccl.InvalidUsage, match=r"call connect\(\) first"):
        await comm.all_reduce_multiple_with_retry([np.ones(4, np.float32)])


async def test_an_all_reduce_during_a_blocking_call_is_refused(
    cluster: Cluster, clock: object
) -> None:
    """A peer waiting in update_topology's vote cannot take part in an all-reduce:
    each way of launching one says so, and the update goes on."""
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(comms[0].update_topology)
            await trio.testing.wait_all_tasks_blocked()
            says = r"all_reduce\(\) while update_topology\(\) runs on this communicator"
            with pytest.raises(pccl.InvalidUsage, match=says):
                comms[0].all_reduce_async(np.ones(4, np.float32))
            with pytest.raises(pccl.InvalidUsage, match=says):
                await comms[0].all_reduce(np.ones(4, np.float32))
            with pytest.raises(pccl.InvalidUsage, match=says):
                await comms[0].all_reduce_multiple_with_retry([np.ones(4, np.float32)])
            await comms[1].update_topology()
        arrays = [np.ones(4, np.float32) for _ in comms]
        async with trio.open_nursery() as nursery:
            for comm, array in zip(comms, arrays, strict=True):
                nursery.start_soon(comm.all_reduce_multiple_with_retry, [array])
        assert all((array == 2).all() for array in arrays)
        for comm in comms:
            await comm.aclose()
        with pytest.raises(pccl.InvalidUsage, match="closed; create a new Communicator"):
            comms[0].all_reduce_async(np.ones(4, np.float32))
