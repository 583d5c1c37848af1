"""``pccl_trio.sync._loop.LoopThread``: calls from other threads, and how an
interrupted call settles, whenever the interruption comes."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from pccl_trio import InvalidUsage
from pccl_trio.sync import _loop
from pccl_trio.sync._loop import LoopThread

GUARD = 60.0  # seconds: a call that should have been interrupted ends by itself then


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test loop")
    thread.start()
    yield thread
    thread.stop()


class Interrupted(Exception):
    """What the test's signal handler raises in the main thread."""


def test_a_call_gives_its_value_and_its_error(loop: LoopThread) -> None:
    async def double(x: int) -> int:
        await trio.lowlevel.checkpoint()
        return 2 * x

    async def fail() -> None:
        raise KeyError("mine")

    assert loop.call(double, 21, what="double") == 42
    with pytest.raises(KeyError, match="mine"):
        loop.call(fail, what="fail")


def test_a_cancellation_that_comes_before_the_spawn_settles_the_call(loop: LoopThread) -> None:
    ran: list[str] = []

    async def never() -> None:
        ran.append("ran")

    job = _loop._Job()
    loop._cancel(job)  # the loop handles it before any spawn
    _loop._wait(job.future)
    with pytest.raises(InvalidUsage, match="cancelled"):
        job.future.result()
    loop.call_sync(loop._spawn, job, never, (), what="spawn")  # late: nothing runs
    loop.call(trio.lowlevel.checkpoint, what="a later call")
    assert ran == []


def test_an_interruption_inside_the_submit_cancels_the_task(
    loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interruption comes as the call is handed over, before its wait began."""
    submit = loop._submit
    ended: list[str] = []

    def interrupted_submit(*args: Any) -> None:
        submit(*args)
        raise KeyboardInterrupt

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.append("cancelled")

    monkeypatch.setattr(loop, "_submit", interrupted_submit)
    with pytest.raises(KeyboardInterrupt):
        loop.call(forever, what="forever")
    assert ended == ["cancelled"]  # settled before the interruption went on


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run in the main thread only")
def test_a_signal_the_main_thread_did_not_receive_still_interrupts_its_wait(
    loop: LoopThread,
) -> None:
    """SIGUSR1 is blocked in the main thread, so the loop's thread receives it: Python
    then runs the handler in the main thread only when that thread runs bytecode
    again, which a wait without slices would not do until the call ended."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    ended: list[str] = []

    async def signal_then_wait() -> None:
        os.kill(os.getpid(), signal.SIGUSR1)  # to the process: a thread that takes it
        try:
            await trio.sleep(GUARD)
        except trio.Cancelled:
            ended.append("cancelled")
            raise
        ended.append("slept")

    previous = signal.signal(signal.SIGUSR1, handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        with pytest.raises(Interrupted):
            loop.call(signal_then_wait, what="signal_then_wait")
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGUSR1, previous)
    assert ended == ["cancelled"]  # the call was interrupted while it waited
