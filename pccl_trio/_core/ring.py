"""Pure ring math: ordering peers into a ring that avoids unreachable links, and the
schedule of a collective over a ring.

A ring is a list of peer ids; member ``i`` sends to ``ring[(i + 1) % n]`` and
receives from ``ring[i - 1]``. Only those directed edges must be reachable. What a
member sends and receives in a collective, and what it does with each byte it
receives, is its ``RingSchedule``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Collection, Sequence

from .errors import RemoteProtocolError

__all__ = [
    "STRIPED_SLICE_FLOOR",
    "RingSchedule",
    "Segment",
    "chunk_bounds",
    "find_ring",
    "neighbours",
    "ring_edges",
    "ring_parts",
    "striped_slice",
]

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


def ring_parts(ring: Sequence[int]) -> tuple[int, ...]:
    """The layout of a ring collective's chunks: position ``c``'s chunk is the part
    of the buffer (``chunk_bounds``, parts in ascending peer-id order, as
    ``numpy.array_split`` cuts them) that belongs to ``ring[c - 1]``, the peer that
    computes its final value. So a reduce-scatter leaves each peer its own part, and
    the all-reduce, laid out alike, accumulates every part in the same order: the two
    agree bit for bit."""
    by_id = sorted(ring)
    return tuple(by_id.index(ring[c - 1]) for c in range(len(ring)))


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


#: The smallest slice ``striped_slice`` cuts: below it a frame's fixed cost of work
#: outweighs what one more connection carries.
STRIPED_SLICE_FLOOR = 256 << 10


def striped_slice(slice_bytes: int, *, nbytes: int, world: int, itemsize: int, stripes: int) -> int:
    """The slice size a ring all-reduce of ``nbytes`` over ``world`` peers uses when the
    ring's pools have up to ``stripes`` connections (the master's
    ``P2PEstablishResult.stripes``, the same for every member).

    A ring step moves one chunk (``nbytes / world``) over one link, dealt slice by slice
    over that link's pool: with fewer slices than connections, some connections idle
    for the whole step while the others are limited by their windows (at 100 ms and 8
    connections, a W=4 64 MiB all-reduce cut in 4 MiB slices kept 4 of them busy and
    took 1.22 s back to back; cut in 1 MiB, 0.99 s: ``docs/benchmarks.md``). So with
    ``stripes`` > 1 a step is cut into at least ``2 * stripes`` slices (two per
    connection, so that each has its next frame queued), but never below
    ``STRIPED_SLICE_FLOOR`` nor above ``slice_bytes``; with one connection per link (a
    LAN, loopback) it is ``slice_bytes``, unchanged. Whole elements only.
    """
    if stripes <= 1:
        return slice_bytes
    chunk = -(-nbytes // world)
    wanted = -(-chunk // (2 * stripes))
    cut = min(slice_bytes, max(STRIPED_SLICE_FLOOR, wanted))
    return max(itemsize, cut - cut % itemsize)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One chunk's worth of a peer's send or receive stream.

    Attributes:
        index: position in its stream.
        chunk: which chunk of the buffer it carries.
        start: byte offset of that chunk in the buffer.
        nbytes: its length in bytes.
        stream_offset: where the segment starts in the stream.
        reduce: the data is a partial result, combined into the buffer where it
            arrives (``local OP incoming``), rather than a final value copied over it.
        forwards: (a send segment) the received segment whose slices it sends, each
            once it arrived and was written; None: it sends this peer's input.
        forwarded_by: (a received segment) the send segment that forwards it; None:
            its data goes no further.
        first_write: (a received segment) its bytes of the buffer are written for the
            first time in the collective: an in-place input is kept just before.
        completes: (a received segment) combining it makes the chunk's final value,
            here, once: an average is divided here, and a codec encodes the block
            every peer then decodes.
    """

    index: int
    chunk: int
    start: int
    nbytes: int
    stream_offset: int
    reduce: bool
    forwards: int | None = None
    forwarded_by: int | None = None
    first_write: bool = False
    completes: bool = False


class RingSchedule:
    """Who sends which bytes when, for one peer of a ring collective.

    Theory of operation: a ring collective is, at each peer, two streams of bytes:
    what it sends to its successor and what it receives from its predecessor, each a
    sequence of *segments* (one chunk of the buffer apiece). A received segment says
    what the receiver does with it: combine it into the buffer (``reduce``) or copy
    it there, and whether it is sent on (``forwarded_by``). A send segment sends
    either this peer's input or, slice for slice, a received segment once each slice
    of it is written (``forwards``): so a collective pipelines slice by slice, and the
    data path (``peer/_attempt.py``) runs any collective given its schedule. The
    schedule of rank ``r``'s send stream is the schedule of rank ``r+1``'s receive
    stream, segment for segment.

    Every segment is cut into slices of ``slice_bytes`` (a multiple of the item size);
    a slice travels as one data frame whose offset is its position in the stream.

    The all-reduce (``all_reduce``) is reduce-scatter then all-gather, fused into
    one stream per direction. Rank ``r`` of ``W`` sends ``2(W-1)`` segments to ``r+1``:
    segment 0 is its own chunk ``r``; segment ``k`` is chunk ``r-k``, i.e. exactly what
    it received as segment ``k-1``, once combined (``k-1 < W-1``) or copied
    (``k-1 >= W-1``). The accumulation order of chunk ``c`` is fixed (it starts at rank
    ``c`` and is combined at ``c+1, ..., c+W-1``, in the form ``local OP incoming``), and
    its final value is computed once, by its owner ``c-1``, and copied everywhere
    else: every peer ends bit-identical.

    Args:
        world: the ring's size; rank: this peer's position in it.
        itemsize: the bytes of one element (slices hold whole elements).
        slice_bytes: the largest slice, rounded down to whole elements.
        send, recv: the two streams' segments, in stream order.

    Raises:
        ValueError: the segments do not make a schedule (not contiguous, or a
            forward that does not match what it forwards).
    """

    def __init__(
        self,
        *,
        world: int,
        rank: int,
        itemsize: int,
        slice_bytes: int,
        send: Sequence[Segment],
        recv: Sequence[Segment],
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a ring of {world}")
        if itemsize < 1 or slice_bytes < 1:
            raise ValueError("itemsize and slice_bytes must be positive")
        self.world = world
        self.rank = rank
        self.itemsize = itemsize
        self.slice_bytes = max(itemsize, slice_bytes - slice_bytes % itemsize)
        self.send = tuple(send)
        self.recv = tuple(recv)
        _check_stream(self.send, itemsize)
        _check_stream(self.recv, itemsize)
        _check_forwards(self.send, self.recv)
        self._recv_starts = tuple(s.stream_offset for s in self.recv)
        #: Slices per segment of each stream, and where each send segment's first
        #: slice stands in the stream of slices.
        self.recv_slices = tuple(self.slice_count(s) for s in self.recv)
        self.send_slices = tuple(self.slice_count(s) for s in self.send)
        self.send_positions = tuple(itertools.accumulate(self.send_slices[:-1], initial=0))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def all_reduce(
        *, count: int, itemsize: int, world: int, rank: int, slice_bytes: int,
        parts: tuple[int, ...] | None = None, scatter: bool = False,
    ) -> RingSchedule:
        """The all-reduce of ``count`` elements at ``rank`` (see the class docstring),
        shared: a schedule is never changed once made, and a training loop
        all-reduces the same shapes over and over.

        Args:
            parts: which of the buffer's ``chunk_bounds`` parts each ring position's
                chunk is (``ring_parts``); None: part ``c`` for position ``c``.
            scatter: the reduce-scatter only (the first ``W - 1`` segments of each
                stream): this peer ends holding the final value of chunk ``rank + 1``
                alone, the same bits as the all-reduce with the same ``parts`` holds
                there.
        """
        bounds = chunk_bounds(count, world)
        order = range(world) if parts is None else parts
        if sorted(order) != list(range(world)):
            raise ValueError(f"parts {parts} are not a permutation of the {world} chunks")
        chunks = tuple(
            (bounds[part][0] * itemsize, (bounds[part][1] - bounds[part][0]) * itemsize)
            for part in order
        )
        steps = world - 1 if scatter else 2 * (world - 1)

        def segments(chunk_of: Callable[[int], int], *, receiving: bool) -> list[Segment]:
            out = []
            offset = 0
            for k in range(steps):
                chunk = chunk_of(k)
                start, nbytes = chunks[chunk]
                reduce = k < world - 1
                out.append(Segment(
                    index=k, chunk=chunk, start=start, nbytes=nbytes, stream_offset=offset,
                    reduce=reduce,
                    forwards=None if receiving or k == 0 else k - 1,
                    forwarded_by=k + 1 if receiving and k + 1 < steps else None,
                    # Written first: each chunk this peer combines, and its own chunk
                    # when the all-gather brings its final value.
                    first_write=receiving and (reduce or chunk == rank),
                    completes=receiving and k == world - 2,
                ))
                offset += nbytes
            return out

        return RingSchedule(
            world=world, rank=rank, itemsize=itemsize, slice_bytes=slice_bytes,
            send=segments(lambda k: (rank - k) % world, receiving=False),
            recv=segments(lambda k: (rank - k - 1) % world, receiving=True),
        )

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def broadcast(
        *, count: int, itemsize: int, world: int, rank: int, root: int, slice_bytes: int
    ) -> RingSchedule:
        """The broadcast of ``count`` elements from ring position ``root``, at ``rank``:
        the whole buffer is one segment that goes down the ring from the root, each
        member storing every slice and passing it on at once, but the root's
        predecessor, whose successor is the root. Pipelined slice by slice, a large
        buffer costs about one transfer plus a slice's time per hop."""
        if not 0 <= root < world:
            raise ValueError(f"root {root} is not in a ring of {world}")
        whole = Segment(
            index=0, chunk=0, start=0, nbytes=count * itemsize, stream_offset=0, reduce=False
        )
        distance = (rank - root) % world
        sends = distance < world - 1
        send = [dataclasses.replace(whole, forwards=None if distance == 0 else 0)] if sends else []
        recv = [] if distance == 0 else [
            dataclasses.replace(whole, forwarded_by=0 if sends else None, first_write=True)
        ]
        return RingSchedule(
            world=world, rank=rank, itemsize=itemsize, slice_bytes=slice_bytes,
            send=send, recv=recv,
        )

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def all_gather(
        *, sizes: tuple[int, ...], ids: tuple[int, ...], itemsize: int, rank: int,
        slice_bytes: int,
    ) -> RingSchedule:
        """The all-gather at ``rank`` of parts of ``sizes[c]`` elements, one per ring
        position ``c``, whose members' peer ids are ``ids`` (the ring): the buffer holds
        the parts in ascending peer-id order, each at the offset the smaller ids' parts
        end at. Rank ``r`` sends its own part (segment 0), then forwards what it
        received, ``W - 1`` parts in all, each stored where it belongs on the way: the
        ring's all-gather half of the all-reduce, with parts that may differ in size.
        (Segment 0 sends the caller's input, which holds only this part: the data path
        reads it less the part's offset, ``Operands``'s ``own_start``.)"""
        world = len(ids)
        if len(sizes) != world or len(set(ids)) != world:
            raise ValueError(f"sizes {sizes} do not match the ring {ids}")
        starts: dict[int, int] = {}
        offset = 0
        for position in sorted(range(world), key=ids.__getitem__):
            starts[position] = offset
            offset += sizes[position] * itemsize

        def segments(position_of: Callable[[int], int], *, receiving: bool) -> list[Segment]:
            out = []
            stream = 0
            for k in range(world - 1):
                position = position_of(k)
                nbytes = sizes[position] * itemsize
                out.append(Segment(
                    index=k, chunk=position, start=starts[position], nbytes=nbytes,
                    stream_offset=stream, reduce=False,
                    forwards=None if receiving or k == 0 else k - 1,
                    forwarded_by=k + 1 if receiving and k + 1 < world - 1 else None,
                ))
                stream += nbytes
            return out

        return RingSchedule(
            world=world, rank=rank, itemsize=itemsize, slice_bytes=slice_bytes,
            send=segments(lambda k: (rank - k) % world, receiving=False),
            recv=segments(lambda k: (rank - k - 1) % world, receiving=True),
        )

    @property
    def scattered(self) -> tuple[int, int]:
        """Of a reduce-scatter (``all_reduce(scatter=True)``): the byte range
        ``[start, stop)`` of the buffer whose final value this peer holds."""
        last = self.recv[-1] if self.recv else None
        if last is None or not last.completes:
            raise ValueError("not a reduce-scatter schedule")
        return last.start, last.start + last.nbytes

    def slice_count(self, segment: Segment) -> int:
        """How many slices ``segment`` is cut into."""
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


def _check_stream(segments: Sequence[Segment], itemsize: int) -> None:
    """Segments numbered in order, each starting where the one before ended."""
    offset = 0
    for position, segment in enumerate(segments):
        if segment.index != position or segment.stream_offset != offset:
            raise ValueError(f"segment {segment} is not at position {position}, offset {offset}")
        if segment.nbytes < 0 or segment.start % itemsize or segment.nbytes % itemsize:
            raise ValueError(f"segment {segment} does not hold whole elements of {itemsize} bytes")
        offset += segment.nbytes


def _check_forwards(send: Sequence[Segment], recv: Sequence[Segment]) -> None:
    """Each forward names the other side, and carries exactly the bytes it forwards."""
    for segment in send:
        if segment.forwards is None:
            continue
        source = recv[segment.forwards] if 0 <= segment.forwards < len(recv) else None
        if (
            source is None or source.forwarded_by != segment.index
            or (source.start, source.nbytes) != (segment.start, segment.nbytes)
        ):
            raise ValueError(f"send segment {segment.index} does not forward {source}")
    for segment in recv:
        if segment.forwarded_by is not None and (
            not 0 <= segment.forwarded_by < len(send)
            or send[segment.forwarded_by].forwards != segment.index
        ):
            raise ValueError(f"received segment {segment.index} is not forwarded as it says")
