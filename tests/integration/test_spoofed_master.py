"""A master that is not one (a wrong address, a man in the middle): what a peer
accepts from its master link is checked like anything else from the network."""

from __future__ import annotations

import struct

import msgpack
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import Welcome
from pccl_trio.testing import MemoryNetwork


def raw_welcome(heartbeat_interval: float, liveness_timeout: float) -> bytes:
    """A Welcome with any timers (the record itself refuses to build a bad one)."""
    body = struct.pack(">BH", 1, Welcome.KIND) + msgpack.packb(
        [1, heartbeat_interval, liveness_timeout, False]  # no content digests
    )
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("interval", "liveness"), [(0.0, 2.0), (5.0, 2.0), (1.0, 1e9)],
    ids=["heartbeats-without-pause", "interval-over-timeout", "endless-timeout"],
)
async def test_a_welcome_with_impossible_timers_fails_connect_clearly(
    interval: float, liveness: float
) -> None:
    network = MemoryNetwork()
    listener = await network.host("master").listen("master", 48148)

    async def fake_master() -> None:
        stream = await listener.accept()
        await stream.receive_some(1 << 16)  # the Register
        await stream.send_all(raw_welcome(interval, liveness))
        await stream.receive_some(1 << 16)  # until the peer hangs up

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake_master)
            comm = pccl.Communicator("master:48148", 0, network=network.host("peer"))
            with pytest.raises(pccl.MasterConnectionError, match="Welcome: heartbeat interval"):
                await comm.connect()
            await comm.aclose()
            nursery.cancel_scope.cancel()
