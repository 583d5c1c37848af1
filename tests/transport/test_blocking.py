"""``SocketLink`` and ``run_in_thread`` over real loopback TCP sockets.

Threads are always started with ``run_in_thread`` and an ``interrupt`` that shuts the
socket they block on down, so the ``fail_after`` bounding every test can end a hang.
Nothing here sleeps to synchronize: a test that must know a thread got somewhere
polls a condition with bare checkpoints, bounded by the same ``fail_after``.
"""

from __future__ import annotations

import fcntl
import random
import socket
import struct
import termios
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import trio

from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.messages import PROTOCOL_VERSION, P2PHello, P2PHelloAck
from pccl_trio._core.wire import DATA_HEADER, DataFrame, FrameType, encode_control, encode_data
from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import FramedStream, SocketLink, _framed, run_in_thread
from pccl_trio.transport._framed import readable_now

TIMEOUT = 10
MiB = 1 << 20
MAX_DATA = 4 * MiB
MAX_CONTROL = 4096
U64_MAX = (1 << 64) - 1
#: A data frame's body is its header (after the length prefix) plus the payload.
DATA_BODY_HEADER = DATA_HEADER.size - 4
#: Far more than loopback TCP buffers hold: a send of it blocks until the peer reads.
BLOCKING_SEND = 64 * MiB


# --- helpers ---------------------------------------------------------------------


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected blocking TCP sockets on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


class CountingSocket(socket.socket):
    """A socket that counts its ``close`` calls."""

    closes: int

    def close(self) -> None:
        self.closes = getattr(self, "closes", 0) + 1
        super().close()


def counting(sock: socket.socket) -> CountingSocket:
    counted = CountingSocket(fileno=sock.detach())
    counted.closes = 0
    return counted


def shut(sock: socket.socket) -> None:
    """Wake every call blocked on ``sock`` (an ``interrupt`` for peer-side threads)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def abort(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (RST) instead of an orderly end of stream (FIN)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    received = 0
    while received < nbytes:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise EOFError(f"end of stream after {received} of {nbytes} bytes")
        received += n
    return bytes(buffer)


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` between checkpoints (the caller's ``fail_after`` bounds it)."""
    while not predicate():
        await trio.lowlevel.checkpoint()


async def block_a_send_then(
    link: SocketLink, peer: socket.socket, error: type[Exception], then: Callable[[], object]
) -> None:
    """Start a send far larger than the socket buffers of a peer that never reads; once
    it is blocked, call ``then``; the send must fail with ``error``."""
    payload = memoryview(bytearray(BLOCKING_SEND))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(error):
                    await run_in_thread(
                        partial(link.send_data, tag=1, seq=1, offset=0, payload=payload), interrupt=link.cut
                    )

            nursery.start_soon(send)
            # The send started (bytes arrived); the peer never reads, so it fills the buffers.
            await wait_until(lambda: link._shared._users == 1 and readable_now(peer))
            then()


def payload_for(tag: int, seq: int, nbytes: int) -> bytes:
    """Deterministic bytes that differ per frame."""
    return random.Random(f"{tag}/{seq}").randbytes(nbytes)


def receive_frame(link: SocketLink) -> tuple[int, int, int, bytes]:
    tag, seq, offset, nbytes = link.receive_data_header()
    payload = bytearray(nbytes)
    link.receive_payload(memoryview(payload))
    return tag, seq, offset, bytes(payload)


def raw_header(*, body_length: int, frame_type: int, nbytes: int, tag: int = 1) -> bytes:
    return DATA_HEADER.pack(body_length, frame_type, tag, 2, 3, nbytes)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Plain sockets to close when the test ends."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


@pytest.fixture
def links() -> Iterator[list[SocketLink]]:
    """Links to cut when the test ends (their threads are over by then)."""
    made: list[SocketLink] = []
    yield made
    for link in made:
        link.cut()


@pytest.fixture
def link_and_peer(
    sockets: list[socket.socket], links: list[SocketLink]
) -> tuple[SocketLink, CountingSocket, socket.socket]:
    """A link on one end of a TCP connection (its socket counts closes), a plain
    socket on the other."""
    mine, peer = tcp_pair()
    counted = counting(mine)
    sockets.append(peer)
    link = SocketLink(counted, max_data_frame=MAX_DATA)
    links.append(link)
    return link, counted, peer


@pytest.fixture
def link_pair(sockets: list[socket.socket], links: list[SocketLink]) -> tuple[SocketLink, SocketLink]:
    a, b = tcp_pair()
    pair = (SocketLink(a, max_data_frame=MAX_DATA), SocketLink(b, max_data_frame=MAX_DATA))
    links.extend(pair)
    return pair


# --- round trips -----------------------------------------------------------------

FRAMES = [
    # (tag, seq, offset, nbytes): empty, one byte, larger than any socket buffer, extremes.
    (0, 0, 0, 0),
    (1, 2, 3, 1),
    (7, 11, 5 * MiB, 3 * MiB),
    (U64_MAX, U64_MAX, U64_MAX, 1000),
    (42, 1, 0, 0),
    (5, 6, 7, 65537),
]


async def test_round_trip_between_two_links(link_pair: tuple[SocketLink, SocketLink]) -> None:
    sender, receiver = link_pair
    received: list[tuple[int, int, int, bytes]] = []

    def send_all() -> None:
        for tag, seq, offset, nbytes in FRAMES:
            payload = memoryview(payload_for(tag, seq, nbytes))
            sender.send_data(tag=tag, seq=seq, offset=offset, payload=payload)

    def receive_all() -> None:
        for _ in FRAMES:
            received.append(receive_frame(receiver))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(run_in_thread, send_all, interrupt=sender.cut))
            nursery.start_soon(partial(run_in_thread, receive_all, interrupt=receiver.cut))

    assert [(tag, seq, offset, len(payload)) for tag, seq, offset, payload in received] == FRAMES
    for tag, seq, _offset, payload in received:
        assert payload == payload_for(tag, seq, len(payload))
    assert not sender.closed and not receiver.closed


async def test_bytes_on_the_wire_are_the_codecs_frames(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    expected = b"".join(
        encode_data(tag=tag, seq=seq, offset=offset, payload=payload_for(tag, seq, nbytes))
        for tag, seq, offset, nbytes in FRAMES
    )
    on_the_wire: list[bytes] = []

    def send_all() -> None:
        for tag, seq, offset, nbytes in FRAMES:
            payload = memoryview(payload_for(tag, seq, nbytes))
            link.send_data(tag=tag, seq=seq, offset=offset, payload=payload)

    async def read_peer() -> None:
        data = await run_in_thread(partial(recv_exact, peer, len(expected)), interrupt=partial(shut, peer))
        on_the_wire.append(data)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(run_in_thread, send_all, interrupt=link.cut))
            nursery.start_soon(read_peer)
    assert on_the_wire == [expected]


async def test_frames_from_concurrent_senders_never_interleave(
    link_pair: tuple[SocketLink, SocketLink],
) -> None:
    sender, receiver = link_pair
    senders, frames_each, nbytes = 4, 8, 256 * 1024
    received: list[tuple[int, int, int, bytes]] = []

    def send_some(tag: int) -> None:
        for seq in range(frames_each):
            payload = memoryview(payload_for(tag, seq, nbytes))
            sender.send_data(tag=tag, seq=seq, offset=seq * nbytes, payload=payload)

    def receive_all() -> None:
        for _ in range(senders * frames_each):
            received.append(receive_frame(receiver))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for tag in range(senders):
                nursery.start_soon(partial(run_in_thread, partial(send_some, tag), interrupt=sender.cut))
            nursery.start_soon(partial(run_in_thread, receive_all, interrupt=receiver.cut))

    assert sorted((tag, seq) for tag, seq, _, _ in received) == [
        (tag, seq) for tag in range(senders) for seq in range(frames_each)
    ]
    for tag, seq, offset, payload in received:
        assert offset == seq * nbytes
        assert payload == payload_for(tag, seq, nbytes)
    for tag in range(senders):  # each sender's own frames stay in order
        assert [seq for t, seq, _, _ in received if t == tag] == list(range(frames_each))


async def test_send_frames_sends_several_whole_frames(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    frames = [encode_data(tag=t, seq=t, offset=0, payload=payload_for(t, t, 100 * t)) for t in range(1, 4)]
    buffers = [memoryview(frame) for frame in frames]
    with trio.fail_after(TIMEOUT):
        await run_in_thread(partial(link.send_frames, buffers), interrupt=link.cut)
        data = await run_in_thread(
            partial(recv_exact, peer, sum(map(len, frames))), interrupt=partial(shut, peer)
        )
    assert data == b"".join(frames)


# --- cut: this side closes -------------------------------------------------------


async def test_cut_wakes_a_blocked_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _peer = link_and_peer
    outcomes: list[BaseException] = []

    async def receive() -> None:
        with pytest.raises(trio.ClosedResourceError) as info:
            await run_in_thread(partial(link.receive_into, memoryview(bytearray(10))), interrupt=link.cut)
        outcomes.append(info.value)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await wait_until(lambda: link._shared._users == 1)
            link.cut()
    assert len(outcomes) == 1
    assert link.closed
    assert counted.fileno() == -1 and counted.closes == 1


async def test_cut_wakes_a_receive_blocked_mid_payload(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    peer.sendall(b"x" * 100)  # a part of what the receive waits for
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await run_in_thread(
                        partial(link.receive_into, memoryview(bytearray(1000))), interrupt=link.cut
                    )

            nursery.start_soon(receive)
            await wait_until(lambda: link._shared._users == 1)
            link.cut()
    assert counted.fileno() == -1 and counted.closes == 1


async def test_cut_wakes_a_send_blocked_on_a_full_socket(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    await block_a_send_then(link, peer, trio.ClosedResourceError, link.cut)
    assert link.closed
    assert counted.fileno() == -1 and counted.closes == 1


async def test_cut_wakes_a_sender_waiting_for_the_send_lock(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    payload = memoryview(bytearray(BLOCKING_SEND))
    errors: list[type[BaseException]] = []

    async def send(nbytes: int) -> None:
        try:
            await run_in_thread(
                partial(link.send_data, tag=1, seq=1, offset=0, payload=payload[:nbytes]), interrupt=link.cut
            )
        except trio.ClosedResourceError as exc:
            errors.append(type(exc))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, BLOCKING_SEND)
            await wait_until(lambda: link._shared._users == 1 and readable_now(peer))
            nursery.start_soon(send, 10)  # queues behind the blocked send's lock
            link.cut()
    assert errors == [trio.ClosedResourceError, trio.ClosedResourceError]
    assert counted.closes == 1


async def test_every_call_after_cut_raises_closed(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _peer = link_and_peer
    link.cut()
    assert link.closed
    assert counted.fileno() == -1 and counted.closes == 1
    with pytest.raises(trio.ClosedResourceError):
        link.send_data(tag=1, seq=1, offset=0, payload=memoryview(b"abc"))
    with pytest.raises(trio.ClosedResourceError):
        link.send_frames([memoryview(b"abc")])
    with pytest.raises(trio.ClosedResourceError):
        link.receive_data_header()
    with pytest.raises(trio.ClosedResourceError):
        link.receive_into(memoryview(bytearray(1)))
    assert link.closed_by_peer()
    assert not link.send_lock.locked()
    await link.aclose()
    link.close_now()
    assert counted.closes == 1


# --- the other side ends the connection ------------------------------------------


async def test_peer_close_at_a_frame_boundary_breaks_the_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    peer.sendall(encode_data(tag=1, seq=2, offset=3, payload=b"abc"))
    peer.close()
    with trio.fail_after(TIMEOUT):
        frame = await run_in_thread(partial(receive_frame, link), interrupt=link.cut)
        assert frame == (1, 2, 3, b"abc")
        with pytest.raises(trio.BrokenResourceError):
            await run_in_thread(link.receive_data_header, interrupt=link.cut)
    assert not link.closed  # broken, not cut: the owner cuts it
    assert counted.closes == 0
    link.cut()
    assert counted.closes == 1


async def test_peer_close_inside_a_header_breaks_the_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    peer.sendall(encode_data(tag=1, seq=2, offset=3, payload=b"abc")[:10])
    peer.close()
    with trio.fail_after(TIMEOUT), pytest.raises(trio.BrokenResourceError):
        await run_in_thread(link.receive_data_header, interrupt=link.cut)


async def test_peer_close_mid_payload_breaks_the_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    frame = encode_data(tag=1, seq=2, offset=3, payload=payload_for(1, 2, 5000))
    peer.sendall(frame[: DATA_HEADER.size + 1234])
    peer.close()
    with trio.fail_after(TIMEOUT):
        header = await run_in_thread(link.receive_data_header, interrupt=link.cut)
        assert header == (1, 2, 3, 5000)
        with pytest.raises(trio.BrokenResourceError):
            await run_in_thread(
                partial(link.receive_payload, memoryview(bytearray(5000))), interrupt=link.cut
            )


async def test_peer_close_wakes_a_blocked_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                with pytest.raises(trio.BrokenResourceError):
                    await run_in_thread(
                        partial(link.receive_into, memoryview(bytearray(10))), interrupt=link.cut
                    )

            nursery.start_soon(receive)
            await wait_until(lambda: link._shared._users == 1)
            peer.close()
    assert not link.closed


async def test_peer_reset_breaks_the_receive(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    abort(peer)
    with trio.fail_after(TIMEOUT), pytest.raises(trio.BrokenResourceError):
        await run_in_thread(partial(link.receive_into, memoryview(bytearray(10))), interrupt=link.cut)


async def test_peer_reset_fails_a_blocked_send_and_cuts_the_link(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    await block_a_send_then(link, peer, trio.BrokenResourceError, lambda: abort(peer))
    assert link.closed  # a send that failed part-way never leaves a torn frame behind
    assert counted.fileno() == -1 and counted.closes == 1
    with pytest.raises(trio.ClosedResourceError):
        link.send_data(tag=1, seq=2, offset=0, payload=memoryview(b""))


async def test_closed_by_peer(link_and_peer: tuple[SocketLink, CountingSocket, socket.socket]) -> None:
    link, _, peer = link_and_peer
    with trio.fail_after(TIMEOUT):
        await run_in_thread(
            partial(link.send_data, tag=1, seq=1, offset=0, payload=memoryview(b"hello")), interrupt=link.cut
        )
        assert not link.closed_by_peer()
        peer.close()
        await wait_until(link.closed_by_peer)
    assert not link.closed
    assert link.closed_by_peer()  # stays so


@pytest.mark.parametrize("ended", ["closed_by_peer", "ended_by_peer"])
async def test_a_reset_and_a_cut_read_as_ended(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket], ended: str
) -> None:
    link, _, peer = link_and_peer
    asks = getattr(link, ended)
    assert not asks()
    abort(peer)
    with trio.fail_after(TIMEOUT):
        await wait_until(asks)
    link.cut()
    assert asks()


async def test_ended_by_peer_is_not_fooled_by_unread_bytes(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    """Bytes waiting for a reader are no close (``closed_by_peer`` would say closed);
    a close behind them is one, read or not."""
    link, _, peer = link_and_peer
    peer.sendall(b"a notice waiting for its reader")
    with trio.fail_after(TIMEOUT):
        await wait_until(link.closed_by_peer)  # readable: the bytes arrived
    assert not link.ended_by_peer()
    peer.close()
    with trio.fail_after(TIMEOUT):
        await wait_until(link.ended_by_peer)
    assert not link.closed
    assert link.ended_by_peer()  # stays so


@pytest.mark.parametrize("kind", ["stdlib", "trio"])
async def test_ended_by_peer_without_tcp_info_peeks(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Where the kernel's state is not read (other systems), a peek tells data from an
    end of stream, on a plain socket and on a trio one alike."""
    monkeypatch.setattr(_framed, "_LINUX_TCP_INFO", None)
    mine, peer = tcp_pair()
    sock: Any = mine if kind == "stdlib" else trio.socket.from_stdlib_socket(mine)
    try:
        assert not _framed.ended_by_peer(sock)
        peer.sendall(b"unread")
        with trio.fail_after(TIMEOUT):
            await wait_until(lambda: readable_now(mine))
        assert not _framed.ended_by_peer(sock)
        mine.recv(6)
        peer.close()
        with trio.fail_after(TIMEOUT):
            await wait_until(lambda: _framed.ended_by_peer(sock))
    finally:
        sock.close()
        peer.close()


# --- malformed headers ------------------------------------------------------------

MALFORMED = {
    "control frame": raw_header(body_length=DATA_BODY_HEADER, frame_type=FrameType.CONTROL, nbytes=0),
    "unknown frame type": raw_header(body_length=DATA_BODY_HEADER + 4, frame_type=7, nbytes=4),
    "payload longer than the body": raw_header(body_length=DATA_BODY_HEADER + 4, frame_type=2, nbytes=5),
    "payload shorter than the body": raw_header(body_length=DATA_BODY_HEADER + 4, frame_type=2, nbytes=3),
    "body shorter than a header": raw_header(body_length=1, frame_type=2, nbytes=0),
    "larger than max_data_frame": raw_header(
        body_length=DATA_BODY_HEADER + MAX_DATA, frame_type=2, nbytes=MAX_DATA
    ),
}


@pytest.mark.parametrize("header", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_header_is_a_protocol_error(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket], header: bytes
) -> None:
    link, _, peer = link_and_peer
    peer.sendall(header)
    with trio.fail_after(TIMEOUT), pytest.raises(RemoteProtocolError):
        await run_in_thread(link.receive_data_header, interrupt=link.cut)


async def test_a_real_control_frame_is_a_protocol_error(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, _, peer = link_and_peer
    frame = encode_control(P2PHelloAck())
    peer.sendall(frame + bytes(max(0, DATA_HEADER.size - len(frame))))
    with trio.fail_after(TIMEOUT), pytest.raises(RemoteProtocolError):
        await run_in_thread(link.receive_data_header, interrupt=link.cut)


async def test_max_data_frame_is_inclusive(sockets: list[socket.socket], links: list[SocketLink]) -> None:
    mine, peer = tcp_pair()
    sockets.append(peer)
    link = SocketLink(mine, max_data_frame=DATA_BODY_HEADER + 100)
    links.append(link)
    peer.sendall(encode_data(tag=1, seq=1, offset=0, payload=bytes(100)))
    peer.sendall(encode_data(tag=1, seq=2, offset=0, payload=bytes(101)))
    with trio.fail_after(TIMEOUT):
        assert await run_in_thread(partial(receive_frame, link), interrupt=link.cut) == (1, 1, 0, bytes(100))
        with pytest.raises(RemoteProtocolError):
            await run_in_thread(link.receive_data_header, interrupt=link.cut)


# --- the descriptor is closed once, by the last user -----------------------------


async def test_cut_without_users_closes_at_once_and_only_once(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _ = link_and_peer
    assert counted.fileno() != -1
    link.cut()
    assert counted.fileno() == -1 and counted.closes == 1
    link.cut()
    await link.aclose()
    assert counted.closes == 1


async def test_cut_inside_a_use_closes_when_the_last_user_leaves(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _ = link_and_peer
    first = link._shared.use()
    link._shared.use()
    link.cut()
    link.cut()
    assert counted.closes == 0 and first.fileno() != -1
    link._shared.done()
    assert counted.closes == 0 and first.fileno() != -1
    with pytest.raises(trio.ClosedResourceError):
        link._shared.use()  # no new user once cut
    assert counted.closes == 0 and first.fileno() != -1
    link._shared.done()
    assert counted.closes == 1 and counted.fileno() == -1
    link.cut()
    assert counted.closes == 1


async def test_cut_with_threads_in_both_directions_closes_once(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, peer = link_and_peer
    payload = memoryview(bytearray(BLOCKING_SEND))
    errors: list[type[BaseException]] = []

    async def call(fn: Callable[[], object]) -> None:
        try:
            await run_in_thread(fn, interrupt=link.cut)
        except trio.ClosedResourceError as exc:
            errors.append(type(exc))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, partial(link.send_data, tag=1, seq=1, offset=0, payload=payload))
            nursery.start_soon(call, partial(link.receive_into, memoryview(bytearray(10))))
            await wait_until(lambda: link._shared._users == 2 and readable_now(peer))
            link.cut()
            link.cut()
    assert errors == [trio.ClosedResourceError, trio.ClosedResourceError]
    assert link._shared._users == 0
    assert counted.fileno() == -1 and counted.closes == 1


async def test_receive_thread_closes_the_descriptor_after_cut(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _ = link_and_peer
    left: list[int] = []  # the descriptor as the receive found it on its way out

    def receive() -> None:
        try:
            link.receive_into(memoryview(bytearray(10)))
        finally:
            left.append(counted.fileno())

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await run_in_thread(receive, interrupt=link.cut)

            nursery.start_soon(run)
            await wait_until(lambda: link._shared._users == 1)
            link.cut()
    assert left == [-1]
    assert counted.closes == 1


# --- run_in_thread ----------------------------------------------------------------


def never_interrupted() -> None:
    raise AssertionError("interrupt called")


async def test_run_in_thread_returns_the_value() -> None:
    with trio.fail_after(TIMEOUT):
        assert await run_in_thread(lambda: 6 * 7, interrupt=never_interrupted) == 42
        caller = threading.get_ident()
        worker = await run_in_thread(threading.get_ident, interrupt=never_interrupted)
    assert worker != caller


async def test_run_in_thread_raises_what_the_function_raises() -> None:
    class Oops(Exception):
        pass

    def fail() -> None:
        raise Oops("from the thread")

    with trio.fail_after(TIMEOUT), pytest.raises(Oops, match="from the thread"):
        await run_in_thread(fail, interrupt=never_interrupted)


async def test_run_in_thread_cancel_interrupts_and_waits_for_the_function() -> None:
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()
    release = threading.Event()
    events: list[str] = []

    def blocking() -> str:
        events.append("started")
        token.run_sync_soon(started.set)
        if not release.wait(3 * TIMEOUT):
            events.append("never interrupted")
        events.append("returned")
        return "value"

    def interrupt() -> None:
        events.append("interrupt")
        release.set()

    with trio.fail_after(TIMEOUT):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_once_started() -> None:
                    await started.wait()
                    scope.cancel()

                nursery.start_soon(cancel_once_started)
                try:
                    await run_in_thread(blocking, interrupt=interrupt)
                except trio.Cancelled:
                    events.append("cancelled")
                    raise
                events.append("not cancelled")
    assert scope.cancelled_caught
    assert events == ["started", "interrupt", "returned", "cancelled"]


async def test_run_in_thread_cancel_cuts_a_blocked_receive() -> None:
    a, b = tcp_pair()
    link = SocketLink(a, max_data_frame=MAX_DATA)
    try:
        with trio.fail_after(TIMEOUT):
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(run_in_thread, link.receive_data_header, interrupt=link.cut))
                    await wait_until(lambda: link._shared._users == 1)
                    scope.cancel()
        assert scope.cancelled_caught
        assert link.closed and link._shared._users == 0
        assert link._shared._sock.fileno() == -1
    finally:
        link.cut()
        b.close()


async def test_run_in_thread_already_cancelled_never_runs() -> None:
    ran: list[str] = []
    with trio.fail_after(TIMEOUT):
        with trio.CancelScope() as scope:
            scope.cancel()
            await run_in_thread(lambda: ran.append("fn"), interrupt=lambda: ran.append("interrupt"))
        assert scope.cancelled_caught
        # Any thread it had started would have had every chance to run by now.
        await run_in_thread(lambda: None, interrupt=never_interrupted)
    assert ran == []


# --- detach: from a FramedStream to a SocketLink ----------------------------------


async def test_detach_takes_over_a_tcp_stream_after_the_handshake(links: list[SocketLink]) -> None:
    with trio.fail_after(TIMEOUT):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            client_stream = await trio.open_tcp_stream("127.0.0.1", port)
            server_stream = await listeners[0].accept()
        framed = {
            side: FramedStream(stream, max_control_frame=MAX_CONTROL, max_data_frame=MAX_DATA)
            for side, stream in (("client", client_stream), ("server", server_stream))
        }
        async with framed["client"].stream, framed["server"].stream:
            hello = P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=3, slot=0)
            await framed["client"].send_message(hello)
            assert await framed["server"].receive_message() == hello
            await framed["server"].send_message(P2PHelloAck())
            assert await framed["client"].receive_message() == P2PHelloAck()

            link = SocketLink.detach(framed["server"], max_data_frame=MAX_DATA)
            assert link is not None
            links.append(link)
            assert framed["server"].closed and framed["server"].socket is None
            await framed["server"].aclose()  # closes nothing the link owns
            assert link._shared._sock.fileno() != -1

            # trio side -> link
            sent = payload_for(9, 1, 3 * MiB)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(framed["client"].send_data, tag=9, seq=1, offset=10, payload=memoryview(sent))
                )
                got = await run_in_thread(partial(receive_frame, link), interrupt=link.cut)
            assert got == (9, 1, 10, sent)

            # link -> trio side
            back = payload_for(9, 2, 1000)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        run_in_thread,
                        partial(link.send_data, tag=9, seq=2, offset=20, payload=memoryview(back)),
                        interrupt=link.cut,
                    )
                )
                frame = await framed["client"].receive()
            assert frame == DataFrame(tag=9, seq=2, offset=20, payload=back)

            link.cut()
            with pytest.raises(trio.BrokenResourceError):
                await framed["client"].receive()


async def test_detach_refuses_a_stream_with_bytes_past_the_handshake() -> None:
    with trio.fail_after(TIMEOUT):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            client_stream = await trio.open_tcp_stream("127.0.0.1", port)
            server_stream = await listeners[0].accept()
        async with client_stream, server_stream:
            server = FramedStream(server_stream, max_control_frame=MAX_CONTROL, max_data_frame=MAX_DATA)
            hello = encode_control(P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=3, slot=0))
            early = encode_data(tag=1, seq=1, offset=0, payload=b"too early")
            await client_stream.send_all(hello + early)
            # Both frames are in the kernel's buffer, so one read takes them both.
            await wait_until(lambda: _pending(server_stream.socket) == len(hello) + len(early))
            assert isinstance(await server.receive_message(), P2PHello)
            with pytest.raises(RemoteProtocolError):
                SocketLink.detach(server, max_data_frame=MAX_DATA)
            assert not server.closed and server.socket is not None  # still the stream's


def _pending(sock: trio.socket.SocketType) -> int:
    """Bytes waiting in the receive buffer of ``sock``."""
    buffer = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", buffer)[0])


async def test_detach_returns_none_for_a_closed_stream() -> None:
    with trio.fail_after(TIMEOUT):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listeners[0]:
            port = listeners[0].socket.getsockname()[1]
            client_stream = await trio.open_tcp_stream("127.0.0.1", port)
            server_stream = await listeners[0].accept()
        async with client_stream:
            server = FramedStream(server_stream, max_control_frame=MAX_CONTROL, max_data_frame=MAX_DATA)
            await server.aclose()
            assert SocketLink.detach(server, max_data_frame=MAX_DATA) is None


async def test_detach_returns_none_on_the_memory_network() -> None:
    network = MemoryNetwork()
    with trio.fail_after(TIMEOUT):
        listener = await network.host("a").listen("a", 0)
        client_stream = await network.host("b").connect("a", listener.port)
        server_stream = await listener.accept()
        client = FramedStream(client_stream, max_control_frame=MAX_CONTROL, max_data_frame=MAX_DATA)
        server = FramedStream(server_stream, max_control_frame=MAX_CONTROL, max_data_frame=MAX_DATA)
        await client.send_message(P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=1, slot=0))
        assert isinstance(await server.receive_message(), P2PHello)
        await server.send_message(P2PHelloAck())
        assert await client.receive_message() == P2PHelloAck()

        assert SocketLink.detach(server, max_data_frame=MAX_DATA) is None

        # The caller keeps using the stream in trio tasks (the communicator does).
        assert not server.closed
        await client.send_data(tag=4, seq=5, offset=6, payload=memoryview(b"payload"))
        assert await server.receive() == DataFrame(tag=4, seq=5, offset=6, payload=b"payload")
        await client.aclose()
        await server.aclose()
        await listener.aclose()


# --- a reader beside a sender ------------------------------------------------------


async def test_a_reader_that_waits_for_readable_bytes_gets_the_frame(
    link_pair: tuple[SocketLink, SocketLink],
) -> None:
    """``receive_data_header(wait_readable=True)`` waits in ``poll`` and then reads the
    frame as a plain receive does, while another thread sends on the same link."""
    sender, receiver = link_pair
    got: list[tuple[int, int, int, bytes]] = []

    def read_back() -> None:
        tag, seq, offset, nbytes = sender.receive_data_header(wait_readable=True)
        payload = bytearray(nbytes)
        sender.receive_payload(memoryview(payload))
        got.append((tag, seq, offset, bytes(payload)))

    def stream_out() -> None:
        for seq in range(4):
            sender.send_data(tag=1, seq=seq, offset=0, payload=memoryview(bytes(MiB)))

    def drain_then_answer() -> None:
        for _ in range(4):
            receive_frame(receiver)
        receiver.send_data(tag=9, seq=8, offset=2, payload=memoryview(b""))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(run_in_thread, read_back, interrupt=sender.cut))
            nursery.start_soon(partial(run_in_thread, stream_out, interrupt=sender.cut))
            nursery.start_soon(partial(run_in_thread, drain_then_answer, interrupt=receiver.cut))
    assert got == [(9, 8, 2, b"")]


async def test_cut_wakes_a_reader_waiting_for_readable_bytes(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    link, counted, _peer = link_and_peer
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def wait() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await run_in_thread(
                        partial(link.receive_data_header, wait_readable=True), interrupt=link.cut
                    )

            nursery.start_soon(wait)
            await wait_until(lambda: link._shared._users == 1)
            link.cut()
    assert counted.fileno() == -1 and counted.closes == 1


async def test_a_reader_waiting_for_readable_bytes_keeps_the_idle_timeout(
    link_and_peer: tuple[SocketLink, CountingSocket, socket.socket],
) -> None:
    """With an idle timeout set, a wait in ``poll`` fails as a silent ``recv`` does."""
    link, _counted, _peer = link_and_peer
    link.set_idle_timeout(0.05)
    with trio.fail_after(TIMEOUT), pytest.raises(trio.BrokenResourceError, match="nothing arrived"):
        await run_in_thread(partial(link.receive_data_header, wait_readable=True), interrupt=link.cut)


# --- acknowledgements against a bulk stream ------------------------------------------


def _quick_acks(sock: socket.socket) -> int:
    """Linux's ``TCP_QUICKACK`` as read back: 1 unless the connection is in its
    interactive ("ping-pong") mode, where acknowledgements are delayed."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK)


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="Linux TCP only")
@pytest.mark.parametrize("kind", ["link", "stream"])
async def test_acknowledge_promptly_leaves_the_interactive_mode_replies_entered(
    kind: str, sockets: list[socket.socket], links: list[SocketLink],
) -> None:
    """A small frame sent at once against bytes that just arrived is a "reply": after
    one to three of them (as the kernel counts) Linux delays its acknowledgements
    (ping-pong mode). ``acknowledge_promptly``, on a ``SocketLink`` or a TCP
    ``FramedStream``, leaves that mode."""
    theirs, mine = tcp_pair()
    sockets.extend([theirs, mine])
    with trio.fail_after(TIMEOUT):
        for _ in range(20):  # a reply the scheduler delayed past the timeout counts not
            theirs.sendall(bytes(4096))
            recv_exact(mine, 4096)
            mine.sendall(b"reply")
            recv_exact(theirs, 5)
            if not _quick_acks(mine):
                break
        assert _quick_acks(mine) == 0, "the replies never entered the interactive mode"
        if kind == "link":
            link = SocketLink(mine.dup(), max_data_frame=MAX_DATA)
            links.append(link)
            link.acknowledge_promptly()
        else:
            framed = FramedStream(
                trio.SocketStream(trio.socket.from_stdlib_socket(mine.dup())),
                max_control_frame=MAX_CONTROL,
            )
            framed.acknowledge_promptly()
            await framed.aclose()
        assert _quick_acks(mine) == 1
