"""``Outbound`` with ``Inbound`` on a bare ledger: a forward still being sent keeps the
part from counting as complete."""

from __future__ import annotations

import socket
import threading
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio

from pccl_trio._core.ring import RingSchedule, Segment
from pccl_trio._types import ReduceOp
from pccl_trio.ops import HostStaging, InputBackup
from pccl_trio.peer._inbound import Inbound
from pccl_trio.peer._ledger import Ledger
from pccl_trio.peer._operands import Operands
from pccl_trio.peer._outbound import Outbound
from pccl_trio.transport import Signal, SocketLink


def _on_trio_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Noting(Signal):
    """The ledger's signal, telling ``parked`` each time a trio task waits on it."""

    def __init__(self, ledger: Ledger, parked: Any) -> None:
        super().__init__(ledger.lock)
        self._parked = parked

    async def wait(self) -> None:
        self._parked()
        await super().wait()


class _HeldLedger(Ledger):
    """A ledger whose sender thread, asked for the slice ``last`` of the reduce-scatter,
    waits until every slice arrived and a reader took the slice that forwards it; and
    which tells waiting threads of every slice that left."""

    def __init__(self, schedule: RingSchedule, last: tuple[int, int]) -> None:
        super().__init__(tag=0, recv_slices=schedule.recv_slices, send_slices=schedule.send_slices)
        self._last = last
        self.all_arrived_and_parked = trio.Event()
        self.signal = _Noting(self, self._parked)

    def _parked(self) -> None:
        if not self.remaining:
            self.all_arrived_and_parked.set()

    def arrived_blocking(self, segment: int, index: int) -> bool:
        ok = super().arrived_blocking(segment, index)
        if (segment, index) == self._last:
            with self.lock:
                self.signal.wait_until_blocking(
                    lambda: not self.remaining and bool(self.sent[-1][self._last[1]])
                )
        return ok

    def left(self, nbytes: int) -> None:
        super().left(nbytes)
        with self.lock:
            self.signal.notify(trio_too=False)


async def test_a_forward_still_sending_keeps_the_part_from_completing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader forwards the last slice while the sender threads, with nothing left to
    send, have ended, and every slice has arrived. Until that forward has left, the
    part must not count as complete: the verdict could then arrive while the send is
    registered, and ending the attempt would cut the connection the next all-reduce
    needs. The reader thread is held right after its bytes went out."""
    # The trio thread's forwards find no room, so sender threads start.
    monkeypatch.setattr(SocketLink, "has_room", lambda link, nbytes: not _on_trio_thread())
    holding = threading.local()
    held, release = threading.Event(), threading.Event()
    original_send = SocketLink.send_data_locked

    def send(link: SocketLink, **frame: Any) -> None:
        original_send(link, **frame)
        if getattr(holding, "hold", False):
            held.set()
            assert release.wait(60), "the test never released the held forward"

    monkeypatch.setattr(SocketLink, "send_data_locked", send)
    mine, theirs = socket.socketpair()
    link = SocketLink(mine, max_data_frame=1 << 20)
    with trio.fail_after(60):
        data = np.arange(8, dtype=np.float32)
        schedule = RingSchedule.all_reduce(count=8, itemsize=4, world=2, rank=0, slice_bytes=8)
        reduced, gathered = schedule.recv
        last = (reduced.index, schedule.slice_count(reduced) - 1)
        ledger = _HeldLedger(schedule, last)
        staging = HostStaging()
        operands = Operands(staging=staging, send=data, result=data, op=ReduceOp.SUM)
        # A forwarder that finds the connection busy waits for it rather than fall back,
        # however long the machine keeps the thread that holds it from running.
        outbound = Outbound(ledger=ledger, schedule=schedule, operands=operands, encoded=None,
                            lock_wait=60.0)
        backup = InputBackup(staging, operands.result_bytes, lock=ledger.lock)
        inbound = Inbound(ledger=ledger, schedule=schedule, operands=operands, backup=backup,
                          encoded=None, forwarder=outbound)
        ledger.seq = 1

        def all_but_the_forward_sent() -> None:
            with ledger.lock:
                ledger.signal.wait_until_blocking(lambda: ledger.unsent <= 1)

        returned: list[tuple[int, int]] = []

        def deliver(segment: Segment, index: int, hold: bool = False) -> None:
            start, stop = schedule.slice_range(segment, index)
            claimed = inbound.claim(0, segment.stream_offset + start - segment.start, stop - start)
            holding.hold = hold
            try:
                inbound.on_slice(*claimed, np.ones(stop - start, dtype=np.uint8))
            finally:
                holding.hold = False

        async def send_all() -> None:
            await outbound.send_all([link])
            returned.append((len(ledger.using), ledger.unsent))
            ledger.all_arrived_and_parked.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            for index in range(last[1]):
                await trio.to_thread.run_sync(deliver, reduced, index)
            # The sender thread is done with everything else: the held forward keeps
            # the connection, and a slice still to send would wait for it forever.
            await trio.to_thread.run_sync(all_but_the_forward_sent)
            nursery.start_soon(partial(trio.to_thread.run_sync, deliver, reduced, last[1], True))
            assert await trio.to_thread.run_sync(held.wait, 60), "no reader forwarded the slice"
            for index in range(schedule.slice_count(gathered)):
                await trio.to_thread.run_sync(deliver, gathered, index)
            await ledger.all_arrived_and_parked.wait()
            early = list(returned)
            release.set()
        assert early == [], "send_all returned while a forward was still being sent"
        assert returned == [(0, 0)]
        ledger.stop()
        assert not inbound.writers
        backup.release()
        assert not link.closed  # the next all-reduce still has its connection
    link.cut()
    theirs.close()
