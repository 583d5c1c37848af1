"""Whether a tx pool is healthy (``Pool.healthy``), which decides in a round whether
it is kept: a connection its successor closed is not, even while the reader of what
comes back on it (slot 0) has not noticed yet, and unread bytes on it are no close."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
import trio

from pccl_trio.peer._pools import Pool
from pccl_trio.transport import SocketLink

TIMEOUT = 10


@pytest.fixture
def pool() -> Iterator[tuple[Pool, list[socket.socket]]]:
    """A tx pool of two TCP connections, slot 0 read by a backward reader (only
    marked: no reader runs, as one that has not woken yet), and their far ends."""
    links: dict[int, SocketLink] = {}
    far: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        for slot in (0, 1):
            mine = socket.create_connection(server.getsockname())
            theirs, _ = server.accept()
            links[slot] = SocketLink(mine, max_data_frame=1 << 20)
            far.append(theirs)
    made = Pool(peer_id=2, slots=dict(links), size=2, read={0})
    yield made, far
    for link in links.values():
        link.cut()
    for end in far:
        end.close()


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(TIMEOUT):
        while not predicate():
            await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("slot", [0, 1], ids=["read", "unread"])
async def test_a_connection_closed_by_the_successor_makes_the_pool_unhealthy(
    pool: tuple[Pool, list[socket.socket]], slot: int
) -> None:
    made, far = pool
    assert made.healthy()
    far[slot].close()
    await until(lambda: not made.healthy())


async def test_bytes_waiting_for_the_backward_reader_are_no_close(
    pool: tuple[Pool, list[socket.socket]],
) -> None:
    made, far = pool
    far[0].sendall(b"a completion notice")
    await until(made.slots[0].closed_by_peer)  # arrived, unread
    assert made.healthy()
