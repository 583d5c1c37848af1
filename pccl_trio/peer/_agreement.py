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
successor could block on the next attempt's data ahead of it: a member's attempt
ends only once its last notice was sent (``done``).

Who sends. Over TCP the notices go from the data path's worker threads: the thread
that completes this member's part sends the first, and the reader that hears a notice
sends the next, each only if that cannot block (``send_now``). The trio thread is then
woken once per attempt, when the members agreed, instead of once per notice and once
at completion. A notice a thread could not send is left to the trio thread
(``send``). One notice is in flight at a time (``claim``, then ``sent``), so the counts
leave in order and none twice.
"""

from __future__ import annotations

import trio

from .._core.errors import RemoteProtocolError
from .._core.messages import CollectiveVerdict
from ..transport import Connection, SocketLink
from ._ledger import Ledger
from ._protocol import Protocol, SendData, run_protocol

__all__ = ["Agreement"]

_EMPTY = memoryview(b"")


class Agreement:
    """What one member of a leased attempt heard of the others' completion.

    Args:
        world: the members of the ring.
        ledger: the attempt's ledger, whose lock guards this too.
    """

    def __init__(self, *, world: int, ledger: Ledger) -> None:
        self.world = world
        self.lock = ledger.lock
        self._ledger = ledger
        # The connection to the successor, once the part starts over TCP: the data
        # path's threads send the notices on it.
        self.link: SocketLink | None = None
        self.heard = 0  # the largest count the predecessor sent
        self.told = 0  # the largest count sent to the successor
        self.sending = False  # a notice is on its way (``claim``d, not ``sent`` yet)
        # The trio thread wants to hear of this member's completion, not only of the
        # agreement (the master was told that the part runs: it must hear its end).
        self.eager = False
        # The master's verdict, once the lease ended and the master resolved it.
        self.verdict: CollectiveVerdict | None = None

    @property
    def agreed(self) -> bool:
        """Whether every member of the ring completed its part (this one included,
        once it sends: a count is only heard from a member that completed)."""
        return 1 + self.heard >= self.world

    @property
    def quiet(self) -> bool:
        """Whether the data path's threads send the notices and wake the trio thread
        only once the members agreed (under the lock)."""
        return self.link is not None and not self.eager

    @property
    def done(self) -> bool:
        """The members agreed, and this member's last notice left (under the lock)."""
        return self.agreed and self.told >= self.world - 1 and not self.sending

    def claim(self) -> int:
        """The count to tell the successor now, reserved for the caller, which sends it
        and then calls ``sent``; 0: nothing new, or a notice is on its way. Under the
        lock, once this member's part is complete."""
        if self.sending:
            return 0
        count = min(1 + self.heard, self.world - 1)
        if count <= self.told:
            return 0
        self.sending = True
        return count

    def sent(self, count: int, *, ok: bool) -> None:
        """The claimed notice of ``count`` left (``ok``), or was not sent (under the
        lock)."""
        self.sending = False
        if ok:
            self.told = count

    def on_notice(self, count: int) -> None:
        """The predecessor's notice (a reader, any thread).

        Raises:
            RemoteProtocolError: the count is not one a member of this ring can send.
        """
        if not 1 <= count < self.world:
            raise RemoteProtocolError(
                f"completion notice of {count} members in a ring of {self.world}"
            )
        with self.lock:
            if count <= self.heard:
                return
            self.heard = count
            if not self.quiet:
                self._wake()
                return
            if not self._ledger.complete:
                return  # the thread that completes the part tells it
        self.tell()

    def wake_on_completion(self) -> None:
        """From now on, wake the trio thread when the part completes, not only when the
        members agreed (the trio thread)."""
        with self.lock:
            self.eager = True
            self._wake()  # it may have completed already

    def tell(self) -> None:
        """The part is complete (quiet, a worker thread, not under the lock): send the
        notice due if that cannot block, and wake the trio thread only when it has
        something to do: the members agreed, a notice is left to it, or the attempt
        failed or stopped."""
        ledger, link = self._ledger, self.link
        assert link is not None
        while True:
            # The notice is sent under the lock: once ``stop`` (which takes it) has
            # returned, no notice of this attempt can leave, and none can follow the
            # next attempt's frames.
            with self.lock:
                if ledger.failure is not None or not ledger.live:
                    # The trio thread decides: after a cancellation the part still
                    # agrees (and the trio thread sends the notices from now on).
                    self._wake()
                    return
                count = self.claim()
                if not count:
                    if self.done:
                        self._wake()
                    return
                ok = False
                try:
                    ok = self.send_now(link, tag=ledger.tag, seq=ledger.seq, count=count)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the trio thread learns it when it tries
                finally:
                    self.sent(count, ok=ok)
                    if not ok:
                        self._wake()  # it sends the notice, or fails trying
            if not ok:
                return

    def deliver(self, verdict: CollectiveVerdict) -> None:
        """The master's verdict on the attempt (the trio thread)."""
        with self.lock:
            self.verdict = verdict
            self._wake()

    def _wake(self) -> None:
        """Wake the attempt's task (with the lock held)."""
        self._ledger.wake(trio_too=True)

    @staticmethod
    def send_now(connection: SocketLink, *, tag: int, seq: int, count: int) -> bool:
        """Tell the successor, on ``connection``, that ``count`` members completed, if
        that cannot block (any thread): True if the notice left.

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError: the connection is gone.
        """
        if not connection.send_lock.acquire(blocking=False):
            return False
        # A frame of no payload that fits in the socket's buffer: sent from here
        # without blocking, and without handing it to a worker thread.
        try:
            if not connection.has_room(0):
                return False
            connection.send_data_locked(tag=tag, seq=seq, offset=count, payload=_EMPTY)
            return True
        finally:
            connection.send_lock.release()

    async def send(self, connection: Connection, *, tag: int, seq: int, count: int) -> None:
        """Tell the successor, on ``connection``, that ``count`` members completed
        (the trio thread).

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError: the connection is gone.
        """
        if isinstance(connection, SocketLink) and self.send_now(
            connection, tag=tag, seq=seq, count=count
        ):
            return
        await run_protocol(_notice(tag, seq, count), connection)


def _notice(tag: int, seq: int, count: int) -> Protocol[None]:
    yield SendData(tag=tag, seq=seq, offset=count, payload=_EMPTY)
