"""A change of program state that trio tasks and worker threads both wait for.

Theory of operation
-------------------
Over TCP the data path runs in worker threads (``SocketLink``) while the rest of a
peer runs in trio tasks, and both wait on the same state: a slice arriving, an
attempt failing, a commence being read. A thread waits on a ``threading.Condition``;
a trio task cannot block the event loop on one, so it parks in a
``trio.lowlevel.ParkingLot``. ``Signal`` holds the two around one lock, so that a
predicate is written once and waited for from either side (``wait_until``,
``wait_until_blocking``), and one ``notify`` wakes both.

The lock guards the state the predicates read; ``notify`` is called with it held.
From the trio thread, ``notify`` unparks the waiting tasks at once. From another
thread, it asks the trio thread to (``run_sync_soon``) only when told ``trio_too``:
a thread whose change only other threads wait for (a slice a sender thread
forwards) then costs the event loop nothing.

No wake-up is lost. A trio task checks its predicate and parks without a checkpoint
in between, and a thread's wake-up runs in the trio thread, so it comes either before
the check (which then sees the change) or after the park (which it then ends). A
thread checks its predicate and waits under the lock that ``notify`` is called with.

A signal belongs to the trio run it is made in. One made outside a run (a
communicator is made before it connects), or in a run that has ended (a blocking
communicator made in a trio program, connected in its own loop), is bound to the run
whose task first waits on it; worker threads may notify it only after that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import trio

__all__ = ["Signal"]


class Signal:
    """A state change to wait for, from trio tasks and worker threads alike (see the
    module docstring).

    Args:
        lock: the lock guarding the state (a new one by default).
    """

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock if lock is not None else threading.Lock()
        self._condition = threading.Condition(self.lock)
        self._lot = trio.lowlevel.ParkingLot()
        self._token: trio.lowlevel.TrioToken | None = None
        self._trio_thread: int | None = None
        try:
            self._bind()
        except RuntimeError:  # not in a run: bound by the first use in one
            pass

    def _bind(self) -> None:
        """Belong to the current trio run (in its thread)."""
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()

    def _bind_to_waiter(self) -> None:
        """A trio task waits: the signal belongs to its run from now on, if it did not
        (made outside a run, or in another one that has ended)."""
        if trio.lowlevel.current_trio_token() is not self._token:
            self._bind()

    def notify(self, *, trio_too: bool = True) -> None:
        """Something changed (with ``lock`` held): wake the waiting threads, and the
        waiting trio tasks when called from the trio thread or with ``trio_too``."""
        self._condition.notify_all()
        if self._token is None:
            return  # no trio task ever waited: none to wake
        if threading.get_ident() == self._trio_thread:
            self._lot.unpark_all()
        elif trio_too:
            try:
                self._token.run_sync_soon(self._lot.unpark_all)
            except trio.RunFinishedError:  # pragma: no cover - the run is over
                pass

    async def wait(self) -> None:
        """Wait, in a trio task (``lock`` not held), for the next ``notify``."""
        self._bind_to_waiter()
        await self._lot.park()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait, in a trio task (``lock`` not held), until ``predicate()`` holds; it is
        read in the trio thread without the lock, so it must read state that is only
        ever set once (a flag, a count that only falls). A checkpoint, like every
        async call, also when it holds at once."""
        self._bind_to_waiter()
        if predicate():
            await trio.lowlevel.checkpoint()
            return
        while not predicate():
            await self._lot.park()

    def wait_blocking(self, timeout: float | None = None) -> None:
        """Wait, in a worker thread with ``lock`` held, for the next ``notify`` (or
        ``timeout`` seconds)."""
        self._condition.wait(timeout)

    def wait_until_blocking(self, predicate: Callable[[], bool]) -> None:
        """Wait, in a worker thread with ``lock`` held, until ``predicate()`` holds."""
        while not predicate():
            self._condition.wait()
