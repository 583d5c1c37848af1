"""How the members of a leased all-reduce agree, without the master, that it succeeded.

Theory of operation
-------------------
An attempt under a lease (``peer/_leases.py``) gets no verdict from the master when
all goes well, yet every member must return the same outcome: a member may return
success only once it knows that every member holds the whole result. Should anything
fail before that, no member has returned, and the master's resolution can still end
the attempt the same way for all (``_core/leases.py``).

Members learn it from *completion notices* passed along the ring, on the data
connections the attempt used: a data frame of the attempt with no payload, whose
``offset`` is a count ``k``, says "the ``k`` members ending with me, going backwards
around the ring, have all completed their part". A member whose own part is complete
sends ``min(1 + h, W - 1)`` to its successor, where ``h`` is the largest count it
heard from its predecessor (0 before any), whenever that number grows; it knows every
member of the ring completed once ``1 + h >= W``. The last member to complete is known
to its successor after one hop, and to everyone after ``W - 1``: for ``W = 3``, two
tiny frames per member, where asking the master would cost two round trips through a
fourth process and that process's time. The counts a member sends only grow, so
``W - 1`` notices at most per member and attempt.

A notice must leave before anything of the member's next attempt can, or its
successor could block on the next attempt's data ahead of it: ``send`` returns once
the notice left, and the attempt ends only after its last notice was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._core.errors import RemoteProtocolError
from .._core.messages import CollectiveVerdict
from ..transport import Connection, SocketLink
from ._protocol import Protocol, SendData, run_protocol

__all__ = ["Agreement"]

_EMPTY = memoryview(b"")


class Agreement:
    """What one member of a leased attempt heard of the others' completion.

    Args:
        world: the members of the ring.
        lock: the attempt's lock; ``wake`` (called with it held) wakes the attempt's
            task.
    """

    def __init__(self, *, world: int, lock: threading.Lock, wake: Callable[[], None]) -> None:
        self.world = world
        self._lock = lock
        self._wake = wake
        self.heard = 0  # the largest count the predecessor sent
        self.told = 0  # the largest count sent to the successor
        # The master's verdict, once the lease ended and the master resolved it.
        self.verdict: CollectiveVerdict | None = None

    @property
    def agreed(self) -> bool:
        """Whether every member of the ring completed its part (this one included,
        once it sends: a count is only heard from a member that completed)."""
        return 1 + self.heard >= self.world

    def due(self) -> int:
        """The count to tell the successor now (0: nothing new); call once this
        member's part is complete."""
        count = min(1 + self.heard, self.world - 1)
        return count if count > self.told else 0

    def on_notice(self, count: int) -> None:
        """The predecessor's notice (any thread).

        Raises:
            RemoteProtocolError: the count is not one a member of this ring can send.
        """
        if not 1 <= count < self.world:
            raise RemoteProtocolError(
                f"completion notice of {count} members in a ring of {self.world}"
            )
        with self._lock:
            if count > self.heard:
                self.heard = count
                self._wake()

    def deliver(self, verdict: CollectiveVerdict) -> None:
        """The master's verdict on the attempt (the trio thread)."""
        with self._lock:
            self.verdict = verdict
            self._wake()

    async def send(self, connection: Connection, *, tag: int, seq: int, count: int) -> None:
        """Tell the successor, on ``connection``, that ``count`` members completed.

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError: the connection is gone.
        """
        self.told = count
        if isinstance(connection, SocketLink) and connection.send_lock.acquire(blocking=False):
            # A frame of no payload that fits in the socket's buffer: sent from here
            # without blocking, and without handing it to a worker thread.
            try:
                if connection.has_room(0):
                    connection.send_data_locked(tag=tag, seq=seq, offset=count, payload=_EMPTY)
                    return
            finally:
                connection.send_lock.release()
        await run_protocol(_notice(tag, seq, count), connection)


def _notice(tag: int, seq: int, count: int) -> Protocol[None]:
    yield SendData(tag=tag, seq=seq, offset=count, payload=_EMPTY)
