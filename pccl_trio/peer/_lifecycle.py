"""A communicator's life: its status, the one membership call running, and failure.

Theory of operation
-------------------
A communicator is NEW, CONNECTING, CONNECTED, then CLOSED; it is FAILED once it was
kicked or lost its master, and every waiting and later call raises that error. The
parts of a communicator (master session, p2p connections, membership, collectives,
shared state, topology) share one ``Lifecycle``: it holds the background nursery their
tasks run in, tells them whether the run is over for this peer, and, when it ends,
wakes every waiter through the wake-ups the parts registered (``on_failure``).

A communicator lives in the ``trio.run`` that connected it: its connections and
background tasks belong to that run's event loop and end with it. Every public call
checks first that it runs in that loop (``check_loop``), so that a call from another
``trio.run``, after the one that connected it ended, from asyncio or from no event
loop at all is an ``InvalidUsage`` that says which, rather than a failure deep inside.

Membership calls (``connect``, ``update_topology``, ``optimize_topology``,
``sync_shared_state``, ``are_peers_pending`` and the re-establishment of a stale ring)
run one at a time, inside ``operation``. The master counts on every peer that voted to
see its vote through: a call interrupted after it voted (cancelled, or a bug) can no
longer follow the protocol, so the peer leaves the run at once and the others are told
by the master instead of waiting for it. ``changed`` is the one place to wait for the
communicator to become idle: it is woken whenever a call ends, an all-reduce attempt
ends, or the peer fails.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from .._core import peers
from .._errors import InvalidUsage, PCCLError

__all__ = ["Call", "Lifecycle", "Status"]

log = logging.getLogger("pccl_trio.peer")


class Status(enum.Enum):
    NEW = enum.auto()
    CONNECTING = enum.auto()
    CONNECTED = enum.auto()
    FAILED = enum.auto()  # kicked, or the master is gone
    CLOSED = enum.auto()


class Call(enum.Enum):
    """The membership calls, which run one at a time.

    Each is spelled as error messages name it, and names the call of the master's
    table (``_core.peers.Call``) whose vote it makes (None: it makes none of them), so
    that which of them block an all-reduce is read from that table
    (``_core.peers.votes_blocking``) rather than listed here again.
    """

    CONNECT = ("connect()", None)  # its registration is no vote of the table
    UPDATE_TOPOLOGY = ("update_topology()", peers.Call.UPDATE_TOPOLOGY)
    OPTIMIZE_TOPOLOGY = ("optimize_topology()", peers.Call.OPTIMIZE_TOPOLOGY)
    SYNC_SHARED_STATE = ("sync_shared_state()", peers.Call.SYNC_SHARED_STATE)
    ARE_PEERS_PENDING = ("are_peers_pending()", peers.Call.ARE_PEERS_PENDING)
    REESTABLISH = ("the re-establishment of the ring", peers.Call.UPDATE_TOPOLOGY)

    def __init__(self, spelling: str, vote: peers.Call | None) -> None:
        self.spelling = spelling
        self.vote = vote

    @property
    def blocks_all_reduce(self) -> bool:
        """Whether an all-reduce started meanwhile is a usage error: this call holds
        the peer in a vote that blocks a collective (the master would refuse the
        all-reduce, naming this peer).

        The re-establishment of the ring is the exception. It makes the vote of
        ``update_topology``, but no caller asked for it: every survivor of an aborted
        collective runs it before its next collective call, so an all-reduce launched
        meanwhile is the next call it was run for, not a misuse. That all-reduce waits
        for it (``Membership.ensure_ring`` waits while a membership call runs, and
        only then votes), so the master never sees the two votes together.
        """
        return self is not Call.REESTABLISH and self.vote in _BLOCKING_ALL_REDUCE


#: The calls of the master's table whose votes block an all-reduce.
_BLOCKING_ALL_REDUCE = peers.votes_blocking(peers.Call.ALL_REDUCE)


class Lifecycle:
    """See the module docstring."""

    def __init__(self) -> None:
        self.status = Status.NEW
        self.failure: PCCLError | None = None
        self.busy: Call | None = None
        self.voted = False  # the running call has sent a vote
        self.nursery: trio.Nursery | None = None
        # The event loop this communicator lives in (set by ``connect``), and whether
        # that loop's trio.run has ended.
        self.loop: trio.lowlevel.TrioToken | None = None
        self.loop_ended = False
        self._changed = trio.lowlevel.ParkingLot()
        self._wakers: list[Callable[[], object]] = []
        self._closer: Callable[[], Any] | None = None
        self._describe: Callable[[], str] = lambda: "peer"

    # --- state ---------------------------------------------------------------------------

    @property
    def over(self) -> bool:
        """Whether the run is over for this peer (failed or closed)."""
        return self.failure is not None or self.status is Status.CLOSED

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.status is Status.CLOSED:
            raise InvalidUsage(
                "the communicator is closed; create a new Communicator to take part in "
                "the run again"
            )

    def check_connected(self) -> None:
        self.raise_if_failed()
        if self.status is not Status.CONNECTED:
            raise InvalidUsage(
                f"the communicator is {self.status.name.lower()}; call connect() first"
            )

    def check_loop(self, call: str) -> None:
        """``call`` (as the API spells it) runs in this communicator's event loop (see
        the module docstring); else an ``InvalidUsage`` says where it was called from."""
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            raise InvalidUsage(_outside_trio(call, connected=self.loop is not None)) from None
        if self.loop is not None and token is not self.loop:
            ended = "; that trio.run has ended" if self.loop_ended else ""
            raise InvalidUsage(
                f"{call} was called in another trio.run than the one that connected this "
                f"communicator{ended}: a communicator lives and ends with the trio.run "
                "that connected it; create and connect a new Communicator in this one"
            )

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a task in the communicator's background nursery."""
        assert self.nursery is not None
        self.nursery.start_soon(fn, *args)

    # --- the one call at a time --------------------------------------------------------

    @contextmanager
    def operation(self, call: Call) -> Iterator[None]:
        """Run one membership call (see the module docstring)."""
        if self.busy is not None:
            raise InvalidUsage(
                f"{call.spelling} while {self.busy.spelling} is running on this communicator; "
                "membership calls must not overlap"
            )
        self.busy = call
        self.voted = False
        try:
            yield
        except BaseException as exc:
            if self.voted and not isinstance(exc, PCCLError):
                self.fail(
                    InvalidUsage(
                        f"{call.spelling} was interrupted ({type(exc).__name__}) after voting; "
                        "this peer left the run so the others do not wait for it: "
                        "create a new Communicator to join again"
                    )
                )
            raise
        finally:
            self.busy = None
            self.voted = False
            self.notify()

    def notify(self) -> None:
        """Something that idleness depends on changed (see ``wait_changed``)."""
        self._changed.unpark_all()

    async def wait_changed(self) -> None:
        """Wait until a call or an attempt ends, or the peer fails."""
        await self._changed.park()

    # --- the end -----------------------------------------------------------------------

    def on_failure(self, wake: Callable[[], object]) -> None:
        """Call ``wake`` (synchronously) whenever the run ends for this peer."""
        self._wakers.append(wake)

    def close_with(self, closer: Callable[[], Any]) -> None:
        """The async function that closes every connection once the peer failed."""
        self._closer = closer

    def describe_with(self, describe: Callable[[], str]) -> None:
        """How log lines name this peer."""
        self._describe = describe

    def fail(self, error: PCCLError) -> None:
        """The run is over for this peer: every waiter wakes and raises ``error``."""
        if self.failure is None and self.status is not Status.CLOSED:
            log.warning("%s: %s", self._describe(), error)
            self.failure = error
            self.status = Status.FAILED
        self.wake_all()
        if self.nursery is not None and self._closer is not None:
            self.nursery.start_soon(self._closer)

    def wake_all(self) -> None:
        """Wake every waiter, so each looks at the status again."""
        for wake in self._wakers:
            wake()
        self.notify()


def _outside_trio(call: str, *, connected: bool) -> str:
    """Why ``call`` cannot run where it was called: not in a Trio event loop
    (``connected``: the communicator lives in one already)."""
    import asyncio  # only on this error path: it is slow to import

    try:
        asyncio.get_running_loop()
        where = "from asyncio"
    except RuntimeError:
        where = "outside any event loop"
    which = ", the one that connected the communicator" if connected else ""
    return (
        f"{call} was called {where}, but pccl_trio runs on Trio: call it from code that "
        f"runs under trio.run(){which}, or use pccl_trio.sync.Communicator, whose calls "
        "block instead"
    )
