"""A read-only snapshot of the run, for people and tools: ``StatusRequest``/``StatusReply``.

Theory of operation
-------------------
An observer (``pccl-trio status``) connects to the master like a peer, passes the same
run-secret handshake when the run has a secret, and sends ``StatusRequest`` instead of
``Register``. The master answers with one ``StatusReply`` and closes the connection:
the observer never becomes a member, takes part in no vote and changes nothing
(``MasterCore.status`` only reads). The same snapshot feeds the master's metrics.

What a reply holds:

- how many peers there are in each group and phase (``tallies``, all of them);
- every peer (up to ``MAX_PEERS``, ``peers_total`` says how many there are): id,
  group, address, phase and state, seconds since the master last heard from it;
- every peer group: world size, ring, whether the ring must be re-established first,
  the ring's predicted time for an all-reduce of ``reference_bytes`` (negative:
  unknown), the shared-state revision it expects next (``has_revision``);
- every vote waiting for members: the call, where, for how long, who has not voted;
- every all-reduce running (commenced): its group, tag and attempt, for how long, and
  the participants that have not completed it (a slow or stuck peer);
- the last kicks (``MAX_KICKS``): who, the cause, the reason, how long ago;
- the run's counters: how many times each kind of run event happened, with its label
  (``RunCount``: ``completed``/``success``, ``kicked``/``liveness``, ...), the totals
  the master's Prometheus counters export.

A reply must fit an observer's control frame whatever the run looks like (thousands of
peers with long host names, many collectives in flight): ``fit`` halves its longest
lists until its encoding is at most ``STATUS_BUDGET`` bytes, and says so
(``truncated``); the tallies and counts are always whole.
"""

from __future__ import annotations

import dataclasses

from .records import C2M, M2C, Message, Record, encode_message, message, record

__all__ = [
    "MAX_KICKS",
    "MAX_COLLECTIVES",
    "MAX_PEERS",
    "STATUS_BUDGET",
    "CollectiveStatus",
    "GroupStatus",
    "KickStatus",
    "PeerStatus",
    "PeerTally",
    "RunCount",
    "StatusReply",
    "StatusRequest",
    "WaitStatus",
    "fit",
]

#: Peers listed in one reply (the rest are counted in ``peers_total``).
MAX_PEERS = 1000
#: Kicks remembered and listed, the latest last.
MAX_KICKS = 16
#: Running collectives listed.
MAX_COLLECTIVES = 256
#: The largest encoded reply: half the default control frame, so an observer with
#: default limits always reads it.
STATUS_BUDGET = 512 << 10


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerStatus(Record):
    peer_id: int
    group: int
    host: str
    port: int
    phase: str  # registered, accepted, ...
    state: str  # idle, or the call it waits in
    silent_seconds: float  # since the master last heard from it
    identity: str  # its node identity's fingerprint (empty: none)


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupStatus(Record):
    group: int
    world: int
    ring: tuple[int, ...]
    stale: bool  # the ring must be re-established before a collective runs
    predicted_seconds: float  # of an all-reduce of reference_bytes on the ring; < 0: unknown
    has_revision: bool
    revision: int  # the shared-state revision the group's next sync expects


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WaitStatus(Record):
    call: str
    where: str
    seconds: float
    missing: tuple[int, ...]


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveStatus(Record):
    group: int
    tag: int
    seq: int
    seconds: float  # since it commenced
    incomplete: tuple[int, ...]  # participants that have not completed it
    call: str = "all_reduce"  # what its voters called, as the API names it


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KickStatus(Record):
    peer_id: int  # 0: a connection that never registered
    cause: str
    reason: str
    seconds_ago: float


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerTally(Record):
    group: int
    phase: str
    count: int


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunCount(Record):
    event: str  # a RunKind value
    label: str  # its outcome or cause, where it has one
    count: int
    total: int = 0  # a quantity summed over the events (bytes, for syncs)


@message(12, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StatusRequest(Message):
    """An observer asks for a ``StatusReply`` (instead of registering)."""


@message(77, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StatusReply(Message):
    """The run as the master sees it (see the module docstring)."""

    uptime_seconds: float
    reference_bytes: int
    peers_total: int
    tallies: tuple[PeerTally, ...]
    peers: tuple[PeerStatus, ...]
    groups: tuple[GroupStatus, ...]
    waiting: tuple[WaitStatus, ...]
    collectives: tuple[CollectiveStatus, ...]
    kicks: tuple[KickStatus, ...]
    counts: tuple[RunCount, ...]
    truncated: bool = False  # some lists were cut to fit (``fit``)


def fit(reply: StatusReply, budget: int = STATUS_BUDGET) -> StatusReply:
    """``reply``, with its longest lists halved until it encodes in ``budget`` bytes."""
    cuttable = ("peers", "groups", "waiting", "collectives", "kicks")
    while len(encode_message(reply)) > budget:
        name = max(cuttable, key=lambda n: len(getattr(reply, n)))
        items = getattr(reply, name)
        if not items:  # pragma: no cover - the whole lists fit any sane budget
            break
        reply = dataclasses.replace(reply, truncated=True, **{name: items[: len(items) // 2]})
    return reply
