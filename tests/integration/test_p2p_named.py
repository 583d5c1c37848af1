"""p2p requests are answered only for those the master named (both networks).

A peer serves shared state only to the fetchers its plan names, from the host the
master knows each at, only the tensors each fetches and each byte once; benchmark
bytes only to a measurement the master announced, from the measuring peer's host, once
and within the announced bytes; and admits ring connections only into slots below the
predecessor's pool size. The strangers here speak raw frames from a host of their own
(``stranger``), from the host of the peer they claim to be, or from another host
(``ELSEWHERE``: a named host in memory, 127.0.0.2 over TCP, where the run's peers are
all at 127.0.0.1). Runs with a secret keep them out before any of this
(``test_run_secret``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.bandwidth import MEASUREMENT_BYTES
from pccl_trio._core.messages import (
    MAX_BENCHMARK_BYTES,
    PROTOCOL_VERSION,
    BenchmarkRequest,
    P2PHello,
    PeerEndpoint,
    SharedStateRequest,
    SharedStateResponse,
)
from pccl_trio._core.wire import DataFrame, encode_control, encode_data
from pccl_trio.peer import _shared_state as sharing
from pccl_trio.testing import PeerSeam
from pccl_trio.transport import FramedStream

from .conftest import (
    Cluster,
    big_state,
    form_run,
    frames_until_closed,
    hold_fetches,
    joined,
    joiner_state,
    same_content,
    shared_state_request,
    state_bytes,
    sync_all,
)

#: A host that is neither a stranger's own nor the one of the peer it claims to be.
ELSEWHERE = "elsewhere"
LIMITS = {"max_control_frame": 1 << 20, "max_data_frame": (64 << 20) + 64}


async def connect_from(cluster: Cluster, source: str, comm: pccl.Communicator) -> trio.abc.Stream:
    """A raw connection from host ``source`` to ``comm``'s p2p listener (over TCP every
    host is 127.0.0.1, but ``ELSEWHERE`` is 127.0.0.2)."""
    host, port = PeerSeam(comm).p2p_address
    if cluster.memory is not None:
        return await cluster.memory.host(source).connect(host, port)
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.2" if source == ELSEWHERE else "127.0.0.1", 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def answered(stream: trio.abc.Stream) -> bytes:
    """The first bytes the other side answers with (empty: it closed the connection
    unanswered); a single read, so that an answer fails the test at once however large
    it would be."""
    try:
        data = await stream.receive_some(1 << 16)
    except trio.BrokenResourceError:
        data = b""
    await stream.aclose()
    return data


async def refusal(
    cluster: Cluster, source: str, distributor: pccl.Communicator, request: SharedStateRequest
) -> str:
    """The error a distributor answers ``request`` from ``source`` with, asserting that
    it sent nothing else and closed the connection."""
    framed = FramedStream(await connect_from(cluster, source, distributor), **LIMITS)
    await framed.send_message(request)
    frames = await frames_until_closed(framed)
    assert len(frames) == 1 and isinstance(frames[0], SharedStateResponse), frames
    assert frames[0].error
    return frames[0].error


def benchmark(peer_id: int, nbytes: int) -> BenchmarkRequest:
    return BenchmarkRequest(
        protocol_version=PROTOCOL_VERSION, peer_id=peer_id, nbytes=nbytes, frame_bytes=1 << 16
    )


async def served(framed: FramedStream, request: BenchmarkRequest) -> int:
    """Send ``request``; the benchmark bytes that came back before all of them did or
    the connection closed."""
    await framed.send_message(request)
    got = 0
    try:
        while got < request.nbytes:
            frame = await framed.receive()
            assert isinstance(frame, DataFrame), frame
            got += len(frame.payload)
    except trio.BrokenResourceError:
        pass
    return got


# --- shared state ------------------------------------------------------------------------


async def test_shared_state_goes_only_to_the_plans_fetchers(cluster: Cluster, clock: object) -> None:
    """Once: a ``SharedStateRequest`` with no membership got the weights. While the
    joiner's fetch is held, every request but its own is refused with a reason and not a
    byte: a stranger, a member that fetches nothing, the joiner's id from another host,
    a tensor the joiner does not fetch, more bytes than the joiner fetches. The joiner's
    own fetch then goes through as before."""
    cluster.plain_frames()
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        f0, f1, joiner = await joined(cluster, states)
        fresh = joiner_state(states[0])
        weights = fresh.tensors[0].data.nbytes
        held, release, syncs = hold_fetches(joiner)
        results: list[object] = []

        async def sync() -> None:
            results.extend(await sync_all([f0, f1, joiner], [*states, fresh]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            await held.wait()
            number, jid = syncs[0], joiner.peer_id
            assert jid is not None and f1.peer_id is not None
            part = ("weights", 0, 4000)
            cases = [
                ("stranger", shared_state_request(99, number, part), "names no peer 99"),
                ("f1", shared_state_request(f1.peer_id, number, part),
                 f"names no peer {f1.peer_id}"),
                (ELSEWHERE, shared_state_request(jid, number, part),
                 "and the master knows it at"),
                ("joiner", shared_state_request(jid, number, ("moments", 0, 4000)),
                 "does not fetch a tensor named 'moments'"),
                ("joiner", shared_state_request(jid, number, ("weights", 0, weights),
                                                ("weights", 0, weights)),
                 f"asks for {2 * weights} bytes, but only {weights}"),
            ]
            for source, request, words in cases:
                for distributor in (f0, f1):
                    assert words in await refusal(cluster, source, distributor, request)
            release.set()
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert results[2].rx_bytes == weights  # type: ignore[attr-defined]
        assert sum(r.tx_bytes for r in results[:2]) == weights  # type: ignore[attr-defined]
        assert same_content([states[0], fresh])
        for comm in (f0, f1, joiner):
            await comm.aclose()


async def test_a_fetcher_gets_each_byte_once(cluster: Cluster, clock: object) -> None:
    """After the joiner fetched its tensors from the one distributor, asking for the
    same bytes again (as the joiner, from its host) is refused."""
    cluster.plain_frames()
    with trio.fail_after(120):
        states = [big_state(2)]
        f0, joiner = await joined(cluster, states)
        fresh = joiner_state(states[0])
        fetched, release = trio.Event(), trio.Event()
        syncs: list[int] = []
        seam = PeerSeam(joiner)
        fetch_from = seam.fetch_from

        async def hold_after(endpoint: PeerEndpoint, fetcher: sharing.Fetcher) -> None:
            await fetch_from(endpoint, fetcher)
            syncs.append(fetcher.sync)
            fetched.set()
            await release.wait()

        seam.fetch_from = hold_after
        results: list[object] = []

        async def sync() -> None:
            results.extend(await sync_all([f0, joiner], [*states, fresh]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            await fetched.wait()
            assert joiner.peer_id is not None
            again = shared_state_request(joiner.peer_id, syncs[0], ("weights", 0, 4000))
            assert "asks for 4000 bytes, but only 0" in await refusal(cluster, "joiner", f0, again)
            release.set()
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert results[0].tx_bytes == results[1].rx_bytes == fresh.tensors[0].data.nbytes  # type: ignore[attr-defined]
        assert same_content([states[0], fresh])
        for comm in (f0, joiner):
            await comm.aclose()


async def test_several_fetchers_and_distributors_sync_as_before(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three distributors, and two fetchers that need different tensors (a joiner all,
    a diverged member one): every fetcher gets exactly its tensors, spread over the
    distributors, on every network kind (a secret's too)."""
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    with trio.fail_after(120):
        states = [big_state(3) for _ in range(4)]
        comms = await joined(cluster, states)
        diverged = states[3]
        diverged.tensors[1].data[7] += 1.0  # its moments differ
        fresh = big_state(4, zero=True)
        infos = await sync_all(comms, [*states, fresh])
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        moments = diverged.tensors[1].data.nbytes
        received = [i.rx_bytes for i in infos]  # type: ignore[union-attr]
        assert received == [0, 0, 0, moments, state_bytes(fresh)]
        sent = [i.tx_bytes for i in infos[:3]]  # type: ignore[union-attr]
        assert sum(sent) == moments + state_bytes(fresh)
        if cluster.memory is not None:  # deterministic: every distributor served a share
            assert all(s > 0 for s in sent), sent
        assert same_content([states[0], diverged, fresh])
        for comm in comms:
            await comm.aclose()


# --- link measurements -------------------------------------------------------------------


async def test_benchmark_bytes_only_for_an_announced_measurement(
    cluster: Cluster, clock: object
) -> None:
    """Once: 3 GiB went out for three 22-byte requests with no membership. Unannounced
    requests get nothing, whoever sends them; an announced measurement is served to its
    measuring peer only, from its host, within the announced bytes, once."""
    cluster.plain_frames()
    with trio.fail_after(120):
        target, measurer = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        mid = measurer.peer_id
        assert mid is not None
        started = trio.current_time()
        for source, peer_id in (("stranger", 99), ("p1", mid)):
            stream = await connect_from(cluster, source, target)
            await stream.send_all(encode_control(benchmark(peer_id, MAX_BENCHMARK_BYTES)) * 3)
            assert await answered(stream) == b""
        if cluster.memory is not None:  # refused at once: no optimization runs here
            assert trio.current_time() == started

        PeerSeam(target).expect_benchmark(PeerSeam(measurer).endpoint, 1 << 20)
        for source, peer_id in (("stranger", 99), (ELSEWHERE, mid)):
            stream = await connect_from(cluster, source, target)
            await stream.send_all(encode_control(benchmark(peer_id, 1)))
            assert await answered(stream) == b""
        framed = FramedStream(await connect_from(cluster, "p1", target), **LIMITS)
        assert await served(framed, benchmark(mid, 512 << 10)) == 512 << 10
        assert await served(framed, benchmark(mid, 256 << 10)) == 256 << 10
        assert await served(framed, benchmark(mid, (256 << 10) + 1)) == 0  # and it is closed
        assert await frames_until_closed(framed) == []
        stream = await connect_from(cluster, "p1", target)  # the announcement is used up
        await stream.send_all(encode_control(benchmark(mid, 1)))
        assert await answered(stream) == b""

        # Announced as the master does, a real measurement goes through.
        PeerSeam(target).expect_benchmark(PeerSeam(measurer).endpoint, MEASUREMENT_BYTES)
        result = await PeerSeam(measurer).measure_link(PeerSeam(target).endpoint, MEASUREMENT_BYTES)
        assert result.bandwidth > 0 and result.nbytes <= MEASUREMENT_BYTES
        for comm in (target, measurer):
            await comm.aclose()


async def test_optimize_topology_measures_every_link(cluster: Cluster, clock: object) -> None:
    """Every link is measured (none refused by the measured peer) on every network kind."""
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        await all_reduce_exactly(comms)
        await all_do_optimize(comms)
        info = comms[0].topology
        assert info is not None and len(info.peers) == 3
        assert (info.bandwidth[~np.eye(3, dtype=bool)] > 0).all(), info.bandwidth
        await all_reduce_exactly(comms)
        for comm in comms:
            await comm.aclose()


# --- ring slots ----------------------------------------------------------------------------


async def all_reduce_exactly(comms: list[pccl.Communicator], tag: int = 0) -> None:
    arrays = [np.arange(50_000, dtype=np.float32) * (i + 1) for i in range(len(comms))]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(functools.partial(comm.all_reduce, array, tag=tag))
    total = sum(range(1, len(comms) + 1))
    want = np.arange(50_000, dtype=np.float32) * total
    assert all(a.tobytes() == want.tobytes() for a in arrays)


async def all_do_optimize(comms: list[pccl.Communicator]) -> None:
    async with trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(comm.optimize_topology)


async def test_a_hello_beyond_the_pool_is_refused(cluster: Cluster, clock: object) -> None:
    """Once: a ``P2PHello`` claiming to be the ring predecessor on a spare slot, then
    data frames for future attempts, had one all-reduce succeed with forged values.
    Slots at or above the predecessor's pool size (2 here), and its id from another
    host, get no acknowledgement and the connection closes; every all-reduce is exact."""
    cluster.plain_frames()
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(2)])
        predecessor, victim = comms
        pid = predecessor.peer_id
        assert pid is not None and victim.ring == (pid, victim.peer_id)
        await all_reduce_exactly(comms)
        forged = b"".join(
            encode_data(tag=0, seq=seq, offset=0, payload=np.full(64, 7.0, np.float32).tobytes())
            for seq in range(1, 40)
        )
        for source, slot in (("p0", 2), ("p0", 1023), (ELSEWHERE, 0), (ELSEWHERE, 1)):
            stream = await connect_from(cluster, source, victim)
            hello = P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=pid, slot=slot)
            await stream.send_all(encode_control(hello) + forged)
            assert await answered(stream) == b"", (source, slot)
        for tag in range(1, 4):
            await all_reduce_exactly(comms, tag)
        assert PeerSeam(victim).connections()  # the real pools are untouched
        assert victim.statistics().rx_connections == {pid: 2}
        for comm in comms:
            await comm.aclose()
