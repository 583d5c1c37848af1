"""What happened in the run, as records: one ``RunEvent`` per thing an operator asks about.

Theory of operation
-------------------
The master's parts do not write log lines of their own for what happens to the run;
they *report* it (``PeerTable.report``): a peer joined or came back, left or was
kicked (and why, with a bounded ``KickCause``), a round ended, a collective was
aborted or completed, a sync ran, a ring changed, an optimization ended, a vote stalled
or was refused. A report is a frozen ``RunEvent``: its kind, the sentence a person
reads, and the same facts as fields a program reads (peer, group, reason, ring, ...).

Each report is logged once, as it is made, on the ``pccl_trio.master.run`` logger: the
text formatter prints the sentence, and ``JsonFormatter`` one JSON object per line with
the kind and every field (``pccl-trio master --log-format json``). Routine events
(a completed collective, a finished sync) are logged at DEBUG, so a run's INFO log
holds what changed in it, not every step. The core also counts every report by kind
and label (with the latest kicks); the run's status and the master's metrics read
those counts, so the counters move by exactly what the log says happened.
``MasterCore.take_reports`` hands over the reports of the event just handled (for
tests and tools that follow the run event by event).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["KickCause", "RunEvent", "RunKind", "log"]

#: The logger of run events (a child of the master's logger).
log = logging.getLogger("pccl_trio.master.run")


class RunKind(enum.Enum):
    """What a ``RunEvent`` is about (its ``event`` field in JSON logs)."""

    JOINED = "joined"  # a peer registered
    RETURNED = "returned"  # a member came back after the master restarted
    LEFT = "left"  # a peer's connection closed, or it was kicked (see KICKED)
    KICKED = "kicked"  # the master removed a peer, with a cause
    ROUND = "round"  # an establishment round ended (succeeded or failed)
    RING = "ring"  # a peer group's ring changed
    ABORTED = "aborted"  # a collective was aborted
    COMPLETED = "completed"  # a collective's verdict went out (DEBUG)
    LEASED = "leased"  # a peer group got a lease on a tag (DEBUG)
    LEASE_ENDED = "lease_ended"  # a lease ended, with how many attempts ran under it
    SYNC_STARTED = "sync_started"  # a shared-state sync began (DEBUG)
    SYNCED = "synced"  # a shared-state sync completed (DEBUG)
    SYNC_FAILED = "sync_failed"  # a peer could not fetch the shared state
    OPTIMIZED = "optimized"  # a topology optimization ended
    LINK_FAILED = "link_failed"  # a link could not be measured
    SEARCH_FAILED = "search_failed"  # a ring search failed
    RECOVERY = "recovery"  # a peer group is coming back, or came back
    UNREACHABLE = "unreachable"  # a peer could not reach its ring neighbours
    ROUND_STARTED = "round_started"  # an establishment round began (DEBUG)
    OPTIMIZING = "optimizing"  # a topology optimization began measuring links
    LINK_MEASURED = "link_measured"  # one link's bandwidth and latency (DEBUG)
    STALLED = "stalled"  # a vote has waited long for some peers
    REFUSED = "refused"  # a stalled vote was refused


class KickCause(enum.Enum):
    """Why the master removed a peer: a small fixed set (a metrics label)."""

    PROTOCOL = "protocol"  # malformed or illegal input
    REFUSED = "refused"  # its registration or return was refused
    LIVENESS = "liveness"  # silent for the liveness timeout
    LATE = "late"  # did not report within a round's or a measurement's timeout
    UNREACHABLE = "unreachable"  # no ring can include it
    IDENTITY = "identity"  # its peer id or node identity conflicts with another's
    SHARED_STATE = "shared_state"  # its shared state breaks the sync rules


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunEvent:
    """One thing that happened in the run (see the module docstring)."""

    kind: RunKind
    text: str  # the sentence for a person
    level: int = logging.INFO
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def emit(self) -> None:
        """Log it, once."""
        if log.isEnabledFor(self.level):
            log.log(self.level, "%s", self.text, extra={"run_event": self})
