"""``RingAttempt`` on its own: writer accounting under errors, and a leased part's
completion notices sent from the thread that completes it."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from pccl_trio._core.ring import RingSchedule
from pccl_trio._types import ReduceOp
from pccl_trio.ops import BufferPool, HostStaging
from pccl_trio.peer._agreement import FORWARD, Agreement
from pccl_trio.peer._attempt import RingAttempt
from pccl_trio.transport import SocketLink


def schedule(count: int, *, world: int, slice_bytes: int = 64) -> RingSchedule:
    """Rank 0's all-reduce of ``count`` float32 values."""
    return RingSchedule.all_reduce(count=count, itemsize=4, world=world, rank=0, slice_bytes=slice_bytes)


class _Reader:
    def __init__(self) -> None:
        self.cut = False

    def close_now(self) -> None:
        self.cut = True


class _NoMemory(BufferPool):
    def take(self, nbytes: int) -> Any:
        raise MemoryError("no backup buffer")


async def test_a_failed_backup_leaves_no_writer_behind() -> None:
    """If saving the input fails as a direct receive starts, the attempt must not wait
    forever for that writer when it settles."""
    with trio.fail_after(10):
        data = np.arange(12, dtype=np.float32)
        staging = HostStaging()
        staging.pool = _NoMemory()
        attempt = RingAttempt(schedule=schedule(12, world=3), staging=staging, send=data,
                              result=data, op=ReduceOp.SUM, tag=0, ring=(1, 2, 3))
        attempt.seq = 1
        # The all-gather segment carrying this rank's own chunk: its first write.
        segment = next(s for s in attempt.schedule.recv if not s.reduce and s.chunk == 0)
        claimed = attempt.inbound.claim(
            0, segment.stream_offset, attempt.schedule.slice_range(segment, 0)[1]
            - attempt.schedule.slice_range(segment, 0)[0]
        )
        reader = _Reader()
        with pytest.raises(MemoryError):
            attempt.inbound.direct_target(*claimed, reader)
        attempt.stop()
        await attempt.settle()
        attempt.restore()
        assert not reader.cut  # it was no longer registered when the attempt stopped
        assert data.tobytes() == np.arange(12, dtype=np.float32).tobytes()


def _on_trio_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _LeasedRun:
    """A leased attempt of a ring of ``world`` peers over socket pairs, whose slices
    arrive in worker threads as a reader's would; ``theirs`` reads what the attempt
    sends to its successor and, in a ring of three, ``predecessor`` what it sends back
    (on ``back``)."""

    def __init__(self, world: int = 2) -> None:
        mine, theirs = socket.socketpair()
        self.link = SocketLink(mine, max_data_frame=1 << 20)
        self.theirs = SocketLink(theirs, max_data_frame=1 << 20)
        self.theirs.set_idle_timeout(10.0)  # a notice that never comes fails the test
        self.back: SocketLink | None = None
        self.predecessor: SocketLink | None = None
        if world > 2:
            mine, theirs = socket.socketpair()
            self.back = SocketLink(mine, max_data_frame=1 << 20)
            self.predecessor = SocketLink(theirs, max_data_frame=1 << 20)
            self.predecessor.set_idle_timeout(10.0)
        data = np.arange(4 * world, dtype=np.float32)
        self.attempt = RingAttempt(
            schedule=schedule(4 * world, world=world, slice_bytes=8), staging=HostStaging(),
            send=data, result=data, op=ReduceOp.SUM, tag=7, ring=tuple(range(1, world + 1)),
        )
        self.agreement = self.attempt.under_lease(5)
        self.returned = trio.Event()

    async def send_all(self) -> None:
        await self.attempt.send_all([self.link], self.back)
        self.returned.set()

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the part, and let it send its own chunk and wait: every slice it
        still sends, and its completion, then come from the delivering thread."""
        nursery.start_soon(self.send_all)
        await trio.testing.wait_all_tasks_blocked()

    def deliver_all(self) -> None:
        """Every slice of the incoming stream (in a worker thread)."""
        attempt = self.attempt
        for segment in attempt.schedule.recv:
            for index in range(attempt.schedule.slice_count(segment)):
                start, stop = attempt.schedule.slice_range(segment, index)
                claimed = attempt.inbound.claim(
                    7, segment.stream_offset + start - segment.start, stop - start
                )
                attempt.inbound.on_slice(*claimed, np.ones(stop - start, dtype=np.uint8))

    def frames(self) -> list[tuple[int, int, int, int]]:
        """The headers of what the attempt sent, up to and with its first notice (a
        worker thread): ``(tag, seq, offset, nbytes)``."""
        headers = []
        while True:
            header = self.theirs.receive_data_header()
            self.theirs.receive_payload(memoryview(bytearray(header[3])))
            headers.append(header)
            if not header[3]:
                return headers

    async def close(self) -> None:
        self.attempt.stop()
        await self.attempt.settle()
        self.attempt.release()
        for link in (self.link, self.theirs, self.back, self.predecessor):
            if link is not None:
                link.cut()


async def test_a_leased_part_completed_in_a_thread_tells_the_successor_from_there() -> None:
    """Over TCP, the thread that completes a leased attempt's part sends its completion
    notice, and the predecessor's notice is answered there too: the trio thread is woken
    once, when the members agreed, not at completion (``_agreement``)."""
    with trio.fail_after(20):
        run = _LeasedRun()
        async with trio.open_nursery() as nursery:
            await run.start(nursery)
            await trio.to_thread.run_sync(run.deliver_all)
            headers = await trio.to_thread.run_sync(run.frames)
            # The notice, from the thread: "1 member (me) completed".
            assert headers[-1] == (7, 5, 1, 0)
            assert all(nbytes for _, _, _, nbytes in headers[:-1])
            await trio.testing.wait_all_tasks_blocked()
            assert run.attempt.complete and not run.returned.is_set()
            # The predecessor's notice: every member of the ring completed.
            await trio.to_thread.run_sync(run.agreement.on_notice, 1)
            await run.returned.wait()
        with run.agreement.lock:
            assert run.agreement.done and run.agreement.claim() is None
        await run.close()


@pytest.mark.parametrize("told", ["before", "after"])
async def test_a_leased_part_whose_master_knows_it_runs_wakes_the_trio_thread_at_completion(
    told: str,
) -> None:
    """Once the master was told that the part runs, its end must be reported whether
    or not the members agree: the completion wakes the trio thread
    (``wake_on_completion``), also when the part completed quietly just before."""
    with trio.fail_after(20):
        run = _LeasedRun()
        if told == "before":
            run.agreement.wake_on_completion()
        async with trio.open_nursery() as nursery:
            await run.start(nursery)
            await trio.to_thread.run_sync(run.deliver_all)
            if told == "after":
                headers = await trio.to_thread.run_sync(run.frames)
                assert headers[-1] == (7, 5, 1, 0)  # quiet: the thread sent it
                run.agreement.wake_on_completion()
            await run.returned.wait()
        with run.agreement.lock:
            assert not run.agreement.agreed
            # Before: no thread sent the notice, it is the trio thread's to send.
            assert run.agreement.claim() == ((FORWARD, 1) if told == "before" else None)
        await run.close()


async def test_a_notice_a_thread_cannot_send_is_left_to_the_trio_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The completing thread cannot send the notice without blocking: it wakes the
    trio thread with the notice still due, never blocking."""
    original = Agreement.send_now

    def send_now(connection: SocketLink, **notice: int) -> bool:
        return _on_trio_thread() and original(connection, **notice)

    monkeypatch.setattr(Agreement, "send_now", staticmethod(send_now))
    with trio.fail_after(20):
        run = _LeasedRun()
        async with trio.open_nursery() as nursery:
            await run.start(nursery)
            await trio.to_thread.run_sync(run.deliver_all)
            await run.returned.wait()
        with run.agreement.lock:
            assert run.attempt.complete and not any(run.agreement.sending)
            assert run.agreement.claim() == (FORWARD, 1)
        await run.close()


async def test_a_notice_one_direction_cannot_send_holds_up_none_the_other_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a ring of three the completing thread finds no room for the forward notice:
    it still sends the one back at once (the predecessor may be waiting for it to
    agree) and leaves only the forward one to the trio thread."""
    original = Agreement.send_now
    run = _LeasedRun(world=3)

    def send_now(connection: SocketLink, **notice: int) -> bool:
        return connection is not run.link and original(connection, **notice)

    monkeypatch.setattr(Agreement, "send_now", staticmethod(send_now))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await run.start(nursery)
            await trio.to_thread.run_sync(run.deliver_all)
            await run.returned.wait()
            assert run.predecessor is not None
            header = await trio.to_thread.run_sync(run.predecessor.receive_data_header)
            assert header == (7, 5, 1, 0)  # "1 member (me) completed", sent back
        with run.agreement.lock:
            assert run.agreement.told == [0, 1] and not any(run.agreement.sending)
            assert run.agreement.claim() == (FORWARD, 1)
        await run.close()


async def test_a_notice_heard_after_a_cancellation_wakes_the_trio_thread() -> None:
    """The caller cancelled after the part completed quietly (the part still agrees,
    and the trio thread takes the notices over): a notice heard then must wake it, or
    it would wait for an agreement that has come."""
    with trio.fail_after(20):
        run = _LeasedRun()
        woken = trio.Event()

        async def wait_changed() -> None:
            await run.attempt.wait_changed()
            woken.set()

        async with trio.open_nursery() as nursery:
            await run.start(nursery)
            await trio.to_thread.run_sync(run.deliver_all)
            await trio.to_thread.run_sync(run.frames)  # the thread's notice
            run.attempt.fail("cancelled")
            await run.returned.wait()  # complete: the part's sending is over
            nursery.start_soon(wait_changed)
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(run.agreement.on_notice, 1)
            await woken.wait()
        with run.agreement.lock:
            assert run.agreement.done
        await run.close()
