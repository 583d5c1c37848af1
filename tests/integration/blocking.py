"""The integration scenarios against the blocking API: ``BlockingPeer`` gives a test the
async ``Communicator``'s surface, made of ``pccl_trio.sync.Communicator``'s blocking
calls, each run on a worker thread of the test's trio run (``trio.to_thread``), so a
scenario written for the async API drives the blocking one unchanged. Every blocking
peer has its own event loop thread and talks to the master and the other peers over
loopback TCP, as a synchronous trainer's process would.

A scenario's guard timeout (``trio.fail_after``) abandons the blocked worker thread
rather than wait for it; the call goes on until its communicator is closed.

Reads of private attributes go to the async communicator inside (``PeerSeam``'s
observations: the attempt in flight), never calls: its coroutines belong to its own
event loop.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

import pccl_trio.sync

#: The calls that block, by the async API's name (``aclose`` is ``close``).
BLOCKING = frozenset({
    "connect", "update_topology", "wait_for_peers", "optimize_topology", "sync_shared_state",
    "are_peers_pending", "all_reduce", "barrier", "broadcast", "reduce_scatter", "all_gather",
    "all_reduce_multiple_with_retry",
})


async def _blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)


class RunningCall:
    """An ``*_async`` call's handle, as the async API's: ``done`` and ``await wait()``."""

    def __init__(self, handle: pccl_trio.sync.Handle[Any]) -> None:
        self._handle = handle
        self.tag = handle.tag

    @property
    def done(self) -> bool:
        return self._handle.done()

    async def wait(self) -> Any:
        return await _blocking(self._handle.wait)


class BlockingPeer:
    """A ``pccl_trio.sync.Communicator`` with the async API's surface (see the module
    docstring)."""

    def __init__(self, blocking: pccl_trio.sync.Communicator) -> None:
        self.blocking = blocking

    async def aclose(self) -> None:
        await _blocking(self.blocking.close)

    def end_loop(self) -> None:
        """End the event loop without leaving the run first, as the end of a trio run
        ends an async communicator (its connections close)."""
        self.blocking._loop.stop()

    async def __aenter__(self) -> BlockingPeer:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            return getattr(self.blocking._comm, name)
        attribute = getattr(self.blocking, name)
        if name in BLOCKING:
            return partial(_blocking, attribute)
        if name.endswith("_async"):
            return lambda *args, **kwargs: RunningCall(attribute(*args, **kwargs))
        return attribute

    def __repr__(self) -> str:
        return f"<BlockingPeer {self.blocking!r}>"
