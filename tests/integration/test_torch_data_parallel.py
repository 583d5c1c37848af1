"""``pccl_trio.torch.AsyncDataParallel`` and ``DataParallel`` in runs: founders against
a hand-written loop, several buckets, an unused parameter, a joiner, a death mid
all-reduce, a kick, the master restarted, a lone peer.

Every peer trains a small torch model with its own deterministic data (its shard and
the step number seed it), so a run's result depends only on its membership history.
On the ``sync`` network kind each trainer is a synchronous loop with ``DataParallel``
over a ``pccl_trio.sync.Communicator`` on a worker thread of the test's trio run (the
hooks then start each bucket from that thread); on the others, a trio task with
``AsyncDataParallel``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import torch
import trio
import trio.testing
from torch import nn

import pccl_trio as pccl
import pccl_trio.sync
import pccl_trio.torch as pccl_torch

from .blocking import BlockingPeer
from .conftest import Cluster, Masters
from .wrapper_runs import (
    GUARD,
    hand_written_admission,
    joiner_mid_run,
    kicked_and_back,
    killed_mid_all_reduce,
    master_restarted,
    run_peers,
    seeded,
)

#: In memory (virtual time, exact) and over loopback TCP through the blocking API, which
#: drives the same async code ("tcp" would add nothing but time to the suite).
NETWORKS = ("memory", "sync")
STEPS = 6
EACH_ITS_OWN = 64  # bucket_bytes: every parameter a bucket of its own

Wrapper = pccl_torch.AsyncDataParallel | pccl_torch.DataParallel
Pause = Callable[[int], Awaitable[None]]


class Net(nn.Module):
    """Two layers, and one the forward pass uses only when asked (``unused``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 2)
        self.spare = nn.Linear(8, 2)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        out = self.second(hidden)
        return out + self.spare(hidden) if self.use_spare else out


def make_model() -> tuple[Net, torch.optim.Optimizer]:
    model = Net()
    seeded(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def backward(model: Net, shard: int, step: int) -> None:
    """This shard's gradients for ``step`` (the spare layer used on odd shards)."""
    generator = torch.Generator().manual_seed(shard * 10_007 + step)
    x = torch.randn(16, 6, generator=generator)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], dim=1) + 0.1 * shard
    model.use_spare = shard % 2 == 1
    nn.functional.mse_loss(model(x), y).backward()


def parameters(model: nn.Module) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


@dataclasses.dataclass
class Trained:
    params: bytes
    steps: int
    digest: str


async def wrapper_peer(
    comm: pccl.Communicator, shard: int, *, steps: int = STEPS, pause: Pause | None = None,
    bucket_bytes: int = 2**20, min_peers: int = 1, wrappers: dict[int, Wrapper] | None = None,
) -> Trained:
    """A trainer's loop with ``AsyncDataParallel`` (for a ``BlockingPeer``:
    ``DataParallel``, in ``blocking_wrapper_peer``); ``pause(steps)`` runs before each
    step's forward pass."""
    if isinstance(comm, BlockingPeer):
        return await trio.to_thread.run_sync(partial(
            blocking_wrapper_peer, comm.blocking, shard, steps=steps, pause=pause,
            bucket_bytes=bucket_bytes, min_peers=min_peers, wrappers=wrappers,
        ), abandon_on_cancel=True)
    model, optimizer = make_model()
    async with pccl_torch.AsyncDataParallel(
        model, communicator=comm, optimizer=optimizer, bucket_bytes=bucket_bytes,
        min_peers=min_peers,
    ) as dp:
        if wrappers is not None:
            wrappers[shard] = dp
        while dp.steps < steps:
            if pause is not None:
                await pause(dp.steps)
            optimizer.zero_grad()
            backward(model, shard, dp.steps)
            await dp.step()
        return Trained(parameters(model), dp.steps, pccl.state_digest(dp.shared_state))


def blocking_wrapper_peer(
    comm: pccl_trio.sync.Communicator, shard: int, *, steps: int, pause: Pause | None,
    bucket_bytes: int, min_peers: int, wrappers: dict[int, Wrapper] | None,
) -> Trained:
    model, optimizer = make_model()
    with pccl_torch.DataParallel(
        model, communicator=comm, optimizer=optimizer, bucket_bytes=bucket_bytes,
        min_peers=min_peers,
    ) as dp:
        if wrappers is not None:
            wrappers[shard] = dp
        while dp.steps < steps:
            if pause is not None:
                trio.from_thread.run(pause, dp.steps)
            optimizer.zero_grad()
            backward(model, shard, dp.steps)
            dp.step()
        return Trained(parameters(model), dp.steps, pccl.state_digest(dp.shared_state))


async def hand_written_peer(comm: pccl.Communicator, shard: int, *, steps: int = STEPS,
                            min_peers: int = 1) -> Trained:
    """The same training, written out by hand: one all-reduce of every gradient."""
    model, optimizer = make_model()
    named = list(model.named_parameters())
    for _, p in named:
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    state = pccl.SharedState(
        [pccl.TensorInfo(f"params.{name}", p.detach()) for name, p in named]
        + [pccl.TensorInfo(f"optimizer.{name}.momentum_buffer",
                           optimizer.state[p]["momentum_buffer"]) for name, p in named]
    )
    async with comm:
        await hand_written_admission(comm, state, fresh=True, min_peers=min_peers)
        while state.revision < steps:
            optimizer.zero_grad()
            backward(model, shard, state.revision)
            grads = torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for _, p in named
            ])
            try:
                await comm.all_reduce(grads, op=pccl.ReduceOp.AVG)
            except pccl.TooFewPeers:
                pass
            offset = 0
            for _, p in named:
                p.grad = grads[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            optimizer.step()
            state.revision += 1
            await hand_written_admission(comm, state, fresh=False, min_peers=min_peers)
        return Trained(parameters(model), state.revision, pccl.state_digest(state))


def all_same(results: list[Trained], steps: int = STEPS) -> None:
    assert len({r.digest for r in results}) == 1
    assert len({r.params for r in results}) == 1
    assert {r.steps for r in results} == {steps}


async def test_founders_match_a_hand_written_loop(cluster: Cluster, clock: object) -> None:
    """Two founders (one of them using the spare layer): the wrapper's bits are those
    of one all-reduce of every gradient by hand; the parameters moved."""
    wrapped = await run_peers(cluster, wrapper_peer, 2, min_peers=2)
    all_same(wrapped)
    by_hand = await run_peers(cluster, hand_written_peer, 2, min_peers=2)
    all_same(by_hand)
    assert wrapped[0].params == by_hand[0].params
    assert wrapped[0].params != parameters(make_model()[0])


async def test_a_bucket_per_parameter_ends_alike(cluster: Cluster, clock: object) -> None:
    """Six buckets, started by the hooks as backward goes (the spare layer's by
    ``step`` on the peers that do not use it): every peer ends with the same bits."""
    all_same(await run_peers(cluster, wrapper_peer, 3, bucket_bytes=EACH_ITS_OWN, min_peers=3))


async def test_a_lone_peer_trains_alone(cluster: Cluster, clock: object) -> None:
    alone, = await run_peers(cluster, wrapper_peer, 1)
    assert alone.steps == STEPS and alone.params != parameters(make_model()[0])


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_second_backward_before_step_is_refused(cluster: Cluster, clock: object) -> None:
    model, optimizer = make_model()
    with trio.fail_after(GUARD):
        async with pccl_torch.AsyncDataParallel(
            model, communicator=cluster.communicator("p0"), optimizer=optimizer,
        ) as dp:
            backward(model, 0, 0)
            with pytest.raises(pccl.InvalidUsage, match="call step\\(\\) after each backward"):
                backward(model, 0, 0)
            assert dp.steps == 0


async def test_a_joiner_mid_run(cluster: Cluster, clock: object) -> None:
    """A peer joins at step 3: it ends with the founders' bits."""
    results = await joiner_mid_run(cluster, wrapper_peer, at=3, bucket_bytes=EACH_ITS_OWN)
    assert len(results) == 3
    all_same(results)


async def test_a_peer_killed_mid_all_reduce(cluster: Cluster, clock: object) -> None:
    """Peer 2 dies while the others' first bucket of step 3 moves data: the survivors
    go on to the end with the same bits."""
    all_same(await killed_mid_all_reduce(cluster, wrapper_peer, at=2))


async def test_the_master_restarted_mid_run(masters: Masters, clock: object) -> None:
    """The master dies before step 3 and comes back at its address while the trainers
    go on: they never see it; the same bits everywhere."""
    all_same(await master_restarted(masters, wrapper_peer, at=2, bucket_bytes=EACH_ITS_OWN))


@pytest.mark.parametrize("network_kind", ["memory"])  # partitions need the memory network
async def test_a_peer_cut_off_until_kicked_joins_again(cluster: Cluster, clock: object) -> None:
    """Peer 1 goes silent before step 2 until the run removed it; the others wait at
    step 4; when peer 1 hears again it is kicked, and the wrapper joins it again with
    a new communicator. Everyone ends with the same bits."""
    all_same(await kicked_and_back(cluster, wrapper_peer, cut_at=2, hold_at=4))
