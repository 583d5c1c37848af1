"""A quantized attempt's slices: encoded blocks on the wire, and the ones it keeps.

Theory of operation
-------------------
Quantized (with an ``ops.Codec``), every slice travels as one encoded block, and
``Encoded`` is the part of an attempt that makes and reads them:

* A slice of a partial result (a send segment that ``reduce``s) is encoded afresh
  from where it lies, when it is sent; only the codes cross to the host. The
  receiver decodes it and combines it with its own values.
* The segment that ``completes`` a chunk makes its final value once, at its owner:
  the owner encodes that value and adopts what decoding the block gives, so it holds
  exactly what every other peer will decode.
* A final value (a segment that does not reduce) is forwarded byte for byte: the
  receiver decodes the block it got and keeps the block to send on. So every peer
  decodes the same bytes and ends with the same bits.

``BlockStore`` holds the blocks a peer sends of final values, in send order (the
owner's own block first, then the ones it forwards), in one buffer taken from the
host pool for the attempt's life: block ``index`` of such a send segment starts at
the segment's offset plus ``index`` full blocks (every slice but a segment's last is
``slice_bytes`` long).
"""

from __future__ import annotations

from typing import Any

from .._core.ring import RingSchedule, Segment
from ..ops import BufferPool, Codec, NonFiniteData, Sender
from ._ledger import Ledger
from ._operands import Operands

__all__ = ["BlockStore", "Encoded", "refusal"]


def refusal(error: NonFiniteData) -> str:
    """Why this peer's data cannot be quantized, as the collective's error says it."""
    return (
        f"quantization needs finite values, and the data at this peer holds NaN or "
        f"inf (in its input, or in partial results that overflowed): {error}"
    )


class BlockStore:
    """The blocks of final values one quantized attempt sends (see the module
    docstring)."""

    def __init__(self, codec: Codec, schedule: RingSchedule, pool: BufferPool) -> None:
        self._codec = codec
        self._schedule = schedule
        self._itemsize = schedule.itemsize
        self._pool = pool
        self._starts: dict[int, int] = {}
        total = 0
        for segment in schedule.send:
            if segment.reduce:
                continue
            self._starts[segment.index] = total
            total += sum(
                self.payload_size(b - a)
                for a, b in (schedule.slice_range(segment, i)
                             for i in range(schedule.slice_count(segment)))
            )
        self._blocks: Any = pool.take(total)

    def payload_size(self, nbytes: int) -> int:
        """Bytes on the wire for a slice of ``nbytes`` in the buffer."""
        return self._codec.block_bytes(nbytes // self._itemsize)

    def block(self, send_segment: int, index: int) -> Any:
        """The stored block of slice ``index`` of send segment ``send_segment`` (one
        that sends a final value)."""
        segment = self._schedule.send[send_segment]
        first = self.payload_size(self._schedule.slice_bytes)
        start = self._starts[send_segment] + index * first
        a, b = self._schedule.slice_range(segment, index)
        return self._blocks[start:start + self.payload_size(b - a)]

    def release(self) -> None:
        """Give the buffer back to the pool (once; the attempt is over)."""
        if self._blocks is not None:
            self._pool.give(self._blocks)
            self._blocks = None


class Encoded:
    """How one quantized attempt encodes what it sends and decodes what it receives
    (see the module docstring).

    Args:
        codec: the blocks' encoding.
        schedule, operands, ledger: the attempt's (the ledger counts clamped values).
    """

    def __init__(
        self, *, codec: Codec, schedule: RingSchedule, operands: Operands, ledger: Ledger
    ) -> None:
        self._codec = codec
        self._schedule = schedule
        self._operands = operands
        self._ledger = ledger
        self._store = BlockStore(codec, schedule, operands.staging.host_pool)

    def payload_size(self, nbytes: int) -> int:
        """Bytes on the wire for a slice of ``nbytes`` in the buffer."""
        return self._store.payload_size(nbytes)

    def scratch(self) -> Any:
        """Host room for one outgoing block encoded afresh."""
        return self._operands.staging.host_empty(self.payload_size(self._schedule.slice_bytes))

    def frame(self, segment: Segment, index: int, sender: Sender, scratch: Any) -> memoryview:
        """The block that carries slice ``index`` of send segment ``segment``
        (``scratch``: from ``scratch``, for a partial result).

        Raises:
            NonFiniteData: a partial result holds NaN or inf.
        """
        if not segment.reduce:
            return memoryview(self._store.block(segment.index, index))
        start, stop = self._schedule.slice_range(segment, index)
        source = self._operands.source(segment, start, stop)
        block = scratch[:self.payload_size(source.size)]
        with sender.working():
            clamped = self._codec.encode(source.view(self._operands.dtype), block)
        self._ledger.count_clamped(clamped)
        return memoryview(block)

    def decode(self, segment: Segment, index: int, start: int, stop: int, block: Any) -> None:
        """Decode the received ``block`` of slice ``index`` of ``segment`` (bytes
        ``[start, stop)`` of the buffer) and combine it in, or copy it; in the staging's
        ``working`` context.

        Raises:
            RemoteProtocolError: the block is malformed.
            NonFiniteData: the chunk's final value holds NaN or inf.
        """
        operands = self._operands
        target = operands.target(start, stop)
        if not segment.reduce:
            self._codec.decode(block, target)
            return
        self._codec.decode_combine(block, target, operands.local(start, stop), operands.op)
        if segment.completes:
            operands.finalize(target, self._schedule.world)
            if segment.forwarded_by is not None:
                # The owner's block, encoded once: what every peer decodes.
                own = self._store.block(segment.forwarded_by, index)
                self._ledger.count_clamped(self._codec.encode_own(target, own))

    def keep(self, segment: Segment, index: int, block: Any) -> None:
        """Keep a final value's received block to forward it byte for byte."""
        if not segment.reduce and segment.forwarded_by is not None:
            self._store.block(segment.forwarded_by, index)[:] = block

    def release(self) -> None:
        """Return pooled memory; the attempt is over."""
        self._store.release()
