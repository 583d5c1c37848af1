"""Messages between peers: the first frames of ring, shared-state and benchmark
connections, and the answers to them.

Theory of operation
-------------------
A peer dials another for one of three purposes, and the connection's first frame says
which: ``P2PHello`` joins a ring connection to the dialled peer's pool (answered by
``P2PHelloAck``), ``SharedStateRequest`` asks for byte ranges of a sync's state
(answered by ``SharedStateResponse``, then the data frames), and ``BenchmarkRequest``
asks for data frames to measure the link. Each first frame carries the protocol
version and the dialling peer's id, checked by the listener before anything else.
These records use the same machinery as every control message (``records``) and are
exported by ``messages`` with the rest.
"""

from __future__ import annotations

import dataclasses

from .errors import RemoteProtocolError
from .nested import SharedStateRange
from .records import P2P, Message, message

__all__ = [
    "MAX_BENCHMARK_BYTES",
    "BenchmarkRequest",
    "P2PHello",
    "P2PHelloAck",
    "SharedStateRequest",
    "SharedStateResponse",
]

#: Most bytes one benchmark request may ask for.
MAX_BENCHMARK_BYTES = 1 << 30


@message(128, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PHello(Message):
    """First frame of a ring connection: who connects, and into which pool slot (below
    the pool size it registered with)."""

    protocol_version: int
    peer_id: int
    slot: int


@message(129, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PHelloAck(Message):
    """The listener stored the connection; data may flow."""


@message(130, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateRequest(Message):
    """First frame of a shared-state connection: send me these byte ranges of the state
    of sync ``sync``."""

    protocol_version: int
    peer_id: int
    sync: int
    ranges: tuple[SharedStateRange, ...]
    frame_bytes: int  # the largest data-frame payload the requester accepts

    def _validate(self) -> None:
        if self.frame_bytes == 0:
            raise RemoteProtocolError("SharedStateRequest.frame_bytes: must be at least 1")


@message(131, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateResponse(Message):
    """The answer to a request: ``error`` empty means the ranges follow as data frames,
    in the order asked (header: the range's index, the sync, its offset, the length)."""

    error: str = ""


@message(132, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchmarkRequest(Message):
    """On a benchmark connection: send me ``nbytes`` of data frames (each at most
    ``frame_bytes`` of payload), to measure the link from you to me."""

    protocol_version: int
    peer_id: int
    nbytes: int
    frame_bytes: int

    def _validate(self) -> None:
        if not 1 <= self.nbytes <= MAX_BENCHMARK_BYTES:
            raise RemoteProtocolError(
                f"BenchmarkRequest.nbytes: {self.nbytes} is not in 1..{MAX_BENCHMARK_BYTES}"
            )
        if self.frame_bytes == 0:
            raise RemoteProtocolError("BenchmarkRequest.frame_bytes: must be at least 1")
