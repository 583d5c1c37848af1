"""The backward reader (``DataReceiver.serve_back``): what a successor sends back on
the first connection of the pool to it. Completion notices reach their running
attempt; stale ones, and those from a peer that is not the attempt's successor, are
dropped; anything else ends the reader with a warning and leaves the connection open
for the senders. Notices go back only over a path long enough for them to pay."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
import trio
import trio.testing

from pccl_trio._core.ring import RingSchedule
from pccl_trio._types import ReduceOp
from pccl_trio.ops import HostStaging
from pccl_trio.peer._agreement import BACKWARD, FORWARD
from pccl_trio.peer._attempt import RingAttempt
from pccl_trio.peer._lifecycle import Lifecycle
from pccl_trio.peer._pools import NOTICES_BACK_FROM, RingPools
from pccl_trio.peer._receiver import DataReceiver
from pccl_trio.transport import SocketLink

_EMPTY = memoryview(b"")


class _Back:
    """Rank 0 of the ring (1, 2, 3) runs leased attempt 5 of tag 7: its successor is
    peer 2, which sends on ``theirs``; the reader reads ``ours``."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        self.ours = SocketLink(mine, max_data_frame=1 << 20)
        self.theirs = SocketLink(theirs, max_data_frame=1 << 20)
        data = np.arange(12, dtype=np.float32)
        self.attempt = RingAttempt(
            schedule=RingSchedule.all_reduce(count=12, itemsize=4, world=3, rank=0, slice_bytes=16),
            staging=HostStaging(), send=data, result=data, op=ReduceOp.SUM, tag=7, ring=(1, 2, 3),
        )
        self.agreement = self.attempt.under_lease(5)
        self.receiver = DataReceiver(lifecycle=Lifecycle(), p2p=None)  # type: ignore[arg-type]
        self.receiver.lease_granted(5, 100)
        self.receiver.add(self.attempt)
        self.receiver.start_leased(self.attempt, 5, 5)

    def send_back(self, seq: int, count: int, payload: bytes = b"") -> None:
        self.theirs.send_data(tag=7, seq=seq, offset=count, payload=memoryview(payload))

    async def close(self) -> None:
        self.attempt.stop()
        await self.attempt.settle()
        self.attempt.release()
        self.ours.cut()
        self.theirs.cut()


async def test_a_notice_sent_back_reaches_its_attempt_and_stale_ones_are_dropped() -> None:
    with trio.fail_after(20):
        back = _Back()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(back.receiver.serve_back, back.ours, 2)
            await trio.to_thread.run_sync(back.send_back, 4, 2)  # an attempt that ended
            await trio.to_thread.run_sync(back.send_back, 5, 1)
            await back.attempt.ledger.signal.wait_until(lambda: back.agreement.heard[BACKWARD] == 1)
            assert back.agreement.heard[FORWARD] == 0
            back.theirs.cut()  # the successor goes: the reader ends quietly
        assert not back.ours.closed  # the senders' connection is theirs to give up
        await back.close()


async def test_a_notice_from_a_peer_that_is_not_the_successor_is_dropped() -> None:
    with trio.fail_after(20):
        back = _Back()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(back.receiver.serve_back, back.ours, 3)
            await trio.to_thread.run_sync(back.send_back, 5, 2)
            await trio.to_thread.run_sync(back.theirs.cut)
        assert back.agreement.heard == [0, 0]
        await back.close()


@pytest.mark.parametrize(("count", "payload"), [(0, b"x" * 64), (3, b"")])
async def test_what_is_no_notice_ends_the_reader_with_a_warning(
    count: int, payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Data sent back, or a count no member of a ring of three can send."""
    with trio.fail_after(20), caplog.at_level(logging.WARNING, logger="pccl_trio.peer"):
        back = _Back()
        await trio.to_thread.run_sync(back.send_back, 5, count, payload)
        await back.receiver.serve_back(back.ours, 2)  # returns: it read what it refuses
        assert "peer 2 sent back what is no completion notice" in caplog.text
        assert back.agreement.heard == [0, 0]
        assert not back.ours.closed
        await back.close()


class _Open:
    """A connection as ``RingPools`` sees it."""

    def __init__(self, *, closed: bool = False) -> None:
        self.closed = closed


@pytest.mark.parametrize(
    ("round_trip", "back"),
    [(None, True), (0.0, False), (50e-6, False), (NOTICES_BACK_FROM, True), (0.1, True)],
)
def test_notices_go_back_only_over_a_path_whose_hops_cost_more_than_they_do(
    round_trip: float | None, back: bool,
) -> None:
    """Loopback and a LAN: forward notices only. A long path, or one whose round trip
    is not known (the memory network), also back."""
    pools = RingPools()
    pool = pools.rx_pool(4)
    first, second = _Open(), _Open()
    pool.slots.update({0: first, 1: second})  # type: ignore[dict-item]
    pool.round_trip = round_trip
    assert pools.back_connection(4) is (first if back else None)


def test_no_notices_go_back_without_an_open_first_connection() -> None:
    pools = RingPools()
    assert pools.back_connection(4) is None
    pool = pools.rx_pool(4)
    pool.slots[1] = _Open()  # type: ignore[assignment]
    assert pools.back_connection(4) is None
    pool.slots[0] = _Open(closed=True)  # type: ignore[assignment]
    assert pools.back_connection(4) is None
