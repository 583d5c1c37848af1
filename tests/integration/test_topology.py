"""``optimize_topology``: links measured, the fastest ring installed and used.

Over the in-memory network, links are shaped (``MemoryNetwork.shape``) and everything
runs in virtual time, so measured rates and all-reduce times are exact and the tests
can compare them with the links' nominal rates. Over TCP (loopback, every link alike)
the tests check the protocol: every peer ends with the same ring and a working run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import Message, PeerEndpoint
from pccl_trio.peer._bandwidth import LinkMeasurement
from pccl_trio.peer._seam import MeasureLink
from pccl_trio.testing import MemoryNetwork, PeerSeam

from .conftest import Cluster, all_do, form_run

#: Bytes per second: 400 and 40 Mbit/s.
FAST, SLOW = 50e6, 5e6
SIZE = 8 << 20  # bytes of float32 all-reduced
SEED = 9  # a matrix whose first, short search is not optimal


def shape_one_fast_ring(memory: MemoryNetwork, hosts: Sequence[str], fast: Sequence[int]) -> None:
    """Every directed link between ``hosts`` at ``SLOW``, except the ring ``fast`` (host
    indices, in sending order) at ``FAST``."""
    for a in hosts:
        for b in hosts:
            if a != b:
                memory.shape(a, b, rate=SLOW)
    for i, a in enumerate(fast):
        memory.shape(hosts[a], hosts[fast[(i + 1) % len(fast)]], rate=FAST)


def is_rotation(ring: Sequence[int], expected: Sequence[int]) -> bool:
    ring, expected = list(ring), list(expected)
    return len(ring) == len(expected) and any(
        ring == expected[i:] + expected[:i] for i in range(len(expected))
    )


async def timed_all_reduce(comms: Sequence[pccl.Communicator]) -> float:
    """Seconds (of the test's clock) for one float32 SUM all-reduce of ``SIZE`` bytes;
    checks the result."""
    arrays = [np.full(SIZE // 4, i + 1, dtype=np.float32) for i in range(len(comms))]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    elapsed = trio.current_time() - started
    expected = sum(range(1, len(comms) + 1))
    assert all((array == expected).all() for array in arrays)
    return elapsed


async def optimize_retrying(comm: pccl.Communicator) -> None:
    """optimize_topology, called once more if its ring failed (a peer left meanwhile)."""
    try:
        await comm.optimize_topology()
    except pccl.TopologyOptimizationFailed:
        await comm.optimize_topology()


def ideal_seconds(world: int, rate: float) -> float:
    """A ring all-reduce of ``SIZE`` bytes whose every hop runs at ``rate``."""
    return 2 * (world - 1) * (SIZE / world) / rate


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize(
    "fast", [(0, 2, 4, 1, 3), (4, 3, 2, 1, 0), (0, 1, 2, 3, 4)],
    ids=["scrambled", "reversed", "already-installed"],
)
async def test_five_hosts_one_fast_ring(
    cluster: Cluster, clock: object, fast: tuple[int, ...]
) -> None:
    """The issue's acceptance case: only one directed ring is fast; whatever ring is
    installed first, after optimize_topology an all-reduce runs within 2x of that
    ring's ideal time, and the optimization itself takes well under 10 s."""
    assert cluster.memory is not None
    hosts = [f"h{i}" for i in range(5)]
    shape_one_fast_ring(cluster.memory, hosts, fast)
    with trio.fail_after(600):
        # One at a time: peer ids (and so the first ring) follow the hosts' order,
        # whatever the scheduling of concurrent registrations.
        comms: list[pccl.Communicator] = []
        for host in hosts:
            comms = await form_run(comms, [cluster.communicator(host)])
        before = await timed_all_reduce(comms)
        started = trio.current_time()
        await all_do(comms, "optimize_topology")
        took = trio.current_time() - started
        after = await timed_all_reduce(comms)

        fast_ring = [comms[i].peer_id for i in fast]
        for comm in comms:
            assert is_rotation(comm.ring, fast_ring), (comm.ring, fast_ring)
        ideal = ideal_seconds(5, FAST)
        assert after <= 2 * ideal, (after, ideal)
        assert took < 10, took
        if fast != (0, 1, 2, 3, 4):  # the first ring (joining order) was all slow
            assert before >= 5 * after, (before, after)

        # What the master measured, as every peer sees it.
        info = comms[0].topology
        assert info is not None and info.optimal
        assert all(c.topology is not None and c.topology.ring == info.ring for c in comms)
        index = {p: i for i, p in enumerate(info.peers)}
        for a, sender in enumerate(comms):
            for b, receiver in enumerate(comms):
                if a == b:
                    continue
                nominal = FAST if (b == fast[(fast.index(a) + 1) % 5]) else SLOW
                measured = info.bandwidth[index[sender.peer_id], index[receiver.peer_id]]
                assert measured == pytest.approx(nominal, rel=0.01), (a, b)
        assert info.predicted_seconds == pytest.approx(
            info.predict(info.reference_bytes), rel=1e-9
        )
        assert info.predict(SIZE) == pytest.approx(ideal, rel=0.01)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_second_call_measures_only_the_new_peers_links(
    cluster: Cluster, clock: object
) -> None:
    assert cluster.memory is not None
    hosts = [f"h{i}" for i in range(4)]
    shape_one_fast_ring(cluster.memory, hosts, (0, 1, 2, 3))
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(host) for host in hosts[:3]])
        await all_do(comms, "optimize_topology")
        measured: list[int] = []
        for comm in comms:
            seam = PeerSeam(comm)
            original = seam.measure_link

            async def counting(
                endpoint: PeerEndpoint, nbytes: int, original: MeasureLink = original
            ) -> LinkMeasurement:
                measured.append(1)
                return await original(endpoint, nbytes)

            seam.measure_link = counting
        # Nothing new: no link is measured again.
        await all_do(comms, "optimize_topology")
        assert measured == []
        comms = await form_run(comms, [cluster.communicator(hosts[3])])
        original_new = PeerSeam(comms[3]).measure_link

        async def counting_new(endpoint: PeerEndpoint, nbytes: int) -> LinkMeasurement:
            measured.append(1)
            return await original_new(endpoint, nbytes)

        PeerSeam(comms[3]).measure_link = counting_new
        await all_do(comms, "optimize_topology")
        assert len(measured) == 2 * 3  # to and from the joiner
        fast_ring = [c.peer_id for c in comms]
        assert all(is_rotation(c.ring, fast_ring) for c in comms)
        assert comms[0].topology is not None
        assert not np.isnan(comms[0].topology.bandwidth[~np.eye(4, dtype=bool)]).any()
        for comm in comms:
            await comm.aclose()


async def test_every_peer_ends_with_the_same_ring(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(4)])
        await all_do(comms, "optimize_topology")
        rings = {c.ring for c in comms}
        assert len(rings) == 1 and sorted(rings.pop()) == sorted(c.peer_id for c in comms)
        infos = [c.topology for c in comms]
        assert all(i is not None for i in infos)
        assert infos[0] is not None and sorted(infos[0].ring) == sorted(infos[0].peers)
        assert math.isfinite(infos[0].predicted_seconds)
        # The ring works: an all-reduce and a topology update go through.
        await timed_all_reduce(comms)
        await all_do(comms, "update_topology")
        await timed_all_reduce(comms)
        for comm in comms:
            await comm.aclose()


async def test_alone_or_in_pairs(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        alone = await form_run([], [cluster.communicator("p0")])
        await alone[0].optimize_topology()  # nothing to measure: returns at once
        assert alone[0].topology is None
        pair = await form_run(alone, [cluster.communicator("p1")])
        await all_do(pair, "optimize_topology")
        info = pair[0].topology
        assert info is not None and info.optimal and len(info.peers) == 2
        assert (info.bandwidth[[0, 1], [1, 0]] > 0).all()
        await timed_all_reduce(pair)
        for comm in pair:
            await comm.aclose()


async def test_groups_are_optimized_together(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await form_run(
            [], [cluster.communicator(f"p{i}", peer_group=i % 2) for i in range(5)]
        )
        await all_do(comms, "optimize_topology")
        for comm in comms:
            info = comm.topology
            assert info is not None
            group = [c.peer_id for c in comms if c.peer_group == comm.peer_group]
            assert sorted(info.peers) == sorted(group) and sorted(comm.ring) == sorted(group)
        for comm in comms:
            await comm.aclose()


async def test_a_mismatched_call_is_refused(cluster: Cluster, clock: object) -> None:
    """Some peers optimize while another updates the topology: the optimizers are told
    (InvalidUsage naming the other call), and once they update too, everyone goes on."""
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(comms[2].update_topology)
            for comm in comms[:2]:
                with pytest.raises(pccl.InvalidUsage, match="update_topology"):
                    await comm.optimize_topology()
            await all_do(comms[:2], "update_topology")
        await all_do(comms, "optimize_topology")
        await timed_all_reduce(comms)
        for comm in comms:
            await comm.aclose()


async def test_in_flight_all_reduce_is_refused(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        handle = comms[0].all_reduce_async(np.ones(4, dtype=np.float32))
        with pytest.raises(pccl.InvalidUsage, match="in flight"):
            await comms[0].optimize_topology()
        await comms[1].all_reduce(np.ones(4, dtype=np.float32))
        await handle.wait()
        for comm in comms:
            await comm.aclose()


async def test_a_peer_dying_while_measuring(cluster: Cluster, clock: object) -> None:
    """A peer dies when asked to measure: the others' call still installs a ring of the
    survivors (or fails retryably), and the run goes on."""
    with trio.fail_after(300):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(4)])
        victim = comms[3]

        async def die(_endpoint: PeerEndpoint, _nbytes: int) -> LinkMeasurement:
            await cluster.kill("p3", victim)
            raise trio.BrokenResourceError("this peer died")

        PeerSeam(victim).measure_link = die
        survivors = comms[:3]

        async with trio.open_nursery() as nursery:
            for comm in survivors:
                nursery.start_soon(optimize_retrying, comm)
            with pytest.raises(pccl.PCCLError):
                await victim.optimize_topology()
        ids = sorted(c.peer_id for c in survivors)
        assert all(sorted(c.ring) == ids for c in survivors)
        assert all(c.topology is not None and victim.peer_id not in c.topology.peers
                   for c in survivors)
        await timed_all_reduce(survivors)
        for comm in survivors:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_an_unmeasurable_link_is_avoided(cluster: Cluster, clock: object) -> None:
    """A link whose measurement fails is recorded unreachable and left out of the ring."""
    assert cluster.memory is not None
    hosts = [f"h{i}" for i in range(4)]
    with trio.fail_after(300):
        comms = await form_run([], [cluster.communicator(host) for host in hosts])
        # Peer 1 cannot measure the link from peer 0, whatever the ring was before.
        original = PeerSeam(comms[1]).measure_link

        async def refuse(endpoint: PeerEndpoint, nbytes: int) -> LinkMeasurement:
            if endpoint.peer_id == comms[0].peer_id:
                raise OSError("connection refused (firewall)")
            return await original(endpoint, nbytes)

        PeerSeam(comms[1]).measure_link = refuse
        await all_do(comms, "optimize_topology")
        info = comms[0].topology
        assert info is not None
        index = {p: i for i, p in enumerate(info.peers)}
        assert info.bandwidth[index[comms[0].peer_id], index[comms[1].peer_id]] == 0
        ring = list(comms[0].ring)
        successor = ring[(ring.index(comms[0].peer_id) + 1) % len(ring)]
        assert successor != comms[1].peer_id
        await timed_all_reduce(comms)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_background_search_improves_the_ring_at_the_next_update(
    clock: object, nursery: trio.Nursery
) -> None:
    """Thirteen peers (past the exact solver) over links of random rates, with a first
    search too short to prove its ring optimal: the master searches on, and the next
    update_topology installs the better ring it found. (Without threads, the search
    budgets count moves, so the outcome is reproducible.)"""
    world = 13
    memory = MemoryNetwork()
    config = pccl.Config(topology_solve_seconds=0.0005, topology_search_seconds=2.0)
    listener = await memory.host("master").listen("master", 48148)
    scope = trio.CancelScope()

    async def master() -> None:
        with scope:
            await pccl.serve_master([listener], config=config)

    nursery.start_soon(master)
    hosts = [f"h{i}" for i in range(world)]
    rng = np.random.default_rng(SEED)
    # Slow links: a measurement grows its transfer until it spans 0.15 s, so the bytes
    # that 156 measurements push through the in-memory network (real CPU time) grow
    # with the rates (a uniform scale leaves the rings' order as it was).
    for a in hosts:
        for b in hosts:
            if a != b:
                memory.shape(a, b, rate=float(rng.uniform(2e5, 6e6)))
    with trio.fail_after(3600):
        comms: list[pccl.Communicator] = []
        for host in hosts:  # one by one: peer ids in host order, the same every run
            comms = await form_run(comms, [
                pccl.Communicator("master:48148", config=config, network=memory.host(host))
            ])
        await all_do(comms, "optimize_topology")
        info = comms[0].topology
        assert info is not None and not info.optimal
        first = comms[0].ring
        assert first == info.ring
        await all_do(comms, "update_topology")
        second = comms[0].ring
        assert all(c.ring == second for c in comms)
        assert info.predict(info.reference_bytes, second) < info.predict(
            info.reference_bytes, first
        )
        # What the communicators show follows the ring installed.
        for comm in comms:
            now = comm.topology
            assert now is not None and now.ring == second and not now.optimal
            assert now.predicted_seconds == pytest.approx(
                info.predict(info.reference_bytes, second)
            )
        await timed_all_reduce(comms)
        for comm in comms:
            await comm.aclose()
    scope.cancel()


async def test_an_all_reduce_during_optimize_topology_is_refused(
    cluster: Cluster, clock: object
) -> None:
    """Starting an all-reduce while this communicator optimizes is a usage error for
    this call alone; the optimization goes on."""
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        voted = trio.Event()
        vote = PeerSeam(comms[0]).vote

        async def vote_and_tell(message: Message) -> int:
            epoch = await vote(message)
            voted.set()
            return epoch

        PeerSeam(comms[0]).vote = vote_and_tell
        async with trio.open_nursery() as nursery:
            for comm in comms:
                nursery.start_soon(comm.optimize_topology)
            await voted.wait()
            with pytest.raises(pccl.InvalidUsage, match="optimize_topology"):
                comms[0].all_reduce_async(np.ones(4, dtype=np.float32))
        await timed_all_reduce(comms)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_groups_optimize_together_after_one_lost_a_peer(
    cluster: Cluster, clock: object
) -> None:
    """A peer of group 0 dies, so group 0's all-reduce aborts and its ring must be
    re-established (a round, which spans every group) before its optimize_topology
    votes; group 1's peers vote to optimize meanwhile. They join that round, then all
    optimize together."""
    with trio.fail_after(300):
        comms = await form_run(
            [], [cluster.communicator(f"p{i}", peer_group=0 if i < 3 else 1) for i in range(5)]
        )
        await cluster.kill("p2", comms[2])
        group0, group1 = comms[:2], comms[3:]

        async def reduce_then_optimize(comm: pccl.Communicator) -> None:
            with pytest.raises(pccl.CollectiveAborted):
                await comm.all_reduce(np.ones(4, dtype=np.float32))
            await comm.optimize_topology()

        async with trio.open_nursery() as nursery:
            for comm in group0:
                nursery.start_soon(reduce_then_optimize, comm)
            for comm in group1:
                nursery.start_soon(comm.optimize_topology)
        for group in (group0, group1):
            ids = sorted(c.peer_id for c in group)
            assert all(sorted(c.ring) == ids for c in group)
            assert all(c.topology is not None and sorted(c.topology.peers) == ids for c in group)
            await timed_all_reduce(group)
        for comm in [*group0, *group1]:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_peer_going_silent_while_measured(cluster: Cluster, clock: object) -> None:
    """A peer's cable is pulled while another measures the link from it: the master
    removes it at its liveness timeout, the measuring peer gives up on it, and the
    others' call installs a ring of the survivors."""
    assert cluster.memory is not None
    memory = cluster.memory
    with trio.fail_after(300):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(4)])
        silent = comms[1]
        measure = PeerSeam(comms[0]).measure_link

        async def pull_the_cable(endpoint: PeerEndpoint, nbytes: int) -> LinkMeasurement:
            if endpoint.peer_id == silent.peer_id:
                memory.partition("p1")
            return await measure(endpoint, nbytes)

        PeerSeam(comms[0]).measure_link = pull_the_cable
        survivors = [c for c in comms if c is not silent]

        async with trio.open_nursery() as nursery:
            for comm in survivors:
                nursery.start_soon(optimize_retrying, comm)

            async def silent_peer() -> None:
                with pytest.raises(pccl.PCCLError):
                    await silent.optimize_topology()

            nursery.start_soon(silent_peer)
        ids = sorted(c.peer_id for c in survivors)
        assert all(sorted(c.ring) == ids for c in survivors)
        await timed_all_reduce(survivors)
        for comm in comms:
            await comm.aclose()
