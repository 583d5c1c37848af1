"""Fixtures that run the same integration tests over both networks.

``memory``: the in-memory network under trio's autojump clock (virtual time, exact).
``tcp``: real loopback TCP sockets under the real clock, with short liveness timers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import Network, TcpNetwork, format_address

#: Real-clock timers: short enough for quick tests, long enough for a loaded CI box.
TCP_CONFIG = pccl.Config(heartbeat_interval=0.1, liveness_timeout=2.0, connect_timeout=5.0)
MEMORY_CONFIG = pccl.Config()


@pytest.fixture(params=["memory", "tcp"])
def network_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(network_kind: str) -> trio.testing.MockClock | None:
    """Virtual time for the memory network; tests take this fixture so pytest-trio
    runs them on it."""
    return trio.testing.MockClock(autojump_threshold=0) if network_kind == "memory" else None


@dataclasses.dataclass
class Cluster:
    kind: str
    master_address: str
    config: pccl.Config
    memory: MemoryNetwork | None
    master_scope: trio.CancelScope

    def network(self, host: str) -> Network:
        if self.memory is not None:
            return self.memory.host(host)
        return TcpNetwork()

    def communicator(
        self, host: str, peer_group: int = 0, pool_size: int = 0, **kwargs: object
    ) -> pccl.Communicator:
        if self.memory is None:
            kwargs.setdefault("p2p_host", "127.0.0.1")
        return pccl.Communicator(
            self.master_address,
            peer_group,
            pool_size,
            config=self.config,
            network=self.network(host),
            **kwargs,  # type: ignore[arg-type]
        )

    async def kill(self, host: str, comm: pccl.Communicator) -> None:
        """The peer's process dies: its connections break at once (FIN/RST)."""
        if self.memory is not None:
            self.memory.kill(host)
        await comm.aclose()

    def partition(self, host: str) -> None:
        assert self.memory is not None, "silent partitions need the memory network"
        self.memory.partition(host)


@pytest.fixture
async def cluster(
    network_kind: str, clock: trio.testing.MockClock | None, nursery: trio.Nursery
) -> AsyncIterator[Cluster]:
    scope = trio.CancelScope()

    async def run_master(*, task_status: trio.TaskStatus[tuple[MemoryNetwork | None, str]]) -> None:
        with scope:
            if network_kind == "memory":
                memory = MemoryNetwork()
                listener = await memory.host("master").listen("master", 48148)
                await pccl.serve_master(
                    [listener],
                    config=MEMORY_CONFIG,
                    task_status=_Relay(task_status, (memory, "master:48148")),
                )
            else:
                await pccl.serve_master_tcp(
                    0,
                    "127.0.0.1",
                    config=TCP_CONFIG,
                    task_status=_Relay(task_status, None),
                )

    memory, address = await nursery.start(run_master)
    yield Cluster(
        kind=network_kind,
        master_address=address,
        config=MEMORY_CONFIG if memory is not None else TCP_CONFIG,
        memory=memory,
        master_scope=scope,
    )
    scope.cancel()


class _Relay:
    """Turns the master's started value into (memory network, "host:port")."""

    def __init__(
        self, task_status: trio.TaskStatus[tuple[MemoryNetwork | None, str]], value: object
    ) -> None:
        self._task_status = task_status
        self._value = value

    def started(self, value: object = None) -> None:
        if isinstance(self._value, tuple):
            self._task_status.started(self._value)  # type: ignore[arg-type]
        else:
            host, port = value  # type: ignore[misc]
            self._task_status.started((None, format_address(host, port)))


async def all_do(comms: Sequence[pccl.Communicator], method: str) -> list[object]:
    """Call ``method`` on every communicator at once (a collective); return results."""
    results: list[object] = [None] * len(comms)

    async def one(index: int) -> None:
        results[index] = await getattr(comms[index], method)()

    async with trio.open_nursery() as nursery:
        for index in range(len(comms)):
            nursery.start_soon(one, index)
    return results


async def form_run(
    members: list[pccl.Communicator], joiners: Sequence[pccl.Communicator]
) -> list[pccl.Communicator]:
    """Connect ``joiners`` while ``members`` loop ``update_topology``, until all are in.

    Returns every member, joiners included, in the order given. With no members, the
    first joiner starts the run alone.
    """
    everyone = [*members, *joiners]
    members = list(members)
    pending = list(joiners)
    if not members and pending:
        first = pending.pop(0)
        await first.connect()
        members.append(first)
    send, receive = trio.open_memory_channel[pccl.Communicator](len(pending))

    async def join(comm: pccl.Communicator) -> None:
        await comm.connect()
        send.send_nowait(comm)

    async with trio.open_nursery() as nursery:
        for comm in pending:
            nursery.start_soon(join, comm)
        while pending:
            await all_do(members, "update_topology")
            world = members[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
            for _ in range(world - len(members)):  # the joiners this round admitted
                comm = await receive.receive()
                pending.remove(comm)
                members.append(comm)
    return everyone
