"""The average of DiLoCo's pseudo-gradients over the run, all-reduced until it succeeds.

Theory of operation
-------------------
At a boundary every peer all-reduces one vector (its pseudo-gradient, flattened; see
``_outer``) with ``ReduceOp.AVG``, exact, quantized or Top-k as the trainer asked.
``Averaging`` makes that all-reduce and carries it to a result, on every peer alike:

- ``TooFewPeers``: this peer is alone, its own vector is the average (left as it is).
- ``CollectiveAborted`` (a peer died mid all-reduce, the master was lost, a peer's
  sync failed): every peer got the same verdict and its input back, so each syncs the
  published shared state again (a repeated revision, which moves nothing for a peer in
  step) and all-reduces again, until it succeeds. A peer whose state that sync changed
  was behind: its vector is relative to outer parameters the run no longer has, so it
  contributes zeros, and the caller learns it (``True``) to treat the round as void.

With Top-k the residual (error feedback: what this peer selected for no all-reduce
yet) is this peer's own and lives here, one per peer for the whole run; a peer that
comes in anew (``reset``) starts from zeros, as a newcomer's residual is.

The all-reduce can be awaited at once (``reduce``) or started now and carried to its
result later (``start``, then ``finish``): the latter is how an overlapped boundary
leaves it in flight while the next round computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import torch

from .._errors import CollectiveAborted, TooFewPeers
from .._types import QuantizationOptions, ReduceOp, TopK
from ..peer import AsyncReduceHandle, Communicator
from ._admission import Admission
from ._outer import OuterModel

__all__ = ["Averaging"]


class Averaging:
    """The pseudo-gradient's all-reduce of one peer (see the module docstring), for
    the vectors of ``outer``, with ``compression`` (None: exact), syncing its published
    state with ``admission`` after an abort."""

    def __init__(self, outer: OuterModel, compression: QuantizationOptions | TopK | None,
                 *, admission: Admission) -> None:
        self._outer = outer
        self._compression = compression
        self._admission = admission
        # With Top-k: what this peer has not sent yet (its own; zero for a newcomer).
        self._residual = outer.new_vector() if isinstance(compression, TopK) else None

    def reset(self) -> None:
        """This peer comes into the run anew: nothing is owed from before."""
        if self._residual is not None:
            self._residual.zero_()

    async def reduce(self, comm: Communicator, vector: torch.Tensor) -> bool:
        """All-reduce ``vector`` in place until it succeeds; whether a sync after an
        abort changed this peer's state."""
        return await self._carried(comm, vector, partial(self._all_reduce, comm, vector))

    def start(self, comm: Communicator, vector: torch.Tensor) -> AsyncReduceHandle:
        """Start the all-reduce of ``vector`` in place; ``finish`` carries it through."""
        return comm.all_reduce_async(vector, op=ReduceOp.AVG, **self._options())

    async def finish(self, comm: Communicator, handle: AsyncReduceHandle,
                     vector: torch.Tensor) -> bool:
        """Wait for ``handle`` (``start``'s, of ``vector``), again after an abort,
        until it succeeds; as ``reduce``."""
        return await self._carried(comm, vector, handle.wait)

    async def _carried(self, comm: Communicator, vector: torch.Tensor,
                       first: Callable[[], Awaitable[object]]) -> bool:
        """Await ``first`` (the all-reduce of ``vector``); after an abort (input
        restored), sync the published state again (a peer that was behind then
        contributes zeros) and all-reduce again, until it succeeds. Whether a sync
        changed this peer's state."""
        attempt, changed = first, False
        while True:
            try:
                await attempt()
                return changed
            except TooFewPeers:
                return changed  # alone: its own pseudo-gradient is the average
            except CollectiveAborted:
                pass
            if (await self._admission.sync(comm, self._outer.shared)).rx_bytes:
                vector.zero_()
                changed = True
            attempt = partial(self._all_reduce, comm, vector)

    async def _all_reduce(self, comm: Communicator, vector: torch.Tensor) -> None:
        await comm.all_reduce(vector, op=ReduceOp.AVG, **self._options())

    def _options(self) -> dict[str, Any]:
        compression = self._compression
        if isinstance(compression, TopK):
            return {"compression": dataclasses.replace(compression, residual=self._residual)}
        return {"quantization": compression}
