"""Where one attempt of a ring collective reads its input and writes its result.

Theory of operation
-------------------
A collective reads this peer's input in two places: the slices it sends of its own
(a send segment that forwards nothing, see ``RingSchedule``), and the local operand
of each combination, ``result = input OP received``. It writes only the result.
``Operands`` holds the three forms an input takes and reads each the one right way:

* in place (``send is result``): the input is the result buffer. Each chunk is
  combined at this peer at most once, so its bytes are still the input when they
  are combined (``reduce_into``);
* into a separate result: the local operand comes from the send buffer
  (``combine_into``: one pass, no copy);
* a fused bucket's tensors (``Gathered``, host memory, unquantized): combined where
  the tensors lie; the slices of its own that this peer sends are first gathered
  into the result buffer at their own offsets (``gather_own``), so they leave from
  there;
* an all-gather's part (``own_start``): the input holds this peer's part only, which
  lies at ``own_start`` in the result; nothing is combined.

Buffers are flat arrays of the staging's array module (numpy, or cupy on a GPU), and
offsets are bytes of the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.ring import Segment
from .._types import ReduceOp
from ..ops import Gathered, Staging, combine_into, copy_into, finalize_average, reduce_into

__all__ = ["Operands"]


class Operands:
    """One attempt's input and result (see the module docstring).

    Args:
        staging: where its buffers live (its ``xp`` is their array module).
        send: the caller's input, a flat array, or a fused bucket's ``Gathered``
            members (not in place, unquantized, host memory).
        result: where the result goes (``send`` itself for in place).
        op: the reduction.
        own_start: an all-gather's: the byte offset in ``result`` of this peer's part,
            which ``send`` holds alone.
    """

    def __init__(
        self, *, staging: Staging, send: Any, result: Any, op: ReduceOp, own_start: int = 0
    ) -> None:
        self.staging = staging
        self.xp = staging.xp
        self.op = op
        self.result = result
        self.dtype = result.dtype
        self.itemsize = int(result.dtype.itemsize)
        self.in_place = send is result
        self.result_bytes = result.view(np.uint8)
        self.gathered = send if isinstance(send, Gathered) else None
        assert self.gathered is None or self.xp is np
        # A gathered input sends its own slices from the result (``gather_own``).
        self.input_bytes = self.result_bytes if self.gathered is not None else send.view(np.uint8)
        self.own_start = own_start

    def source(self, segment: Segment, start: int, stop: int) -> Any:
        """The bytes ``[start, stop)`` that send segment ``segment`` sends: this peer's
        input, or what it received there and forwards."""
        if segment.forwards is not None:
            return self.result_bytes[start:stop]
        return self.input_bytes[start - self.own_start:stop - self.own_start]

    def target(self, start: int, stop: int) -> Any:
        """The result's elements at bytes ``[start, stop)``."""
        return self.result_bytes[start:stop].view(self.dtype)

    def local(self, start: int, stop: int) -> Any:
        """The input's elements at bytes ``[start, stop)``, for a combination (not of a
        gathered input)."""
        assert self.gathered is None
        return (self.result_bytes if self.in_place else self.input_bytes)[start:stop].view(self.dtype)

    def gather_own(self, segment: Segment) -> None:
        """A gathered input: copy the chunk that send segment ``segment`` sends of this
        peer's input into the result, before any byte of it leaves."""
        if self.gathered is not None:
            self.gathered.gather(self.result_bytes, segment.start, segment.start + segment.nbytes)

    def write(self, segment: Segment, start: int, stop: int, incoming: Any, world: int) -> None:
        """Combine (``segment.reduce``) or copy the received ``incoming`` (a uint8
        array of the buffers' module) into the result at bytes ``[start, stop)``; a
        completing segment's average is divided by ``world`` here."""
        target = self.target(start, stop)
        incoming = incoming.view(self.dtype)
        if not segment.reduce:
            copy_into(self.xp, target, incoming)
            return
        if self.in_place:
            reduce_into(self.xp, target, incoming, self.op)
        elif self.gathered is not None:
            self.gathered.combine(target, incoming, start, self.op)
        else:
            combine_into(self.xp, target, self.local(start, stop), incoming, self.op)
        if segment.completes:
            self.finalize(target, world)

    def finalize(self, target: Any, world: int) -> None:
        """The final value of a chunk's elements ``target``: an average is divided."""
        if self.op is ReduceOp.AVG:
            finalize_average(self.xp, target, world)
