"""Control messages: frozen, validated records, encoded as msgpack arrays.

Theory of operation
-------------------
Every control message is a frozen, keyword-only dataclass registered under a small
integer ``KIND``. On the wire a message is ``kind`` (in the frame header, see
``wire``) followed by a msgpack array holding the field values in declaration order;
nested records (``PeerEndpoint``, ``WorldSizes``) are arrays too. Field types are
checked in ``__post_init__``, so a record that exists is a valid record, whether it
was built locally or decoded from the network. Decoding anything else (an unknown
kind, a wrong field count, a wrong type, an out-of-range integer) raises
``RemoteProtocolError`` naming the message and field.

The record machinery (type checks, the kind registry, the msgpack codec) is in
``records``; this module declares the messages.

Directions: ``C2M`` messages go from a peer to the master, ``M2C`` from the master to
a peer, ``P2P`` between peers (declared in ``p2p_messages``, exported from here, as
the status messages of ``status`` are). The master accepts only ``C2M`` kinds from peers; a peer
accepts only ``M2C`` kinds from the master.
"""

from __future__ import annotations

import dataclasses
import enum
import typing

from .errors import RemoteProtocolError
from .nested import (
    DIGEST_SIZE,
    DTYPE_NAMES,
    MAX_KEY,
    MAX_POOL_SIZE,
    PeerEndpoint,
    SharedStateEntry,
    SharedStateFetch,
    SharedStateFetcher,
    SharedStateRange,
    TensorSpan,
    WorldSizes,
    check_identity,
    check_pool_size,
)
from .p2p_messages import (
    MAX_BENCHMARK_BYTES,
    BenchmarkRequest,
    P2PHello,
    P2PHelloAck,
    SharedStateRequest,
    SharedStateResponse,
)
from .records import (
    C2M,
    M2C,
    P2P,
    U16_MAX,
    U32_MAX,
    Message,
    body_limit,
    bounded,
    decode_message,
    encode_message,
    message,
    message_kinds,
)
from .status import StatusReply, StatusRequest

__all__ = [
    "BenchmarkRequest",
    "C2M",
    "DIGEST_SIZE",
    "DTYPE_NAMES",
    "CollectiveAbort",
    "CollectiveCommence",
    "CollectiveComplete",
    "CollectiveInitiate",
    "CollectiveVerdict",
    "ExpectBenchmark",
    "M2C",
    "MAX_BENCHMARK_BYTES",
    "MAX_KEY",
    "MAX_LEASE_SPAN",
    "MAX_PENDING_WAIT",
    "MAX_POOL_SIZE",
    "MAX_TIMER",
    "P2P",
    "PROTOCOL_VERSION",
    "Heartbeat",
    "Kick",
    "LeaseEnd",
    "LeaseReport",
    "LeaseState",
    "LinkMeasured",
    "MeasureLink",
    "Message",
    "Outcome",
    "P2PEstablished",
    "P2PEstablishResult",
    "P2PHello",
    "P2PHelloAck",
    "P2PInfo",
    "PeerEndpoint",
    "PeersPendingResult",
    "Register",
    "SharedStateComplete",
    "SharedStateDone",
    "SharedStateEntry",
    "SharedStateFetch",
    "SharedStateFetcher",
    "SharedStatePlan",
    "SharedStateRange",
    "SharedStateRequest",
    "SharedStateResponse",
    "SharedStateVote",
    "StatusReply",
    "StatusRequest",
    "SyncStrategy",
    "TensorSpan",
    "TopologyOptimized",
    "VoteEstablish",
    "VoteOptimizeTopology",
    "VotePeersPending",
    "Welcome",
    "WorldSizes",
    "body_limits",
    "bounded",
    "decode_message",
    "encode_message",
    "message_kinds",
]

def body_limits(
    kinds: typing.Iterable[type[Message]], max_control_frame: int
) -> dict[int, int]:
    """``{kind: largest body}`` for a reader that accepts only ``kinds``."""
    return {cls.KIND: body_limit(cls, max_control_frame) for cls in kinds}


#: Bumped whenever the wire format or a message changes incompatibly.
PROTOCOL_VERSION = 14

OP_NAMES = ("SUM", "AVG", "PROD", "MAX", "MIN")
QUANTIZATION_NAMES = ("NONE", "MIN_MAX", "ZERO_POINT_SCALE")
DISTRIBUTION_HINT_NAMES = ("NONE", "NORMAL", "UNIFORM")


class CollectiveKind(enum.IntEnum):
    """``CollectiveInitiate.kind``: which call a peer makes of a tag. The peers of a
    collective must all make the same one."""

    ALL_REDUCE = 0
    BARRIER = 1
    REDUCE_SCATTER = 2
    BROADCAST = 3
    # Its ``count`` is this peer's own part, which may differ between peers: the
    # commence tells every member the parts of all (``CollectiveCommence.sizes``).
    ALL_GATHER = 4
    # An all-reduce with ``compression=TopK``: ``count`` and ``dtype`` are the dense
    # vector's, ``topk`` and ``topk_chunk`` the entries kept of every chunk of so many,
    # the quantization fields the kept values'. Its data is a gather of equal parts.
    TOPK_ALL_REDUCE = 5


#: How the calls are named in messages (the communicator's methods).
COLLECTIVE_NAMES = (
    "all_reduce", "barrier", "reduce_scatter", "broadcast", "all_gather",
    "all_reduce(compression=TopK)",
)

#: The largest chunk of a Top-k all-reduce: its indexes travel in 16 bits.
MAX_TOPK_CHUNK = 1 << 16
#: The code widths below a byte a Top-k all-reduce's values may be packed in.
TOPK_CODE_BITS = (2, 4)
#: ``DataType.UINT8``'s wire value: the codes packed codes are cut from.
UINT8_CODE = 0


class Outcome(enum.IntEnum):
    """``CollectiveVerdict.outcome``: how a collective ended, the same for every voter."""

    SUCCESS = 0
    ABORTED = 1  # a peer failed, left or voted otherwise: retry once the ring is re-established
    REJECTED = 2  # the peers disagree on the call, or a peer's data could not be reduced
    # It never ran: a member waits in a shared-state sync, which an all-reduce cannot
    # join. The ring is as it was (no data moved, nobody left): sync, then retry.
    BLOCKED = 3


class LeaseState(enum.IntEnum):
    """``LeaseReport.state``: where the last attempt a peer started under a lease is."""

    NONE = 0  # it started none under this lease
    RUNNING = 1  # its part is still running (a CollectiveComplete follows)
    COMPLETE = 2  # its part is complete: it holds the whole result
    FAILED = 3  # its part failed (it will never hold the result)


class SyncStrategy(enum.IntEnum):
    """``SharedStateVote.strategy``: what a peer offers and accepts in a shared-state sync
    (the public ``SharedStateSyncStrategy`` uses the same values)."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


OUTCOMES = tuple(Outcome)
LEASE_STATES = tuple(LeaseState)
#: Most attempts one lease may number (``CollectiveVerdict.lease``).
MAX_LEASE_SPAN = 1 << 24
STRATEGY_NAMES = tuple(strategy.name for strategy in SyncStrategy)
#: Largest group whose link matrices ``TopologyOptimized`` carries.
MATRIX_LIMIT = 128
#: Longest liveness timeout a master may impose, in seconds.
MAX_TIMER = 3600.0
#: Longest wait a pending-peers vote may ask for, in seconds (some 31 years: a peer
#: that waits "forever" asks for this).
MAX_PENDING_WAIT = 1e9
#: Largest peer id, revision or round, attempt, sync or optimization number a member
#: coming back may report (``Register``): far beyond any run, far below overflow.
MAX_RUN_NUMBER = 1 << 48
#: Longest host name (DNS) or address a peer may advertise.
MAX_HOST = 253
def _check_unique_keys(keys: typing.Iterable[str], where: str) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise RemoteProtocolError(f"{where}: key {key!r} appears twice")
        seen.add(key)

# --- peer -> master ---------------------------------------------------------------


@message(1, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Register(Message):
    """First message on a master link: join the run."""

    # The only kind a connection may send first, so the only one a stranger reaches
    # the decoder with: small.
    BODY_LIMIT: typing.ClassVar[int | None] = 1024

    protocol_version: int
    peer_group: int
    p2p_port: int
    advertised_host: str = ""  # empty: use the address the master sees
    pool_size: int = 1  # connections it opens to its successor (slots 0 to pool_size - 1)
    # A member that lost its master registers again as the member it was (``recovery``):
    rejoin: int = 0  # the peer id it had (0: it joins anew; the fields below are 0 too)
    predecessor: int = 0  # its ring neighbours (0: none, it was alone in its ring)
    successor: int = 0
    next_revision: int = 0  # the shared-state revision its group expects next (0: unknown)
    high_water: int = 0  # the highest round, attempt, sync or optimization number it saw
    predecessor_identity: bytes = b""  # the node identities the master named for them
    successor_identity: bytes = b""
    # Its connections from its predecessor broke with the master: that peer is gone.
    predecessor_gone: bool = False

    def _validate(self) -> None:
        check_pool_size(self.pool_size, "Register.pool_size")
        check_identity(self.predecessor_identity, "Register.predecessor_identity")
        check_identity(self.successor_identity, "Register.successor_identity")
        if not self.rejoin and (
            self.predecessor or self.successor or self.next_revision or self.high_water
            or self.predecessor_identity or self.successor_identity or self.predecessor_gone
        ):
            raise RemoteProtocolError(
                "Register: ring neighbours, revision or numbers without a peer id to rejoin as"
            )
        if self.predecessor_gone and not self.predecessor:
            raise RemoteProtocolError("Register: predecessor_gone without a predecessor")
        for name in ("rejoin", "predecessor", "successor", "next_revision", "high_water"):
            # A master continues its numbers above these: keep them far from overflowing.
            if getattr(self, name) > MAX_RUN_NUMBER:
                raise RemoteProtocolError(
                    f"Register.{name}: {getattr(self, name)} exceeds 2**48, more than a run "
                    "ever counts to"
                )
        if len(self.advertised_host) > MAX_HOST:
            raise RemoteProtocolError(
                f"Register.advertised_host: {len(self.advertised_host)} characters, more "
                f"than a host name or address can have ({MAX_HOST})"
            )
        if self.peer_group > U32_MAX:
            raise RemoteProtocolError(f"Register.peer_group: {self.peer_group} exceeds 2**32-1")
        if not 1 <= self.p2p_port <= U16_MAX:
            raise RemoteProtocolError(f"Register.p2p_port: {self.p2p_port} is not a TCP port")


@message(2, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat(Message):
    """Sent both ways on a quiet master link so silence can be told from calm."""


@message(3, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VoteEstablish(Message):
    """Vote to (re-)establish the ring; ``accept_new_peers`` also admits pending peers."""

    accept_new_peers: bool


@message(4, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PEstablished(Message):
    """Report on connecting to the ring neighbours the master named in ``round``;
    ``pool``: the connections the peer's pool to its successor has (0: none, it is
    alone or failed), from which the master tells the group how finely to cut a ring
    step (``P2PEstablishResult.stripes``)."""

    round: int
    success: bool
    failed_peers: tuple[int, ...] = ()
    pool: int = 0

    def _validate(self) -> None:
        if self.pool:
            check_pool_size(self.pool, "P2PEstablished.pool")


@message(5, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VotePeersPending(Message):
    """Vote to learn whether peers are waiting to be accepted.

    ``wait``: seconds the answer may wait for a peer to arrive while none waits (0:
    answer at once); once every member asked, the master answers as soon as a peer
    waits, or when the shortest ``wait`` of the voters ran out.
    """

    wait: float = 0.0

    def _validate(self) -> None:
        if not 0 <= self.wait <= MAX_PENDING_WAIT:
            raise RemoteProtocolError(
                f"VotePeersPending.wait: {self.wait!r} is not in [0, {MAX_PENDING_WAIT:g}] seconds"
            )


@message(6, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveInitiate(Message):
    """Vote to run collective ``tag``; every peer of the group must describe it alike:
    the same call (``kind``, a ``CollectiveKind``), down to the slice size its data
    frames are cut by (``Config.slice_bytes``: peers that cut the buffer differently
    could never reassemble each other's frames). A barrier is a collective of no data
    (count 0); a broadcast names its ``root``, the peer id whose bytes every member
    ends holding (0 for every other call)."""

    tag: int
    count: int
    dtype: int
    op: int
    quantized_dtype: int
    quantization: int
    distribution_hint: int = 0
    slice_bytes: int = 0
    # The peer can run the tag's next attempts under a lease (``CollectiveVerdict.lease``).
    lease: bool = False
    kind: int = CollectiveKind.ALL_REDUCE
    root: int = 0
    topk: int = 0
    topk_chunk: int = 0
    # A Top-k all-reduce's values as codes of this many bits, packed (0: the whole
    # width of ``quantized_dtype``, or unquantized).
    topk_bits: int = 0

    def _validate(self) -> None:
        _check_descriptor(self, "CollectiveInitiate")

    def describe(self) -> str:
        """The descriptor in words, for error messages."""
        return _describe(self)


def _check_descriptor(message: typing.Any, name: str) -> None:
    """The enumerated fields of a collective's descriptor hold known values, and a
    barrier carries no data."""
    for field, names in (
        ("dtype", DTYPE_NAMES), ("op", OP_NAMES), ("quantized_dtype", DTYPE_NAMES),
        ("quantization", QUANTIZATION_NAMES), ("distribution_hint", DISTRIBUTION_HINT_NAMES),
        ("kind", COLLECTIVE_NAMES),
    ):
        value = getattr(message, field)
        if value >= len(names):
            raise RemoteProtocolError(f"{name}.{field}: unknown value {value}")
    if message.kind == CollectiveKind.BARRIER and (message.count or message.quantization):
        raise RemoteProtocolError(f"{name}: a barrier carries no data, not {_describe(message)}")
    if message.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.BROADCAST) and (
        message.quantization
    ):
        raise RemoteProtocolError(f"{name}: a {COLLECTIVE_NAMES[message.kind]} is not quantized")
    if message.root and message.kind != CollectiveKind.BROADCAST:
        raise RemoteProtocolError(f"{name}.root: only a broadcast has a root")
    if message.kind == CollectiveKind.TOPK_ALL_REDUCE:
        if not 1 <= message.topk <= message.topk_chunk <= MAX_TOPK_CHUNK:
            raise RemoteProtocolError(
                f"{name}: a Top-k all_reduce keeps 1 to topk_chunk of every topk_chunk "
                f"(at most {MAX_TOPK_CHUNK}) entries, not {message.topk} of {message.topk_chunk}"
            )
        if message.topk_bits and (
            message.topk_bits not in TOPK_CODE_BITS or not message.quantization
            or message.quantized_dtype != UINT8_CODE
        ):
            raise RemoteProtocolError(
                f"{name}.topk_bits: {message.topk_bits}-bit codes, where packed codes are "
                f"{' or '.join(map(str, TOPK_CODE_BITS))} bits of uint8 codes"
            )
    elif message.topk or message.topk_chunk or message.topk_bits:
        raise RemoteProtocolError(f"{name}.topk: only a Top-k all_reduce keeps entries")
    if message.kind == CollectiveKind.ALL_GATHER and (
        message.quantization or message.op or getattr(message, "lease", False)
    ):
        raise RemoteProtocolError(
            f"{name}: an all_gather is neither quantized, reduced nor leased"
        )


def _describe(message: typing.Any) -> str:
    """A collective's descriptor in words, for error messages: the call, then what
    its peers must agree on."""
    if message.kind == CollectiveKind.BARRIER and not message.count:
        return "barrier()"
    if message.kind == CollectiveKind.BROADCAST:
        return (
            f"broadcast root={message.root} count={message.count} "
            f"dtype={DTYPE_NAMES[message.dtype]} slice_bytes={message.slice_bytes}"
        )
    if message.kind == CollectiveKind.ALL_GATHER:
        return (
            f"all_gather count={message.count} (its own) dtype={DTYPE_NAMES[message.dtype]} "
            f"slice_bytes={message.slice_bytes}"
        )
    text = (
        f"{COLLECTIVE_NAMES[message.kind]} count={message.count} "
        f"dtype={DTYPE_NAMES[message.dtype]} op={OP_NAMES[message.op]}"
    )
    if message.kind == CollectiveKind.TOPK_ALL_REDUCE:
        text += f" keeping {message.topk} of every {message.topk_chunk}"
        if message.topk_bits:
            text += f" as {message.topk_bits}-bit codes"
    if message.quantization:
        text += (
            f" quantization={QUANTIZATION_NAMES[message.quantization]}"
            f"->{DTYPE_NAMES[message.quantized_dtype]}"
        )
    if message.distribution_hint:
        text += f" distribution_hint={DISTRIBUTION_HINT_NAMES[message.distribution_hint]}"
    return text + f" slice_bytes={message.slice_bytes}"


@message(7, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveComplete(Message):
    """This peer is done with attempt ``seq`` of ``tag``; ``aborted``: it failed locally.

    ``invalid``, when not empty, says why this peer's data could not be reduced (e.g.
    NaN among values to quantize): the collective then fails for every peer as an
    invalid argument with that reason, instead of as an abort to retry.
    """

    tag: int
    seq: int
    aborted: bool
    invalid: str = ""  # non-empty implies aborted


@message(13, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LeaseReport(Message):
    """Where this peer stands with its lease on ``tag`` (the lease numbered from
    ``lease``): ``seq`` is the last attempt it started under it (0: none) and ``state``
    where that attempt is. Sent when an attempt under the lease fails, runs long, or the
    master asks (``LeaseEnd``); it ends the lease. The descriptor fields are the lease's
    (what every attempt under it reduces), ``invalid`` as in ``CollectiveComplete``."""

    tag: int
    lease: int
    seq: int
    state: int
    count: int
    dtype: int
    op: int
    quantized_dtype: int
    quantization: int
    distribution_hint: int
    slice_bytes: int
    invalid: str = ""
    kind: int = CollectiveKind.ALL_REDUCE
    root: int = 0
    topk: int = 0
    topk_chunk: int = 0
    topk_bits: int = 0

    def _validate(self) -> None:
        _check_descriptor(self, "LeaseReport")
        if self.state not in LEASE_STATES:
            raise RemoteProtocolError(f"LeaseReport.state: unknown state {self.state}")
        if not self.lease:
            raise RemoteProtocolError("LeaseReport.lease: 0 names no lease")
        if (self.seq == 0) != (self.state == LeaseState.NONE):
            raise RemoteProtocolError(
                f"LeaseReport: attempt {self.seq} with state {LeaseState(self.state).name}"
            )
        if self.seq and not 0 <= self.seq - self.lease < MAX_LEASE_SPAN:
            raise RemoteProtocolError(
                f"LeaseReport.seq: attempt {self.seq} is outside the lease from {self.lease}"
            )
        if self.invalid and self.state != LeaseState.FAILED:
            raise RemoteProtocolError("LeaseReport.invalid: only a failed attempt is invalid")

    def initiate(self) -> CollectiveInitiate:
        """The lease's descriptor, as the vote that would have asked for it."""
        return CollectiveInitiate(
            tag=self.tag, count=self.count, dtype=self.dtype, op=self.op,
            quantized_dtype=self.quantized_dtype, quantization=self.quantization,
            distribution_hint=self.distribution_hint, slice_bytes=self.slice_bytes, lease=True,
            kind=self.kind, root=self.root, topk=self.topk, topk_chunk=self.topk_chunk,
            topk_bits=self.topk_bits,
        )


@message(8, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateVote(Message):
    """Vote to synchronize the shared state: its revision, strategy and entries."""

    revision: int
    strategy: int
    entries: tuple[SharedStateEntry, ...]

    def _validate(self) -> None:
        if self.strategy >= len(STRATEGY_NAMES):
            raise RemoteProtocolError(f"SharedStateVote.strategy: unknown value {self.strategy}")
        _check_unique_keys((e.key for e in self.entries), "SharedStateVote.entries")


@message(9, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateDone(Message):
    """This peer's part of shared-state sync ``sync`` is over: it holds the state
    (``success``), or could not fetch it (``reason`` says why; its state is unchanged)."""

    sync: int
    success: bool
    reason: str = ""


@message(10, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VoteOptimizeTopology(Message):
    """Vote to measure the links not measured yet and re-order the rings by them."""


@message(11, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkMeasured(Message):
    """The link from peer ``sender`` to this peer, measured for ``optimization``:
    ``bandwidth`` bytes per second and ``latency`` seconds one way, or ``error`` (not
    empty) saying why it could not be measured."""

    optimization: int
    sender: int
    bandwidth: float = 0.0
    latency: float = 0.0
    error: str = ""

    def _validate(self) -> None:
        if not self.error and not (self.bandwidth > 0 and self.latency >= 0):
            raise RemoteProtocolError(
                f"LinkMeasured: bandwidth {self.bandwidth} and latency {self.latency} "
                "must be positive and non-negative (or an error given)"
            )


# --- master -> peer ---------------------------------------------------------------


@message(64, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Welcome(Message):
    """Registration accepted: the peer's id, the liveness timers to use, and whether
    its shared-state votes must carry content digests (``SharedStateEntry.digest``)."""

    peer_id: int
    heartbeat_interval: float
    liveness_timeout: float
    content_digest: bool = False

    def _validate(self) -> None:
        if not 0 < self.heartbeat_interval < self.liveness_timeout <= MAX_TIMER:
            raise RemoteProtocolError(
                f"Welcome: heartbeat interval {self.heartbeat_interval!r}s and liveness "
                f"timeout {self.liveness_timeout!r}s are not 0 < interval < timeout <= "
                f"{MAX_TIMER}s"
            )


@message(65, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Kick(Message):
    """The master is removing this peer; the connection closes after this frame."""

    reason: str


@message(66, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PInfo(Message):
    """Start of a p2p establishment round: whom to connect to."""

    round: int
    ring: tuple[int, ...]
    neighbours: tuple[PeerEndpoint, ...]
    world: WorldSizes


@message(67, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PEstablishResult(Message):
    """End of an establishment round, the same verdict for every participant.

    ``round`` 0 with ``error`` not empty: the peer's ``VoteEstablish`` was refused (the
    other members did not vote within the master's stall timeout); no round follows.
    ``stripes``: the most connections any pool of the ring has, which every member's
    all-reduces on this ring cut each step's data for (``_core.ring.striped_slice``).
    """

    round: int
    success: bool
    ring: tuple[int, ...]
    world: WorldSizes
    error: str = ""
    stripes: int = 1

    def _validate(self) -> None:
        check_pool_size(self.stripes, "P2PEstablishResult.stripes")


@message(68, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeersPendingResult(Message):
    """The answer to a pending-peers vote; ``error`` non-empty: the vote was refused."""

    pending: bool
    error: str = ""


@message(69, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCommence(Message):
    """Every peer of the group initiated ``tag`` alike: run it as attempt ``seq``.

    ``sizes``, of an all-gather only: the element count each member of ``ring`` voted
    for its own part, in ring order (the parts may differ in size)."""

    tag: int
    seq: int
    ring: tuple[int, ...]
    sizes: tuple[int, ...] = ()

    def _validate(self) -> None:
        if self.sizes and len(self.sizes) != len(self.ring):
            raise RemoteProtocolError(
                f"CollectiveCommence.sizes: {len(self.sizes)} sizes for a ring of "
                f"{len(self.ring)}"
            )
        if any(size >= 1 << 62 for size in self.sizes):
            raise RemoteProtocolError(f"CollectiveCommence.sizes: out of range ({self.sizes})")


@message(70, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveAbort(Message):
    """Stop attempt ``seq`` now (the verdict will say aborted); ``reason`` says why."""

    tag: int
    seq: int
    reason: str


@message(71, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveVerdict(Message):
    """The one final outcome of a collective for this peer (``seq`` 0: never ran).

    A success may grant the group a *lease* on the tag: its next attempts with the same
    descriptor, on the same ring, are numbered ``lease`` to ``lease_last`` in order,
    and run without asking the master (``allreduce.md``, "Leases").
    """

    tag: int
    seq: int
    outcome: int
    reason: str = ""
    lease: int = 0  # the first number of the lease granted (0: none)
    lease_last: int = 0  # its last number

    def _validate(self) -> None:
        if self.outcome not in OUTCOMES:
            raise RemoteProtocolError(f"CollectiveVerdict.outcome: unknown outcome {self.outcome}")
        if self.lease or self.lease_last:
            if self.outcome != Outcome.SUCCESS or not self.seq:
                raise RemoteProtocolError("CollectiveVerdict.lease: only a success grants a lease")
            if not 0 < self.lease <= self.lease_last < self.lease + MAX_LEASE_SPAN:
                raise RemoteProtocolError(
                    f"CollectiveVerdict.lease: {self.lease} to {self.lease_last} is not a "
                    f"range of 1 to {MAX_LEASE_SPAN} numbers"
                )


@message(72, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStatePlan(Message):
    """The outcome of a shared-state vote for this peer: after sync ``sync`` it holds
    ``revision``, once it fetched ``fetches`` from any of ``distributors`` (which hold
    the popular state). A distributor serves ``fetchers`` only, each only the tensors
    named there. ``error`` non-empty: the vote was refused, nothing happens.
    ``complete``: no member of the group fetches anything, so the sync is over with
    its plan: the peer sends no ``SharedStateDone`` and gets no ``SharedStateComplete``.
    """

    sync: int
    revision: int
    fetches: tuple[SharedStateFetch, ...]
    distributors: tuple[PeerEndpoint, ...]
    fetchers: tuple[SharedStateFetcher, ...] = ()
    error: str = ""
    complete: bool = False

    def _validate(self) -> None:
        _check_unique_keys((f.key for f in self.fetches), "SharedStatePlan.fetches")
        if self.complete and (self.fetches or self.fetchers or self.error):
            raise RemoteProtocolError(
                "SharedStatePlan.complete: a sync that is over with its plan has no fetches, "
                "no fetchers and no error"
            )


@message(73, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateComplete(Message):
    """Every peer of the group is done with sync ``sync``: distributors stop serving."""

    sync: int


@message(74, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeasureLink(Message):
    """Measure the link from ``source`` to this peer, pulling at most ``nbytes`` over
    one benchmark connection, and report it (``LinkMeasured``)."""

    optimization: int
    source: PeerEndpoint
    nbytes: int


@message(75, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TopologyOptimized(Message):
    """The end of ``optimization`` for this peer's group; an establishment round of the
    new ring follows. ``error`` not empty: the vote was refused, nothing follows.

    ``peers`` orders the rows and columns of the flattened ``bandwidth`` (bytes per
    second; 0: unknown) and ``latency`` (seconds) matrices, ``unreachable`` lists the
    flat indices of links that could not be measured; the matrices are left empty for
    groups larger than ``MATRIX_LIMIT``. ``ring`` is the solved ring, ``predicted_seconds``
    its predicted time for an all-reduce of ``reference_bytes`` (negative: unknown, some
    link of it unmeasured), and ``optimal`` whether no ring is predicted faster. A refusal
    with ``rejoin`` means other peers re-establish the ring (after an aborted all-reduce):
    the peer joins that round, then votes again.
    """

    optimization: int
    error: str = ""
    peers: tuple[int, ...] = ()
    bandwidth: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()
    unreachable: tuple[int, ...] = ()
    ring: tuple[int, ...] = ()
    predicted_seconds: float = -1.0
    reference_bytes: int = 0
    optimal: bool = False
    rejoin: bool = False  # refused because peers re-establish the ring: join, then vote again

    def _validate(self) -> None:
        n = len(self.peers)
        if len(set(self.peers)) != n:
            raise RemoteProtocolError("TopologyOptimized.peers: a peer appears twice")
        for name in ("bandwidth", "latency"):
            values = getattr(self, name)
            if values and len(values) != n * n:
                raise RemoteProtocolError(
                    f"TopologyOptimized.{name}: {len(values)} values for {n} peers"
                )
            if any(v < 0 for v in values):
                raise RemoteProtocolError(f"TopologyOptimized.{name}: a negative value")
        if any(i >= n * n for i in self.unreachable):
            raise RemoteProtocolError("TopologyOptimized.unreachable: index out of range")
        if self.ring and sorted(self.ring) != sorted(self.peers):
            raise RemoteProtocolError("TopologyOptimized.ring: not an order of the peers")


@message(76, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExpectBenchmark(Message):
    """Peer ``measurer`` measures the link from this peer to it in ``optimization``:
    serve it one benchmark connection of at most ``nbytes`` (sent before its
    ``MeasureLink``)."""

    optimization: int
    measurer: PeerEndpoint
    nbytes: int


@message(78, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LeaseEnd(Message):
    """The group's lease on ``tag`` (numbered from ``lease``) ends: take no attempt
    from it any more, and report where you stand (``LeaseReport``)."""

    tag: int
    lease: int
    reason: str
