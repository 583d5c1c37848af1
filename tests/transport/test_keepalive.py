"""``keep_alive``: heartbeats written from a thread while the event loop is blocked,
sealed with the link's channel and never torn by, or tearing, the trio side's frames.

Real loopback TCP under a run secret. The trio thread blocks with ``time.sleep`` on
purpose: that is what a trainer computing inline does to it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Sequence

import pytest
import trio

from pccl_trio._core.channel import Purpose
from pccl_trio._core.messages import Heartbeat, Kick, Message
from pccl_trio._core.wire import DataFrame, Undecoded, encode_control
from pccl_trio.testing import MemoryNetwork
from pccl_trio.transport import Credential, FramedStream, keep_alive, secure_client, secure_server

TIMEOUT = 20
CREDENTIAL = Credential(secret=b"k" * 32)
#: A data frame's payload larger than loopback's socket buffers, so
#: trio's sends wait part-way through a frame.
BIG = 1024 * 1024
MAX_CONTROL = 4096


async def secured_pair() -> tuple[FramedStream, FramedStream]:
    """A peer-side and a master-side ``FramedStream`` over loopback TCP, each with the
    channel of one run-secret handshake."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client_stream = await trio.open_tcp_stream("127.0.0.1", port)
    server_stream = await listeners[0].accept()
    await listeners[0].aclose()
    async with trio.open_nursery() as nursery:
        channels: dict[str, object] = {}

        async def serve() -> None:
            channels["server"] = (await secure_server(
                server_stream, CREDENTIAL, frozenset({Purpose.MASTER})
            ))[1]

        nursery.start_soon(serve)
        channels["client"] = await secure_client(client_stream, CREDENTIAL, Purpose.MASTER)
    return (
        FramedStream(client_stream, max_control_frame=MAX_CONTROL,
                     channel=channels["client"]),  # type: ignore[arg-type]
        FramedStream(server_stream, max_control_frame=MAX_CONTROL, max_data_frame=2 * BIG,
                     channel=channels["server"]),  # type: ignore[arg-type]
    )


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FramedStream, FramedStream]]:
    with trio.fail_after(TIMEOUT):
        client, server = await secured_pair()
    try:
        yield client, server
    finally:
        await client.aclose()
        await server.aclose()


async def received_until_closed(
    link: FramedStream, pause: float = 0.0
) -> list[Message | DataFrame]:
    """Every frame ``link`` receives until the other side closes it (each opened with
    the channel: a torn, reordered or unsealed frame raises), blocking the loop for
    ``pause`` after each."""
    frames: list[Message | DataFrame] = []
    while True:
        try:
            frame = await link.receive()
        except trio.BrokenResourceError:
            return frames
        assert not isinstance(frame, Undecoded)
        assert not isinstance(frame, DataFrame) or len(frame.payload) == BIG
        frames.append(frame)
        time.sleep(pause)  # noqa: ASYNC251 - the sender waits mid-frame, with room now


async def ended(thread: threading.Thread) -> bool:
    await trio.to_thread.run_sync(thread.join, TIMEOUT)
    return not thread.is_alive()


async def test_heartbeats_flow_while_the_loop_is_blocked(
    pair: tuple[FramedStream, FramedStream],
) -> None:
    client, server = pair
    with trio.fail_after(TIMEOUT):
        thread = keep_alive(client, Heartbeat(), 0.02)
        assert thread is not None
        time.sleep(0.5)  # noqa: ASYNC251 - the loop blocks, as a trainer's step would
        await client.send_message(Kick(reason="after the block"))
        await client.aclose()
        assert await ended(thread)
        frames = await received_until_closed(server)
    assert frames[-1] == Kick(reason="after the block")
    # The trio side sent no heartbeat: every one came from the thread, in the block.
    assert len(frames) >= 2 and set(frames[:-1]) == {Heartbeat()}, frames


async def test_a_task_blocking_the_loop_right_after_a_send_does_not_lock_the_thread_out(
    pair: tuple[FramedStream, FramedStream], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer's task may block the loop while the sending task sits at the checkpoint
    that ends its send: the wire's claim ended with the last byte, so the thread still
    heartbeats in every block. The trainer blocks as soon as the frame is written; trio
    runs the two tasks in random order, so several rounds."""
    client, server = pair
    rounds = 8
    written = 0
    writev = os.writev

    def counting_writev(fd: int, buffers: Sequence[memoryview]) -> int:
        nonlocal written
        sent = writev(fd, buffers)
        written += 1
        return sent

    monkeypatch.setattr(os, "writev", counting_writev)
    with trio.fail_after(TIMEOUT):
        thread = keep_alive(client, Heartbeat(), 0.01)
        assert thread is not None

        async def compute(round_: int) -> None:
            while written <= round_:
                await trio.lowlevel.cancel_shielded_checkpoint()
            time.sleep(0.2)  # noqa: ASYNC251 - a trainer's step, inline

        for index in range(rounds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.send_message, Kick(reason=str(index)))
                nursery.start_soon(compute, index)
        await client.aclose()
        assert await ended(thread)
        frames = await received_until_closed(server)
    kicks = [i for i, f in enumerate(frames) if isinstance(f, Kick)]
    assert [frames[i] for i in kicks] == [Kick(reason=str(i)) for i in range(rounds)]
    # The thread heartbeated in every block, after its round's frame.
    assert all(b - a > 1 for a, b in zip(kicks, [*kicks[1:], len(frames)], strict=True)), frames


async def test_thread_frames_interleave_whole_and_in_seal_order(
    pair: tuple[FramedStream, FramedStream],
) -> None:
    """The trio side sends data frames too big for the socket buffers (its sends wait
    mid-frame, and the receiver blocks the loop while they do) and messages, and blocks
    between them; the thread heartbeats in every gap it may. The master side opens every
    frame with its channel, and the trio side's arrive whole and in order."""
    client, server = pair
    count = 24
    payload = memoryview(bytes(BIG))
    with trio.fail_after(TIMEOUT):
        # Heartbeats at most every 3 ms: fewer than the receiver's pauses let it read.
        thread = keep_alive(client, Heartbeat(), 0.003)
        assert thread is not None

        async def send() -> None:
            for index in range(count):
                await client.send_data(tag=1, seq=index, offset=0, payload=payload)
                await client.send_message(Kick(reason=str(index)))
                time.sleep(0.005)  # noqa: ASYNC251 - a gap the thread fills
            await client.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            frames = await received_until_closed(server, pause=0.002)
        assert await ended(thread)
    from_trio = [
        ("data", f.seq) if isinstance(f, DataFrame) else ("kick", int(f.reason))
        for f in frames if isinstance(f, (DataFrame, Kick))
    ]
    assert from_trio == [(kind, i) for i in range(count) for kind in ("data", "kick")]
    heartbeats = [f for f in frames if not isinstance(f, (DataFrame, Kick))]
    assert heartbeats and set(heartbeats) == {Heartbeat()}


async def test_the_thread_ends_when_the_other_side_resets(
    pair: tuple[FramedStream, FramedStream],
) -> None:
    client, server = pair
    with trio.fail_after(TIMEOUT):
        thread = keep_alive(client, Heartbeat(), 0.01)
        assert thread is not None
        assert server.socket is not None
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await server.aclose()  # a reset: the thread's next write fails
        assert await ended(thread)
        assert not client.closed  # the trio side finds out on its own
        with pytest.raises(trio.BrokenResourceError):
            await client.receive_message()


async def test_no_thread_without_a_tcp_socket() -> None:
    network = MemoryNetwork()
    with trio.fail_after(TIMEOUT):
        listener = await network.host("a").listen("a", 0)
        stream = await network.host("b").connect("a", listener.port)
        link = FramedStream(stream, max_control_frame=MAX_CONTROL)
        assert keep_alive(link, Heartbeat(), 0.01) is None
        await link.aclose()


async def test_a_frame_written_in_part_without_waiting_keeps_the_wire_claimed(
    pair: tuple[FramedStream, FramedStream],
) -> None:
    """``write_nowait`` writes what the socket takes at once (here, with nobody
    reading, not all of it); until ``send_bytes`` finished the rest, a keepalive
    writes nothing, even once there is room, so the frames arrive whole and in seal
    order."""
    client, server = pair
    with trio.fail_after(TIMEOUT):
        kicks = [Kick(reason=f"{i:06d}" + "x" * 1000) for i in range(16_000)]
        sealed = b"".join(encode_control(kick, server.channel) for kick in kicks)
        rest = server.write_nowait(sealed)
        assert 0 < len(rest) < len(sealed)
        # Make room, then offer the keepalive's heartbeat mid-frame.
        whole = (len(sealed) - len(rest)) * len(kicks) // len(sealed)
        received: list[Message | DataFrame] = [await client.receive_message()
                                               for _ in range(whole // 2)]
        assert server.socket is not None
        await trio.lowlevel.wait_writable(server.socket)
        assert server.write_if_idle(Heartbeat(), 0.0)
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                received.extend(await received_until_closed(client))

            nursery.start_soon(receive)
            await server.send_bytes(rest)
            last = server.write_nowait(encode_control(Kick(reason="last"), server.channel))
            if last:
                await server.send_bytes(last)
            await server.aclose()
    assert received == [*kicks, Kick(reason="last")]
