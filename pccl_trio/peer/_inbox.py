"""The master's messages waiting for the calls that take them: ``Inbox``.

Theory of operation
-------------------
The master session's reader puts every message that no route took into the inbox, in
the order they arrive (``put``). A call takes the first message of the kind it waits
for that its predicate accepts (``wait_for``, PCCL's predicate-matched queue); the
others stay where they are, for the calls that will take them. A waiting call looks
again whenever a message arrives and whenever ``wake`` is called (something else it
depends on changed: the master was lost, the run ended for this peer); before it waits
again it calls its ``check``, which raises to end the wait. ``discard`` drops the
messages nobody will wait for any more.

When the master is lost, what it decided stands. A vote's result or refusal and an
attempt's verdict (``decided``) went to every peer concerned at once, and the peers
that took theirs in time ended their calls with it; so the calls of this peer that
wait for one still take it (``keep_decided`` keeps those and drops the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

from .._core.messages import (
    CollectiveVerdict,
    Message,
    P2PEstablishResult,
    PeersPendingResult,
    SharedStateComplete,
    SharedStatePlan,
    TopologyOptimized,
)

__all__ = ["Inbox", "decided"]

_M = TypeVar("_M", bound=Message)

#: How a vote or an attempt ended, as the master decided it: the same message went to
#: every peer concerned at once. One that reached this peer before its master was lost
#: is still taken by the call waiting for it, as the peers that took theirs in time
#: did; dropping it would end this peer's call otherwise than theirs.
_DECIDED = (PeersPendingResult, P2PEstablishResult, SharedStateComplete, CollectiveVerdict)


def decided(message: Message) -> bool:
    """Whether ``message`` ends a call as the master decided it (``_DECIDED``, or the
    refusal of a sync or an optimization vote: their plans, when not refused, start
    work that only the lost master could have finished)."""
    if isinstance(message, _DECIDED):
        return True
    if isinstance(message, SharedStatePlan | TopologyOptimized):
        return bool(message.error)
    return False


class Inbox:
    """The master's messages that no call took yet (see the module docstring)."""

    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._lot = trio.lowlevel.ParkingLot()

    def put(self, message: Message) -> None:
        """Queue ``message`` after the others and wake the waiting calls."""
        self._messages.append(message)
        self._lot.unpark_all()

    async def wait_for(
        self,
        kind: type[_M] | tuple[type[_M], ...],
        match: Callable[[_M], bool] | None = None,
        *,
        check: Callable[[], None],
    ) -> _M:
        """Take the first message of ``kind`` (and matching ``match``), waiting for one
        if none is queued (returning at once, without a checkpoint, if one is).

        Args:
            check: called before each wait; what it raises ends the wait.
        """
        while True:
            for index, message in enumerate(self._messages):
                if isinstance(message, kind) and (match is None or match(message)):
                    del self._messages[index]
                    return message
            check()
            await self._lot.park()

    def wake(self) -> None:
        """Have every waiting call look again (and ``check``)."""
        self._lot.unpark_all()

    def discard(self, unwanted: Callable[[Message], bool]) -> None:
        """Drop the queued messages nobody will wait for any more."""
        self._messages = [m for m in self._messages if not unwanted(m)]

    def keep_decided(self) -> None:
        """Drop every queued message but the outcomes the master decided (``decided``):
        the master that sent them was lost."""
        self.discard(lambda message: not decided(message))

    def clear(self) -> None:
        """Drop every queued message."""
        self._messages.clear()
