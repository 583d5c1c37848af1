"""A blocking socket that several threads use at once and any of them may cut.

Theory of operation
-------------------
A ``SocketLink``'s socket is used by worker threads, a sender and a reader at once,
and cut from any thread: the one that sees a failure, or trio's when a collective
ends. Closing a descriptor that another thread is blocked on neither wakes that
thread nor is safe (the kernel may hand the number out again at once), so a cut shuts
the connection down instead, which wakes every blocked call, and the descriptor is
closed by whoever is the last to stop using it.

Every use is counted: ``use`` before a call on the socket, ``done`` after it (a pair
of calls rather than a context manager: they run for every frame, on the data path's
hot path). ``use`` refuses once the socket is cut, so no thread starts a call on it
after the cut; the descriptor is closed exactly once, by ``cut`` if nobody uses it,
else by the last ``done``.
"""

from __future__ import annotations

import socket
import threading

import trio

__all__ = ["SharedSocket"]


class SharedSocket:
    """``sock``, counted while threads use it, closed once it is cut and unused (see
    the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._state = threading.Lock()
        self._users = 0  # threads between ``use`` and ``done``
        self._cut = False
        self._released = False  # the descriptor was closed (or its closer chosen)

    @property
    def cut_off(self) -> bool:
        """Whether this side cut the connection."""
        return self._cut

    def use(self) -> socket.socket:
        """The socket, counted as in use until ``done``.

        Raises:
            trio.ClosedResourceError: this side cut the connection.
        """
        with self._state:
            if self._cut:
                raise trio.ClosedResourceError("the connection was closed")
            self._users += 1
        return self._sock

    def done(self) -> None:
        """The calling thread no longer uses the socket (after ``use``)."""
        with self._state:
            self._users -= 1
            release = self._cut and not self._users and not self._released
            self._released = self._released or release
        if release:
            self._sock.close()

    def cut(self) -> None:
        """Shut the connection down now, from any thread; calls blocked on it return.

        Idempotent. The descriptor is closed once no thread uses it.
        """
        with self._state:
            if self._cut:
                return
            self._cut = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already reset by the other side
            release = not self._users and not self._released
            self._released = self._released or release
        if release:
            self._sock.close()

    def error(self, what: str, exc: BaseException | None = None) -> Exception:
        """The error of a call on the socket that failed: ``ClosedResourceError`` if
        this side cut it (the cut is why), else ``BrokenResourceError`` saying
        ``what`` (and ``exc``)."""
        if self._cut:
            return trio.ClosedResourceError("the connection was closed")
        detail = f": {exc}" if exc is not None else ""
        return trio.BrokenResourceError(f"{what}{detail}")
