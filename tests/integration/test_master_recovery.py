"""A run outlives its master: peers get a restarted master, or a standby, back.

On the in-memory network (virtual time) and over loopback TCP. Three peers train: every
step all-reduces (retried when aborted) and syncs the shared state, whose revision
each step advances. The master is killed mid-run (its task cancelled: every
connection closes at once, as when its process dies); peers must not fail: a new
master comes up at the same address 2 s later, or a standby that was up all along
takes over. Afterwards the revisions go on without a gap, no sync moves a byte (the
peers never diverged) and the weights end bit-identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import MemoryNetwork

from .conftest import TCP_CONFIG, form_run

STEPS = 12
KILL_AFTER = 4  # steps every peer completed before the master dies


@pytest.fixture(params=["memory", "tcp"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(kind: str) -> trio.testing.MockClock | None:
    return None if kind == "tcp" else trio.testing.MockClock(autojump_threshold=0)


@dataclasses.dataclass
class Masters:
    """Masters started and killed at will, on the memory network or loopback TCP."""

    kind: str
    nursery: trio.Nursery
    config: pccl.Config
    memory: MemoryNetwork | None

    async def start(self, name: str, port: int = 0) -> tuple[str, trio.CancelScope]:
        """A master at ``name`` (a memory host; over TCP, 127.0.0.1 at ``port``, 0: a
        free one): its address and the scope that kills it."""
        scope = trio.CancelScope()

        async def run(*, task_status: trio.TaskStatus[object]) -> None:
            with scope:
                if self.memory is not None:
                    listener = await self.memory.host(name).listen(name, 48148)
                    await pccl.serve_master([listener], config=self.config, task_status=task_status)
                else:
                    await pccl.serve_master_tcp(
                        port, "127.0.0.1", config=self.config, task_status=task_status
                    )

        started = await self.nursery.start(run)
        if self.memory is not None:
            return f"{name}:48148", scope
        return f"127.0.0.1:{started[1]}", scope  # type: ignore[index]

    def communicator(self, host: str, address: str) -> pccl.Communicator:
        network = self.memory.host(host) if self.memory is not None else pccl.TcpNetwork()
        return pccl.Communicator(
            address, config=self.config, network=network,
            **({"p2p_host": "127.0.0.1"} if self.memory is None else {}),
        )


@pytest.fixture
async def masters(kind: str, clock: object, nursery: trio.Nursery) -> AsyncIterator[Masters]:
    config = TCP_CONFIG if kind == "tcp" else pccl.Config()
    yield Masters(kind=kind, nursery=nursery, config=config,
                  memory=MemoryNetwork() if kind == "memory" else None)


@dataclasses.dataclass
class Progress:
    """Steps each peer completed, the bytes each sync after a peer's first received,
    and an event set once every peer completed ``KILL_AFTER`` steps."""

    steps: list[int]
    syncs: list[list[int]]
    stepped: trio.Event

    @classmethod
    def of(cls, peers: int) -> Progress:
        return cls(steps=[0] * peers, syncs=[[] for _ in range(peers)], stepped=trio.Event())


async def train(comms: list[pccl.Communicator], progress: Progress) -> list[pccl.SharedState]:
    """Every peer trains ``STEPS`` steps, reporting to ``progress``."""
    states = [
        pccl.SharedState([pccl.TensorInfo("w", np.zeros(50_000, np.float32))]) for _ in comms
    ]

    async def peer(i: int) -> None:
        comm, state = comms[i], states[i]
        weights = state.tensors[0].data
        for step in range(STEPS):
            grads = np.full(weights.shape, float(i + 1 + step), np.float32)
            while True:
                try:
                    await comm.all_reduce(grads)
                    break
                except pccl.CollectiveAborted:
                    grads[:] = float(i + 1 + step)  # restored anyway; keep it explicit
            weights -= 0.001 * grads
            state.revision += 1
            info = await comm.sync_shared_state(state)
            if step:
                progress.syncs[i].append(info.rx_bytes)
            progress.steps[i] += 1
            if min(progress.steps) >= KILL_AFTER:
                progress.stepped.set()

    async with trio.open_nursery() as nursery:
        for i in range(len(comms)):
            nursery.start_soon(peer, i)
    return states


async def kill_once_stepped(progress: Progress, scope: trio.CancelScope) -> None:
    await progress.stepped.wait()
    scope.cancel()


def check_run(states: list[pccl.SharedState], progress: Progress) -> None:
    assert progress.steps == [STEPS] * len(states)
    assert all(s.revision == STEPS for s in states)  # every step advanced it by one
    assert all(rx == 0 for peer in progress.syncs for rx in peer), progress.syncs  # no divergence
    first = states[0].tensors[0].data.tobytes()
    assert all(s.tensors[0].data.tobytes() == first for s in states)


async def test_a_master_restarted_at_the_same_address_takes_the_run_back(masters: Masters) -> None:
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        ids = [c.peer_id for c in comms]
        progress = Progress.of(3)

        async def restart() -> None:
            await kill_once_stepped(progress, scope)
            await trio.sleep(2.0)
            await masters.start("master", port=port)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart)
            states = await train(comms, progress)
        check_run(states, progress)
        assert [c.peer_id for c in comms] == ids  # every peer came back as itself
        for comm in comms:
            await comm.aclose()


async def test_a_standby_master_takes_the_run_over(masters: Masters) -> None:
    with trio.fail_after(120):
        first, scope = await masters.start("master")
        standby, _ = await masters.start("standby")
        address = f"{first},{standby}"
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        progress = Progress.of(3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_once_stepped, progress, scope)
            states = await train(comms, progress)
        check_run(states, progress)
        for comm in comms:
            await comm.aclose()


async def test_without_a_master_calls_fail_after_the_grace(masters: Masters) -> None:
    masters.config = dataclasses.replace(masters.config, master_grace=5.0)
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(2)])
        scope.cancel()
        with pytest.raises(pccl.MasterConnectionError, match="no master took this peer back"):
            await comms[0].update_topology()
        for comm in comms:
            await comm.aclose()


async def test_with_no_grace_losing_the_master_ends_the_communicator(masters: Masters) -> None:
    masters.config = dataclasses.replace(masters.config, master_grace=0.0)
    with trio.fail_after(60):
        address, scope = await masters.start("master")
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(2)])
        scope.cancel()
        with pytest.raises(pccl.MasterConnectionError, match="cannot go on without its master"):
            await comms[0].update_topology()
        for comm in comms:
            await comm.aclose()
