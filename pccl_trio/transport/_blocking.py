"""TCP data connections driven by worker threads: ``SocketLink``.

Why threads
-----------
One trio thread doing all socket IO of a ring peer idles between hops: while it
reduces one slice, nothing drains the kernel's receive buffer or refills the send
buffer. A worker thread blocked in ``recv_into`` or ``sendmsg`` releases the GIL (as
numpy's kernels do), so each direction of each connection makes progress on its own.
``benchmarks/ring_ceiling.py`` measures the difference on a bare byte ring.

Ownership and closing
---------------------
A ``SocketLink`` is created from a ``FramedStream`` once its handshake is over; from
then on only threads touch the socket, through a ``SharedSocket``: ``cut`` shuts the
connection down, which wakes every blocked call, and the descriptor is closed by
whoever is the last to stop using it (``_shared_socket``).

Sending without waiting
-----------------------
``has_room`` tells whether a frame fits in the socket's send buffer now (the bytes
queued, ``TIOCOUTQ``, against half the buffer's fixed size): a thread that must not
block, such as a reader forwarding a slice of a small all-reduce, holds ``send_lock``
and sends with ``send_data_locked`` only then.

Reading beside a sender
-----------------------
A thread blocked in ``recv`` on a Linux TCP socket is woken by every event of the
socket, the send-buffer space that each acknowledgement frees included (its wait does
not say what it waits for), checks for data and sleeps again. On a connection that
carries a bulk stream out, a reader waiting there for the few frames that come back is
woken that way all the time: on loopback, back to back W=3 all-reduces of 16 MiB took
17.5 ms of CPU per rank with such a reader against 15 without. A ``poll`` for readable
bytes is woken by those alone, so such a reader waits there first
(``receive_data_header(wait_readable=True)``).

A link keeps the ``Channel`` of the stream it was detached from (its frame counters
go on where the stream's stopped) and protects frames as ``FramedStream`` does.
"""

from __future__ import annotations

import fcntl
import select
import socket
import struct
import termios
import threading
from collections.abc import Callable

import trio

from .._core.channel import TAG_SIZE, Channel
from .._core.messages import Message, decode_message
from .._core.wire import (
    CONTROL_HEADER_SIZE,
    LENGTH_SIZE,
    DataFrameReader,
    encode_control,
    encode_data_header,
    open_control,
    parse_control_kind,
    parse_control_length,
)
from ._framed import (
    RECEIVE_CHUNK,
    FramedStream,
    acknowledge_promptly,
    drop_sent,
    ended_by_peer,
    readable_now,
)
from ._network import kernel_congestion_control, pinned_buffers
from ._shared_socket import SharedSocket

__all__ = ["SocketLink"]

_INT = bytes(4)
#: Room counted for a frame's header and authentication tag.
_FRAME_ALLOWANCE = 256


class SocketLink:
    """A TCP connection carrying data frames, used by worker threads with blocking calls.

    Sends are serialized by ``send_lock`` (frames never interleave); one thread at a
    time receives. Errors follow trio's taxonomy: ``trio.BrokenResourceError`` when
    the other side or the network broke the connection, ``trio.ClosedResourceError``
    once this side cut it. A send that fails part-way cuts the connection: it is never
    reused with a torn frame in it.
    """

    def __init__(
        self, sock: socket.socket, *, max_data_frame: int, max_control_frame: int = 1 << 20,
        channel: Channel | None = None,
    ) -> None:
        sock.setblocking(True)
        self._shared = SharedSocket(sock)
        self.channel = channel
        self._data = DataFrameReader(max_data_frame=max_data_frame, channel=channel)
        self._max_control_frame = max_control_frame
        self.send_lock = threading.Lock()
        self._idle_timeout: float | None = None
        # A pinned send buffer keeps its size: read once (0: autotuned, read each time).
        self._send_buffer: int = (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            if socket.SO_SNDBUF in pinned_buffers() else 0
        )

    @classmethod
    def detach(
        cls, framed: FramedStream, *, max_data_frame: int, max_control_frame: int = 1 << 20
    ) -> SocketLink | None:
        """Take over the socket of a TCP ``FramedStream`` whose handshake is done.

        Returns None, leaving ``framed`` as it was, if the stream has no socket of its
        own (the in-memory network) or was closed meanwhile. Otherwise ``framed`` is
        closed and never touches the socket again.

        Raises:
            RemoteProtocolError: the other side sent bytes before the handshake was
                over.
        """
        trio_socket = framed.socket
        if trio_socket is None or framed.closed:
            return None
        framed.forget_socket()
        fd = trio_socket.detach()
        if fd < 0:  # pragma: no cover - closed between the check and here
            return None
        return cls(
            socket.socket(fileno=fd), max_data_frame=max_data_frame,
            max_control_frame=max_control_frame, channel=framed.channel,
        )

    @property
    def congestion_control(self) -> str | None:
        """The TCP congestion control the kernel runs on this connection (None if it
        does not say, or the connection was cut)."""
        try:
            sock = self._shared.use()
        except trio.ClosedResourceError:
            return None
        try:
            return kernel_congestion_control(sock)
        finally:
            self._shared.done()

    @property
    def closed(self) -> bool:
        """Whether this side cut the connection (or a send failed part-way)."""
        return self._shared.cut_off

    def cut(self) -> None:
        """Shut the connection down now, from any thread; calls blocked on it return.

        Idempotent. The descriptor is closed once no thread uses it.
        """
        self._shared.cut()

    close_now = cut

    def set_idle_timeout(self, seconds: float | None) -> None:
        """Fail a send or receive that makes no progress for ``seconds`` (None: wait
        forever), as ``trio.BrokenResourceError``; the connection is then unusable."""
        # Kernel timeouts keep the socket blocking (and MSG_WAITALL receives whole);
        # a call that waits this long with nothing moving fails with EAGAIN.
        self._idle_timeout = seconds
        whole = int(seconds or 0)
        timeval = struct.pack("ll", whole, int(((seconds or 0) - whole) * 1e6))
        sock = self._shared.use()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        finally:
            self._shared.done()

    async def aclose(self) -> None:
        self.cut()
        await trio.lowlevel.checkpoint()

    # --- sending -------------------------------------------------------------------

    def send_frames(self, buffers: list[memoryview]) -> None:
        """Send whole plain frames (blocking; a link with a channel sends only through
        ``send_data`` and ``send_message``). Cuts the connection if it fails part-way."""
        if self.channel is not None:
            raise RuntimeError("frames on a protected link are sealed as they are sent")
        with self.send_lock:
            self._send_locked(buffers)

    def _send_locked(self, buffers: list[memoryview]) -> None:
        sock = self._shared.use()
        try:
            while buffers:
                drop_sent(buffers, sock.sendmsg(buffers))
        except OSError as exc:
            error = self._shared.error("send failed", exc)
            self.cut()
            raise error from exc
        except BaseException:
            self.cut()
            raise
        finally:
            self._shared.done()

    def send_data(self, *, tag: int, seq: int, offset: int, payload: memoryview) -> None:
        """Send one data frame; the payload goes from the caller's memory to the kernel
        (unless the channel encrypts it)."""
        with self.send_lock:
            self.send_data_locked(tag=tag, seq=seq, offset=offset, payload=payload)

    def send_data_locked(self, *, tag: int, seq: int, offset: int, payload: memoryview) -> None:
        """``send_data`` for a caller that holds ``send_lock`` (tags, with a channel,
        are made in the order the frames leave)."""
        if payload.itemsize != 1:
            payload = payload.cast("B")  # lengths below count bytes
        header = encode_data_header(
            tag=tag, seq=seq, offset=offset, nbytes=len(payload), trailer=self._data.trailer
        )
        if self.channel is None:
            self._send_locked([memoryview(header), payload])
        else:
            self._send_locked(self.channel.protect_data(header, payload))

    def has_room(self, nbytes: int) -> bool:
        """Whether a frame with ``nbytes`` of payload fits in the socket's send buffer
        now, with a margin: sending it then returns without waiting for the other side.
        The kernel accounts queued bytes with overhead, so at most half the buffer
        counts as room. A pinned buffer's size (``pinned_buffers``) was read once, at
        creation; one the kernel autotunes grows with the connection, so it is read
        each time.

        Raises:
            trio.ClosedResourceError: this side cut the connection.
        """
        sock = self._shared.use()
        try:
            queued: int = struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, _INT))[0]
            buffer: int = self._send_buffer or sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            return False
        finally:
            self._shared.done()
        return queued + nbytes + _FRAME_ALLOWANCE <= buffer // 2

    def send_message(self, message: Message) -> None:
        """Send one control frame (blocking)."""
        with self.send_lock:
            self._send_locked([memoryview(encode_control(message, self.channel))])

    # --- receiving -----------------------------------------------------------------

    def receive_message(self) -> Message:
        """The next frame, which must be a control message (blocking; nothing past it
        is read).

        Raises:
            RemoteProtocolError: not a valid control frame.
        """
        prefix = bytearray(LENGTH_SIZE + CONTROL_HEADER_SIZE)
        self.receive_into(memoryview(prefix)[:LENGTH_SIZE])
        length = parse_control_length(
            prefix[:LENGTH_SIZE], max_control_frame=self._max_control_frame + self._data.trailer
        )
        self.receive_into(memoryview(prefix)[LENGTH_SIZE:])
        kind = parse_control_kind(prefix[LENGTH_SIZE:], length, None, trailer=self._data.trailer)
        remaining = length - CONTROL_HEADER_SIZE
        body = bytearray()
        while len(body) < remaining:  # the buffer grows with what arrived
            start = len(body)
            body.extend(bytes(min(RECEIVE_CHUNK, remaining - start)))
            self.receive_into(memoryview(body)[start:])
        if self.channel is not None:
            return decode_message(kind, open_control(prefix, body, self.channel))
        return decode_message(kind, body)

    def receive_data_header(self, *, wait_readable: bool = False) -> tuple[int, int, int, int]:
        """``(tag, seq, offset, nbytes)`` of the next frame, which must be a data frame;
        the caller then receives its payload with ``receive_payload``.

        Args:
            wait_readable: wait for the frame to arrive before reading it (``Reading
                beside a sender`` above): for a reader of seldom frames on a connection
                that other threads send on.

        Raises:
            RemoteProtocolError: not a valid data frame.
        """
        if wait_readable:
            self._wait_readable()
        self.receive_into(self._data.header_buffer())
        return self._data.parse_header()

    def _wait_readable(self) -> None:
        """Block until the socket has bytes to read, an end of stream or an error (or
        this side cut it), for at most the idle timeout."""
        sock = self._shared.use()
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            timeout = None if self._idle_timeout is None else int(self._idle_timeout * 1000)
            if not poller.poll(timeout):
                raise self._shared.error(f"nothing arrived for {self._idle_timeout} seconds")
        finally:
            self._shared.done()

    def receive_payload(self, view: memoryview) -> None:
        """Receive the payload of the data frame whose header was just read into
        ``view`` (exactly as long), then check its authentication tag (blocking).

        Raises:
            RemoteProtocolError: the tag failed (``view`` must not be used).
        """
        view = self._data.payload_buffer(view)
        if self.channel is None:
            self.receive_into(view)
            return
        tag = bytearray(TAG_SIZE)
        self._receive_scattered([view, memoryview(tag)])  # one wake-up for both
        self._data.accept(view, tag)

    def receive_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly (blocking)."""
        if view.itemsize != 1:
            view = view.cast("B")
        sock = self._shared.use()
        try:
            received = 0
            total = len(view)
            while received < total:
                try:
                    # One wake-up for the whole view, not one per arriving segment.
                    n = sock.recv_into(view[received:], 0, socket.MSG_WAITALL)
                except OSError as exc:
                    raise self._shared.error("receive failed", exc) from exc
                if n == 0:
                    raise self._shared.error("connection closed by the other side")
                received += n
        finally:
            self._shared.done()

    def _receive_scattered(self, buffers: list[memoryview]) -> None:
        """Fill every buffer of ``buffers`` exactly, in order (blocking)."""
        sock = self._shared.use()
        try:
            while buffers:
                try:
                    n = sock.recvmsg_into(buffers, 0, socket.MSG_WAITALL)[0]
                except OSError as exc:
                    raise self._shared.error("receive failed", exc) from exc
                if n == 0:
                    raise self._shared.error("connection closed by the other side")
                drop_sent(buffers, n)
        finally:
            self._shared.done()

    def acknowledge_promptly(self) -> None:
        """After sending a small frame against a bulk stream that comes the other way:
        keep acknowledging that stream at once (``acknowledge_promptly``; any thread)."""
        try:
            sock = self._shared.use()
        except trio.ClosedResourceError:
            return
        try:
            acknowledge_promptly(sock)
        finally:
            self._shared.done()

    def closed_by_peer(self) -> bool:
        """Whether the other side closed a connection we only send on."""
        return self._socket_says(readable_now)

    def ended_by_peer(self) -> bool:
        """Whether the other side closed the link, even one a reader reads (see
        ``_framed.ended_by_peer``)."""
        return self._socket_says(ended_by_peer)

    def _socket_says(self, check: Callable[[socket.socket], bool]) -> bool:
        """``check`` of the socket, or True once the link is cut or closed."""
        if self._shared.cut_off:
            return True
        try:
            sock = self._shared.use()
        except trio.ClosedResourceError:
            return True
        try:
            return check(sock)
        finally:
            self._shared.done()
