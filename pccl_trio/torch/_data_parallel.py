"""``DataParallel`` and ``AsyncDataParallel``: a torch training loop's gradients, averaged.

Theory of operation
-------------------
The trainer keeps its loop: ``optimizer.zero_grad()``, forward, ``loss.backward()``,
and then ``dp.step()`` in place of ``optimizer.step()``. The wrapper registers a hook
on every trainable parameter when it is made; once it joined the run, backward's
hooks start each bucket's all-reduce as soon as its gradients exist, and ``step``
waits for them all, sets the averaged gradients, steps the optimizer and admits
waiting peers (``GradientRounds``). The parameters and the optimizer's state are the
run's shared state: a joiner receives them, and every peer holds the same bits after
each step.

Both classes own their communicator (``_owner``), as ``DiLoCo`` does: ``join`` (the
start of a ``with`` block, or the first ``step``) connects it and makes the first
boundary, a peer kicked after it stepped joins again by itself, ``close`` leaves the
run and removes the hooks. ``DataParallel`` takes a ``pccl_trio.sync.Communicator``:
the hooks hand each start to the communicator's loop, where the bucket then travels
while backward computes the layers before it. ``AsyncDataParallel`` takes a
``pccl_trio.Communicator``; its hooks start the all-reduce in the trainer's trio run
(from a worker thread through ``trio.from_thread``, when backward runs in one, which
is what lets it overlap backward).
"""

from __future__ import annotations

import torch
import trio
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import InvalidArgument
from ..peer import Communicator as AsyncCommunicator
from ..sync import Communicator as BlockingCommunicator
from ._admission import check_peers
from ._gradients import Bucket, GradientRounds
from ._owner import AsyncWrapper, BlockingWrapper

__all__ = ["AsyncDataParallel", "DataParallel"]

#: Bytes of gradients per bucket by default, as torch's DistributedDataParallel.
BUCKET_BYTES = 25 * 2**20


def _rounds(model: nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: int,
            min_peers: int) -> GradientRounds:
    """The steps, from the arguments both classes check alike."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidArgument(f"bucket_bytes must be a positive int, not {bucket_bytes!r}")
    check_peers(min_peers, "min_peers")
    return GradientRounds(model, optimizer, bucket_bytes=bucket_bytes, min_peers=min_peers)


def _hook(rounds: GradientRounds) -> list[RemovableHandle]:
    """A hook on every bucketed parameter: backward tells ``rounds`` what it made."""
    return [
        p.register_post_accumulate_grad_hook(rounds.ready)  # type: ignore[no-untyped-call]
        for bucket in rounds.buckets for p in bucket.params
    ]


def _unhook(rounds: GradientRounds, hooks: list[RemovableHandle]) -> None:
    rounds.start = None
    for hook in hooks:
        hook.remove()


class DataParallel(BlockingWrapper[GradientRounds]):
    """Per-step gradient averaging for a synchronous torch loop, over a
    ``pccl_trio.sync.Communicator``.

    Call ``step()`` after each ``loss.backward()``, in place of ``optimizer.step()``:
    the gradients, all-reduced (averaged) in buckets while backward made them, are
    set on the parameters and the optimizer steps, the same bits on every peer. The
    parameters and the optimizer's state are the run's shared state: a joiner
    receives them at the end of a step.

    Args:
        model: its trainable parameters are averaged; on one device, floating point.
        communicator: a new (or just connected) ``pccl_trio.sync.Communicator``;
            owned from here on (``close()`` closes it).
        optimizer: the torch optimizer over ``model.parameters()``; ``step()`` steps it.
        bucket_bytes: gradient bytes per all-reduce (a larger parameter goes alone).
        min_peers: before the run's first step, a step with fewer peers in the run
            waits for company.

    Raises:
        InvalidArgument: an argument is wrong.
    """

    def __init__(
        self, model: nn.Module, *, communicator: BlockingCommunicator,
        optimizer: torch.optim.Optimizer, bucket_bytes: int = BUCKET_BYTES, min_peers: int = 1,
    ) -> None:
        super().__init__(communicator, lambda: _rounds(model, optimizer, bucket_bytes, min_peers),
                         name="DataParallel", twin="AsyncDataParallel")
        self._hooks = _hook(self._rounds)

    @property
    def steps(self) -> int:
        """The run's count of steps done (the shared state's revision): the same on
        every peer after each step."""
        return self._rounds.shared.revision

    def join(self) -> None:
        """Connect (when the communicator is new) and take part in the run's next
        boundary: the model then holds the run's parameters."""
        super().join()
        self._rounds.start = self._start

    def step(self) -> None:
        """The averaged gradients, the optimizer's step, and admissions (blocks)."""
        if not self._owner.joined:
            self.join()  # this backward ran unhooked: its buckets all start in step
        self._owner.run(self._rounds.step)

    def close(self) -> None:
        """Leave the run and remove the hooks."""
        _unhook(self._rounds, self._hooks)
        super().close()

    def _start(self, bucket: Bucket) -> None:
        self._owner.call(self._rounds.start_in_loop, bucket)


class AsyncDataParallel(AsyncWrapper[GradientRounds]):
    """``DataParallel`` for a trainer that runs in trio, over a ``pccl_trio.Communicator``:
    the same arguments, with ``await dp.join()``, ``await dp.step()``, ``await
    dp.aclose()`` and ``async with``. Run backward off the event loop
    (``trio.to_thread.run_sync``) for the buckets to travel while it computes.
    """

    def __init__(
        self, model: nn.Module, *, communicator: AsyncCommunicator,
        optimizer: torch.optim.Optimizer, bucket_bytes: int = BUCKET_BYTES, min_peers: int = 1,
    ) -> None:
        super().__init__(communicator, lambda: _rounds(model, optimizer, bucket_bytes, min_peers),
                         name="AsyncDataParallel", twin="DataParallel")
        self._hooks = _hook(self._rounds)

    @property
    def steps(self) -> int:
        """As ``DataParallel.steps``."""
        return self._rounds.shared.revision

    async def join(self) -> None:
        """As ``DataParallel.join``."""
        await super().join()
        self._rounds.start = self._start

    async def step(self) -> None:
        """As ``DataParallel.step``."""
        if not self._owner.joined:
            await self.join()
        await self._owner.run(self._rounds.step)

    async def aclose(self) -> None:
        """As ``DataParallel.close``."""
        _unhook(self._rounds, self._hooks)
        await super().aclose()

    def _start(self, bucket: Bucket) -> None:
        comm = self._owner.communicator
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # backward in a worker thread of the trio run
            trio.from_thread.run_sync(self._rounds.start_now, comm, bucket)
        else:
            self._rounds.start_now(comm, bucket)
