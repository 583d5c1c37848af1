"""Fixtures that run the same integration tests over both networks.

``memory``: the in-memory network under trio's autojump clock (virtual time, exact).
``tcp``: real loopback TCP sockets under the real clock, with short liveness timers.
``secret``: the in-memory network again, with a run secret shared by the master and
every peer, so every connection is handshaken and every frame authenticated. Tests
that speak raw frames as a stranger skip it (``Cluster.plain_frames``): against a run
with a secret, a stranger gets nothing past the handshake (``test_run_secret``).
``sync``: loopback TCP as ``tcp``, each peer a ``pccl_trio.sync.Communicator`` driven
through its blocking calls (``blocking.BlockingPeer``); only for the modules that ask
for it (``NETWORKS = WITH_BLOCKING``), whose scenarios thus cover the blocking API.

Below the fixtures, the helpers and scenarios that several modules share: forming a
run, all peers doing one call, a run that trains through a master's death, masters
started and killed at will, shared-state fetches held or cut. A module keeps to itself
only what no other module uses.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
import pccl_trio.sync
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    Message,
    PeerEndpoint,
    SharedStateRange,
    SharedStateRequest,
)
from pccl_trio._core.wire import DataFrame, FrameDecoder
from pccl_trio.peer import _shared_state as sharing
from pccl_trio.testing import MemoryNetwork, PeerSeam
from pccl_trio.transport import FramedStream, Network, TcpNetwork, format_address

from .blocking import BlockingPeer

#: Real-clock timers: short enough for quick tests, long enough for a loaded CI box.
TCP_CONFIG = pccl.Config(heartbeat_interval=0.1, liveness_timeout=2.0, connect_timeout=5.0)
MEMORY_CONFIG = pccl.Config()
RUN_SECRET = b"integration tests' run secret"
SECRET_CONFIG = pccl.Config(run_secret=RUN_SECRET)
#: The peers' config per network kind.
CONFIGS = {"memory": MEMORY_CONFIG, "tcp": TCP_CONFIG, "secret": SECRET_CONFIG, "sync": TCP_CONFIG}
#: A module's ``NETWORKS`` that runs its scenarios against the blocking API too.
WITH_BLOCKING = ("memory", "tcp", "secret", "sync")
#: The kinds whose peers talk over loopback TCP under the real clock.
OVER_TCP = ("tcp", "sync")


@pytest.fixture(params=["memory", "tcp", "secret"])
def network_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets ``NETWORKS`` (a module whose runs bring their own secrets:
    ``("memory", "tcp")``) runs its tests on those networks only, as if each test that
    takes ``network_kind`` were marked ``parametrize("network_kind", NETWORKS)``; a
    test's own such mark still decides for that test. A test marked ``async_only``
    (it cancels calls, or replaces a step of a communicator with one that uses the
    test's own trio primitives, which a blocking peer's event loop cannot touch) skips
    the ``sync`` kind."""
    networks = getattr(metafunc.module, "NETWORKS", None)
    if networks is None or "network_kind" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("async_only") is not None:
        networks = tuple(kind for kind in networks if kind != "sync")
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "network_kind" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return
    metafunc.definition.add_marker(pytest.mark.parametrize("network_kind", networks))


@pytest.fixture
def clock(network_kind: str) -> trio.testing.MockClock | None:
    """Virtual time for the memory network; tests take this fixture so pytest-trio
    runs them on it."""
    return None if network_kind in OVER_TCP else trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def master_config(network_kind: str) -> pccl.Config:
    """The master's config (a test module may override this fixture)."""
    return CONFIGS[network_kind]


@dataclasses.dataclass
class Cluster:
    kind: str
    master_address: str
    config: pccl.Config
    memory: MemoryNetwork | None
    master_scope: trio.CancelScope
    # The blocking peers made (``sync``), whose event loops end with the test.
    blocking: list[BlockingPeer] = dataclasses.field(default_factory=list)

    def plain_frames(self) -> None:
        """Skip the test on a run with a secret: it speaks raw frames as a stranger."""
        if self.config.run_secret is not None:
            pytest.skip("speaks unauthenticated frames; see test_run_secret")

    def network(self, host: str) -> Network:
        if self.memory is not None:
            return self.memory.host(host)
        return TcpNetwork()

    def communicator(
        self, host: str, peer_group: int = 0, pool_size: int = 0, **kwargs: object
    ) -> pccl.Communicator:
        if self.memory is None:
            kwargs.setdefault("p2p_host", "127.0.0.1")
        if self.kind == "sync":
            peer = BlockingPeer(pccl_trio.sync.Communicator(
                self.master_address, peer_group, pool_size, config=self.config,
                network=self.network(host), **kwargs,  # type: ignore[arg-type]
            ))
            self.blocking.append(peer)
            return peer  # type: ignore[return-value]
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
    network_kind: str, clock: trio.testing.MockClock | None, nursery: trio.Nursery,
    master_config: pccl.Config,
) -> AsyncIterator[Cluster]:
    cluster = await start_cluster(nursery, network_kind, CONFIGS[network_kind], master_config)
    yield cluster
    await end_loops(cluster.blocking)
    cluster.master_scope.cancel()


async def end_loops(peers: Sequence[BlockingPeer]) -> None:
    """End the event loops of blocking peers, as the end of a test's trio run ends an
    async peer's: what a test left open is closed, and no thread outlives the test."""
    for peer in peers:
        await trio.to_thread.run_sync(peer.end_loop)


async def start_cluster(
    nursery: trio.Nursery, network_kind: str, config: pccl.Config,
    master_config: pccl.Config | None = None,
) -> Cluster:
    """A master with ``master_config`` (default: ``config``, the peers' config) on the
    in-memory network or on loopback TCP (``"tcp"``); cancel its ``master_scope`` to
    stop it."""
    master_config = master_config or config
    scope = trio.CancelScope()
    memory = None if network_kind in OVER_TCP else MemoryNetwork()

    async def run_master(*, task_status: trio.TaskStatus[object]) -> None:
        with scope:
            if memory is not None:
                listener = await memory.host("master").listen("master", 48148)
                await pccl.serve_master([listener], config=master_config, task_status=task_status)
            else:
                await pccl.serve_master_tcp(
                    0, "127.0.0.1", config=master_config, task_status=task_status
                )

    started = await nursery.start(run_master)
    if memory is not None:
        address = "master:48148"
    else:
        host, port = started  # type: ignore[misc]
        address = format_address(host, port)
    return Cluster(
        kind=network_kind, master_address=address, config=config, memory=memory,
        master_scope=scope,
    )


async def all_do(comms: Sequence[pccl.Communicator], method: str) -> list[object]:
    """Every communicator calls ``method`` at once (a collective that must work for
    all): the results, or the first error raised."""
    results = await run_all(comms, lambda _index, comm: getattr(comm, method)())
    for result in results:
        if isinstance(result, pccl.PCCLError):
            raise result
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


# --- helpers shared by the integration tests ------------------------------------------


def first_reply(data: bytes) -> Message | None:
    """The first frame the master sent before hanging up, if any."""
    decoder = FrameDecoder(max_control_frame=1 << 20)
    decoder.receive_data(data)
    frame = decoder.next_frame()
    return frame if isinstance(frame, Message) else None


async def exchange_raw(cluster: Cluster, host: str, *frames: bytes) -> Message | None:
    """Send ``frames`` to the master on a fresh connection from ``host``, read until
    the master hangs up, and return the first message it sent (None: none)."""
    cluster.plain_frames()
    master_host, port = cluster.master_address.rsplit(":", 1)
    stream = await cluster.network(host).connect(master_host, int(port))
    received = b""
    try:
        for frame in frames:
            await stream.send_all(frame)
        while chunk := await stream.receive_some(1 << 16):
            received += chunk
    except trio.BrokenResourceError:
        pass  # it hung up while we still sent: what it said before is what counts
    finally:
        await stream.aclose()
    return first_reply(received)

SMALL = pccl.Config(slice_bytes=256)  # many slices even for small buffers
FINE = pccl.Config(slice_bytes=4096)
ENFORCE = pccl.SharedStateSyncStrategy.ENFORCE_POPULAR


def unfused(cluster: Cluster) -> None:
    """Peers made from now on reduce one tensor per all-reduce in
    ``all_reduce_multiple_with_retry`` (tag = index): for tests that steer the retry
    engine by tag, or that mix it with single all-reduces on other peers."""
    cluster.config = dataclasses.replace(cluster.config, bucket_bytes=0)


def fine(cluster: Cluster) -> pccl.Config:
    """The cluster's config with ``FINE``'s slices."""
    return dataclasses.replace(cluster.config, slice_bytes=FINE.slice_bytes)


async def run_all(comms: Sequence[pccl.Communicator], call: object) -> list[object]:
    """Every communicator at once: ``call(index, comm)``'s result each, or the
    ``PCCLError`` it raised."""
    results: list[object] = [None] * len(comms)

    async def one(index: int) -> None:
        try:
            results[index] = await call(index, comms[index])  # type: ignore[operator]
        except pccl.PCCLError as exc:
            results[index] = exc

    async with trio.open_nursery() as nursery:
        for index in range(len(comms)):
            nursery.start_soon(one, index)
    return results


async def retried_after_an_abort(
    comms: Sequence[pccl.Communicator], call: object
) -> list[list[object]]:
    """``run_all(comms, call)``, once more if every peer's call was aborted: a collective
    that passed on a ring a departed peer was in leaves it stale, and the next call's
    abort re-establishes it (the same for every peer). Every round's results; the last
    is the one to check."""
    rounds = [await run_all(comms, call)]
    if all(isinstance(r, pccl.CollectiveAborted) for r in rounds[0]):
        rounds.append(await run_all(comms, call))
    return rounds


async def make_run(cluster: Cluster, world: int, config: pccl.Config | None = None,
                   pool: int = 0) -> list[pccl.Communicator]:
    if config is not None:
        cluster.config = dataclasses.replace(cluster.config, slice_bytes=config.slice_bytes)
    return await form_run([], [cluster.communicator(f"p{i}", 0, pool) for i in range(world)])


async def started(comm: pccl.Communicator, tag: int, *, or_ended: bool = False) -> bool:
    """Until this peer's attempt of ``tag`` has received data (it is mid-operation):
    True. ``or_ended``: False if the attempt ended before that was seen, else that
    fails the test. Over TCP an attempt under a lease needs no master and its data
    moves in worker threads, so it can run to its end between two looks of this poll,
    and what a caller does next then comes too late; an attempt the master decides
    cannot (its verdict comes through the event loop this poll runs in)."""
    launched = False
    while True:
        attempt = PeerSeam(comm).attempt(tag)
        if attempt is not None:
            launched = True
            if attempt.rx_bytes > 0:
                return True
        elif launched:
            if or_ended:
                return False
            raise AssertionError(f"the all-reduce with tag {tag} ended before it was observed")
        # Poll at scheduling granularity: in virtual time the transfer takes no time.
        await trio.lowlevel.checkpoint()


def state_bytes(state: pccl.SharedState, *, comparable_only: bool = False) -> int:
    return sum(
        t.data.nbytes for t in state.tensors
        if not (comparable_only and t.allow_content_inequality)
    )


def same_content(states: Sequence[pccl.SharedState]) -> bool:
    first = states[0]
    return all(
        a.data.tobytes() == b.data.tobytes()
        for state in states[1:]
        for a, b in zip(first.tensors, state.tensors, strict=True)
        if not a.allow_content_inequality
    )


async def sync_all(
    comms: Sequence[pccl.Communicator], states: Sequence[pccl.SharedState],
    strategies: Sequence[pccl.SharedStateSyncStrategy] | None = None,
) -> list[object]:
    return await run_all(list(comms), lambda i, c: c.sync_shared_state(
        states[i], ENFORCE if strategies is None else strategies[i]))


def big_state(seed: int, *, zero: bool = False) -> pccl.SharedState:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    moments = rng.standard_normal(300_000).astype(np.float64)
    if zero:
        weights[:], moments[:] = 0, 0
    return pccl.SharedState(
        [pccl.TensorInfo("weights", weights), pccl.TensorInfo("moments", moments)], revision=0
    )


async def joined(cluster: Cluster, states: list[pccl.SharedState]) -> list[pccl.Communicator]:
    """One founder per state, synced on ``states``, then a joiner admitted (last in the
    list); the founders' revisions advanced for the next sync."""
    founders = await form_run([], [cluster.communicator(f"f{i}") for i in range(len(states))])
    await sync_all(founders, states)
    comms = await form_run(founders, [cluster.communicator("joiner")])
    for s in states:
        s.revision += 1
    return comms


async def die_mid_all_reduce(
    cluster: Cluster, comms: list[pccl.Communicator], victim: int, call: object
) -> list[object]:
    """Every peer makes ``call(i, comm)`` (an all-reduce of tag 0, or a call that starts
    with one); peer ``victim`` (host ``p{victim}``) dies once the first survivor's
    all-reduce is mid-operation. The survivors' results, in order. The victim's call
    fails, unless the kill came too late: over TCP an all-reduce under a lease may
    finish everywhere first (see ``started``), and then every survivor succeeded too."""
    survivors = [c for i, c in enumerate(comms) if i != victim]
    results: list[object] = []
    returned: list[object] = []

    async def survivors_run() -> None:
        results.extend(await run_all(survivors, lambda i, c: call(comms.index(c), c)))  # type: ignore[operator]

    async def victim_run() -> None:
        try:
            returned.append(await call(victim, comms[victim]))  # type: ignore[operator]
        except pccl.PCCLError:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(survivors_run)
        nursery.start_soon(victim_run)
        await started(survivors[0], 0, or_ended=cluster.memory is None)
        await cluster.kill(f"p{victim}", comms[victim])
    if returned:
        assert cluster.memory is None, f"the victim's call returned {returned[0]!r}"
        assert not any(isinstance(r, BaseException) for r in results), (returned, results)
    return results


# --- scenarios several modules share ---------------------------------------------

STEPS = 12


KILL_AFTER = 4  # steps every peer completed before the master dies


@dataclasses.dataclass
class Masters:
    """Masters started and killed at will, on the memory network or loopback TCP."""

    kind: str
    nursery: trio.Nursery
    config: pccl.Config
    memory: MemoryNetwork | None
    blocking: list[BlockingPeer] = dataclasses.field(default_factory=list)

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

    def communicator(
        self, host: str, address: str, identity: Path | None = None
    ) -> pccl.Communicator:
        network = self.memory.host(host) if self.memory is not None else pccl.TcpNetwork()
        config = self.config if identity is None else dataclasses.replace(
            self.config, identity=identity
        )
        if self.kind == "sync":
            peer = BlockingPeer(pccl_trio.sync.Communicator(
                address, config=config, network=network, p2p_host="127.0.0.1"
            ))
            self.blocking.append(peer)
            return peer  # type: ignore[return-value]
        return pccl.Communicator(
            address, config=config, network=network,
            **({"p2p_host": "127.0.0.1"} if self.memory is None else {}),
        )


@pytest.fixture
async def masters(network_kind: str, clock: object, nursery: trio.Nursery) -> AsyncIterator[Masters]:
    masters = Masters(kind=network_kind, nursery=nursery, config=CONFIGS[network_kind],
                      memory=MemoryNetwork() if network_kind == "memory" else None)
    yield masters
    await end_loops(masters.blocking)


@dataclasses.dataclass
class Progress:
    """Steps each peer completed (and when, in trio's clock), the bytes each sync
    after a peer's first received, and an event set once every peer completed
    ``KILL_AFTER`` steps."""

    steps: list[int]
    syncs: list[list[int]]
    stepped: trio.Event
    times: list[list[float]]

    @classmethod
    def of(cls, peers: int) -> Progress:
        return cls(steps=[0] * peers, syncs=[[] for _ in range(peers)], stepped=trio.Event(),
                   times=[[] for _ in range(peers)])

    def next_step(self, peer: int, after: float) -> float:
        """When ``peer`` completed its first step after ``after``."""
        return next(t for t in self.times[peer] if t > after)


async def train(
    comms: list[pccl.Communicator], progress: Progress, *, doomed: int | None = None
) -> list[pccl.SharedState]:
    """Every peer trains ``STEPS`` steps, reporting to ``progress``; peer ``doomed``
    trains along until its process is killed (its communicator fails), and is left
    out of ``progress``, whose peers are the others in order."""
    states = [
        pccl.SharedState([pccl.TensorInfo("w", np.zeros(50_000, np.float32))]) for _ in comms
    ]
    counted = [i for i in range(len(comms)) if i != doomed]

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
            if i == doomed:
                continue
            at = counted.index(i)
            if step:
                progress.syncs[at].append(info.rx_bytes)
            progress.steps[at] += 1
            progress.times[at].append(trio.current_time())
            if min(progress.steps) >= KILL_AFTER:
                progress.stepped.set()

    async def doomed_peer(i: int) -> None:
        try:
            await peer(i)
        except (pccl.PCCLError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # killed

    async with trio.open_nursery() as nursery:
        for i in range(len(comms)):
            nursery.start_soon(doomed_peer if i == doomed else peer, i)
    return [states[i] for i in counted]


def check_run(states: list[pccl.SharedState], progress: Progress) -> None:
    assert progress.steps == [STEPS] * len(states)
    assert all(s.revision == STEPS for s in states)  # every step advanced it by one
    assert all(rx == 0 for peer in progress.syncs for rx in peer), progress.syncs  # no divergence
    first = states[0].tensors[0].data.tobytes()
    assert all(s.tensors[0].data.tobytes() == first for s in states)


async def frames_until_closed(framed: FramedStream) -> list[Message | DataFrame]:
    """Every frame the other side sent until it closed the connection."""
    frames: list[Message | DataFrame] = []
    try:
        while True:
            frame = await framed.receive()
            assert isinstance(frame, Message | DataFrame), frame
            frames.append(frame)
    except trio.BrokenResourceError:
        pass
    await framed.aclose()
    return frames


def hold_fetches(joiner: pccl.Communicator) -> tuple[trio.Event, trio.Event, list[int]]:
    """Hold ``joiner``'s shared-state fetches: ``held`` is set once one is about to
    start (``syncs`` names its sync), and it starts once ``release`` is set."""
    held, release = trio.Event(), trio.Event()
    syncs: list[int] = []
    seam = PeerSeam(joiner)
    fetch_from = seam.fetch_from

    async def hold(endpoint: PeerEndpoint, fetcher: sharing.Fetcher) -> None:
        syncs.append(fetcher.sync)
        held.set()
        await release.wait()
        await fetch_from(endpoint, fetcher)

    seam.fetch_from = hold
    return held, release, syncs


def shared_state_request(
    peer_id: int, sync: int, *ranges: tuple[str, int, int]
) -> SharedStateRequest:
    return SharedStateRequest(
        protocol_version=PROTOCOL_VERSION, peer_id=peer_id, sync=sync,
        ranges=tuple(SharedStateRange(key=k, offset=o, nbytes=n) for k, o, n in ranges),
        frame_bytes=1 << 16,
    )


def joiner_state(founder: pccl.SharedState) -> pccl.SharedState:
    """A joiner that holds the founders' moments but zero weights: it fetches weights."""
    weights, moments = (t.data for t in founder.tensors)
    return pccl.SharedState([
        pccl.TensorInfo("weights", np.zeros_like(weights)),
        pccl.TensorInfo("moments", moments.copy()),
    ])


async def reduce_exactly(comms: list[pccl.Communicator], tag: int = 0) -> None:
    count = 300_000  # several slices per segment
    arrays = [np.arange(count, dtype=np.float32) + i for i in range(len(comms))]
    expected = sum(np.arange(count, dtype=np.float32) + i for i in range(len(comms)))
    results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], tag=tag))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    for array in arrays:
        assert array.tobytes() == expected.tobytes()


def kill_during_fetch(
    monkeypatch: pytest.MonkeyPatch,
    cluster: Cluster,
    victims: dict[str, pccl.Communicator],
    nursery: trio.Nursery,
    *,
    after_pieces: int,
) -> list[int]:
    """Small pieces, and the ``victims`` die once the fetching peer has received
    ``after_pieces`` frames; the fetch waits until they are gone. Returns the bytes
    received when they died."""
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    monkeypatch.setattr(sharing, "FRAME_BYTES", 64 << 10)
    token = trio.lowlevel.current_trio_token()
    original = sharing.Fetcher.count
    frames: list[int] = []
    dead = threading.Event()

    async def kill() -> None:
        for host, comm in victims.items():
            await cluster.kill(host, comm)
        dead.set()

    def count(self: sharing.Fetcher, nbytes: int) -> None:
        original(self, nbytes)
        frames.append(nbytes)
        if len(frames) < after_pieces:
            return
        on_trio = threading.current_thread() is threading.main_thread()
        if len(frames) == after_pieces:
            if on_trio:
                # The trio thread cannot wait for the kill: the victims stop serving
                # right now, so the fetch cannot go on from them while they close.
                for host, comm in victims.items():
                    if cluster.memory is not None:  # dies right now, in virtual time
                        cluster.memory.kill(host)
                    PeerSeam(comm).stop_serving()
                nursery.start_soon(kill)
            else:
                token.run_sync_soon(nursery.start_soon, kill)
        if not on_trio:
            # Every fetching thread (one per distributor) waits until the victims are
            # gone: another victim's thread must not finish the fetch meanwhile.
            dead.wait(30)

    monkeypatch.setattr(sharing.Fetcher, "count", count)
    return frames
