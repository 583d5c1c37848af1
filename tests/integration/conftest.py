"""Fixtures that run the same integration tests over both networks.

``memory``: the in-memory network under trio's autojump clock (virtual time, exact).
``tcp``: real loopback TCP sockets under the real clock, with short liveness timers.
``secret``: the in-memory network again, with a run secret shared by the master and
every peer, so every connection is handshaken and every frame authenticated. Tests
that speak raw frames as a stranger skip it (``Cluster.plain_frames``): against a run
with a secret, a stranger gets nothing past the handshake (``test_run_secret``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio._core.messages import Message
from pccl_trio._core.wire import FrameDecoder
from pccl_trio.testing import MemoryNetwork, PeerSeam
from pccl_trio.transport import Network, TcpNetwork, format_address

#: Real-clock timers: short enough for quick tests, long enough for a loaded CI box.
TCP_CONFIG = pccl.Config(heartbeat_interval=0.1, liveness_timeout=2.0, connect_timeout=5.0)
MEMORY_CONFIG = pccl.Config()
RUN_SECRET = b"integration tests' run secret"
SECRET_CONFIG = pccl.Config(run_secret=RUN_SECRET)
#: The peers' config per network kind.
CONFIGS = {"memory": MEMORY_CONFIG, "tcp": TCP_CONFIG, "secret": SECRET_CONFIG}


@pytest.fixture(params=["memory", "tcp", "secret"])
def network_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets ``NETWORKS`` (a module whose runs bring their own secrets:
    ``("memory", "tcp")``) runs its tests on those networks only, as if each test that
    takes ``network_kind`` were marked ``parametrize("network_kind", NETWORKS)``; a
    test's own such mark still decides for that test."""
    networks = getattr(metafunc.module, "NETWORKS", None)
    if networks is None or "network_kind" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "network_kind" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return
    metafunc.definition.add_marker(pytest.mark.parametrize("network_kind", networks))


@pytest.fixture
def clock(network_kind: str) -> trio.testing.MockClock | None:
    """Virtual time for the memory network; tests take this fixture so pytest-trio
    runs them on it."""
    return None if network_kind == "tcp" else trio.testing.MockClock(autojump_threshold=0)


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
    cluster.master_scope.cancel()


async def start_cluster(
    nursery: trio.Nursery, network_kind: str, config: pccl.Config,
    master_config: pccl.Config | None = None,
) -> Cluster:
    """A master with ``master_config`` (default: ``config``, the peers' config) on the
    in-memory network or on loopback TCP (``"tcp"``); cancel its ``master_scope`` to
    stop it."""
    master_config = master_config or config
    scope = trio.CancelScope()
    memory = None if network_kind == "tcp" else MemoryNetwork()

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


async def run_all(comms: list[pccl.Communicator], call: object) -> list[object]:
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
