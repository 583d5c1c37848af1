"""What each network offers: ``DiscoveringNetwork`` and ``reaches_other_machines``."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import DiscoveringNetwork, Network, TcpNetwork, reaches_other_machines


class ListenAndConnect:
    """A network with ``listen`` and ``connect`` only."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        raise OSError("unused")

    async def listen(self, host: str, port: int) -> trio.abc.Listener[Any]:
        raise OSError("unused")


# Checked statically too: both networks satisfy the protocol as written.
TCP: DiscoveringNetwork = TcpNetwork()
MEMORY: DiscoveringNetwork = MemoryNetwork().host("a")
PLAIN: Network = ListenAndConnect()


def test_tcp_and_memory_hosts_find_masters_and_reserve_ports() -> None:
    assert isinstance(TCP, DiscoveringNetwork)
    assert isinstance(MEMORY, DiscoveringNetwork)
    assert not isinstance(PLAIN, DiscoveringNetwork)


def test_only_tcp_reaches_other_machines() -> None:
    assert reaches_other_machines(TCP)
    assert not reaches_other_machines(MEMORY)
    assert not reaches_other_machines(PLAIN)


async def test_a_memory_reservation_refuses_dials_until_it_listens(
    autojump_clock: trio.abc.Clock,
) -> None:
    network = MemoryNetwork()
    host = network.host("a")
    reservation = await host.reserve("a")
    with pytest.raises(OSError):
        await network.host("b").connect("a", reservation.port)
    listener = await reservation.listen()
    stream = await network.host("b").connect("a", reservation.port)
    await stream.aclose()
    await listener.aclose()


async def test_the_kernel_knows_a_tcp_stream_round_trip_and_nothing_of_a_memory_one() -> None:
    from pccl_trio.transport import kernel_round_trip, listener_address

    listener = await TCP.listen("127.0.0.1", 0)
    host, port = listener_address(listener)
    stream = await TCP.connect(host, port)
    accepted = await listener.accept()
    try:
        # Both ends: the connecting one sizes its pool by it, the accepting one decides
        # by it whether notices go back (``_pools.NOTICES_BACK_FROM``).
        for end in (stream, accepted):
            round_trip = kernel_round_trip(end)
            assert round_trip is not None and 0.0 <= round_trip < 1.0
    finally:
        await accepted.aclose()
        await stream.aclose()
        await listener.aclose()
    network = MemoryNetwork()
    memory_listener = await network.host("b").listen("b", 1)
    memory_stream = await network.host("a").connect("b", 1)
    assert kernel_round_trip(memory_stream) is None
    await memory_stream.aclose()
    await memory_listener.aclose()
