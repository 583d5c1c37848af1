"""All-reduce under failure: kills, silent partitions and cancellation mid-operation."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import PeerSeam

from .conftest import WITH_BLOCKING, Cluster, all_do, fine, form_run, run_all, started, unfused

NETWORKS = WITH_BLOCKING


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
    unfused(cluster)
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


@pytest.mark.async_only
async def test_cancelled_all_reduce_aborts_for_everyone(cluster: Cluster, clock: object) -> None:
    """Peer 0's all-reduce is cancelled once data arrived. The cancellation either takes
    effect, and the all-reduce is aborted for every peer with every input in place, or
    (over TCP, where threads move the data meanwhile) it comes too late, and every peer
    returns the exact result. Either way the run goes on."""
    cluster.config = fine(cluster) if cluster.memory is not None else cluster.config
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(300_000, dtype=np.int32) + i for i in range(3)]
        arrays = [d.copy() for d in data]
        returned: object = None
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
                returned = await comms[0].all_reduce(arrays[0])
        if cluster.memory is not None:  # virtual time: the cancellation always lands
            assert scope.cancelled_caught
        if scope.cancelled_caught:
            assert returned is None
            assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
            for i in range(3):
                assert arrays[i].tobytes() == data[i].tobytes()
        else:  # too late: the result, the same everywhere
            assert isinstance(returned, pccl.ReduceInfo), returned
            assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
            assert all(a.tobytes() == sum(data).tobytes() for a in arrays)
            for i in range(3):
                arrays[i][:] = data[i]
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
    collective for everyone (inputs restored); then retries work. A peer that heard of
    the abort before its reader read the poisoned frame keeps that connection in the
    re-established ring (it is the same ring), and reads the frame during the first
    retry, which it aborts in turn: each of the three poisoned frames can abort at most
    one retry, so the fourth attempt at the latest succeeds, exactly."""
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
        for tag in range(8, 12):
            infos = await run_all(comms, lambda i, c, t=tag: c.all_reduce(arrays[i], tag=t))
            if not all(isinstance(r, pccl.CollectiveAborted) for r in infos):
                break
            for i in range(3):  # an aborted retry restored its input
                assert arrays[i].tobytes() == data[i].tobytes()
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
    from pccl_trio.peer._attempt import RingAttempt

    real = RingAttempt.send_all

    async def broken(self: RingAttempt, connections: object, back: object = None) -> None:
        if self.schedule.rank == 0:
            raise RuntimeError("a bug in the data path")
        await real(self, connections, back)  # type: ignore[arg-type]

    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        data = [np.arange(5_000, dtype=np.float64) + i for i in range(3)]
        arrays = [d.copy() for d in data]
        bad = [c.ring.index(c.peer_id) for c in comms].index(0)
        monkeypatch.setattr(RingAttempt, "send_all", broken)
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
        monkeypatch.setattr(RingAttempt, "send_all", real)
        infos = await run_all([comms[i] for i in good],
                              lambda j, c: c.all_reduce(arrays[good[j]]))
        assert all(isinstance(r, pccl.ReduceInfo) and r.world_size == 2 for r in infos), infos
        for i in good:
            assert arrays[i].tobytes() == (data[good[0]] + data[good[1]]).tobytes()
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_launch_racing_an_abort_is_retried_alike_on_every_peer(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside ``all_reduce_multiple_with_retry``, peer A launches a tensor before it
    hears that another one was aborted, and peer B launches it only after it voted to
    re-establish the ring. The master aborts A's vote (B is in the establishment vote);
    B must not vote for that tensor on the new ring either, or, once A's retries fill
    its window with other tensors, each peer waits for the other's vote for ever.

    Two peers, four tensors, two in flight. Tensors 0 and 1 fail at B (the ring is
    re-established); 2 and 3 go on, unless the pass stops launching after the abort.
    Tensor 2 then fails at B once A launched 3, and B's pass hears of 1's end only once
    B voted to re-establish the ring again (or A is retrying already)."""
    from pccl_trio._core.messages import Message, VoteEstablish
    from pccl_trio.peer._attempt import RingAttempt
    from pccl_trio.peer._ledger import LocalFailure
    from pccl_trio.peer._results import ReduceResult

    unfused(cluster)
    with trio.fail_after(120):
        a, b = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        b_id = b.peer_id
        failed_at_b: set[int] = set()
        held = False
        b_establish_votes = 0
        real_send_all = RingAttempt.send_all
        real_get = ReduceResult.get
        real_vote = PeerSeam(b).vote

        def at_b(attempt: RingAttempt | None) -> bool:
            return attempt is not None and attempt.ring[attempt.schedule.rank] == b_id

        async def send_all(self: RingAttempt, connections: object, back: object = None) -> None:
            if self.tag in (0, 1, 2) and at_b(self) and self.tag not in failed_at_b:
                failed_at_b.add(self.tag)
                if self.tag == 2:
                    while PeerSeam(a).attempt(3) is None:  # until A launched tensor 3
                        await trio.lowlevel.checkpoint()
                self.fail("a link broke (injected)")
                raise LocalFailure(self.failure or "")
            await real_send_all(self, connections, back)  # type: ignore[arg-type]

        async def get(self: ReduceResult) -> pccl.ReduceInfo:
            nonlocal held
            try:
                return await real_get(self)
            finally:
                if self.attempt is not None and self.attempt.tag == 1 and at_b(self.attempt) \
                        and not held:
                    held = True
                    while b_establish_votes < 2 and PeerSeam(a).attempt(0) is None:
                        await trio.lowlevel.checkpoint()

        async def vote(message: Message) -> int:
            nonlocal b_establish_votes
            epoch = await real_vote(message)
            if isinstance(message, VoteEstablish):
                b_establish_votes += 1
            return epoch

        monkeypatch.setattr(RingAttempt, "send_all", send_all)
        monkeypatch.setattr(ReduceResult, "get", get)
        PeerSeam(b).vote = vote
        data = [[np.full(10_000, 10 * rank + t, dtype=np.int64) for t in range(4)]
                for rank in range(2)]
        tensors = [[d.copy() for d in row] for row in data]
        infos = await run_all([a, b], lambda i, c: c.all_reduce_multiple_with_retry(
            tensors[i], max_in_flight=2))
        assert failed_at_b == {0, 1, 2} and held
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 2 for i in infos), infos
        for t in range(4):
            want = data[0][t] + data[1][t]
            assert tensors[0][t].tobytes() == tensors[1][t].tobytes() == want.tobytes(), t
        for comm in (a, b):
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_every_peer_retries_the_same_tensors_after_a_launch_raced_an_abort(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The race of the test above within one pass: tensor 0 succeeds, A launches
    tensor 2 before it hears that tensor 1 failed at B, and B's pass hears of tensor
    0's success only once B voted to re-establish the ring. The master aborts A's vote
    for tensor 2, so B must not vote for it in this pass: both retry tensors 1 and 2."""
    from pccl_trio._core.messages import Message, VoteEstablish
    from pccl_trio.peer._attempt import RingAttempt
    from pccl_trio.peer._ledger import LocalFailure
    from pccl_trio.peer._results import ReduceResult

    caplog.set_level("INFO", logger="pccl_trio.peer")
    unfused(cluster)
    with trio.fail_after(120):
        a, b = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        b_id = b.peer_id
        failed_at_b = held = False
        b_establishing = trio.Event()
        real_send_all = RingAttempt.send_all
        real_get = ReduceResult.get
        real_vote = PeerSeam(b).vote

        def at_b(attempt: RingAttempt | None) -> bool:
            return attempt is not None and attempt.ring[attempt.schedule.rank] == b_id

        async def send_all(self: RingAttempt, connections: object, back: object = None) -> None:
            nonlocal failed_at_b
            if self.tag == 1 and at_b(self) and not failed_at_b:
                failed_at_b = True
                while PeerSeam(a).attempt(2) is None:  # until A launched tensor 2
                    await trio.lowlevel.checkpoint()
                self.fail("a link broke (injected)")
                raise LocalFailure(self.failure or "")
            await real_send_all(self, connections, back)  # type: ignore[arg-type]

        async def get(self: ReduceResult) -> pccl.ReduceInfo:
            nonlocal held
            try:
                return await real_get(self)
            finally:
                if self.attempt is not None and self.attempt.tag == 0 and at_b(self.attempt) \
                        and not held:
                    held = True
                    await b_establishing.wait()

        async def vote(message: Message) -> int:
            epoch = await real_vote(message)
            if isinstance(message, VoteEstablish):
                b_establishing.set()
            return epoch

        monkeypatch.setattr(RingAttempt, "send_all", send_all)
        monkeypatch.setattr(ReduceResult, "get", get)
        PeerSeam(b).vote = vote
        data = [[np.full(10_000, 10 * rank + t, dtype=np.int64) for t in range(3)]
                for rank in range(2)]
        tensors = [[d.copy() for d in row] for row in data]
        infos = await run_all([a, b], lambda i, c: c.all_reduce_multiple_with_retry(
            tensors[i], max_in_flight=2))
        assert failed_at_b and held
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 2 for i in infos), infos
        retries = sorted(r.getMessage() for r in caplog.records if "retrying" in r.getMessage())
        assert retries == sorted(f"peer {c.peer_id}: retrying 2 all-reduces" for c in (a, b)), \
            retries
        for t in range(3):
            want = data[0][t] + data[1][t]
            assert tensors[0][t].tobytes() == tensors[1][t].tobytes() == want.tobytes(), t
        for comm in (a, b):
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_a_replaced_connection_failing_late_aborts_nothing(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round replaces the connections from the predecessor (its pool broke), and the
    old connections' readers see their end only once the next all-reduce runs, as a
    worker thread's error may be handled late under load. The old connections carried
    none of its frames: it must not fail."""
    import pccl_trio.peer._receiver as receiver

    with trio.fail_after(120):
        real_run_protocol = receiver.run_protocol
        old: set[object] = set()  # B's connections from A before the round
        released = 0

        def commenced() -> bool:
            attempt = PeerSeam(b).attempt(0)
            return attempt is not None and attempt.seq > 0 and attempt.live

        async def run_protocol(protocol: object, connection: object, **kwargs: object) -> object:
            nonlocal released
            try:
                return await real_run_protocol(protocol, connection, **kwargs)  # type: ignore[arg-type]
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                if connection in old:
                    while not commenced():  # at scheduling granularity: it takes no time
                        await trio.lowlevel.checkpoint()
                    released += 1
                raise

        monkeypatch.setattr(receiver, "run_protocol", run_protocol)  # before any reader
        a, b = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        old.update(set(PeerSeam(b).connections()) - set(PeerSeam(b).sending_connections()))
        for stream in PeerSeam(a).sending_connections():
            await stream.aclose()  # as a torn send leaves them
        await all_do([a, b], "update_topology")  # A opens a new pool; B admits it
        assert old.isdisjoint(PeerSeam(b).connections())
        arrays = [np.full(10_000, i + 1, dtype=np.int64) for i in range(2)]
        infos = await run_all([a, b], lambda i, c: c.all_reduce(arrays[i], tag=0))
        assert released == len(old) > 0
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert all((x == 3).all() for x in arrays)
        for comm in (a, b):
            await comm.aclose()


async def test_an_abort_that_arrives_before_the_part_starts_stops_it(
    cluster: Cluster, clock: object
) -> None:
    """The master's abort may be read before the task of a commenced attempt runs (a
    peer died just after the commence). That peer's part must end at once, not wait
    for data its neighbours, aborted, never send; every peer gets the abort and its
    input back. The victim is no neighbour of the late peer: no broken link tells it."""
    from pccl_trio._core.messages import CollectiveAbort
    from pccl_trio.peer._attempt import RingAttempt

    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(4)])
        late = comms[0]
        by_id = {c.peer_id: c for c in comms}
        ring = list(late.ring)
        victim = by_id[ring[(ring.index(late.peer_id) + 2) % len(ring)]]
        seam = PeerSeam(late)
        real_run_part = seam.run_part
        aborts_read: dict[int, trio.Event] = {}
        held = 0

        def abort_read(message: CollectiveAbort) -> None:
            aborts_read.setdefault(message.seq, trio.Event()).set()

        async def run_part_late(attempt: RingAttempt) -> bool:
            nonlocal held
            if not held:  # the first part waits until the master's abort of it was read
                await aborts_read.setdefault(attempt.seq, trio.Event()).wait()
                held += 1
            return await real_run_part(attempt)

        seam.after_reading(CollectiveAbort, abort_read)
        seam.run_part = run_part_late
        data = [np.full(10_000, float(i + 1), dtype=np.float32) for i in range(4)]
        arrays = [d.copy() for d in data]
        results: dict[int, object] = {}

        async def one(i: int) -> None:
            try:
                results[i] = await comms[i].all_reduce(arrays[i])
            except pccl.PCCLError as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            while (attempt := PeerSeam(late).attempt(0)) is None or not attempt.seq:
                await trio.lowlevel.checkpoint()
            await cluster.kill(f"p{comms.index(victim)}", victim)
        assert held == 1
        survivors = [i for i, c in enumerate(comms) if c is not victim]
        assert all(isinstance(results[i], pccl.CollectiveAborted) for i in survivors), results
        assert all(arrays[i].tobytes() == data[i].tobytes() for i in survivors)
        # The ring was re-established: a retry runs on the three survivors.
        infos = await run_all([comms[i] for i in survivors],
                              lambda k, c: c.all_reduce(arrays[comms.index(c)]))
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
        for comm in (comms[i] for i in survivors):
            await comm.aclose()
