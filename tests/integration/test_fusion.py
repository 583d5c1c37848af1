"""``all_reduce_multiple_with_retry`` with fusion: buckets, exactness, aborts, rejections."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import CollectiveInitiate
from pccl_trio.peer._requests import ReduceRequest
from pccl_trio.testing import PeerSeam

from .conftest import WITH_BLOCKING, Cluster, fine, form_run, run_all, started

NETWORKS = WITH_BLOCKING

BUCKET = 4096


@dataclasses.dataclass(frozen=True)
class Vote:
    tag: int
    count: int
    buffer: int


@pytest.fixture
def votes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Vote]]:
    """Every all-reduce attempt any peer makes (its vote, or the descriptor it runs
    under a lease with): its tag, count and buffer address."""
    seen: list[Vote] = []
    real = ReduceRequest.vote

    def vote(self: ReduceRequest, slice_bytes: int, *, lease: bool = False) -> CollectiveInitiate:
        seen.append(Vote(tag=self.tag, count=int(self.result.size),
                         buffer=int(self.result.ctypes.data)))
        return real(self, slice_bytes, lease=lease)

    monkeypatch.setattr(ReduceRequest, "vote", vote)
    yield seen


def bucketed(cluster: Cluster, bucket_bytes: int = BUCKET) -> None:
    cluster.config = dataclasses.replace(cluster.config, bucket_bytes=bucket_bytes)


#: (dtype, count) of one step's tensors, in order: tiny ones, one exactly the bucket,
#: one a byte short of it, larger ones, mixed dtypes interleaved.
LAYOUT: list[tuple[type[np.generic], int]] = [
    (np.float32, 3), (np.float16, 100), (ml_dtypes.bfloat16, 50), (np.float64, 200),
    (np.int32, BUCKET // 4), (np.float32, 10), (np.uint8, 4095), (np.float32, 5000),
    (np.float16, 7), (np.int64, 1), (np.float32, 0), (np.int8, 300), (np.float64, 300),
    (np.float32, 1000), (np.float32, 24), (ml_dtypes.bfloat16, 3000), (np.int32, 9),
]


#: The buckets of LAYOUT at BUCKET bytes: (0, 5, 10, 13), (1, 8), (2,), (3, 12),
#: (4,), (6,), (7,), (9,), (11,), (14,), (15,), (16,); their element counts by tag.
PLANNED_COUNTS = [1013, 107, 50, 500, 1024, 4095, 5000, 1, 300, 24, 3000, 9]
LONE = (4, 6, 7, 9, 11, 14, 15, 16)


def step_inputs(seed: int, world: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """A base per tensor, and per peer its inputs: base + rank, small integers that
    every dtype holds exactly, so SUM is 3 * base + 3 and AVG base + 1 at W=3."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 30, count).astype(dtype) for dtype, count in LAYOUT]
    return bases, [[(b.astype(np.float64) + rank).astype(b.dtype) for b in bases]
                   for rank in range(world)]


def expected(base: np.ndarray, op: pccl.ReduceOp, world: int) -> np.ndarray:
    wide = base.astype(np.float64)
    total = world * wide + world * (world - 1) / 2
    return (total if op is pccl.ReduceOp.SUM else total / world).astype(base.dtype)


@pytest.mark.parametrize("network_kind", ["memory", "tcp"])
@pytest.mark.parametrize("op", [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG])
async def test_fused_results_are_exact_and_identical(
    cluster: Cluster, clock: object, votes: list[Vote], op: pccl.ReduceOp
) -> None:
    bucketed(cluster)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        bases, tensors = step_inputs(7, 3)
        infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(
            tensors[i], op=op, max_in_flight=4))
        assert all(isinstance(info, pccl.ReduceInfo) and info.world_size == 3
                   for info in infos), infos
        # ReduceInfo sums over the buckets: over the peers, a ring all-reduce sends
        # (and receives) every byte 2(W-1) times.
        payload = 2 * 2 * sum(base.nbytes for base in bases)
        assert sum(info.tx_bytes for info in infos) == payload  # type: ignore[attr-defined]
        assert sum(info.rx_bytes for info in infos) == payload  # type: ignore[attr-defined]
        for t, base in enumerate(bases):
            want = expected(base, op, 3)
            for rank in range(3):
                assert tensors[rank][t].dtype == base.dtype
                assert tensors[rank][t].tobytes() == want.tobytes(), (rank, t)
        # One vote per bucket and peer, tagged by bucket: the plan of the docs (by
        # dtype, in order, up to BUCKET bytes; tensors 4, 7 and 15 too large).
        counts = {v.tag: v.count for v in votes}
        assert len(votes) == 3 * len(counts), votes
        assert counts == dict(enumerate(PLANNED_COUNTS)), counts
        # A bucket of one tensor is voted on the caller's own buffer (zero-copy).
        lone = {int(tensors[r][t].ctypes.data) for r in range(3) for t in LONE}
        assert lone <= {v.buffer for v in votes}
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_torch_tensors_fuse_with_numpy_arrays(
    cluster: Cluster, clock: object, votes: list[Vote]
) -> None:
    torch = pytest.importorskip("torch")
    bucketed(cluster)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        tensors = [[
            torch.full((4, 5), rank + 1, dtype=torch.float32),  # fused with the next two
            np.full(30, rank + 1, dtype=np.float32),
            torch.full((7,), rank + 1, dtype=torch.bfloat16),
            torch.full((3, 3), rank + 1, dtype=torch.float32),
            torch.full((2, 2048), rank + 1, dtype=torch.float32),  # 32 KiB: alone
            torch.full((5,), rank + 1, dtype=torch.bfloat16),
        ] for rank in range(3)]
        pointers = [tensors[rank][4].data_ptr() for rank in range(3)]
        infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(tensors[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        for rank in range(3):
            for t, tensor in enumerate(tensors[rank]):
                assert bool((tensor == 6).all()), (rank, t)
            assert tensors[rank][4].shape == (2, 2048)
        assert sorted({(v.tag, v.count) for v in votes}) == [(0, 59), (1, 12), (2, 4096)]
        assert set(pointers) <= {v.buffer for v in votes}  # the large one: zero-copy
        for comm in comms:
            await comm.aclose()


def per_tensor_outcomes(
    data: list[list[np.ndarray]], tensors: list[list[np.ndarray]], ranks: list[int],
    survivors: list[int],
) -> list[str]:
    """Per tensor, ``old`` (all ``ranks``' sum) or ``new`` (the survivors'), checked
    identical on every survivor."""
    outcomes = []
    for t in range(len(data[0])):
        old = np.sum([data[r][t] for r in ranks], axis=0, dtype=data[0][t].dtype)
        new = np.sum([data[r][t] for r in survivors], axis=0, dtype=data[0][t].dtype)
        first = tensors[survivors[0]][t].tobytes()
        assert all(tensors[r][t].tobytes() == first for r in survivors), t
        assert first in (old.tobytes(), new.tobytes()), t
        outcomes.append("old" if first == old.tobytes() else "new")
    return outcomes


async def kill_during(
    cluster: Cluster, comms: list[pccl.Communicator], victim: int, tag: int,
    call: Callable[[int, pccl.Communicator], object],
) -> list[object]:
    """Every peer runs ``call``; ``victim`` dies once the others' all-reduce ``tag``
    moves data. The survivors' outcomes."""
    survivors = [c for i, c in enumerate(comms) if i != victim]
    outcome: list[object] = []
    async with trio.open_nursery() as nursery:

        async def survivors_run() -> None:
            outcome.extend(await run_all(
                survivors, lambda i, c: call(comms.index(c), c)))

        nursery.start_soon(survivors_run)
        nursery.start_soon(run_all, [comms[victim]], lambda i, c: call(victim, c))
        await started(survivors[0], tag)
        await cluster.kill(f"p{victim}", comms[victim])
    return outcome


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("leased", [False, True], ids=["first-step", "leased-step"])
async def test_kill_mid_step_retries_buckets_on_the_survivors(
    cluster: Cluster, clock: object, votes: list[Vote], leased: bool
) -> None:
    """Several buckets in flight when a peer dies: every tensor ends as the old
    world's or the new world's result, identical on the survivors, and each bucket's
    members alike. ``leased``: a step ran before, so the buckets' tags are leased and
    the step the kill hits runs without the master."""
    cluster.config = fine(cluster)
    bucketed(cluster, 1 << 20)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(3)])
        sizes = [50_000, 50_000, 30_000, 20_000, 40_000, 60_000, 50_000, 10_000, 70_000,
                 5_000, 80_000, 50_000]  # int64, in buckets of up to 1 MiB
        data = [[np.full(n, 10 * rank + t, dtype=np.int64) for t, n in enumerate(sizes)]
                for rank in range(3)]
        if leased:
            warm = [[a.copy() for a in row] for row in data]
            infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(warm[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            assert all(PeerSeam(c).leased(0) for c in comms)
        tensors = [[a.copy() for a in row] for row in data]
        outcome = await kill_during(
            cluster, comms, 1, 1,
            lambda i, c: c.all_reduce_multiple_with_retry(tensors[i], max_in_flight=3))
        assert all(isinstance(o, pccl.ReduceInfo) and o.world_size == 2 for o in outcome), \
            outcome
        results = per_tensor_outcomes(data, tensors, [0, 1, 2], [0, 2])
        assert "new" in results  # the kill mattered: some buckets were retried
        buckets = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10), (11,)]
        assert {v.tag for v in votes} == set(range(len(buckets)))  # voted by bucket
        for bucket in buckets:
            assert len({results[t] for t in bucket}) == 1, (bucket, results)
        for i in (0, 2):
            await comms[i].aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_an_aborted_bucket_leaves_its_tensors_holding_their_inputs(
    cluster: Cluster, clock: object
) -> None:
    """Two peers; one dies while a bucket is in flight: the survivor raises
    TooFewPeers, and each tensor holds its input (its bucket aborted or never run)
    or the two peers' sum (its bucket done), a bucket's members alike."""
    cluster.config = fine(cluster)
    bucketed(cluster, 1 << 20)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(2)])
        data = [[np.full(50_000, 10 * rank + t + 1, dtype=np.int64) for t in range(10)]
                for rank in range(2)]
        tensors = [[a.copy() for a in row] for row in data]
        outcome = await kill_during(
            cluster, comms, 1, 1,
            lambda i, c: c.all_reduce_multiple_with_retry(tensors[i], max_in_flight=2))
        assert len(outcome) == 1 and isinstance(outcome[0], pccl.TooFewPeers), outcome
        states = []
        for t in range(10):
            held = tensors[0][t].tobytes()
            summed = (data[0][t] + data[1][t]).tobytes()
            assert held in (data[0][t].tobytes(), summed), t
            states.append("input" if held == data[0][t].tobytes() else "sum")
        assert "input" in states, states
        for bucket in [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]:
            assert len({states[t] for t in bucket}) == 1, (bucket, states)
        await comms[0].aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_rejected_bucket_names_its_tensors(cluster: Cluster, clock: object) -> None:
    """The peers pass different lists: the bucket they disagree on is rejected on
    every peer, naming its tensors, which hold their inputs; the others complete."""
    bucketed(cluster)
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        tensors = [
            [np.full(2048, 1.0, np.float32), np.full(5, 1.0, np.float64),
             np.full(6, 1.0, np.float64), np.full(7, 1.0, np.float64)],
            [np.full(2048, 2.0, np.float32), np.full(5, 2.0, np.float64),
             np.full(6, 2.0, np.float64)],
        ]
        outcome = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(tensors[i]))
        for rank, error in enumerate(outcome):
            assert isinstance(error, pccl.InvalidArgument), outcome
            members = [1, 2, 3] if rank == 0 else [1, 2]
            assert f"(tensors {members}; fused in buckets [1]" in str(error), error
            assert "Config.bucket_bytes" in str(error)
            assert np.all(tensors[rank][0] == 3.0)  # its own bucket completed
            assert all(np.all(t == rank + 1) for t in tensors[rank][1:])
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_quantized_tensors_are_not_fused(
    cluster: Cluster, clock: object, votes: list[Vote]
) -> None:
    bucketed(cluster)
    quantization = pccl.QuantizationOptions(
        algorithm=pccl.QuantizationAlgorithm.MIN_MAX, quantized_datatype=pccl.DataType.UINT8)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        tensors = [[np.full(10 + t, float(t + rank), np.float32) for t in range(5)]
                   for rank in range(3)]
        infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(
            tensors[i], quantization=quantization))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert sorted({(v.tag, v.count) for v in votes}) == [(t, 10 + t) for t in range(5)]
        assert all((tensors[r][t] == 3 * t + 3).all() for r in range(3) for t in range(5))
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_bucket_bytes_zero_is_one_all_reduce_per_tensor(
    cluster: Cluster, clock: object, votes: list[Vote]
) -> None:
    bucketed(cluster, 0)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        tensors = [[np.full(3 + t, rank + 1, np.int32) for t in range(4)] for rank in range(2)]
        infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(tensors[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert sorted({(v.tag, v.count) for v in votes}) == [(t, 3 + t) for t in range(4)]
        assert all(np.all(t == 3) for row in tensors for t in row)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_bad_tensor_is_named_by_its_index_before_anything_runs(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        good = np.ones(8, dtype=np.float32)
        strided = np.ones((4, 4), dtype=np.float32)[:, :2]
        with pytest.raises(pccl.InvalidArgument, match=r"^tensors\[1\]: the array is not C-contiguous"):
            await comms[0].all_reduce_multiple_with_retry([good, strided])
        assert bool((good == 1).all())
        for comm in comms:
            await comm.aclose()


async def test_a_bucket_of_empty_tensors_is_an_empty_all_reduce(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        tensors = [[np.zeros(0, np.float32), np.zeros((2, 0), np.float32),
                    np.full(5, rank + 1, np.int32)] for rank in range(2)]
        infos = await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(tensors[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(row[2].tolist() == [3] * 5 and row[0].size == row[1].size == 0 for row in tensors)
        for comm in comms:
            await comm.aclose()
