"""One attempt of a ring all-reduce at one peer: its buffers, schedule and data path.

Theory of operation
-------------------
An ``AllReduceAttempt`` is created when the user launches an all-reduce, before the
peer votes, so that data frames can be accepted the moment the master commences it
(the neighbour may start sending before this peer has even read the commence).

* The **receive side** is driven by the communicator's per-connection readers: each
  data frame names ``(tag, seq, offset)``; the reader ``claim``s the slice, receives
  the payload (into its own staging buffer, or for all-gather data straight into the
  result, see ``direct_target``) and calls ``on_slice``, which combines or copies it
  into the result buffer if the attempt is still live.
* The **send side** is ``send_all``: one sender per pool connection, each sending its
  share of the slices in stream order, every slice as soon as the slice it forwards
  has arrived (see ``RingSchedule``). A sender is a protocol of ``_protocol``, so the
  same code runs in a trio task or a worker thread.
* **Forwarding.** A small unquantized all-reduce over worker threads
  (``FORWARD_MAX_BYTES``) starts no sender: the reader thread that completes a slice
  sends the slice that forwards it, and the trio thread sends what is ready when the
  attempt starts (its own chunk). A ring hop then wakes one thread per peer (the
  reader), not two. A forwarder sends only what cannot block it (the connection is
  free within ``FORWARD_LOCK_WAIT`` and its socket buffer has room, so a reader always
  goes back to draining its connection); a slice it cannot send starts the sender
  threads, which skip what was sent already. Every outgoing slice is taken by exactly
  one thread, under the lock.

Readers and senders are trio tasks on streams without a socket of their own (the
in-memory network), and worker threads blocking on ``SocketLink``s over TCP. The
attempt's state is guarded by one lock, and its buffers by a count of writers:
``stop`` ends the attempt (no writer starts after it, and a reader receiving into
the result buffer has its connection cut), and ``settle`` waits for the writers that
were already running, so ``restore`` never races a late write.

For an in-place all-reduce every slice is copied to a backup just before its first
write (``_inputs``), so an aborted attempt restores exactly the caller's input.

GPU buffers run this same code: the attempt's ``staging`` (``_staging``) hands senders
the host bytes of a slice (copied from the device into pinned memory, the next one
while this one is sent), lands received payloads on the device, and runs the kernels
on the reader's stream; the backup lives in device memory. Only forwarding and the
receive straight into the result (``direct_target``) are host-only.

Quantized (with a ``Codec``), every slice travels as one encoded block. In the
reduce-scatter a sender encodes the slice's current partial result afresh; the
receiver decodes it and combines it into its own values. The owner of a chunk encodes
its final value once, on the last reduce step, and adopts the decoded block as its own
result; in the all-gather the blocks are kept (``_blocks.BlockStore``) and forwarded byte
for byte, and every receiver decodes the same bytes. So every peer ends with the same
bits.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np
import trio

from .._core.errors import RemoteProtocolError
from .._core.ring import RingSchedule, Segment
from .._types import ReduceOp
from ..ops import Codec, NonFiniteData, combine_into, copy_into, finalize_average, reduce_into
from ..transport import Connection, SocketLink
from ._agreement import Agreement
from ._blocks import BlockStore
from ._gathered import Gathered
from ._inputs import InputBackup
from ._protocol import Protocol as IOProtocol
from ._protocol import SendData, Wait, run_protocol
from ._staging import Sender, Staging

__all__ = [
    "FORWARD_MAX_BYTES",
    "AllReduceAttempt",
    "LocalFailure",
]

#: Unquantized all-reduces of at most this many bytes over worker threads forward each
#: slice from the reader that completed it (see ``send_all``).
FORWARD_MAX_BYTES = 4 << 20
#: How long a forwarding thread (the trio thread included) waits for a connection
#: another thread is sending on before it leaves the slice to the attempt's sender
#: threads. A forwarder holds a connection only for a send that fits in its buffer.
FORWARD_LOCK_WAIT = 0.002
#: Forwarding sends from host buffers only.
_HOST = Sender()


class LocalFailure(Exception):
    """This peer's part of an attempt failed (a link broke, a frame was bad)."""


class _Cuttable(Protocol):
    def close_now(self) -> None: ...


@dataclasses.dataclass(kw_only=True)
class _Progress:
    """Per received segment: which slices a reader took on, and which are written."""

    claimed: list[bytearray]
    done: list[bytearray]
    remaining: int


class AllReduceAttempt:
    """One attempt of an all-reduce (see the module docstring).

    Args:
        staging: how bytes move between the buffers and the sockets (its ``xp`` is
            the buffers' array module).
        send: the caller's input, a flat array, or a fused bucket's ``Gathered``
            members (not in place, unquantized, host memory).
        result: where the result goes (``send`` itself for in place).
        op: the reduction.
        tag: the user's tag.
        ring: the peer group's ring (peer ids); rank: this peer's position in it.
        slice_bytes: the size of one slice in the buffer (unquantized, the payload of
            one data frame).
        codec: how slices are encoded on the wire; None sends the buffer's bytes.
    """

    def __init__(
        self,
        *,
        staging: Staging,
        send: Any,
        result: Any,
        op: ReduceOp,
        tag: int,
        ring: tuple[int, ...],
        rank: int,
        slice_bytes: int,
        codec: Codec | None = None,
    ) -> None:
        self.staging = staging
        self.xp = staging.xp
        self.codec = codec
        self.tag = tag
        self.op = op
        self.seq = 0  # the master's number for it, once it commences
        self.ring = ring
        self.predecessor, self.successor = ring[rank - 1], ring[(rank + 1) % len(ring)]
        world = len(ring)
        self.result = result
        self.in_place = send is result
        self.itemsize = int(result.dtype.itemsize)
        self.schedule = RingSchedule.of(
            count=int(result.size), itemsize=self.itemsize, world=world, rank=rank,
            slice_bytes=slice_bytes,
        )
        self._result_bytes = result.view(np.uint8)
        # A gathered input (host, unquantized) sends its own chunk from the result.
        self._gathered = send if isinstance(send, Gathered) else None
        assert self._gathered is None or (codec is None and self.xp is np)
        self._send_bytes = self._result_bytes if self._gathered is not None else send.view(np.uint8)
        self.live = True
        self.failure: str | None = None
        # Set when this peer's data cannot be reduced (quantizing NaN or inf): the
        # collective fails as an invalid argument rather than a fault.
        self.invalid: str | None = None
        self.clamped = 0
        self.tx_bytes = 0
        self.rx_bytes = 0
        # Trio tasks wait on the lot; worker threads on the condition, which shares
        # the lock guarding everything below.
        self._lot = trio.lowlevel.ParkingLot()
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        counts = self.schedule.recv_slices
        self._progress = _Progress(
            claimed=[bytearray(n) for n in counts],
            done=[bytearray(n) for n in counts],
            remaining=sum(counts),
        )
        # Readers and reductions writing into the result buffer right now.
        self._writers = 0
        # In place: the caller's input of every slice overwritten so far.
        self._input = InputBackup(staging, self._result_bytes, lock=self._lock) if self.in_place else None
        # Connections receiving a slice straight into the result buffer right now,
        # and (threads) connections a sender is writing a frame of ours on.
        self._direct_readers: set[_Cuttable] = set()
        self._active_links: set[_Cuttable] = set()
        # Send side: which outgoing slices were taken by a sender (set once, under the
        # lock, so every slice is sent exactly once), how many are not sent yet, and
        # each send segment's first position in the stream of slices (for striping).
        self._sent = [bytearray(n) for n in self.schedule.send_slices]
        self._unsent = sum(self.schedule.send_slices)
        self._positions = self.schedule.send_positions
        # Forwarding (see ``send_all``): the outgoing links while readers forward, and
        # whether a slice was left to sender threads.
        self._links: tuple[SocketLink, ...] = ()
        self._need_senders = False
        # Under a lease: how its members agree on the outcome (``under_lease``).
        self.agreement: Agreement | None = None
        # Whether the data moved in worker threads (TCP), so restoring may too; on the
        # in-memory network everything stays in trio tasks (virtual time).
        self.uses_threads = False
        # Quantized: the encoded blocks of the all-gather segments this peer sends.
        self._blocks = None if codec is None else BlockStore(
            codec, self.schedule, self.itemsize, staging.host_pool)

    def under_lease(self, seq: int) -> Agreement:
        """Run as attempt ``seq`` of a lease: no commence comes, and its members agree
        on the outcome among themselves (``_agreement``)."""
        self.seq = seq
        self.agreement = Agreement(
            world=len(self.ring), attempt=self, lock=self._lock,
            wake=partial(self._wake, trio_too=True),
        )
        return self.agreement

    def _quiet_agreement(self) -> Agreement | None:
        """The agreement, if the data path's threads tell its completion (under the
        lock, once this part is complete: ``Agreement.quiet``)."""
        agreement = self.agreement
        return agreement if agreement is not None and agreement.quiet else None

    # --- waking waiters ----------------------------------------------------------------

    def _wake(self, *, trio_too: bool) -> None:
        """Called with the lock held after a state change: wake waiting threads, and
        (from the trio thread always, from others if ``trio_too``) waiting tasks."""
        self._changed.notify_all()
        if threading.get_ident() == self._trio_thread:
            self._lot.unpark_all()
        elif trio_too:
            try:
                self._token.run_sync_soon(self._lot.unpark_all)
            except trio.RunFinishedError:  # pragma: no cover - the run is over
                pass

    # --- receive side (called by connection readers) ---------------------------------

    def claim(self, tag: int, stream_offset: int, nbytes: int) -> tuple[Segment, int]:
        """The segment and slice a frame carries, checked against this attempt and
        reserved for the calling reader.

        Raises:
            RemoteProtocolError: wrong tag, not a slice of the stream, or a repeat.
        """
        if tag != self.tag:
            raise RemoteProtocolError(
                f"data frame for attempt {self.seq} carries tag {tag}, not {self.tag}"
            )
        segment, index = self.schedule.locate(
            stream_offset, nbytes, None if self.codec is None else self._payload_size
        )
        with self._lock:
            claimed = self._progress.claimed[segment.index]
            if claimed[index]:
                raise RemoteProtocolError(
                    f"slice {index} of segment {segment.index} arrived twice"
                )
            claimed[index] = 1
        return segment, index

    def on_slice(self, segment: Segment, index: int, payload: Any) -> None:
        """Combine or copy a claimed slice (``payload``: a uint8 array view); dropped
        if the attempt is over."""
        with self._lock:
            if not self.live:
                return  # an aborted attempt: drop, never write
            self._writers += 1
        written = False
        try:
            start, stop = self.schedule.slice_range(segment, index)
            if self.codec is None:
                self._write(segment, start, stop, payload)
            else:
                self._write_block(segment, index, start, stop, payload)
            written = True
        except NonFiniteData as exc:
            self.reject(exc)
        finally:
            self._end_write(segment, index, written)

    def direct_target(self, segment: Segment, index: int, reader: _Cuttable) -> memoryview | None:
        """Where a claimed all-gather slice may be received in place, or None (use
        staging and ``on_slice``).

        All-gather data is final, so it can go straight into the result buffer. While
        the payload arrives ``reader`` writes into that buffer; if the attempt stops
        meanwhile, ``stop`` cuts that connection, so no byte lands once the reader has
        returned. Finish with ``on_direct_slice``, whether the receive worked or not.
        """
        if segment.reduce or self.xp is not np or self.codec is not None:
            return None
        start, stop = self.schedule.slice_range(segment, index)
        with self._lock:
            if not self.live:
                return None
            self._writers += 1
            self._direct_readers.add(reader)
        try:
            self._back_up(segment, start, stop)
        except BaseException:
            self.on_direct_slice(segment, index, reader, False)
            raise
        return memoryview(self._result_bytes[start:stop])

    def on_direct_slice(self, segment: Segment, index: int, reader: _Cuttable, received: bool) -> None:
        """The receive that ``direct_target`` allowed is over."""
        with self._lock:
            self._direct_readers.discard(reader)
        self._end_write(segment, index, received)

    def _end_write(self, segment: Segment, index: int, written: bool) -> None:
        with self._lock:
            self._writers -= 1
            if written:
                start, stop = self.schedule.slice_range(segment, index)
                self._progress.done[segment.index][index] = 1
                self.rx_bytes += self._payload_size(stop - start)
                self._progress.remaining -= 1
            complete = self.complete
            quiet = self._quiet_agreement() if complete else None
            self._wake(trio_too=complete and quiet is None or not self._writers and not self.live)
            forward = written and self._links and segment.index + 1 < len(self._sent)
        if quiet is not None and written:
            quiet.tell()
        if forward:
            # This reader forwards the slice it completed: no other thread to wake.
            if not self._send_now(segment.index + 1, index, wait=FORWARD_LOCK_WAIT):
                with self._lock:
                    self._need_senders = True
                    self._wake(trio_too=True)

    def _back_up(self, segment: Segment, start: int, stop: int) -> None:
        """In place: keep the caller's input of a slice about to be first written."""
        if self._input is not None and (segment.reduce or segment.chunk == self.schedule.rank):
            self._input.keep(start, stop)

    def _write(self, segment: Segment, start: int, stop: int, payload: Any) -> None:
        with self.staging.working():
            self._write_staged(segment, start, stop, self.staging.to_device(payload))

    def _write_staged(self, segment: Segment, start: int, stop: int, payload: Any) -> None:
        dtype = self.result.dtype
        target = self._result_bytes[start:stop].view(dtype)
        incoming = payload.view(dtype)
        self._back_up(segment, start, stop)
        if segment.reduce:
            if self.in_place:
                reduce_into(self.xp, target, incoming, self.op)
            elif self._gathered is not None:
                self._gathered.combine(target, incoming, start, self.op)
            else:
                # Not in place: the local contribution comes from the send buffer.
                local = self._send_bytes[start:stop].view(dtype)
                combine_into(self.xp, target, local, incoming, self.op)
            if segment.index == self.schedule.world - 2 and self.op is ReduceOp.AVG:
                finalize_average(self.xp, target, self.schedule.world)
        else:
            copy_into(self.xp, target, incoming)

    def _payload_size(self, nbytes: int) -> int:
        """Bytes on the wire for a slice of ``nbytes`` in the buffer."""
        return nbytes if self._blocks is None else self._blocks.payload_size(nbytes)

    def _block(self, send_segment: int, index: int) -> Any:
        """The stored block of slice ``index`` of all-gather send segment ``send_segment``."""
        assert self._blocks is not None
        return self._blocks.block(send_segment, index)

    def _write_block(self, segment: Segment, index: int, start: int, stop: int, block: Any) -> None:
        """``_write`` for an encoded slice: decode and combine it (reduce-scatter), or
        decode it and keep it to forward (all-gather). Blocks stay in host memory: the
        codec copies only the codes across, and decodes where the buffers are."""
        codec = self.codec
        assert codec is not None
        dtype = self.result.dtype
        target = self._result_bytes[start:stop].view(dtype)
        with self.staging.working():
            self._back_up(segment, start, stop)
            if not segment.reduce:
                codec.decode(block, target)
            else:
                local = target if self.in_place else self._send_bytes[start:stop].view(dtype)
                codec.decode_combine(block, target, local, self.op)
                if segment.index == self.schedule.world - 2:
                    self._own_block(index, target)
        if not segment.reduce and segment.index + 1 < len(self.schedule.send):
            self._block(segment.index + 1, index)[:] = block

    def _own_block(self, index: int, target: Any) -> None:
        """This peer owns the chunk: encode its final value once, and hold exactly
        what every other peer will decode."""
        codec = self.codec
        assert codec is not None
        if self.op is ReduceOp.AVG:
            finalize_average(self.xp, target, self.schedule.world)
        own = self._block(self.schedule.world - 1, index)
        clamped = codec.encode_own(target, own)
        if clamped:
            with self._lock:
                self.clamped += clamped

    def reject(self, error: NonFiniteData) -> None:
        """This peer's data cannot be quantized: the collective fails for everyone as
        an invalid argument."""
        reason = (
            f"quantization needs finite values, and the data at this peer holds NaN or "
            f"inf (in its input, or in partial results that overflowed): {error}"
        )
        with self._lock:
            if not self.live:
                return  # over already: what was read may have been a restore's
            if self.invalid is None:
                self.invalid = reason
        self.fail(reason)

    def fail(self, reason: str) -> None:
        """Mark this peer's part failed (e.g. an incoming link broke); any thread."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
            self._wake(trio_too=True)

    def stop(self) -> None:
        """No more writes: the attempt is over (aborted or finished).

        Readers receiving into the result buffer and senders blocked mid-frame have
        their connections cut; ``settle`` then waits for writers already running.
        """
        with self._lock:
            self.live = False
            # Under the lock: a connection leaving these sets now could otherwise
            # start a frame of another collective before the cut reaches it.
            for connection in [*self._direct_readers, *self._active_links]:
                connection.close_now()
            self._wake(trio_too=True)

    async def wait_changed(self) -> None:
        """Wait until something may have changed (a slice, notice, failure, stop, verdict)."""
        await self._lot.park()

    async def settle(self) -> None:
        """Wait until no reader or reduction writes into the buffers; after ``stop``."""
        assert not self.live
        with trio.CancelScope(shield=True):
            while self._writers:
                await self._lot.park()

    @property
    def restore_seconds(self) -> float:  # spent putting the input back (``restore``)
        return self._input.restore_seconds if self._input is not None else 0.0

    def restore(self) -> None:
        """Put the caller's input back (in place); call only after ``settle``."""
        assert not self.live and not self._writers
        if self._input is not None:
            self._input.restore()

    def release(self) -> None:
        """Return pooled memory; the attempt is over."""
        if self._input is not None:
            self._input.release()
        if self._blocks is not None:
            self._blocks.release()

    # --- send side -----------------------------------------------------------------

    def _plan(self, connections: int) -> list[list[tuple[Segment, int]]]:
        """The stream's slices dealt round-robin over ``connections``, in order."""
        stream = [(s, i) for s in self.schedule.send for i in range(self.schedule.send_slices[s.index])]
        return [stream[k::connections] for k in range(connections)]

    def _source(self, segment: Segment, index: int) -> Any:
        """The bytes of an outgoing slice in the buffers: segment 0 is our own input,
        later ones forward what we received."""
        start, stop = self.schedule.slice_range(segment, index)
        source = self._send_bytes if segment.index == 0 else self._result_bytes
        return source[start:stop]

    def _frame(
        self, segment: Segment, index: int, sender: Sender, scratch: Any
    ) -> tuple[int, memoryview]:
        """The stream offset and payload (host bytes) of one outgoing slice, staged
        by ``sender`` (``scratch``: host room for one encoded block, when quantized).

        Raises:
            NonFiniteData: quantized, and the slice holds NaN or inf.
        """
        offset = segment.stream_offset + index * self.schedule.slice_bytes
        if self.codec is None:
            return offset, sender.host(self._source(segment, index), key=(segment.index, index))
        if segment.reduce:
            # A partial result: encode it afresh, where it is; only the codes cross.
            source = self._source(segment, index)
            block = scratch[:self._payload_size(source.size)]
            with sender.working():
                clamped = self.codec.encode(source.view(self.result.dtype), block)
            if clamped:
                with self._lock:
                    self.clamped += clamped
            return offset, memoryview(block)
        return offset, memoryview(self._block(segment.index, index))

    def _scratch(self) -> Any:
        """Host room for one outgoing encoded block (None unquantized)."""
        size = self._payload_size(self.schedule.slice_bytes)
        return None if self.codec is None else self.staging.host_empty(size)

    def _prefetch(self, sender: Sender, slices: list[tuple[Segment, int]], position: int) -> None:
        """Start staging the sender's slice at ``position`` if it is ready."""
        if self.codec is not None or position >= len(slices):
            return
        segment, index = slices[position]
        if segment.index == 0 or self._progress.done[segment.index - 1][index]:
            sender.prefetch((segment.index, index), self._source(segment, index))

    async def _arrived(self, segment_index: int, slice_index: int) -> bool:
        """Wait until slice ``slice_index`` of received segment ``segment_index`` is in;
        False if the attempt failed first."""
        done = self._progress.done[segment_index]
        while not done[slice_index]:
            if self.failure is not None or not self.live:
                return False
            await self._lot.park()
        return True

    def _arrived_blocking(self, segment_index: int, slice_index: int) -> bool:
        """``_arrived`` from a worker thread."""
        done = self._progress.done[segment_index]
        with self._lock:
            while not done[slice_index] and self.failure is None and self.live:
                self._changed.wait()
            return self.failure is None and self.live

    def _send_slices(self, connection: Connection, slices: list[tuple[Segment, int]]) -> IOProtocol[None]:
        """One sender: ``slices`` in order on ``connection``, each once it is ready."""
        sender = self.staging.sender(self._payload_size(self.schedule.slice_bytes))
        try:
            yield from self._send_staged(connection, slices, sender)
        finally:
            sender.close()

    def _send_staged(
        self, connection: Connection, slices: list[tuple[Segment, int]], sender: Sender
    ) -> IOProtocol[None]:
        scratch = self._scratch()
        done = self._progress.done
        for position, (segment, index) in enumerate(slices, start=1):
            # A slice whose source arrived already needs no wait to drive.
            if segment.index and not done[segment.index - 1][index] and not (yield Wait(
                partial(self._arrived, segment.index - 1, index),
                partial(self._arrived_blocking, segment.index - 1, index),
            )):
                return
            try:
                offset, payload = self._frame(segment, index, sender, scratch)
            except NonFiniteData as exc:
                self.reject(exc)
                return
            # Its staging overlaps this one's send.
            self._prefetch(sender, slices, position)
            with self._lock:
                # Checked and registered under the lock: ``stop`` either sees this
                # connection (and cuts it) or this sender sees the attempt over.
                if self.failure is not None or not self.live:
                    return
                if self._sent[segment.index][index]:
                    continue  # a reader forwarded it
                self._sent[segment.index][index] = 1
                self._active_links.add(connection)
            try:
                yield SendData(tag=self.tag, seq=self.seq, offset=offset, payload=payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.fail(f"sending to the next peer failed ({exc})")
                return
            finally:
                with self._lock:
                    self._active_links.discard(connection)
            self._sent_one(len(payload))

    @property
    def complete(self) -> bool:
        """Every slice received and sent: this peer holds the whole result, whatever
        happened since (what ``send_all`` waits for; under the lock)."""
        return not self._progress.remaining and not self._unsent

    def _sent_one(self, nbytes: int) -> None:
        """A slice of ``nbytes`` on the wire left this peer."""
        with self._lock:
            self.tx_bytes += nbytes
            self._unsent -= 1
            quiet = self._quiet_agreement() if self.complete else None
            if self.complete and quiet is None:
                self._wake(trio_too=True)
        if quiet is not None:
            quiet.tell()

    def _send_now(self, segment_index: int, index: int, *, wait: float) -> bool:
        """Send outgoing slice ``index`` of ``segment_index`` (which is ready) from the
        calling thread, if that cannot block: its connection is free within ``wait``
        seconds and has room for the frame (``SocketLink.has_room``).
        True if the slice is dealt with (sent, taken by another sender, or no longer
        wanted); False leaves it to the sender threads.
        """
        links = self._links
        link = links[(self._positions[segment_index] + index) % len(links)]
        if not link.send_lock.acquire(timeout=wait):
            return False
        try:
            offset, payload = self._frame(self.schedule.send[segment_index], index, _HOST, None)
            if not link.has_room(len(payload)):
                return False
            with self._lock:
                # As in ``_send_slices``: ``stop`` cuts the link or we see it stopped.
                if self._sent[segment_index][index] or self.failure is not None or not self.live:
                    return True
                self._sent[segment_index][index] = 1
                self._active_links.add(link)
            try:
                link.send_data_locked(tag=self.tag, seq=self.seq, offset=offset, payload=payload)
            finally:
                with self._lock:
                    self._active_links.discard(link)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.fail(f"sending to the next peer failed ({exc})")
            return True
        finally:
            link.send_lock.release()
        self._sent_one(len(payload))
        return True

    def _forward_from_here(self, links: tuple[SocketLink, ...]) -> None:
        """Start forwarding (see ``send_all``): from now on the reader that completes a
        slice sends the slice that forwards it; the slices ready already (this peer's
        own chunk, and what arrived before) are sent from here, the trio thread, where
        that cannot block."""
        with self._lock:
            self._links = links
            ready = [
                (s, i) for s, flags in enumerate(self._sent) for i in range(len(flags))
                if not flags[i] and (s == 0 or self._progress.done[s - 1][i])
            ]
        for segment_index, index in ready:
            if not self._send_now(segment_index, index, wait=FORWARD_LOCK_WAIT):
                self._need_senders = True

    async def send_all(self, connections: Sequence[Connection]) -> None:
        """Send this peer's whole stream, striped over ``connections``, and wait until
        every slice of it has left and every slice of the incoming stream has arrived.
        Not before: a reader's forward may still be sending when the sender threads
        are done, and ending the attempt then (the verdict can come as soon as the
        bytes are out) would cut the connection under it. Small unquantized
        all-reduces over worker threads *forward* (the module docstring).

        Raises:
            LocalFailure: a link broke or a frame was bad.
        """
        if not connections:
            self.fail(self.failure or "no open connection to the next peer")
            raise LocalFailure(self.failure or "")
        self.uses_threads = any(isinstance(c, SocketLink) for c in connections)
        if self._gathered is not None:  # before any slice of it leaves (``_gathered``)
            own = self.schedule.send[0]
            self._gathered.gather(self._result_bytes, own.start, own.start + own.nbytes)
        links = tuple(c for c in connections if isinstance(c, SocketLink))
        if self.agreement is not None and isinstance(connections[0], SocketLink):
            with self._lock:  # before any slice leaves: none can complete the part yet
                self.agreement.link = connections[0]
        forward = (
            self.codec is None and self.xp is np and len(links) == len(connections)
            and len(self._result_bytes) <= FORWARD_MAX_BYTES
        )
        if forward:
            self._forward_from_here(links)
            while (
                (self._progress.remaining or self._unsent) and not self._need_senders
                and self.failure is None and self.live
            ):
                await self._lot.park()
        if not forward or self._need_senders and self.failure is None and self.live:
            async with trio.open_nursery() as nursery:
                for connection, slices in zip(
                    connections, self._plan(len(connections)), strict=True
                ):
                    if slices:
                        nursery.start_soon(partial(
                            run_protocol, self._send_slices(connection, slices), connection,
                            interrupt=self.stop,
                        ))
        while not self.complete and self.failure is None and self.live:
            await self._lot.park()
        if self.complete:
            return  # whatever happened since (a leased part waits here for its agreement)
        if self.failure is not None:
            raise LocalFailure(self.failure)
        if not self.live:
            raise LocalFailure("the attempt was stopped")
