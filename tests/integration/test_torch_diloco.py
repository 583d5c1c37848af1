"""``pccl_trio.torch.AsyncDiLoCo`` and ``DiLoCo`` in runs: founders, a joiner, a death,
a kick, a master restarted, a lone peer, with and without overlap; and against a
hand-written loop.

On the ``sync`` network kind every trainer is a synchronous loop with ``DiLoCo`` over
a ``pccl_trio.sync.Communicator``, run on a worker thread of the test's trio run (as a
trainer's process would run it); on the others, a trio task with ``AsyncDiLoCo``.

Every peer trains a small torch model with its own deterministic data (the peer's
shard seeds it, and the outer step number), so a run's result depends only on its
membership history. The hand-written loop in ``hand_written_peer`` is the README's
loop with DiLoCo's rounds, written with the async communicator; on the same
membership history the wrapper must give the same bits.
"""

from __future__ import annotations

import dataclasses
import threading
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
from pccl_trio.testing import PeerSeam

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
SYNC_EVERY = 3
OUTER_STEPS = 5


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    seeded(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, shard: int, outer: int,
               inner: int) -> None:
    """One inner step on this shard's batch for (outer step, inner step)."""
    generator = torch.Generator().manual_seed(shard * 10_007 + outer * 101 + inner)
    x = torch.randn(16, 6, generator=generator)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], dim=1) + 0.1 * shard
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def parameters(model: nn.Module) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


@dataclasses.dataclass
class Trained:
    """What a peer ended with."""

    params: bytes
    outer_steps: int
    state: bytes  # the shared state's tensors
    digest: str  # pccl_trio.state_digest of the shared state


Wrapper = pccl_torch.AsyncDiLoCo | pccl_torch.DiLoCo
Pause = Callable[[int], Awaitable[None]]


def state_of(state: pccl.SharedState) -> bytes:
    return b"".join(t.data.numpy().tobytes() for t in state.tensors)


def trained(model: nn.Module, state: pccl.SharedState) -> Trained:
    """What a peer ended with, from its model and the run's shared state."""
    return Trained(parameters(model), state.revision, state_of(state), pccl.state_digest(state))


def pseudo_gradient(outer: list[torch.Tensor], params: list[torch.Tensor],
                    into: torch.Tensor) -> None:
    """A hand-written loop's pseudo-gradient: outer minus local, flattened."""
    with torch.no_grad():
        torch.cat([(o - p.detach()).reshape(-1) for o, p in zip(outer, params, strict=True)],
                  out=into)


async def wrapper_peer(
    comm: pccl.Communicator, shard: int, *, overlap: bool = False, steps: int = OUTER_STEPS,
    pause: Pause | None = None,
    compression: pccl.QuantizationOptions | pccl.TopK | None = None, min_peers: int = 1,
    wrappers: dict[int, Wrapper] | None = None,
) -> Trained:
    """A trainer's loop with ``AsyncDiLoCo`` (for a ``BlockingPeer``: ``DiLoCo`` in
    ``blocking_wrapper_peer``); ``pause(outer_steps)`` runs after each boundary (the
    test's hook); ``wrappers[shard]`` is this peer's wrapper."""
    if isinstance(comm, BlockingPeer):
        return await trio.to_thread.run_sync(partial(
            blocking_wrapper_peer, comm.blocking, shard, overlap=overlap, steps=steps,
            pause=pause, compression=compression, min_peers=min_peers, wrappers=wrappers,
        ), abandon_on_cancel=True)
    model, optimizer = make_model()
    async with pccl_torch.AsyncDiLoCo(
        model, optimizer, communicator=comm, sync_every=SYNC_EVERY, overlap=overlap,
        compression=compression, min_peers=min_peers,
    ) as diloco:
        if wrappers is not None:
            wrappers[shard] = diloco
        inner = 0
        while diloco.outer_steps < steps:
            if inner % SYNC_EVERY == 0 and pause is not None:
                await pause(diloco.outer_steps)
            inner_step(model, optimizer, shard, diloco.outer_steps, inner % SYNC_EVERY)
            inner += 1
            await diloco.step()
        return trained(model, diloco.shared_state)


def blocking_wrapper_peer(
    comm: pccl_trio.sync.Communicator, shard: int, *, overlap: bool, steps: int,
    pause: Pause | None, compression: pccl.QuantizationOptions | pccl.TopK | None,
    min_peers: int, wrappers: dict[int, Wrapper] | None,
) -> Trained:
    """``wrapper_peer``'s loop, synchronous, with ``DiLoCo``; ``pause`` runs in the
    test's trio run."""
    model, optimizer = make_model()
    with pccl_torch.DiLoCo(
        model, optimizer, communicator=comm, sync_every=SYNC_EVERY, overlap=overlap,
        compression=compression, min_peers=min_peers,
    ) as diloco:
        if wrappers is not None:
            wrappers[shard] = diloco
        inner = 0
        while diloco.outer_steps < steps:
            if inner % SYNC_EVERY == 0 and pause is not None:
                trio.from_thread.run(pause, diloco.outer_steps)
            inner_step(model, optimizer, shard, diloco.outer_steps, inner % SYNC_EVERY)
            inner += 1
            diloco.step()
        return trained(model, diloco.shared_state)


async def hand_written_peer(comm: pccl.Communicator, shard: int, *,
                            steps: int = OUTER_STEPS, min_peers: int = 1,
                            pause: Callable[[int], Awaitable[None]] | None = None,
                            wrappers: dict[int, Wrapper] | None = None) -> Trained:
    """The same training as ``wrapper_peer`` (no overlap), written out by hand (no
    wrapper: ``wrappers`` is left alone)."""
    model, optimizer = make_model()
    params = list(model.parameters())
    outer = [p.detach().clone() for p in params]
    outer_optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for p in params:
        outer_optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    state = pccl.SharedState(
        [pccl.TensorInfo(f"outer.{name}", o)
         for (name, _), o in zip(model.named_parameters(), outer, strict=True)]
        + [pccl.TensorInfo(f"outer_optimizer.{name}.momentum_buffer",
                           outer_optimizer.state[p]["momentum_buffer"])
           for name, p in model.named_parameters()]
    )
    numel = sum(p.numel() for p in params)

    def load() -> None:
        with torch.no_grad():
            for o, p in zip(outer, params, strict=True):
                p.copy_(o)

    async with comm:
        fresh, own = True, False
        pseudo = torch.zeros(numel)
        while True:
            changed = await hand_written_admission(comm, state, fresh=fresh, min_peers=min_peers)
            fresh = False
            if changed or not own:
                pseudo.zero_()
            try:
                await comm.all_reduce(pseudo, op=pccl.ReduceOp.AVG)
            except pccl.TooFewPeers:
                pass
            if pseudo.any():
                with torch.no_grad():
                    offset = 0
                    for o, p in zip(outer, params, strict=True):
                        p.copy_(o)
                        p.grad = pseudo[offset:offset + p.numel()].view_as(p).clone()
                        offset += p.numel()
                outer_optimizer.step()
                with torch.no_grad():
                    for o, p in zip(outer, params, strict=True):
                        o.copy_(p)
                        p.grad = None
                state.revision += 1
            load()
            if state.revision >= steps:
                break
            if pause is not None:
                await pause(state.revision)
            for inner in range(SYNC_EVERY):
                inner_step(model, optimizer, shard, state.revision, inner)
            pseudo_gradient(outer, params, pseudo)
            own = True
        return trained(model, state)


async def hand_written_overlap_peer(comm: pccl.Communicator, shard: int, *,
                                    steps: int = OUTER_STEPS, min_peers: int = 1) -> Trained:
    """``wrapper_peer`` with overlap, written out by hand for founders: a round's
    all-reduce is waited for at the next boundary, which takes its outer step (plain
    SGD at lr 0.7, over the outer tensors) before it admits, syncs and starts the
    round's own all-reduce; the next round starts from the outer parameters."""
    model, optimizer = make_model()
    params = list(model.parameters())
    outer = [p.detach().clone() for p in params]
    outer_optimizer = torch.optim.SGD(outer, lr=0.7)
    state = pccl.SharedState([pccl.TensorInfo(f"outer.{name}", o)
                              for (name, _), o in zip(model.named_parameters(), outer, strict=True)])
    numel = sum(p.numel() for p in params)
    vectors = [torch.zeros(numel), torch.zeros(numel)]
    async with comm:
        flight: tuple[pccl.AsyncReduceHandle, torch.Tensor] | None = None
        own, pseudo = False, vectors[0]
        while True:
            if flight is not None:
                handle, averaged = flight
                try:
                    await handle.wait()
                except pccl.TooFewPeers:
                    pass
                if averaged.any():
                    offset = 0
                    for o in outer:
                        o.grad = averaged[offset:offset + o.numel()].view_as(o)
                        offset += o.numel()
                    outer_optimizer.step()
                    state.revision += 1
            await hand_written_admission(comm, state, fresh=flight is None, min_peers=min_peers)
            if not own:
                pseudo.zero_()
            flight = comm.all_reduce_async(pseudo, op=pccl.ReduceOp.AVG), pseudo
            with torch.no_grad():
                for o, p in zip(outer, params, strict=True):
                    p.copy_(o)
            if state.revision >= steps:
                break
            for inner in range(SYNC_EVERY):
                inner_step(model, optimizer, shard, state.revision, inner)
            pseudo = vectors[1] if pseudo is vectors[0] else vectors[0]
            pseudo_gradient(outer, params, pseudo)
            own = True
        return trained(model, state)


def all_same(results: list[Trained]) -> None:
    assert len({r.digest for r in results}) == 1
    assert len({r.params for r in results}) == 1
    assert len({r.state for r in results}) == 1
    assert {r.outer_steps for r in results} == {OUTER_STEPS}


async def test_founders_match_a_hand_written_loop(cluster: Cluster, clock: object) -> None:
    """Two founders that start together: the wrapper's bits are the hand-written loop's."""
    wrapped = await run_peers(cluster, wrapper_peer, 2, min_peers=2)
    all_same(wrapped)
    by_hand = await run_peers(cluster, hand_written_peer, 2, min_peers=2)
    all_same(by_hand)
    assert wrapped[0].params == by_hand[0].params
    assert wrapped[0].state == by_hand[0].state


async def test_founders_with_overlap_match_a_hand_written_loop(
    cluster: Cluster, clock: object
) -> None:
    """Delayed outer updates: two founders end with the hand-written delayed loop's
    bits (two, since a sum of two is the same whatever the ring's order), and they
    differ from the run without overlap (the update really comes a round late)."""
    overlapped = await run_peers(cluster, wrapper_peer, 2, overlap=True, min_peers=2)
    all_same(overlapped)
    by_hand = await run_peers(cluster, hand_written_overlap_peer, 2, min_peers=2)
    all_same(by_hand)
    assert overlapped[0].params == by_hand[0].params
    assert overlapped[0].state == by_hand[0].state
    plain = await run_peers(cluster, wrapper_peer, 2, min_peers=2)
    assert overlapped[0].params != plain[0].params


@pytest.mark.parametrize("compression", [
    pccl.QuantizationOptions(quantized_datatype=pccl.DataType.UINT8,
                             algorithm=pccl.QuantizationAlgorithm.MIN_MAX),
    pccl.TopK(0.25, chunk=16),
    pccl.TopK(0.25, chunk=16, values=pccl.QuantizationOptions(
        quantized_datatype=pccl.DataType.UINT8, algorithm=pccl.QuantizationAlgorithm.MIN_MAX)),
], ids=["uint8", "topk", "topk-uint8"])
async def test_compressed_pseudo_gradients(
    cluster: Cluster, clock: object, compression: object
) -> None:
    results = await run_peers(cluster, wrapper_peer, 3, compression=compression, min_peers=3)
    all_same(results)


async def test_a_lone_peer_trains_alone(cluster: Cluster, clock: object) -> None:
    """Alone, a peer's pseudo-gradient is the average: the outer steps go on."""
    alone, = await run_peers(cluster, wrapper_peer, 1)
    assert alone.outer_steps == OUTER_STEPS
    model, _ = make_model()
    assert alone.params != parameters(model)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_a_joiner_mid_run(cluster: Cluster, clock: object, overlap: bool) -> None:
    """A peer joins at outer step 2 (with overlap: while an all-reduce is in flight):
    it ends with the founders' bits. On the memory network (where the founders connect
    in a known order, hence the same ring) and without overlap, the hand-written loop
    on the same membership history gives the same bits too."""
    wrapped = await joiner_mid_run(cluster, wrapper_peer, at=2, overlap=overlap)
    all_same(wrapped)
    if cluster.memory is not None and not overlap:
        all_same(wrapped + await joiner_mid_run(cluster, hand_written_peer, at=2))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_a_peer_killed_mid_all_reduce(cluster: Cluster, clock: object, overlap: bool) -> None:
    """Peer 2 dies while the others' all-reduce of outer step 3 moves data: the
    survivors go on to the end with the same bits."""
    all_same(await killed_mid_all_reduce(cluster, wrapper_peer, at=2, overlap=overlap))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_the_master_restarted_mid_run(masters: Masters, clock: object, overlap: bool) -> None:
    """The master dies after outer step 2 and comes back at the same address while
    the trainers go on: none of them sees it, and every peer ends with the same bits."""
    all_same(await master_restarted(masters, wrapper_peer, at=2, overlap=overlap))


@pytest.mark.parametrize("network_kind", ["memory"])  # partitions need the memory network
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
async def test_a_peer_cut_off_until_kicked_joins_again(
    cluster: Cluster, clock: object, overlap: bool
) -> None:
    """Peer 1 goes silent at outer step 2 until the run removed it; the others wait at
    outer step 4; when peer 1 hears again it is kicked, and the wrapper joins it again
    with a new communicator. Everyone ends with the same bits."""
    all_same(await kicked_and_back(cluster, wrapper_peer, cut_at=2, hold_at=4, overlap=overlap))


@pytest.mark.parametrize("network_kind", ["sync"])
async def test_close_from_another_thread_ends_a_diloco_blocked_in_a_boundary(
    cluster: Cluster, clock: object
) -> None:
    """A lone ``DiLoCo`` waits for company in its first boundary (``min_peers=2``);
    ``close()`` from another thread ends it with ``InvalidUsage`` (whichever vote it
    waited in), and the communicator's loop thread with it."""
    peer = cluster.communicator("p0")
    assert isinstance(peer, BlockingPeer)
    model, optimizer = make_model()
    diloco = pccl_torch.DiLoCo(model, optimizer, communicator=peer.blocking,
                               sync_every=SYNC_EVERY, min_peers=2)
    loop_thread = f"pccl_trio communicator {id(peer.blocking):#x}"

    async def trainer() -> None:
        # Either the call saw the close, or the loop stopped under it first: both say so.
        with pytest.raises(pccl.InvalidUsage, match="the communicator (is|was) closed"):
            await trio.to_thread.run_sync(diloco.join)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer)
            while not PeerSeam(peer).voted:  # in a membership call of its boundary
                await trio.lowlevel.checkpoint()
            await trio.to_thread.run_sync(diloco.close)
    assert loop_thread not in {thread.name for thread in threading.enumerate()}
