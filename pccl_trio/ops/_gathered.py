"""A fused bucket's input, read where its tensors lie.

Theory of operation
-------------------
A bucket of several tensors is one all-reduce over their concatenation. Its result
needs a buffer of its own (the tensors are written only once the bucket succeeded,
``_fusion``), but its input does not: the ring reads a peer's input in two places
only, and both can read the tensors themselves.

* The reduce-scatter combines a received slice with the same bytes of the input,
  ``result = input OP received``. ``combine`` does that piece by piece, one ufunc call
  per tensor the slice overlaps, with the same operands in the same order as one call
  over a packed copy would: the same values. (Only where both operands are NaN may
  the payload of the NaN kept differ, as it already did with where slices end:
  numpy's vector and tail loops keep different ones. Peers still agree: a chunk is
  combined at one peer and its bytes copied to the others.) When the slice covers
  many small tensors, whose calls would cost more than their bytes, it copies them
  into the result first (one call) and combines there (one call), the same operands
  again.
* Segment 0 of the send stream is this peer's own chunk of the input, sent as it is.
  Sending wants one contiguous buffer, so ``gather`` copies that chunk into the
  result buffer at its own offsets before the first byte leaves. Nothing else
  writes there until the all-gather brings the chunk's final value, which depends on
  this peer's chunk having arrived at the next peer, so the bytes were sent by then.

Once the bucket succeeded, ``scatter`` copies its result into the members (the
tensors, as the caller passed them: in place).

Packing the whole bucket would copy every byte once more before the ring could start:
on a two-core host that pass over memory was about a quarter of a fused step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._types import ReduceOp
from ._kernels import combine_parts, reduce_into

__all__ = ["Gathered"]

#: Below this many bytes per tensor on average, a range's tensors are combined by
#: copying them into place first (one call) and combining once: a call per tensor
#: costs microseconds, as much as copying tens of kilobytes.
SMALL_PIECES = 64 << 10


class Gathered:
    """The concatenation of ``members`` (flat host arrays of one dtype), unpacked.

    Offsets are bytes of the concatenation (the layout of the bucket's result buffer).
    """

    def __init__(self, members: Sequence[np.ndarray]) -> None:
        if not members:
            raise ValueError("a gathered input needs at least one member")
        self.dtype: np.dtype[Any] = members[0].dtype
        self.itemsize = int(self.dtype.itemsize)
        self.members = tuple(members)
        starts, size = [], 0
        for member in self.members:
            if member.dtype != self.dtype or member.ndim != 1:
                raise ValueError("gathered members must be flat arrays of one dtype")
            starts.append(size)
            size += int(member.size)
        self._starts = starts  # element offsets of the members
        self.size = size

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def _pieces(self, first: int, last: int) -> list[tuple[np.ndarray, int, int]]:
        """``(member part, a, b)`` covering elements ``[first, last)`` of the input,
        ``[a, b)`` counted from ``first``."""
        pieces = []
        members, starts = self.members, self._starts
        index = bisect.bisect_right(starts, first) - 1
        at = first
        while at < last:
            member, offset = members[index], starts[index]
            end = min(last, offset + int(member.size))
            whole = at == offset and end - offset == member.size
            pieces.append((member if whole else member[at - offset:end - offset], at - first, end - first))
            at = end
            index += 1
        return pieces

    def _elements(self, start: int, stop: int) -> tuple[int, int]:
        if start % self.itemsize or stop % self.itemsize or not 0 <= start <= stop <= self.nbytes:
            raise ValueError(f"bytes [{start}, {stop}) are not whole elements of the input")
        return start // self.itemsize, stop // self.itemsize

    def gather(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy bytes ``[start, stop)`` of the input to the same bytes of ``out`` (a
        uint8 array as long as the input)."""
        first, last = self._elements(start, stop)
        if last > first:
            parts = [part for part, _, _ in self._pieces(first, last)]
            np.concatenate(parts, out=out[start:stop].view(self.dtype))

    def scatter(self, source: np.ndarray) -> None:
        """Copy ``source`` (an array of the input's dtype and size) into the members."""
        for member, start in zip(self.members, self._starts, strict=True):
            # Item assignment of equal dtypes: a plain copy, cheaper to call than copyto.
            member[...] = source[start:start + member.size]

    def combine(self, target: np.ndarray, incoming: np.ndarray, start: int, op: ReduceOp) -> None:
        """``target = input[start:...] OP incoming`` elementwise, ``target`` and
        ``incoming`` being arrays of the input's dtype and ``start`` a byte offset:
        ``ops.combine_into``'s operands in its order, in parts (see the module docstring)."""
        first, last = self._elements(start, start + int(target.size) * self.itemsize)
        pieces = self._pieces(first, last)
        if len(pieces) > 1 and target.nbytes < len(pieces) * SMALL_PIECES:
            # Many small tensors: copy them into place, then combine in one call
            # (``reduce_into`` takes the local operand first, as ``combine_into`` does).
            np.concatenate([part for part, _, _ in pieces], out=target)
            reduce_into(np, target, incoming, op)
        else:
            combine_parts(np, target, pieces, incoming, op)
