"""The hand-written loop of docs/loop.md, run as written: a peer dying mid-step, a peer alone.

The block after the ``hand-written-loop`` marker in docs/loop.md is executed as it stands, with
the three functions it leaves to the trainer (``init_model``, ``compute_gradients``,
``apply_update``) defined here: a small model, each peer's gradient from its own data
shard, momentum SGD. ``pccl_trio.Communicator`` is swapped, for the test's duration,
for a factory that places each peer on its host of the test's network (which peer a
task is comes from a context variable), so the block's own ``Communicator(address,
peer_group=0)`` joins the test's master.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core import master as master_core
from pccl_trio._core.events import MessageReceived
from pccl_trio._core.messages import Heartbeat, PeerEndpoint, VotePeersPending
from pccl_trio.peer._shared_state import Fetcher
from pccl_trio.testing import PeerSeam

from .conftest import WITH_BLOCKING, Cluster
from .marked_blocks import ROOT, python_block_after

NETWORKS = WITH_BLOCKING

LOOP = ROOT / "docs" / "loop.md"
MARKER = "<!-- hand-written-loop: tests/integration/test_hand_written_loop.py runs the next block -->"
SIZE = 64


def loop_block() -> str:
    """The python block right after the marker in docs/loop.md."""
    return python_block_after(LOOP, MARKER)


class Died(Exception):
    """A peer's process ends (raised out of its training loop)."""


@dataclasses.dataclass
class Peer:
    """What the test knows of one training process."""

    host: str
    shard: int
    die_at: int | None = None  # the compute_gradients call that kills this peer
    cut_at: int | None = None  # the compute_gradients call that cuts this peer off
    failing_fetches: int = 0  # shared-state fetches that fail before one may succeed
    communicators: int = 0  # how many the block created
    weights: np.ndarray | None = None
    # How often compute_gradients saw each weights (a step computed again: 2).
    computed: Counter[bytes] = dataclasses.field(default_factory=Counter)


CURRENT: contextvars.ContextVar[Peer] = contextvars.ContextVar("hand_written_loop_peer")


class Trainer:
    """The trainer's side of the block, and ``run`` to run the block as a peer."""

    def __init__(self, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cluster = cluster
        self.nursery: trio.Nursery | None = None  # where a cut-off peer's healing runs
        real = pccl.Communicator

        def communicator(address: str, peer_group: int = 0) -> pccl.Communicator:
            peer = CURRENT.get()
            peer.communicators += 1
            extra: dict[str, Any] = {} if cluster.memory is not None else {"p2p_host": "127.0.0.1"}
            comm = real(
                address, peer_group, config=cluster.config,
                network=cluster.network(peer.host), **extra,
            )
            seam = PeerSeam(comm)
            fetch_from = seam.fetch_from

            async def failing(endpoint: PeerEndpoint, fetcher: Fetcher) -> None:
                if peer.failing_fetches > 0:
                    peer.failing_fetches -= 1
                    fetcher.failed(endpoint.peer_id, "the test failed this fetch")
                    return
                await fetch_from(endpoint, fetcher)

            seam.fetch_from = failing
            return comm

        monkeypatch.setattr(pccl, "Communicator", communicator)
        self.namespace: dict[str, Any] = {
            "__name__": "hand_written_loop",
            "init_model": self.init_model,
            "compute_gradients": self.compute_gradients,
            "apply_update": self.apply_update,
        }
        exec(compile(loop_block(), str(LOOP), "exec"), self.namespace)

    @staticmethod
    def init_model() -> tuple[np.ndarray, np.ndarray]:
        peer = CURRENT.get()
        # Each peer starts from weights of its own: the first sync makes them the run's.
        peer.weights = np.random.default_rng(100 + peer.shard).standard_normal(SIZE)
        return peer.weights, np.zeros(SIZE)

    def compute_gradients(self, weights: np.ndarray) -> np.ndarray:
        peer = CURRENT.get()
        peer.computed[weights.tobytes()] += 1
        if peer.die_at is not None and peer.computed.total() >= peer.die_at:
            if self.cluster.memory is not None:
                self.cluster.memory.kill(peer.host)  # its sockets break, as in a SIGKILL
            raise Died(peer.host)  # and its communicator closes on the way out
        if peer.cut_at is not None and peer.computed.total() == peer.cut_at:
            assert self.cluster.memory is not None and self.nursery is not None
            self.cluster.memory.partition(peer.host)  # silently, as a pulled cable
            self.nursery.start_soon(self.heal, peer.host)
        target = np.random.default_rng(peer.shard).standard_normal(SIZE)
        return weights - target  # the gradient of |weights - target|^2 / 2 on its shard

    async def heal(self, host: str) -> None:
        """Long past the liveness timeout: the run went on without ``host``."""
        assert self.cluster.memory is not None
        await trio.sleep(5 * self.cluster.config.liveness_timeout)
        self.cluster.memory.heal(host)

    @staticmethod
    def apply_update(weights: np.ndarray, momentum: np.ndarray, grads: np.ndarray) -> None:
        momentum *= 0.9
        momentum += grads
        weights -= 0.1 * momentum

    async def run(self, peer: Peer, steps: int) -> None:
        """The block's ``train(address, steps)``, as ``peer``."""
        CURRENT.set(peer)
        train: Callable[[str, int], Coroutine[Any, Any, None]] = self.namespace["train"]
        await train(self.cluster.master_address, steps)


class MasterSpy:
    """Counts the messages the master receives, by connection and type."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *, alarm: int, flood: int = 10_000
    ) -> None:
        self.counts: Counter[tuple[int, str]] = Counter()
        # Set after ``flood`` messages in all: peers that keep refusing each other
        # spin without letting virtual time pass, so no timeout would end the test.
        self.flooded = trio.Event()
        self.flood = flood
        self.asker: int | None = None
        self.waiting = trio.Event()  # the first pending-peers question arrived (from ``asker``)
        self.alarm = alarm
        self.spinning = trio.Event()  # the asker sent ``alarm`` messages after it
        handle = master_core.MasterCore.handle
        spy = self

        def counting(core: master_core.MasterCore, event: Any, now: float) -> Any:
            if isinstance(event, MessageReceived):
                spy.counts[event.conn, type(event.message).__name__] += 1
                if spy.counts.total() >= spy.flood:
                    spy.flooded.set()
                message = event.message
                if spy.asker is None and isinstance(message, VotePeersPending):
                    spy.asker = event.conn
                    spy.waiting.set()
                elif event.conn == spy.asker and not isinstance(message, Heartbeat):
                    spy.alarm -= 1
                    if spy.alarm <= 0:
                        spy.spinning.set()
            return handle(core, event, now)

        monkeypatch.setattr(master_core.MasterCore, "handle", counting)

    def sent_by(self, conn: int) -> int:
        """Messages from ``conn`` other than heartbeats."""
        return sum(n for (c, kind), n in self.counts.items() if c == conn and kind != "Heartbeat")


@pytest.mark.parametrize("network_kind", ["memory", "tcp"])
async def test_survivors_of_a_peer_death_end_bit_identical(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(cluster, monkeypatch)
    founder, victim, third = Peer("p0", shard=0), Peer("p1", shard=1, die_at=6), Peer("p2", shard=2)
    deaths: list[str] = []

    async def run(peer: Peer) -> None:
        try:
            await trainer.run(peer, steps=15)
        except Died as died:
            deaths.append(str(died))

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for peer in (founder, victim, third):  # they join whenever they connect
                nursery.start_soon(run, peer)

    assert deaths == ["p1"]
    assert founder.weights is not None and third.weights is not None
    assert founder.weights.tobytes() == third.weights.tobytes()
    # The step the death aborted was computed again, from the same weights.
    assert max(founder.computed.values()) == 2 and max(third.computed.values()) == 2


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_peer_whose_sync_failed_syncs_again_and_the_others_follow(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = MasterSpy(monkeypatch, alarm=1000)
    trainer = Trainer(cluster, monkeypatch)
    # Both start at revision 0 with weights of their own; the founder's win (the lower
    # peer id), so the joiner fetches them, and its first fetch fails: its sync raises
    # SharedStateSyncFailed while the founder's succeeds.
    founder, joiner = Peer("founder", shard=0), Peer("joiner", shard=1, failing_fetches=1)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:

            async def no_flood() -> None:
                await spy.flooded.wait()
                raise AssertionError(f"the peers spin: {spy.counts.most_common(4)}")

            nursery.start_soon(no_flood)
            async with trio.open_nursery() as peers:
                peers.start_soon(trainer.run, founder, 8)
                await spy.waiting.wait()  # it waits alone for company
                peers.start_soon(trainer.run, joiner, 8)
            nursery.cancel_scope.cancel()
    assert spy.counts.total() < 1000  # far from a flood

    assert joiner.failing_fetches == 0
    assert joiner.communicators == founder.communicators == 1
    assert founder.weights is not None and joiner.weights is not None
    assert founder.weights.tobytes() == joiner.weights.tobytes()
    # The founder's first all-reduce was ended before it ran (the joiner synced again):
    # it computed that step twice; the joiner computed every step once, from the
    # founder's weights.
    assert sorted(founder.computed.values()) == [1] * 7 + [2]
    assert sorted(joiner.computed.values()) == [1] * 8


@pytest.mark.parametrize("network_kind", ["memory"])  # virtual time: an hour alone
async def test_a_lone_peer_waits_without_round_trips_then_trains_with_a_joiner(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = MasterSpy(monkeypatch, alarm=3)
    trainer = Trainer(cluster, monkeypatch)
    alone, joiner = Peer("alone", shard=0), Peer("joiner", shard=1)
    with trio.fail_after(7200):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer.run, alone, 5)
            await spy.waiting.wait()  # its question, held by the master
            assert spy.asker is not None
            before = spy.sent_by(spy.asker)
            with trio.move_on_after(3600):
                await spy.spinning.wait()
            assert not spy.spinning.is_set(), "the lone peer kept asking the master"
            assert spy.sent_by(spy.asker) == before  # an hour alone: nothing but heartbeats
            assert not alone.computed
            nursery.start_soon(trainer.run, joiner, 5)

    assert alone.weights is not None and joiner.weights is not None
    assert alone.weights.tobytes() == joiner.weights.tobytes()
    assert sum(alone.computed.values()) == sum(joiner.computed.values()) == 5


@pytest.mark.parametrize("network_kind", ["memory"])  # partitions need the memory network
async def test_a_peer_cut_off_past_the_liveness_timeout_is_kicked_and_joins_anew(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(cluster, monkeypatch)
    founder, cut, third = Peer("p0", shard=0), Peer("p1", shard=1, cut_at=5), Peer("p2", shard=2)
    # Steps take virtual time (10 ms each way on every link), so that the run is still
    # going when the cut-off peer comes back.
    assert cluster.memory is not None
    hosts = ["master", "p0", "p1", "p2"]
    for source in hosts:
        for destination in hosts:
            if source != destination:
                cluster.memory.shape(source, destination, latency=0.01)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            trainer.nursery = nursery
            for peer in (founder, cut, third):
                nursery.start_soon(trainer.run, peer, 300)

    # Its master removed it; when the cable came back it was kicked, and it joined
    # again as a newcomer, whose first sync brought the run's weights.
    assert (founder.communicators, cut.communicators, third.communicators) == (1, 2, 1)
    assert founder.weights is not None and cut.weights is not None and third.weights is not None
    assert founder.weights.tobytes() == cut.weights.tobytes() == third.weights.tobytes()
