"""What goes into ``MasterCore`` and what comes out: events, actions and views.

Theory of operation
-------------------
The master's shell (``pccl_trio.master._server``) owns every socket, task, thread and
clock; the core owns every decision. They talk through the records below, and through
nothing else:

- *Events* go in, one at a time, with the current time (``MasterCore.handle(event,
  now)``): a connection opened, a message arrived on one, one broke (bytes that are no
  frame stream) or closed, a ring search (``Solve``) finished, or only time passed
  (``Tick``, delivered at ``MasterCore.next_deadline()`` if nothing came first).
- *Actions* come out, in the order the shell must carry them out: send a message on a
  connection, close one once what was queued before is sent, start a ring search off
  the event loop, or cancel one.
- *Views* are read-only snapshots for tests, logs and tools (``TopologyView`` here;
  ``peers.PeerView`` lives with the peer states it shows).

All of them are frozen, keyword-only records with no behaviour; connections are named
by the shell's integer ids.
"""

from __future__ import annotations

import dataclasses

import numpy

from .messages import Message

__all__ = [
    "Action",
    "CancelSolve",
    "Close",
    "ConnectionBroken",
    "ConnectionClosed",
    "ConnectionOpened",
    "Event",
    "MessageReceived",
    "Send",
    "Solve",
    "SolveFinished",
    "Tick",
    "TopologyView",
]

# --- events ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConnectionOpened:
    """A peer connected; ``conn`` names the connection from now on."""

    conn: int
    host: str  # the remote address as the master sees it
    identity: bytes = b""  # the node identity proven in its handshake (empty: none)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MessageReceived:
    """A whole, valid control message arrived on the connection."""

    conn: int
    message: Message


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConnectionBroken:
    """The connection delivered bytes that are not a valid frame stream."""

    conn: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConnectionClosed:
    """The connection ended (the peer closed it, or the network lost it)."""

    conn: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tick:
    """Only time passed."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SolveFinished:
    """A ``Solve`` job ended: the best ring it found (indices into the job's ``peers``)
    and whether it is provably optimal; ``order`` empty: it failed (``error`` says why)
    or was cancelled."""

    job: int
    order: tuple[int, ...] = ()
    optimal: bool = False
    error: str = ""


Event = (
    ConnectionOpened | MessageReceived | ConnectionBroken | ConnectionClosed | Tick | SolveFinished
)

# --- actions -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Send:
    """Queue ``message`` on the connection."""

    conn: int
    message: Message


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Close:
    """Close the connection once the frames queued before this action are sent."""

    conn: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Solve:
    """Find a ring for ``peers`` over ``cost`` (seconds per ring chunk from row to
    column; infinity: unusable) off the event loop, for at most ``seconds``; then deliver
    ``SolveFinished(job=...)``. ``start``: a ring (indices) to improve on. ``background``:
    the long search after a first answer that was not provably optimal."""

    job: int
    group: int
    peers: tuple[int, ...]
    cost: numpy.ndarray
    start: tuple[int, ...] | None
    seconds: float
    background: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CancelSolve:
    """Stop job ``job`` if it still runs; its ``SolveFinished`` is no longer needed."""

    job: int


Action = Send | Close | Solve | CancelSolve

# --- views -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TopologyView:
    """What the master knows of one peer group's links and ring (for logs and tools).

    ``bandwidth[i, j]`` (bytes per second; NaN: not measured, 0: unreachable) and
    ``latency[i, j]`` (seconds; NaN: unknown) describe the link from ``peers[i]`` to
    ``peers[j]``;
    ``predicted_seconds`` is the installed ring's predicted all-reduce time for
    ``reference_bytes`` (infinity while some link of it is unknown).
    """

    peers: tuple[int, ...]
    bandwidth: numpy.ndarray
    latency: numpy.ndarray
    ring: tuple[int, ...]
    predicted_seconds: float
    reference_bytes: int
