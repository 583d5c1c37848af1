"""Leases: a tag's repeated all-reduces run without the master, and every way one can
end while attempts run under it leaves every peer with the same outcome.

Each test first runs the tag once through the master (which leases it), so that what
follows runs under the lease. The master's run events (logged by
``pccl_trio.master.run``) show what it decided; under a lease it decides nothing until
the lease ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio.ops import Gathered
from pccl_trio.testing import PeerSeam

from .conftest import WITH_BLOCKING, Cluster, die_mid_all_reduce, fine, form_run, run_all

NETWORKS = WITH_BLOCKING

COUNT = 50_000


@pytest.fixture
def decided(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """The master's decisions, as it reports them: one line per collective's verdict
    (``completed``), lease granted (``leased``) or lease ended (``lease_ended``)."""
    caplog.set_level(logging.DEBUG, logger="pccl_trio.master.run")
    lines: list[str] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("collective tag") and " aborted: " not in message:
                lines.append(f"completed {message}")
            elif " leases tag " in message:
                lines.append(f"leased {message}")
            elif "lease on tag" in message and "ended after" in message:
                lines.append(f"lease_ended {message}")

    handler = Watch()
    logger = logging.getLogger("pccl_trio.master.run")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def kinds(lines: list[str]) -> list[str]:
    return [line.split(" ", 1)[0] for line in lines]


async def leased(comms: list[pccl.Communicator], arrays: list[np.ndarray]) -> None:
    """Run tag 0 once through the master: it leases the tag to the group."""
    infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i].copy()))
    assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos


async def retried(comm: pccl.Communicator, array: np.ndarray) -> pccl.ReduceInfo:
    """``all_reduce`` retried after aborts, as a training loop does."""
    while True:
        try:
            return await comm.all_reduce(array)
        except pccl.CollectiveAborted:
            continue


def inputs(world: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(COUNT).astype(np.float32) for _ in range(world)]


async def test_repeated_all_reduces_run_without_the_master(
    cluster: Cluster, clock: object, decided: list[str]
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        for step in range(6):
            arrays = inputs(3, seed=step)
            await run_all(
                comms, lambda i, c, arrays=arrays: c.all_reduce(arrays[i], op=pccl.ReduceOp.AVG)
            )
            assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
            exact = (inputs(3, seed=step)[0].astype(np.float64) + inputs(3, seed=step)[1]
                     + inputs(3, seed=step)[2]) / 3
            assert np.allclose(arrays[0], exact, atol=1e-5)
        # The first went through the master, which leased the tag; the other five it
        # never heard of.
        assert kinds(decided) == ["completed", "leased"], decided
        for comm in comms:
            await comm.aclose()


async def test_another_descriptor_ends_the_lease_and_is_rejected_everywhere(
    cluster: Cluster, clock: object, decided: list[str]
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        arrays = inputs(3)
        await leased(comms, arrays)
        # Peer 2 passes another count for the same tag: nobody's data is combined.
        wrong = [a.copy() for a in arrays]
        wrong[2] = wrong[2][: COUNT // 2].copy()
        before = [w.copy() for w in wrong]
        results = await run_all(comms, lambda i, c: c.all_reduce(wrong[i]))
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert all("disagree" in str(r) and f"count={COUNT // 2}" in str(r) for r in results)
        for array, original in zip(wrong, before, strict=True):
            assert array.tobytes() == original.tobytes()
        # The tag goes through the master again, and works (peer 2, which never ran
        # the rejected attempt, learns only now that the ring is re-established: its
        # next call is aborted once, and retried).
        infos = await run_all(comms, lambda i, c: retried(c, arrays[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("victim", [0, 2], ids=["kill-rank0", "kill-rank2"])
async def test_a_peer_killed_mid_leased_all_reduce(
    cluster: Cluster, clock: object, victim: int, decided: list[str]
) -> None:
    cluster.config = fine(cluster) if cluster.memory is not None else cluster.config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(4)])
        data = [np.arange(400_000, dtype=np.float32) + i for i in range(4)]
        await leased(comms, data)
        arrays = [d.copy() for d in data]
        survivors = [c for i, c in enumerate(comms) if i != victim]
        results = await die_mid_all_reduce(
            cluster, comms, victim, lambda i, c: c.all_reduce(arrays[i])
        )
        # One outcome for every survivor: aborted with its input back, or the old
        # world's sum, bit for bit the same.
        assert len({type(r) for r in results}) == 1, results
        outcome = [arrays[comms.index(c)] for c in survivors]
        if isinstance(results[0], pccl.CollectiveAborted):
            for comm in survivors:
                i = comms.index(comm)
                assert arrays[i].tobytes() == data[i].tobytes()
            infos = await run_all(survivors, lambda i, c: c.all_reduce(arrays[comms.index(c)]))
            assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
            want = sum(d for i, d in enumerate(data) if i != victim)
        else:
            want = sum(data)
            # It had finished everywhere before the kill took effect (over TCP the
            # attempt needs no master). The lease ends all the same, once the
            # survivors' next call finds a member gone: after that call, not before.
            infos = await run_all(survivors, lambda i, c: retried(c, data[comms.index(c)].copy()))
            assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
        for array in outcome:
            assert array.tobytes() == want.tobytes()
        assert "lease_ended" in kinds(decided)
        for comm in survivors:
            await comm.aclose()


async def test_a_silent_peer_is_removed_and_the_attempt_waiting_for_it_aborted(
    cluster: Cluster, clock: object
) -> None:
    """A peer falls silent (a pulled cable) as the others start an attempt under the
    lease: they wait for its data until the master removes it, then abort alike."""
    if cluster.memory is None:
        pytest.skip("silent partitions need the memory network")
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = inputs(3)
        await leased(comms, data)
        arrays = [d.copy() for d in data]
        cluster.partition("p2")
        results = await run_all(comms[:2], lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        for i in (0, 1):
            assert arrays[i].tobytes() == data[i].tobytes()
        infos = await run_all(comms[:2], lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 2 for i in infos), infos
        assert arrays[0].tobytes() == (data[0] + data[1]).tobytes()
        for comm in comms[:2]:
            await comm.aclose()


async def test_a_peer_that_computes_long_is_waited_for(
    cluster: Cluster, clock: object, decided: list[str]
) -> None:
    """Two peers start an attempt under the lease; the third computes for ten liveness
    timeouts first. Theirs is reported to the master as running long; the late peer
    joins that very attempt when it calls, and all succeed."""
    if cluster.memory is None:
        pytest.skip("a long computation in virtual time")
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = inputs(3)
        await leased(comms, data)
        arrays = [d.copy() for d in data]

        async def call(i: int, comm: pccl.Communicator) -> pccl.ReduceInfo:
            if i == 2:
                await trio.sleep(10 * cluster.config.liveness_timeout)
            return await comm.all_reduce(arrays[i])

        infos = await run_all(comms, call)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        assert np.allclose(arrays[0], data[0] + data[1] + data[2], atol=1e-5)
        # The master settled that attempt: the lease ended, the attempt succeeded.
        assert kinds(decided)[2:] == ["lease_ended", "completed"], decided
        assert "SUCCESS" in decided[-1]
        for comm in comms:
            await comm.aclose()


async def test_a_peer_in_a_sync_blocks_the_attempt_the_others_started(
    cluster: Cluster, clock: object
) -> None:
    """Two peers call the all-reduce, the third a shared-state sync (its sync failed
    where theirs succeeded, say): the two are told to sync, with their inputs back, and
    then everyone goes on."""
    if cluster.memory is None:
        pytest.skip("waits for the lease's report in virtual time")
    with trio.fail_after(600):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = inputs(3)
        await leased(comms, data)
        arrays = [d.copy() for d in data]
        states = [pccl.SharedState([pccl.TensorInfo("w", np.zeros(8, np.float32))])
                  for _ in comms]
        synced: list[object] = []

        async def syncing() -> None:
            synced.append(await comms[2].sync_shared_state(states[2]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(syncing)
            results = await run_all(comms[:2], lambda i, c: c.all_reduce(arrays[i]))
            assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
            assert all("synchronize the shared state" in str(r) for r in results), results
            for i in (0, 1):
                assert arrays[i].tobytes() == data[i].tobytes()
            await run_all(comms[:2], lambda i, c: c.sync_shared_state(states[i]))
        assert len(synced) == 1
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        for comm in comms:
            await comm.aclose()


@pytest.mark.async_only
async def test_a_cancelled_leased_all_reduce_leaves_its_input_and_aborts_the_others(
    cluster: Cluster, clock: object
) -> None:
    cluster.config = fine(cluster)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(400_000, dtype=np.float32) * (i + 1) for i in range(3)]
        await leased(comms, data)
        arrays = [d.copy() for d in data]
        outcome: list[object] = []

        async def cancelled() -> None:
            with trio.CancelScope() as scope:
                async def cancel_when_started() -> None:
                    # Once data arrived (or not at all, if it finished unseen).
                    while not outcome:
                        attempt = PeerSeam(comms[0]).attempt(0)
                        if attempt is not None and attempt.rx_bytes > 0:
                            scope.cancel()
                            return
                        await trio.lowlevel.checkpoint()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_when_started)
                    outcome.append(await comms[0].all_reduce(arrays[0]))
            if not outcome:
                outcome.append(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancelled)
            results = await run_all(comms[1:], lambda i, c: c.all_reduce(arrays[i + 1]))
        if outcome == [None]:  # the cancel took effect: aborted for everyone
            assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
            for i in range(3):
                assert arrays[i].tobytes() == data[i].tobytes()
        else:  # too late: it succeeded everywhere
            assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
            assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        # Everyone goes on.
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        for comm in comms:
            await comm.aclose()


async def test_leased_all_reduces_go_on_without_the_master(
    cluster: Cluster, clock: object
) -> None:
    """The master dies: all-reduces under a lease need it not, and succeed."""
    config = dataclasses.replace(cluster.config, master_grace=3600.0)
    cluster.config = config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = inputs(3)
        await leased(comms, data)
        cluster.master_scope.cancel()  # gone, and not coming back within the test
        for step in range(3):
            arrays = inputs(3, seed=10 + step)
            infos = await run_all(comms, lambda i, c, arrays=arrays: c.all_reduce(arrays[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        with trio.move_on_after(5):  # closing does not wait for a master
            for comm in comms:
                await comm.aclose()


async def test_quantized_nan_under_a_lease_is_rejected_for_everyone(
    cluster: Cluster, clock: object
) -> None:
    options = pccl.QuantizationOptions(
        quantized_datatype=pccl.DataType.UINT8, algorithm=pccl.QuantizationAlgorithm.MIN_MAX
    )
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = inputs(3)
        infos = await run_all(comms, lambda i, c: c.all_reduce(data[i].copy(), quantization=options))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        arrays = [d.copy() for d in data]
        arrays[1][17] = np.nan
        before = [a.copy() for a in arrays]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], quantization=options))
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert all("NaN" in str(r) for r in results), results
        for array, original in zip(arrays, before, strict=True):
            assert array.tobytes() == original.tobytes()
        for comm in comms:
            await comm.aclose()


async def test_a_peer_without_leases_keeps_the_tag_with_the_master(
    cluster: Cluster, clock: object, decided: list[str]
) -> None:
    """A lease needs every member to ask: one peer with ``Config(leases=False)`` keeps
    every all-reduce of the group with the master."""
    with trio.fail_after(120):
        plain = dataclasses.replace(cluster.config, leases=False)
        comms = [cluster.communicator("p0"), cluster.communicator("p1")]
        cluster.config = plain
        comms.append(cluster.communicator("p2"))
        comms = await form_run([], comms)
        for step in range(3):
            arrays = inputs(3, seed=step)
            await run_all(comms, lambda i, c, arrays=arrays: c.all_reduce(arrays[i]))
            assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        assert kinds(decided) == ["completed"] * 3, decided
        assert not PeerSeam(comms[0]).leased(0)
        for comm in comms:
            await comm.aclose()


async def test_a_bucket_reads_its_tensors_in_place_through_the_master_and_leased(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused bucket's input is its tensors where they lie: of the input, only this
    peer's own chunk is copied (into the result buffer, to be sent from there), once
    per attempt, before any of it leaves. Exact through the master and under a lease,
    whose part starts the moment the attempt is made (a reader thread may combine a
    frame into the result at once)."""
    cluster.config = dataclasses.replace(cluster.config, bucket_bytes=64 << 10)
    copied: list[tuple[int, int]] = []  # (bytes gathered, bytes of the bucket)
    real_gather = Gathered.gather

    def gather(self: Gathered, out: np.ndarray, start: int, stop: int) -> None:
        copied.append((stop - start, self.nbytes))
        real_gather(self, out, start, stop)

    monkeypatch.setattr(Gathered, "gather", gather)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        rng = np.random.default_rng(7)
        for step in range(3):  # the first through the master, the others leased
            data = [[rng.integers(0, 100, 2000).astype(np.int32) for _ in range(40)]
                    for _ in comms]
            tensors = [[t.copy() for t in row] for row in data]
            infos = await run_all(
                comms, lambda i, c, ts=tensors: c.all_reduce_multiple_with_retry(ts[i])
            )
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            for t in range(40):
                want = data[0][t] + data[1][t] + data[2][t]
                assert all((tensors[i][t] == want).all() for i in range(3)), (step, t)
        assert PeerSeam(comms[0]).leased(0)
        # 40 x 8000 bytes in 64 KiB buckets: 5 buckets of 8 tensors, each peer copying
        # a third of each (its own chunk), once per bucket and step.
        assert len(copied) == 3 * 5 * 3
        assert all(3 * chunk <= whole + 3 * 4 and whole == 8 * 8000 for chunk, whole in copied)
        for comm in comms:
            await comm.aclose()


@pytest.fixture
def run_events(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The master's run events, as logged (each record carries its ``run_event``)."""
    caplog.set_level(logging.DEBUG, logger="pccl_trio.master.run")
    return caplog


def kinds_of(caplog: pytest.LogCaptureFixture, kind: str) -> list[Any]:
    """The master's run events of ``kind`` (a ``RunKind`` value), as logged so far."""
    events = [r.run_event for r in caplog.records if hasattr(r, "run_event")]
    return [e for e in events if e.kind.value == kind]


@contextlib.asynccontextmanager
async def left(caplog: pytest.LogCaptureFixture, peers: int) -> AsyncIterator[trio.Event]:
    """An event set once the master has logged ``peers`` peers leaving in all."""
    gone = trio.Event()
    seen = len(kinds_of(caplog, "left"))

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal seen
            event = getattr(record, "run_event", None)
            if event is not None and event.kind.value == "left":
                seen += 1
            if seen >= peers:
                gone.set()

    handler = Watch()
    logger = logging.getLogger("pccl_trio.master.run")
    logger.addHandler(handler)
    try:
        yield gone
    finally:
        logger.removeHandler(handler)


def counted(records: pytest.LogCaptureFixture) -> tuple[int, int, int, int]:
    """(all-reduces the master decided a success of, all-reduces counted under leases,
    leases granted, leases ended), from the master's run events."""
    successes = sum(
        1 for e in kinds_of(records, "completed") if str(e.fields["outcome"]) == "success"
    )
    ended = kinds_of(records, "lease_ended")
    leased = sum(e.fields["attempts"] for e in ended)
    return successes, leased, len(kinds_of(records, "leased")), len(ended)


async def test_every_all_reduce_is_counted_when_the_run_ends_by_its_peers_leaving(
    cluster: Cluster, clock: object, run_events: pytest.LogCaptureFixture
) -> None:
    steps = 12
    with trio.fail_after(300):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        for step in range(steps):
            if step == steps // 2:
                # A joiner is admitted: the ring is installed anew, the lease ends.
                comms = await form_run(comms, [cluster.communicator("p2")])
            arrays = inputs(len(comms), seed=step)
            infos = await run_all(comms, lambda i, c, arrays=arrays: c.all_reduce(arrays[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        async with left(run_events, len(comms)) as gone:
            for comm in comms:  # the run ends: every peer leaves, one after another
                await comm.aclose()
            await gone.wait()  # until the master saw them leave
    successes, leased, granted, ended = counted(run_events)
    assert successes + leased == steps, (successes, leased)
    assert granted == ended == 2, (granted, ended)
    assert leased == steps - 2  # each lease's first all-reduce went through the master
