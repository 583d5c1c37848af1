"""One attempt of a ring all-reduce at one peer: its buffers, schedule and data path.

Theory of operation
-------------------
An ``AllReduceAttempt`` is created when the user launches an all-reduce, before the
peer votes, so that data frames can be accepted the moment the master commences it
(the neighbour may start sending before this peer has even read the commence).

* The **receive side** is driven by the communicator's per-connection readers: each
  data frame names ``(tag, seq, offset)``; the reader receives the payload into its
  own staging buffer and calls ``on_slice``, which (synchronously, with no await in
  between) checks the attempt is still live and combines or copies the slice into
  the result buffer. Because only live attempts write, and an aborted attempt stops
  being live before its input is restored, a late frame can never corrupt a buffer.
* The **send side** is ``send_all``: one task per pool connection, each sending its
  share of the slices in stream order, every slice as soon as the slice it forwards
  has arrived (see ``RingSchedule``).

For an in-place all-reduce every slice is copied to a backup just before its first
write, so an aborted attempt restores exactly the caller's input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from .._core.errors import RemoteProtocolError
from .._core.ring import RingSchedule, Segment
from .._types import ReduceInfo, ReduceOp
from ..ops import copy_into, finalize_average, reduce_into
from ..transport import FramedStream

__all__ = ["AllReduceAttempt", "AsyncReduceHandle", "BufferPool", "LocalFailure"]


class BufferPool:
    """Reusable host byte buffers (their pages stay mapped between collectives)."""

    def __init__(self) -> None:
        self._free: list[Any] = []

    def take(self, nbytes: int) -> Any:
        """A uint8 array of at least ``nbytes`` (a view of exactly ``nbytes``)."""
        fitting = [i for i, b in enumerate(self._free) if b.size >= nbytes]
        if fitting:
            buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].size))
        else:
            buffer = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]

    def give(self, view: Any) -> None:
        base = view.base if view.base is not None else view
        self._free.append(base)
        # Keep a bounded amount: the largest few.
        self._free.sort(key=lambda b: b.size, reverse=True)
        del self._free[4:]


class LocalFailure(Exception):
    """This peer's part of an attempt failed (a link broke, a frame was bad)."""


@dataclasses.dataclass(kw_only=True)
class _Progress:
    """Which slices of each received segment have been combined or copied."""

    done: list[bytearray]
    remaining: int


class AllReduceAttempt:
    """One attempt of an all-reduce (see the module docstring).

    Args:
        xp: the array module of the buffers.
        send: the caller's input, a flat array.
        result: where the result goes (``send`` itself for in place).
        op: the reduction.
        tag: the user's tag.
        world: ring size; rank: this peer's position in the ring.
        slice_bytes: the size of one data frame's payload.
    """

    def __init__(
        self,
        *,
        xp: Any,
        send: Any,
        result: Any,
        op: ReduceOp,
        tag: int,
        world: int,
        rank: int,
        slice_bytes: int,
        buffers: BufferPool,
    ) -> None:
        self.xp = xp
        self.buffers = buffers
        self.tag = tag
        self.op = op
        self.seq = 0
        self.ring: tuple[int, ...] = ()
        self.predecessor: int | None = None
        self.send_array = send
        self.result = result
        self.in_place = send is result
        self.itemsize = int(result.dtype.itemsize)
        self.schedule = RingSchedule(
            count=int(result.size), itemsize=self.itemsize, world=world, rank=rank,
            slice_bytes=slice_bytes,
        )
        self._send_bytes = send.view(np.uint8)
        self._result_bytes = result.view(np.uint8)
        self.live = True
        self.failure: str | None = None
        self.tx_bytes = 0
        self.rx_bytes = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._progress = _Progress(
            done=[bytearray(self.schedule.slice_count(s)) for s in self.schedule.recv],
            remaining=sum(self.schedule.slice_count(s) for s in self.schedule.recv),
        )
        # In place: the caller's input of every slice overwritten so far, kept at the
        # same offsets of a pooled buffer (fresh memory would cost a page fault per
        # page on first touch, slower than the copy itself).
        self._backup: Any = None
        self._backed_up: list[tuple[int, int]] = []
        # Connections receiving a slice straight into the result buffer right now.
        self._direct_readers: set[FramedStream] = set()

    # --- receive side (called by connection readers) ---------------------------------

    def _locate(self, tag: int, stream_offset: int, nbytes: int) -> tuple[Segment, int]:
        """The segment and slice a frame carries, checked against this attempt.

        Raises:
            RemoteProtocolError: wrong tag, not a slice of the stream, or a repeat.
        """
        if tag != self.tag:
            raise RemoteProtocolError(
                f"data frame for attempt {self.seq} carries tag {tag}, not {self.tag}"
            )
        segment, index = self.schedule.locate(stream_offset, nbytes)
        if self._progress.done[segment.index][index]:
            raise RemoteProtocolError(f"slice {index} of segment {segment.index} arrived twice")
        return segment, index

    def on_slice(self, tag: int, stream_offset: int, payload: Any) -> None:
        """Combine or copy one received slice (``payload``: a uint8 array view).

        Raises:
            RemoteProtocolError: the frame does not fit this attempt.
        """
        segment, index = self._locate(tag, stream_offset, len(payload))
        if not self.live:
            return  # an aborted attempt: drop, never write
        start, stop = self.schedule.slice_range(segment, index)
        self._write(segment, start, stop, payload)
        self._mark_done(segment, index)

    def direct_target(
        self, tag: int, stream_offset: int, nbytes: int, reader: FramedStream
    ) -> tuple[memoryview, Segment, int] | None:
        """Where an all-gather slice may be received in place, or None (use staging).

        All-gather data is final, so it can go straight into the result buffer. While
        the payload arrives, ``reader`` writes into that buffer; if the attempt stops
        meanwhile, ``stop`` closes the connection at once, so no byte lands after the
        attempt is over (and its input restored). Finish with ``on_direct_slice``.
        """
        segment, index = self._locate(tag, stream_offset, nbytes)
        if segment.reduce or not self.live or self.xp is not np:
            return None
        start, stop = self.schedule.slice_range(segment, index)
        self._back_up(segment, start, stop)
        self._direct_readers.add(reader)
        return memoryview(self._result_bytes[start:stop]), segment, index

    def on_direct_slice(self, segment: Segment, index: int, reader: FramedStream) -> None:
        """A slice from ``direct_target`` has fully arrived."""
        self._direct_readers.discard(reader)
        self._mark_done(segment, index)

    def _mark_done(self, segment: Segment, index: int) -> None:
        start, stop = self.schedule.slice_range(segment, index)
        self._progress.done[segment.index][index] = 1
        self.rx_bytes += stop - start
        self._progress.remaining -= 1
        self._lot.unpark_all()

    def _back_up(self, segment: Segment, start: int, stop: int) -> None:
        """In place: keep the caller's input of a slice about to be first written."""
        if self.in_place and (segment.reduce or segment.chunk == self.schedule.rank):
            if self._backup is None:
                self._backup = self.buffers.take(len(self._result_bytes))
            self._backup[start:stop] = self._result_bytes[start:stop]
            self._backed_up.append((start, stop))

    def _write(self, segment: Segment, start: int, stop: int, payload: Any) -> None:
        dtype = self.result.dtype
        target = self._result_bytes[start:stop].view(dtype)
        incoming = payload.view(dtype)
        self._back_up(segment, start, stop)
        if segment.reduce:
            if not self.in_place:
                # Not in place: the local contribution comes from the send buffer.
                copy_into(self.xp, target, self._send_bytes[start:stop].view(dtype))
            reduce_into(self.xp, target, incoming, self.op)
            if segment.index == self.schedule.world - 2 and self.op is ReduceOp.AVG:
                finalize_average(self.xp, target, self.schedule.world)
        else:
            copy_into(self.xp, target, incoming)

    def fail(self, reason: str) -> None:
        """Mark this peer's part failed (e.g. an incoming link broke)."""
        if self.failure is None:
            self.failure = reason
        self._lot.unpark_all()

    def stop(self) -> None:
        """No more writes: the attempt is over (aborted or finished)."""
        self.live = False
        for reader in self._direct_readers:
            reader.close_now()  # it was receiving into our buffer: cut it off
        self._direct_readers.clear()
        self._lot.unpark_all()

    def restore(self) -> None:
        """Put the caller's input back (in place); call only after ``stop``."""
        assert not self.live
        for start, stop in self._backed_up:
            self._result_bytes[start:stop] = self._backup[start:stop]
        self._backed_up.clear()

    def release(self) -> None:
        """Return pooled memory; the attempt is over."""
        if self._backup is not None:
            self.buffers.give(self._backup)
            self._backup = None

    # --- send side -----------------------------------------------------------------

    async def _arrived(self, segment_index: int, slice_index: int) -> bool:
        """Wait until slice ``slice_index`` of received segment ``segment_index`` is in;
        False if the attempt failed first."""
        done = self._progress.done[segment_index]
        while not done[slice_index]:
            if self.failure is not None:
                return False
            await self._lot.park()
        return True

    async def send_all(self, connections: Sequence[FramedStream]) -> None:
        """Send this peer's whole stream, striped over ``connections``, then wait for
        every slice of the incoming stream.

        Raises:
            LocalFailure: a link broke or a frame was bad.
        """
        if not connections:
            self.fail(self.failure or "no open connection to the next peer")
            raise LocalFailure(self.failure or "")
        plan: list[list[tuple[Segment, int]]] = [[] for _ in connections]
        position = 0
        for segment in self.schedule.send:
            for index in range(self.schedule.slice_count(segment)):
                plan[position % len(connections)].append((segment, index))
                position += 1

        async def sender(connection: FramedStream, slices: list[tuple[Segment, int]]) -> None:
            for segment, index in slices:
                if segment.index and not await self._arrived(segment.index - 1, index):
                    return
                start, stop = self.schedule.slice_range(segment, index)
                # Segment 0 is our own input; later ones forward what we received.
                source = self._send_bytes if segment.index == 0 else self._result_bytes
                try:
                    await connection.send_data(
                        tag=self.tag,
                        seq=self.seq,
                        offset=segment.stream_offset + index * self.schedule.slice_bytes,
                        payload=memoryview(source[start:stop]),
                    )
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.fail(f"sending to the next peer failed ({exc})")
                    return
                self.tx_bytes += stop - start

        async with trio.open_nursery() as nursery:
            for connection, slices in zip(connections, plan, strict=True):
                if slices:
                    nursery.start_soon(sender, connection, slices)
        while self._progress.remaining and self.failure is None:
            await self._lot.park()
        if self.failure is not None:
            raise LocalFailure(self.failure)


class AsyncReduceHandle:
    """A running all-reduce started by ``Communicator.all_reduce_async``.

    ``await handle.wait()`` returns its ``ReduceInfo`` or raises what ``all_reduce``
    would have raised; it may be awaited any number of times. Cancelling a ``wait``
    does not cancel the all-reduce, which goes on in the communicator.
    """

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self._done = trio.Event()
        self._info: ReduceInfo | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, info: ReduceInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._done.set()

    async def wait(self) -> ReduceInfo:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def __repr__(self) -> str:
        state = "running" if not self.done else ("failed" if self._error else "done")
        return f"<AsyncReduceHandle tag={self.tag} {state}>"
