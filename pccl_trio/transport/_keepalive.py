"""Heartbeats that do not need the event loop: ``keep_alive``.

Theory of operation
-------------------
A trainer may compute inline, blocking its event loop for minutes between two calls
(a long forward and backward pass, or a ``time.sleep``). Heartbeats sent by a trio task
stop meanwhile, and the master would remove a peer that is only busy. So each master
link over TCP gets a *keepalive*: a daemon thread that wakes every quarter of the
heartbeat interval and, if nothing was written on the link for a whole interval,
writes a heartbeat itself (``FramedStream.write_if_idle``: under the stream's wire
lock, sealed with its channel, never while a trio send holds the wire). While the loop
runs, the trio side's own heartbeats and messages keep the link busy and the thread
writes nothing; a duplicate heartbeat now and then is harmless.

The thread proves that the *process* is alive and its network path works, nothing more:
a killed process takes its threads with it (and its kernel closes the socket), a
stopped one (``SIGSTOP``) stops them too, and a partition stops its bytes, so the
master still removes such a peer within its liveness timeout. A live process that
never calls again is for the master's stall handling (``Config.stall_timeout``).

The thread ends within a quarter interval of the link's closing (``wait_closed``), or
at once when a write fails (the trio side then finds the link broken). It runs only
while the run keeps real time (``threads_allowed``) and only on TCP: under a virtual
clock the loop never really blocks, and a stream without a socket of its own (the
in-memory network) has no descriptor to write to.
"""

from __future__ import annotations

import threading

from .._core.messages import Message
from ._framed import FramedStream
from ._threads import threads_allowed

__all__ = ["keep_alive"]

#: Checks per heartbeat interval: silence lasts at most ``1 + 1/CHECKS`` intervals.
CHECKS = 4


def keep_alive(link: FramedStream, heartbeat: Message, interval: float) -> threading.Thread | None:
    """Write ``heartbeat`` on ``link`` from a thread whenever nothing was written on it
    for ``interval`` seconds, until it closes (see the module docstring).

    Returns:
        the thread, or None where none is started (no TCP socket, or a virtual clock).
    """
    if link.socket is None or not threads_allowed():
        return None
    thread = threading.Thread(
        target=_run, args=(link, heartbeat, interval), name="pccl_trio keepalive", daemon=True
    )
    thread.start()
    return thread


def _run(link: FramedStream, heartbeat: Message, interval: float) -> None:
    while not link.wait_closed(interval / CHECKS):
        if not link.write_if_idle(heartbeat, interval):
            return
