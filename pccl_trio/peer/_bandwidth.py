"""Measuring one directed link: how fast, and how far, a peer is from another.

Theory of operation
-------------------
A peer measures the link *from* another peer *to* itself by opening a benchmark
connection to that peer's p2p listener and asking (``BenchmarkRequest``) for a number of
bytes, which come back as data frames. Both sides are written once as generators of IO
operations (``_protocol``: trio tasks or a worker thread over a blocking socket),
reading the clock as an operation too: in the thread that
moves the bytes, and in virtual time under trio's mock clock.

1. **Latency.** Three requests for a single byte; the smallest round trip, halved, is
   the link's one-way latency.
2. **Bandwidth.** Requests of growing size (starting at 256 KiB, times four each time)
   until one takes at least ``min_seconds`` after its first byte, or the byte cap or
   the time budget is reached. The rate is that transfer's payload after its first
   frame divided by the time from the first frame's arrival to the last one's: round
   trips do not count, and a token bucket's initial burst weighs little once a
   transfer lasts a tenth of a second or more.

The master announces each measurement to both ends with a byte budget
(``MEASUREMENT_BYTES``): the measuring peer never asks for more in all, and the measured
peer serves one connection of the announced peer up to that budget, and nothing beyond
it (``serve_benchmark``).
"""

from __future__ import annotations

import dataclasses

import numpy

from .._core.errors import RemoteProtocolError
from .._core.messages import MAX_BENCHMARK_BYTES, PROTOCOL_VERSION, BenchmarkRequest
from ._protocol import (
    Protocol,
    ReadClock,
    ReceiveHeader,
    ReceiveMessage,
    ReceivePayload,
    Send,
    SendData,
)

__all__ = ["LinkMeasurement", "measure_link", "serve_benchmark"]

#: Largest data frame a benchmark server sends.
FRAME_BYTES = 1 << 20
#: Seconds a measurement aims to stay within (a link slower than about 4 Mbit/s takes
#: longer: its first 256 KiB transfer alone does).
BUDGET_SECONDS = 0.8
#: Frame size a measuring peer asks for.
MEASURE_FRAME_BYTES = 64 << 10
#: The first bandwidth transfer's size (each later one is four times the last).
FIRST_TRANSFER = 256 << 10
_ZEROS = memoryview(bytes(FRAME_BYTES))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkMeasurement:
    """One directed link, as measured.

    Attributes:
        bandwidth: bytes per second.
        latency: one-way seconds (half the smallest round trip of a 1-byte request).
        nbytes: payload bytes moved to measure it.
        seconds: wall time the measurement took.
    """

    bandwidth: float
    latency: float
    nbytes: int
    seconds: float


def serve_benchmark(request: BenchmarkRequest, *, budget: int) -> Protocol[None]:
    """The measured peer's side: answer ``request`` and every later one of the same
    peer with zeros, until the measuring peer closes the connection or asks for more
    than ``budget`` bytes in all (the connection is then dropped, no byte sent for it)."""
    peer_id = request.peer_id
    while True:
        if request.peer_id != peer_id:
            raise RemoteProtocolError(
                f"a BenchmarkRequest of peer {request.peer_id} on peer {peer_id}'s connection"
            )
        if request.nbytes > budget:
            raise RemoteProtocolError(
                f"peer {peer_id} asks for {request.nbytes} benchmark bytes, {budget} left of "
                "what the master announced"
            )
        budget -= request.nbytes
        frame = min(FRAME_BYTES, request.frame_bytes)
        for offset in range(0, request.nbytes, frame):
            nbytes = min(frame, request.nbytes - offset)
            yield SendData(tag=0, seq=0, offset=offset, payload=_ZEROS[:nbytes])
        following = yield ReceiveMessage()
        if not isinstance(following, BenchmarkRequest):
            raise RemoteProtocolError(
                f"expected a BenchmarkRequest, got {type(following).__name__}"
            )
        request = following


def measure_link(
    *,
    peer_id: int,
    frame_bytes: int,
    budget_bytes: int,
    min_seconds: float = 0.15,
    budget_seconds: float = BUDGET_SECONDS,
    max_bytes: int = 64 << 20,
) -> Protocol[LinkMeasurement]:
    """The measuring peer's side (see the module docstring), moving at most
    ``budget_bytes`` in all; the connection's first frame is its first request.

    Raises:
        RemoteProtocolError: frames that do not continue the transfer, or a budget
            too small for the first transfer.
    """
    if budget_bytes < 3 + FIRST_TRANSFER:
        raise RemoteProtocolError(
            f"a budget of {budget_bytes} bytes is too small to measure a link "
            f"(at least {3 + FIRST_TRANSFER})"
        )
    started = yield ReadClock()
    # Small frames: even the first, smallest transfer spans several, so its rate can be
    # read from the arrival of the first frame to the last.
    frame_bytes = min(MEASURE_FRAME_BYTES, frame_bytes)
    sink = numpy.empty(frame_bytes, dtype=numpy.uint8)
    moved = 0

    def receive(nbytes: int) -> Protocol[tuple[float, float, float, int]]:
        """Ask for ``nbytes``; the time the request left, the first frame arrived and
        the last one did, and the first frame's size."""
        nonlocal moved
        sent = yield ReadClock()
        yield Send(BenchmarkRequest(protocol_version=PROTOCOL_VERSION, peer_id=peer_id,
                                    nbytes=nbytes, frame_bytes=frame_bytes))
        got = 0
        first_at, first_size = 0.0, 0
        while got < nbytes:
            _tag, _seq, offset, size = yield ReceiveHeader()
            if offset != got or not 0 < size <= min(len(sink), nbytes - got):
                raise RemoteProtocolError(
                    f"benchmark frame at byte {offset} of {size} bytes does not continue "
                    f"byte {got} of {nbytes}"
                )
            yield ReceivePayload(sink[:size].data)
            if not got:
                first_at, first_size = (yield ReadClock()), size
            got += size
        moved += nbytes
        return sent, first_at, (yield ReadClock()), first_size

    round_trips = []
    for _ in range(3):
        sent, _first, done, _size = yield from receive(1)
        round_trips.append(done - sent)
    latency = min(round_trips) / 2
    nbytes = FIRST_TRANSFER
    while True:
        _sent, first, done, first_size = yield from receive(nbytes)
        span = done - first
        if span <= 0:
            # A transfer the clock cannot resolve (virtual time, an unshaped link): as
            # fast as a nanosecond allows, and larger ones would read the same.
            rate = (nbytes - first_size) / 1e-9
            break
        rate = (nbytes - first_size) / span
        elapsed = (yield ReadClock()) - started
        if span >= min_seconds or nbytes * 4 > min(max_bytes, MAX_BENCHMARK_BYTES):
            break
        if moved + nbytes * 4 > budget_bytes:
            break
        if elapsed + 4 * max(span, 1e-3) > budget_seconds:
            break
        nbytes *= 4
    return LinkMeasurement(
        bandwidth=rate, latency=latency, nbytes=moved, seconds=(yield ReadClock()) - started
    )
