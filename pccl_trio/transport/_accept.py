"""One guarded accept loop for every listener: the master's and each peer's p2p one.

Theory of operation
-------------------
``serve_accepted`` accepts connections from a listener and runs a handler for each in
a nursery, under two rules that every server here needs against what its clients and
its operating system do to it:

* ``accept`` failing with an ``OSError`` (``EMFILE``: out of file descriptors) is
  logged, and accepting goes on after ``ACCEPT_BACKOFF`` seconds: descriptors come
  back as other connections close, and the connections being served go on meanwhile.
* A connection that has not sent its first frame yet is *fresh*: it holds a task and
  a buffer until its deadline drops it, and has said nothing of who it is. At most
  ``max_fresh`` connections are fresh at once; one accepted beyond that is closed at
  once, with a warning. A handler says when its connection has sent its first frame by
  calling the ``arrived`` function it is given (once is enough, more calls do
  nothing); a handler that returns without calling it is counted as done all the
  same.

The loop returns when its listener is closed (by its owner) or broken; what that
means is the caller's to say.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._network import remote_host

__all__ = ["ACCEPT_BACKOFF", "Arrived", "serve_accepted"]

#: Seconds to wait after ``accept`` failed before accepting again.
ACCEPT_BACKOFF = 0.1

#: What a handler calls once its connection has sent its first frame.
Arrived = Callable[[], None]


def _unnamed() -> str:
    return ""


async def serve_accepted(
    listener: trio.abc.Listener[Any],
    handler: Callable[[trio.abc.Stream, Arrived], Awaitable[object]],
    *,
    max_fresh: int,
    nursery: trio.Nursery,
    log: logging.Logger,
    what: str = "connection",
    name: Callable[[], str] = _unnamed,
) -> None:
    """Accept connections from ``listener`` and serve each with ``handler`` in
    ``nursery``, at most ``max_fresh`` of them before their first frame (see the
    module docstring); return once the listener is closed or broken.

    Args:
        handler: called with the connection and its ``arrived`` function; it owns
            the connection.
        log: where the warnings go.
        what: what a connection is, in the warnings (``"p2p connection"``).
        name: how the warnings name the server, as a prefix (``"peer 3: "``), asked
            each time one is logged.
    """
    fresh = 0

    async def serve(stream: trio.abc.Stream) -> None:
        counted = True

        def arrived() -> None:
            nonlocal fresh, counted
            if counted:
                counted = False
                fresh -= 1

        try:
            await handler(stream, arrived)
        finally:
            arrived()

    while True:
        try:
            stream = await listener.accept()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        except OSError as exc:  # e.g. EMFILE: back off, keep serving
            log.warning("%saccepting a %s failed: %s", name(), what, exc)
            await trio.sleep(ACCEPT_BACKOFF)
            continue
        if fresh >= max_fresh:
            log.warning(
                "%srefusing a %s from %s: %d connections have not sent their first "
                "frame yet", name(), what, remote_host(stream), fresh,
            )
            await trio.aclose_forcefully(stream)
            continue
        fresh += 1
        nursery.start_soon(serve, stream)
