"""``DiLoCo`` and ``AsyncDiLoCo``: a torch training loop's outer steps, owned.

Theory of operation
-------------------
The trainer keeps its loop: forward, backward, ``optimizer.step()``, and then
``diloco.step()``. Every ``sync_every`` calls, ``step`` runs an outer round's boundary
(``OuterRounds``: admit, sync, all-reduce the pseudo-gradient, outer step), which
handles every error of a run that can go on; what reaches the trainer means it cannot
(``MasterConnectionError``, a kick before the first outer step, bad arguments).

Both classes own their communicator (``_owner``): ``join`` (also the start of a ``with`` block, or
the first ``step``) connects it when it is new and makes this peer's first boundary,
``close`` leaves the run. A peer kicked after it stepped joins again by itself: the
kicked communicator is closed and ``replacement()`` gives a new one with the same
arguments; ``communicator`` is always the current one.

``DiLoCo`` takes a ``pccl_trio.sync.Communicator`` and runs each boundary in that
communicator's event loop (``call_in_loop``), so the outer step's torch work runs on
the loop's thread while the trainer's thread waits; with ``overlap`` the all-reduce
in flight goes on in that loop while the trainer's thread computes. ``AsyncDiLoCo``
takes a ``pccl_trio.Communicator`` and runs the boundary in the trainer's own task;
with ``overlap`` the inner steps should run off the event loop
(``trio.to_thread.run_sync``) for the all-reduce in flight to make progress meanwhile.
"""

from __future__ import annotations

import torch
from torch import nn

from .._errors import InvalidArgument
from .._types import QuantizationOptions, TopK
from ..peer import Communicator as AsyncCommunicator
from ..sync import Communicator as BlockingCommunicator
from ._admission import check_peers
from ._outer import OuterModel
from ._owner import AsyncWrapper, BlockingWrapper
from ._rounds import OuterRounds

__all__ = ["AsyncDiLoCo", "DiLoCo"]


def _rounds(
    model: nn.Module, inner_optimizer: torch.optim.Optimizer,
    outer_optimizer: torch.optim.Optimizer | None, sync_every: int,
    compression: QuantizationOptions | TopK | None, overlap: bool, min_peers: int,
) -> OuterRounds:
    """The outer rounds, from the arguments both classes check alike."""
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise InvalidArgument(
            f"inner_optimizer must be a torch.optim.Optimizer, not {type(inner_optimizer).__name__}"
        )
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise InvalidArgument(f"sync_every must be a positive int, not {sync_every!r}")
    check_peers(min_peers, "min_peers")
    if compression is not None and not isinstance(compression, (QuantizationOptions, TopK)):
        raise InvalidArgument(
            "compression must be None, a pccl_trio.QuantizationOptions or a "
            f"pccl_trio.TopK, not {type(compression).__name__}"
        )
    if isinstance(compression, TopK) and compression.residual is not None:
        raise InvalidArgument(
            "compression=TopK(..., residual=None): DiLoCo keeps the residual itself"
        )
    if outer_optimizer is inner_optimizer:
        raise InvalidArgument("the outer optimizer must not be the inner one")
    return OuterRounds(
        OuterModel(model, outer_optimizer, delayed=overlap), sync_every=sync_every,
        compression=compression,
        overlap=overlap, min_peers=min_peers,
    )


class DiLoCo(BlockingWrapper[OuterRounds]):
    """DiLoCo for a synchronous torch loop, over a ``pccl_trio.sync.Communicator``.

    Call ``step()`` after each inner ``optimizer.step()``. Every ``sync_every`` steps
    the peers average their pseudo-gradients (outer minus local parameters) and take
    an outer step with ``outer_optimizer`` (below), after which the model holds the
    new outer parameters, the same bits on every peer. The outer parameters and the outer
    optimizer's state are the run's shared state: a joiner receives them.

    Args:
        model: its trainable parameters are trained; on one device, floating point.
        inner_optimizer: the trainer's optimizer over the model's parameters (its
            state stays this peer's own).
        communicator: a new (or just connected) ``pccl_trio.sync.Communicator``;
            owned from here on (``close()`` closes it).
        outer_optimizer: a torch optimizer over ``model.parameters()``; by default SGD
            at lr 0.7 with Nesterov momentum 0.9, and with ``overlap`` plain SGD at lr
            0.7 (momentum on an update applied a round late diverged).
        sync_every: inner steps per round.
        compression: how the pseudo-gradient travels: None (as it is), a
            ``QuantizationOptions`` (e.g. uint8 min-max), or ``TopK(fraction,
            residual=None, ...)``, whose residual (error feedback) DiLoCo keeps.
        overlap: the all-reduce of a round runs while the next round's inner steps
            compute, and its average is applied one round late; the outer step, the
            admissions and the sync that follow it run then too (``hold`` is then
            the way to wait for peers: make no membership calls of your own on the
            communicator). It keeps a second copy of the outer parameters and the
            outer optimizer's state.
        min_peers: below this many peers in the run, a boundary waits for company.

    Raises:
        InvalidArgument: an argument is wrong.
    """

    def __init__(
        self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
        communicator: BlockingCommunicator, outer_optimizer: torch.optim.Optimizer | None = None,
        sync_every: int, compression: QuantizationOptions | TopK | None = None,
        overlap: bool = False, min_peers: int = 1,
    ) -> None:
        super().__init__(communicator, lambda: _rounds(
            model, inner_optimizer, outer_optimizer, sync_every, compression, overlap,
            min_peers,
        ), name="DiLoCo", twin="AsyncDiLoCo")

    @property
    def outer_steps(self) -> int:
        """The run's count of outer steps done (the shared state's revision): the same
        on every peer after each boundary."""
        return self._rounds.shared.revision

    def step(self) -> None:
        """Count one inner step; at the end of a round, the outer round (blocks)."""
        if not self._owner.joined:
            self.join()
            return
        if self._rounds.due():
            self._owner.run(self._rounds.boundary)


class AsyncDiLoCo(AsyncWrapper[OuterRounds]):
    """``DiLoCo`` for a trainer that runs in trio, over a ``pccl_trio.Communicator``:
    the same arguments, with ``await diloco.join()``, ``await diloco.step()``,
    ``await diloco.aclose()`` and ``async with``. With ``overlap``, compute the inner
    steps off the event loop (``trio.to_thread.run_sync``) so that the all-reduce in
    flight makes progress meanwhile.
    """

    def __init__(
        self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
        communicator: AsyncCommunicator, outer_optimizer: torch.optim.Optimizer | None = None,
        sync_every: int, compression: QuantizationOptions | TopK | None = None,
        overlap: bool = False, min_peers: int = 1,
    ) -> None:
        super().__init__(communicator, lambda: _rounds(
            model, inner_optimizer, outer_optimizer, sync_every, compression, overlap,
            min_peers,
        ), name="AsyncDiLoCo", twin="DiLoCo")

    @property
    def outer_steps(self) -> int:
        """As ``DiLoCo.outer_steps``."""
        return self._rounds.shared.revision

    async def step(self) -> None:
        """As ``DiLoCo.step``."""
        if not self._owner.joined:
            await self.join()
            return
        if self._rounds.due():
            await self._owner.run(self._rounds.boundary)
