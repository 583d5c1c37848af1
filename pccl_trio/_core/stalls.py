"""Stalls: votes that wait too long for peers that do not make the call.

Theory of operation
-------------------
The master fails at once every call it can prove will never complete: a peer waits in
a vote that the others' call cannot join (``peers.BLOCKED_BY``), or the members of an
all-reduce describe it differently (``collectives``). Given what a peer may do
meanwhile (an all-reduce may be started, and ``are_peers_pending`` asked, from another
task while a call waits; only update_topology, sync_shared_state and
optimize_topology hold a peer in a vote), these are the only waits that provably never
end. Anything else may still complete: a peer that has not voted may be computing, or
make the call from another task.

So every waiting vote is timed from its first voter. After ``warning`` seconds the
master logs one line naming the peers that have not voted and what each of them waits
in (``peers.pending_calls``), again after twice that, four times, and so on; after
``timeout`` seconds it fails the vote for its voters with the same names, each part in
the way its vote is refused (a REJECTED verdict, a pending-peers answer with an error,
a refused establishment, sync or optimization). A vote is *waiting* while some peer
it needs has not voted; a vote that waits only for a running round is not.

Each part lists its waiting votes (``Waiting``): whether a vote waits is a count, and
who it waits for is worked out only for a log line or an error. The list is kept until
the master reports an event that may change a vote (``changed``: anything but a
heartbeat or a quiet Tick), so the heartbeats that make up most of the master's events
cost it nothing. ``deadline()`` is the earliest timeout (the warnings ride on the
Ticks that the heartbeats bring every heartbeat interval while any peer is connected,
so they add no deadline of their own); ``check()``, on a Tick, logs the warnings due
and fails the votes whose timeout passed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from .peers import Call, Peer, PeerTable, pending_calls
from .records import bounded
from .report import RunKind

__all__ = ["Stalls", "Waiting", "call_name", "run_vote"]



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Waiting:
    """A vote some of whose peers have not voted yet.

    Attributes:
        key: names the vote among all waiting ones (with ``since``, one wait of it).
        call: the call its voters made, as the API spells it (``all_reduce(tag=3)``).
        where: whose vote it is (``peer group 0``, ``the run``).
        since: when its first voter voted.
        missing: the peers it waits for (computed when needed).
        fail: refuses the vote for its voters, with the reason given.
        awaited: who ``missing`` are, as the log line and the reason name them.
        rule: what the missing peers should have done, for the reason.
    """

    key: Hashable
    call: str
    where: str
    since: float
    missing: Callable[[], Sequence[Peer]]
    fail: Callable[[str], None]
    awaited: str = "the peers that did not call it"
    rule: str = "every peer must make the same calls in the same order"


Source = Callable[[], Iterable[Waiting]]


def call_name(call: str) -> str:
    """A waiting call's name without its arguments (``all_reduce(tag=3)``: ``all_reduce``),
    a value from a small fixed set."""
    return call.split("(", 1)[0]


def run_vote(
    table: PeerTable, call: Call, *, voted: Callable[[Peer], bool],
    since: Callable[[Peer], float], fail: Callable[[str], None],
) -> Iterator[Waiting]:
    """The run-wide vote of ``call`` (every accepted peer takes part), while some have
    voted (``voted``, since ``since``) and others have not."""
    accepted = table.accepted()
    voters = [p for p in accepted if voted(p)]
    if voters and len(voters) < len(accepted):
        yield Waiting(
            key=call.value,
            call=call.value,
            where="the run",
            since=min(since(p) for p in voters),
            missing=lambda: [p for p in table.accepted() if not voted(p)],
            fail=fail,
        )


class Stalls:
    """Warn about waiting votes, and fail those waiting past the timeout.

    Args:
        table: the registry (for the clock).
        sources: each part's waiting votes.
        timeout: seconds a vote may wait for its missing peers (``inf``: forever).
        warning: seconds before the first log line about a waiting vote; then after
            twice as long, four times, ...
    """

    def __init__(
        self, table: PeerTable, sources: Sequence[Source], *, timeout: float, warning: float
    ) -> None:
        self._table = table
        self._sources = sources
        self._timeout = timeout
        self._warning = warning
        # (key, since) -> how many warnings were logged for that wait.
        self._warned: dict[tuple[Hashable, float], int] = {}
        # The waiting votes and the earliest timeout, until something changes.
        self._cache: tuple[list[Waiting], float] | None = None

    def changed(self) -> None:
        """Something that may start, complete or refuse a vote happened."""
        self._cache = None

    def _waiting(self) -> tuple[list[Waiting], float]:
        if self._cache is None:
            waiting = [waiting for source in self._sources for waiting in source()]
            deadline = min((w.since + self._timeout for w in waiting), default=math.inf)
            self._cache = waiting, deadline
        return self._cache

    def waiting(self) -> list[Waiting]:
        """Every vote waiting for members now."""
        return list(self._waiting()[0])

    def deadline(self) -> float:
        """When the first waiting vote times out (``inf``: none waits)."""
        return self._waiting()[1]

    def check(self) -> bool:
        """Log the warnings due; fail the votes that waited past the timeout; whether
        any was failed."""
        now = self._table.now
        due: list[tuple[Waiting, str]] = []
        warned: dict[tuple[Hashable, float], int] = {}
        for waiting in self._waiting()[0]:
            age = now - waiting.since
            # The same sum as in deadline(): a Tick at the deadline must act.
            if now >= waiting.since + self._timeout:
                # Every reason is written before any vote is refused, so that each
                # names what the others wait in now.
                due.append((waiting, bounded(
                    f"{waiting.call} of {waiting.where} waited {age:.0f}s for "
                    f"{self._who(waiting)}; {waiting.rule} (the master's stall timeout "
                    f"is {self._timeout:g}s)"
                )))
                continue
            key = (waiting.key, waiting.since)
            count = self._warned.get(key, 0)
            if age >= self._warning * 2**count:
                self._table.report(
                    RunKind.STALLED,
                    bounded(
                        f"{waiting.call} of {waiting.where} has waited {age:.0f}s for "
                        f"{self._who(waiting)}; it fails after {self._timeout:g}s"
                    ),
                    level=logging.WARNING, call=call_name(waiting.call), where=waiting.where,
                    seconds=age, missing=tuple(p.peer_id for p in waiting.missing()),
                )
                while age >= self._warning * 2**count:
                    count += 1
            warned[key] = count
        self._warned = {key: count for key, count in warned.items() if count}
        for waiting, reason in due:
            self._table.report(
                RunKind.REFUSED, f"refused: {reason}", level=logging.WARNING,
                call=call_name(waiting.call), where=waiting.where, reason=reason,
            )
            waiting.fail(reason)
        if due:
            self.changed()
        return bool(due)

    @staticmethod
    def _who(waiting: Waiting) -> str:
        """The missing peers and what each waits in: ``the peers that did not call it:
        peer 3 waits in all_reduce(tag=1); peer 5 is in no call``."""
        calls = "; ".join(pending_calls(peer) for peer in waiting.missing())
        return f"{waiting.awaited}: {calls}"
