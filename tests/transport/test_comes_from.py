"""``comes_from``: whether a connection's other end is the host the master names.

Over TCP an address matches itself (an IPv4-mapped IPv6 address its IPv4 form too) and
a host name matches the addresses it resolves to; on the in-memory network host names
are compared as they are.
"""

from __future__ import annotations

import pytest
import trio

from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import TcpNetwork, comes_from, listener_address


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("127.0.0.2", False),
        ("::1", False),
        ("10.0.0.1", False),
    ],
)
async def test_a_tcp_connection_from_loopback(host: str, expected: bool) -> None:
    with trio.fail_after(30):
        listener = await TcpNetwork().listen("127.0.0.1", 0)
        port = listener_address(listener)[1]
        client = await TcpNetwork().connect("127.0.0.1", port)
        server = await listener.accept()
        try:
            assert await comes_from(server, host) is expected
        finally:
            for resource in (client, server, listener):
                await resource.aclose()


async def test_memory_hosts_are_compared_by_name(autojump_clock: trio.abc.Clock) -> None:
    network = MemoryNetwork()
    listener = await network.host("b").listen("b", 0)
    client = await network.host("a").connect("b", listener.port)
    server = await listener.accept()
    assert await comes_from(server, "a")
    assert not await comes_from(server, "b")
    assert not await comes_from(server, "127.0.0.1")
    await client.aclose()
    await server.aclose()
