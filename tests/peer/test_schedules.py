"""Any ring schedule runs on an attempt's parts: the all-reduce, and a broadcast and an
all-gather written as schedules, over trio tasks and over worker threads."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import trio

from pccl_trio._core.ring import RingSchedule, Segment, ring_parts
from pccl_trio._types import ReduceOp
from pccl_trio.ops import HostStaging
from pccl_trio.peer._attempt import RingAttempt
from pccl_trio.peer._ledger import LocalFailure
from pccl_trio.peer._protocol import Protocol, ReceiveHeader, ReceivePayload, run_protocol
from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import Connection, FramedStream, SocketLink

WORLD = 3
SLICE = 64  # bytes: several slices per chunk
FRAMES = 1 << 20

Plan = Callable[[int], RingSchedule]


def all_reduce(count: int) -> Plan:
    return lambda rank: RingSchedule.all_reduce(
        count=count, itemsize=4, world=WORLD, rank=rank, slice_bytes=SLICE
    )


def broadcast(count: int) -> Plan:
    """Rank 0's buffer, down the ring: each rank stores it and forwards it, but the
    last, whose successor is the root."""
    whole = Segment(index=0, chunk=0, start=0, nbytes=count * 4, stream_offset=0, reduce=False)

    def plan(rank: int) -> RingSchedule:
        sends = rank < WORLD - 1
        send = [dataclasses.replace(whole, forwards=None if rank == 0 else 0)] if sends else []
        recv = [] if rank == 0 else [dataclasses.replace(
            whole, forwarded_by=0 if sends else None, first_write=True,
        )]
        return RingSchedule(world=WORLD, rank=rank, itemsize=4, slice_bytes=SLICE, send=send, recv=recv)

    return plan


def all_gather(count: int) -> Plan:
    """Chunk ``r`` of the buffer is rank ``r``'s: each rank sends its own, then forwards
    what it received, ``W - 1`` chunks in all."""
    chunk = count // WORLD * 4

    def segments(rank: int, first: int, *, receiving: bool) -> list[Segment]:
        out = []
        for k in range(WORLD - 1):
            c = (rank - k - first) % WORLD
            out.append(Segment(
                index=k, chunk=c, start=c * chunk, nbytes=chunk, stream_offset=k * chunk,
                reduce=False,
                forwards=None if receiving or k == 0 else k - 1,
                forwarded_by=k + 1 if receiving and k + 1 < WORLD - 1 else None,
                first_write=receiving,
            ))
        return out

    return lambda rank: RingSchedule(
        world=WORLD, rank=rank, itemsize=4, slice_bytes=SLICE,
        send=segments(rank, 0, receiving=False), recv=segments(rank, 1, receiving=True),
    )


def reader(attempt: RingAttempt, connection: Connection, frames: int | None = None) -> Protocol[None]:
    """What the receive path does with each frame of the attempt, for one connection:
    every frame of the attempt, or the first ``frames``."""
    landing = np.empty(SLICE, dtype=np.uint8)
    inbound = attempt.inbound
    for _ in range(sum(attempt.schedule.recv_slices) if frames is None else frames):
        tag, _seq, offset, nbytes = yield ReceiveHeader()
        segment, index = inbound.claim(tag, offset, nbytes)
        view = inbound.direct_target(segment, index, connection)
        if view is not None:
            yield ReceivePayload(view)
            inbound.on_direct_slice(segment, index, connection, True)
        else:
            yield ReceivePayload(landing[:nbytes].data)
            inbound.on_slice(segment, index, landing[:nbytes])


async def memory_ring() -> list[tuple[Connection, Connection]]:
    """``(to successor, from predecessor)`` per rank, in trio tasks."""
    network = MemoryNetwork()
    hosts = [network.host(f"p{r}") for r in range(WORLD)]
    listeners = [await host.listen("", 7000) for host in hosts]
    outgoing, incoming = [], []
    for rank in range(WORLD):
        successor = (rank + 1) % WORLD
        outgoing.append(await hosts[rank].connect(f"p{successor}", 7000))
        incoming.append(await listeners[successor].accept())
    framed = [FramedStream(s, max_control_frame=4096, max_data_frame=FRAMES) for s in outgoing]
    received = [FramedStream(s, max_control_frame=4096, max_data_frame=FRAMES) for s in incoming]
    return [(framed[r], received[r - 1]) for r in range(WORLD)]


def socket_ring() -> list[tuple[Connection, Connection]]:
    """The same over socket pairs, in worker threads (readers forward small attempts)."""
    pairs = [socket.socketpair() for _ in range(WORLD)]
    sending = [SocketLink(a, max_data_frame=FRAMES) for a, _ in pairs]
    receiving = [SocketLink(b, max_data_frame=FRAMES) for _, b in pairs]
    return [(sending[r], receiving[r - 1]) for r in range(WORLD)]


async def run(
    plan: Plan, buffers: Sequence[np.ndarray], op: ReduceOp, drivers: str, *,
    ring: tuple[int, ...] = tuple(range(1, WORLD + 1)),
    sends: Sequence[np.ndarray] | None = None, own_starts: Sequence[int] | None = None,
) -> list[RingAttempt]:
    """Run each rank's schedule of ``plan`` into its buffer (in place, or from
    ``sends``: an all-gather's own parts, which lie at ``own_starts`` in the buffers)."""
    attempts = [
        RingAttempt(schedule=plan(rank), staging=HostStaging(),
                    send=buffers[rank] if sends is None else sends[rank],
                    result=buffers[rank], op=op, tag=5, ring=ring,
                    own_start=0 if own_starts is None else own_starts[rank])
        for rank in range(WORLD)
    ]
    links = await memory_ring() if drivers == "trio" else socket_ring()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for attempt, (to_next, from_previous) in zip(attempts, links, strict=True):
                attempt.seq = 1
                nursery.start_soon(run_protocol, reader(attempt, from_previous), from_previous)
                nursery.start_soon(attempt.send_all, [to_next])
    for attempt in attempts:
        assert attempt.complete and attempt.failure is None
        attempt.stop()
        await attempt.settle()
        attempt.release()
    for to_next, from_previous in links:
        for link in (to_next, from_previous):
            link.close_now()
    return attempts


@pytest.fixture(params=["trio", "threads"])
def drivers(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("count", [0, 2, 301, 3000])
async def test_the_all_reduce_schedule_sums_exactly_on_every_peer(count: int, drivers: str) -> None:
    rng = np.random.default_rng(count)
    data = [rng.integers(-1000, 1000, count).astype(np.int32) for _ in range(WORLD)]
    buffers = [d.copy() for d in data]
    attempts = await run(all_reduce(count), buffers, ReduceOp.SUM, drivers)
    for buffer in buffers:
        assert buffer.tobytes() == sum(data).astype(np.int32).tobytes()
    for attempt in attempts:
        assert attempt.tx_bytes == sum(s.nbytes for s in attempt.schedule.send)
        assert attempt.rx_bytes == sum(s.nbytes for s in attempt.schedule.recv)


@pytest.mark.parametrize("count", [1, 300])
async def test_a_broadcast_schedule_leaves_the_roots_bytes_everywhere(count: int, drivers: str) -> None:
    data = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(WORLD)]
    buffers = [d.copy() for d in data]
    attempts = await run(broadcast(count), buffers, ReduceOp.SUM, drivers)
    for buffer in buffers:
        assert buffer.tobytes() == data[0].tobytes()
    assert attempts[0].rx_bytes == attempts[-1].tx_bytes == 0


@pytest.mark.parametrize("root", range(WORLD))
async def test_the_broadcast_schedule_from_any_root_leaves_its_bytes_everywhere(
    root: int, drivers: str,
) -> None:
    count = 300
    data = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(WORLD)]
    buffers = [d.copy() for d in data]
    attempts = await run(
        lambda rank: RingSchedule.broadcast(
            count=count, itemsize=4, world=WORLD, rank=rank, root=root, slice_bytes=SLICE
        ),
        buffers, ReduceOp.SUM, drivers,
    )
    assert all(b.tobytes() == data[root].tobytes() for b in buffers)
    assert attempts[root].rx_bytes == attempts[root - 1].tx_bytes == 0
    assert sum(a.tx_bytes for a in attempts) == (WORLD - 1) * count * 4


async def test_an_all_gather_schedule_gives_every_peer_every_chunk(drivers: str) -> None:
    count = WORLD * 100
    chunk = count // WORLD
    data = [np.full(count, -1, dtype=np.int32) for _ in range(WORLD)]
    for rank, array in enumerate(data):
        array[rank * chunk:(rank + 1) * chunk] = np.arange(chunk) + 1000 * rank
    buffers = [d.copy() for d in data]
    await run(all_gather(count), buffers, ReduceOp.SUM, drivers)
    expected = np.concatenate([d[r * chunk:(r + 1) * chunk] for r, d in enumerate(data)])
    for buffer in buffers:
        assert buffer.tobytes() == expected.tobytes()


@pytest.mark.parametrize("count", [0, 2, 301, 3000])
@pytest.mark.parametrize("ring", [(1, 2, 3), (3, 1, 2), (2, 1, 3)])
async def test_a_reduce_scatter_leaves_each_peer_its_part_with_the_all_reduces_bits(
    count: int, ring: tuple[int, int, int], drivers: str,
) -> None:
    """``all_reduce(scatter=True)`` laid out by ``ring_parts``: the peer at each ring
    position ends holding its own part of the vector (``numpy.array_split``'s, by
    ascending peer id), bit for bit what the all-reduce laid out alike holds there,
    for floats whose sum depends on its order."""
    rng = np.random.default_rng(count)
    data = [rng.standard_normal(count).astype(np.float32) * 10.0 ** r for r in range(WORLD)]
    parts = ring_parts(ring)

    def plan(scatter: bool) -> Plan:
        return lambda rank: RingSchedule.all_reduce(
            count=count, itemsize=4, world=WORLD, rank=rank, slice_bytes=SLICE,
            parts=parts, scatter=scatter,
        )

    whole = [d.copy() for d in data]
    await run(plan(False), whole, ReduceOp.SUM, drivers)
    scattered = [d.copy() for d in data]
    attempts = await run(plan(True), scattered, ReduceOp.SUM, drivers)
    by_id = sorted(ring)
    for rank, attempt in enumerate(attempts):
        start, stop = (offset // 4 for offset in attempt.schedule.scattered)
        assert (start, stop) == _part(count, by_id.index(ring[rank]))
        assert scattered[rank][start:stop].tobytes() == whole[rank][start:stop].tobytes()
    assert all(w.tobytes() == whole[0].tobytes() for w in whole)


def _part(count: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``count`` elements cut in ``WORLD``, as ``numpy.array_split``."""
    sizes = [len(p) for p in np.array_split(np.arange(count), WORLD)]
    start = sum(sizes[:index])
    return start, start + sizes[index]


async def sends_until_stopped(attempt: RingAttempt, connection: Connection) -> None:
    """The part, stopped; the root's may have sent everything first."""
    try:
        await attempt.send_all([connection])
    except LocalFailure as exc:
        assert "stopped by the test" in str(exc)


async def test_an_aborted_broadcast_puts_the_input_back() -> None:
    """Stopped once five slices of the root's bytes arrived at the next peer (and as
    many of them went on), every receiver's buffer is its own input again."""
    count = 1000
    data = [np.arange(count, dtype=np.float32) + r for r in range(WORLD)]
    buffers = [d.copy() for d in data]
    plan = broadcast(count)
    ring = tuple(range(1, WORLD + 1))
    attempts = [
        RingAttempt(schedule=plan(rank), staging=HostStaging(), send=buffers[rank],
                    result=buffers[rank], op=ReduceOp.SUM, tag=5, ring=ring)
        for rank in range(WORLD)
    ]
    links = await memory_ring()
    middle, last = attempts[1], attempts[2]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for attempt in attempts:
                attempt.seq = 1
            nursery.start_soon(run_protocol, reader(last, links[2][1]), links[2][1])
            for rank in (0, 1):
                nursery.start_soon(sends_until_stopped, attempts[rank], links[rank][0])
            await run_protocol(reader(middle, links[1][1], frames=5), links[1][1])
            await last.ledger.signal.wait_until(lambda: last.rx_bytes == 5 * SLICE)
            for attempt in attempts:
                attempt.fail("stopped by the test")
                attempt.stop()
            nursery.cancel_scope.cancel()
    for to_next, from_previous in links:
        to_next.close_now()
        from_previous.close_now()
    assert middle.rx_bytes == 5 * SLICE
    for attempt in attempts:
        await attempt.settle()
        attempt.restore()
        attempt.release()
    for buffer, original in zip(buffers, data, strict=True):
        assert buffer.tobytes() == original.tobytes()


async def test_a_stream_is_dealt_round_robin_over_the_pool_in_stream_order() -> None:
    """Slice ``p`` of a peer's send stream travels on connection ``p mod n`` of its
    pool, each connection's slices in stream order, at the offsets the schedule names."""
    count, pool = 1000, 2
    schedule = all_reduce(count)
    network = MemoryNetwork()
    hosts = [network.host(f"p{r}") for r in range(2)]
    listener = await hosts[1].listen("", 7000)
    outgoing = [await hosts[0].connect("p1", 7000) for _ in range(pool)]
    incoming = [await listener.accept() for _ in range(pool)]
    framed = [FramedStream(s, max_control_frame=4096, max_data_frame=FRAMES) for s in outgoing]
    received = [FramedStream(s, max_control_frame=4096, max_data_frame=FRAMES) for s in incoming]
    data = np.arange(count, dtype=np.float32)
    # Rank 0 of three: its predecessor's part is played by the test (every slice it
    # would receive is delivered at once), its successor's by the readers below.
    attempt = RingAttempt(schedule=schedule(0), staging=HostStaging(), send=data, result=data,
                          op=ReduceOp.SUM, tag=5, ring=(1, 2, 3))
    attempt.seq = 1
    plan = attempt.schedule
    expected = [
        segment.stream_offset + index * plan.slice_bytes
        for segment in plan.send for index in range(plan.slice_count(segment))
    ]
    headers: list[list[tuple[int, int]]] = [[] for _ in range(pool)]

    async def read(k: int) -> None:
        for _ in range(len(expected[k::pool])):
            _tag, _seq, offset, nbytes = await received[k].receive_data_header()
            await received[k].receive_payload(memoryview(bytearray(nbytes)))
            headers[k].append((offset, nbytes))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for k in range(pool):
                nursery.start_soon(read, k)
            nursery.start_soon(attempt.send_all, framed)
            for segment in plan.recv:
                for index in range(plan.slice_count(segment)):
                    start, stop = plan.slice_range(segment, index)
                    inbound = attempt.inbound
                    claimed = inbound.claim(5, segment.stream_offset + start - segment.start, stop - start)
                    inbound.on_slice(*claimed, np.zeros(stop - start, dtype=np.uint8))
    for k in range(pool):
        assert [offset for offset, _ in headers[k]] == expected[k::pool]
    attempt.stop()
    await attempt.settle()
    attempt.release()
