"""How the members of a leased all-reduce agree, without the master, that it succeeded.

Theory of operation
-------------------
An attempt under a lease (``peer/_leases.py``) gets no verdict from the master when
all goes well, yet every member must return the same outcome: a member may return
success only once it knows that every member holds the whole result. Should anything
fail before that, no member has returned, and the master's resolution can still end
the attempt the same way for all (``_core/leases.py``).

Members learn it from *completion notices* passed both ways around the ring, on the
data connections the attempt used: a data frame of the attempt with no payload, whose
``offset`` is a count ``k``. Sent forward (to the successor, on the first connection
of the pool to it) it says "the ``k`` members ending with me, going backwards around
the ring, have all completed their part"; sent back (to the predecessor, on the first
connection of its pool to this member, whose sender reads it: ``DataReceiver``) it
says the same of the ``k`` members starting with me, going forwards. A member whose
own part is complete sends, in each direction, ``1 + h`` where ``h`` is the largest
count it heard from the other side (0 before any), whenever that grows; it knows every
member of the ring completed once ``1 + h_forward + h_back >= W`` (the two runs of
members cover the ring), and from then on it tells both neighbours ``W - 1``, the most
a count can say, so that they know it too. The last member to complete is known to
both its neighbours after one hop and to everyone after ``floor(W / 2)``: for ``W = 3``
one hop, where passing the notices one way costs ``W - 1``, and asking the master two
round trips through a fourth process. A ring of two passes them forward only (its one
neighbour is both), and so does a member whose path from its predecessor is too short
for the hops saved to pay for the notices (``_pools.RingPools.back_connection``): the
counts are true either way, and the forward ones alone reach agreement, so a ring may
mix members of both kinds. The counts a member sends only grow, so ``W - 1`` notices at most
per member, direction and attempt. The two directions go independently: a notice
that waits for room on one connection holds up nothing on the other, where the
neighbour may be waiting for it to agree. A notice sent back travels against the data
stream of its connection, so its sender then asks its TCP to go on acknowledging that
stream at once (``acknowledge_promptly``): a reply like it would otherwise put the
connection into Linux's interactive mode, whose delayed acknowledgements stall the
stream's sender.

A forward notice must leave before anything of the member's next attempt can, or its
successor could block on the next attempt's data ahead of it: a member's attempt ends
only once its last notices were sent (``done``). Nothing but notices goes back, so the
backward direction has no such order to keep; a notice that arrives after its attempt
ended is stale and dropped.

Who sends. Over TCP the notices go from the data path's worker threads: the thread
that completes this member's part sends the first ones, and the reader that hears a
notice sends those it makes due, each only if that cannot block (``send_now``). The
trio thread is then woken once per attempt, when the members agreed, instead of once
per notice and once at completion. A notice a thread could not send is left to the
trio thread (``send``). One notice per direction is in flight at a time (``claim``,
then ``sent``), so the counts leave in order and none twice.
"""

from __future__ import annotations

import trio

from .._core.errors import RemoteProtocolError
from .._core.messages import CollectiveVerdict
from ..transport import Connection, SocketLink
from ._ledger import Ledger
from ._protocol import Protocol, SendData, run_protocol

__all__ = ["BACKWARD", "FORWARD", "Agreement"]

_EMPTY = memoryview(b"")


#: The directions a notice goes in: to the successor, and back to the predecessor.
FORWARD, BACKWARD = 0, 1
_NAMES = ("forward", "back")


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
        # Where each direction's notices go, once the part starts (``attach``): the
        # first connection to the successor, and the first from the predecessor.
        self.connections: list[Connection | None] = [None, None]
        self.directions: tuple[int, ...] = (FORWARD,)
        self.heard = [0, 0]  # the largest count that came in each direction
        self.told = [0, 0]  # the largest count sent in each direction
        # A notice is on its way in that direction (``claim``ed, not ``sent`` yet).
        self.sending = [False, False]
        # The trio thread wants to hear of this member's completion, not only of the
        # agreement (the master was told that the part runs: it must hear its end).
        self.eager = False
        # The master's verdict, once the lease ended and the master resolved it.
        self.verdict: CollectiveVerdict | None = None

    def attach(self, forward: Connection | None, backward: Connection | None) -> None:
        """Send the notices on these connections (under the lock, before any slice of
        the part leaves); back too only in a ring of three or more, and only with a
        connection to send on."""
        self.connections = [forward, backward]
        both = self.world > 2 and backward is not None
        self.directions = (FORWARD, BACKWARD) if both else (FORWARD,)

    @property
    def agreed(self) -> bool:
        """Whether every member of the ring completed its part (this one included,
        once it sends: a count is only heard from a member that completed)."""
        return 1 + self.heard[FORWARD] + self.heard[BACKWARD] >= self.world

    @property
    def quiet(self) -> bool:
        """Whether the data path's threads send the notices and wake the trio thread
        only once the members agreed (under the lock): every direction goes over a
        socket the threads can send on."""
        return not self.eager and all(
            isinstance(self.connections[d], SocketLink) for d in self.directions
        )

    @property
    def done(self) -> bool:
        """The members agreed, and this member's last notices left (under the lock)."""
        return self.agreed and all(
            self.told[d] >= self.world - 1 and not self.sending[d] for d in self.directions
        )

    def claim(self, *, besides: tuple[int, ...] = ()) -> tuple[int, int] | None:
        """The notice to send now, ``(direction, count)``, reserved for the caller,
        which sends it and then calls ``sent``; None: nothing new, or the notices due
        are on their way. Under the lock, once this member's part is complete.

        Args:
            besides: directions the caller will not send in now (it tried them).
        """
        for direction in self.directions:
            if self.sending[direction] or direction in besides:
                continue
            # A count extends the run that came in the same direction; once agreed,
            # the whole ring.
            count = self.world - 1 if self.agreed else min(
                1 + self.heard[direction], self.world - 1
            )
            if count > self.told[direction]:
                self.sending[direction] = True
                return direction, count
        return None

    def sent(self, direction: int, count: int, *, ok: bool) -> None:
        """The claimed notice of ``count`` left in ``direction`` (``ok``), or was not
        sent (under the lock)."""
        self.sending[direction] = False
        if ok:
            self.told[direction] = count

    def on_notice(self, count: int, *, came: int = FORWARD) -> None:
        """A neighbour's notice (a reader, any thread): the predecessor's, which came
        ``FORWARD``, or the successor's, sent back.

        Raises:
            RemoteProtocolError: the count is not one a member of this ring can send.
        """
        if not 1 <= count < self.world:
            raise RemoteProtocolError(
                f"completion notice of {count} members in a ring of {self.world}"
            )
        with self.lock:
            if count <= self.heard[came]:
                return
            self.heard[came] = count
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
        notices due if that cannot block, and wake the trio thread only when it has
        something to do: the members agreed, a notice is left to it, or the attempt
        failed or stopped."""
        ledger = self._ledger
        # A direction whose socket has no room is left to the trio thread, but the
        # other still goes now: the neighbour there may be waiting for it to agree.
        left: tuple[int, ...] = ()
        while True:
            # Notices are sent under the lock: once ``stop`` (which takes it) has
            # returned, no notice of this attempt can leave, and none can follow the
            # next attempt's frames.
            with self.lock:
                if ledger.failure is not None or not ledger.live:
                    # The trio thread decides: after a cancellation the part still
                    # agrees (and the trio thread sends the notices from now on).
                    self._wake()
                    return
                claimed = self.claim(besides=left)
                if claimed is None:
                    if self.done or left:
                        self._wake()
                    return
                direction, count = claimed
                link = self.connections[direction]
                assert isinstance(link, SocketLink)
                ok = False
                try:
                    ok = self.send_now(link, tag=ledger.tag, seq=ledger.seq, count=count)
                    if ok and direction == BACKWARD:
                        link.acknowledge_promptly()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the trio thread learns it when it tries
                finally:
                    self.sent(direction, count, ok=ok)
                if not ok:
                    left += (direction,)  # the trio thread sends it, or fails trying

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
        """Tell the neighbour at the other end of ``connection`` that ``count`` members
        completed, if that cannot block (any thread): True if the notice left.

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

    async def send_claimed(
        self, claims: list[tuple[int, int]], *, tag: int, seq: int
    ) -> Exception | None:
        """Send the claimed notices, ``(direction, count)``, each direction on its own
        (the trio thread): one that waits for room on its connection holds up nothing on
        the other, whose neighbour may be waiting for it to agree. Each is marked
        ``sent`` whatever happened; the error of one that could not be sent (then the
        master settles the attempt), or None."""
        failure: Exception | None = None

        async def send(direction: int, count: int) -> None:
            nonlocal failure
            ok = False
            try:
                await self.send(direction, tag=tag, seq=seq, count=count)
                ok = True
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                failure = exc
            finally:
                with self.lock:
                    self.sent(direction, count, ok=ok)

        if len(claims) == 1:
            await send(*claims[0])
        else:
            async with trio.open_nursery() as nursery:
                for direction, count in claims:
                    nursery.start_soon(send, direction, count)
        return failure

    async def send(self, direction: int, *, tag: int, seq: int, count: int) -> None:
        """Tell the neighbour in ``direction`` that ``count`` members completed (the
        trio thread).

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError: the connection is gone
                (or there was none).
        """
        connection = self.connections[direction]
        if connection is None:
            raise trio.ClosedResourceError(
                f"no open connection to send the {_NAMES[direction]} notice on"
            )
        if not (isinstance(connection, SocketLink) and self.send_now(
            connection, tag=tag, seq=seq, count=count
        )):
            await run_protocol(_notice(tag, seq, count), connection)
        if direction == BACKWARD:
            connection.acknowledge_promptly()


def _notice(tag: int, seq: int, count: int) -> Protocol[None]:
    yield SendData(tag=tag, seq=seq, offset=count, payload=_EMPTY)
