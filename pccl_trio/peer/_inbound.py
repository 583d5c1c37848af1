"""What arrives at one attempt of a ring collective, and what it does there.

Theory of operation
-------------------
The readers of the connections from the ring's predecessor (``_receiver``) hand
``Inbound`` every data frame of the attempt. Each frame names a position in the
received stream; ``claim`` checks it against the schedule (exactly one slice, not
seen before) and reserves that slice for the reader, which then receives the payload:

* into its own staging buffer, and ``on_slice`` writes the slice into the result
  as its segment says: combined with this peer's input (``reduce``), or copied over
  (a final value), or for a quantized attempt decoded from its block (``_blocks``);
* or, for a final value of an unquantized attempt on host memory, straight into the
  result buffer (``direct_target``, finished by ``on_direct_slice``), which spares a
  copy.

Writers are counted (``writers``, under the ledger's lock): no write starts once the
attempt stopped, and the attempt's ``settle`` waits for the writers that were
already running, so that a restore never races a late write. A reader receiving
straight into the result is in the ledger's ``using`` meanwhile: if the attempt stops,
its connection is cut, so no byte lands after the reader returned.

In place, the input of each slice is kept (``_inputs``) just before the slice's
first write (``Segment.first_write``), so an aborted attempt puts back exactly the
caller's input.

A slice whose segment is forwarded (``Segment.forwarded_by``) is then the outgoing
side's to send: when forwarding is on (``_outbound``), the reader that wrote it sends
it on from its own thread.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from .._core.errors import RemoteProtocolError
from .._core.ring import RingSchedule, Segment
from ..ops import InputBackup, NonFiniteData
from ._blocks import Encoded, refusal
from ._ledger import Cuttable, Ledger
from ._operands import Operands

__all__ = ["Forwarder", "Inbound"]


class Forwarder(typing.Protocol):
    """The outgoing side, as far as the readers are concerned (``_outbound``)."""

    @property
    def forwarding(self) -> bool:
        """Whether readers send on what they wrote (under the ledger's lock)."""
        ...

    def forward(self, send_segment: int, index: int) -> None:
        """Send slice ``index`` of ``send_segment``, which is ready, from this thread."""
        ...


class Inbound:
    """The receiving side of one attempt (see the module docstring).

    Args:
        ledger, schedule, operands: the attempt's.
        backup: where an in-place input is kept (None: not in place).
        encoded: the quantized attempt's blocks (None: unquantized).
        forwarder: the sending side, for forwarding.
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        schedule: RingSchedule,
        operands: Operands,
        backup: InputBackup | None,
        encoded: Encoded | None,
        forwarder: Forwarder,
    ) -> None:
        self._ledger = ledger
        self._schedule = schedule
        self._operands = operands
        self._backup = backup
        self._encoded = encoded
        self._forwarder = forwarder
        # Which slices a reader took on, per received segment (under the lock).
        self._claimed = [bytearray(n) for n in schedule.recv_slices]
        # Readers and reductions writing into the result buffer right now.
        self.writers = 0

    def payload_size(self, nbytes: int) -> int:
        """Bytes on the wire for a slice of ``nbytes`` in the buffer."""
        return nbytes if self._encoded is None else self._encoded.payload_size(nbytes)

    def claim(self, tag: int, stream_offset: int, nbytes: int) -> tuple[Segment, int]:
        """The segment and slice a frame carries, checked against this attempt and
        reserved for the calling reader.

        Raises:
            RemoteProtocolError: wrong tag, not a slice of the stream, or a repeat.
        """
        ledger = self._ledger
        if tag != ledger.tag:
            raise RemoteProtocolError(
                f"data frame for attempt {ledger.seq} carries tag {tag}, not {ledger.tag}"
            )
        segment, index = self._schedule.locate(
            stream_offset, nbytes, None if self._encoded is None else self.payload_size
        )
        with ledger.lock:
            claimed = self._claimed[segment.index]
            if claimed[index]:
                raise RemoteProtocolError(
                    f"slice {index} of segment {segment.index} arrived twice"
                )
            claimed[index] = 1
        return segment, index

    def on_slice(self, segment: Segment, index: int, payload: Any) -> None:
        """Write a claimed slice (``payload``: a uint8 array view, in host memory);
        dropped if the attempt is over."""
        with self._ledger.lock:
            if not self._ledger.live:
                return  # an aborted attempt: drop, never write
            self.writers += 1
        written = False
        try:
            start, stop = self._schedule.slice_range(segment, index)
            self._write(segment, index, start, stop, payload)
            written = True
        except NonFiniteData as exc:
            self._ledger.reject(refusal(exc))
        finally:
            self._end_write(segment, index, written)

    def direct_target(self, segment: Segment, index: int, reader: Cuttable) -> memoryview | None:
        """Where a claimed slice of a final value may be received in place, or None
        (use staging and ``on_slice``).

        A final value can go straight into the result buffer. While the payload
        arrives ``reader`` writes into that buffer; if the attempt stops meanwhile, its
        connection is cut, so no byte lands once the reader has returned. Finish with
        ``on_direct_slice``, whether the receive worked or not.
        """
        if segment.reduce or self._operands.xp is not np or self._encoded is not None:
            return None
        start, stop = self._schedule.slice_range(segment, index)
        with self._ledger.lock:
            if not self._ledger.live:
                return None
            self.writers += 1
            self._ledger.use(reader)
        try:
            self._keep(segment, start, stop)
        except BaseException:
            self.on_direct_slice(segment, index, reader, False)
            raise
        return memoryview(self._operands.result_bytes[start:stop])

    def on_direct_slice(self, segment: Segment, index: int, reader: Cuttable, received: bool) -> None:
        """The receive that ``direct_target`` allowed is over."""
        self._end_write(segment, index, received, reader=reader)

    def _end_write(
        self, segment: Segment, index: int, written: bool, *, reader: Cuttable | None = None
    ) -> None:
        ledger = self._ledger
        with ledger.lock:
            if reader is not None:
                ledger.unuse(reader)
            self.writers -= 1
            if written:
                start, stop = self._schedule.slice_range(segment, index)
                ledger.received(segment.index, index, self.payload_size(stop - start))
            complete = ledger.complete
            telling = ledger.teller() if complete else None
            # The trio thread waits for the completion, and after a stop for the last
            # writer (``settle``).
            ledger.wake(trio_too=complete and telling is None or not self.writers and not ledger.live)
            forward = written and segment.forwarded_by is not None and self._forwarder.forwarding
        if telling is not None and written:
            telling.tell()
        if forward:
            assert segment.forwarded_by is not None
            self._forwarder.forward(segment.forwarded_by, index)

    def _keep(self, segment: Segment, start: int, stop: int) -> None:
        """In place: keep the caller's input of a slice about to be first written."""
        if self._backup is not None and segment.first_write:
            self._backup.keep(start, stop)

    def _write(self, segment: Segment, index: int, start: int, stop: int, payload: Any) -> None:
        """Write a received slice as its segment says (see the module docstring)."""
        staging = self._operands.staging
        encoded = self._encoded
        with staging.working():
            if encoded is None:
                incoming = staging.to_device(payload)
                self._keep(segment, start, stop)
                self._operands.write(segment, start, stop, incoming, self._schedule.world)
                return
            # Blocks stay in host memory: the codec copies only the codes across, and
            # decodes where the buffers are.
            self._keep(segment, start, stop)
            encoded.decode(segment, index, start, stop, payload)
        encoded.keep(segment, index, payload)
