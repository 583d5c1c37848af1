"""What a stranger can do to a peer's p2p port before any handshake (both networks).

A first frame is judged from its 7-byte header: only the first-frame kinds, each
within its size limit, and the buffer grows with the bytes that arrive, never from a
length not read yet. At most ``MAX_NEW_CONNECTIONS`` connections may wait for their
first frame; more are closed at once.
"""

from __future__ import annotations

import struct

import numpy as np
import trio

import pccl_trio as pccl
from pccl_trio._core.channel import MAGIC
from pccl_trio._core.messages import P2PHello, P2PHelloAck
from pccl_trio.peer import _p2p
from pccl_trio.testing import PeerSeam

from .conftest import Cluster, form_run


async def p2p_port(cluster: Cluster, comm: pccl.Communicator, host: str) -> trio.abc.Stream:
    """A fresh connection from ``host`` to ``comm``'s p2p listener."""
    address = PeerSeam(comm).p2p_address
    target = "127.0.0.1" if cluster.memory is None else address[0]
    return await cluster.network(host).connect(target, address[1])


async def hung_up(stream: trio.abc.Stream) -> bytes:
    """Everything the other side sent until it closed the connection."""
    received = b""
    try:
        while chunk := await stream.receive_some(1 << 16):
            received += chunk
    except trio.BrokenResourceError:
        pass
    await stream.aclose()
    return received


async def reduce_together(comms: list[pccl.Communicator]) -> None:
    arrays = [np.full(256, 2.0, dtype=np.float32) for _ in comms]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    assert all((a == 2.0 * len(comms)).all() for a in arrays)


async def test_first_frames_are_judged_from_their_header(cluster: Cluster, clock: object) -> None:
    cluster.plain_frames()
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        started = trio.current_time()
        cases = {
            # A P2PHello announcing a megabyte: refused before a byte of its body.
            "big": struct.pack(">IBH", 1 << 20, 1, P2PHello.KIND),
            # A kind no connection may open with.
            "ack": struct.pack(">IBH", 3, 1, P2PHelloAck.KIND),
            # Not a control frame at all.
            "data": struct.pack(">IBH", 40, 2, 0),
        }
        for name, header in cases.items():
            stream = await p2p_port(cluster, comms[0], name)
            await stream.send_all(header)
            assert await hung_up(stream) == b""
        if cluster.memory is not None:  # virtual time: refused at once, not timed out
            assert trio.current_time() - started < cluster.config.connect_timeout
        await reduce_together(comms)
        for comm in comms:
            await comm.aclose()


async def test_connections_waiting_for_a_first_frame_are_capped(
    cluster: Cluster, clock: object
) -> None:
    """Each of them only sent a length prefix announcing a megabyte (once, 300 such
    connections cost a peer 300 MiB until they timed out); with a run secret, the
    opening of a handshake (a plain prefix is refused there at once)."""
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        prefix = struct.pack(">I", 1 << 20) if cluster.config.run_secret is None else MAGIC
        waiting = []
        for index in range(_p2p.MAX_NEW_CONNECTIONS):
            stream = await p2p_port(cluster, comms[0], f"slow{index}")
            await stream.send_all(prefix)
            waiting.append(stream)
        extra = await p2p_port(cluster, comms[0], "extra")
        ended: list[str] = []

        async def ends(name: str, stream: trio.abc.Stream) -> None:
            assert await hung_up(stream) == b""
            ended.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ends, "extra", extra)
            nursery.start_soon(ends, "oldest waiting", waiting[0])
        # Closed at once, long before the oldest waiting one met its deadline.
        assert ended == ["extra", "oldest waiting"]
        await reduce_together(comms)  # the ring's own connections are long established
        for stream in waiting[1:]:  # each dropped at the first-frame deadline
            assert await hung_up(stream) == b""
        late = await p2p_port(cluster, comms[0], "late")  # room again
        await late.send_all(struct.pack(">IBH", 3, 1, P2PHelloAck.KIND))
        assert await hung_up(late) == b""
        for comm in comms:
            await comm.aclose()
