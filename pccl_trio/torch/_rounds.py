"""DiLoCo's outer rounds over a communicator: the hand-written loop, made once for every trainer.

Theory of operation
-------------------
``OuterRounds`` is what happens at the end of a round of inner steps (``boundary``)
and when this peer comes into the run (``join``), written against the async
``pccl_trio.Communicator``; ``DiLoCo`` drives it from a blocking communicator's loop,
``AsyncDiLoCo`` from the trainer's own trio run.

A boundary, on every peer alike, without ``overlap``:

1. the pseudo-gradient of the round just computed (outer minus local parameters);
2. the membership part (``Admission``): the peers waiting to join are admitted and
   the ring re-ordered, the shared state (outer parameters, outer optimizer state,
   revision = outer steps) is synced, and before the run's first outer step, below
   ``min_peers``, it waits for company;
3. the pseudo-gradient is all-reduced (AVG; quantized or Top-k as asked) and the outer
   step taken;
4. the model is set to the outer parameters: the next round starts there.

With ``overlap`` the same steps are cut where the all-reduce would wait, and what
follows it moves off the trainer's path. At the boundary, the trainer's part is short:
it waits for the *landing* of the round before (below; normally done by then),
writes the pseudo-gradient relative to the published outer parameters, publishes the
ones the landing stepped (``OuterModel.publish``), starts the all-reduce and sets the
model to the published parameters. The landing is a task of the communicator's event
loop (a system task of its trio run) that runs while the next round's inner steps
compute: it waits for the all-reduce, takes the outer step into the spare bank
(``OuterModel.advance``; torch's kernels release the GIL, and on a GPU they are
queued, so the trainer's thread goes on meanwhile), and then makes the membership part
for it (admit, order the ring, sync, hold). So the outer update of round t is applied
at the boundary after it (the delayed outer update), and a joiner, admitted by the
landing after the update, receives the state that has it. The trainer's thread waits
only where the network or the run is slower than the inner steps. Between boundaries
the wrapper then uses the communicator: a trainer makes no membership calls of its
own on it. ``hold`` is the one it may ask for between boundaries (every peer at the
same step): it waits for the landing and then admits until the run has the peers
asked for, so a joiner admitted there receives the state the landing stepped.

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
  repeated revision, which moves nothing) and all-reduces again (``Averaging``, which
  also keeps Top-k's residual).
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
from collections.abc import Coroutine
from typing import Any

import torch
import trio

from .._errors import InvalidUsage, Kicked
from .._types import Attribute, QuantizationOptions, SharedState, TopK
from ..peer import AsyncReduceHandle, Communicator
from ._admission import Admission
from ._averaging import Averaging
from ._outer import OuterModel, nonzero
from ._owner import Rejoin

__all__ = ["OuterRounds"]


@dataclasses.dataclass
class _Landing:
    """The part of an overlapped boundary that runs while the next round computes:
    when it is ``done``, its ``error`` (None: it succeeded) and whether a sync in it
    changed this peer's state (``stale``: the round's pseudo-gradient is void)."""

    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: BaseException | None = None
    stale: bool = False


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
        # The round's pseudo-gradient; with overlap the landing has used it up (outer
        # step) before the next boundary writes it again.
        self._vector = outer.new_vector()
        self._landing: _Landing | None = None
        self._admission = Admission(min_peers)
        self._averaging = Averaging(outer, compression, admission=self._admission)
        # Without overlap, after a ``hold``: its sync changed the state; it admitted
        # for the next boundary (whose all-reduce a joiner it admitted meets next).
        self._stale = self._admitted = False
        self._stepped = False  # an outer step was applied with this communicator

    @property
    def shared(self) -> SharedState:
        """The run's shared state as of the last boundary (the published bank)."""
        return self.outer.shared

    async def join(self, comm: Communicator) -> None:
        """This peer's first boundary with a communicator that just connected: no
        pseudo-gradient of its own yet (it contributes zeros)."""
        self._admission.connected()
        self._stepped, self._landing = False, None
        self._stale = self._admitted = False  # a hold's admission was the old communicator's
        self._averaging.reset()
        await self._boundary(comm, own=False)

    async def boundary(self, comm: Communicator) -> None:
        """The end of a round of inner steps (see the module docstring)."""
        await self._boundary(comm, own=True)

    def rejoining(self) -> None:
        """Before ``join`` with a new communicator, after ``Rejoin``: a newcomer."""
        self.outer.shared.revision = 0
        self._landing = None
        self._inner_steps = 0

    async def hold(self, comm: Communicator, peers: int) -> None:
        """Between boundaries, on every peer alike: wait until the run has ``peers``
        peers, admitting those that ask. With overlap, the landing in flight ends first
        and the admission is made for the state it stepped (which a joiner receives)."""
        await self._guarded(self._hold(comm, peers))

    def due(self) -> bool:
        """Count one inner step; whether the round ends with it."""
        self._inner_steps += 1
        if self._inner_steps < self.sync_every:
            return False
        self._inner_steps = 0
        return True

    # --- one boundary -------------------------------------------------------------------

    async def _boundary(self, comm: Communicator, *, own: bool) -> None:
        if self.overlap:
            await self._guarded(self._overlapped(comm, own=own))
        else:
            await self._guarded(self._plain(comm, own=own))

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        """``work``, with a kick after this peer stepped made ``Rejoin``."""
        try:
            await work
        except Kicked:
            if not self._stepped:
                raise
            raise Rejoin from None

    async def _hold(self, comm: Communicator, peers: int) -> None:
        landing = self._landing
        if landing is not None:
            await landing.done.wait()
            if landing.error is not None:
                return  # the next boundary raises it
        # The world after the last admission, the same on every peer: with enough peers
        # there is nothing to do (a joiner a landing admitted meets the next flight).
        if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) >= peers:
            return
        if landing is None:  # without overlap: this admission stands for the next boundary's
            self._stale |= await self._admission.admit_and_sync(comm, self.shared, company=peers)
            self._admitted = True
            return
        landing.stale |= await self._admission.admit_and_sync(
            comm, self.outer.spare_shared, company=peers
        )

    async def _plain(self, comm: Communicator, *, own: bool) -> None:
        vector = self._vector
        if own:
            self.outer.pseudo_gradient(vector)
        changed = self._stale
        if not self._admitted:
            changed |= await self._admission.admit_and_sync(comm, self.shared)
        self._stale = self._admitted = False
        if changed or not own:
            vector.zero_()  # relative to outer parameters the run no longer has
        await self._averaging.reduce(comm, vector)
        if nonzero(vector):  # else only newcomers' zeros (the same bits everywhere)
            self.outer.apply(vector)
            self.shared.revision += 1
            self._stepped = True
        self.outer.load()

    async def _overlapped(self, comm: Communicator, *, own: bool) -> None:
        vector = self._vector
        landing, self._landing = self._landing, None
        stale = not own
        if landing is None:  # the first boundary with this communicator: admit here
            stale |= await self._admission.admit_and_sync(comm, self.shared)
        else:
            await landing.done.wait()
            if landing.error is not None:
                raise landing.error
            stale |= landing.stale
            if not stale:
                self.outer.pseudo_gradient(vector)  # relative to where the round started
            self.outer.publish()
        if stale:
            vector.zero_()  # relative to outer parameters the run no longer has
        handle = self._averaging.start(comm, vector)
        self._landing = _Landing()
        trio.lowlevel.spawn_system_task(self._land, comm, handle, self._landing,
                                        name="pccl_trio DiLoCo landing")
        self.outer.load()

    async def _land(self, comm: Communicator, handle: AsyncReduceHandle,
                    landing: _Landing) -> None:
        """The landing (module docstring), its outcome kept in ``landing`` for the next
        boundary."""
        try:
            landing.stale = await self._settle(comm, handle)
        except Exception as exc:
            landing.error = exc
        except BaseException:  # cancelled: the communicator's event loop ended
            landing.error = InvalidUsage(
                "the communicator's event loop ended while an overlapped outer step was "
                "on its way: the communicator was closed"
            )
            raise
        finally:
            landing.done.set()

    async def _settle(self, comm: Communicator, handle: AsyncReduceHandle) -> bool:
        """Wait for the all-reduce (again after an abort), take its outer step into the
        spare bank and make the membership part for that bank; whether a sync changed
        this peer's state."""
        vector = self._vector
        stale = await self._averaging.finish(comm, handle, vector)
        if self._advance(vector):
            self.outer.spare_shared.revision += 1
            self._stepped = True
        stale |= await self._admission.admit_and_sync(comm, self.outer.spare_shared)
        return stale

    def _advance(self, averaged: torch.Tensor) -> bool:
        """``OuterModel.advance`` with ``averaged`` unless it is zero everywhere;
        whether an outer step was taken."""
        step = nonzero(averaged)
        self.outer.advance(averaged if step else None)
        return step
