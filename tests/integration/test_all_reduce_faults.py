"""All-reduce under failure: kills, silent partitions and cancellation mid-operation."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import PeerSeam

from .conftest import Cluster, fine, form_run, run_all, started


@pytest.mark.parametrize("victim", [0, 2], ids=["kill-rank0", "kill-rank2"])
async def test_kill_mid_all_reduce(cluster: Cluster, clock: object, victim: int) -> None:
    cluster.config = fine(cluster) if cluster.memory is not None else cluster.config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(4)])
        count = 400_000
        data = [np.arange(count, dtype=np.float32) + i for i in range(4)]
        arrays = [d.copy() for d in data]
        survivors = [c for i, c in enumerate(comms) if i != victim]

        async def call(i: int, comm: pccl.Communicator) -> None:
            with pytest.raises(pccl.PCCLError):  # the victim dies mid-call
                await comm.all_reduce(arrays[i])

        async with trio.open_nursery() as nursery:
            results: list[object] = []

            async def survivors_run() -> None:
                results.extend(await run_all(
                    survivors, lambda i, c: c.all_reduce(arrays[comms.index(c)])))

            nursery.start_soon(survivors_run)
            nursery.start_soon(call, victim, comms[victim])
            await started(survivors[0], 0)
            await cluster.kill(f"p{victim}", comms[victim])
        # The same verdict everywhere; an abort restores every input bit for bit.
        kinds = {type(r) for r in results}
        assert len(kinds) == 1, results
        if isinstance(results[0], pccl.CollectiveAborted):
            for comm in survivors:
                i = comms.index(comm)
                assert arrays[i].tobytes() == data[i].tobytes()
        else:  # finished before the kill could matter: the old world's sum
            assert all((arrays[comms.index(c)] == sum(data)).all() for c in survivors)
            return
        # A retry runs on the survivors (the ring was re-established) and is exact.
        infos = await run_all(survivors, lambda i, c: c.all_reduce(arrays[comms.index(c)]))
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
        want = sum(d for i, d in enumerate(data) if i != victim)
        for comm in survivors:
            assert arrays[comms.index(comm)].tobytes() == want.tobytes()
        for comm in survivors:
            await comm.aclose()


async def test_kill_inside_multiple_with_retry(cluster: Cluster, clock: object) -> None:
    cluster.config = fine(cluster) if cluster.memory is not None else cluster.config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(3)])
        n_tensors = 8
        data = [[np.full(50_000, 10 * rank + t, dtype=np.int64) for t in range(n_tensors)]
                for rank in range(3)]
        tensors = [[a.copy() for a in row] for row in data]
        victim = 1
        survivors = [0, 2]

        async with trio.open_nursery() as nursery:
            outcome: list[object] = []

            async def survivors_run() -> None:
                outcome.extend(await run_all(
                    [comms[i] for i in survivors],
                    lambda i, c: c.all_reduce_multiple_with_retry(
                        tensors[comms.index(c)], max_in_flight=3),
                ))

            nursery.start_soon(survivors_run)

            async def victim_run() -> None:
                try:
                    await comms[victim].all_reduce_multiple_with_retry(tensors[victim],
                                                                      max_in_flight=3)
                except pccl.PCCLError:
                    pass

            nursery.start_soon(victim_run)
            await started(comms[0], 1)
            await cluster.kill(f"p{victim}", comms[victim])
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        for t in range(n_tensors):
            old = sum(data[r][t] for r in range(3))
            new = sum(data[r][t] for r in survivors)
            first = tensors[survivors[0]][t]
            assert first.tobytes() in (old.tobytes(), new.tobytes()), t
            for r in survivors:
                assert tensors[r][t].tobytes() == first.tobytes()
        for i in survivors:
            await comms[i].aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_silent_peer_mid_all_reduce(cluster: Cluster, clock: object) -> None:
    cluster.config = fine(cluster)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(200_000, dtype=np.float64) * (i + 1) for i in range(3)]
        arrays = [d.copy() for d in data]
        async with trio.open_nursery() as nursery:
            results: list[object] = []

            async def survivors_run() -> None:
                results.extend(await run_all(
                    comms[:2], lambda i, c: c.all_reduce(arrays[i])))

            nursery.start_soon(survivors_run)
            nursery.start_soon(run_all, comms[2:], lambda i, c: c.all_reduce(arrays[2]))
            await started(comms[0], 0)
            start = trio.current_time()
            cluster.partition("p2")
        elapsed = trio.current_time() - start
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        assert elapsed <= cluster.config.liveness_timeout + cluster.config.heartbeat_interval
        for i in range(2):
            assert arrays[i].tobytes() == data[i].tobytes()
        infos = await run_all(comms[:2], lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert (arrays[0] == data[0] + data[1]).all() and (arrays[1] == arrays[0]).all()
        for comm in comms:
            await comm.aclose()


async def test_cancelled_all_reduce_aborts_for_everyone(cluster: Cluster, clock: object) -> None:
    cluster.config = fine(cluster) if cluster.memory is not None else cluster.config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(300_000, dtype=np.int32) + i for i in range(3)]
        arrays = [d.copy() for d in data]
        async with trio.open_nursery() as nursery:
            results: list[object] = []

            async def others() -> None:
                results.extend(await run_all(comms[1:], lambda i, c: c.all_reduce(arrays[i + 1])))

            nursery.start_soon(others)
            with trio.CancelScope() as scope:
                async def cancel_when_started() -> None:
                    await started(comms[0], 0)
                    scope.cancel()

                nursery.start_soon(cancel_when_started)
                await comms[0].all_reduce(arrays[0])
        assert scope.cancelled_caught
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        for i in range(3):
            assert arrays[i].tobytes() == data[i].tobytes()
        # Everyone is still in the run, and the next all-reduce works.
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
        assert all(a.tobytes() == sum(data).tobytes() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_no_open_connection_to_the_successor_aborts_cleanly(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        # Every connection this peer sends on is gone (as after torn sends).
        for stream in PeerSeam(comms[0]).sending_connections():
            await stream.aclose()
        arrays = [np.full(1000, i + 1, dtype=np.int32) for i in range(3)]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        assert all((a == i + 1).all() for i, a in enumerate(arrays))
        # The abort re-established the ring, reopening the pool: the retry works.
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        assert all((a == 6).all() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_malformed_data_frames_abort_instead_of_hanging(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every peer's first data frame of tag 7 arrives with a header that is not a data
    frame: each reader drops its connection before any slice is claimed, so nothing
    arrives anywhere and no sender hits a broken pipe (over TCP; the in-memory network's
    small buffers may break a send first). The readers' errors alone must abort the
    collective for everyone (inputs restored); then a retry works."""
    import pccl_trio.transport._blocking as blocking
    import pccl_trio.transport._framed as framed

    real = framed.encode_data_header

    def poisoned(*, tag: int, seq: int, offset: int, nbytes: int, trailer: int = 0) -> bytes:
        header = bytearray(real(tag=tag, seq=seq, offset=offset, nbytes=nbytes, trailer=trailer))
        if tag == 7:
            header[4] = 0  # the frame type byte: not DATA
        return bytes(header)

    monkeypatch.setattr(framed, "encode_data_header", poisoned)
    monkeypatch.setattr(blocking, "encode_data_header", poisoned)
    # One slice per segment: after its first frame no sender has anything to send.
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(10_000, dtype=np.int64) * (i + 1) for i in range(3)]
        arrays = [d.copy() for d in data]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], tag=7))
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        for i in range(3):
            assert arrays[i].tobytes() == data[i].tobytes()
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], tag=8))
        assert all(isinstance(r, pccl.ReduceInfo) for r in infos), infos
        for i in range(3):
            assert arrays[i].tobytes() == (data[0] * 6).tobytes()
        for comm in comms:
            await comm.aclose()


async def test_an_internal_error_after_voting_still_gives_the_others_a_verdict(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug inside one peer's part of a commenced all-reduce is reported to its caller,
    and that peer leaves the run (it can no longer follow the protocol), so the others
    get an aborted verdict instead of waiting for it, and go on without it."""
    from pccl_trio.peer._allreduce import AllReduceAttempt

    real = AllReduceAttempt.send_all

    async def broken(self: AllReduceAttempt, connections: object) -> None:
        if self.schedule.rank == 0:
            raise RuntimeError("a bug in the data path")
        await real(self, connections)  # type: ignore[arg-type]

    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(5_000, dtype=np.float64) + i for i in range(3)]
        arrays = [d.copy() for d in data]
        bad = [c.ring.index(c.peer_id) for c in comms].index(0)
        monkeypatch.setattr(AllReduceAttempt, "send_all", broken)
        outcomes: list[object] = [None] * 3

        async def one(i: int) -> None:
            try:
                outcomes[i] = await comms[i].all_reduce(arrays[i])
            except Exception as exc:  # noqa: BLE001 - sorted out below
                outcomes[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        assert "a bug in the data path" in repr(outcomes[bad]), outcomes
        good = [i for i in range(3) if i != bad]
        assert all(isinstance(outcomes[i], pccl.CollectiveAborted) for i in good), outcomes
        for i in range(3):
            assert arrays[i].tobytes() == data[i].tobytes()
        with pytest.raises(pccl.InvalidUsage, match="internal error"):
            await comms[bad].all_reduce(arrays[bad])
        monkeypatch.setattr(AllReduceAttempt, "send_all", real)
        infos = await run_all([comms[i] for i in good],
                              lambda j, c: c.all_reduce(arrays[good[j]]))
        assert all(isinstance(r, pccl.ReduceInfo) and r.world_size == 2 for r in infos), infos
        for i in good:
            assert arrays[i].tobytes() == (data[good[0]] + data[good[1]]).tobytes()
        for comm in comms:
            await comm.aclose()
