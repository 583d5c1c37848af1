"""The parts of commenced attempts running at this peer, and what stops them.

Theory of operation
-------------------
A commenced attempt's *part* is this peer's share of the ring: its sends, and the
wait for everything its predecessor sends (``RingAttempt.send_all``). A part runs in
a cancel scope of its own (``Part``), and is registered here by tag while it runs, so
that nothing needs a task watching for what stops it; each of these stops the
attempt (no more writes, the connections carrying its bytes cut) and cancels the
part's scope, as it happens:

* the master's ``CollectiveAbort``, which the session applies as it reads it (a
  route), stops the attempt it names, from its commence to its end: a part running
  stops where it is, one not started yet fails at once;
* the loss of the master (a hook of the session) stops every part but those under a
  lease, which need the master only if they fail, and marks them, so that their
  caller raises ``MasterLost`` rather than report to a master that is gone;
* the end of the run for this peer (a hook of the lifecycle) stops every part, and
  every leased attempt waiting for its members or for its verdict.
"""

from __future__ import annotations

import logging

import trio

from .._core.messages import CollectiveAbort
from ._attempt import RingAttempt
from ._context import PeerContext
from ._ledger import LocalFailure
from ._receiver import DataReceiver

__all__ = ["Part", "RunningParts"]

log = logging.getLogger("pccl_trio.peer")


class Part:
    """A commenced attempt's part while it runs: ``stop`` ends the attempt and
    cancels the task sending it."""

    def __init__(self, attempt: RingAttempt) -> None:
        self.attempt = attempt
        self.scope = trio.CancelScope()
        self.master_lost = False

    def stop(self) -> None:
        self.attempt.stop()  # no more writes, whatever is in flight
        self.scope.cancel()


class RunningParts:
    """The parts running at this peer (see the module docstring).

    Args:
        context: the communicator's parts (the session's route and hook, and the
            lifecycle's, are registered here).
        receiver: the attempts in flight, by tag.
    """

    def __init__(self, context: PeerContext, *, receiver: DataReceiver) -> None:
        self._life = context.lifecycle
        self._session = context.session
        self._p2p = context.p2p
        self._receiver = receiver
        self._parts: dict[int, Part] = {}  # by tag: one attempt per tag
        self._session.route(CollectiveAbort, self._on_abort)
        self._session.on_away(self._on_master_lost)
        self._life.on_failure(self._on_run_over)

    async def run(self, part: Part) -> bool:
        """Send this peer's part of an attempt (stopped by ``part.stop``); True if it
        went through.

        Raises:
            PCCLError: the run is over for this peer.
        """
        attempt = part.attempt
        self._life.raise_if_failed()
        successor = attempt.successor
        connections = self._p2p.pools.successor_connections(successor)
        if not connections:
            attempt.fail(f"no open connection to the next peer ({successor})")
        self._parts[attempt.tag] = part
        ok = False
        try:
            with part.scope:
                try:
                    await attempt.send_all(
                        connections, self._p2p.pools.back_connection(attempt.predecessor)
                    )
                    ok = True
                except LocalFailure as exc:
                    log.info("peer %s: tag %d failed locally: %s", self._session.peer_id,
                             attempt.tag, exc)
        finally:
            del self._parts[attempt.tag]
        self._life.raise_if_failed()
        return ok

    # --- what stops a part (called by the session and the lifecycle, never blocking) ---

    def _on_abort(self, message: CollectiveAbort) -> None:
        """The master aborted an attempt (a route of the session: applied as the abort
        arrives). (An attempt whose part ended is stopped too, harmlessly: the master
        aborts only peers that did not complete, and the verdict after an abort is
        never a success.)"""
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
        for attempt in list(self._receiver.by_tag.values()):
            if attempt.agreement is not None:
                attempt.stop()  # wakes an attempt waiting for its members or its verdict

    def _stop_parts(self, *, master_lost: bool) -> None:
        for part in list(self._parts.values()):
            if master_lost and part.attempt.agreement is not None:
                continue  # under a lease: it needs the master only if it fails
            part.master_lost = part.master_lost or master_lost
            part.stop()
