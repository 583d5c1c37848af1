"""When work may leave the trio thread, and how it does.

Theory of operation
-------------------
Four kinds of work run off the event loop: blocking socket IO of the data path
(``SocketLink``, driven by ``run_in_thread``), CPU-bound array work (hashes, copies:
``run_off_loop``), the master's ring searches and a master link's keepalive
(``_keepalive``). All four follow one rule, ``threads_allowed``: threads are used only
while the run keeps real time. Under a virtual clock (``trio.testing.MockClock``, which
the in-memory tests run on) a worker thread's work takes no virtual time, so with the
clock jumping ahead whenever every task waits, timers would fire long before the thread
is done; there the same work runs inline, in the trio thread, and its results are
reproducible (a keepalive is not needed there: the loop never really blocks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

__all__ = ["hash_threads", "run_in_thread", "run_off_loop", "threads_allowed"]

T = TypeVar("T")

#: Most threads one content hash is split over.
MAX_HASH_THREADS = 8


def threads_allowed() -> bool:
    """Whether work may leave the trio thread: only while the run keeps real time.

    A virtual clock is a ``trio.testing.MockClock``, which exists only once
    ``trio.testing`` was imported; this module does not import it (it would load pytest
    into every process).
    """
    testing = sys.modules.get("trio.testing")
    return testing is None or not isinstance(trio.lowlevel.current_clock(), testing.MockClock)


def hash_threads() -> int:
    """Threads to split one content hash over: the machine's cores (at most
    ``MAX_HASH_THREADS``) where threads are allowed, else one."""
    return min(MAX_HASH_THREADS, os.cpu_count() or 1) if threads_allowed() else 1


async def run_off_loop(work: Callable[[], T]) -> T:
    """Run CPU-bound ``work`` in a worker thread where threads are allowed (heartbeats
    keep flowing meanwhile), inline otherwise (then without a checkpoint: callers rely
    on inline work, such as a restore, not being skipped by a cancellation)."""
    if threads_allowed():
        return await trio.to_thread.run_sync(work)
    return work()


async def run_in_thread(fn: Callable[[], T], *, interrupt: Callable[[], None]) -> T:
    """Run blocking ``fn`` in a worker thread and return (or raise) what it does.

    If the calling task is cancelled, ``interrupt()`` is called (from the trio thread)
    to make ``fn`` return soon, e.g. by cutting the connection it blocks on, and the
    cancellation is delivered only once ``fn`` has returned: nothing the thread does
    outlives the call. The thread comes from trio's cache but takes none of
    ``trio.to_thread``'s tokens (data-path threads block for as long as their
    connection lives).
    """
    token = trio.lowlevel.current_trio_token()
    finished = trio.Event()
    results: list[outcome.Outcome[T]] = []

    def deliver(result: outcome.Outcome[T]) -> None:
        results.append(result)
        try:
            token.run_sync_soon(finished.set)
        except trio.RunFinishedError:  # pragma: no cover - the run is gone anyway
            pass

    await trio.lowlevel.checkpoint_if_cancelled()
    trio.lowlevel.start_thread_soon(fn, deliver, name=f"pccl_trio {getattr(fn, '__name__', 'worker')}")
    try:
        await finished.wait()
    except BaseException:
        try:
            interrupt()
        finally:
            with trio.CancelScope(shield=True):
                await finished.wait()
        raise
    return results[0].unwrap()
