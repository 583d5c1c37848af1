"""What the caller of an all-reduce holds while it runs: its result and its handle.

Theory of operation
-------------------
The task that runs an all-reduce (``AllReduces._run``) sets its ``ReduceResult`` once,
whatever happens: a ``ReduceInfo`` or the error the caller gets. The result also
carries what a cancelled caller needs to stop the all-reduce: whether it was
cancelled (an attempt made from then on starts stopped), the attempt once made, and
``final``, set once the buffers hold what they will hold. ``AsyncReduceHandle`` is the
public view of a result for ``all_reduce_async``: awaiting it never cancels the
all-reduce, which goes on in the communicator; an ``AsyncValueHandle`` is that of a
collective whose caller gets a value made from its buffers (a shard, gathered parts).
``Rejected`` and ``Blocked`` mark the verdicts that a retry would meet again (they show
as their public base).

``CallsByTag`` holds this peer's calls by tag, from their launch until their task
ended. A call cancelled before its commence winds down after its caller left (it still
votes, then fails): a later call of its tag is then not refused as concurrent, but
reserves the tag and waits for it in its own task; ``wound_down`` waits for every such
call, for the calls that need this peer in no collective.
"""

from __future__ import annotations

from collections.abc import Callable, KeysView
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from .._errors import CollectiveAborted, InvalidArgument, InvalidUsage, shown_as_base
from .._types import ReduceInfo, Shard

if TYPE_CHECKING:
    from .._core.messages import CollectiveInitiate
    from ._attempt import RingAttempt

__all__ = [
    "AsyncGatherHandle",
    "AsyncReduceHandle",
    "AsyncShardHandle",
    "AsyncValueHandle",
    "Blocked",
    "CallsByTag",
    "ReduceResult",
    "Rejected",
]

T = TypeVar("T")


@shown_as_base
class Rejected(InvalidArgument):
    """The master rejected a collective for every peer of its group (the peers disagree
    on its arguments, or a peer's data cannot be reduced): retrying would fail alike."""


@shown_as_base
class Blocked(CollectiveAborted):
    """The master ended a collective because a member waits in a shared-state sync:
    retrying before syncing would fail alike."""




class ReduceResult:
    """How one all-reduce ended, set once by the task that runs it; and what a
    cancelled caller needs to stop it (``cancelled``, ``attempt``, ``final``)."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._info: ReduceInfo | None = None
        self._error: BaseException | None = None
        # The caller was cancelled: an attempt made from now on starts stopped.
        self.cancelled = False
        # The attempt, once made (before its vote), and the vote it makes (or the
        # descriptor it runs under a lease with).
        self.attempt: RingAttempt | None = None
        self.vote: CollectiveInitiate | None = None
        # An all-gather's, once the commence told the sizes: each member's part (its
        # offset and element count in the buffer, by peer id) and the buffer.
        self.parts: dict[int, tuple[int, int]] = {}
        self.gathered: Any = None
        # The buffers hold what they will hold: the result, or the input restored.
        self.final = trio.Event()
        # The task that ran it ended: nothing of it goes on here (its tag is free).
        self.ended = trio.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def info(self) -> ReduceInfo | None:
        """The ``ReduceInfo`` of a successful all-reduce (None otherwise, or not yet)."""
        return self._info

    @property
    def error(self) -> BaseException | None:
        """Why it failed (None: it succeeded, or has not ended)."""
        return self._error

    def finish(self, info: ReduceInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._done.set()
        self.final.set()

    async def settled(self) -> None:
        """Wait until it ended, whatever the outcome."""
        await self._done.wait()

    async def get(self) -> ReduceInfo:
        """Wait until it ended; its ``ReduceInfo``, or raise its error."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def __repr__(self) -> str:
        return "running" if not self.done else ("failed" if self._error else "done")


class AsyncReduceHandle:
    """A running all-reduce started by ``Communicator.all_reduce_async``.

    ``await handle.wait()`` returns its ``ReduceInfo`` or raises what ``all_reduce``
    would have raised; it may be awaited any number of times. Cancelling a ``wait``
    does not cancel the all-reduce, which goes on in the communicator.
    """

    def __init__(self, tag: int, result: ReduceResult) -> None:
        self.tag = tag
        self._result = result

    @property
    def done(self) -> bool:
        """Whether the all-reduce has ended (``wait`` then returns at once)."""
        return self._result.done

    async def wait(self) -> ReduceInfo:
        """Wait for the all-reduce to end; its ``ReduceInfo``, or raise its error."""
        return await self._result.get()

    def __repr__(self) -> str:
        return f"<AsyncReduceHandle tag={self.tag} {self._result!r}>"


class AsyncValueHandle(Generic[T]):
    """A running collective whose caller gets a value made from its buffers once it
    succeeded (a reduce-scatter's shard, an all-gather's parts).

    ``await handle.wait()`` returns that value or raises what the blocking call would
    have raised; it may be awaited any number of times (each returns the same value).
    Cancelling a ``wait`` does not cancel the collective, which goes on in the
    communicator.
    """

    def __init__(self, tag: int, result: ReduceResult, value: Callable[[], T]) -> None:
        self.tag = tag
        self._result = result
        self._value = value
        self._made: list[T] = []

    @property
    def done(self) -> bool:
        """Whether the collective has ended (``wait`` then returns at once)."""
        return self._result.done

    async def wait(self) -> T:
        """Wait for the collective to end; its value, or raise its error."""
        await self._result.get()
        if not self._made:
            self._made.append(self._value())
        return self._made[0]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} tag={self.tag} {self._result!r}>"


class AsyncShardHandle(AsyncValueHandle[Shard]):
    """A running reduce-scatter started by ``Communicator.reduce_scatter_async``:
    ``await handle.wait()`` returns its ``Shard`` (see ``AsyncValueHandle``)."""


class AsyncGatherHandle(AsyncValueHandle[dict[int, Any]]):
    """A running all-gather started by ``Communicator.all_gather_async``: ``await
    handle.wait()`` returns every peer's part by peer id (see ``AsyncValueHandle``)."""


class CallsByTag:
    """This peer's collective calls by tag, from launch until their task ended (see
    the module docstring)."""

    def __init__(self) -> None:
        self._calls: dict[int, ReduceResult] = {}  # tag -> its latest call

    @property
    def tags(self) -> KeysView[int]:
        """The tags of the calls whose task has not ended."""
        return self._calls.keys()

    def reserve(self, tag: int, result: ReduceResult, *, may_wait: bool) -> ReduceResult | None:
        """``result``'s call takes ``tag``; the cancelled call it must wait for, if any
        (``may_wait``: the call can wait; else such a call refuses it too).

        Raises:
            InvalidUsage: a call of the tag is in flight (one waits for, or may not).
        """
        before = self._calls.get(tag)
        if before is not None and (not may_wait or not before.cancelled):
            raise InvalidUsage(
                f"tag {tag} is already in flight; give concurrent all-reduces distinct tags"
            )
        self._calls[tag] = result
        return before

    def release(self, tag: int, result: ReduceResult, before: ReduceResult | None) -> None:
        """``result``'s call of ``tag`` ended (or never started, having reserved it
        after ``before``): the tag is free, or ``before``'s again while it runs."""
        if self._calls.get(tag) is result:
            if before is not None and not before.ended.is_set():
                self._calls[tag] = before
            else:
                del self._calls[tag]
        result.ended.set()

    async def wound_down(self) -> None:
        """Wait until the calls whose callers were cancelled have ended."""
        while True:
            leaving = [r for r in self._calls.values() if r.cancelled]
            if not leaving:
                return
            await leaving[0].ended.wait()
