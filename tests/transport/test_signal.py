"""``Signal``: one predicate waited for by trio tasks and worker threads, no wake-up lost."""

from __future__ import annotations

import threading

import trio
import trio.testing

from pccl_trio.transport import Signal


async def test_a_thread_wakes_a_waiting_task_and_a_waiting_thread() -> None:
    with trio.fail_after(20):
        signal = Signal()
        state = {"ready": False}
        seen_by_thread = threading.Event()

        def thread_waits() -> None:
            with signal.lock:
                signal.wait_until_blocking(lambda: state["ready"])
            seen_by_thread.set()

        def thread_sets() -> None:
            with signal.lock:
                state["ready"] = True
                signal.notify()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, thread_waits)
            nursery.start_soon(signal.wait_until, lambda: state["ready"])
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(thread_sets)
        assert seen_by_thread.is_set()


async def test_a_thread_that_does_not_ask_for_it_leaves_the_trio_tasks_parked() -> None:
    """``trio_too=False`` from a worker thread wakes threads only; a later notify from
    the trio thread wakes the task."""
    with trio.fail_after(20):
        signal = Signal()
        woken = trio.Event()

        async def wait() -> None:
            await signal.wait()
            woken.set()

        def notify_threads_only() -> None:
            with signal.lock:
                signal.notify(trio_too=False)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(notify_threads_only)
            await trio.testing.wait_all_tasks_blocked()
            assert not woken.is_set()
            with signal.lock:
                signal.notify()
            await woken.wait()


async def test_waiting_for_what_holds_already_is_a_checkpoint() -> None:
    signal = Signal()
    with trio.CancelScope() as scope:
        scope.cancel()
        await signal.wait_until(lambda: True)
        raise AssertionError("not a checkpoint")  # pragma: no cover
    assert scope.cancelled_caught


def test_a_signal_made_outside_a_run_belongs_to_the_run_that_first_waits() -> None:
    signal = Signal()
    with signal.lock:
        signal.notify()  # nobody to wake, and no run to ask

    async def main() -> None:
        woken = trio.Event()

        async def wait() -> None:
            await signal.wait()
            woken.set()

        def notify() -> None:
            with signal.lock:
                signal.notify()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(notify)
            await woken.wait()

    trio.run(main)


def test_a_signal_made_in_one_run_belongs_to_the_run_that_waits_on_it() -> None:
    """A communicator made under one ``trio.run`` and connected in another (a blocking
    communicator made in a trio program, connected in its own loop): its signals go to
    the run whose tasks wait, not to the one they were made in."""

    async def make() -> Signal:
        return Signal()

    signal = trio.run(make)  # that run is over

    async def main() -> None:
        woken = trio.Event()

        async def wait() -> None:
            await signal.wait()
            woken.set()

        def notify() -> None:
            with signal.lock:
                signal.notify()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await trio.to_thread.run_sync(notify)
            with trio.fail_after(30):
                await woken.wait()

    trio.run(main)
