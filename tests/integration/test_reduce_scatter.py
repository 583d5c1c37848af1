"""``Communicator.reduce_scatter``: each peer's part of the reduced vector, the parts
in ascending peer-id order as ``numpy.array_split`` cuts them, bit for bit the same
range of an all-reduce on the same ring; the input only read; torch in, torch out;
one verdict when a peer dies, and an exact retry; a mismatched call refused, naming
both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

import pccl_trio as pccl

from .conftest import WITH_BLOCKING, Cluster, die_mid_all_reduce, make_run, retried_after_an_abort, run_all

NETWORKS = WITH_BLOCKING

WORLD = 3


def parts(count: int) -> list[tuple[int, int]]:
    sizes = [len(p) for p in np.array_split(np.arange(count), WORLD)]
    bounds = np.cumsum([0, *sizes])
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(WORLD)]


@pytest.mark.parametrize(
    ("dtype", "op"),
    [(np.float32, pccl.ReduceOp.SUM), (np.float64, pccl.ReduceOp.AVG),
     (np.int32, pccl.ReduceOp.MAX), (np.float16, pccl.ReduceOp.SUM)],
)
async def test_each_peer_gets_its_part_with_the_all_reduces_bits(
    cluster: Cluster, clock: object, dtype: type, op: pccl.ReduceOp,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        by_id = sorted(c.peer_id for c in comms)  # type: ignore[type-var]
        rng = np.random.default_rng(7)
        for count in (0, 2, 1001):
            data = [(rng.standard_normal(count) * 10.0 ** i).astype(dtype) for i in range(WORLD)]
            sent = [d.copy() for d in data]
            shards = await run_all(
                comms, lambda i, c, sent=sent: c.reduce_scatter(sent[i], op=op, tag=1)
            )
            whole = [d.copy() for d in data]
            await run_all(comms, lambda i, c, whole=whole: c.all_reduce(whole[i], op=op, tag=2))
            for i, (comm, shard) in enumerate(zip(comms, shards, strict=True)):
                assert isinstance(shard, pccl.Shard), shard
                assert (shard.start, shard.stop) == parts(count)[by_id.index(comm.peer_id)]
                assert shard.data.dtype == dtype and shard.data.shape == (shard.stop - shard.start,)
                assert shard.data.tobytes() == whole[i][shard.start:shard.stop].tobytes()
                assert sent[i].tobytes() == data[i].tobytes()  # only read
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_torch_in_torch_out(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        tensors = [torch.full((4, 5), float(i + 1), dtype=torch.bfloat16) for i in range(WORLD)]
        shards = await run_all(comms, lambda i, c: c.reduce_scatter(tensors[i], tag=3))
        for shard in shards:
            assert isinstance(shard, pccl.Shard)
            assert isinstance(shard.data, torch.Tensor) and shard.data.dtype == torch.bfloat16
            assert torch.equal(shard.data, torch.full((shard.stop - shard.start,), 6.0,
                                                      dtype=torch.bfloat16))
        await run_all(comms, lambda i, c: c.aclose())


async def test_a_peer_killed_mid_reduce_scatter_leaves_one_verdict_and_a_retry_is_exact(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD, pool=2)
        count = 300_000
        data = [np.arange(count, dtype=np.float32) + i for i in range(WORLD)]
        sent = [d.copy() for d in data]
        results = await die_mid_all_reduce(
            cluster, comms, 2, lambda i, c: c.reduce_scatter(sent[i])
        )
        assert len({type(r) for r in results}) == 1, results
        for i in range(2):
            assert sent[i].tobytes() == data[i].tobytes()
        survivors = comms[:2]
        *aborted, shards = await retried_after_an_abort(
            survivors, lambda i, c: c.reduce_scatter(sent[i])
        )
        for first in aborted:
            assert "the input" not in str(first[0])
        want = data[0] + data[1]
        covered = 0
        for shard in shards:
            assert isinstance(shard, pccl.Shard), shards
            assert shard.data.tobytes() == want[shard.start:shard.stop].tobytes()
            covered += shard.stop - shard.start
        assert covered == count
        await run_all(survivors, lambda i, c: c.aclose())


async def test_a_reduce_scatter_facing_an_all_reduce_is_refused_naming_both(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        data = [np.ones(6, dtype=np.float32) for _ in range(WORLD)]

        async def call(i: int, comm: pccl.Communicator) -> object:
            if i == 0:
                return await comm.all_reduce(data[i], tag=4)
            return await comm.reduce_scatter(data[i], tag=4)

        results = await run_all(comms, call)
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert f"peer {comms[0].peer_id}: all_reduce count=6" in str(results[0])
        assert f"peer {comms[1].peer_id}: reduce_scatter count=6" in str(results[0])
        assert all((d == 1.0).all() for d in data)
        await run_all(comms, lambda i, c: c.aclose())
