"""Records nested inside control messages: endpoints, world sizes, shared-state entries.

Theory of operation
-------------------
These are records (``records.record``), not messages: they have no kind of their own
and travel only as fields of the messages in ``messages``, which re-exports them as
part of the one vocabulary of the protocol. Like messages, they check their fields
when built, so a decoded endpoint or entry is a valid one.

A shared-state entry names its tensor's content twice: ``hash``, the 32-bit simplehash
every run compares (fast, but anyone can craft other bytes with the same value), and
``digest``, a BLAKE2b-256 of the same bytes (``DIGEST_SIZE``), which peers send only
when the master requires it (``Welcome.content_digest``) and which is empty otherwise.
"""

from __future__ import annotations

import dataclasses

from .errors import RemoteProtocolError
from .identity import IDENTITY_SIZE
from .records import U16_MAX, Record, record

__all__ = [
    "DIGEST_SIZE",
    "DTYPE_NAMES",
    "MAX_KEY",
    "MAX_POOL_SIZE",
    "PeerEndpoint",
    "SharedStateEntry",
    "SharedStateFetch",
    "SharedStateFetcher",
    "SharedStateRange",
    "TensorSpan",
    "WorldSizes",
    "check_digest",
    "check_identity",
    "check_key",
    "check_pool_size",
]

#: Names by wire value; the public enums in ``pccl_trio._types`` use the same values
#: (a test holds them together).
DTYPE_NAMES = (
    "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64",
    "FLOAT16", "BFLOAT16", "FLOAT", "DOUBLE",
)
#: Bytes of one element of each dtype, by its value (``DTYPE_NAMES``' order).
DTYPE_SIZES = (1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8)
#: Bytes of a shared-state content digest (BLAKE2b-256).
DIGEST_SIZE = 32
#: Longest shared-state key, in characters.
MAX_KEY = 1024

#: Most connections per ring neighbour (a pool's slots are numbered from 0 below it).
MAX_POOL_SIZE = 1024


def check_pool_size(pool_size: int, where: str) -> None:
    if not 1 <= pool_size <= MAX_POOL_SIZE:
        raise RemoteProtocolError(f"{where}: {pool_size} is not in 1..{MAX_POOL_SIZE}")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerEndpoint(Record):
    """Where a peer accepts p2p connections (and the host its own connections come
    from), and how many connections its ring pool opens."""

    peer_id: int
    host: str
    port: int
    pool_size: int = 1
    identity: bytes = b""  # the node identity it proved to the master (empty: none)

    def _validate(self) -> None:
        if not 1 <= self.port <= U16_MAX:
            raise RemoteProtocolError(f"PeerEndpoint.port: {self.port} is not a TCP port")
        check_pool_size(self.pool_size, "PeerEndpoint.pool_size")
        check_identity(self.identity, "PeerEndpoint.identity")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorldSizes(Record):
    """The four world-size attributes of one peer's view of the run."""

    global_world_size: int
    peer_group_world_size: int
    num_distinct_peer_groups: int
    largest_peer_group_world_size: int


def check_identity(identity: bytes, where: str) -> None:
    if len(identity) not in (0, IDENTITY_SIZE):
        raise RemoteProtocolError(
            f"{where}: a node identity has {IDENTITY_SIZE} bytes (or none), got {len(identity)}"
        )


def check_digest(digest: bytes, where: str) -> None:
    if len(digest) not in (0, DIGEST_SIZE):
        raise RemoteProtocolError(
            f"{where}: a content digest has {DIGEST_SIZE} bytes (or none), got {len(digest)}"
        )


def check_key(key: str, where: str) -> None:
    if not key or len(key) > MAX_KEY:
        raise RemoteProtocolError(f"{where}: a shared-state key has 1 to {MAX_KEY} characters")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateEntry(Record):
    """One tensor of a peer's shared state, as it votes: what the master compares.

    ``hash`` is the simplehash of its bytes, ``digest`` their BLAKE2b-256 when the run
    requires digests (empty otherwise). A tensor whose content may differ
    (``allow_content_inequality``) is never compared: it votes hash 0 and no digest.
    """

    key: str
    hash: int
    dtype: int
    count: int
    allow_content_inequality: bool
    digest: bytes = b""

    def _validate(self) -> None:
        check_key(self.key, "SharedStateEntry.key")
        check_digest(self.digest, "SharedStateEntry.digest")
        if self.dtype >= len(DTYPE_NAMES):
            raise RemoteProtocolError(f"SharedStateEntry.dtype: unknown value {self.dtype}")

    def describe(self) -> str:
        return f"{self.count} x {DTYPE_NAMES[self.dtype]}"


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateFetch(Record):
    """A tensor a peer must fetch, and the hash (and, when not empty, the digest) it
    must have, unless not ``verify``."""

    key: str
    hash: int
    verify: bool
    digest: bytes = b""

    def _validate(self) -> None:
        check_key(self.key, "SharedStateFetch.key")
        check_digest(self.digest, "SharedStateFetch.digest")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpan(Record):
    """Tensors ``first`` to ``first + count - 1`` of the popular state, in vote order."""

    first: int
    count: int

    def _validate(self) -> None:
        if self.count == 0:
            raise RemoteProtocolError("TensorSpan.count: must be at least 1")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateFetcher(Record):
    """A peer a distributor may serve in a sync: its id, the host its connections come
    from, the node identity it proved to the master, and the tensors it may ask for."""

    peer_id: int
    host: str
    identity: bytes
    tensors: tuple[TensorSpan, ...]

    def _validate(self) -> None:
        check_identity(self.identity, "SharedStateFetcher.identity")


@record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateRange(Record):
    """Bytes ``[offset, offset + nbytes)`` of one shared-state tensor."""

    key: str
    offset: int
    nbytes: int

    def _validate(self) -> None:
        check_key(self.key, "SharedStateRange.key")
