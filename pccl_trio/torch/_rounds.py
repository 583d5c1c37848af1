"""DiLoCo's outer rounds over a communicator: the hand-written loop, made once for every trainer.

Theory of operation
-------------------
``OuterRounds`` is what happens at the end of a round of inner steps (``boundary``)
and when this peer comes into the run (``join``), written against the async
``pccl_trio.Communicator``; ``DiLoCo`` drives it from a blocking communicator's loop,
``AsyncDiLoCo`` from the trainer's own trio run.

A boundary, on every peer alike:

1. the pseudo-gradient of the round just computed (outer minus local parameters);
2. with ``overlap``, the all-reduce started at the previous boundary is waited for and
   its average applied (the delayed outer update). A joiner is admitted only after
   it (step 3), so the state it receives has that update too;
3. the membership part (``Admission``): the peers waiting to join are admitted and
   the ring re-ordered, the shared state (outer parameters, outer optimizer state,
   revision = outer steps) is synced, and before the run's first outer step, below
   ``min_peers``, it waits for company;
4. the pseudo-gradient is all-reduced (AVG; quantized or Top-k as asked): at once and
   then applied, or, with ``overlap``, started and left running while the next round's
   inner steps compute;
5. the model is set to the outer parameters (where an outer step did not leave it
   already): the next round starts there.

A peer whose outer parameters changed in its sync (a joiner, a peer that was behind)
holds a pseudo-gradient relative to parameters the run no longer has: it contributes
zeros to this all-reduce. A joiner comes in at a boundary of the run (``connect()``
returns at the end of the members' ``update_topology``), so it takes part in that
boundary's all-reduce with zeros, and is in step with everyone after it. An average
that is zero everywhere (only newcomers took part: the founders of a run) makes no
outer step; every peer sees the same bits, so every peer skips it alike.

Errors, as the hand-written loop (``docs/loop.md``) handles them:

- ``CollectiveAborted`` (a peer died mid all-reduce, the master was lost, a peer's sync
  failed): every peer got the same verdict and its input back; it syncs again (a
  repeated revision, which moves nothing) and all-reduces again.
- ``SharedStateSyncFailed``: sync again.
- ``TooFewPeers`` from the all-reduce: alone, this peer's pseudo-gradient is the
  average. From a membership call, and ``UpdateTopologyFailed`` and
  ``TopologyOptimizationFailed``: step 3 starts over (``Admission``).
- ``Kicked`` after this peer's first outer step: ``Rejoin`` is raised, and the wrapper
  joins again with a new communicator (``Communicator.replacement``) at revision 0, so
  that its first sync takes the run's state. Kicked before that: a mistake to fix
  (mismatched models, a refused identity), raised to the trainer.

Any other error (``MasterConnectionError``: no master within ``Config.master_grace``;
``InvalidUsage``, ``InvalidArgument``) means the run cannot go on for this peer and
reaches the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._errors import CollectiveAborted, Kicked, TooFewPeers
from .._types import QuantizationOptions, ReduceOp, SharedState, TopK
from ..peer import AsyncReduceHandle, Communicator
from ._admission import Admission
from ._outer import OuterModel
from ._owner import Rejoin

__all__ = ["OuterRounds"]


@dataclasses.dataclass
class _Flight:
    """An all-reduce left running across a round (``overlap``)."""

    handle: AsyncReduceHandle
    vector: torch.Tensor


class OuterRounds:
    """The outer rounds of one peer (see the module docstring)."""

    def __init__(
        self, outer: OuterModel, *, sync_every: int,
        compression: QuantizationOptions | TopK | None, overlap: bool, min_peers: int,
    ) -> None:
        self.outer = outer
        self.sync_every = sync_every
        self._inner_steps = 0  # since the last boundary
        self.overlap = overlap
        self._compression = compression
        # With Top-k: what this peer has not sent yet (its own; zero for a newcomer).
        self._residual = outer.new_vector() if isinstance(compression, TopK) else None
        self._vectors = [outer.new_vector(), outer.new_vector()]  # this round's, in flight
        self._flight: _Flight | None = None
        self._admission = Admission(outer.shared, min_peers)
        self._stepped = False  # an outer step was applied with this communicator

    @property
    def shared(self) -> SharedState:
        return self.outer.shared

    async def join(self, comm: Communicator) -> None:
        """This peer's first boundary with a communicator that just connected: no
        pseudo-gradient of its own yet (it contributes zeros)."""
        self._admission.connected()
        self._stepped, self._flight = False, None
        if self._residual is not None:
            self._residual.zero_()
        vector = self._vectors[0]
        vector.zero_()
        await self._boundary(comm, vector, own=False)

    async def boundary(self, comm: Communicator) -> None:
        """The end of a round of inner steps (see the module docstring)."""
        vector = self._spare()
        self.outer.pseudo_gradient(vector)
        await self._boundary(comm, vector, own=True)

    def rejoining(self) -> None:
        """Before ``join`` with a new communicator, after ``Rejoin``: a newcomer."""
        self.outer.shared.revision = 0
        self._flight = None
        self._inner_steps = 0

    def due(self) -> bool:
        """Count one inner step; whether the round ends with it."""
        self._inner_steps += 1
        if self._inner_steps < self.sync_every:
            return False
        self._inner_steps = 0
        return True

    # --- one boundary -------------------------------------------------------------------

    async def _boundary(self, comm: Communicator, vector: torch.Tensor, *, own: bool) -> None:
        try:
            at_outer = False  # the model holds the outer parameters (an outer step left it so)
            if self._flight is not None:
                flight, self._flight = self._flight, None
                at_outer = await self._land(comm, flight)
            changed = await self._admission.admit_and_sync(comm)
            if changed or not own:
                vector.zero_()  # relative to outer parameters the run no longer has
            if self.overlap:
                self._flight = _Flight(
                    comm.all_reduce_async(vector, op=ReduceOp.AVG, **self._options()), vector
                )
                at_outer = at_outer and not changed
            else:
                await self._reduce(comm, vector)
                at_outer = self._step(vector)
            if not at_outer:
                self.outer.load()
        except Kicked:
            if not self._stepped:
                raise
            raise Rejoin from None

    async def _land(self, comm: Communicator, flight: _Flight) -> bool:
        """Wait for the all-reduce in flight, again after an abort; apply it. Whether
        an outer step was taken."""
        try:
            await flight.handle.wait()
        except CollectiveAborted:
            if (await self._admission.sync(comm)).rx_bytes:
                flight.vector.zero_()
            await self._reduce(comm, flight.vector)
        except TooFewPeers:
            pass  # alone: its own pseudo-gradient is the average
        return self._step(flight.vector)

    async def _reduce(self, comm: Communicator, vector: torch.Tensor) -> None:
        """All-reduce ``vector`` in place until it succeeds; after an abort (input
        restored) the state is synced again first."""
        while True:
            try:
                await comm.all_reduce(vector, op=ReduceOp.AVG, **self._options())
                return
            except TooFewPeers:
                return  # alone: its own pseudo-gradient is the average
            except CollectiveAborted:
                if (await self._admission.sync(comm)).rx_bytes:
                    vector.zero_()

    def _step(self, averaged: torch.Tensor) -> bool:
        """The outer step on ``averaged``, unless it is zero everywhere; whether it
        was taken (the model then holds the new outer parameters)."""
        if not bool(averaged.any()):
            return False  # only newcomers' zeros (the same bits everywhere): no outer step
        self.outer.apply(averaged)
        self.outer.shared.revision += 1
        self._stepped = True
        return True

    def _options(self) -> dict[str, Any]:
        compression = self._compression
        if isinstance(compression, TopK):
            return {"compression": dataclasses.replace(compression, residual=self._residual)}
        return {"quantization": compression}

    def _spare(self) -> torch.Tensor:
        """The vector that is not in flight."""
        flying = self._flight.vector if self._flight is not None else None
        return self._vectors[1] if flying is self._vectors[0] else self._vectors[0]
