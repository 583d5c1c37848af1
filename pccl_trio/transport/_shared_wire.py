"""The writing side of a TCP stream that trio's thread and one other thread share.

Theory of operation
-------------------
A ``FramedStream`` over TCP may be written from one other thread besides trio's, its
keepalive (``_keepalive``: heartbeats that do not need the event loop). Both writers
share the *wire lock*, a ``threading.Lock`` held by a ``SharedWire``. A trio send
takes it only to claim the wire before it seals its frame and to release the claim
right after its last byte, before any checkpoint (``claim``); it never holds the lock
across an await, and a frame left part-written while trio waits for room in the
socket stays claimed. ``write_if_idle`` holds the lock while it seals and writes a
whole frame, and writes only while no trio send holds the claim. A channel's frames
therefore leave in the order they were sealed, and bytes of two frames never
interleave. ``write_nowait`` (the master's replies) writes from the trio thread
without awaiting, under the wire lock, what the socket takes at once; a frame it
leaves part-written stays claimed until the trio send that finishes it.

Closing the stream marks the wire closed under the same lock (``close``) before the
socket is closed, so the other thread never writes to a descriptor number the kernel
may hand out again, and wakes that thread if it waits for the end (``wait_closed``).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

__all__ = ["SharedWire"]


def _wait_writable(sock: trio.socket.SocketType, seconds: float) -> bool:
    """Whether ``sock`` can take more bytes within ``seconds`` (a blocking wait: for
    threads other than trio's)."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        return bool(poller.poll(max(0, int(seconds * 1000))))
    except (OSError, ValueError):
        return False


class SharedWire:
    """Who may write a stream's socket now, and since when nothing was written (see
    the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the wire lock
        self._claimed = False  # a trio send is between its seal and its last byte
        self._last_write = time.monotonic()  # when the last frame was written
        self._closed = False
        self._ended = threading.Event()  # set once closed: ends a keepalive thread

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Closed from now on: no thread writes after this returns."""
        with self._lock:
            self._closed = True
        self._ended.set()

    def wait_closed(self, seconds: float) -> bool:
        """Block the calling thread (never trio's) until the wire is closed, for at
        most ``seconds``; whether it is."""
        return self._ended.wait(seconds)

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Hold the wire for one trio send: the other thread writes nothing meanwhile.
        Waits at most for one tiny frame of that thread."""
        with self._lock:
            self._claimed = True
        try:
            yield
        finally:
            with self._lock:
                self._claimed = False
                self._last_write = time.monotonic()

    def write_nowait(self, sock: trio.socket.SocketType, view: memoryview) -> memoryview:
        """From the trio thread, while no trio send is under way: write what ``sock``
        takes of ``view`` right now, unless the wire is claimed or closed. Returns what
        was not written; a frame left part-written keeps the wire claimed until the
        trio send that finishes it."""
        with self._lock:
            if self._closed or self._claimed:
                return view
            try:
                written = os.write(sock.fileno(), view)
            except OSError:  # full, or broken: the queued send waits or reports it
                return view
            self._last_write = time.monotonic()
            self._claimed = written < len(view)
        return view[written:]

    def write_if_idle(self, sock: trio.socket.SocketType, seal: Callable[[], bytes],
                      idle: float) -> bool:
        """From a thread other than trio's: seal a frame (``seal``) and write it to
        ``sock``, unless a trio send holds the wire, something was written in the last
        ``idle`` seconds, or the socket's buffer is full. A frame started is finished
        (within ``idle``) or the connection is shut down: nothing may follow a torn
        frame, nor a sealed one left unsent.

        Returns:
            whether the stream can still be written: False once it is closed or broken.
        """
        with self._lock:
            if self._closed:
                return False
            now = time.monotonic()
            if self._claimed or now - self._last_write < idle or not _wait_writable(sock, 0):
                return True
            frame = memoryview(seal())
            try:
                while frame:
                    try:
                        frame = frame[os.write(sock.fileno(), frame) :]
                    except BlockingIOError:
                        if not _wait_writable(sock, now + idle - time.monotonic()):
                            raise
            except OSError:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # trio's next read or send breaks
                except OSError:
                    pass
                return False
            self._last_write = time.monotonic()
            return True
