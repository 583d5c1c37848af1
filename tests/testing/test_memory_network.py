"""Link shaping on the in-memory network: bandwidth and latency in virtual time.

Every test takes pytest-trio's ``autojump_clock`` (a ``MockClock`` with
``autojump_threshold=0``), so it runs in virtual time and the times asserted are exact."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from pccl_trio.testing import MemoryNetwork
from pccl_trio.testing._memory import MemoryListener, MemoryStream

MB = 1_000_000
EPS = 1e-9


async def connect(
    network: MemoryNetwork, client: str = "a", server: str = "b", listener: MemoryListener | None = None
) -> tuple[MemoryStream, MemoryStream]:
    """A connection from ``client`` to ``server``: (client end, server end)."""
    if listener is None:
        listener = await network.host(server).listen(server, 0)
    client_end = await network.host(client).connect(server, listener.port)
    server_end = await listener.accept()
    return client_end, server_end


async def receive_exactly(stream: MemoryStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some()
        assert chunk, "unexpected end of stream"
        data += chunk
    return bytes(data)


async def test_rate_paces_a_transfer(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=MB)
    a, b = await connect(network)
    payload = bytes(range(256)) * (MB // 256) + b"x" * (MB % 256)
    received: list[float] = []

    async def reader() -> None:
        assert await receive_exactly(b, MB) == payload
        received.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        start = trio.current_time()
        await a.send_all(payload)
        sent = trio.current_time()
    assert sent - start == pytest.approx(1.0, abs=EPS)  # the sender is paced by the wire
    assert received[0] - start == pytest.approx(1.0, abs=EPS)


async def test_latency_delays_arrival(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", latency=0.25)
    a, b = await connect(network)
    start = trio.current_time()
    await a.send_all(b"!")
    assert trio.current_time() == start  # unlimited rate: the send itself is instant
    assert await b.receive_some() == b"!"
    assert trio.current_time() - start == pytest.approx(0.25, abs=EPS)


async def test_rate_and_latency_add_up(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1000, latency=0.5)
    a, b = await connect(network)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, b"y" * 500)
        assert await receive_exactly(b, 500) == b"y" * 500
    assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)


async def test_connections_between_a_pair_share_the_rate(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=MB)
    listener = await network.host("b").listen("b", 0)
    first = await connect(network, listener=listener)
    second = await connect(network, listener=listener)
    start = trio.current_time()
    finished: list[float] = []

    async def transfer(pair: tuple[MemoryStream, MemoryStream]) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pair[0].send_all, b"z" * MB)
            assert await receive_exactly(pair[1], MB) == b"z" * MB
        finished.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(transfer, first)
        nursery.start_soon(transfer, second)
    assert sorted(finished) == pytest.approx([1.0, 2.0], abs=EPS)


async def test_other_pairs_are_not_shaped(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=MB)
    listener = await network.host("b").listen("b", 0)
    a_to_b, _ = await connect(network, listener=listener)
    c_to_b, b_from_c = await connect(network, client="c", listener=listener)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a_to_b.send_all, b"q" * MB)  # occupies the a->b wire for 1 s
        await trio.sleep(0.25)
        await c_to_b.send_all(b"q" * MB)
        assert await receive_exactly(b_from_c, MB) == b"q" * MB
        assert trio.current_time() - start == pytest.approx(0.25, abs=EPS)
    assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)


async def test_directions_are_independent(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1, latency=5.0)
    a, b = await connect(network)
    start = trio.current_time()
    await b.send_all(b"fast" * 1000)
    assert await receive_exactly(a, 4000) == b"fast" * 1000
    assert trio.current_time() == start


async def test_order_is_kept_across_sends(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=100, latency=0.1)
    a, b = await connect(network)
    messages = [bytes([i]) * (i + 1) for i in range(20)]
    async with trio.open_nursery() as nursery:

        async def sender() -> None:
            for message in messages:
                await a.send_all(message)

        nursery.start_soon(sender)
        total = sum(len(m) for m in messages)
        assert await receive_exactly(b, total) == b"".join(messages)


async def test_partial_reads_see_only_arrived_bytes(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", latency=1.0)
    a, b = await connect(network)
    start = trio.current_time()
    await a.send_all(b"one")
    await trio.sleep(0.5)
    await a.send_all(b"two")
    assert await b.receive_some() == b"one"  # arrives at 1.0; "two" is still in flight
    assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)
    view = memoryview(bytearray(10))
    assert await b.receive_into(view) == 3
    assert bytes(view[:3]) == b"two"
    assert trio.current_time() - start == pytest.approx(1.5, abs=EPS)


async def test_end_of_stream_follows_in_flight_bytes(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1000, latency=2.0)
    a, b = await connect(network)
    start = trio.current_time()
    await a.send_all(b"d" * 1000)
    await a.aclose()
    assert await receive_exactly(b, 1000) == b"d" * 1000
    assert trio.current_time() - start == pytest.approx(3.0, abs=EPS)
    assert await b.receive_some() == b""


async def test_bytes_in_flight_arrive_after_the_sender_dies(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", latency=1.0)
    a, b = await connect(network)
    await a.send_all(b"last words")
    network.kill("a")
    assert await receive_exactly(b, 10) == b"last words"
    assert await b.receive_some() == b""


@pytest.mark.parametrize(
    ("end", "error"),
    [("kill", trio.BrokenResourceError), ("close", trio.ClosedResourceError)],
)
async def test_a_receiver_waiting_for_bytes_in_flight_is_woken(
    autojump_clock: trio.testing.MockClock, end: str, error: type[Exception]
) -> None:
    """Killing the receiver's host, or closing its end, wakes it at once, not when the
    bytes would have arrived."""
    network = MemoryNetwork()
    network.shape("a", "b", latency=10.0)
    a, b = await connect(network)
    await a.send_all(b"never read")
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def reader() -> None:
            with pytest.raises(error):
                await b.receive_some()
            assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)

        nursery.start_soon(reader)
        await trio.sleep(1.0)
        if end == "kill":
            network.kill("b")
        else:
            b.close_now()


async def test_closing_or_killing_wakes_a_paced_sender(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=MB)
    listener = await network.host("b").listen("b", 0)
    first, _ = await connect(network, listener=listener)
    second, second_remote = await connect(network, listener=listener)
    third, _ = await connect(network, client="a", listener=listener)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def send(stream: MemoryStream, error: type[Exception]) -> None:
            with pytest.raises(error):
                await stream.send_all(b"s" * 10 * MB)
            assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)

        nursery.start_soon(send, first, trio.ClosedResourceError)
        nursery.start_soon(send, second, trio.BrokenResourceError)
        await trio.sleep(1.0)
        first.close_now()  # our own close
        second_remote.close_now()  # the reader went away: a reset
    # Killing the sender's host (here: with a partition in force) wakes it too.
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, third, trio.BrokenResourceError)
        await trio.sleep(1.0)
        network.partition("a")
        network.kill("a")


async def test_bytes_sent_during_a_partition_vanish(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1000, latency=1.0)
    a, b = await connect(network)
    network.partition("b")
    start = trio.current_time()
    await a.send_all(b"lost" * 1000)
    assert trio.current_time() == start  # nothing went on the wire
    network.heal("b")
    await a.send_all(b"kept")
    assert await b.receive_some() == b"kept"
    assert trio.current_time() - start == pytest.approx(1.004, abs=EPS)


@pytest.mark.parametrize(
    ("rate", "latency"),
    [
        (0, 0.0),
        (-1, 0.0),
        (math.inf, 0.0),
        (math.nan, 0.0),
        (None, -0.1),
        (None, math.inf),
        (None, math.nan),
        (1000, -1.0),
    ],
)
async def test_bad_arguments_raise(
    rate: float | None, latency: float, autojump_clock: trio.testing.MockClock
) -> None:
    network = MemoryNetwork()
    with pytest.raises(ValueError, match="rate|latency"):
        network.shape("a", "b", rate=rate, latency=latency)
    assert not network._links


async def test_unshaping_restores_instant_delivery(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1000, latency=1.0)
    a, b = await connect(network)
    network.shape("a", "b")  # the defaults remove the shaping
    start = trio.current_time()
    await a.send_all(b"u" * MB)
    assert await receive_exactly(b, MB) == b"u" * MB
    assert trio.current_time() == start


async def test_unshaping_keeps_order_behind_bytes_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", latency=1.0)
    a, b = await connect(network)
    start = trio.current_time()
    await a.send_all(b"first ")
    network.shape("a", "b", rate=None, latency=0.0)
    await a.send_all(b"second")
    assert await receive_exactly(b, 12) == b"first second"
    assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)
    await a.send_all(b"!")  # nothing in flight any more: instant
    assert await b.receive_some() == b"!"
    assert trio.current_time() - start == pytest.approx(1.0, abs=EPS)


async def test_reshaping_applies_to_later_sends(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.shape("a", "b", rate=1000)
    a, b = await connect(network)
    start = trio.current_time()
    await a.send_all(b"r" * 1000)
    network.shape("a", "b", rate=2000, latency=0.5)
    await a.send_all(b"r" * 1000)
    assert trio.current_time() - start == pytest.approx(1.5, abs=EPS)
    assert await receive_exactly(b, 2000) == b"r" * 2000
    assert trio.current_time() - start == pytest.approx(2.0, abs=EPS)
