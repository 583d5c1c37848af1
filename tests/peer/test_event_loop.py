"""A communicator lives in the trio.run that connected it: a call from another
trio.run, after that one ended, from asyncio or from no event loop at all is an
``InvalidUsage`` that says which, never a failure deep inside the communicator.

Each test runs its own event loops (these are plain functions, not trio tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio.testing import MemoryNetwork


def connected_in_a_run_that_ended() -> pccl.Communicator:
    """A communicator connected (alone, to an in-memory master) in a trio.run that has
    returned since."""
    box: list[pccl.Communicator] = []

    async def run() -> None:
        network = MemoryNetwork()
        async with trio.open_nursery() as nursery:
            listener = await network.host("master").listen("master", 48148)
            await nursery.start(lambda task_status: pccl.serve_master([listener], task_status=task_status))
            comm = pccl.Communicator("master:48148", 0, 0, network=network.host("p0"))
            await comm.connect()
            box.append(comm)
            nursery.cancel_scope.cancel()

    trio.run(run)
    return box[0]


CALLS: dict[str, Callable[[pccl.Communicator], Coroutine[Any, Any, object]]] = {
    "all_reduce()": lambda c: c.all_reduce(np.ones(4, np.float32)),
    "all_reduce_multiple_with_retry()": lambda c: c.all_reduce_multiple_with_retry(
        [np.ones(4, np.float32)]
    ),
    "update_topology()": lambda c: c.update_topology(),
    "optimize_topology()": lambda c: c.optimize_topology(),
    "are_peers_pending()": lambda c: c.are_peers_pending(),
    "sync_shared_state()": lambda c: c.sync_shared_state(
        pccl.SharedState([pccl.TensorInfo("w", np.ones(4, np.float32))])
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_in_another_trio_run_after_the_first_ended_says_so(call: str) -> None:
    comm = connected_in_a_run_that_ended()

    async def use() -> None:
        with trio.fail_after(30), pytest.raises(pccl.InvalidUsage) as raised:
            await CALLS[call](comm)
        message = str(raised.value)
        assert message.startswith(f"{call} was called in another trio.run"), message
        assert "that trio.run has ended" in message and "create and connect a new" in message
        await comm.aclose()  # its connections ended with that run: closing is quiet
        await comm.aclose()

    trio.run(use)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_from_asyncio_says_that_pccl_trio_runs_on_trio(call: str) -> None:
    comm = connected_in_a_run_that_ended()
    with pytest.raises(pccl.InvalidUsage) as raised:
        asyncio.run(CALLS[call](comm))  # type: ignore[arg-type]
    assert str(raised.value).startswith(f"{call} was called from asyncio, but pccl_trio runs on Trio")


def test_connect_from_asyncio_and_a_launch_outside_any_loop_say_where_they_were() -> None:
    comm = pccl.Communicator("127.0.0.1:1", 0, 0, config=pccl.Config(insecure=True))
    with pytest.raises(pccl.InvalidUsage, match=r"^connect\(\) was called from asyncio"):
        asyncio.run(comm.connect())  # type: ignore[arg-type]
    with pytest.raises(pccl.InvalidUsage, match=r"^all_reduce_async\(\) was called outside any event loop"):
        comm.all_reduce_async(np.ones(4, np.float32))
