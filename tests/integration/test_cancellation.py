"""A cancelled ``all_reduce`` leaves its caller able to tell input from result.

The rule (``docs/api.md``): when ``trio.Cancelled`` propagates out of ``all_reduce``,
the all-reduce was aborted for every peer (they raise ``CollectiveAborted``), the
caller's in-place buffer holds its input and nothing writes to its buffers any more;
when the cancellation came too late to abort it (this peer had finished its part and
every peer succeeded), ``all_reduce`` returns its result like any other time and the
enclosing scope's next checkpoint raises ``Cancelled``.

In memory the links are shaped, so an all-reduce takes a few virtual milliseconds;
the cancellation points sweep all of it, from before the vote to after the verdict,
and some are pinned to an exact moment by a hook. Over TCP the threads move the data,
and a few points mid-transfer are tried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import CollectiveComplete, Message
from pccl_trio.peer import _results
from pccl_trio.testing import PeerSeam

from .conftest import Cluster, fine, form_run, run_all, started, unfused

COUNT = 16384  # float32: 64 KiB
RATE = 4e6  # bytes/s on each ring link: about 20 ms per all-reduce of three peers
DELAYS = [i * 0.0007 for i in range(45)]  # 0 to 31 ms


async def make_ring(cluster: Cluster, *, shaped: bool = True) -> list[pccl.Communicator]:
    cluster.config = fine(cluster)
    comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
    if cluster.memory is not None and shaped:
        for a in ("p0", "p1", "p2"):
            for b in ("p0", "p1", "p2"):
                if a != b:
                    cluster.memory.shape(a, b, rate=RATE, latency=0.0005)
    return comms


def inputs(tag: int, count: int = COUNT) -> list[np.ndarray]:
    return [np.arange(count, dtype=np.float32) * (i + 1) + tag for i in range(3)]


async def barrier(comms: list[pccl.Communicator], tag: int) -> None:
    """A full all-reduce: every earlier abort was followed by its re-establishment."""
    arrays = [np.ones(8, np.float32) for _ in comms]
    results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], tag=tag))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results


async def cancelled_reduce(
    comms: list[pccl.Communicator],
    tag: int,
    *,
    in_place: bool,
    cancel: Callable[[trio.CancelScope, trio.Nursery], object],
    count: int = COUNT,
) -> str:
    """Peer 0 reduces under a scope that ``cancel`` cancels (it is handed the scope and
    a nursery); the others reduce normally. Checks the rule; returns "cancelled" or
    "returned"."""
    data = inputs(tag, count)
    arrays = [d.copy() for d in data]
    recv = None if in_place else np.full(count, -1.0, dtype=np.float32)
    others: list[object] = []
    returned: object = None
    seen: np.ndarray | None = None
    async with trio.open_nursery() as nursery:

        async def reduce_others() -> None:
            others.extend(await run_all(comms[1:], lambda i, c: c.all_reduce(arrays[i + 1], tag=tag)))

        nursery.start_soon(reduce_others)
        with trio.CancelScope() as scope:
            cancel(scope, nursery)
            returned = await comms[0].all_reduce(arrays[0], recv, tag=tag)
        if returned is None:
            seen = (arrays[0] if recv is None else recv).copy()
    await barrier(comms, tag + 10_000)
    assert not PeerSeam(comms[0]).reducing(tag)  # nothing of it goes on in the background
    total = data[0] + data[1] + data[2]
    result = arrays[0] if recv is None else recv
    if returned is None:
        assert scope.cancelled_caught
        assert all(isinstance(r, pccl.CollectiveAborted) for r in others), others
        assert arrays[0].tobytes() == data[0].tobytes()  # the input, in place or not
        assert seen is not None and result.tobytes() == seen.tobytes()  # no late write
        for i in (1, 2):
            assert arrays[i].tobytes() == data[i].tobytes()
        return "cancelled"
    assert isinstance(returned, pccl.ReduceInfo), returned
    assert all(isinstance(r, pccl.ReduceInfo) for r in others), others
    assert result.tobytes() == total.tobytes()
    assert arrays[1].tobytes() == arrays[2].tobytes() == total.tobytes()
    return "returned"


def after(delay: float) -> Callable[[trio.CancelScope, trio.Nursery], object]:
    def cancel(scope: trio.CancelScope, nursery: trio.Nursery) -> None:
        scope.deadline = trio.current_time() + delay

    return cancel


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "recv"])
async def test_every_cancellation_point_obeys_the_rule(
    cluster: Cluster, clock: object, in_place: bool
) -> None:
    if cluster.memory is None:
        pytest.skip("a sweep over exact moments needs virtual time")
    with trio.fail_after(600):
        comms = await make_ring(cluster)
        outcomes = [
            await cancelled_reduce(comms, tag, in_place=in_place, cancel=after(delay))
            for tag, delay in enumerate(DELAYS)
        ]
        # Early points abort, late ones return; the sweep crosses the whole transfer.
        assert outcomes[0] == "cancelled" and outcomes[-1] == "returned", outcomes
        assert outcomes.count("cancelled") >= 10 and outcomes.count("returned") >= 5, outcomes
        for comm in comms:
            await comm.aclose()


async def test_cancelled_after_the_verdict_returns_the_result(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict SUCCESS is in and the result in the buffer, but the caller has not
    resumed yet when the cancellation comes: all_reduce returns the result (it used to
    raise Cancelled with the result in the buffer)."""
    with trio.fail_after(120):
        comms = await make_ring(cluster)
        scopes: list[trio.CancelScope] = []
        finish = _results.ReduceResult.finish

        def finish_then_cancel(self: _results.ReduceResult, info: object, error: object) -> None:
            finish(self, info, error)  # type: ignore[arg-type]
            for scope in scopes:
                scope.cancel()

        monkeypatch.setattr(_results.ReduceResult, "finish", finish_then_cancel)
        outcome = await cancelled_reduce(
            comms, 1, in_place=True, cancel=lambda scope, _nursery: scopes.append(scope)
        )
        assert outcome == "returned"
        for comm in comms:
            await comm.aclose()


async def test_cancelled_after_completing_its_part(cluster: Cluster, clock: object) -> None:
    """Cancelled right after this peer reported its part complete: too late to abort,
    so the verdict decides, and it is SUCCESS for everyone."""
    with trio.fail_after(120):
        comms = await make_ring(cluster)
        scopes: list[trio.CancelScope] = []
        seam = PeerSeam(comms[0])
        send = seam.send_to_master

        async def send_then_cancel(message: Message, **options: Any) -> int:
            sent = await send(message, **options)
            if isinstance(message, CollectiveComplete):
                for scope in scopes:
                    scope.cancel()
            return sent

        seam.send_to_master = send_then_cancel
        outcome = await cancelled_reduce(
            comms, 2, in_place=True, cancel=lambda scope, _nursery: scopes.append(scope)
        )
        assert outcome == "returned"
        for comm in comms:
            await comm.aclose()


async def test_cancelled_between_vote_and_commence(cluster: Cluster, clock: object) -> None:
    """Peer 0 voted, the others have not yet: the cancellation returns at once, the
    input untouched, and the others' all-reduce is aborted once they vote."""
    with trio.fail_after(120):
        comms = await make_ring(cluster)
        data = inputs(3)
        arrays = [d.copy() for d in data]
        with trio.move_on_after(1.0) as scope:
            await comms[0].all_reduce(arrays[0], tag=3)
        assert scope.cancelled_caught
        if cluster.memory is not None:
            assert trio.current_time() - scope.deadline < 0.01  # at once
        assert arrays[0].tobytes() == data[0].tobytes()
        others = await run_all(comms[1:], lambda i, c: c.all_reduce(arrays[i + 1], tag=3))
        assert all(isinstance(r, pccl.CollectiveAborted) for r in others), others
        await barrier(comms, 4)
        assert [a.tobytes() for a in arrays] == [d.tobytes() for d in data]
        for comm in comms:
            await comm.aclose()


async def test_cancelled_mid_transfer(cluster: Cluster, clock: object) -> None:
    """Both networks: cancelled once data arrived, the all-reduce aborts everywhere.
    (Unshaped: ``started`` polls at every checkpoint, which would hold virtual time.)"""
    with trio.fail_after(120):
        comms = await make_ring(cluster, shaped=False)
        outcomes = []
        for tag in range(4):

            def when_started(scope: trio.CancelScope, nursery: trio.Nursery, tag: int = tag) -> None:
                async def watch() -> None:
                    await started(comms[0], tag)
                    scope.cancel()

                nursery.start_soon(watch)

            outcomes.append(await cancelled_reduce(
                comms, tag, in_place=tag % 2 == 0, cancel=when_started, count=1 << 20
            ))
        assert "cancelled" in outcomes, outcomes
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("delay", [0.001, 0.004, 0.012, 0.03], ids=lambda d: f"{d * 1000:g}ms")
async def test_a_cancelled_reduce_of_many_tensors_writes_nothing_after(
    cluster: Cluster, clock: object, delay: float
) -> None:
    """all_reduce_multiple_with_retry cancelled at some point: each tensor holds its
    input or its result, as the other peers' verdict for it says, and none is written
    once Cancelled propagated. (Cancelled before its first launch, at 0 ms, it makes no
    call at all: the others would wait for the stall timeout.)"""
    if cluster.memory is None:
        pytest.skip("exact moments need virtual time")
    unfused(cluster)  # its tensors meet the other peers' single all-reduces by tag
    with trio.fail_after(120):
        comms = await make_ring(cluster)
        tags = range(4)
        data = [inputs(tag, COUNT // 4) for tag in tags]  # data[tag][peer]
        tensors = [[d[peer].copy() for d in data] for peer in range(3)]  # [peer][tag]
        verdicts: dict[tuple[int, int], object] = {}
        seen: list[np.ndarray] = []
        async with trio.open_nursery() as nursery:

            async def other(peer: int) -> None:
                handles = [
                    comms[peer].all_reduce_async(tensors[peer][tag], tag=tag) for tag in tags
                ]
                for tag, handle in zip(tags, handles, strict=True):
                    try:
                        verdicts[peer, tag] = await handle.wait()
                    except pccl.PCCLError as exc:
                        verdicts[peer, tag] = exc

            for peer in (1, 2):
                nursery.start_soon(other, peer)
            with trio.move_on_after(delay) as scope:
                await comms[0].all_reduce_multiple_with_retry(tensors[0], max_in_flight=4)
            if scope.cancelled_caught:
                seen = [t.copy() for t in tensors[0]]
        await barrier(comms, 100)
        for tag in tags:
            total = data[tag][0] + data[tag][1] + data[tag][2]
            outcome = {type(verdicts[peer, tag]) for peer in (1, 2)}
            assert len(outcome) == 1, verdicts  # the same verdict for both
            if outcome == {pccl.ReduceInfo}:
                expected = [total, total, total]
            else:
                assert outcome == {pccl.CollectiveAborted}, verdicts
                expected = [data[tag][0], data[tag][1], data[tag][2]]
            for peer in range(3):
                assert tensors[peer][tag].tobytes() == expected[peer].tobytes(), (peer, tag)
        if seen:  # nothing was written after the cancellation
            assert all(a.tobytes() == b.tobytes() for a, b in zip(seen, tensors[0], strict=True))
        else:
            assert all(isinstance(verdicts[1, tag], pccl.ReduceInfo) for tag in tags)
        for comm in comms:
            await comm.aclose()


async def cancel_once_registered(
    comms: list[pccl.Communicator], tag: int, then: Callable[[int, pccl.Communicator], Any],
) -> list[object]:
    """Peer 0 calls ``all_reduce(tag=tag)`` and is cancelled as soon as its attempt is
    registered, then at once makes the call ``then(0, comm)``; the others call the
    all-reduce too, then ``then``. The others' all-reduce gets one verdict (an abort,
    or the sum if peer 0's part had run through); returns every peer's ``then``."""
    arrays = [np.ones(1 << 12, np.float32) for _ in comms]
    firsts: list[object] = []
    seconds: list[object] = [None] * len(comms)

    async def other(i: int) -> None:
        try:
            firsts.append(await comms[i].all_reduce(arrays[i], tag=tag))
        except pccl.CollectiveAborted as exc:
            firsts.append(exc)
        seconds[i] = await then(i, comms[i])

    async with trio.open_nursery() as nursery:
        for i in (1, 2):
            nursery.start_soon(other, i)
        with trio.CancelScope() as scope:

            async def watch() -> None:
                while PeerSeam(comms[0]).attempt(tag) is None:
                    await trio.lowlevel.checkpoint()
                scope.cancel()

            nursery.start_soon(watch)
            returned = await comms[0].all_reduce(arrays[0], tag=tag)
        # At once: the cancelled call may still wind down here.
        seconds[0] = await then(0, comms[0])
    if scope.cancelled_caught:
        assert all(isinstance(r, pccl.CollectiveAborted) for r in firsts), firsts
    else:
        assert isinstance(returned, pccl.ReduceInfo), returned
        assert all(isinstance(r, pccl.ReduceInfo) for r in firsts), firsts
    return seconds


async def test_a_call_right_after_a_cancelled_one_waits_for_it_to_wind_down(
    cluster: Cluster, clock: object
) -> None:
    """A call cancelled before the commence returns at once and winds down in the
    background (it votes, then fails). The caller's next call of that tag (alone, or
    among ``all_reduce_multiple_with_retry``'s), and its next membership call, wait for
    it instead of being refused as concurrent: every peer's next call succeeds."""
    with trio.fail_after(120):
        comms = await make_ring(cluster, shaped=False)
        data = inputs(4)
        arrays = [d.copy() for d in data]
        results = await cancel_once_registered(
            comms, 4, lambda i, c: c.all_reduce(arrays[i], tag=4)
        )
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        total = data[0] + data[1] + data[2]
        assert all(a.tobytes() == total.tobytes() for a in arrays)

        # all_reduce_multiple_with_retry launches its buckets on the current ring
        # (tag 0 for the one tensor here): it waits for the cancelled call of tag 0 too.
        tensors = [d.copy() for d in data]
        results = await cancel_once_registered(
            comms, 0, lambda i, c: c.all_reduce_multiple_with_retry([tensors[i]])
        )
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        assert all(t.tobytes() == total.tobytes() for t in tensors)

        await cancel_once_registered(comms, 5, lambda i, c: c.update_topology())
        assert not PeerSeam(comms[0]).reducing(5)
        await barrier(comms, 6)
        for comm in comms:
            await comm.aclose()
