"""``Communicator.broadcast``: every peer ends holding the root's bytes, the root's
stays as it was; from any root of the ring, for every dtype's bits; under a lease; a
root that dies during its broadcast leaves one verdict and every input intact; a
different root, or a root that is no peer, refused for everyone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

import pccl_trio as pccl

from .conftest import (
    WITH_BLOCKING,
    Cluster,
    die_mid_all_reduce,
    make_run,
    retried_after_an_abort,
    run_all,
)

NETWORKS = WITH_BLOCKING

WORLD = 3


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int64, np.float16])
async def test_every_peer_ends_holding_the_roots_bytes(
    cluster: Cluster, clock: object, dtype: type,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        rng = np.random.default_rng(3)
        for count in (0, 1, 5000):
            for root in comms:  # every position of the ring, the first through the master
                data = [rng.integers(0, 200, count).astype(dtype) for _ in comms]
                buffers = [d.copy() for d in data]
                infos = await run_all(
                    comms, lambda i, c, b=buffers, r=root: c.broadcast(b[i], root=r.peer_id, tag=1)
                )
                assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
                want = data[comms.index(root)].tobytes()
                assert all(b.tobytes() == want for b in buffers)
                sender = comms.index(root)
                assert infos[sender].rx_bytes == 0  # type: ignore[union-attr]
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_torch_tensor_is_written_in_place(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        tensors = [torch.full((3, 4), float(i), dtype=torch.bfloat16) for i in range(WORLD)]
        await run_all(comms, lambda i, c: c.broadcast(tensors[i], root=comms[1].peer_id))
        assert all(torch.equal(t, torch.full((3, 4), 1.0, dtype=torch.bfloat16)) for t in tensors)
        await run_all(comms, lambda i, c: c.aclose())


async def test_a_root_that_dies_during_its_broadcast_leaves_one_verdict(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD, pool=2)
        root = comms[2]
        count = 400_000
        data = [np.arange(count, dtype=np.float32) * (i + 1) for i in range(WORLD)]
        buffers = [d.copy() for d in data]
        results = await die_mid_all_reduce(
            cluster, comms, 2, lambda i, c: c.broadcast(buffers[i], root=root.peer_id)
        )
        assert len({type(r) for r in results}) == 1, results
        if isinstance(results[0], pccl.CollectiveAborted):
            for i in range(2):  # put back: the root's bytes never half-land
                assert buffers[i].tobytes() == data[i].tobytes()
        else:  # it had passed everything on first
            assert all(buffers[i].tobytes() == data[2].tobytes() for i in range(2))
        survivors = comms[:2]
        # With the root gone, a broadcast from it is refused; from a survivor it runs.
        *_, again = await retried_after_an_abort(
            survivors, lambda i, c: c.broadcast(buffers[i], root=survivors[0].peer_id)
        )
        assert all(isinstance(r, pccl.ReduceInfo) for r in again), again
        assert buffers[1].tobytes() == buffers[0].tobytes()
        gone = await run_all(survivors, lambda i, c: c.broadcast(buffers[i], root=root.peer_id))
        assert all(isinstance(r, pccl.InvalidArgument) for r in gone), gone
        assert f"broadcast(root={root.peer_id}): no such peer" in str(gone[0])
        await run_all(survivors, lambda i, c: c.aclose())


async def test_peers_naming_different_roots_are_refused_naming_each(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        data = [np.full(6, i, dtype=np.float32) for i in range(WORLD)]

        async def call(i: int, comm: pccl.Communicator) -> object:
            root = comms[0] if i else comms[1]
            return await comm.broadcast(data[i], root=root.peer_id, tag=2)

        results = await run_all(comms, call)
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert f"peer {comms[0].peer_id}: broadcast root={comms[1].peer_id} count=6" in str(results[0])
        assert f"peer {comms[1].peer_id}: broadcast root={comms[0].peer_id} count=6" in str(results[0])
        assert all((d == i).all() for i, d in enumerate(data))
        for root in (0, -1, True, 1.0):
            with pytest.raises(pccl.InvalidArgument, match="root must be a peer id"):
                await comms[0].broadcast(data[0], root=root)  # type: ignore[arg-type]
        await run_all(comms, lambda i, c: c.aclose())


async def test_every_collective_in_flight_at_once_through_async_handles(
    cluster: Cluster, clock: object,
) -> None:
    """An all-reduce, a broadcast, a reduce-scatter and a barrier, each on its own tag,
    all launched before any is awaited: each ends as it would alone."""
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        count = 3000
        summed = [np.full(count, i + 1, dtype=np.float32) for i in range(WORLD)]
        sent = [np.arange(count, dtype=np.float32) * (i + 1) for i in range(WORLD)]
        scattered = [np.full(count, 2 * i, dtype=np.float32) for i in range(WORLD)]
        root = comms[1].peer_id

        async def call(i: int, comm: pccl.Communicator) -> list[object]:
            handles = [
                comm.all_reduce_async(summed[i], tag=10),
                comm.broadcast_async(sent[i], root=root, tag=11),
                comm.reduce_scatter_async(scattered[i], tag=12),
                comm.barrier_async(tag=13),
            ]
            assert not any(h.done for h in handles[:3]) or cluster.memory is None
            return [await h.wait() for h in handles]

        outcomes = await run_all(comms, call)
        by_id = sorted(c.peer_id for c in comms)  # type: ignore[type-var]
        for i, (comm, outcome) in enumerate(zip(comms, outcomes, strict=True)):
            assert isinstance(outcome, list), outcome
            reduced, broadcast, shard, barrier = outcome
            assert isinstance(reduced, pccl.ReduceInfo) and (summed[i] == 6.0).all()
            assert isinstance(broadcast, pccl.ReduceInfo)
            assert sent[i].tobytes() == (np.arange(count, dtype=np.float32) * 2).tobytes()
            assert isinstance(shard, pccl.Shard)
            part = np.array_split(np.arange(count), WORLD)[by_id.index(comm.peer_id)]
            assert (shard.start, shard.stop) == (part[0], part[-1] + 1)
            assert (shard.data == 6.0).all()
            assert isinstance(barrier, pccl.ReduceInfo) and barrier.tx_bytes == 0
        await run_all(comms, lambda i, c: c.aclose())
