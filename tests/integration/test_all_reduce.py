"""All-reduce over both networks: results, concurrency, arguments, and failures."""

from __future__ import annotations

import dataclasses
import pickle
import traceback

import ml_dtypes
import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import PeerSeam

from .conftest import SMALL, WITH_BLOCKING, Cluster, form_run, make_run, run_all

NETWORKS = WITH_BLOCKING

DTYPES = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]


def inputs(world: int, count: int, dtype: object, seed: int) -> list[np.ndarray]:
    """Small integer values: every op's exact result is representable in every dtype."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4, size=count).astype(dtype) for _ in range(world)]


def expected(arrays: list[np.ndarray], op: pccl.ReduceOp) -> np.ndarray:
    wide = [a.astype(np.float64) for a in arrays]
    if op is pccl.ReduceOp.SUM:
        out = np.sum(wide, axis=0)
    elif op is pccl.ReduceOp.AVG:
        out = np.sum(wide, axis=0) / len(arrays)
        if np.issubdtype(arrays[0].dtype, np.integer):
            out = np.trunc(out)
    elif op is pccl.ReduceOp.PROD:
        out = np.prod(wide, axis=0)
    elif op is pccl.ReduceOp.MAX:
        out = np.max(wide, axis=0)
    else:
        out = np.min(wide, axis=0)
    return out.astype(arrays[0].dtype)



@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "into_recv"])
async def test_every_dtype_and_op_is_exact_and_bit_identical(
    cluster: Cluster, clock: object, in_place: bool
) -> None:
    with trio.fail_after(300):
        comms = await make_run(cluster, 3, SMALL, pool=2)
        for dtype in DTYPES:
            for op in pccl.ReduceOp:
                for count in (1, 3, 1025):
                    data = inputs(3, count, dtype, seed=count)
                    sends = [d.copy() for d in data]
                    recvs = [np.zeros_like(d) for d in data]

                    async def call(
                        i: int, comm: pccl.Communicator, sends: list[np.ndarray] = sends,
                        recvs: list[np.ndarray] = recvs, op: pccl.ReduceOp = op,
                    ) -> pccl.ReduceInfo:
                        return await comm.all_reduce(
                            sends[i], None if in_place else recvs[i], op=op, tag=7
                        )

                    infos = await run_all(comms, call)
                    assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
                    results = sends if in_place else recvs
                    want = expected(data, op)
                    for i, result in enumerate(results):
                        assert result.tobytes() == results[0].tobytes(), (dtype, op, count)
                        np.testing.assert_array_equal(
                            result.astype(np.float64), want.astype(np.float64),
                            err_msg=f"{np.dtype(dtype)} {op} {count}",
                        )
                        if not in_place:
                            assert sends[i].tobytes() == data[i].tobytes()  # untouched
        for comm in comms:
            await comm.aclose()


async def test_bytes_moved_match_the_ring(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, 4)
        count = 300007
        arrays = [np.full(count, i, dtype=np.float32) for i in range(4)]

        async def call(i: int, comm: pccl.Communicator) -> pccl.ReduceInfo:
            return await comm.all_reduce(arrays[i])

        infos = await run_all(comms, call)
        ideal = 2 * 3 / 4 * count * 4
        for info in infos:
            assert isinstance(info, pccl.ReduceInfo)
            assert info.world_size == 4
            assert abs(info.tx_bytes - ideal) / ideal < 0.01
            assert abs(info.rx_bytes - ideal) / ideal < 0.01
        assert all((a == 6).all() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_six_concurrent_tags(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, 3, SMALL, pool=3)
        arrays = [[np.full(5000 + tag, tag + rank, dtype=np.int64) for tag in range(6)]
                  for rank in range(3)]

        async def call(i: int, comm: pccl.Communicator) -> list[pccl.ReduceInfo]:
            handles = [comm.all_reduce_async(arrays[i][tag], tag=tag) for tag in range(6)]
            return [await h.wait() for h in handles]

        results = await run_all(comms, call)
        assert all(isinstance(r, list) for r in results), results
        for rank in range(3):
            for tag in range(6):
                assert (arrays[rank][tag] == 3 * tag + 3).all()
        for comm in comms:
            await comm.aclose()


async def test_disagreeing_peers_get_invalid_argument(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, 3)
        arrays = [np.ones(10 + (i == 2), dtype=np.float32) for i in range(3)]
        originals = [a.copy() for a in arrays]

        async def call(i: int, comm: pccl.Communicator) -> object:
            return await comm.all_reduce(arrays[i], tag=3)

        results = await run_all(comms, call)
        for result in results:
            assert isinstance(result, pccl.InvalidArgument), result
            assert "count=10" in str(result) and "count=11" in str(result)
            # Tracebacks name the class callers catch.
            shown = "".join(traceback.format_exception_only(result))
            assert shown.startswith("pccl_trio._errors.InvalidArgument: "), shown
            again = pickle.loads(pickle.dumps(result))  # e.g. to another process
            assert type(again) is pccl.InvalidArgument and str(again) == str(result)
        assert all(a.tobytes() == o.tobytes() for a, o in zip(arrays, originals, strict=True))
        # The run goes on: an agreeing all-reduce works right after.
        arrays = [np.ones(10, dtype=np.float32) for _ in range(3)]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], tag=3))
        assert all(isinstance(r, pccl.ReduceInfo) for r in results)
        assert all((a == 3).all() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_peers_with_different_slice_sizes_get_invalid_argument(
    cluster: Cluster, clock: object
) -> None:
    """Peers that cut their buffers into slices of different sizes could never
    reassemble each other's frames: the master refuses the all-reduce for all of them,
    saying which setting differs, instead of letting every attempt abort."""
    with trio.fail_after(120):
        assert cluster.config.slice_bytes == 4 << 20
        configs = [cluster.config, dataclasses.replace(cluster.config, slice_bytes=1 << 20)]
        comms = []
        for i in range(3):
            cluster.config = configs[i == 2]
            comms.append(cluster.communicator(f"p{i}"))
        cluster.config = configs[0]
        comms = await form_run([], comms)
        arrays = [np.arange(100_000, dtype=np.float32) for _ in range(3)]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        for result in results:
            assert isinstance(result, pccl.InvalidArgument), result
            assert "slice_bytes=1048576" in str(result) and "slice_bytes=4194304" in str(result)
            assert "Config.slice_bytes" in str(result)
        assert all((a == np.arange(100_000, dtype=np.float32)).all() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_usage_errors(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, 2)
        comm = comms[0]
        with pytest.raises(pccl.InvalidArgument, match="contiguous"):
            comm.all_reduce_async(np.ones((4, 4), np.float32)[:, 1])
        with pytest.raises(pccl.InvalidArgument, match="dtype"):
            comm.all_reduce_async(np.ones(4, np.complex64))
        with pytest.raises(pccl.InvalidArgument, match="recv"):
            comm.all_reduce_async(np.ones(4, np.float32), np.ones(5, np.float32))
        with pytest.raises(pccl.InvalidArgument, match="tag"):
            comm.all_reduce_async(np.ones(4, np.float32), tag=-1)
        with pytest.raises(pccl.InvalidArgument, match="quantization"):
            comm.all_reduce_async(np.ones(4, np.float32), quantization="uint8")  # type: ignore[arg-type]
        pending = comm.all_reduce_async(np.ones(4, np.float32), tag=5)
        with pytest.raises(pccl.InvalidUsage, match="already in flight"):
            comm.all_reduce_async(np.ones(4, np.float32), tag=5)
        with pytest.raises(pccl.InvalidUsage, match="in flight"):
            await comm.update_topology()
        other = np.ones(4, np.float32)
        await comms[1].all_reduce(other, tag=5)
        assert (await pending.wait()).world_size == 2
        assert (other == 2).all()
        for c in comms:
            await c.aclose()


async def test_single_peer_is_too_few(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        async with cluster.communicator("p0") as comm:
            with pytest.raises(pccl.TooFewPeers):
                await comm.all_reduce(np.ones(3, np.float32))
            with pytest.raises(pccl.TooFewPeers):
                await comm.all_reduce_multiple_with_retry([np.ones(3, np.float32)])


@pytest.mark.parametrize("threaded", [True, False], ids=["threads", "trio_tasks"])
async def test_both_data_path_drivers(cluster: Cluster, clock: object, threaded: bool) -> None:
    """TCP connections are driven by threads unless turned off; the in-memory network
    always uses trio tasks. Either way results are exact, alone and concurrent."""
    with trio.fail_after(120):
        cluster.config = dataclasses.replace(cluster.config, slice_bytes=4096,
                                             threaded_data_path=threaded)
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(3)])
        link_types = {type(stream).__name__ for c in comms
                      for stream in PeerSeam(c).connections()}
        on_threads = threaded and cluster.memory is None
        assert link_types == ({"SocketLink"} if on_threads else {"FramedStream"})
        arrays = [[np.arange(20_000 + tag, dtype=np.float64) * (rank + 1) for tag in range(4)]
                  for rank in range(3)]

        async def call(i: int, comm: pccl.Communicator) -> list[pccl.ReduceInfo]:
            handles = [comm.all_reduce_async(arrays[i][tag], tag=tag) for tag in range(4)]
            infos = [await h.wait() for h in handles]
            infos.append(await comm.all_reduce(arrays[i][0], op=pccl.ReduceOp.MAX, tag=9))
            return infos

        results = await run_all(comms, call)
        assert all(isinstance(r, list) for r in results), results
        for tag in range(4):
            want = np.arange(20_000 + tag, dtype=np.float64) * 6
            for rank in range(3):
                assert arrays[rank][tag].tobytes() == want.tobytes()
        for comm in comms:
            await comm.aclose()
