"""A Trio event loop on a thread of its own, running calls for the program's threads.

Theory of operation
-------------------
A communicator lives in one ``trio.run`` (``peer/_lifecycle.py``). ``LoopThread`` is such
a run on a daemon thread, started by ``start()`` and ended by ``stop()``; its main task
holds a nursery and waits to be told to stop. Any other thread hands it work:

* ``call(afn, *args)`` runs ``await afn(*args)`` as a task of that nursery and blocks
  the calling thread until it ends: its value is returned, its exception raised, in
  the calling thread (the very objects, so ``except pccl.CollectiveAborted`` works as
  it does in an async trainer);
* ``call_sync(fn, *args)`` runs a plain function in the loop's thread (a read of a
  communicator's state, the start of an ``*_async`` call, which must spawn its task in
  the loop) and returns its value. It waits only for the loop to run it, so it may
  be made from anywhere but the loop's thread, a Trio run included.

Calls from several threads at once run as concurrent tasks, exactly as concurrent
calls of an async trainer do; whatever the async API allows or refuses then (two
all-reduces of distinct tags: allowed; two of one tag: ``InvalidUsage``) is allowed
or refused alike.

A blocked thread interrupted while it waits (``KeyboardInterrupt`` in the main thread,
or any exception delivered to it) cancels its task and waits for the task to end before
the interruption goes on, so that whatever the call holds (the caller's buffers, the
tag) has been settled by trio's rules for a cancelled call: the buffers hold the
input or the result, nothing writes to them any more. A second interruption while it
waits goes on at once. A cancellation that reaches the loop before the task was
spawned settles the call itself ("the call was cancelled"), so the caller never
waits for a task that will not run.

The main thread waits in slices of ``SIGNAL_SLICE`` seconds. Python runs a signal's
handler only between bytecodes of the main thread: a signal that arrives after the
thread last looked and before its wait started blocking does not end that wait, and
one long wait would hold Ctrl-C back until the call ended, perhaps never (an
all-reduce whose peers never come). The slice bounds that delay.

Two calls are refused with ``InvalidUsage`` instead of deadlocking: any made on the
loop's own thread (it would wait for itself), and a ``call`` made inside a Trio run (it
would stop that run's every task while it blocks; such code uses the async API, or
``trio.to_thread.run_sync``). ``stop()`` cancels the tasks still running: their callers
get ``InvalidUsage`` saying the loop stopped.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._errors import InvalidUsage

__all__ = ["LoopThread"]

_T = TypeVar("_T")

#: Seconds the main thread blocks at a time while it waits for a call (module docstring).
SIGNAL_SLICE = 0.1


def _wait(future: concurrent.futures.Future[Any]) -> None:
    """Block until ``future`` is done; on the main thread in slices, so that a signal
    handler (``KeyboardInterrupt``) runs soon after its signal arrives."""
    if threading.current_thread() is not threading.main_thread():
        concurrent.futures.wait((future,))
        return
    while not future.done():
        concurrent.futures.wait((future,), timeout=SIGNAL_SLICE)


class _Job:
    """One call running in the loop: its result for the caller, the cancel scope that
    an interrupted caller cancels, and whether the loop spawned its task yet."""

    __slots__ = ("future", "scope", "spawned")

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.scope = trio.CancelScope()
        self.spawned = False


class LoopThread:
    """A trio loop on a daemon thread that runs calls for other threads (see the module
    docstring).

    Args:
        name: the thread's name (shown by debuggers and ``threading.enumerate``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ended: BaseException | None = None  # why the loop ended, when it did
        self._running = False

    @property
    def running(self) -> bool:
        """The loop runs: started, and neither stopped nor ended by a failure."""
        return self._running

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the loop's."""
        return self._thread is not None and threading.current_thread() is self._thread

    def start(self) -> None:
        """Start the loop's thread; return once it runs calls."""
        if self._thread is not None:
            raise InvalidUsage("this loop was started already")
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(started,), name=self._name, daemon=True
        )
        self._thread.start()
        started.wait()
        if self._ended is not None:
            raise self._ended

    def call(self, afn: Callable[..., Awaitable[_T]], *args: Any, what: str) -> _T:
        """``await afn(*args)`` in the loop; block until it ends (see the module
        docstring); ``what`` names the call in errors.

        Raises:
            InvalidUsage: called on the loop's thread or inside a Trio run, or the loop
                does not run.
            BaseException: whatever ``afn`` raised.
        """
        self._check_caller(what, blocking=True)
        job = _Job()
        try:
            self._submit(lambda: self._spawn(job, afn, args), what)
            _wait(job.future)
        except BaseException:
            if job.future.done():
                raise
            # Interrupted (perhaps before the submit finished): the task is cancelled
            # and settles first.
            self._cancel(job)
            try:
                _wait(job.future)
            except BaseException:  # a second interruption: stop waiting
                pass
            raise
        return job.future.result()  # type: ignore[no-any-return]

    def call_sync(self, fn: Callable[..., _T], *args: Any, what: str) -> _T:
        """``fn(*args)`` on the loop's thread; its value, or its exception raised here.

        Raises:
            InvalidUsage: as for ``call``.
        """
        self._check_caller(what, blocking=False)
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        self._submit(run, what)
        return future.result()

    def stop(self) -> None:
        """End the loop (its tasks still running are cancelled) and wait for its thread
        to end. Safe to call more than once, and from any thread but the loop's."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._running = False
            return
        if self.on_loop_thread():
            raise InvalidUsage("the loop cannot be stopped from its own thread")
        token, stop = self._token, self._stop
        if token is not None and stop is not None:
            try:
                token.run_sync_soon(stop.set)
            except trio.RunFinishedError:
                pass
        thread.join()
        self._running = False

    # --- the loop's side ----------------------------------------------------------------

    def _main(self, started: threading.Event) -> None:
        try:
            trio.run(self._serve, started)
        except BaseException as exc:  # pragma: no cover - the loop's own code is small
            self._ended = exc
        finally:
            self._running = False
            started.set()

    async def _serve(self, started: threading.Event) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._running = True
            started.set()
            await self._stop.wait()
            self._running = False
            nursery.cancel_scope.cancel()
        self._nursery = None

    def _spawn(self, job: _Job, afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        if job.future.done():  # cancelled before it was spawned
            return
        job.spawned = True
        if self._nursery is None or not self._running:
            job.future.set_exception(InvalidUsage(self._not_running()))
            return
        try:
            self._nursery.start_soon(self._run_job, job, afn, args)
        except RuntimeError:  # the nursery closed meanwhile
            job.future.set_exception(InvalidUsage(self._not_running()))

    async def _run_job(
        self, job: _Job, afn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
    ) -> None:
        try:
            with job.scope:
                try:
                    value = await afn(*args)
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    job.future.set_exception(exc)
                else:
                    job.future.set_result(value)
                return
            # Only an interrupted caller cancels its job's scope; it re-raises its own
            # interruption and does not read this.
            job.future.set_exception(InvalidUsage("the call was cancelled"))
        finally:
            if not job.future.done():  # the loop stops under it
                job.future.set_exception(InvalidUsage(
                    "the communicator's event loop stopped while this call ran: the "
                    "communicator was closed"
                ))

    # --- helpers ------------------------------------------------------------------------

    def _check_caller(self, what: str, *, blocking: bool) -> None:
        if self.on_loop_thread():
            raise InvalidUsage(
                f"{what} is a blocking call and was made on the communicator's own event "
                "loop thread, where it would wait for itself"
            )
        if not blocking:  # a moment's wait for the loop: harmless anywhere
            return
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return
        raise InvalidUsage(
            f"{what} is a blocking call and was made inside a Trio run, whose every task "
            "it would stop while it waits: under Trio use pccl_trio.Communicator (async), "
            "or run the blocking call in trio.to_thread.run_sync"
        )

    def _submit(self, fn: Callable[[], None], what: str) -> None:
        token = self._token
        if token is None or not self._running:
            raise InvalidUsage(f"{what}: {self._not_running()}")
        try:
            token.run_sync_soon(fn)
        except trio.RunFinishedError:
            raise InvalidUsage(f"{what}: {self._not_running()}") from None

    def _cancel(self, job: _Job) -> None:
        """Cancel ``job`` in the loop; one the loop never spawned (or never will: the
        loop ended) is settled here, as cancelled."""

        def cancel() -> None:
            if not job.spawned and not job.future.done():
                job.future.set_exception(InvalidUsage("the call was cancelled"))
            job.scope.cancel()

        token = self._token
        try:
            if token is None:
                raise trio.RunFinishedError
            token.run_sync_soon(cancel)
        except trio.RunFinishedError:  # no loop runs the job: nothing else settles it
            if not job.future.done():
                job.future.set_exception(InvalidUsage(self._not_running()))

    def _not_running(self) -> str:
        """As the async communicator says it of itself."""
        if self._thread is None:
            return "the communicator is new; call connect() first"
        return "the communicator is closed; create a new Communicator to join again"
