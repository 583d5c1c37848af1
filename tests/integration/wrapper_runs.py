"""Runs of ``pccl_trio.torch``'s wrappers that the DiLoCo and DataParallel tests share.

A scenario takes a *trainer*: ``await train(comm, shard, pause=..., min_peers=...,
wrappers=...)`` trains one peer on ``comm`` to the end and returns what it ended with;
``pause(count)`` is awaited before each round (``count``: the run's steps so far, outer
steps for DiLoCo), so a scenario can hold a trainer at a known point of the run, and
``wrappers[shard]`` is set to the trainer's wrapper once it joined (a hand-written
loop sets none). A scenario that waits for peers asks a wrapper's ``hold``
(``hold_through``), never the wrapper's communicator, which the wrapper may be
using between boundaries. Every scenario has
a guard timeout (virtual on the memory network): a hang fails.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import torch
import trio
import trio.testing
from torch import nn

import pccl_trio as pccl
import pccl_trio.sync
import pccl_trio.torch as pccl_torch

from .blocking import BlockingPeer
from .conftest import Cluster, Masters, started

GUARD = 120  # seconds a scenario may take at most
RESTART_DELAY = 0.5  # seconds the run goes without a master

R = TypeVar("R")
Train = Callable[..., Awaitable[R]]


def seeded(model: nn.Module) -> None:
    """The same initial weights on every peer, from a generator of its own: trainers on
    worker threads must not share torch's global generator (``manual_seed`` races)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def async_view(wrapper: Any) -> pccl.Communicator:
    """A wrapper's communicator with the async API's surface (``BlockingPeer``)."""
    comm = wrapper.communicator
    if isinstance(comm, pccl_trio.sync.Communicator):
        return BlockingPeer(comm)  # type: ignore[return-value]
    return comm  # type: ignore[no-any-return]


async def hand_written_admission(comm: pccl.Communicator, state: pccl.SharedState, *,
                                 fresh: bool, min_peers: int) -> bool:
    """A hand-written loop's membership part (``docs/loop.md``): admit waiting peers,
    order the ring, sync; before step 1, below ``min_peers``, wait for them. ``fresh``:
    the communicator just connected. Whether the sync changed the state."""
    changed, waiting = False, False
    while True:
        if fresh or await comm.are_peers_pending(wait=math.inf if waiting else 0):
            if not fresh:
                await comm.update_topology()
            fresh = False
            if comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) >= 2:
                await comm.optimize_topology()
        changed |= (await comm.sync_shared_state(state)).rx_bytes > 0
        world = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
        waiting = state.revision == 0 and world < min_peers
        if not waiting:
            return changed


async def hold_through(wrapper: Any, peers: int) -> None:
    """``wrapper.hold(peers)``: a blocking wrapper's in a worker thread (its trainer's
    thread waits in the pause meanwhile), an async one's here."""
    if isinstance(wrapper, pccl_torch.AsyncDiLoCo | pccl_torch.AsyncDataParallel):
        await wrapper.hold(peers)
    else:
        await trio.to_thread.run_sync(wrapper.hold, peers, abandon_on_cancel=True)


class Gate:
    """Holds ``peers`` trainers at count ``at`` (``pause``) until ``open()``;
    ``reached`` is set once all of them wait there."""

    def __init__(self, peers: int, at: int) -> None:
        self.peers, self.at, self.waiting = peers, at, 0
        self.reached, self._open = trio.Event(), trio.Event()

    async def pause(self, count: int) -> None:
        if count != self.at or self._open.is_set():
            return
        self.waiting += 1
        if self.waiting == self.peers:
            self.reached.set()
        await self._open.wait()

    def open(self) -> None:
        self._open.set()


async def run_peers(cluster: Cluster, train: Train[R], shards: int, **options: Any) -> list[R]:
    """``shards`` trainers started together; their results by shard."""
    results: dict[int, R] = {}

    async def one(i: int) -> None:
        results[i] = await train(cluster.communicator(f"p{i}"), i, **options)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            for i in range(shards):
                nursery.start_soon(one, i)
    return [results[i] for i in sorted(results)]


async def joiner_mid_run(cluster: Cluster, train: Train[R], *, at: int,
                         **options: Any) -> list[R]:
    """Two founders (on the memory network p0 connects first, so peer ids and the
    ring are known) held at count ``at`` until a joiner is pending; every result."""
    comms = [cluster.communicator(host) for host in ("p0", "p1", "joiner")]
    results: list[R] = []
    held: set[int] = set()
    founders_held = trio.Event()
    wrappers: dict[int, Any] = {}

    async def hold(i: int, count: int) -> None:
        if count != at or i in held:
            return
        held.add(i)
        if len(held) == 2:
            founders_held.set()
        if i in wrappers:
            await hold_through(wrappers[i], 3)
        else:  # a hand-written loop: a vote both founders make here
            await comms[i].are_peers_pending(wait=math.inf)

    async def one(i: int, **more: Any) -> None:
        results.append(await train(comms[i], i, wrappers=wrappers, **options, **more))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(partial(one, i, min_peers=2, pause=partial(hold, i)))
                if cluster.memory is not None:
                    await trio.testing.wait_all_tasks_blocked()
            await founders_held.wait()
            nursery.start_soon(one, 2)
    return results


async def killed_mid_all_reduce(cluster: Cluster, train: Train[R], *, at: int,
                                **options: Any) -> list[R]:
    """Three trainers held at count ``at``; once let go, peer 2 dies while peer 0's
    all-reduce of tag 0 moves data. The survivors' results.

    Over TCP that all-reduce may end before it is seen (``started``): then the victim
    waits at its next count until it is dead, so that it cannot train to the end
    first however the threads are scheduled, and the kill comes once it waits there
    (the survivors' next all-reduce waits for it)."""
    wrappers: dict[int, Any] = {}
    gate = Gate(3, at=at)
    results: list[R] = []
    held, dead = trio.Event(), trio.Event()

    async def doomed_pause(count: int) -> None:
        await gate.pause(count)
        if count > at:
            held.set()
            await dead.wait()

    async def mid_all_reduce() -> None:
        async with trio.open_nursery() as race:
            async def seen() -> None:
                await started(async_view(wrappers[0]), 0, or_ended=cluster.memory is None)
                race.cancel_scope.cancel()

            async def waits() -> None:
                await held.wait()
                race.cancel_scope.cancel()

            race.start_soon(seen)
            race.start_soon(waits)

    async def survivor(i: int) -> None:
        results.append(await train(cluster.communicator(f"p{i}"), i, min_peers=3,
                                   pause=gate.pause, wrappers=wrappers, **options))

    async def victim() -> None:
        try:
            await train(cluster.communicator("p2"), 2, min_peers=3, pause=doomed_pause,
                        wrappers=wrappers, **options)
        except (pccl.PCCLError, trio.BrokenResourceError, trio.ClosedResourceError):
            return  # its process died
        raise AssertionError("the victim trained to the end")

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor, 0)
            nursery.start_soon(survivor, 1)
            async with trio.open_nursery() as doomed:
                doomed.start_soon(victim)
                await gate.reached.wait()
                gate.open()
                await mid_all_reduce()
                await cluster.kill("p2", async_view(wrappers[2]))
                dead.set()
    assert len(results) == 2
    return results


async def master_restarted(masters: Masters, train: Train[R], *, at: int,
                           **options: Any) -> list[R]:
    """Three trainers; the master dies when all reached count ``at`` and comes back
    at its address ``RESTART_DELAY`` later, while they go on. Every result."""
    with trio.fail_after(GUARD):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = [masters.communicator(f"p{i}", address) for i in range(3)]
        gate = Gate(3, at=at)
        results: list[R] = []

        async def one(i: int) -> None:
            results.append(await train(comms[i], i, min_peers=3, pause=gate.pause, **options))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
            await gate.reached.wait()
            scope.cancel()
            gate.open()
            await trio.sleep(RESTART_DELAY)  # the scenario: the run without a master
            await masters.start("master", port=port)
    assert len(results) == 3
    return results


async def kicked_and_back(cluster: Cluster, train: Train[R], *, cut_at: int, hold_at: int,
                          **options: Any) -> list[R]:
    """Peer 1 goes silent at count ``cut_at`` for five liveness timeouts (the memory
    network's partition): the run removes it and goes on; the others wait at
    ``hold_at`` until it is back (pending or in the run), else the run could end
    before it hears again; it is kicked and its wrapper joins again with a new
    communicator (checked here). Every result."""
    assert cluster.memory is not None, "partitions need the memory network"
    memory = cluster.memory
    wrappers: dict[int, Any] = {}
    comms = [cluster.communicator(f"p{i}") for i in range(3)]
    results: list[R] = []
    cut = trio.Event()

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:

            async def heal() -> None:
                await trio.sleep(5 * cluster.config.liveness_timeout)
                memory.heal("p1")

            async def cut_off(count: int) -> None:
                if count == cut_at and not cut.is_set():
                    cut.set()
                    memory.partition("p1")  # silently, as a pulled cable
                    nursery.start_soon(heal)

            async def hold(i: int, count: int) -> None:
                world = comms[i].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
                if count == hold_at and world < 3:
                    await hold_through(wrappers[i], 3)

            async def one(i: int) -> None:
                results.append(await train(
                    comms[i], i, min_peers=3, wrappers=wrappers,
                    pause=cut_off if i == 1 else partial(hold, i), **options,
                ))

            for i in range(3):
                nursery.start_soon(one, i)
    assert cut.is_set()
    assert len(results) == 3
    assert wrappers[1].communicator is not comms[1]  # it joined again
    assert wrappers[0].communicator is comms[0]
    return results
