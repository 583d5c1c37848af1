"""The all-reduce receive path: which attempt a data frame belongs to, and where it goes.

Theory of operation
-------------------
Each data connection from the ring's predecessor has one reader, a protocol of
``_protocol`` (a trio task, or a worker thread over a ``SocketLink``). Every frame
names its attempt by the master's number (``seq``, from ``CollectiveCommence``).
Attempts are registered here by tag when launched, before their vote, and by number
when the master's commence arrives: ``on_commence`` is a route of the master session,
so it runs as the commence is read, before any later message (an all-gather's
attempt gets its schedule there, from the members' sizes the commence carries). A frame may still
arrive before the commence reached this peer (the neighbour started sending at once);
its reader waits for it. Numbers only grow, so a frame at or below the last commence
seen whose attempt is not running is stale: it is read and dropped.

Attempts under a lease (``_leases``) are numbered by this peer, from the lease's
block, and registered by number as they start (``start_leased``): a frame numbered
in a lease's block waits while this peer may still start that attempt (at or above
the next number it would take, while the lease stands; once it ended, only that next
number, which the master may still commence here) and is stale otherwise. A frame
with no payload is a completion notice (``_agreement``), handed to its attempt.

The successor sends notices back too, on the first connection of this peer's pool to
it: ``serve_back`` reads them there (a trio task, or a worker thread over a
``SocketLink``, beside the senders) for as long as the connection lives. Only notices
come back; a notice whose attempt is not running here is stale (a successor completes
an attempt only once this peer sent it everything, so this peer registered it long
before) and dropped, and anything else is a protocol error that ends the reader and
leaves the pool to be reopened.

A frame for a running attempt is claimed (checked against the attempt's schedule),
then received into a staging buffer and combined into the result, or, for all-gather
data, straight into the result buffer (see ``RingAttempt``). When a connection
breaks, every live attempt receiving from that peer fails: its frames are lost. Not
so for a connection that already left the pool (a newer one from the sender took its
slot, or the sender is no longer the predecessor): that happens only in an
establishment round, when no attempt runs here, so the attempts running when its
reader's error is handled (a worker thread's may be handled much later) never had a
frame on it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Generator
from functools import partial
from typing import Any

import numpy as np
import trio

from .._core.errors import RemoteProtocolError
from .._core.messages import CollectiveCommence, P2PHello
from ..transport import Connection, Signal, SocketLink
from ._agreement import BACKWARD
from ._attempt import RingAttempt
from ._lifecycle import Lifecycle
from ._p2p import P2PConnections
from ._protocol import Operation, Protocol, ReceiveHeader, ReceivePayload, Wait, run_protocol

__all__ = ["DataReceiver"]

log = logging.getLogger("pccl_trio.peer")


_EMPTY = memoryview(bytearray())  # writable: a notice's (empty) payload is received into it
_RECEIVE_HEADER = ReceiveHeader()
_RECEIVE_NOTICE_HEADER = ReceiveHeader(beside_sender=True)  # the senders use its connection


@dataclasses.dataclass(kw_only=True, slots=True)
class _Block:
    """A lease's numbers, as far as this peer's data path is concerned."""

    last: int
    next: int  # the number this peer would start next
    open: bool = True  # the lease stands: this peer may still start any number from next


class DataReceiver:
    """The attempts in flight, and the readers of the ring's data connections."""

    def __init__(self, *, lifecycle: Lifecycle, p2p: P2PConnections) -> None:
        self._life = lifecycle
        self._p2p = p2p
        self.by_tag: dict[int, RingAttempt] = {}
        self._by_seq: dict[int, RingAttempt] = {}
        self._last_commenced = 0
        # Leases, by their first number (kept sorted in ``_firsts``).
        self._blocks: dict[int, _Block] = {}
        self._firsts: list[int] = []
        # Readers waiting for a commence (trio tasks and threads); its lock guards
        # the numbers and leases that threads read.
        self._commenced = Signal()
        lifecycle.on_failure(self.wake)

    # --- the attempts ----------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """Whether any attempt is registered (launched and not ended)."""
        return bool(self.by_tag)

    def add(self, attempt: RingAttempt) -> None:
        """Register a launched attempt, before it votes."""
        self.by_tag[attempt.tag] = attempt

    def remove(self, attempt: RingAttempt) -> None:
        """The attempt is over: no more frames are routed to it."""
        del self.by_tag[attempt.tag]
        self._by_seq.pop(attempt.seq, None)

    def running(self, seq: int) -> bool:
        """Whether attempt ``seq`` runs here (commenced or started, not ended)."""
        return seq in self._by_seq

    def on_commence(self, message: CollectiveCommence) -> None:
        """Make the attempt reachable by its number before any of its data is read."""
        attempt = self.by_tag.get(message.tag)
        if attempt is not None and attempt.seq == 0:
            if message.ring != attempt.ring:
                attempt.fail(
                    f"the master's ring {list(message.ring)} differs from this peer's "
                    f"{list(attempt.ring)}"
                )
            elif attempt.sizing is not None or message.sizes:
                # An all-gather's parts: its schedule is made now, before any frame.
                sizing, attempt.sizing = attempt.sizing, None  # once (it refers to the attempt)
                problem = (
                    sizing(message.sizes) if sizing is not None
                    else f"the master sent part sizes {list(message.sizes)} for a "
                    "collective that gathers nothing"
                )
                if problem is not None:
                    attempt.fail(problem)
            attempt.seq = message.seq
            self._by_seq[message.seq] = attempt
        with self._commenced.lock:
            self._last_commenced = max(self._last_commenced, message.seq)
            self._commenced.notify()

    # --- leases (called by ``_leases``, in the trio thread) ------------------------------

    def lease_granted(self, first: int, last: int) -> None:
        """Numbers ``first`` to ``last`` belong to a lease of this peer."""
        with self._commenced.lock:
            self._blocks[first] = _Block(last=last, next=first)
            bisect.insort(self._firsts, first)
        self.wake()

    def start_leased(self, attempt: RingAttempt, first: int, seq: int) -> None:
        """Attempt ``seq`` of the lease from ``first`` starts here: its frames go to it."""
        with self._commenced.lock:
            self._by_seq[seq] = attempt
            self._blocks[first].next = seq + 1
        self.wake()

    def lease_closed(self, first: int, *, settled: bool = False) -> None:
        """No attempt starts under the lease from ``first`` any more, but the master
        may still commence the next one here (``settled``: it will not either)."""
        with self._commenced.lock:
            block = self._blocks[first]
            block.open = False
            if settled:
                block.next += 1
        self.wake()

    def lease_forgotten(self, first: int) -> None:
        """The lease from ``first`` is over: its frames not taken yet are stale."""
        with self._commenced.lock:
            if self._blocks.pop(first, None) is not None:
                self._firsts.remove(first)
        self.wake()

    def _waits(self, seq: int) -> bool:
        """Whether a frame of attempt ``seq``, not running here, may still get an
        attempt (see the module docstring); with ``_commenced.lock`` held, or in the
        trio thread, which alone changes what it reads."""
        index = bisect.bisect_right(self._firsts, seq) - 1
        if index >= 0:
            first = self._firsts[index]
            block = self._blocks[first]
            if seq <= block.last:
                return seq >= block.next if block.open else seq == block.next
        return seq > self._last_commenced

    def wake(self) -> None:
        """Readers waiting for a commence must look at the communicator's state."""
        with self._commenced.lock:
            self._commenced.notify()

    async def _attempt_for(self, seq: int) -> RingAttempt | None:
        """The attempt a data frame belongs to; None for a finished or aborted one."""
        while seq not in self._by_seq and self._waits(seq):
            if self._life.over:
                raise trio.ClosedResourceError("the communicator is shutting down")
            await self._commenced.wait()
        return self._by_seq.get(seq)

    def _attempt_for_blocking(self, seq: int) -> RingAttempt | None:
        """``_attempt_for`` from a reader thread."""
        with self._commenced.lock:
            while seq not in self._by_seq and self._waits(seq):
                if self._life.over:
                    raise trio.ClosedResourceError("the communicator is shutting down")
                self._commenced.wait_blocking(timeout=1.0)
        return self._by_seq.get(seq)

    # --- the readers -------------------------------------------------------------------------

    async def serve(self, connection: Connection, hello: P2PHello) -> None:
        """Handle a ring neighbour's data connection, admitted into its pool (the p2p
        handler of ring connections, ``P2PConnections.handle_ring``)."""
        try:
            await run_protocol(self._receive(connection, hello.peer_id), connection)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError) as exc:
            self._link_lost(hello.peer_id, connection, exc)
            raise
        except Exception:
            for attempt in list(self._by_seq.values()):
                attempt.fail("internal error while receiving (see the log)")
            raise
        finally:
            if isinstance(connection, SocketLink):
                connection.cut()

    async def serve_back(self, connection: Connection, successor: int) -> None:
        """Read the notices ``successor`` sends back on ``connection`` until it closes
        (the backward reader of ``P2PConnections.handle_ring``); the connection is left
        open, for the senders."""
        try:
            await run_protocol(self._receive_back(successor), connection)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed by either side: the senders learn it as they send
        except RemoteProtocolError as exc:
            log.warning("peer %d sent back what is no completion notice: %s", successor, exc)

    def _receive_back(self, successor: int) -> Protocol[None]:
        by_seq = self._by_seq
        while True:
            tag, seq, count, nbytes = yield _RECEIVE_NOTICE_HEADER
            if nbytes:
                raise RemoteProtocolError(
                    f"{nbytes} bytes of data for tag {tag} attempt {seq} sent back on a ring "
                    "connection, where only completion notices come back"
                )
            yield ReceivePayload(_EMPTY)
            attempt = by_seq.get(seq)
            if (attempt is not None and attempt.agreement is not None
                    and attempt.successor == successor):
                attempt.agreement.on_notice(count, came=BACKWARD)

    def _receive(self, connection: Connection, sender: int) -> Protocol[None]:
        """Receive data frames from ``sender`` and hand each slice to its attempt.

        A payload that is not received in place lands in this reader's host buffer for
        the attempt's staging (pinned memory for GPU buffers, see ``_staging``).
        """
        landing: dict[int, Any] = {}
        by_seq = self._by_seq
        while True:
            header = yield _RECEIVE_HEADER
            seq = header[1]
            # Most frames find their attempt running: no wait to drive.
            attempt = by_seq.get(seq)
            if attempt is None:
                attempt = yield Wait(
                    partial(self._attempt_for, seq), partial(self._attempt_for_blocking, seq)
                )
            if not header[3]:  # a completion notice
                yield ReceivePayload(_EMPTY)
                if attempt is not None and attempt.agreement is not None:
                    attempt.agreement.on_notice(header[2])
                continue
            staging = None if attempt is None else attempt.staging
            buffer = landing.get(id(staging))
            if buffer is None or header[3] > buffer.size:
                buffer = landing[id(staging)] = (
                    np.empty(header[3], dtype=np.uint8) if staging is None
                    else staging.host_empty(header[3])
                )
            yield from self._deliver(attempt, sender, connection, buffer, header)

    def _link_lost(self, sender: int, connection: Connection, exc: BaseException) -> None:
        """Every attempt receiving from ``sender`` lost frames with ``connection``,
        unless the connection had left the pool (see the module docstring)."""
        if not self._life.over and not self._p2p.pools.receives_on(sender, connection):
            return
        for attempt in list(self._by_seq.values()):
            if attempt.predecessor == sender and attempt.live:
                attempt.fail(f"the link from peer {sender} broke ({exc})")

    @staticmethod
    def _deliver(
        attempt: RingAttempt | None,
        sender: int,
        reader: Connection,
        staging: Any,
        header: tuple[int, int, int, int],
    ) -> Generator[Operation, Any, None]:
        """Receive one data frame's payload into where it goes, then hand the slice to
        its attempt: straight into the result for all-gather data, through ``staging``
        otherwise, and nowhere for a stale attempt (``None``). If the receive fails,
        the attempt learns that the payload did not arrive.

        Raises:
            RemoteProtocolError: the frame does not fit its attempt (which fails).
        """
        tag, _seq, offset, nbytes = header
        if attempt is None:
            yield ReceivePayload(staging[:nbytes].data)  # read and drop
            return
        inbound = attempt.inbound
        try:
            segment, index = inbound.claim(tag, offset, nbytes)
        except RemoteProtocolError as exc:
            attempt.fail(f"peer {sender} sent a bad data frame ({exc})")
            raise
        view = inbound.direct_target(segment, index, reader)
        if view is not None:
            received = False
            try:
                yield ReceivePayload(view)
                received = True
            finally:
                inbound.on_direct_slice(segment, index, reader, received)
            return
        payload = staging[:nbytes]
        yield ReceivePayload(payload.data)
        inbound.on_slice(segment, index, payload)
