"""All-reduce calls: arguments, attempts, verdicts, and what follows an abort.

Theory of operation
-------------------
``all_reduce_async`` checks its arguments into a ``ReduceRequest``, reserves the tag and
runs the call in a task of the communicator (the handle's result is set by that task
whatever happens). One call is one *attempt*:

1. If an earlier abort left the ring stale, it is re-established first
   (``Membership.ensure_ring``).
2. The attempt is built (buffers, schedule, codec) and registered with the receive
   path (``DataReceiver``) *before* the vote, so that frames arriving the moment the
   master commences it have somewhere to go.
3. The vote (``CollectiveInitiate``) carries the call's descriptor; the master answers
   with ``CollectiveCommence`` once every peer of the group voted alike, or at once with
   a verdict (the peers disagree, a peer votes for something else, the ring is stale).
4. Commenced, this peer sends its part (``AllReduceAttempt.send_all``); the master's
   ``CollectiveAbort``, the loss of the master and the end of the run stop it where it
   is (routes and hooks of the session, run as each arrives: no task watches for them).
   It reports ``CollectiveComplete`` and waits for the verdict, which is the same on
   every peer.
5. The attempt ends: no more writes, no more frames routed to it. On an aborted
   verdict the ring is marked stale at once, the input is restored, and the last
   attempt of a failed set re-establishes the ring (unless that was done since) so
   that a retry runs on the survivors. A verdict that it never ran leaves the ring as
   it is: REJECTED (the peers disagree) and BLOCKED (a member waits in a shared-state
   sync, whose vote a re-establishment would refuse; this peer's next call is its own
   sync, and ``all_reduce_multiple_with_retry`` gives up rather than retry).

A cancelled ``all_reduce`` follows trio's rule for an operation that may be past the
point of no return: the cancellation either takes effect, and then the all-reduce was
aborted for every peer and the caller's buffers hold its input (and nothing writes to
them any more), or it comes too late, and the call returns its result. Before the
master commenced the attempt nothing was written: the attempt is stopped (it is made
stopped if it did not exist yet; it still votes, and its first act once commenced is
to fail, which aborts it for everyone) and ``Cancelled`` propagates at once. After, this
peer's part is failed, which aborts the collective unless the part was complete; the
caller waits (shielded) for the verdict and the restore, which the protocol's timers
bound: SUCCESS (every peer had finished) returns the result, anything else re-raises.

``all_reduce_multiple_with_retry`` runs in passes over its all-reduces (one per bucket
of fused tensors, ``peer/_fusion.py``; "index" below is the bucket's, its tag). A pass
starts on an up-to-date ring and launches the same indices in the same order on every
peer, each attempt made and registered as it is launched (step 1 is done once for the
pass, and step 2 at once), so this peer votes for it before it could vote to
re-establish the ring. Once the ring went stale (an attempt was aborted), the pass
launches nothing more; the next pass retries the aborted and the unlaunched indices.
Without that stop, a peer that heard of an abort late could vote for an index before
the re-establishment and another peer only after it: the master aborts the first vote
(the other peer was in the establishment vote), and the second waits, in its old pass,
for a vote that the first peer makes only in a later pass, if ever. With it, an index
is voted in the pass's ring or not at all, every peer sees the same verdicts, and all
retry alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import trio

from .._core.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveVerdict,
    Message,
    Outcome,
    bounded,
)
from .._errors import (
    CollectiveAborted,
    InvalidArgument,
    InvalidUsage,
    PCCLError,
    TooFewPeers,
    UpdateTopologyFailed,
    shown_as_base,
)
from .._types import (
    ReduceInfo,
)
from ..ops import Codec
from ..transport import run_in_thread
from ._allreduce import AllReduceAttempt, LocalFailure
from ._context import PeerContext
from ._membership import Membership
from ._receiver import DataReceiver
from ._requests import ReduceRequest
from ._results import AsyncReduceHandle, ReduceResult
from ._session import MasterLost
from ._staging import gpu_of, staging_for

__all__ = ["AllReduces"]

log = logging.getLogger("pccl_trio.peer")


_CANCELLED = "the caller cancelled the all-reduce"


def _outcome(error: BaseException | None) -> str:
    """An all-reduce's outcome as the metrics name it."""
    if error is None:
        return "success"
    if isinstance(error, _Blocked):
        return "blocked"
    if isinstance(error, CollectiveAborted):
        return "aborted"
    if isinstance(error, InvalidArgument):
        return "rejected"
    return "failed"


@shown_as_base
class _Rejected(InvalidArgument):
    """The master rejected a collective for every peer of its group (the peers disagree
    on its arguments, or a peer's data cannot be reduced): retrying would fail alike."""


@shown_as_base
class _Blocked(CollectiveAborted):
    """The master ended a collective before it ran because a member waits in a
    shared-state sync: the ring is intact; retrying before syncing would fail alike."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _RetryOutcome:
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


class AllReduces:
    """This peer's all-reduces (see the module docstring)."""

    def __init__(
        self, context: PeerContext, *, receiver: DataReceiver, membership: Membership
    ) -> None:
        self._config = context.config
        self._life = context.lifecycle
        self._session = context.session
        self._p2p = context.p2p
        self._metrics = context.metrics
        self._receiver = receiver
        self._membership = membership
        self.tags_in_flight: set[int] = set()  # reserved at launch, until the handle ends
        # The commenced attempts sending their part, by tag (one attempt per tag).
        self._parts: dict[int, _Part] = {}
        self._session.route(CollectiveAbort, self._on_abort)
        self._session.on_away(self._on_master_lost)
        self._life.on_failure(self._on_run_over)

    def check_idle(self, call: str) -> None:
        """Connected, with no all-reduce in flight (``call`` is the call asking)."""
        self._life.check_connected()
        if self.tags_in_flight:
            raise InvalidUsage(
                f"{call}() while all-reduces are in flight (tags "
                f"{sorted(self.tags_in_flight)}); await them first"
            )

    # --- calls ---------------------------------------------------------------------------

    async def all_reduce(self, request: ReduceRequest) -> ReduceInfo:
        """``Communicator.all_reduce`` with its arguments checked."""
        result = self._start(request)
        try:
            return await result.get()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                info = await self._cancel(result)
            if info is None:
                raise
        # Too late to abort: the all-reduce succeeded for every peer and the result is
        # in the buffer. Like a trio operation whose abort failed, it returns; the
        # caller's cancelled scope raises Cancelled at its next checkpoint.
        return info

    async def _cancel(self, result: ReduceResult) -> ReduceInfo | None:
        """Stop this peer's part of a cancelled all-reduce (see the module docstring);
        its ``ReduceInfo`` if it succeeded all the same, else None: the buffers hold the
        input, and nothing writes to them any more."""
        result.cancelled = True
        attempt = result.attempt
        if attempt is None or not attempt.seq:
            # Not commenced: no byte was written, and with the attempt stopped (or made
            # stopped) none will be; once commenced, it fails at once.
            if attempt is not None:
                attempt.fail(_CANCELLED)
                attempt.stop()
            return None
        if not result.done:
            attempt.fail(_CANCELLED)  # no effect if this peer's part was complete
        await result.final.wait()
        return result.info

    def launch(self, request: ReduceRequest) -> AsyncReduceHandle:
        """``Communicator.all_reduce_async`` with its arguments checked."""
        return AsyncReduceHandle(request.tag, self._start(request))

    def check_launch(self) -> None:
        """An all-reduce may start now: connected, and no call holds this peer in a
        vote that a collective cannot join."""
        self._life.check_connected()
        busy = self._life.busy
        if busy is not None and busy.blocks_all_reduce:
            raise InvalidUsage(f"all_reduce() while {busy.value} runs on this communicator")

    def _start(self, request: ReduceRequest, *, on_current_ring: bool = False) -> ReduceResult:
        """Reserve the tag and run the all-reduce in a task of the communicator.

        ``on_current_ring``: the attempt is made and registered now, on the ring as it
        is (which must not be stale), rather than by the task once the ring is up to
        date; this peer then votes for it before any later establishment vote.
        """
        self.check_launch()
        if request.tag in self.tags_in_flight:
            raise InvalidUsage(
                f"tag {request.tag} is already in flight; give concurrent all-reduces distinct tags"
            )
        self.tags_in_flight.add(request.tag)
        result = ReduceResult()
        try:
            attempt = self._prepare(request, result) if on_current_ring else None
            self._life.spawn(self._run, request, result, attempt)
        except BaseException:
            self.tags_in_flight.discard(request.tag)
            if result.attempt is not None:
                self._receiver.remove(result.attempt)
                result.attempt.release()
            raise
        return result

    async def reduce_each_with_retry(
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
        outcome = _RetryOutcome(on_success=on_success)
        pending = list(range(len(requests)))
        while pending:
            self.check_launch()
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
                log.info("peer %s: retrying %d all-reduces", self._session.peer_id, len(pending))
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
        outcome: _RetryOutcome,
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
            except _Blocked as exc:  # a member syncs: retrying before that fails alike
                fatal.append(CollectiveAborted(str(exc)))
            except CollectiveAborted:
                failed.append(index)
            except _Rejected as exc:  # the same verdict on every peer: not retried
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
                        results[index] = self._start(requests[index], on_current_ring=True)
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
                            stopping.start_soon(self._cancel, result)
            for index, result in results.items():
                # Succeeded, but cancelled before ``one`` recorded it (or too late to
                # abort): its result stands, as a cancelled ``all_reduce``'s does.
                if result.info is not None and index not in outcome.recorded:
                    outcome.succeeded(index, result.info)
        if fatal:
            raise fatal[0]
        return sorted(failed)

    # --- one attempt -----------------------------------------------------------------------

    async def _run(
        self, request: ReduceRequest, result: ReduceResult, attempt: AllReduceAttempt | None
    ) -> None:
        """The task behind a handle; every outcome ends up in ``result``. ``attempt``:
        made and registered at launch (None: made here)."""
        started = time.perf_counter()
        try:
            info = await self._attempt(request, result, attempt)
        except MasterLost as exc:  # the input is restored (``_attempt``), the run goes on
            result.finish(None, CollectiveAborted(
                f"the all-reduce with tag {request.tag} was aborted: {exc}; the input was "
                "restored, and a retry runs once the master is back"
            ))
        except PCCLError as exc:
            result.finish(None, exc)
        except Exception as exc:  # a bug: report it to the caller, keep the peer alive
            log.exception("all-reduce with tag %d failed unexpectedly", request.tag)
            result.finish(None, exc)
        else:
            result.finish(info, None)
        finally:
            # Cancelled (alone, or grouped by the nurseries it crossed): the
            # communicator is closing under it.
            if not result.done:
                result.finish(
                    None, InvalidUsage("the communicator was closed during the all-reduce")
                )
            self.tags_in_flight.discard(request.tag)
            self._observe(result, time.perf_counter() - started)

    def _observe(self, result: ReduceResult, seconds: float) -> None:
        """Tell the metrics how an all-reduce ended."""
        info, error = result.info, result.error
        attempt = result.attempt
        self._metrics.all_reduce(
            _outcome(error), seconds, info.tx_bytes if info else 0, info.rx_bytes if info else 0,
            attempt.restore_seconds if attempt is not None else 0.0,
        )

    def _prepare(self, request: ReduceRequest, result: ReduceResult) -> AllReduceAttempt:
        """Make the attempt on the ring as it is and register it with the receive path
        (before the vote; from now on this peer re-establishes no ring before it ends)."""
        ring = self._membership.ring
        if len(ring) < 2:
            raise TooFewPeers("all_reduce() needs at least 2 peers in the peer group; it has 1")
        assert self._session.peer_id is not None
        codec = None
        if request.quantization is not None:
            codec = Codec(request.xp, request.result.dtype, request.quantization.algorithm,
                          request.quantization.quantized_datatype, request.hint)
        staging = staging_for(request.xp, gpu_of(request.xp, request.result))
        staging.check_slices(self._config.slice_bytes, int(request.result.nbytes))
        attempt = AllReduceAttempt(
            staging=staging, send=request.send, result=request.result, op=request.op, tag=request.tag,
            ring=ring, rank=ring.index(self._session.peer_id),
            slice_bytes=self._config.slice_bytes, codec=codec,
        )
        self._receiver.add(attempt)
        result.attempt = attempt
        if result.cancelled:  # the caller is gone: take part only to fail
            attempt.fail(_CANCELLED)
            attempt.stop()
        return attempt

    async def _attempt(
        self, request: ReduceRequest, result: ReduceResult, attempt: AllReduceAttempt | None
    ) -> ReduceInfo:
        if attempt is None:
            await self._membership.ensure_ring()
            attempt = self._prepare(request, result)
        ring = attempt.ring
        tag = request.tag
        verdict: CollectiveVerdict | None = None
        local_ok = False
        try:
            await self._session.send(request.vote(self._config.slice_bytes))
            if request.fill is not None:
                # Before any checkpoint: the commence (the master needs every vote) is
                # applied by a trio task, so no frame reaches the attempt before this.
                request.fill()
            reply: CollectiveCommence | CollectiveVerdict = await self._session.wait_for(
                (CollectiveCommence, CollectiveVerdict),
                lambda m: m.tag == tag and (isinstance(m, CollectiveCommence) or m.seq == 0),
            )
            if isinstance(reply, CollectiveVerdict):
                verdict = reply
            else:
                local_ok = await self._run_ring(attempt)
                verdict = await self._session.wait_for(
                    CollectiveVerdict, lambda m: m.tag == tag and m.seq == attempt.seq
                )
        except BaseException as exc:
            self._end(attempt)
            if isinstance(exc, MasterLost) and attempt.seq:
                # Data was moving when the master was lost: the ring's connections may
                # hold parts of frames. Re-establish it before the retry, as after any
                # abort (marked before the settle, as below).
                self._membership.stale = True
            await attempt.settle()
            attempt.restore()
            attempt.release()
            if verdict is None and isinstance(exc, Exception) and not isinstance(exc, PCCLError):
                # A bug after this peer voted (the protocol's own errors leave the
                # master informed).
                self._abandon(attempt, exc)
            raise
        self._end(attempt)
        try:
            if verdict.outcome == Outcome.SUCCESS and local_ok:
                return ReduceInfo(
                    world_size=len(ring), tx_bytes=attempt.tx_bytes, rx_bytes=attempt.rx_bytes,
                    clamped=attempt.clamped,
                )
            never_ran = verdict.outcome in (Outcome.REJECTED, Outcome.BLOCKED) and not verdict.seq
            if not never_ran:
                # Stale from the verdict on, not from after the settle: a
                # re-establishment that another attempt starts meanwhile then covers
                # this abort too. Marked later, it would call for a second, needless
                # round, whose vote aborts the all-reduces that peers launched on the
                # ring the first one made.
                self._membership.stale = True
            await attempt.settle()
            if never_ran:
                attempt.restore()  # nothing was written, but keep the rule simple
                if verdict.outcome == Outcome.BLOCKED:
                    raise _Blocked(
                        f"the all-reduce with tag {tag} was aborted for every peer before it "
                        f"ran: {verdict.reason}; the input is unchanged: synchronize the "
                        "shared state as that peer does, then retry"
                    )
                raise _Rejected(verdict.reason)
            reason = verdict.reason or attempt.failure or "a peer failed"
            await self._after_abort(attempt, result)
            if verdict.outcome == Outcome.REJECTED:
                # A peer's data could not be reduced: retrying would fail alike.
                raise _Rejected(
                    f"the all-reduce with tag {tag} failed for every peer: {reason}; the "
                    "input was restored"
                )
            raise CollectiveAborted(
                f"the all-reduce with tag {tag} was aborted for every peer: {reason}; the "
                "input was restored and retrying is safe"
            )
        finally:
            attempt.release()

    async def _after_abort(self, attempt: AllReduceAttempt, result: ReduceResult) -> None:
        """An aborted attempt (the ring is marked stale already): restore the input
        (then the buffers are final); the last attempt of the failed set also
        re-establishes the ring, unless that was done since, so a retry runs at once on
        the surviving peers."""
        last = not self._receiver.in_flight
        ring_error: PCCLError | None = None

        async def restore_in_thread() -> None:
            await run_in_thread(attempt.restore, interrupt=lambda: None)
            result.final.set()

        async with trio.open_nursery() as nursery:
            if last and attempt.uses_threads:
                # Restore (a copy of up to the whole buffer) in a worker thread
                # while the ring is re-established below.
                nursery.start_soon(restore_in_thread)
            else:
                attempt.restore()
                result.final.set()
            if last:
                try:
                    await self._membership.ensure_ring()
                except UpdateTopologyFailed:
                    pass
                except PCCLError as exc:  # raised below, not grouped by the nursery
                    ring_error = exc
        if ring_error is not None:
            raise ring_error

    def _abandon(self, attempt: AllReduceAttempt, error: Exception) -> None:
        """This peer voted for a collective and then failed unexpectedly (a bug). The
        others count on its part, and after the abort on its vote to re-establish the
        ring; it can promise neither, so it leaves the run, and the master tells them."""
        self._life.fail(
            InvalidUsage(
                f"internal error during the all-reduce with tag {attempt.tag} ({error!r}); "
                "this peer left the run so the others do not wait for it: create a new "
                "Communicator to join again"
            )
        )

    def _end(self, attempt: AllReduceAttempt) -> None:
        """The attempt is over: no more writes, no more frames or aborts routed to it."""
        attempt.stop()
        self._receiver.remove(attempt)

        def stale_abort(message: Message) -> bool:
            return isinstance(message, CollectiveAbort) and message.seq == attempt.seq

        self._session.discard(stale_abort)
        self._life.notify()

    async def _complete(self, attempt: AllReduceAttempt, ok: bool) -> None:
        """Report this peer's part to the master. Cancellable until the master link is
        up, shielded from then on: a frame half-sent would end the link."""
        await self._session.until_back()
        with trio.CancelScope(shield=True):
            await self._session.send(
                CollectiveComplete(
                    tag=attempt.tag, seq=attempt.seq, aborted=not ok,
                    invalid=bounded(attempt.invalid or ""),
                )
            )

    async def _run_ring(self, attempt: AllReduceAttempt) -> bool:
        """This peer's part of a commenced attempt, reported to the master with
        ``CollectiveComplete``; True if it completed locally. The master's abort stops
        the part where it is (``_on_abort``), and it is reported aborted; the loss of
        the master or the end of the run stop it too, and raise (no report: the master
        that commenced it is gone).

        Raises:
            MasterLost: the master was lost while the part ran.
            PCCLError: the run is over for this peer.
        """
        self._life.raise_if_failed()
        successor = attempt.successor
        connections = self._p2p.successor_connections(successor)
        if not connections:
            attempt.fail(f"no open connection to the next peer ({successor})")
        part = self._parts[attempt.tag] = _Part(attempt)
        if self._session.away:  # a commence a lost link's reader delivered late
            part.master_lost = True
            part.stop()
        ok = False
        try:
            with part.scope:
                try:
                    await attempt.send_all(connections)
                    ok = True
                except LocalFailure as exc:
                    log.info("peer %s: tag %d failed locally: %s", self._session.peer_id,
                             attempt.tag, exc)
        finally:
            del self._parts[attempt.tag]
        self._life.raise_if_failed()
        if part.master_lost:
            raise MasterLost(
                f"lost the master at {self._session.address} during the all-reduce with "
                f"tag {attempt.tag}"
            )
        ok = ok and attempt.live
        await self._complete(attempt, ok)
        return ok

    # --- what stops a part (called by the session, never blocking) --------------------------

    def _on_abort(self, message: CollectiveAbort) -> None:
        """The master aborted an attempt (a route of the session: applied as the abort
        arrives). The attempt is stopped, from its commence (registered with the
        receiver) to its end: a part running stops where it is, one not started yet
        fails at once. (An attempt whose part ended is stopped too, harmlessly: the
        master aborts only peers that did not complete, and the verdict after an abort
        is never a success.)"""
        attempt = self._receiver.by_tag.get(message.tag)
        if attempt is None or attempt.seq != message.seq:
            return  # over already (its verdict tells), or an older attempt's abort
        part = self._parts.get(message.tag)
        if part is not None:
            part.stop()
        else:
            attempt.stop()

    def _on_master_lost(self) -> None:
        self._stop_parts(master_lost=True)

    def _on_run_over(self) -> None:
        self._stop_parts(master_lost=False)

    def _stop_parts(self, *, master_lost: bool) -> None:
        for part in list(self._parts.values()):
            part.master_lost = part.master_lost or master_lost
            part.stop()


class _Part:
    """A commenced attempt's part while it runs: ``stop`` ends the attempt and
    cancels the task sending it."""

    def __init__(self, attempt: AllReduceAttempt) -> None:
        self.attempt = attempt
        self.scope = trio.CancelScope()
        self.master_lost = False

    def stop(self) -> None:
        self.attempt.stop()  # no more writes, whatever is in flight
        self.scope.cancel()
