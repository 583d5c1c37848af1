"""Shared-state sync, peer side: the tensors, their hashes, and the transfer protocol.

Theory of operation
-------------------
A sync has three parts. The communicator hashes every tensor whose content must match
(``simplehash``, the same for host and GPU memory, and, when the master requires it,
a BLAKE2b-256 *digest* of the same bytes: the simplehash is fast but can be forged
offline, the digest cannot), votes its entries to the master and, from that moment,
*serves* its tensors: peers that received the master's plan earlier may already ask.
The master answers each peer with a plan: the revision to hold afterwards, the tensors
to fetch with their expected hashes (and digests), and the *distributors*, every peer
that holds the popular state.

A distributor serves only the peers the master's plan names as fetchers, each from the
host the master knows it at, each only the tensors it fetches, and each byte of them at
most once (``Serving.claim``): a stranger, a peer of the run not fetching, or a fetcher
asking for other tensors or for the same bytes again gets a refusal, not data.

A fetching peer splits the bytes it needs into *pieces* (at most ``PIECE_BYTES`` of one
tensor) and opens a connection to every distributor, or several where the path is long
(as many as the ring's pools have, spread over the distributors: ``SharedStateSync``).
Each connection's worker takes
the next piece from one shared queue, asks for it (``SharedStateRequest``), and receives
the answer's data frames straight into the tensor's memory. Fast distributors thus
serve more pieces; none is singled out. When a distributor fails (it left, broke the
connection, refused, or sent a frame that does not continue the range), the unfinished
part of its piece goes back to the front of the queue for the others. Before the first
byte lands, every tensor to fetch is copied aside: if every distributor fails, or a
received tensor does not hash to the value the master announced (or, with the popular
simplehash, does not have the digest it announced: ``mismatched``), the copies are put
back, and the state and revision stay what they were. Only a complete, verified state
is reported as synced.

Each distributor's worker sees the fetch through its own ``Share``, which counts what
that distributor delivered: a distributor slower than the minimum rate is dropped
like a failed one (``SharedStateSync``).

The protocol on one connection is written once, as generators of IO operations
(``_protocol``), run by trio tasks or by a worker thread like every p2p protocol.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Mapping, Sequence

import numpy

from .._core.errors import RemoteProtocolError
from .._core.messages import (
    DIGEST_SIZE,
    MAX_KEY,
    PROTOCOL_VERSION,
    SharedStateEntry,
    SharedStateFetch,
    SharedStateFetcher,
    SharedStateRange,
    SharedStateRequest,
    SharedStateResponse,
    bounded,
)
from .._core.records import MAX_SEQUENCE, U64_MAX
from .._errors import InvalidArgument
from .._types import SharedState, TensorInfo
from ..ops import (
    CROSSINGS,
    Array,
    ArrayModule,
    HostStaging,
    Lander,
    as_array,
    byte_view,
    from_numpy_dtype,
    gpu_of,
    simplehash,
    staging_for,
)
from ._protocol import Protocol, ReceiveHeader, ReceiveMessage, ReceivePayload, Send, SendData

__all__ = [
    "PIECE_BYTES",
    "Allowance",
    "Backup",
    "Fetcher",
    "Piece",
    "Share",
    "Serving",
    "Tensor",
    "prepare_state",
    "state_digest",
    "request_pieces",
    "serve_requests",
]

#: Largest piece of a tensor asked for in one request.
PIECE_BYTES = 64 << 20
#: Largest data frame a distributor sends.
FRAME_BYTES = 8 << 20


# --- the tensors ---------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class Tensor:
    """One tensor of the state being synchronized, as flat views of its memory."""

    key: str
    xp: ArrayModule
    array: Array  # flat, the tensor's dtype
    raw: Array  # flat uint8 view of the same memory
    allow_content_inequality: bool

    @property
    def nbytes(self) -> int:
        return int(self.raw.size)

    @property
    def staging(self) -> HostStaging:
        """How its bytes meet the sockets; ``staging.current()`` makes its GPU current."""
        return staging_for(self.xp, gpu_of(self.xp, self.raw))

    def entry(self, content_hash: int, digest: bytes = b"") -> SharedStateEntry:
        return SharedStateEntry(
            key=self.key,
            hash=content_hash,
            dtype=from_numpy_dtype(self.array.dtype).value,
            count=int(self.array.size),
            allow_content_inequality=self.allow_content_inequality,
            digest=digest,
        )

    def content_hash(self, threads: int = 1) -> int:
        """simplehash of the bytes; 0 for a tensor whose content may differ."""
        if self.allow_content_inequality:
            return 0
        with self.staging.current():  # in a worker thread: the tensor's GPU there too
            return simplehash(self.xp, self.raw, threads=threads)

    def content_digest(self) -> bytes:
        """BLAKE2b-256 of the bytes; empty for a tensor whose content may differ.

        One code path for every array module: the bytes come through ``read``, in place
        from host memory, copied to the host one piece (``PIECE_BYTES``) at a time from
        a GPU. hashlib releases the GIL while it hashes, so run it in a worker thread.
        """
        if self.allow_content_inequality:
            return b""
        digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
        for start in range(0, self.nbytes, PIECE_BYTES):
            digest.update(self.read(start, min(PIECE_BYTES, self.nbytes - start)))
        return digest.digest()

    def read(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)``, zero-copy from host memory (a copy from
        a GPU)."""
        if self.xp is numpy:
            return byte_view(numpy, self.raw)[offset : offset + nbytes]
        CROSSINGS.to_host(nbytes)
        return memoryview(self.xp.asnumpy(self.raw[offset : offset + nbytes]))


def prepare_state(state: object) -> list[Tensor]:
    """Check a ``SharedState`` and view its tensors.

    Raises:
        InvalidArgument: not a SharedState, a bad revision, a tensor that is not a
            TensorInfo, a missing, duplicate or overlong name, or an unusable buffer.
    """
    if not isinstance(state, SharedState):
        raise InvalidArgument(f"expected a pccl_trio.SharedState, got {type(state).__name__}")
    revision = state.revision
    if not (isinstance(revision, int) and not isinstance(revision, bool)
            and 0 <= revision <= U64_MAX):
        raise InvalidArgument(
            f"SharedState.revision must be an integer from 0 to 2**64-1, got {revision!r}"
        )
    if not isinstance(state.tensors, Sequence) or isinstance(state.tensors, str | bytes):
        raise InvalidArgument("SharedState.tensors must be a list of pccl_trio.TensorInfo")
    if len(state.tensors) > MAX_SEQUENCE:
        raise InvalidArgument(
            f"SharedState holds {len(state.tensors)} tensors; at most {MAX_SEQUENCE} fit in a "
            "vote: concatenate small tensors"
        )
    tensors: list[Tensor] = []
    seen: set[str] = set()
    for index, info in enumerate(state.tensors):
        if not isinstance(info, TensorInfo):
            raise InvalidArgument(
                f"SharedState.tensors[{index}] is a {type(info).__name__}, not a pccl_trio.TensorInfo"
            )
        name = info.name
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_KEY:
            raise InvalidArgument(
                f"SharedState.tensors[{index}]: the name must be a string of 1 to {MAX_KEY} "
                f"characters, got {name!r:.80}"
            )
        if name in seen:
            raise InvalidArgument(f"SharedState: two tensors are named {name!r}; names must be unique")
        seen.add(name)
        if not isinstance(info.allow_content_inequality, bool):
            raise InvalidArgument(
                f"TensorInfo {name!r}: allow_content_inequality must be a bool, got "
                f"{info.allow_content_inequality!r}"
            )
        xp, array = as_array(info.data, name=f"shared-state tensor {name!r}")
        if xp is not numpy:
            staging_for(xp, gpu_of(xp, array)).wait_current_stream()
        tensors.append(
            Tensor(
                key=name, xp=xp, array=array, raw=array.view(numpy.uint8),
                allow_content_inequality=info.allow_content_inequality,
            )
        )
    return tensors


def state_digest(state: object) -> str:
    """A hex BLAKE2b-256 digest of what a sync keeps identical in ``state``: each
    tensor's name, dtype and size, then its bytes, in order, leaving out the tensors
    with ``allow_content_inequality``. Peers holding the same state get the same
    digest (whatever memory the tensors live in); the revision is not part of it.

    It reads every byte (a GPU tensor is copied to the host piece by piece): a
    fraction of a second per GiB on a host, more from a GPU. Log it now and then on
    every peer to check that the weights agree.

    Raises:
        InvalidArgument: ``state`` is not a valid ``SharedState``.
    """
    outer = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for tensor in prepare_state(state):
        if tensor.allow_content_inequality:
            continue
        outer.update(f"{tensor.key}\0{tensor.array.dtype.str}\0{tensor.nbytes}\0".encode())
        outer.update(tensor.content_digest())
    return outer.hexdigest()


# --- serving ---------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class Allowance:
    """What one fetcher may ask a distributor for in a sync (from the master's plan)."""

    host: str  # where its connections come from
    identity: bytes  # the node identity it proved to the master (empty: none)
    keys: frozenset[str]  # the tensors it fetches
    left: int  # bytes of them not sent to it yet


class Serving:
    """This peer's tensors, offered to the peers of its sync from its vote to the end.

    ``sync`` is None until this peer has its own plan; requests wait for it.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors: Mapping[str, Tensor] = {t.key: t for t in tensors}
        self.sync: int | None = None
        self.distributor = False  # set with ``sync``: only peers fetching nothing serve
        self.fetchers: dict[int, Allowance] = {}  # set with ``sync``: whom it serves
        self.active = True
        self.handlers = 0  # connections being served (counted in the trio thread)
        self._lock = threading.Lock()
        self._tx_bytes = 0

    @property
    def tx_bytes(self) -> int:
        with self._lock:
            return self._tx_bytes

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self._tx_bytes += nbytes

    def allow(self, fetchers: Sequence[SharedStateFetcher]) -> None:
        """Serve the plan's ``fetchers``, each the tensors at the positions it names."""
        order = list(self.tensors.values())
        for fetcher in fetchers:
            keys = frozenset(
                order[i].key
                for span in fetcher.tensors
                for i in range(span.first, min(span.first + span.count, len(order)))
            )
            self.fetchers[fetcher.peer_id] = Allowance(
                host=fetcher.host, identity=fetcher.identity, keys=keys,
                left=sum(self.tensors[k].nbytes for k in keys),
            )

    def claim(self, request: SharedStateRequest, peer_id: int) -> str:
        """Why ``request``, on a connection of peer ``peer_id``, cannot be served (empty:
        it can, and its bytes now count as sent to that peer)."""
        if (not self.active or self.sync is None or request.sync != self.sync
                or not self.distributor):
            return f"this peer does not distribute the shared state of sync {request.sync}"
        if request.peer_id != peer_id:
            return f"a request of peer {request.peer_id} on a connection of peer {peer_id}"
        allowance = self.fetchers.get(peer_id)
        if allowance is None:
            return (
                f"the master's plan for sync {self.sync} names no peer {peer_id} fetching "
                "from this peer"
            )
        if not request.ranges:
            return "a request must name at least one range"
        for r in request.ranges:
            tensor = self.tensors.get(r.key)
            if tensor is None or r.key not in allowance.keys:
                return f"peer {peer_id} does not fetch a tensor named {r.key!r:.100} in this sync"
            if r.nbytes == 0 or r.offset + r.nbytes > tensor.nbytes:
                return (
                    f"bytes {r.offset} to {r.offset + r.nbytes} are not inside tensor "
                    f"{r.key!r:.100} ({tensor.nbytes} bytes)"
                )
        nbytes = sum(r.nbytes for r in request.ranges)
        with self._lock:
            if nbytes > allowance.left:
                return (
                    f"peer {peer_id} asks for {nbytes} bytes, but only {allowance.left} of "
                    "the tensors it fetches were not sent to it yet"
                )
            allowance.left -= nbytes
        return ""


def serve_requests(serving: Serving, request: SharedStateRequest) -> Protocol[None]:
    """A distributor's side of one connection: answer ``request`` and every later one,
    until the requester closes the connection (or asks for something it cannot have)."""
    peer_id = request.peer_id
    while True:
        refusal = bounded(serving.claim(request, peer_id))
        yield Send(SharedStateResponse(error=refusal))
        if refusal:
            return
        frame = min(FRAME_BYTES, request.frame_bytes)
        for index, wanted in enumerate(request.ranges):
            tensor = serving.tensors[wanted.key]
            end = wanted.offset + wanted.nbytes
            # Staged like an all-reduce's slices: the next frame's copy to the host
            # overlaps this frame's send.
            sender = tensor.staging.sender(frame)
            try:
                for start in range(wanted.offset, end, frame):
                    nbytes = min(frame, end - start)
                    payload = sender.host(tensor.raw[start : start + nbytes], key=start)
                    if start + frame < end:
                        following = start + frame
                        sender.prefetch(following, tensor.raw[following : min(following + frame, end)])
                    yield SendData(tag=index, seq=request.sync, offset=start, payload=payload)
                    serving.sent(nbytes)
            finally:
                sender.close()
        following = yield ReceiveMessage()
        if not isinstance(following, SharedStateRequest):
            raise RemoteProtocolError(
                f"expected a SharedStateRequest, got {type(following).__name__}"
            )
        request = following


# --- fetching ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of tensor ``key``; a ``whole`` piece (a tensor
    whose content may differ between peers) must come from one distributor, so after a
    failure it starts again from its first byte."""

    key: str
    offset: int
    nbytes: int
    whole: bool = False


class DistributorRefused(Exception):
    """A distributor answered a request with an error."""


class Fetcher:
    """The pieces still to fetch, shared by one worker per distributor (trio tasks or
    threads), and what was received."""

    def __init__(self, tensors: Mapping[str, Tensor], keys: Sequence[str], *, sync: int,
                 peer_id: int, frame_bytes: int, whole: Sequence[str] = ()) -> None:
        self.tensors = tensors
        self.sync = sync
        self.peer_id = peer_id
        self.frame_bytes = frame_bytes
        self.pieces: collections.deque[Piece] = collections.deque()
        for key in keys:
            size = tensors[key].nbytes
            if key in whole:
                # Peers' copies may differ: splicing two would give a value nobody has.
                self.pieces.append(Piece(key, 0, size, whole=True))
                continue
            for offset in range(0, size, PIECE_BYTES):
                self.pieces.append(Piece(key, offset, min(PIECE_BYTES, size - offset)))
        self._lock = threading.Lock()
        self._received = 0
        self.failures: list[str] = []
        self.failed_peers: set[int] = set()

    @property
    def received(self) -> int:
        with self._lock:
            return self._received

    def take(self) -> Piece | None:
        with self._lock:
            return self.pieces.popleft() if self.pieces else None

    def give_back(self, piece: Piece) -> None:
        with self._lock:
            self.pieces.appendleft(piece)

    def count(self, nbytes: int) -> None:
        with self._lock:
            self._received += nbytes

    def uncount(self, nbytes: int) -> None:
        """Bytes received for a whole piece that must start again."""
        with self._lock:
            self._received -= nbytes

    def failed(self, distributor: int, reason: str) -> None:
        with self._lock:
            self.failures.append(f"peer {distributor}: {reason}")
            self.failed_peers.add(distributor)


class Share(Fetcher):
    """One distributor's view of a ``Fetcher``: the same pieces, tensors and totals
    (every call goes to the fetcher), and the bytes this distributor delivered."""

    def __init__(self, fetcher: Fetcher) -> None:
        # Not Fetcher.__init__: the queue, its lock and the totals are the fetcher's.
        self.whole = fetcher
        self.tensors = fetcher.tensors
        self.sync = fetcher.sync
        self.peer_id = fetcher.peer_id
        self.frame_bytes = fetcher.frame_bytes
        self._delivered_lock = threading.Lock()
        self._delivered = 0

    @property
    def delivered(self) -> int:
        """Bytes of complete data frames this distributor sent."""
        with self._delivered_lock:
            return self._delivered

    @property
    def received(self) -> int:
        return self.whole.received

    def take(self) -> Piece | None:
        return self.whole.take()

    def give_back(self, piece: Piece) -> None:
        self.whole.give_back(piece)

    def count(self, nbytes: int) -> None:
        self.whole.count(nbytes)
        with self._delivered_lock:
            self._delivered += nbytes

    def uncount(self, nbytes: int) -> None:
        self.whole.uncount(nbytes)

    def failed(self, distributor: int, reason: str) -> None:
        self.whole.failed(distributor, reason)


def request_pieces(fetcher: Fetcher) -> Protocol[None]:
    """A fetching peer's side of one connection: request pieces until none is left.

    A piece interrupted by a failure goes back to the queue, from its first missing byte.
    Payloads land through the staging of their tensor's array module (on a GPU, a copy
    to the device runs while the next frame arrives); every such copy is complete when
    this returns or raises.
    """
    landers: dict[int, Lander] = {}
    try:
        while True:
            piece = fetcher.take()
            if piece is None:
                return
            yield from _fetch_piece(fetcher, piece, landers)
    finally:
        for lander in landers.values():
            lander.close()


def _fetch_piece(fetcher: Fetcher, piece: Piece, landers: dict[int, Lander]) -> Protocol[None]:
    done = 0
    try:
        yield Send(
            SharedStateRequest(
                protocol_version=PROTOCOL_VERSION,
                peer_id=fetcher.peer_id,
                sync=fetcher.sync,
                ranges=(SharedStateRange(key=piece.key, offset=piece.offset,
                                         nbytes=piece.nbytes),),
                frame_bytes=fetcher.frame_bytes,
            )
        )
        response = yield ReceiveMessage()
        if not isinstance(response, SharedStateResponse):
            raise RemoteProtocolError(
                f"expected a SharedStateResponse, got {type(response).__name__}"
            )
        if response.error:
            raise DistributorRefused(response.error)
        tensor = fetcher.tensors[piece.key]
        staging = tensor.staging
        lander = landers.get(id(staging))
        if lander is None:
            lander = landers[id(staging)] = staging.lander(fetcher.frame_bytes)
        while done < piece.nbytes:
            tag, seq, offset, nbytes = yield ReceiveHeader()
            if (tag, seq, offset) != (0, fetcher.sync, piece.offset + done) or not (
                0 < nbytes <= min(piece.nbytes - done, fetcher.frame_bytes)
            ):
                raise RemoteProtocolError(
                    f"data frame (tag {tag}, sync {seq}, bytes {offset} to "
                    f"{offset + nbytes}) does not continue tensor {piece.key!r} at byte "
                    f"{piece.offset + done}"
                )
            target = tensor.raw[offset : offset + nbytes]
            room = lander.room(target)
            yield ReceivePayload(room)
            lander.landed(target, room)
            done += nbytes
            fetcher.count(nbytes)
    except BaseException:
        if done < piece.nbytes:
            if piece.whole:
                fetcher.uncount(done)
                fetcher.give_back(piece)
            else:
                fetcher.give_back(
                    Piece(piece.key, piece.offset + done, piece.nbytes - done)
                )
        raise


class Backup:
    """The old bytes of the tensors to fetch, to put back if the sync does not complete.

    Kept chunk by chunk, and a chunk of zeros (a joiner's fresh state) is remembered as
    zeros rather than copied: copying means touching as much new memory as the state,
    which costs more than the transfer itself on some machines.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._chunks: list[tuple[Tensor, int, int, Array | None]] = []
        for tensor in tensors:
            for start in range(0, tensor.nbytes, PIECE_BYTES):
                end = min(start + PIECE_BYTES, tensor.nbytes)
                chunk = tensor.raw[start:end]
                with tensor.staging.current():  # a worker thread: its GPU current there
                    copy = chunk.copy() if chunk.any() else None
                self._chunks.append((tensor, start, end, copy))
        # On a GPU the copies are queued on this thread's stream, and fetched bytes
        # land from other streams: the copies must be done first.
        self._settle()

    def restore(self) -> None:
        for tensor, start, end, copy in self._chunks:
            with tensor.staging.current():
                if copy is None:
                    tensor.raw[start:end].fill(0)
                else:
                    tensor.xp.copyto(tensor.raw[start:end], copy)
        self._settle()  # the user's next kernels may run on any stream

    def _settle(self) -> None:
        for staging in {id(t.staging): t.staging for t, *_ in self._chunks}.values():
            staging.wait_current_stream()


def mismatched(
    tensors: Sequence[Tensor], expected: Mapping[str, SharedStateFetch], threads: int = 1
) -> tuple[list[str], list[str]]:
    """The keys among ``tensors`` whose content does not match what ``expected`` (by
    key) announced: first those whose simplehash differs, then those whose simplehash
    matches but whose digest differs from the one announced (when one was)."""
    wrong_hash: list[str] = []
    wrong_digest: list[str] = []
    for t in tensors:
        fetch = expected.get(t.key)
        if fetch is None:
            continue
        if t.content_hash(threads) != fetch.hash:
            wrong_hash.append(t.key)
        elif fetch.digest and t.content_digest() != fetch.digest:
            wrong_digest.append(t.key)
    return wrong_hash, wrong_digest
