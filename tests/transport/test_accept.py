"""The guarded accept loop: the cap on connections before their first frame, the
back-off after a failed accept, and the end with the listener.

In virtual time (pytest-trio's ``autojump_clock``) over the in-memory network."""

from __future__ import annotations

import errno
import functools
import logging
from typing import Any

import pytest
import trio
import trio.testing

from pccl_trio.testing import MemoryNetwork
from pccl_trio.testing._memory import MemoryListener
from pccl_trio.transport import Arrived, serve_accepted
from pccl_trio.transport._accept import ACCEPT_BACKOFF

log = logging.getLogger("pccl_trio.test")


class Server:
    """A handler that holds each connection until told to let its first frame in, or
    to end."""

    def __init__(self) -> None:
        self.served: list[trio.abc.Stream] = []
        self.arrive: dict[int, Arrived] = {}
        self.done: dict[int, trio.Event] = {}

    async def handler(self, stream: trio.abc.Stream, arrived: Arrived) -> None:
        index = len(self.served)
        self.served.append(stream)
        self.arrive[index] = arrived
        self.done[index] = trio.Event()
        try:
            await self.done[index].wait()
        finally:
            await stream.aclose()


def serving(
    server: Server, listener: trio.abc.Listener[Any], nursery: trio.Nursery, *, max_fresh: int,
    **names: Any,
) -> functools.partial[Any]:
    """``serve_accepted`` of ``listener`` by ``server``, for ``nursery.start_soon``."""
    return functools.partial(
        serve_accepted, listener, server.handler, max_fresh=max_fresh, nursery=nursery, log=log,
        **names,
    )


async def listening(network: MemoryNetwork) -> MemoryListener:
    return await network.host("server").listen("server", 0)


async def refused(network: MemoryNetwork, listener: MemoryListener, client: str) -> bool:
    """Whether a new connection from ``client`` is closed at once, unserved."""
    stream = await network.host(client).connect("server", listener.port)
    with trio.move_on_after(1):
        ended = await stream.receive_some(1) == b""
        await stream.aclose()
        return ended
    await stream.aclose()
    return False


async def test_connections_past_the_cap_are_closed_until_one_arrives(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    network, server = MemoryNetwork(), Server()
    listener = await listening(network)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serving(server, listener, nursery, max_fresh=2))
            clients = [await network.host(f"c{i}").connect("server", listener.port) for i in range(2)]
            await trio.testing.wait_all_tasks_blocked()
            assert len(server.served) == 2
            assert await refused(network, listener, "extra")
            assert ("refusing a connection from extra: 2 connections have not sent their "
                    "first frame yet") in caplog.text
            server.arrive[0]()
            server.arrive[0]()  # once is enough: a second call frees no second place
            assert not await refused(network, listener, "third")  # served: room for one
            assert len(server.served) == 3
            assert await refused(network, listener, "fourth")
            server.done[1].set()  # a handler that ends without a frame frees its place
            await trio.testing.wait_all_tasks_blocked()
            assert not await refused(network, listener, "fifth")
            for stream in clients:
                await stream.aclose()
            for done in server.done.values():
                done.set()
            nursery.cancel_scope.cancel()


class FailingListener(trio.abc.Listener[trio.abc.Stream]):
    """A listener whose first ``accept`` fails as one out of file descriptors does,
    then hands out ``inner``'s connections."""

    def __init__(self, inner: MemoryListener) -> None:
        self.inner = inner
        self.failures = 1
        self.accepts: list[float] = []

    async def accept(self) -> trio.abc.Stream:
        self.accepts.append(trio.current_time())
        if self.failures:
            self.failures -= 1
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.inner.accept()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_failed_accept_is_logged_and_accepting_goes_on_after_a_pause(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    network, server = MemoryNetwork(), Server()
    listener = FailingListener(await listening(network))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(serving(server, listener, nursery, max_fresh=4))
            client = await network.host("c").connect("server", listener.inner.port)
            await trio.sleep(2 * ACCEPT_BACKOFF)
            assert len(server.served) == 1
            assert listener.accepts[1] - start == pytest.approx(ACCEPT_BACKOFF)
            assert "accepting a connection failed: [Errno 24] Too many open files" in caplog.text
            await client.aclose()
            server.done[0].set()
            nursery.cancel_scope.cancel()


async def test_the_loop_ends_with_its_listener(autojump_clock: trio.testing.MockClock) -> None:
    network, server = MemoryNetwork(), Server()
    listener = await listening(network)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            ended = trio.Event()

            async def run() -> None:
                await serve_accepted(listener, server.handler, max_fresh=1, nursery=nursery, log=log)
                ended.set()

            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            await listener.aclose()  # its owner closes it
            await ended.wait()


async def test_the_warnings_name_the_server_and_its_connections(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    network, server = MemoryNetwork(), Server()
    listener = await listening(network)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serving(
                server, listener, nursery, max_fresh=0, what="p2p connection",
                name=lambda: "peer 7: ",
            ))
            assert await refused(network, listener, "extra")
            assert ("peer 7: refusing a p2p connection from extra: 0 connections have not "
                    "sent their first frame yet") in caplog.text
            assert not server.served
            nursery.cancel_scope.cancel()
