"""The encoded blocks a quantized all-reduce attempt keeps to forward.

Theory of operation
-------------------
Quantized, every slice travels as one encoded block (``ops.Codec``). In the all-gather
a peer forwards the blocks it received byte for byte, and sends its own chunk's block,
encoded once, first: so every peer decodes the same bytes. ``BlockStore`` holds those
blocks for one attempt, in send order (the owner's own block first, then the ones it
forwards), in one buffer taken from the host pool for the attempt's life: block
``index`` of an all-gather send segment starts at the segment's offset plus ``index``
full blocks (every slice but a segment's last is ``slice_bytes`` long).
"""

from __future__ import annotations

from typing import Any

from .._core.ring import RingSchedule
from ..ops import Codec
from ._staging import BufferPool

__all__ = ["BlockStore"]


class BlockStore:
    """The all-gather blocks of one quantized attempt (see the module docstring)."""

    def __init__(
        self, codec: Codec, schedule: RingSchedule, itemsize: int, pool: BufferPool
    ) -> None:
        self._codec = codec
        self._schedule = schedule
        self._itemsize = itemsize
        self._pool = pool
        self._starts: dict[int, int] = {}
        total = 0
        for segment in schedule.send[schedule.world - 1:]:
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
        """The stored block of slice ``index`` of all-gather send segment ``send_segment``."""
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
