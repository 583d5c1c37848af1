"""A trio stream that speaks frames: the shell around ``_core.wire``.

A ``FramedStream`` wraps either a TCP ``trio.SocketStream`` (zero-copy receives with
``recv_into`` on its socket, frames written with ``writev`` straight from their parts)
or a stream without a socket of its own that offers the ``InMemoryStream``
capabilities; nothing else is probed for. ``Connection`` names the two forms a p2p
connection takes once its handshake is over: this one, driven by trio tasks, and
``SocketLink``, driven by worker threads.

After a run-secret handshake (``_secure``) a stream carries its ``Channel``: control
frames are sealed as they are encoded and opened as they are read, a data frame's
payload is followed by its authentication tag, which ``receive_payload`` checks before
it returns, so no caller ever uses bytes that failed it.

A TCP stream may also be written from one other thread, its keepalive
(``_keepalive``). Both writers share the stream's ``SharedWire`` (``_shared_wire``): its
wire lock keeps frames whole and in the order they were sealed, and closing the stream
marks the wire closed before the socket is closed.
"""

from __future__ import annotations

import os
import select
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import trio

from .._core.channel import TAG_SIZE, Channel
from .._core.errors import RemoteProtocolError
from .._core.messages import Message, decode_message
from .._core.wire import (
    CONTROL_HEADER_SIZE,
    LENGTH_SIZE,
    Admission,
    DataFrame,
    DataFrameReader,
    DecoderState,
    FrameDecoder,
    Undecoded,
    encode_control,
    encode_data_header,
    open_control,
    parse_control_kind,
    parse_control_length,
)
from ._network import InMemoryStream
from ._shared_wire import SharedWire

if TYPE_CHECKING:
    from ._blocking import SocketLink

__all__ = [
    "RECEIVE_CHUNK",
    "Connection",
    "FramedStream",
    "acknowledge_promptly",
    "drop_sent",
    "readable_now",
]

RECEIVE_SIZE = 1 << 16
#: Step by which a one-frame reader grows its buffer: allocation follows arrival.
RECEIVE_CHUNK = 1 << 16


def readable_now(sock: socket.socket | trio.socket.SocketType) -> bool:
    """Whether a socket has something to read (data, end of stream, or a reset) right
    now; True if it is no longer usable at all. On a connection we only send on, this
    means the other side closed it."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


#: ``struct tcp_info``'s first byte on Linux: the connection's state, 1 while established.
#: (Other kernels lay the struct out otherwise: there, no ``TCP_INFO`` is asked.)
_TCP_ESTABLISHED = 1
_LINUX_TCP_INFO: int | None = (
    getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
)


def ended_by_peer(sock: socket.socket | trio.socket.SocketType) -> bool:
    """Whether the other side closed or reset a TCP connection, whether or not bytes
    it sent before are still unread; True if the socket is no longer usable at all.

    Unlike ``readable_now`` it is right on a connection that a reader reads too: an
    unread frame is no close. Linux says so in the connection's state (``TCP_INFO``:
    anything but established); elsewhere a peek tells an end of stream from data, and
    data waiting before the end counts as open.
    """
    try:
        if _LINUX_TCP_INFO is not None:
            info = sock.getsockopt(socket.IPPROTO_TCP, _LINUX_TCP_INFO, 8)
            if info:
                return info[0] != _TCP_ESTABLISHED
        # A plain socket on the same descriptor: a trio socket's ``recv`` is async.
        raw = sock if isinstance(sock, socket.socket) else socket.socket(fileno=sock.fileno())
        try:
            return not raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        finally:
            if raw is not sock:
                raw.detach()
    except BlockingIOError:
        return False  # nothing to read: open
    except (OSError, ValueError):
        return True


#: Linux's option that makes TCP acknowledge what arrives at once (``linux/tcp.h``).
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def acknowledge_promptly(sock: socket.socket | trio.socket.SocketType) -> None:
    """Make ``sock``'s TCP acknowledge what arrives at once again, after this side sent
    a small frame on a connection whose bulk comes the other way.

    A send that follows a received segment within the delayed-acknowledgement timeout
    looks to Linux like the reply of an interactive exchange: the connection enters its
    "ping-pong" mode, in which acknowledgements wait up to about 40 ms for data to ride
    on. Nothing rides on them here, so the other side's send window stalls instead:
    measured on loopback, a 16 MiB all-reduce at W=3 took 50 ms instead of 30 once each
    member also sent its completion notices back to its predecessor. ``TCP_QUICKACK``
    leaves that mode (it is not sticky: the next such send enters it again). A no-op
    where the system has no such option or the socket is gone.
    """
    if _TCP_QUICKACK is None:  # pragma: no cover - not Linux
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
    except (OSError, ValueError):
        pass  # closed meanwhile: its owner learns that from its own calls


def drop_sent(buffers: list[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes from ``buffers`` after a partial ``sendmsg`` or ``writev``."""
    while buffers and sent >= len(buffers[0]):
        sent -= len(buffers[0])
        buffers.pop(0)
    if buffers and sent:
        buffers[0] = buffers[0][sent:]


class FramedStream:
    """Send and receive whole frames over a ``trio.abc.Stream``.

    Sends are serialized by a lock so frames never interleave (and by the wire lock
    with a keepalive thread: see the module docstring). A send that fails or is
    cancelled may have written part of a frame, so the stream is closed at once: the
    connection is never reused with a torn frame in it.
    """

    def __init__(
        self, stream: trio.abc.Stream, *, max_control_frame: int, max_data_frame: int = 0,
        admission: Admission | None = None, decode: bool = True,
        channel: Channel | None = None,
    ) -> None:
        self.stream = stream
        self.channel = channel
        self._max_control_frame = max_control_frame
        # Zero-copy paths: a trio socket (TCP) or the memory network's receive_into.
        self._socket: trio.socket.SocketType | None = (
            stream.socket if isinstance(stream, trio.SocketStream) else None
        )
        self._data = DataFrameReader(max_data_frame=max_data_frame, channel=channel)
        self._decoder = FrameDecoder(
            max_control_frame=max_control_frame, max_data_frame=max_data_frame,
            admission=admission, decode=decode, channel=channel,
        )
        self._send_lock = trio.StrictFIFOLock()
        self._wire = SharedWire()  # shared with a keepalive thread

    @property
    def closed(self) -> bool:
        return self._wire.closed

    def wait_closed(self, seconds: float) -> bool:
        """Block the calling thread (never trio's) until the stream is closed, for at
        most ``seconds``; whether it is."""
        return self._wire.wait_closed(seconds)

    @property
    def socket(self) -> trio.socket.SocketType | None:
        """The TCP socket underneath, if any (None on the in-memory network)."""
        return self._socket

    def forget_socket(self) -> None:
        """Hand the socket to a new owner (``SocketLink.detach``): this stream is closed
        and never touches it again.

        Raises:
            RemoteProtocolError: the other side sent bytes before its turn (they were
                already read past the last frame, so the new owner would miss them).
        """
        if self._decoder.buffered:
            raise RemoteProtocolError("bytes arrived before the handshake finished")
        self._wire.close()
        self._socket = None

    async def send_message(self, message: Message) -> None:
        async with self._send_lock:
            # Sealed under the claim: a channel's frames must leave in the order sealed.
            await self._send_frame(lambda: [memoryview(encode_control(message, self.channel))])

    async def send_bytes(self, frame: bytes | bytearray | memoryview) -> None:
        """Send one or more complete encoded frames (sealed with ``channel``, in order,
        if the stream has one: see ``wire.encode_control``). Frames sealed before the
        call could fall behind a keepalive's: a stream with a channel and a keepalive
        is sent to with ``send_message`` only."""
        async with self._send_lock:
            await self._send_frame(lambda: [memoryview(frame).cast("B")])

    async def send_data(
        self, *, tag: int, seq: int, offset: int, payload: memoryview
    ) -> None:
        """Send one data frame; the payload goes from the caller's memory to the kernel
        (unless the channel encrypts it)."""
        if payload.itemsize != 1:
            payload = payload.cast("B")  # lengths below count bytes
        header = encode_data_header(
            tag=tag, seq=seq, offset=offset, nbytes=len(payload), trailer=self._data.trailer
        )
        async with self._send_lock:
            await self._send_frame(
                lambda: [memoryview(header), payload] if self.channel is None
                else self.channel.protect_data(header, payload)
            )

    async def _send_frame(self, seal: Callable[[], list[memoryview]]) -> None:
        """Seal one frame (``seal`` returns its parts) and write it whole, under
        ``_send_lock``. The wire's claim ends with the last byte, not a checkpoint
        later: a trainer that blocks the loop right after a send must not find a
        keepalive locked out. On TCP the parts go straight to the socket (one
        ``writev`` while the kernel takes them, waiting for room in between)."""
        if self._wire.closed:
            raise trio.ClosedResourceError("framed stream was closed")
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            with self._wire.claim():
                buffers = seal()
                if self._socket is None:
                    for buffer in buffers:
                        await self.stream.send_all(buffer)
                else:
                    fd = self._socket.fileno()
                    while buffers:
                        try:
                            drop_sent(buffers, os.writev(fd, buffers))
                        except BlockingIOError:
                            await trio.lowlevel.wait_writable(fd)
        except OSError as exc:
            await self.aclose()
            raise trio.BrokenResourceError(f"send failed: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise
        await trio.lowlevel.cancel_shielded_checkpoint()

    def write_nowait(self, frame: bytes) -> memoryview:
        """From the trio thread: write what the TCP socket takes of ``frame`` (complete
        sealed frames) right now, without waiting, if no trio send holds the stream.
        Returns what was not written (all of it without a socket, while a send is in
        progress, or if the socket is full or broken): send it with ``send_bytes``
        before anything else. A frame left part-written keeps the wire claimed (a
        keepalive writes nothing) until that send ends."""
        view = memoryview(frame).cast("B")
        if self._socket is None or self._send_lock.locked():
            return view
        return self._wire.write_nowait(self._socket, view)

    def write_if_idle(self, message: Message, idle: float) -> bool:
        """From a thread other than trio's: seal ``message`` and write it straight to the
        TCP socket, unless a trio send holds the wire, something was written in the last
        ``idle`` seconds, or the socket's buffer is full (``SharedWire.write_if_idle``).

        Returns:
            whether the stream can still be written: False once it is closed or broken.
        """
        sock = self._socket
        assert sock is not None, "only a TCP stream is written from a thread"
        return self._wire.write_if_idle(sock, lambda: encode_control(message, self.channel), idle)

    async def receive_data_header(self) -> tuple[int, int, int, int]:
        """``(tag, seq, offset, nbytes)`` of the next frame, which must be a data frame;
        the caller then receives its payload with ``receive_payload``."""
        if self._decoder.buffered:
            raise RemoteProtocolError("unexpected bytes before the data stream")
        await self.receive_into(self._data.header_buffer())
        return self._data.parse_header()

    async def receive_payload(self, view: memoryview) -> None:
        """Receive the payload of the data frame whose header was just read into
        ``view`` (exactly as long), then check its authentication tag.

        Raises:
            RemoteProtocolError: the tag failed (``view`` must not be used).
        """
        view = self._data.payload_buffer(view)
        await self.receive_into(view)
        if self.channel is not None:
            tag = bytearray(TAG_SIZE)
            await self.receive_into(memoryview(tag))
            self._data.accept(view, tag)

    async def receive_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly from the stream.

        Raises:
            trio.BrokenResourceError: the stream ended first.
        """
        received = 0
        total = len(view)
        while received < total:
            try:
                if self._socket is not None:
                    n = await self._socket.recv_into(view[received:])
                elif isinstance(self.stream, InMemoryStream):
                    n = await self.stream.receive_into(view[received:])
                else:  # pragma: no cover - any other stream: one copy
                    data = await self.stream.receive_some(total - received)
                    n = len(data)
                    view[received : received + n] = data
            except OSError as exc:
                raise trio.BrokenResourceError(f"receive failed: {exc}") from exc
            if n == 0:
                raise trio.BrokenResourceError("connection closed by the other side")
            received += n

    async def receive(self) -> Message | Undecoded | DataFrame:
        """The next frame (control frames ``Undecoded`` if the stream was made with
        ``decode=False``).

        Raises:
            trio.BrokenResourceError: the other side closed the connection or broke it.
            RemoteProtocolError: the other side sent bytes that are not valid frames.
        """
        while True:
            frame = self._decoder.next_frame()
            if frame is DecoderState.CLOSED:
                raise trio.BrokenResourceError("connection closed by the other side")
            if frame is not DecoderState.NEED_DATA:
                assert not isinstance(frame, DecoderState)
                return frame
            data = await self.stream.receive_some(RECEIVE_SIZE)
            self._decoder.receive_data(data)

    async def receive_message_exact(self, admission: Admission | None = None) -> Message:
        """The next frame, which must be a control message, read without taking any byte
        beyond it (data frames that follow can then be received straight into place).

        Args:
            admission: the kinds accepted, judged from the frame's header.

        Raises:
            trio.BrokenResourceError: the stream ended first.
            RemoteProtocolError: not a valid control frame, refused by ``admission``,
                or bytes already buffered.
        """
        if self._decoder.buffered:
            raise RemoteProtocolError("unexpected bytes before the control frame")
        prefix = bytearray(LENGTH_SIZE + CONTROL_HEADER_SIZE)
        await self.receive_into(memoryview(prefix)[:LENGTH_SIZE])
        length = parse_control_length(
            prefix[:LENGTH_SIZE], max_control_frame=self._max_control_frame + self._data.trailer
        )
        await self.receive_into(memoryview(prefix)[LENGTH_SIZE:])
        kind = parse_control_kind(prefix[LENGTH_SIZE:], length, admission, trailer=self._data.trailer)
        remaining = length - CONTROL_HEADER_SIZE
        body = bytearray()
        while len(body) < remaining:  # the buffer grows with what arrived
            start = len(body)
            body.extend(bytes(min(RECEIVE_CHUNK, remaining - start)))
            await self.receive_into(memoryview(body)[start:])
        if self.channel is not None:
            return decode_message(kind, open_control(prefix, body, self.channel))
        return decode_message(kind, body)

    async def receive_message(self) -> Message:
        """The next frame, which must be a control message."""
        frame = await self.receive()
        if isinstance(frame, DataFrame):
            raise RemoteProtocolError("data frame where a control message was expected")
        return frame.decode() if isinstance(frame, Undecoded) else frame

    async def receive_undecoded(self) -> Undecoded:
        """The next frame, which must be a control frame, as the stream received it
        (made with ``decode=False``)."""
        frame = await self.receive()
        if not isinstance(frame, Undecoded):
            raise RemoteProtocolError("a control frame was expected")
        return frame

    async def aclose(self) -> None:
        self._wire.close()
        await trio.aclose_forcefully(self.stream)

    def close_now(self) -> None:
        """Close without waiting: a task blocked receiving on this stream wakes with
        ``ClosedResourceError`` and receives nothing more."""
        self._wire.close()
        if self._socket is not None:
            self._socket.close()
        elif isinstance(self.stream, InMemoryStream):
            self.stream.close_now()
        else:  # pragma: no cover - only our two stream kinds exist
            raise TypeError(f"cannot close {self.stream!r} synchronously")

    def acknowledge_promptly(self) -> None:
        """After sending a small frame against a bulk stream that comes the other way:
        keep acknowledging that stream at once (``acknowledge_promptly``)."""
        if self._socket is not None and not self._wire.closed:
            acknowledge_promptly(self._socket)

    def closed_by_peer(self) -> bool:
        """Whether the other side closed a connection we only send on (it would be
        readable: end of stream or a reset)."""
        return self._socket_says(readable_now)

    def ended_by_peer(self) -> bool:
        """Whether the other side closed the connection, even one a reader reads (see
        the module function ``ended_by_peer``)."""
        return self._socket_says(ended_by_peer)

    def _socket_says(self, check: Callable[[trio.socket.SocketType], bool]) -> bool:
        """``check`` of a TCP stream's socket; an in-memory stream knows its peer's
        end whoever reads it."""
        if self._wire.closed:
            return True
        if self._socket is not None:
            return check(self._socket)
        if isinstance(self.stream, InMemoryStream):
            return self.stream.ended_by_peer()
        return False  # pragma: no cover - only our two stream kinds exist


#: A p2p connection once its handshake is over: trio tasks drive a ``FramedStream``,
#: worker threads a ``SocketLink``.
Connection: TypeAlias = "FramedStream | SocketLink"
