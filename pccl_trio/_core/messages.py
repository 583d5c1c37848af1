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

Directions: ``C2M`` messages go from a peer to the master, ``M2C`` from the master to
a peer, ``P2P`` between peers. The master accepts only ``C2M`` kinds from peers; a peer
accepts only ``M2C`` kinds from the master.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import msgpack

from .errors import RemoteProtocolError

__all__ = [
    "BenchmarkRequest",
    "C2M",
    "CollectiveAbort",
    "CollectiveCommence",
    "CollectiveComplete",
    "CollectiveInitiate",
    "CollectiveVerdict",
    "M2C",
    "P2P",
    "PROTOCOL_VERSION",
    "Heartbeat",
    "Kick",
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
    "SharedStatePlan",
    "SharedStateRange",
    "SharedStateRequest",
    "SharedStateResponse",
    "SharedStateVote",
    "SyncStrategy",
    "TopologyOptimized",
    "VoteEstablish",
    "VoteOptimizeTopology",
    "VotePeersPending",
    "Welcome",
    "WorldSizes",
    "decode_message",
    "encode_message",
]

#: Bumped whenever the wire format or a message changes incompatibly.
PROTOCOL_VERSION = 4

#: Names by wire value; the public enums in ``pccl_trio._types`` use the same values
#: (a test holds them together).
DTYPE_NAMES = (
    "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64",
    "FLOAT16", "BFLOAT16", "FLOAT", "DOUBLE",
)
OP_NAMES = ("SUM", "AVG", "PROD", "MAX", "MIN")
QUANTIZATION_NAMES = ("NONE", "MIN_MAX", "ZERO_POINT_SCALE")
DISTRIBUTION_HINT_NAMES = ("NONE", "NORMAL", "UNIFORM")


class Outcome(enum.IntEnum):
    """``CollectiveVerdict.outcome``: how a collective ended, the same for every voter."""

    SUCCESS = 0
    ABORTED = 1  # a peer failed, left or voted otherwise: retry once the ring is re-established
    REJECTED = 2  # the peers disagree on the call, or a peer's data could not be reduced


class SyncStrategy(enum.IntEnum):
    """``SharedStateVote.strategy``: what a peer offers and accepts in a shared-state sync
    (the public ``SharedStateSyncStrategy`` uses the same values)."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


OUTCOMES = tuple(Outcome)
STRATEGY_NAMES = tuple(strategy.name for strategy in SyncStrategy)
#: The outcomes under their former module-level names (the peer still imports these).
SUCCESS, ABORTED, REJECTED = Outcome.SUCCESS, Outcome.ABORTED, Outcome.REJECTED
#: Most bytes one benchmark request may ask for.
MAX_BENCHMARK_BYTES = 1 << 30
#: Largest group whose link matrices ``TopologyOptimized`` carries.
MATRIX_LIMIT = 128
#: Longest shared-state key, in characters.
MAX_KEY = 1024

U16_MAX = (1 << 16) - 1
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
MAX_STRING = 4096
MAX_SEQUENCE = 1 << 16


def _check(value: Any, hint: Any, where: str) -> None:
    """Raise ``RemoteProtocolError`` unless ``value`` matches the type ``hint``."""
    origin = typing.get_origin(hint)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX
    elif hint is float:
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        )
    elif hint is str:
        ok = isinstance(value, str) and len(value) <= MAX_STRING
    elif hint is bytes:
        ok = isinstance(value, bytes) and len(value) <= MAX_STRING
    elif origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if not isinstance(value, tuple):
            raise RemoteProtocolError(f"{where}: expected a sequence, got {type(value).__name__}")
        if len(value) > MAX_SEQUENCE:
            raise RemoteProtocolError(
                f"{where}: {len(value)} items exceed the limit of {MAX_SEQUENCE}"
            )
        for index, item in enumerate(value):
            _check(item, item_hint, f"{where}[{index}]")
        return
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        ok = isinstance(value, hint)
    else:  # pragma: no cover - a message declared a field type this module can't check
        raise TypeError(f"{where}: unsupported field type {hint!r}")
    if not ok:
        raise RemoteProtocolError(f"{where}: invalid value {value!r:.80} for a field of type "
                                  f"{getattr(hint, '__name__', hint)}")


class _Record:
    """Mixin: type-check every field of a frozen dataclass after construction."""

    _HINTS: ClassVar[Mapping[str, Any]] = types.MappingProxyType({})

    def __post_init__(self) -> None:
        for name, hint in type(self)._HINTS.items():
            _check(getattr(self, name), hint, f"{type(self).__name__}.{name}")
        self._validate()

    def _validate(self) -> None:
        """Extra range checks beyond the field types; raise ``RemoteProtocolError``."""


class Message(_Record):
    """Base of all control messages."""

    KIND: ClassVar[int]
    DIRECTION: ClassVar[str]


C2M = "c2m"
M2C = "m2c"
P2P = "p2p"

_BY_KIND: dict[int, type[Message]] = {}
_R = TypeVar("_R", bound=type[_Record])


def _record(cls: _R) -> _R:
    hints = typing.get_type_hints(cls)
    cls._HINTS = types.MappingProxyType(
        {field.name: hints[field.name] for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    )
    return cls


def _message(kind: int, direction: str) -> typing.Callable[[_R], _R]:
    def register(cls: _R) -> _R:
        assert issubclass(cls, Message)
        assert kind not in _BY_KIND, f"message kind {kind} registered twice"
        cls.KIND = kind
        cls.DIRECTION = direction
        _BY_KIND[kind] = cls
        return _record(cls)

    return register


# --- nested records -------------------------------------------------------------


@_record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerEndpoint(_Record):
    """Where a peer accepts p2p connections."""

    peer_id: int
    host: str
    port: int

    def _validate(self) -> None:
        if not 1 <= self.port <= U16_MAX:
            raise RemoteProtocolError(f"PeerEndpoint.port: {self.port} is not a TCP port")


@_record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorldSizes(_Record):
    """The four world-size attributes of one peer's view of the run."""

    global_world_size: int
    peer_group_world_size: int
    num_distinct_peer_groups: int
    largest_peer_group_world_size: int


def _check_key(key: str, where: str) -> None:
    if not key or len(key) > MAX_KEY:
        raise RemoteProtocolError(f"{where}: a shared-state key has 1 to {MAX_KEY} characters")


@_record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateEntry(_Record):
    """One tensor of a peer's shared state, as it votes: what the master compares."""

    key: str
    hash: int
    dtype: int
    count: int
    allow_content_inequality: bool

    def _validate(self) -> None:
        _check_key(self.key, "SharedStateEntry.key")
        if self.dtype >= len(DTYPE_NAMES):
            raise RemoteProtocolError(f"SharedStateEntry.dtype: unknown value {self.dtype}")

    def describe(self) -> str:
        return f"{self.count} x {DTYPE_NAMES[self.dtype]}"


@_record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateFetch(_Record):
    """A tensor a peer must fetch, and the hash it must have (unless not ``verify``)."""

    key: str
    hash: int
    verify: bool

    def _validate(self) -> None:
        _check_key(self.key, "SharedStateFetch.key")


@_record
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateRange(_Record):
    """Bytes ``[offset, offset + nbytes)`` of one shared-state tensor."""

    key: str
    offset: int
    nbytes: int

    def _validate(self) -> None:
        _check_key(self.key, "SharedStateRange.key")


_NESTED: dict[type, type[_Record]] = {
    PeerEndpoint: PeerEndpoint,
    WorldSizes: WorldSizes,
    SharedStateEntry: SharedStateEntry,
    SharedStateFetch: SharedStateFetch,
    SharedStateRange: SharedStateRange,
}


def _check_unique_keys(keys: typing.Iterable[str], where: str) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise RemoteProtocolError(f"{where}: key {key!r} appears twice")
        seen.add(key)

# --- peer -> master ---------------------------------------------------------------


@_message(1, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Register(Message):
    """First message on a master link: join the run."""

    protocol_version: int
    peer_group: int
    p2p_port: int
    advertised_host: str = ""  # empty: use the address the master sees

    def _validate(self) -> None:
        if self.peer_group > U32_MAX:
            raise RemoteProtocolError(f"Register.peer_group: {self.peer_group} exceeds 2**32-1")
        if not 1 <= self.p2p_port <= U16_MAX:
            raise RemoteProtocolError(f"Register.p2p_port: {self.p2p_port} is not a TCP port")


@_message(2, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat(Message):
    """Sent both ways on a quiet master link so silence can be told from calm."""


@_message(3, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VoteEstablish(Message):
    """Vote to (re-)establish the ring; ``accept_new_peers`` also admits pending peers."""

    accept_new_peers: bool


@_message(4, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PEstablished(Message):
    """Report on connecting to the ring neighbours the master named in ``round``."""

    round: int
    success: bool
    failed_peers: tuple[int, ...] = ()


@_message(5, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VotePeersPending(Message):
    """Vote to learn whether peers are waiting to be accepted."""


@_message(6, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveInitiate(Message):
    """Vote to run all-reduce ``tag``; every peer of the group must describe it alike."""

    tag: int
    count: int
    dtype: int
    op: int
    quantized_dtype: int
    quantization: int
    distribution_hint: int = 0

    def _validate(self) -> None:
        for name, names in (
            ("dtype", DTYPE_NAMES), ("op", OP_NAMES), ("quantized_dtype", DTYPE_NAMES),
            ("quantization", QUANTIZATION_NAMES), ("distribution_hint", DISTRIBUTION_HINT_NAMES),
        ):
            value = getattr(self, name)
            if value >= len(names):
                raise RemoteProtocolError(f"CollectiveInitiate.{name}: unknown value {value}")

    def describe(self) -> str:
        """The descriptor in words, for error messages."""
        text = (
            f"count={self.count} dtype={DTYPE_NAMES[self.dtype]} op={OP_NAMES[self.op]}"
        )
        if self.quantization:
            text += (
                f" quantization={QUANTIZATION_NAMES[self.quantization]}"
                f"->{DTYPE_NAMES[self.quantized_dtype]}"
            )
        if self.distribution_hint:
            text += f" distribution_hint={DISTRIBUTION_HINT_NAMES[self.distribution_hint]}"
        return text


@_message(7, C2M)
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


@_message(8, C2M)
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


@_message(9, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateDone(Message):
    """This peer's part of shared-state sync ``sync`` is over: it holds the state
    (``success``), or could not fetch it (``reason`` says why; its state is unchanged)."""

    sync: int
    success: bool
    reason: str = ""


@_message(10, C2M)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VoteOptimizeTopology(Message):
    """Vote to measure the links not measured yet and re-order the rings by them."""


@_message(11, C2M)
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


@_message(64, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Welcome(Message):
    """Registration accepted: the peer's id and the liveness timers to use."""

    peer_id: int
    heartbeat_interval: float
    liveness_timeout: float


@_message(65, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Kick(Message):
    """The master is removing this peer; the connection closes after this frame."""

    reason: str


@_message(66, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PInfo(Message):
    """Start of a p2p establishment round: whom to connect to."""

    round: int
    ring: tuple[int, ...]
    neighbours: tuple[PeerEndpoint, ...]
    world: WorldSizes


@_message(67, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PEstablishResult(Message):
    """End of an establishment round, the same verdict for every participant."""

    round: int
    success: bool
    ring: tuple[int, ...]
    world: WorldSizes


@_message(68, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeersPendingResult(Message):
    """The answer to a pending-peers vote; ``error`` non-empty: the vote was refused."""

    pending: bool
    error: str = ""


@_message(69, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCommence(Message):
    """Every peer of the group initiated ``tag`` alike: run it as attempt ``seq``."""

    tag: int
    seq: int
    ring: tuple[int, ...]


@_message(70, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveAbort(Message):
    """Stop attempt ``seq`` now (the verdict will say aborted); ``reason`` says why."""

    tag: int
    seq: int
    reason: str


@_message(71, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveVerdict(Message):
    """The one final outcome of a collective for this peer (``seq`` 0: never ran)."""

    tag: int
    seq: int
    outcome: int
    reason: str = ""

    def _validate(self) -> None:
        if self.outcome not in OUTCOMES:
            raise RemoteProtocolError(f"CollectiveVerdict.outcome: unknown outcome {self.outcome}")


@_message(72, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStatePlan(Message):
    """The outcome of a shared-state vote for this peer: after sync ``sync`` it holds
    ``revision``, once it fetched ``fetches`` from any of ``distributors`` (which hold
    the popular state). ``error`` non-empty: the vote was refused, nothing happens."""

    sync: int
    revision: int
    fetches: tuple[SharedStateFetch, ...]
    distributors: tuple[PeerEndpoint, ...]
    error: str = ""

    def _validate(self) -> None:
        _check_unique_keys((f.key for f in self.fetches), "SharedStatePlan.fetches")


@_message(73, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateComplete(Message):
    """Every peer of the group is done with sync ``sync``: distributors stop serving."""

    sync: int


@_message(74, M2C)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeasureLink(Message):
    """Measure the link from ``source`` to this peer and report it (``LinkMeasured``)."""

    optimization: int
    source: PeerEndpoint


@_message(75, M2C)
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


# --- peer <-> peer ----------------------------------------------------------------


@_message(128, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PHello(Message):
    """First frame of a p2p connection: who connects, and into which pool slot."""

    protocol_version: int
    peer_id: int
    slot: int


@_message(129, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class P2PHelloAck(Message):
    """The listener stored the connection; data may flow."""


@_message(130, P2P)
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


@_message(131, P2P)
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateResponse(Message):
    """The answer to a request: ``error`` empty means the ranges follow as data frames,
    in the order asked (header: the range's index, the sync, its offset, the length)."""

    error: str = ""


@_message(132, P2P)
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


# --- codec ------------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    if isinstance(value, _Record):
        return [_to_wire(getattr(value, name)) for name in type(value)._HINTS]
    if isinstance(value, tuple):
        return [_to_wire(item) for item in value]
    return value


def _from_wire(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise RemoteProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        (item_hint, _ellipsis) = typing.get_args(hint)
        return tuple(_from_wire(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(hint, type) and hint in _NESTED:
        return _build(hint, value, where)
    return value


def _build(cls: type[_Record], fields: Any, where: str) -> Any:
    hints = cls._HINTS
    if not isinstance(fields, list) or len(fields) != len(hints):
        raise RemoteProtocolError(
            f"{where}: expected {len(hints)} fields, got "
            f"{len(fields) if isinstance(fields, list) else type(fields).__name__}"
        )
    kwargs = {
        name: _from_wire(value, hint, f"{where}.{name}")
        for (name, hint), value in zip(hints.items(), fields, strict=True)
    }
    try:
        return cls(**kwargs)
    except RemoteProtocolError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - defensive
        raise RemoteProtocolError(f"{where}: {exc}") from exc


def encode_message(message: Message) -> bytes:
    """Encode the fields of ``message`` (its kind travels in the frame header)."""
    return msgpack.packb(_to_wire(message), use_bin_type=True)  # type: ignore[no-any-return]


def decode_message(kind: int, payload: bytes | memoryview) -> Message:
    """Decode and validate one control message.

    Raises:
        RemoteProtocolError: unknown kind, undecodable msgpack, or invalid fields.
    """
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise RemoteProtocolError(f"unknown message kind {kind}")
    try:
        fields = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise RemoteProtocolError(f"{cls.__name__}: undecodable payload ({exc})") from exc
    message: Message = _build(cls, fields, cls.__name__)
    return message


def message_kinds() -> Mapping[int, type[Message]]:
    """Every registered message class by kind (for tests and docs)."""
    return types.MappingProxyType(_BY_KIND)
