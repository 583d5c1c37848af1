"""Pure ring math: ordering peers into a ring that avoids unreachable links.

A ring is a list of peer ids; member ``i`` sends to ``ring[(i + 1) % n]`` and
receives from ``ring[i - 1]``. Only those directed edges must be reachable.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Collection, Sequence

from .errors import RemoteProtocolError

__all__ = ["RingSchedule", "Segment", "chunk_bounds", "find_ring", "neighbours", "ring_edges"]

#: Bound on the search for a ring around blocked edges; past it we give up (and the
#: master removes a peer) rather than stall the master's event loop.
SEARCH_BUDGET = 200_000


def neighbours(ring: Sequence[int], peer: int) -> tuple[int, int] | None:
    """``peer``'s ``(predecessor, successor)`` in ``ring`` (the same peer twice in a
    ring of two); None when it is alone or not in the ring."""
    if len(ring) < 2 or peer not in ring:
        return None
    index = ring.index(peer)
    return ring[index - 1], ring[(index + 1) % len(ring)]


def ring_edges(ring: Sequence[int]) -> list[tuple[int, int]]:
    """The directed edges ``(sender, receiver)`` a ring uses."""
    if len(ring) < 2:
        return []
    return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]


def find_ring(
    preferred: Sequence[int], blocked: Collection[tuple[int, int]]
) -> list[int] | None:
    """A ring of all of ``preferred`` that uses no edge in ``blocked``, or None.

    The preferred order is kept when it already avoids every blocked edge; otherwise
    a depth-first search for a Hamiltonian cycle tries successors in preferred order,
    so the result stays as close to it as the search finds.
    """
    members = list(preferred)
    if len(members) != len(set(members)):
        raise ValueError(f"ring members must be distinct: {members}")
    blocked_set = set(blocked)
    if not any(edge in blocked_set for edge in ring_edges(members)):
        return members
    if len(members) == 2:
        return None  # both directions are needed and one is blocked
    start = members[0]
    path = [start]
    used = {start}
    budget = SEARCH_BUDGET

    def extend() -> bool:
        nonlocal budget
        if len(path) == len(members):
            return (path[-1], start) not in blocked_set
        for candidate in members:
            budget -= 1
            if budget <= 0:
                return False
            if candidate in used or (path[-1], candidate) in blocked_set:
                continue
            path.append(candidate)
            used.add(candidate)
            if extend():
                return True
            path.pop()
            used.discard(candidate)
        return False

    return path if extend() else None


# --- the all-reduce schedule --------------------------------------------------------


def chunk_bounds(count: int, world: int) -> list[tuple[int, int]]:
    """Element ranges of the ``world`` chunks of a ``count``-element buffer.

    Chunk ``c`` has ``count // world`` elements, plus one for the first
    ``count % world`` chunks; chunks are contiguous and in order, and may be empty
    when ``count < world``.
    """
    if world < 1 or count < 0:
        raise ValueError(f"need world >= 1 and count >= 0, got {world}, {count}")
    base, extra = divmod(count, world)
    bounds = []
    start = 0
    for chunk in range(world):
        stop = start + base + (1 if chunk < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One chunk's worth of a peer's send or receive stream.

    Attributes:
        index: position in the stream, 0 .. 2W-3.
        chunk: which chunk of the buffer it carries.
        start: byte offset of that chunk in the buffer.
        nbytes: its length in bytes.
        stream_offset: where the segment starts in the stream.
        reduce: received data is combined into the buffer (reduce-scatter) rather
            than copied over it (all-gather).
    """

    index: int
    chunk: int
    start: int
    nbytes: int
    stream_offset: int
    reduce: bool


class RingSchedule:
    """Who sends which bytes when, for one peer of a ring all-reduce.

    Theory of operation: reduce-scatter then all-gather, fused into one stream per
    direction. Rank ``r`` of ``W`` sends ``2(W-1)`` segments to ``r+1``: segment 0 is
    its own chunk ``r``; segment ``k`` is chunk ``r-k``, i.e. exactly what it received
    as segment ``k-1``, once combined (``k-1 < W-1``) or copied (``k-1 >= W-1``). So a
    slice may be forwarded as soon as the same slice of the previous segment arrived,
    and the whole operation pipelines slice by slice. The accumulation order of chunk
    ``c`` is fixed (it starts at rank ``c`` and is combined at ``c+1, ..., c+W-1``, in
    the form ``local OP incoming``), and its final value is computed once, by its
    owner ``c-1``, and copied everywhere else: every peer ends bit-identical.

    Every segment is cut into slices of ``slice_bytes`` (a multiple of the item size);
    a slice travels as one data frame whose offset is its position in the stream.
    """

    def __init__(
        self, *, count: int, itemsize: int, world: int, rank: int, slice_bytes: int
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a ring of {world}")
        if itemsize < 1 or slice_bytes < 1:
            raise ValueError("itemsize and slice_bytes must be positive")
        self.count = count
        self.itemsize = itemsize
        self.world = world
        self.rank = rank
        self.slice_bytes = max(itemsize, slice_bytes - slice_bytes % itemsize)
        self.chunks = tuple(
            (start * itemsize, (stop - start) * itemsize)
            for start, stop in chunk_bounds(count, world)
        )
        self.send = self._segments(lambda k: (rank - k) % world)
        self.recv = self._segments(lambda k: (rank - k - 1) % world)
        self._recv_starts = tuple(s.stream_offset for s in self.recv)
        #: Slices per segment of each stream, and where each send segment's first
        #: slice stands in the stream of slices.
        self.recv_slices = tuple(self.slice_count(s) for s in self.recv)
        self.send_slices = tuple(self.slice_count(s) for s in self.send)
        self.send_positions = tuple(itertools.accumulate(self.send_slices[:-1], initial=0))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(*, count: int, itemsize: int, world: int, rank: int, slice_bytes: int) -> RingSchedule:
        """The schedule for these arguments, shared: a schedule is never changed once
        made, and a training loop all-reduces the same shapes over and over."""
        return RingSchedule(
            count=count, itemsize=itemsize, world=world, rank=rank, slice_bytes=slice_bytes
        )

    def _segments(self, chunk_of: Callable[[int], int]) -> tuple[Segment, ...]:
        segments = []
        offset = 0
        for k in range(2 * (self.world - 1)):
            chunk = chunk_of(k)
            start, nbytes = self.chunks[chunk]
            segments.append(
                Segment(
                    index=k, chunk=chunk, start=start, nbytes=nbytes, stream_offset=offset,
                    reduce=k < self.world - 1,
                )
            )
            offset += nbytes
        return tuple(segments)

    @property
    def stream_bytes(self) -> int:
        """Bytes each peer sends (and receives) in one all-reduce."""
        return sum(s.nbytes for s in self.send)

    @property
    def owned_chunk(self) -> int:
        """The chunk whose final value this rank computes."""
        return (self.rank + 1) % self.world

    def slice_count(self, segment: Segment) -> int:
        return -(-segment.nbytes // self.slice_bytes)

    def slice_range(self, segment: Segment, index: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` in the buffer of slice ``index`` of ``segment``."""
        start = segment.start + index * self.slice_bytes
        return start, min(start + self.slice_bytes, segment.start + segment.nbytes)

    def locate(
        self,
        stream_offset: int,
        nbytes: int,
        payload_size: Callable[[int], int] | None = None,
    ) -> tuple[Segment, int]:
        """The received segment and slice index a data frame carries.

        ``payload_size`` maps a slice's size in the buffer to its payload's size on the
        wire (when the wire encodes slices, e.g. quantized); by default they are equal.

        Raises:
            RemoteProtocolError: the frame is not exactly one slice of the stream.
        """
        position = bisect.bisect_right(self._recv_starts, stream_offset) - 1
        # Empty segments share their start with the next one: skip to a non-empty one.
        while 0 <= position < len(self.recv) and self.recv[position].nbytes == 0:
            position += 1
        if position < 0 or position >= len(self.recv):
            raise RemoteProtocolError(f"data frame at stream offset {stream_offset} is out of range")
        segment = self.recv[position]
        relative = stream_offset - segment.stream_offset
        index, misaligned = divmod(relative, self.slice_bytes)
        if misaligned or relative < 0 or index >= self.slice_count(segment):
            raise RemoteProtocolError(
                f"data frame at stream offset {stream_offset} does not start a slice"
            )
        start, stop = self.slice_range(segment, index)
        expected = stop - start if payload_size is None else payload_size(stop - start)
        if nbytes != expected:
            raise RemoteProtocolError(
                f"data frame at stream offset {stream_offset} carries {nbytes} bytes; "
                f"the slice needs {expected}"
            )
        return segment, index
