"""The exceptions pccl_trio raises. Every one derives from :class:`PCCLError`.

Messages always say what was wrong and what the caller can do about it.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = [
    "CollectiveAborted",
    "InvalidArgument",
    "InvalidUsage",
    "Kicked",
    "MasterConnectionError",
    "PCCLError",
    "SharedStateSyncFailed",
    "TooFewPeers",
    "TopologyOptimizationFailed",
    "UpdateTopologyFailed",
]


class PCCLError(Exception):
    """Base class of every error raised by pccl_trio."""


class MasterConnectionError(PCCLError):
    """The master could not be reached, or the connection to it was lost."""


class UpdateTopologyFailed(PCCLError):
    """The topology update did not complete; calling ``update_topology`` again is safe."""


class TopologyOptimizationFailed(PCCLError):
    """Topology optimization did not complete; calling it again is safe."""


class TooFewPeers(PCCLError):
    """The operation needs more peers than the run (or peer group) has."""


class CollectiveAborted(PCCLError):
    """The collective was aborted for every surviving peer; inputs were restored."""


class InvalidArgument(PCCLError, ValueError):
    """An argument was malformed or disagreed with the other peers' arguments (also a
    ``ValueError``, as Python's own bad values are)."""


class InvalidUsage(PCCLError):
    """The call is not allowed in the communicator's current state."""


class SharedStateSyncFailed(PCCLError):
    """Shared-state synchronization did not complete."""


class Kicked(PCCLError):
    """The master removed this peer from the run.

    Attributes:
        reason: the master's explanation, e.g. which rule the peer broke.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"kicked by the master: {reason}")
        self.reason = reason


_E = TypeVar("_E", bound=PCCLError)


def shown_as_base(marker: type[_E]) -> type[_E]:
    """Class decorator for an internal subclass that marks a case of a public error:
    callers catch it, and tracebacks and reprs name it, as its public base class."""
    base = marker.__mro__[1]
    marker.__module__, marker.__qualname__, marker.__name__ = (
        base.__module__, base.__qualname__, base.__name__
    )

    def reduce(error: BaseException) -> tuple[Any, ...]:
        # Pickle finds classes by the names above, which now name the base: a marker
        # crosses processes as its base (what callers catch anyway).
        return base, error.args, error.__dict__ or None

    marker.__reduce__ = reduce  # type: ignore[assignment,method-assign]
    return marker
