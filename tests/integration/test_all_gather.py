"""``Communicator.all_gather``: every peer's part by ascending peer id, the parts of
different sizes, the same bytes on every peer; the input only read; torch in, torch
out; one verdict when a peer dies, and an exact retry; mismatched calls refused,
naming each peer's call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

import pccl_trio as pccl

from .conftest import WITH_BLOCKING, Cluster, die_mid_all_reduce, make_run, retried_after_an_abort, run_all

NETWORKS = WITH_BLOCKING

WORLD = 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16, np.uint8])
async def test_every_peer_gets_every_part_by_peer_id_sizes_differing(
    cluster: Cluster, clock: object, dtype: type,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        rng = np.random.default_rng(11)
        for sizes in ((0, 0, 0), (1, 0, 5), (2, 3, 1), (1001, 7, 300)):
            data = [(rng.standard_normal(n) * 100).astype(dtype) for n in sizes]
            sent = [d.copy() for d in data]
            results = await run_all(comms, lambda i, c, sent=sent: c.all_gather(sent[i], tag=1))
            by_id = sorted(range(WORLD), key=lambda i: comms[i].peer_id)  # type: ignore[arg-type,return-value]
            for i, parts in enumerate(results):
                assert isinstance(parts, dict), parts
                assert list(parts) == [comms[j].peer_id for j in by_id]
                for j in by_id:
                    got = parts[comms[j].peer_id]
                    assert got.dtype == dtype and got.shape == (sizes[j],)
                    assert got.tobytes() == data[j].tobytes()
                assert sent[i].tobytes() == data[i].tobytes()  # only read
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_torch_in_torch_out_and_several_tags_in_flight(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        tensors = [torch.full((i + 1, 2), float(i + 1), dtype=torch.bfloat16) for i in range(WORLD)]
        dense = [np.full(1000, float(i), dtype=np.float32) for i in range(WORLD)]

        async def call(i: int, comm: pccl.Communicator) -> object:
            gather = comm.all_gather_async(tensors[i], tag=3)
            reduce = comm.all_reduce_async(dense[i], tag=4)
            assert isinstance(gather, pccl.AsyncGatherHandle)
            await reduce.wait()
            return await gather.wait()

        results = await run_all(comms, call)
        for parts in results:
            assert isinstance(parts, dict), parts
            for i, comm in enumerate(comms):
                got = parts[comm.peer_id]
                assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
                assert torch.equal(got, tensors[i].flatten())
        assert all((d == 3.0).all() for d in dense)
        await run_all(comms, lambda i, c: c.aclose())


async def test_a_peer_killed_mid_all_gather_leaves_one_verdict_and_a_retry_is_exact(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD, pool=2)
        counts = (300_000, 200_000, 100_000)
        data = [np.arange(n, dtype=np.float32) + i for i, n in enumerate(counts)]
        sent = [d.copy() for d in data]
        results = await die_mid_all_reduce(cluster, comms, 2, lambda i, c: c.all_gather(sent[i]))
        assert len({type(r) for r in results}) == 1, results
        for i in range(2):
            assert sent[i].tobytes() == data[i].tobytes()
        survivors = comms[:2]
        *aborted, results = await retried_after_an_abort(
            survivors, lambda i, c: c.all_gather(sent[i])
        )
        for first in aborted:
            assert "the input" not in str(first[0])
        for parts in results:
            assert isinstance(parts, dict), results
            assert sorted(parts) == sorted(c.peer_id for c in survivors)  # type: ignore[type-var]
            for i, comm in enumerate(survivors):
                assert parts[comm.peer_id].tobytes() == data[i].tobytes()
        await run_all(survivors, lambda i, c: c.aclose())


async def test_mismatched_calls_are_refused_naming_each_peers_call(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        data = [np.ones(6, dtype=np.float32) for _ in range(WORLD)]

        async def call(i: int, comm: pccl.Communicator) -> object:
            if i == 0:
                return await comm.broadcast(data[i], root=comms[1].peer_id, tag=4)  # type: ignore[arg-type]
            if i == 1:
                return await comm.all_gather(data[i].astype(np.float64), tag=4)
            return await comm.all_gather(data[i], tag=4)

        results = await run_all(comms, call)
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        message = str(results[0])
        assert f"peer {comms[0].peer_id}: broadcast root=" in message
        assert f"peer {comms[1].peer_id}: all_gather count=6 (its own) dtype=DOUBLE" in message
        assert f"peer {comms[2].peer_id}: all_gather count=6 (its own) dtype=FLOAT" in message
        assert all((d == 1.0).all() for d in data)
        # The tag is free again, and dtypes that agree gather.
        results = await run_all(comms, lambda i, c: c.all_gather(data[i][: i + 1], tag=4))
        assert all(isinstance(r, dict) and len(r) == WORLD for r in results), results
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_parts_kept_from_one_call_are_not_overwritten_by_the_next(
    cluster: Cluster, clock: object,
) -> None:
    """The buffer of a call whose parts the caller dropped is reused by the next call
    of the tag; one whose parts it keeps never is."""
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        first = await run_all(comms, lambda i, c: c.all_gather(np.full(4, i, np.float32), tag=6))
        kept = [{p: v.copy() for p, v in parts.items()} for parts in first]  # type: ignore[union-attr]
        for round_ in range(3):
            await run_all(comms, lambda i, c, r=round_: c.all_gather(
                np.full(4, 10 * (r + 1) + i, np.float32), tag=6,
            ))
        for parts, copies in zip(first, kept, strict=True):
            assert isinstance(parts, dict)
            assert all(parts[p].tobytes() == copies[p].tobytes() for p in copies)
        await run_all(comms, lambda i, c: c.aclose())
