"""Top-k all-reduces (``compression=TopK``): the selection before the vote, the gather
of every peer's selection on the ring, and the dense sum and the residual after.

Theory of operation
-------------------
A Top-k all-reduce is a collective of its own kind (``CollectiveKind.TOPK_ALL_REDUCE``):
its vote describes the dense call (count, dtype, op) and the compression (entries kept
of every chunk, the values' quantization), so peers that would sum differently are
refused, naming each one's call. Its data path is the ring's all-gather of equal parts
(``RingSchedule.all_gather``): every peer's selection has the same size
(``ops.TopKLayout.payload_bytes``), known before the vote, so it may run under a lease
like any all-reduce.

``TopKCall`` carries one call through:

1. ``select`` (before the attempt is made; off the event loop for host memory): what
   this peer sends of ``input + residual`` (``ops.topk_select``); nothing of the caller's is
   written. A retry after an abort sends the same selection: the inputs are unchanged.
2. The attempt gathers the selections into a buffer of its own (reused from call to
   call, ``ops.Recycled``), this peer's part sent straight from its selection.
3. ``conclude``, once the verdict is a success (in the task that runs the call, before
   its result is set, so a cancelled caller that came too late finds the buffers
   final): the dense sum of every selection in ascending peer-id order into the
   result (``ops.topk_sum``), and what this peer did not send into the residual
   (``ops.topk_feed_back``). On any other outcome neither is written: the caller's
   input and residual hold what they held.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._types import QuantizationOptions, ReduceOp
from ..ops import Array, ArrayModule, Selection, TopKLayout, topk_feed_back, topk_select, topk_sum
from ..transport import run_off_loop

__all__ = ["TopKCall"]


class TopKCall:
    """One Top-k all-reduce's own state (see the module docstring).

    Args:
        xp: the buffers' array module; layout: the call's (``ops.TopKLayout``).
        send: the input (flat); out: where the dense result goes (``send`` in place);
        residual: the caller's residual (flat, like ``send``).
        op: SUM or AVG; values: how kept values travel (the vote names it).
    """

    def __init__(
        self, xp: ArrayModule, layout: TopKLayout, *, send: Array, out: Array, residual: Array,
        op: ReduceOp, values: QuantizationOptions | None,
    ) -> None:
        self.xp = xp
        self.layout = layout
        self.values = values
        self._send = send
        self._out = out
        self._residual = residual
        self._op = op
        self.selection: Selection | None = None

    async def select(self) -> None:
        """Choose what this peer sends (once per call; retries reuse it)."""
        if self.selection is None:
            self.selection = await self._run(
                lambda: topk_select(self.xp, self.layout, self._send, self._residual)
            )

    @property
    def invalid(self) -> str | None:
        """Why the selection cannot travel (non-finite values to quantize), or None."""
        return self.selection.invalid if self.selection is not None else None

    async def conclude(self, parts: dict[int, tuple[int, int]], gathered: Array, me: int) -> None:
        """The call succeeded: the dense sum of every selection (``parts``: each peer's
        offset and size in ``gathered``; this peer's ``me`` is its own selection) into
        the result, and the residual fed back."""
        selection = self.selection
        assert selection is not None
        payloads = [
            selection.payload if peer_id == me else gathered[start:start + size]
            for peer_id, (start, size) in sorted(parts.items())
        ]

        def write() -> None:
            topk_sum(self.xp, self.layout, payloads, op=self._op, out=self._out)
            topk_feed_back(self.xp, self.layout, selection, self._residual)

        await self._run(write)

    async def _run(self, work: Any) -> Any:
        """``work()`` off the event loop for host memory (a selection of a large vector
        takes a while; ``run_off_loop``: inline under a virtual clock), inline for
        device memory, whose kernels queue on the current stream."""
        if self.xp is not np:
            return work()
        return await run_off_loop(work)
