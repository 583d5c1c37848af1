"""What one attempt of a ring collective sends to the ring's successor.

Theory of operation
-------------------
This peer's send stream (``RingSchedule.send``) is a sequence of slices, each sent
exactly once: its own input, and the slices it forwards, each as soon as the slice
it forwards has arrived and been written. ``send_all`` deals the stream round-robin
over the connections of the pool (slice ``p`` of the stream on connection ``p mod
n``) and waits until every slice has left and every slice of the incoming stream has
arrived: the part is then complete.

* **Senders.** One sender per connection sends its share of the slices in stream
  order, each once it is ready. A sender is a protocol of ``_protocol``, so the same
  code runs in a trio task (the in-memory network) or a worker thread over a
  ``SocketLink`` (TCP). While one slice is sent, the staging prepares the next
  (``prefetch``: a GPU buffer's bytes are copied to pinned host memory).
* **Forwarding.** A small unquantized attempt on host memory over worker threads
  (``FORWARD_MAX_BYTES``) starts no sender: the reader thread that writes a slice
  sends the slice that forwards it (``forward``), and the trio thread sends what is
  ready when the part starts (its own input). A ring hop then wakes one thread per
  peer (the reader), not two. A forwarder sends only what cannot block it (the
  connection is free within ``lock_wait`` and its socket buffer has room, so a reader
  always goes back to draining its connection); a slice it cannot send starts the
  sender threads, which skip what was sent already.

Every slice is taken by exactly one thread: its flag in the ledger's ``sent`` is set
under the lock, where the sender also checks that the attempt still runs and puts
the connection in the ledger's ``using``. ``stop`` (which takes the same lock) thus
either finds the connection there and cuts it, or the sender sees the attempt over.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import trio

from .._core.ring import RingSchedule, Segment
from ..ops import NonFiniteData, Sender
from ..transport import Connection, SocketLink
from ._blocks import Encoded, refusal
from ._ledger import Ledger, LocalFailure
from ._operands import Operands
from ._protocol import Protocol, SendData, Wait, run_protocol

__all__ = ["FORWARD_LOCK_WAIT", "FORWARD_MAX_BYTES", "Outbound"]

#: Unquantized attempts of at most this many bytes over worker threads forward each
#: slice from the reader that wrote it (see the module docstring).
FORWARD_MAX_BYTES = 4 << 20
#: How long a forwarding thread (the trio thread included) waits for a connection
#: another thread is sending on before it leaves the slice to the sender threads. A
#: forwarder holds a connection only for a send that fits in its buffer.
FORWARD_LOCK_WAIT = 0.002
#: Forwarding sends from host buffers only.
_HOST = Sender()


class Outbound:
    """The sending side of one attempt (see the module docstring).

    Args:
        ledger, schedule, operands: the attempt's.
        encoded: the quantized attempt's blocks (None: unquantized).
        lock_wait: how long a forwarder waits for a busy connection (None:
            ``FORWARD_LOCK_WAIT``).
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        schedule: RingSchedule,
        operands: Operands,
        encoded: Encoded | None,
        lock_wait: float | None = None,
    ) -> None:
        self._ledger = ledger
        self._schedule = schedule
        self._operands = operands
        self._encoded = encoded
        self._lock_wait = FORWARD_LOCK_WAIT if lock_wait is None else lock_wait
        # While readers forward: the outgoing links (under the lock), and whether a
        # slice was left to sender threads.
        self._links: tuple[SocketLink, ...] = ()
        self._need_senders = False
        # Whether the data moved in worker threads (TCP), so restoring may too; on
        # the in-memory network everything stays in trio tasks (virtual time).
        self.uses_threads = False

    @property
    def forwarding(self) -> bool:
        """Whether readers send on what they wrote (under the lock)."""
        return bool(self._links)

    # --- frames ----------------------------------------------------------------------

    def _ready(self, segment: Segment, index: int) -> bool:
        """Whether slice ``index`` of send segment ``segment`` may be sent: what it
        forwards has arrived (read without the lock: the flags are set once)."""
        return segment.forwards is None or bool(self._ledger.done[segment.forwards][index])

    def _frame(
        self, segment: Segment, index: int, sender: Sender, scratch: Any
    ) -> tuple[int, memoryview]:
        """The stream offset and payload (host bytes) of one outgoing slice, staged
        by ``sender`` (``scratch``: host room for one encoded block, when quantized).

        Raises:
            NonFiniteData: quantized, and the slice holds NaN or inf.
        """
        offset = segment.stream_offset + index * self._schedule.slice_bytes
        if self._encoded is not None:
            return offset, self._encoded.frame(segment, index, sender, scratch)
        start, stop = self._schedule.slice_range(segment, index)
        return offset, sender.host(self._operands.source(segment, start, stop), key=(segment.index, index))

    def _payload_bytes(self) -> int:
        """Bytes on the wire of the largest slice."""
        nbytes = self._schedule.slice_bytes
        return nbytes if self._encoded is None else self._encoded.payload_size(nbytes)

    def _prefetch(self, sender: Sender, slices: list[tuple[Segment, int]], position: int) -> None:
        """Start staging the sender's slice at ``position`` if it is ready."""
        if self._encoded is not None or position >= len(slices):
            return
        segment, index = slices[position]
        if self._ready(segment, index):
            start, stop = self._schedule.slice_range(segment, index)
            sender.prefetch((segment.index, index), self._operands.source(segment, start, stop))

    # --- senders ---------------------------------------------------------------------

    def _plan(self, connections: int) -> list[list[tuple[Segment, int]]]:
        """The stream's slices dealt round-robin over ``connections``, in order."""
        schedule = self._schedule
        stream = [(s, i) for s in schedule.send for i in range(schedule.send_slices[s.index])]
        return [stream[k::connections] for k in range(connections)]

    def _send_slices(self, connection: Connection, slices: list[tuple[Segment, int]]) -> Protocol[None]:
        """One sender: ``slices`` in order on ``connection``, each once it is ready."""
        sender = self._operands.staging.sender(self._payload_bytes())
        try:
            yield from self._send_staged(connection, slices, sender)
        finally:
            sender.close()

    def _send_staged(
        self, connection: Connection, slices: list[tuple[Segment, int]], sender: Sender
    ) -> Protocol[None]:
        ledger = self._ledger
        scratch = None if self._encoded is None else self._encoded.scratch()
        for position, (segment, index) in enumerate(slices, start=1):
            # A slice whose source arrived already needs no wait to drive.
            source = segment.forwards
            if source is not None and not self._ready(segment, index) and not (yield Wait(
                partial(ledger.arrived, source, index),
                partial(ledger.arrived_blocking, source, index),
            )):
                return
            try:
                offset, payload = self._frame(segment, index, sender, scratch)
            except NonFiniteData as exc:
                ledger.reject(refusal(exc))
                return
            # Its staging overlaps this one's send.
            self._prefetch(sender, slices, position)
            with ledger.lock:
                # Checked and registered under the lock: ``stop`` either sees this
                # connection (and cuts it) or this sender sees the attempt over.
                if not ledger.running:
                    return
                if ledger.sent[segment.index][index]:
                    continue  # a reader forwarded it
                ledger.sent[segment.index][index] = 1
                ledger.use(connection)
            try:
                yield SendData(tag=ledger.tag, seq=ledger.seq, offset=offset, payload=payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                ledger.fail(f"sending to the next peer failed ({exc})")
                return
            finally:
                with ledger.lock:
                    ledger.unuse(connection)
            ledger.left(len(payload))

    # --- forwarding ------------------------------------------------------------------

    def _send_now(self, segment_index: int, index: int) -> bool:
        """Send outgoing slice ``index`` of ``segment_index`` (which is ready) from the
        calling thread, if that cannot block: its connection is free within
        ``lock_wait`` seconds and has room for the frame (``SocketLink.has_room``).
        True if the slice is dealt with (sent, taken by another sender, or no longer
        wanted); False leaves it to the sender threads.
        """
        ledger, links = self._ledger, self._links
        link = links[(self._schedule.send_positions[segment_index] + index) % len(links)]
        if not link.send_lock.acquire(timeout=self._lock_wait):
            return False
        try:
            offset, payload = self._frame(self._schedule.send[segment_index], index, _HOST, None)
            if not link.has_room(len(payload)):
                return False
            with ledger.lock:
                # As in ``_send_staged``: ``stop`` cuts the link or we see it stopped.
                if ledger.sent[segment_index][index] or not ledger.running:
                    return True
                ledger.sent[segment_index][index] = 1
                ledger.use(link)
            try:
                link.send_data_locked(tag=ledger.tag, seq=ledger.seq, offset=offset, payload=payload)
            finally:
                with ledger.lock:
                    ledger.unuse(link)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            ledger.fail(f"sending to the next peer failed ({exc})")
            return True
        finally:
            link.send_lock.release()
        ledger.left(len(payload))
        return True

    def forward(self, send_segment: int, index: int) -> None:
        """A reader wrote the slice that slice ``index`` of ``send_segment`` forwards:
        send it from this thread, or leave it to the sender threads."""
        if not self._send_now(send_segment, index):
            with self._ledger.lock:
                self._need_senders = True
                self._ledger.wake(trio_too=True)

    def _forward_from_here(self, links: tuple[SocketLink, ...]) -> None:
        """Start forwarding: from now on the reader that writes a slice sends the
        slice that forwards it; the slices ready already (this peer's own input, and
        what arrived before) are sent from here, the trio thread, where that cannot
        block."""
        ledger, send = self._ledger, self._schedule.send
        with ledger.lock:
            self._links = links
            ready = [
                (s, i) for s, flags in enumerate(ledger.sent) for i in range(len(flags))
                if not flags[i] and self._ready(send[s], i)
            ]
        for segment_index, index in ready:
            if not self._send_now(segment_index, index):
                self._need_senders = True

    async def send_all(self, connections: Sequence[Connection]) -> None:
        """Send this peer's whole stream, striped over ``connections``, and wait until
        every slice of it has left and every slice of the incoming stream has arrived.
        Not before: a reader's forward may still be sending when the sender threads
        are done, and ending the attempt then (the verdict can come as soon as the
        bytes are out) would cut the connection under it.

        Raises:
            LocalFailure: a link broke or a frame was bad.
        """
        ledger = self._ledger
        if not connections:
            ledger.fail(ledger.failure or "no open connection to the next peer")
            raise LocalFailure(ledger.failure or "")
        self.uses_threads = any(isinstance(c, SocketLink) for c in connections)
        for segment in self._schedule.send:  # before any slice of it leaves
            if segment.forwards is None:
                self._operands.gather_own(segment)
        links = tuple(c for c in connections if isinstance(c, SocketLink))
        forward = (
            self._encoded is None and self._operands.xp is np and len(links) == len(connections)
            and len(self._operands.result_bytes) <= FORWARD_MAX_BYTES
        )
        if forward:
            self._forward_from_here(links)
            while not (ledger.complete or self._need_senders or not ledger.running):
                await ledger.signal.wait()
        if not forward or self._need_senders and ledger.running:
            async with trio.open_nursery() as nursery:
                for connection, slices in zip(
                    connections, self._plan(len(connections)), strict=True
                ):
                    if slices:
                        nursery.start_soon(partial(
                            run_protocol, self._send_slices(connection, slices), connection,
                            interrupt=ledger.stop,
                        ))
        while not (ledger.complete or not ledger.running):
            await ledger.signal.wait()
        if ledger.complete:
            return  # whatever happened since (a leased part waits here for its agreement)
        if ledger.failure is not None:
            raise LocalFailure(ledger.failure)
        raise LocalFailure("the attempt was stopped")
