"""``all_reduce_multiple_with_retry``: its all-reduces in passes, each retried until it
succeeded or was rejected.

Theory of operation
-------------------
The call runs in passes over its all-reduces (one per bucket of fused tensors,
``peer/_fusion.py``; "index" below is the bucket's, its tag). A pass starts on an
up-to-date ring and launches the same indices in the same order on every peer, each
attempt made and registered as it is launched (the ring is made up to date once for
the pass, and each attempt registered at once), so this peer votes for it before it
could vote to re-establish the ring. Once the ring went stale (an attempt was aborted),
the pass launches nothing more; the next pass retries the aborted and the unlaunched
indices. Without that stop, a peer that heard of an abort late could vote for an index
before the re-establishment and another peer only after it: the master aborts the
first vote (the other peer was in the establishment vote), and the second waits, in
its old pass, for a vote that the first peer makes only in a later pass, if ever. With
it, an index is voted in the pass's ring or not at all, every peer sees the same
verdicts, and all retry alike. A rejection (the peers disagree, or data cannot be
reduced) is not retried: every peer got it, and would get it again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import trio

from .._errors import CollectiveAborted, InvalidArgument, PCCLError, TooFewPeers
from .._types import ReduceInfo
from ._collectives import AllReduces
from ._membership import Membership
from ._metrics import NoMetrics
from ._requests import ReduceRequest
from ._results import Blocked, ReduceResult, Rejected
from ._session import MasterLost

__all__ = ["RetriedReduces"]

log = logging.getLogger("pccl_trio.peer")


@dataclasses.dataclass(kw_only=True, slots=True)
class _Outcome:
    """What ``all_reduce_multiple_with_retry`` gathered over its passes."""

    tx: int = 0
    rx: int = 0
    clamped: int = 0
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)
    on_success: Callable[[int], None] | None = None
    recorded: set[int] = dataclasses.field(default_factory=set)

    def succeeded(self, index: int, info: ReduceInfo) -> None:
        self.recorded.add(index)
        self.tx += info.tx_bytes
        self.rx += info.rx_bytes
        self.clamped += info.clamped
        if self.on_success is not None:
            self.on_success(index)


def _rejection(
    requests: Sequence[ReduceRequest],
    members: Sequence[Sequence[int]] | None,
    rejected: dict[int, str],
) -> InvalidArgument:
    """The error naming the tensors of the rejected all-reduces of a retried set."""
    if members is None:
        members = [(index,) for index in range(len(requests))]
    count = sum(len(m) for m in members)
    indices = sorted(rejected)
    tensors = sorted(t for index in indices for t in members[index])
    fused = [index for index in indices if len(members[index]) > 1]
    where = (
        f"; fused in buckets {fused}, whose peers may disagree on the tensor list or "
        "on Config.bucket_bytes" if fused else ""
    )
    first = indices[0]
    return InvalidArgument(
        f"{len(tensors)} of {count} tensors were rejected for every peer (tensors "
        f"{tensors}{where}; they were restored to their inputs, the others completed); "
        f"tag {first} (tensors {list(members[first])}): {rejected[first]}"
    )


class RetriedReduces:
    """The retried all-reduces of one communicator (see the module docstring).

    Args:
        reduces: where each all-reduce is launched.
        membership: the ring the passes run on, and whether it went stale.
        metrics: where the retries are counted.
    """

    def __init__(self, reduces: AllReduces, *, membership: Membership, metrics: NoMetrics) -> None:
        self._reduces = reduces
        self._membership = membership
        self._metrics = metrics

    async def run(
        self,
        requests: Sequence[ReduceRequest],
        max_in_flight: int,
        *,
        members: Sequence[Sequence[int]] | None = None,
        on_success: Callable[[int], None] | None = None,
    ) -> ReduceInfo:
        """``Communicator.all_reduce_multiple_with_retry``'s all-reduces (its buckets,
        ``peer/_fusion.py``), each retried until it succeeded or was rejected.

        Args:
            members: per request, the indices of the caller's tensors it carries, to
                name them in a rejection (default: request ``i`` is tensor ``i``).
            on_success: called with a request's index once it succeeded (also for
                one that succeeded after all while the call was being cancelled),
                before the call returns or raises.
        """
        outcome = _Outcome(on_success=on_success)
        pending = list(range(len(requests)))
        while pending:
            # Calls cancelled before their commence (an earlier pass of a cancelled
            # call of this method, say) may still hold its tags: they end first.
            await self._reduces.calls.wound_down()
            # Asked before the ring is brought up to date, so that a call holding this
            # peer in a vote is reported rather than waited for; each launch of the
            # pass asks again (``_reduce_pass``), after the waits that came since.
            self._reduces.check_launch()
            try:
                # Every pass starts on an up-to-date ring, like a single all-reduce.
                await self._membership.ensure_ring()
            except MasterLost:
                continue  # its vote died with the master; the next one waits for it
            ring = self._membership.ring
            if len(ring) < 2:
                raise TooFewPeers(
                    f"the peer group has {len(ring)} peer; {len(pending)} of "
                    f"{len(requests)} all-reduces could not complete"
                )
            pending = await self._reduce_pass(requests, pending, max_in_flight, outcome)
            if pending:
                log.info("peer %s: retrying %d all-reduces", self._reduces.peer_id, len(pending))
                self._metrics.retries(len(pending))
        if outcome.rejected:
            raise _rejection(requests, members, outcome.rejected)
        return ReduceInfo(
            world_size=len(self._membership.ring), tx_bytes=outcome.tx, rx_bytes=outcome.rx,
            clamped=outcome.clamped,
        )

    async def _reduce_pass(
        self,
        requests: Sequence[ReduceRequest],
        pending: list[int],
        max_in_flight: int,
        outcome: _Outcome,
    ) -> list[int]:
        """One pass over ``pending``, on the ring as it is (up to date): the aborted
        and the unlaunched indices, to retry. Successes and rejections are recorded in
        ``outcome``.

        Every peer launches the same indices in the same order. Each is made and
        registered as it is launched, on the pass's ring; once the ring went stale
        (an all-reduce was aborted), the pass launches nothing more: the rest are
        retried in the next pass, after the re-establishment. So every peer votes for
        an index either in this pass, before it votes to re-establish the ring, or not
        at all here; and a vote that another peer did not match is aborted by the
        master (that peer is in the establishment vote, which blocks all-reduces), so
        every peer sees the same verdict for every index and retries the same ones.
        Cancelled, it stops the all-reduces in flight as a cancelled ``all_reduce``
        does, and waits for them: no tensor is written once ``Cancelled`` propagates.
        """
        failed: list[int] = []
        fatal: list[PCCLError] = []
        slots = trio.Semaphore(max_in_flight)
        results: dict[int, ReduceResult] = {}
        generation = self._membership.generation

        async def one(index: int) -> None:
            try:
                info = await results[index].get()
            except Blocked as exc:  # a member syncs: retrying before that fails alike
                fatal.append(CollectiveAborted(str(exc)))
            except CollectiveAborted:
                failed.append(index)
            except Rejected as exc:  # the same verdict on every peer: not retried
                outcome.rejected[index] = str(exc)
            except PCCLError as exc:  # the run is over for us: stop launching
                fatal.append(exc)
            else:
                outcome.succeeded(index, info)
            finally:
                slots.release()

        try:
            async with trio.open_nursery() as nursery:
                for position, index in enumerate(pending):
                    await slots.acquire()  # launch in index order, the same on every peer
                    if fatal:
                        break
                    if self._membership.generation != generation or self._membership.stale:
                        # Voting now could come after this peer's establishment vote,
                        # and so after another peer's vote for this index was aborted
                        # (see above): leave the rest to the next pass.
                        failed.extend(pending[position:])
                        break
                    try:
                        self._reduces.check_launch()
                        results[index] = self._reduces.start(requests[index], on_current_ring=True)
                    except PCCLError as exc:
                        fatal.append(exc)
                        break
                    nursery.start_soon(one, index)
        finally:
            running = [result for result in results.values() if not result.done]
            if running:  # cancelled: stop them all, then wait for each to settle
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as stopping:
                        for result in running:
                            stopping.start_soon(self._reduces.cancel, result)
            for index, result in results.items():
                # Succeeded, but cancelled before ``one`` recorded it (or too late to
                # abort): its result stands, as a cancelled ``all_reduce``'s does.
                if result.info is not None and index not in outcome.recorded:
                    outcome.succeeded(index, result.info)
        if fatal:
            raise fatal[0]
        return sorted(failed)

