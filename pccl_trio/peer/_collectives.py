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
4. Commenced, this peer sends its part (``RingAttempt.send_all``); the master's
   ``CollectiveAbort``, the loss of the master and the end of the run stop it where it
   is (routes and hooks of the session, run as each arrives: no task watches for them;
   ``_parts``).
   It reports ``CollectiveComplete`` and waits for the verdict, which is the same on
   every peer.
5. The attempt ends: no more writes, no more frames routed to it. On an aborted
   verdict the ring is marked stale at once, the input is restored, and the last
   attempt of a failed set re-establishes the ring (unless that was done since) so
   that a retry runs on the survivors. A verdict that it never ran leaves the ring as
   it is: REJECTED (the peers disagree); so does BLOCKED (a member waits in a
   shared-state sync, whose vote a re-establishment would refuse; this peer's next
   call is its own sync, and ``all_reduce_multiple_with_retry`` gives up rather than
   retry).

A success may lease the tag to the group (``_leases``; asked for with
``Config.leases``). The next calls of the tag with the same descriptor, on the same
ring, then skip steps 3 and 4's messages: the attempt takes the lease's next number
when it is made (step 2), runs its part at once, and succeeds once every member
completed theirs, which the members tell each other (``_agreement``). Only when the
lease ends while it runs (something failed, ran long, or a member called otherwise)
does the master decide it, with a verdict like any other. The loss of the master does
not stop it: it needs the master only then.

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
A call cancelled before the commence thus winds down after its caller left: it still
votes, and ends with the verdict. Until then its tag stays taken; a later call of the
tag waits for it in its own task instead of being refused as a concurrent one (which
the caller could not have helped: its call returned), and so do the membership calls
and each pass of ``all_reduce_multiple_with_retry`` (``CallsByTag.wound_down``): the
master accepts a membership vote only from a peer with no collective in flight.

``all_reduce_multiple_with_retry``'s passes over its all-reduces are in ``_retry``, which
launches them here (``start``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import trio

from .._core.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveKind,
    CollectiveVerdict,
    Message,
    Outcome,
    bounded,
)
from .._core.ring import RingSchedule, ring_parts, striped_slice
from .._errors import (
    CollectiveAborted,
    InvalidArgument,
    InvalidUsage,
    PCCLError,
    TooFewPeers,
    UpdateTopologyFailed,
)
from .._types import ReduceInfo, Shard
from ..ops import Codec, Recycled, copy_into, gpu_of, in_kind_of, staging_for
from ..transport import run_in_thread
from ._attempt import RingAttempt
from ._context import PeerContext
from ._leases import Leases
from ._membership import Membership
from ._parts import Part, RunningParts
from ._receiver import DataReceiver
from ._requests import ReduceRequest
from ._results import (
    AsyncReduceHandle,
    AsyncValueHandle,
    Blocked,
    CallsByTag,
    ReduceResult,
    Rejected,
)
from ._session import MasterLost

__all__ = ["AllReduces", "gathered", "shard"]

T = TypeVar("T")
H = TypeVar("H", bound=AsyncValueHandle[Any])

log = logging.getLogger("pccl_trio.peer")


_CANCELLED = "the caller cancelled the all-reduce"


def _outcome(error: BaseException | None) -> str:
    """An all-reduce's outcome as the metrics name it."""
    if error is None:
        return "success"
    if isinstance(error, Blocked):
        return "blocked"
    if isinstance(error, CollectiveAborted):
        return "aborted"
    if isinstance(error, InvalidArgument):
        return "rejected"
    return "failed"


def shard(request: ReduceRequest, send: Any, result: ReduceResult) -> Shard:
    """This peer's part of a reduce-scatter that succeeded: the range its schedule
    ends holding, copied out of the scratch buffer, in the kind of the caller's
    ``send``."""
    assert result.attempt is not None
    start, stop = result.attempt.schedule.scattered
    itemsize = int(request.result.dtype.itemsize)
    first, last = start // itemsize, stop // itemsize
    return Shard(first, last, in_kind_of(send, request.result[first:last].copy()))


def gathered(request: ReduceRequest, send: Any, result: ReduceResult) -> dict[int, Any]:
    """Every member's part of an all-gather that succeeded, by ascending peer id, each
    a view of the one buffer they gathered into, in the kind of the caller's ``send``
    (this peer's own part is copied in from ``send``, which the ring only read)."""
    attempt, buffer = result.attempt, result.gathered
    assert attempt is not None
    start, count = result.parts[attempt.ring[attempt.schedule.rank]]
    copy_into(request.xp, buffer[start:start + count], request.send)
    return {
        peer_id: in_kind_of(send, buffer[start:start + count])
        for peer_id, (start, count) in sorted(result.parts.items())
    }


def _by_peer_id(ring: tuple[int, ...], sizes: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """Where each member's part of a gathered buffer lies (its offset and size, in
    elements, by peer id): in ascending peer-id order, ``sizes[c]`` the part of ring
    position ``c``, as ``RingSchedule.all_gather`` lays them out."""
    parts: dict[int, tuple[int, int]] = {}
    start = 0
    for peer_id, size in sorted(zip(ring, sizes, strict=True)):
        parts[peer_id] = (start, size)
        start += size
    return parts


def _data_plan(
    request: ReduceRequest, result: ReduceResult, ring: tuple[int, ...], rank: int, *,
    slice_bytes: int, stripes: int, recycled: Recycled,
) -> tuple[RingSchedule, Any, Any, int]:
    """What a call moves on ``ring`` at ``rank``: its schedule, the buffers it sends
    from and writes into, and where its own part lies in the latter (an all-gather's).
    A Top-k all-reduce gathers every peer's selection into a buffer of its own."""
    send, buffer, own_start = request.send, request.result, 0
    topk = request.topk
    if topk is not None:
        assert topk.selection is not None  # chosen before the attempt is made
        send = topk.selection.payload
        size = topk.layout.payload_bytes
        buffer = recycled.take(("topk", request.tag), request.xp, send, len(ring) * size)
        result.parts = _by_peer_id(ring, (size,) * len(ring))
        result.gathered = buffer
        own_start = result.parts[ring[rank]][0]
    itemsize = int(buffer.dtype.itemsize)
    cut = striped_slice(
        slice_bytes, nbytes=int(buffer.nbytes), world=len(ring), itemsize=itemsize,
        stripes=stripes,
    )
    count = int(buffer.size)
    if request.kind == CollectiveKind.BROADCAST:
        schedule = RingSchedule.broadcast(
            count=count, itemsize=itemsize, world=len(ring), rank=rank,
            root=ring.index(request.root), slice_bytes=cut,
        )
    elif request.kind == CollectiveKind.ALL_GATHER:
        # No data until the commence tells every member's size (``_sizing``).
        schedule = RingSchedule(
            world=len(ring), rank=rank, itemsize=itemsize, slice_bytes=cut, send=(), recv=(),
        )
    elif topk is not None:
        schedule = RingSchedule.all_gather(
            sizes=(topk.layout.payload_bytes,) * len(ring), ids=ring, itemsize=1, rank=rank,
            slice_bytes=cut,
        )
    else:
        schedule = RingSchedule.all_reduce(
            count=count, itemsize=itemsize, world=len(ring), rank=rank, slice_bytes=cut,
            parts=ring_parts(ring), scatter=request.kind == CollectiveKind.REDUCE_SCATTER,
        )
    return schedule, send, buffer, own_start


def _sizing(
    attempt: RingAttempt, request: ReduceRequest, result: ReduceResult, *,
    slice_bytes: int, stripes: int, recycled: Recycled,
) -> Callable[[tuple[int, ...]], str | None]:
    """What makes an all-gather's schedule once the master's commence tells every
    member's size (``RingAttempt.sizing``): the buffer of all parts, in ascending
    peer-id order, and the ring's all-gather over it; or why it cannot."""

    def sized(sizes: tuple[int, ...]) -> str | None:
        ring, rank = attempt.ring, attempt.schedule.rank
        own = int(request.send.size)
        if not sizes or sizes[rank] != own:
            return (
                f"the master's part sizes {list(sizes)} for the ring {list(ring)} do not "
                f"give this peer its {own} elements"
            )
        itemsize = int(request.send.dtype.itemsize)
        total = sum(sizes)
        try:
            buffer = recycled.take(("all_gather", request.tag), request.xp, request.send, total)
        except (MemoryError, ValueError):  # numpy: "array is too big"
            return f"no memory for the {total} elements gathered from {len(ring)} peers"
        cut = striped_slice(
            slice_bytes, nbytes=total * itemsize, world=len(ring), itemsize=itemsize,
            stripes=stripes,
        )
        try:
            attempt.staging.check_slices(cut, total * itemsize)
        except PCCLError as exc:
            return str(exc)
        schedule = RingSchedule.all_gather(
            sizes=sizes, ids=ring, itemsize=itemsize, rank=rank, slice_bytes=cut
        )
        result.parts = _by_peer_id(ring, sizes)
        result.gathered = buffer
        attempt.reschedule(schedule, request.send, buffer, result.parts[ring[rank]][0] * itemsize)
        return None

    return sized


#: The calls, in words, by kind.
_CALLED = {
    CollectiveKind.ALL_REDUCE: "all-reduce", CollectiveKind.BARRIER: "barrier",
    CollectiveKind.REDUCE_SCATTER: "reduce-scatter", CollectiveKind.BROADCAST: "broadcast",
    CollectiveKind.ALL_GATHER: "all-gather", CollectiveKind.TOPK_ALL_REDUCE: "all-reduce",
}


#: The kinds counted in the metrics' ``pccl_peer_collective*`` families, by their label.
_METRIC_NAMES: dict[int, str] = {
    CollectiveKind.BROADCAST: "broadcast", CollectiveKind.ALL_GATHER: "all_gather",
    CollectiveKind.REDUCE_SCATTER: "reduce_scatter",
}


def _called(vote: CollectiveInitiate | None) -> str:
    """What the caller called, in words (an all-reduce before it voted)."""
    return "all-reduce" if vote is None else _CALLED[CollectiveKind(vote.kind)]


def _input_restored(kind: int, text: str) -> str:
    """``text``, said of the caller's input, if a call of ``kind`` writes to it (an
    in-place all-reduce and a broadcast may: a barrier has none, a reduce-scatter never
    writes it)."""
    return text if kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST) else ""


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
        # The calls by tag, from launch until their task ends.
        self.calls = CallsByTag()
        self._leases = Leases(context, receiver=receiver, membership=membership)
        # The commenced attempts sending their part, and what stops them.
        self._parts = RunningParts(context, receiver=receiver)
        # Buffers of results and scratch, reused once nobody holds them (by tag).
        self.recycled = Recycled()

    @property
    def peer_id(self) -> int | None:
        return self._session.peer_id

    def leased(self, tag: int) -> bool:
        """Whether a lease on ``tag`` stands here (``_leases``)."""
        return self._leases.standing(tag)

    async def leave(self) -> None:
        """This peer leaves the run: the master hears how far it got under its leases."""
        await self._leases.leave()

    def check_idle(self, call: str) -> None:
        """Connected, with no all-reduce in flight (``call`` is the call asking; it
        awaited ``calls.wound_down`` first)."""
        self._life.check_connected()
        if self.calls.tags:
            raise InvalidUsage(
                f"{call}() while all-reduces are in flight (tags "
                f"{sorted(self.calls.tags)}); await them first"
            )

    # --- calls ---------------------------------------------------------------------------

    async def all_reduce(self, request: ReduceRequest) -> ReduceInfo:
        """``Communicator.all_reduce`` with its arguments checked (and ``check_launch``
        asked before them)."""
        return await self._outcome(self.start(request))

    async def collect(self, request: ReduceRequest, value: Callable[[ReduceResult], T]) -> T:
        """A collective whose caller gets ``value`` of its result once it succeeded
        (``Communicator.reduce_scatter``, ``all_gather``), its arguments checked."""
        result = self.start(request)
        await self._outcome(result)
        return value(result)

    def launch_collect(
        self, request: ReduceRequest, value: Callable[[ReduceResult], Any], handle: type[H]
    ) -> H:
        """``collect``'s async form (``reduce_scatter_async``, ``all_gather_async``)."""
        result = self.start(request)
        return handle(request.tag, result, partial(value, result))

    async def _outcome(self, result: ReduceResult) -> ReduceInfo:
        """What the caller of a started collective gets, cancelled or not."""
        try:
            return await result.get()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                info = await self.cancel(result)
            if info is None:
                raise
        # Too late to abort: the all-reduce succeeded for every peer and the result is
        # in the buffer. Like a trio operation whose abort failed, it returns; the
        # caller's cancelled scope raises Cancelled at its next checkpoint.
        return info

    async def cancel(self, result: ReduceResult) -> ReduceInfo | None:
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
        """``Communicator.all_reduce_async`` with its arguments checked (and
        ``check_launch`` asked before them)."""
        return AsyncReduceHandle(request.tag, self.start(request))

    def check_launch(self) -> None:
        """An all-reduce may start now: connected, and no call holds this peer in a
        vote that a collective cannot join. Whoever launches one (``start``) asks this
        just before, with no checkpoint between: the facade before it checks the call's
        arguments, ``_retry`` before each all-reduce of a pass."""
        self._life.check_connected()
        busy = self._life.busy
        if busy is not None and busy.blocks_all_reduce:
            raise InvalidUsage(f"all_reduce() while {busy.spelling} runs on this communicator")

    def start(self, request: ReduceRequest, *, on_current_ring: bool = False) -> ReduceResult:
        """Reserve the tag and run the all-reduce in a task of the communicator (the
        caller asked ``check_launch`` since its last checkpoint).

        ``on_current_ring``: the attempt is made and registered now, on the ring as it
        is (which must not be stale), rather than by the task once the ring is up to
        date; this peer then votes for it before any later establishment vote.
        """
        result = ReduceResult()
        # A call made on the current ring cannot wait: its attempt registers now.
        before = self.calls.reserve(request.tag, result, may_wait=not on_current_ring)
        try:
            attempt = self._prepare(request, result) if on_current_ring else None
            self._life.spawn(self._run, request, result, attempt, before)
        except BaseException:
            self.calls.release(request.tag, result, before)
            if result.attempt is not None:
                self._receiver.remove(result.attempt)
                result.attempt.release()
            raise
        return result

    # --- one attempt -----------------------------------------------------------------------

    async def _run(
        self, request: ReduceRequest, result: ReduceResult, attempt: RingAttempt | None,
        before: ReduceResult | None = None,
    ) -> None:
        """The task behind a handle; every outcome ends up in ``result``. ``attempt``:
        made and registered at launch (None: made here). ``before``: the call of the
        same tag whose caller was cancelled, which ends first."""
        started = time.perf_counter()
        try:
            if before is not None:
                await before.ended.wait()
            info = await self._attempt(request, result, attempt)
            made = result.attempt
            if request.topk is not None and made is not None:
                # Succeeded for every peer: the dense sum and the residual, before the
                # result is set (a caller cancelled too late then finds them final).
                await request.topk.conclude(
                    result.parts, result.gathered, made.ring[made.schedule.rank]
                )
        except MasterLost as exc:  # the input is restored (``_attempt``), the run goes on
            result.finish(None, CollectiveAborted(
                f"the {_CALLED[request.kind]} with tag {request.tag} was aborted: {exc}; "
                f"{_input_restored(request.kind, 'the input was restored, and ')}"
                "a retry runs once the master is back"
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
            self.calls.release(request.tag, result, None)
            self._observe(request.kind, result, time.perf_counter() - started)

    def _observe(self, kind: int, result: ReduceResult, seconds: float) -> None:
        """Tell the metrics how a collective of ``kind`` ended (each kind but the two
        all-reduces counted apart)."""
        info, error = result.info, result.error
        if kind == CollectiveKind.BARRIER:
            self._metrics.barrier(_outcome(error), seconds)
            return
        if kind in _METRIC_NAMES:
            self._metrics.collective(
                _METRIC_NAMES[kind], _outcome(error), seconds,
                info.tx_bytes if info else 0, info.rx_bytes if info else 0,
            )
            return
        attempt = result.attempt
        self._metrics.all_reduce(
            _outcome(error), seconds, info.tx_bytes if info else 0, info.rx_bytes if info else 0,
            attempt.restore_seconds if attempt is not None else 0.0,
        )

    def _prepare(self, request: ReduceRequest, result: ReduceResult) -> RingAttempt:
        """Make the attempt on the ring as it is and register it with the receive path
        (before the vote; from now on this peer re-establishes no ring before it ends)."""
        ring = self._membership.ring
        if len(ring) < 2:
            raise TooFewPeers(
                f"{_CALLED[request.kind]} needs at least 2 peers in the peer group; it has 1: "
                "admit the waiting ones first (are_peers_pending, update_topology), or wait "
                "for them (wait_for_peers)"
            )
        assert self._session.peer_id is not None
        codec = None
        if request.quantization is not None:
            codec = Codec(request.xp, request.result.dtype, request.quantization.algorithm,
                          request.quantization.quantized_datatype, request.hint)
        staging = staging_for(request.xp, gpu_of(request.xp, request.result))
        rank = ring.index(self._session.peer_id)
        if request.kind == CollectiveKind.BROADCAST and request.root not in ring:
            raise InvalidArgument(
                f"broadcast(root={request.root}): no such peer in this peer group, whose "
                f"ring is {list(ring)}"
            )
        schedule, send, buffer, own_start = _data_plan(
            request, result, ring, rank, slice_bytes=self._config.slice_bytes,
            stripes=self._membership.stripes, recycled=self.recycled,
        )
        staging.check_slices(schedule.slice_bytes, int(buffer.nbytes))
        attempt = RingAttempt(
            schedule=schedule, staging=staging, send=send, result=buffer,
            op=request.op, tag=request.tag, ring=ring, codec=codec, own_start=own_start,
        )
        if request.topk is not None and request.topk.invalid is not None:
            attempt.ledger.reject(request.topk.invalid)  # the call fails for everyone
        if request.kind == CollectiveKind.ALL_GATHER:
            attempt.sizing = _sizing(
                attempt, request, result, slice_bytes=self._config.slice_bytes,
                stripes=self._membership.stripes, recycled=self.recycled,
            )
        self._receiver.add(attempt)
        result.attempt = attempt
        vote = result.vote = request.vote(self._config.slice_bytes, lease=self._config.leases)
        if result.cancelled:  # the caller is gone: take part only to fail
            attempt.fail(_CANCELLED)
            attempt.stop()
        elif vote.lease:
            lease = self._leases.take(vote, ring)
            if lease is not None:
                self._leases.start(lease, attempt)
        return attempt

    async def _attempt(
        self, request: ReduceRequest, result: ReduceResult, attempt: RingAttempt | None
    ) -> ReduceInfo:
        if attempt is None:
            if request.topk is not None:
                await request.topk.select()  # before the ring: no checkpoint after it
            await self._membership.ensure_ring()
            attempt = self._prepare(request, result)
        if attempt.agreement is not None:
            return await self._leased(request, result, attempt)
        tag = request.tag
        verdict: CollectiveVerdict | None = None
        local_ok = False
        vote = result.vote
        assert vote is not None
        try:
            await self._session.send(vote)
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
        if verdict.outcome == Outcome.SUCCESS and local_ok and verdict.lease:
            self._leases.grant(vote, verdict, attempt.ring)
        return await self._conclude(attempt, result, verdict, local_ok)

    async def _conclude(
        self, attempt: RingAttempt, result: ReduceResult,
        verdict: CollectiveVerdict | None, local_ok: bool,
    ) -> ReduceInfo:
        """What an ended attempt's verdict means for the caller (step 5); None: the
        members of a leased attempt agreed that it succeeded."""
        tag = attempt.tag
        called = _called(result.vote)
        kind = result.vote.kind if result.vote is not None else CollectiveKind.ALL_REDUCE
        try:
            if (verdict is None or verdict.outcome == Outcome.SUCCESS) and local_ok:
                return ReduceInfo(
                    world_size=len(attempt.ring), tx_bytes=attempt.tx_bytes,
                    rx_bytes=attempt.rx_bytes, clamped=attempt.clamped,
                )
            assert verdict is not None  # the members agree only on complete parts
            blocked = verdict.outcome == Outcome.BLOCKED
            never_ran = blocked or verdict.outcome == Outcome.REJECTED and not verdict.seq
            if not never_ran:
                # Stale from the verdict on, not from after the settle: a
                # re-establishment that another attempt starts meanwhile then covers
                # this abort too. Marked later, it would call for a second, needless
                # round, whose vote aborts the all-reduces that peers launched on the
                # ring the first one made.
                self._membership.stale = True
            await attempt.settle()
            if never_ran:
                # Nothing was written, but keep the rule simple (a leased attempt that a
                # sync blocked may have written: put back).
                attempt.restore()
                if blocked:
                    raise Blocked(
                        f"the {called} with tag {tag} was aborted for every peer: "
                        f"{verdict.reason}; "
                        f"{_input_restored(kind, 'its input is as it was: ')}"
                        "synchronize the shared state as that peer does, then retry"
                    )
                raise Rejected(verdict.reason)
            reason = verdict.reason or attempt.failure or "a peer failed"
            if verdict.outcome == Outcome.REJECTED:
                # A peer's data could not be reduced, or the peers disagree (an attempt
                # under a lease that a member called otherwise): retrying would fail
                # alike. The ring is re-established before this peer's next call, not
                # now: members that never ran the attempt (they voted for it) do not
                # re-establish, and the round waits for their next call.
                attempt.restore()
                result.final.set()
                raise Rejected(
                    f"the {called} with tag {tag} failed for every peer: {reason}"
                    f"{_input_restored(kind, '; the input was restored')}"
                )
            await self._after_abort(attempt, result)
            raise CollectiveAborted(
                f"the {called} with tag {tag} was aborted for every peer: {reason}; "
                f"{_input_restored(kind, 'the input was restored and ')}"
                "retrying is safe"
            )
        finally:
            attempt.release()

    async def _after_abort(self, attempt: RingAttempt, result: ReduceResult) -> None:
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

    def _abandon(self, attempt: RingAttempt, error: Exception) -> None:
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

    def _end(self, attempt: RingAttempt) -> None:
        """The attempt is over: no more writes, no more frames or aborts routed to it."""
        attempt.stop()
        self._receiver.remove(attempt)

        def stale_abort(message: Message) -> bool:
            return isinstance(message, CollectiveAbort) and message.seq == attempt.seq

        self._session.discard(stale_abort)
        self._life.notify()

    async def _complete(self, attempt: RingAttempt, ok: bool) -> None:
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

    async def _run_ring(self, attempt: RingAttempt) -> bool:
        """This peer's part of a commenced attempt, reported to the master with
        ``CollectiveComplete``; True if it completed locally. The master's abort stops
        the part where it is (``_parts``), and it is reported aborted; the loss of
        the master or the end of the run stop it too, and raise (no report: the master
        that commenced it is gone).

        Raises:
            MasterLost: the master was lost while the part ran.
            PCCLError: the run is over for this peer.
        """
        part = Part(attempt)
        if self._session.away:  # a commence a lost link's reader delivered late
            part.master_lost = True
            part.stop()
        ok = await self._parts.run(part)
        if part.master_lost:
            raise MasterLost(
                f"lost the master at {self._session.address} during the all-reduce with "
                f"tag {attempt.tag}"
            )
        ok = ok and attempt.live
        await self._complete(attempt, ok)
        return ok

    # --- an attempt under a lease ----------------------------------------------------------

    async def _leased(
        self, request: ReduceRequest, result: ReduceResult, attempt: RingAttempt
    ) -> ReduceInfo:
        """An attempt under a lease (see the module docstring): its part, then the
        members' agreement, or the master's verdict once the lease ended."""
        verdict: CollectiveVerdict | None = None
        complete = False
        try:
            await self._parts.run(Part(attempt))
            complete = attempt.complete
            self._leases.part_ended(attempt)
            if not complete and result.cancelled:
                # No member can succeed without this part: the outcome is known here,
                # and the caller needs no verdict to go.
                verdict = CollectiveVerdict(
                    tag=attempt.tag, seq=attempt.seq, outcome=Outcome.ABORTED, reason=_CANCELLED
                )
            else:
                verdict = await self._agree(attempt, complete)
        except BaseException:
            self._end(attempt)
            self._membership.stale = True  # its frames may be half sent
            await attempt.settle()
            attempt.restore()
            attempt.release()
            self._leases.ended(attempt)
            raise
        self._end(attempt)
        self._leases.ended(attempt)
        return await self._conclude(attempt, result, verdict, complete)

    async def _agree(self, attempt: RingAttempt, complete: bool) -> CollectiveVerdict | None:
        """Wait until every member completed its part (None), telling both neighbours
        what this peer heard (``_agreement``); or for the master's verdict, when the
        master was told this part ran (then only it decides), when this part is not
        complete, or when the notices cannot flow."""
        agreement = attempt.agreement
        assert agreement is not None
        unsure = not complete
        while agreement.verdict is None:
            if not unsure:
                claims: list[tuple[int, int]] = []
                with agreement.lock:
                    # None too while threads send them; one claim per direction at most.
                    while (claimed := agreement.claim()) is not None:
                        claims.append(claimed)
                if claims:
                    failure = await agreement.send_claimed(claims, tag=attempt.tag, seq=attempt.seq)
                    if failure is not None:
                        unsure = True
                        self._leases.unsure(attempt, f"its completion notice was not sent ({failure})")
                    continue
                if agreement.done and not self._leases.told_running(attempt):
                    return None
                if attempt.failure not in (None, _CANCELLED):
                    unsure = True  # e.g. the link from the predecessor broke
                    self._leases.unsure(attempt, attempt.failure or "")
            self._life.raise_if_failed()
            await attempt.wait_changed()
        return agreement.verdict
