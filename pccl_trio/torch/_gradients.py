"""DataParallel's steps over a communicator: gradients averaged in buckets as backward
makes them, then one optimizer step on every peer alike.

Theory of operation
-------------------
The model's trainable parameters are cut into buckets (``Bucket``) once: in reverse
order of ``named_parameters()`` (backward produces the last layers' gradients
first), parameters of one dtype together, up to ``bucket_bytes`` each (a larger
parameter alone). Every peer has the same model, hence the same buckets; bucket ``i``
all-reduces with tag ``i``.

During backward, a hook on each parameter (``register_post_accumulate_grad_hook``)
counts it ready; when a bucket's last parameter is, its gradients are copied into the
bucket's flat buffer and the buffer's all-reduce (``AVG``) is started
(``all_reduce_async``), so that it travels while backward goes on with the layers
before. The hooks call ``start``, which the wrapper makes: over a blocking
communicator it hands the start to the communicator's loop.

``step`` (on every peer alike, after backward):

1. the buckets that did not start (a parameter without a gradient, unused this step:
   it counts as zeros) start now, so every peer makes the same all-reduces;
2. every bucket's all-reduce is waited for. ``TooFewPeers``: alone, its own
   gradients are the average. ``CollectiveAborted`` (a peer died, the master was
   lost, a peer's sync failed; every survivor got the same verdict, and the buffer
   its input back): after all were waited for, the shared state is synced again (a
   repeated revision, which moves nothing) and the aborted buckets are all-reduced
   again, one after the other, until they succeed. A sync that changed this peer's
   parameters (it was behind) makes its buckets contribute zeros;
3. each parameter's ``.grad`` is set to its slice of its bucket's average, the
   optimizer steps, and the revision (the run's count of steps) moves on by one;
4. the membership part (``Admission``): peers waiting to join are admitted, the ring
   re-ordered, the shared state (the parameters themselves and the optimizer's state)
   synced: a joiner receives it here, ready for the next step. Before the run's first
   step, below ``min_peers``, it waits for company.

``join`` is step 4 alone, for a communicator that just connected; when its sync
changed the parameters (a joiner), gradients made before it are dropped (they count
as zeros at the next step). ``Kicked`` after this peer's first step raises ``Rejoin``:
the owner joins again with a new communicator, and the step in which it happened
takes no optimizer step on this peer. Before the first step, ``Kicked`` reaches the
trainer. The averaged gradients are the same bits on every
peer, and so is the optimizer's step from identical state: the parameters stay
identical without moving a byte in the syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .._errors import CollectiveAborted, InvalidUsage, Kicked, TooFewPeers
from .._types import Attribute, ReduceOp, SharedState, TensorInfo
from ..peer import AsyncReduceHandle, Communicator
from ._admission import Admission
from ._owner import Rejoin
from ._state import check_optimizes, create_state, state_tensors, trainable

__all__ = ["Bucket", "GradientRounds"]


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together, in one flat buffer."""

    tag: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0  # parameters whose gradient this step's backward made
    handle: AsyncReduceHandle | None = None  # its all-reduce, once started

    def fill(self) -> None:
        """Copy the parameters' gradients into the buffer (zeros for none)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                part = self.buffer[offset:offset + p.numel()]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(p.grad.reshape(-1))
                offset += p.numel()

    def unload(self) -> None:
        """Set each parameter's gradient to its slice of the (averaged) buffer."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                part = self.buffer[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)
                offset += p.numel()


def buckets_of(named: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[Bucket]:
    """The buckets of the module docstring, tagged in the order they fill."""
    groups: list[list[nn.Parameter]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[nn.Parameter], list[int]]] = {}
    for _, p in reversed(named):
        size = p.numel() * p.element_size()
        group, used = open_by_dtype.get(p.dtype, (None, [0]))
        if group is None or used[0] + size > bucket_bytes:
            group, used = [], [0]
            groups.append(group)
            open_by_dtype[p.dtype] = (group, used)
        group.append(p)
        used[0] += size
    return [
        Bucket(tag, group, torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                                       device=group[0].device))
        for tag, group in enumerate(groups)
    ]


class GradientRounds:
    """One peer's data-parallel steps (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 bucket_bytes: int, min_peers: int) -> None:
        named = trainable(model)
        check_optimizes(optimizer, named, what="optimizer")
        params = [p for _, p in named]
        create_state(optimizer, params)
        self.optimizer = optimizer
        self._params = params
        self.shared = SharedState(
            [TensorInfo(f"params.{name}", p.detach()) for name, p in named]
            + state_tensors(optimizer, named, "optimizer")
        )
        self.buckets = buckets_of(named, bucket_bytes)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._admission = Admission(min_peers)
        self._stepped = False  # a step was taken with this communicator
        #: How a hook starts a bucket's all-reduce (the wrapper's; None: not joined).
        self.start: Callable[[Bucket], None] | None = None

    # --- the hooks (backward) ------------------------------------------------------------

    def ready(self, p: nn.Parameter) -> None:
        """``p``'s gradient was made: start its bucket once the bucket is complete."""
        if self.start is None:
            return  # not in the run (yet): backward goes on as without the wrapper
        bucket = self._bucket_of[id(p)]
        if bucket.handle is not None:
            raise InvalidUsage(
                "a second backward before DataParallel.step(): its gradients are on "
                "their way already; call step() after each backward"
            )
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self.start(bucket)

    def start_now(self, comm: Communicator, bucket: Bucket) -> None:
        """Fill ``bucket`` and start its all-reduce (in the communicator's loop)."""
        bucket.fill()
        bucket.handle = comm.all_reduce_async(bucket.buffer, op=ReduceOp.AVG, tag=bucket.tag)

    async def start_in_loop(self, comm: Communicator, bucket: Bucket) -> None:
        """``start_now`` for ``call_in_loop``."""
        self.start_now(comm, bucket)

    # --- the rounds ----------------------------------------------------------------------

    async def join(self, comm: Communicator) -> None:
        """This peer's first boundary with a communicator that just connected."""
        self._admission.connected()
        self._stepped = False
        self._forget()
        if await self._admission.admit_and_sync(comm, self.shared):  # Kicked: a mistake to fix
            for p in self._params:
                p.grad = None  # made at parameters the run does not have: zeros

    async def step(self, comm: Communicator) -> None:
        """Steps 1 to 4 of the module docstring."""
        try:
            for bucket in self.buckets:
                if bucket.handle is None:
                    self.start_now(comm, bucket)
            aborted = []
            for bucket in self.buckets:
                assert bucket.handle is not None
                try:
                    await bucket.handle.wait()
                except CollectiveAborted:
                    aborted.append(bucket)
                except TooFewPeers:
                    pass  # alone: its own gradients are the average
            for bucket in aborted:
                await self._reduce(comm, bucket)
            for bucket in self.buckets:
                bucket.unload()
            self.optimizer.step()
            self.shared.revision += 1
            self._stepped = True
            self._forget()
            await self._admission.admit_and_sync(comm, self.shared)
        except Kicked:
            self._forget()
            if not self._stepped:
                raise
            raise Rejoin from None

    def rejoining(self) -> None:
        """Before ``join`` with a new communicator, after ``Rejoin``: a newcomer."""
        self.shared.revision = 0
        self._forget()

    async def hold(self, comm: Communicator, peers: int) -> None:
        """Between steps, on every peer alike: wait until the run has ``peers`` peers,
        admitting those that ask (nothing is in flight between steps). With enough
        peers already (the world after the last step, the same on every peer) it has
        nothing to do."""
        if comm.get_attribute(Attribute.GLOBAL_WORLD_SIZE) >= peers:
            return
        try:
            await self._admission.admit_and_sync(comm, self.shared, company=peers)
        except Kicked:
            if not self._stepped:
                raise
            raise Rejoin from None

    def _forget(self) -> None:
        """Ready for the next backward: no bucket started."""
        for bucket in self.buckets:
            bucket.ready, bucket.handle = 0, None

    async def _reduce(self, comm: Communicator, bucket: Bucket) -> None:
        """All-reduce an aborted bucket again until it succeeds; before each try the
        state is synced again (the abort restored the buffer)."""
        while True:
            if (await self._admission.sync(comm, self.shared)).rx_bytes:
                bucket.buffer.zero_()  # gradients of parameters the run no longer has
            try:
                await comm.all_reduce(bucket.buffer, op=ReduceOp.AVG, tag=bucket.tag)
                return
            except TooFewPeers:
                return
            except CollectiveAborted:
                continue
