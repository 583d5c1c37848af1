"""The shared-state sync flow at one peer: vote, serve, fetch, verify, report.

Theory of operation
-------------------
``sync`` hashes the tensors whose content must match (in worker threads where threads
are allowed; a BLAKE2b-256 digest beside the simplehash, in the same step, when the
master's ``Welcome`` required content digests), votes their entries with the state's
revision, and from that moment *serves* them: peers whose plan arrived earlier may
already ask (``serve``, the p2p handler of ``SharedStateRequest``, waits for this peer's
own plan before answering). A distributor's plan names the peers that fetch from it and
what they fetch; it serves them only, from the hosts the master knows them at
(``_shared_state.Serving``). The master's plan names the tensors this peer must fetch
and the distributors that hold them. Fetching spreads pieces over every distributor
(``_shared_state.Fetcher``), with the old bytes kept aside (``Backup``) until the sync
completes, and put back if it does not (its master was lost, the call was cancelled), if
the fetch fails, or if it does not verify against the hashes the master announced, or against
the digests where it announced them (content with the popular simplehash but another
digest fails the fetch just like a wrong hash). A distributor must keep up a minimum
rate (``Config.shared_state_min_rate``, after ``Config.shared_state_grace``): one that
trickles bytes, which no idle timeout notices, is cut off and its piece goes to the
others; when none is left, the sync fails. This peer reports to the master and waits
for the group's completion; only then does it adopt the new revision. Serving stops when
the sync ends: connections still being served are cut, and their handlers are waited
for (a bounded while), so ``tx_bytes`` counts everything that was sent.

The data moves through the protocols of ``_shared_state`` (``request_pieces``,
``serve_requests``), run on p2p connections by ``P2PConnections.run_protocol``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from .._core.channel import Purpose
from .._core.messages import (
    PeerEndpoint,
    SharedStateComplete,
    SharedStateDone,
    SharedStateFetch,
    SharedStatePlan,
    SharedStateRequest,
    SharedStateResponse,
    SharedStateVote,
    bounded,
)
from .._core.wire import encode_control, max_payload
from .._errors import InvalidArgument, SharedStateSyncFailed
from .._types import SharedStateSyncInfo, SharedStateSyncStrategy
from ..transport import (
    Connection,
    FramedStream,
    hash_threads,
    run_off_loop,
)
from . import _shared_state as sharing
from ._context import PeerContext
from ._lifecycle import Call
from ._membership import Membership
from ._p2p import LINK_ERRORS, claim_refusal

__all__ = ["SharedStateSync"]

log = logging.getLogger("pccl_trio.peer")


class SharedStateSync:
    """This peer's part in shared-state syncs (see the module docstring)."""

    def __init__(self, context: PeerContext, *, membership: Membership) -> None:
        self._config = context.config
        self._life = context.lifecycle
        self._session = context.session
        self._p2p = context.p2p
        self._metrics = context.metrics
        self._membership = membership
        # What this peer offers during a sync, and the connections serving it (cut when
        # the sync ends).
        self._serving: sharing.Serving | None = None
        self._serving_lot = trio.lowlevel.ParkingLot()
        self._serving_links: set[Connection] = set()
        #: The revision this peer's group expects next, after the last sync this peer
        #: completed (0: none yet): what it tells a master it comes back to.
        self.next_revision = 0
        #: How pieces are fetched from one distributor (replaceable: the test seam holds
        #: or fails fetches here).
        self.fetch_from: Callable[[PeerEndpoint, sharing.Fetcher], Awaitable[None]] = (
            self._fetch_from
        )

    async def sync(self, state: Any, strategy: SharedStateSyncStrategy) -> SharedStateSyncInfo:
        """``Communicator.sync_shared_state`` once the communicator is idle."""
        started = time.perf_counter()
        try:
            info = await self._sync(state, strategy)
        except BaseException as exc:
            outcome = (
                "rejected" if isinstance(exc, InvalidArgument)  # a bad state: it never ran
                else "cancelled" if isinstance(exc, trio.Cancelled) else "failed"
            )
            self._metrics.sync(outcome, time.perf_counter() - started, 0, 0)
            raise
        self._metrics.sync("success", time.perf_counter() - started, info.tx_bytes, info.rx_bytes)
        return info

    async def _sync(self, state: Any, strategy: SharedStateSyncStrategy) -> SharedStateSyncInfo:
        tensors = sharing.prepare_state(state)
        await self._membership.ensure_ring()  # see Membership.update_topology
        with self._life.operation(Call.SYNC_SHARED_STATE):
            threads, digests = hash_threads(), self._session.content_digest
            contents = await run_off_loop(lambda: [
                (t.content_hash(threads), t.content_digest() if digests else b"")
                for t in tensors
            ])
            vote = SharedStateVote(
                revision=state.revision,
                strategy=strategy.value,
                entries=tuple(t.entry(*c) for t, c in zip(tensors, contents, strict=True)),
            )
            if len(encode_control(vote)) > self._config.max_control_frame:
                raise InvalidArgument(
                    f"the shared state's {len(tensors)} tensors do not fit in one vote of "
                    f"Config.max_control_frame={self._config.max_control_frame} bytes; "
                    "use fewer (concatenated) tensors or shorter names"
                )
            serving = sharing.Serving(tensors)
            self._serving = serving
            kept: list[sharing.Backup] = []  # the fetched tensors' old bytes, until complete
            try:
                epoch = await self._session.vote(vote)
                plan = await self._session.wait_for(SharedStatePlan)
                if plan.error:
                    raise SharedStateSyncFailed(
                        f"the master refused the sync: {plan.error}; the shared state and "
                        "its revision are unchanged"
                    )
                serving.sync = plan.sync
                serving.distributor = not plan.fetches
                serving.allow(plan.fetchers)
                self._serving_lot.unpark_all()
                received, failure = 0, ""
                if plan.fetches:
                    received, failure = await self._fetch(plan, tensors, kept)
                    if failure:
                        await _put_back(kept)
                if not plan.complete:  # else nobody fetches: the sync is over already
                    await self._session.send(
                        SharedStateDone(sync=plan.sync, success=not failure,
                                        reason=bounded(failure)),
                        epoch=epoch,  # for the master that planned it, or for none
                    )
                    await self._session.wait_for(
                        SharedStateComplete, lambda m: m.sync == plan.sync
                    )
            except BaseException:
                # The sync did not complete (the fetch was cancelled, its master was
                # lost, the run ended): the old bytes go back, to match the revision,
                # which stays as it was.
                await _put_back(kept)
                raise
            finally:
                await self._stop_serving(serving)
            if failure:
                raise SharedStateSyncFailed(
                    f"could not fetch the shared state of revision {plan.revision}: "
                    f"{failure}; the state and its revision ({state.revision}) are unchanged"
                )
            state.revision = plan.revision
            self.next_revision = plan.revision + 1
            return SharedStateSyncInfo(tx_bytes=serving.tx_bytes, rx_bytes=received)

    def cut_serving(self) -> None:
        """Stop serving shared state at once (any sync's): requests from now on are
        refused, and the connections being served are cut."""
        if self._serving is not None:
            self._serving.active = False
            self._serving = None
        self._serving_lot.unpark_all()
        for link in list(self._serving_links):
            link.close_now()

    async def _stop_serving(self, serving: sharing.Serving) -> None:
        serving.active = False
        self.cut_serving()
        # Handlers count what they sent when their send returns: wait for them (cut
        # above, they end at once) so tx_bytes is complete.
        with trio.move_on_after(self._session.liveness_timeout) as cleanup:
            cleanup.shield = True
            while serving.handlers:
                await self._serving_lot.park()

    # --- fetching --------------------------------------------------------------------------

    async def _fetch(
        self, plan: SharedStatePlan, tensors: Sequence[sharing.Tensor],
        kept: list[sharing.Backup],
    ) -> tuple[int, str]:
        """Fetch the plan's tensors from its distributors, their old bytes first added
        to ``kept`` (for the caller to put back unless the sync completes).

        Returns:
            the bytes received, and why the fetch failed (empty: it did not).
        """
        by_key = {t.key: t for t in tensors}
        unknown = [f.key for f in plan.fetches if f.key not in by_key]
        if unknown:  # a master of another run, or a broken one: fetch nothing
            return 0, (
                f"the master's plan names {len(unknown)} tensor(s) this peer's shared state "
                f"does not have (first: {unknown[0]!r})"
            )
        targets = [by_key[f.key] for f in plan.fetches]
        expected = {f.key: f for f in plan.fetches if f.verify}
        assert self._session.peer_id is not None
        fetcher = sharing.Fetcher(
            by_key, [t.key for t in targets], sync=plan.sync, peer_id=self._session.peer_id,
            # No larger than distributors send anyway: it bounds the bytes a frame still
            # in flight may owe to the minimum rate.
            frame_bytes=min(max_payload(self._config.max_data_frame), sharing.FRAME_BYTES),
            whole=[f.key for f in plan.fetches if not f.verify],
        )
        kept.append(await run_off_loop(lambda: sharing.Backup(targets)))
        failure = await self._transfer(plan, fetcher, targets, expected)
        if failure:
            log.warning("peer %s: shared-state fetch failed: %s", self._session.peer_id, failure)
        return fetcher.received, failure

    async def _transfer(
        self,
        plan: SharedStatePlan,
        fetcher: sharing.Fetcher,
        targets: Sequence[sharing.Tensor],
        expected: dict[str, SharedStateFetch],
    ) -> str:
        """Fetch every piece and verify the tensors; why it failed (empty: it did not)."""
        # A distributor that fails gives its piece back; the others may have finished
        # meanwhile, so the survivors go round again until nothing is left. A path
        # that a ring pool needs several connections to fill needs as many for the
        # fetch: the ring's largest pool (``Membership.stripes``: 1 on a LAN, 8 at
        # 100 ms) is spread over the distributors, at least one worker and connection
        # each, all taking pieces from the one queue.
        alive = list(plan.distributors)
        while fetcher.pieces and alive:
            self._life.raise_if_failed()
            workers = max(1, -(-self._membership.stripes // len(alive)))
            async with trio.open_nursery() as nursery:
                for endpoint in alive:
                    for _ in range(workers):
                        nursery.start_soon(self.fetch_from, endpoint, fetcher)
            alive = [e for e in alive if e.peer_id not in fetcher.failed_peers]
        if fetcher.pieces:
            return (
                "every peer holding it failed ("
                + ("; ".join(fetcher.failures) or "none is left") + ")"
            )
        threads = hash_threads()
        wrong, forged = await run_off_loop(
            lambda: sharing.mismatched(targets, expected, threads)
        )
        problems = []
        if wrong:
            problems.append(
                f"tensors {wrong} arrived but do not hash to the popular state's values "
                "(a distributor changed them during the sync?)"
            )
        if forged:
            problems.append(
                f"tensors {forged} arrived with the popular state's simplehash but their "
                "content digest (BLAKE2b-256) differs: a distributor sent other content "
                "than the popular state's"
            )
        return "; ".join(problems)

    async def _fetch_from(self, endpoint: PeerEndpoint, fetcher: sharing.Fetcher) -> None:
        """One distributor's worker: fetch pieces from it until none is left or it fails."""
        share = sharing.Share(fetcher)
        try:
            framed = await self._p2p.connect(endpoint, Purpose.SHARED_STATE)
            failure = await self._request_pieces(framed, share)
        except (*LINK_ERRORS, sharing.DistributorRefused) as exc:
            failure = str(exc) or type(exc).__name__
        if failure:
            fetcher.failed(endpoint.peer_id, failure)
            log.info("peer %s: fetching shared state from peer %d failed: %s",
                     self._session.peer_id, endpoint.peer_id, failure)

    async def _request_pieces(self, framed: FramedStream, share: sharing.Share) -> str:
        """Fetch pieces on ``framed`` while the distributor keeps the minimum rate; why
        it was cut off (empty: it was not).

        The rate is judged on complete data frames, so the distributor may owe the
        bytes of one frame besides: after ``grace`` seconds, it must have delivered
        ``min_rate * (elapsed - grace)`` bytes, less one frame. A distributor at the
        minimum rate or faster is never cut off.

        Raises:
            the errors of the link and of the distributor's answers.
        """
        protocol = sharing.request_pieces(share)
        rate, grace = self._config.shared_state_min_rate, self._config.shared_state_grace
        if not rate:
            await self._p2p.run_protocol(framed, protocol)
            return ""
        start = trio.current_time()

        def deadline() -> float:
            return start + grace + (share.delivered + share.frame_bytes) / rate

        error: Exception | None = None
        slow = ""
        async with trio.open_nursery() as nursery:

            async def transfer() -> None:
                nonlocal error
                try:
                    await self._p2p.run_protocol(framed, protocol)
                except (*LINK_ERRORS, sharing.DistributorRefused) as exc:
                    error = exc
                nursery.cancel_scope.cancel()  # done: stop watching

            nursery.start_soon(transfer)
            while True:
                # Each wake-up either finds the distributor behind or moves the deadline
                # past the bytes it delivered meanwhile: at most one per frame.
                await trio.sleep_until(deadline())
                if trio.current_time() >= deadline():
                    break
            if not nursery.cancel_scope.cancel_called:  # the transfer did not end first
                elapsed = trio.current_time() - start
                slow = (
                    f"it sent {share.delivered} bytes in {elapsed:.0f}s, slower than "
                    f"Config.shared_state_min_rate ({rate:g} bytes/s after "
                    f"{grace:g}s)"
                )
                nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return slow

    # --- serving ---------------------------------------------------------------------------

    async def serve(self, framed: FramedStream, request: SharedStateRequest) -> None:
        """Answer a peer fetching shared state from us, on its connection (the p2p
        handler of ``SharedStateRequest``)."""
        # Its plan may have reached it before ours reached us: wait for ours.
        with trio.move_on_after(self._session.liveness_timeout):
            while self._serving is not None and self._serving.sync is None:
                await self._serving_lot.park()
        serving = self._serving or sharing.Serving(())  # none: every request is refused
        serving.handlers += 1
        try:
            allowance = serving.fetchers.get(request.peer_id)
            refusal = "" if allowance is None else await claim_refusal(framed, allowance)
            if refusal:
                refusal = f"a request claiming to be peer {request.peer_id}, but {refusal}"
                log.warning("peer %s: refusing shared state: %s", self._session.peer_id, refusal)
                await framed.send_message(SharedStateResponse(error=bounded(refusal)))
                return
            await self._p2p.run_protocol(
                framed, sharing.serve_requests(serving, request), track=self._serving_links
            )
        finally:
            serving.handlers -= 1
            self._serving_lot.unpark_all()


async def _put_back(kept: list[sharing.Backup]) -> None:
    """Restore the old bytes in ``kept`` (once: the list is emptied), shielded from
    cancellation, which must not skip it."""
    with trio.CancelScope(shield=True):
        while kept:
            await run_off_loop(kept.pop().restore)
