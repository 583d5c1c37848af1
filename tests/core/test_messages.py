"""Message records: validation at construction and on decode, errors that name the field."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.messages import (
    C2M,
    DISTRIBUTION_HINT_NAMES,
    DTYPE_NAMES,
    M2C,
    MAX_LEASE_SPAN,
    MAX_PENDING_WAIT,
    MAX_POOL_SIZE,
    MAX_TIMER,
    OP_NAMES,
    OUTCOMES,
    P2P,
    QUANTIZATION_NAMES,
    STRATEGY_NAMES,
    BenchmarkRequest,
    CollectiveCommence,
    CollectiveInitiate,
    CollectiveKind,
    CollectiveVerdict,
    ExpectBenchmark,
    Heartbeat,
    Kick,
    LeaseReport,
    LeaseState,
    LinkMeasured,
    MeasureLink,
    Message,
    Outcome,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    Register,
    SharedStateEntry,
    SharedStateFetch,
    SharedStatePlan,
    SharedStateRange,
    SharedStateRequest,
    SharedStateVote,
    TensorSpan,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
    Welcome,
    WorldSizes,
    decode_message,
    encode_message,
    message_kinds,
)
from pccl_trio._core.records import MAX_SEQUENCE, MAX_STRING, U16_MAX, U32_MAX, U64_MAX

from .support import DETERMINISTIC, NEIGHBOURS, SAMPLES, WORLD, wire_fields


def decode(cls: type[Message], fields: Any) -> Message:
    """Decode ``fields`` (anything msgpack can pack) as a message of class ``cls``."""
    return decode_message(cls.KIND, msgpack.packb(fields, use_bin_type=True))


def replaced(message: Message, path: tuple[int, ...], value: Any) -> Any:
    """The wire fields of ``message`` with the item at ``path`` replaced by ``value``."""
    fields = wire_fields(message)
    target = fields
    for index in path[:-1]:
        target = target[index]
    target[path[-1]] = value
    return fields


# --- construction ---------------------------------------------------------------------

INVALID_RECORDS: list[tuple[type[Any], dict[str, Any], str]] = [
    (VoteEstablish, {"accept_new_peers": 1}, "VoteEstablish.accept_new_peers"),
    (VoteEstablish, {"accept_new_peers": None}, "VoteEstablish.accept_new_peers"),
    (P2PEstablished, {"round": True, "success": True}, "P2PEstablished.round"),
    (P2PEstablished, {"round": -1, "success": True}, "P2PEstablished.round"),
    (P2PEstablished, {"round": U64_MAX + 1, "success": True}, "P2PEstablished.round"),
    (P2PEstablished, {"round": 1.0, "success": True}, "P2PEstablished.round"),
    (P2PEstablished, {"round": "1", "success": True}, "P2PEstablished.round"),
    (P2PEstablished, {"round": 1, "success": True, "failed_peers": [2]},
     "P2PEstablished.failed_peers"),
    (P2PEstablished, {"round": 1, "success": True, "failed_peers": (2, -3)},
     r"P2PEstablished.failed_peers\[1\]"),
    (P2PEstablished, {"round": 1, "success": True, "failed_peers": (False,)},
     r"P2PEstablished.failed_peers\[0\]"),
    (P2PEstablished, {"round": 1, "success": True,
                      "failed_peers": tuple(range(MAX_SEQUENCE + 1))},
     "P2PEstablished.failed_peers"),
    (Kick, {"reason": "x" * (MAX_STRING + 1)}, "Kick.reason"),
    (Kick, {"reason": b"bytes"}, "Kick.reason"),
    (Welcome, {"peer_id": 1, "heartbeat_interval": math.nan, "liveness_timeout": 2.0},
     "Welcome.heartbeat_interval"),
    (Welcome, {"peer_id": 1, "heartbeat_interval": 1.0, "liveness_timeout": math.inf},
     "Welcome.liveness_timeout"),
    (Welcome, {"peer_id": 1, "heartbeat_interval": -math.inf, "liveness_timeout": 2.0},
     "Welcome.heartbeat_interval"),
    (Welcome, {"peer_id": 1, "heartbeat_interval": True, "liveness_timeout": 2.0},
     "Welcome.heartbeat_interval"),
    (Welcome, {"peer_id": 1, "heartbeat_interval": "1", "liveness_timeout": 2.0},
     "Welcome.heartbeat_interval"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 0}, "Register.p2p_port"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": U16_MAX + 1},
     "Register.p2p_port"),
    (Register, {"protocol_version": 1, "peer_group": U32_MAX + 1, "p2p_port": 1},
     "Register.peer_group"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "advertised_host": None},
     "Register.advertised_host"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "pool_size": 0},
     "Register.pool_size: 0 is not in 1..1024"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1,
                "pool_size": MAX_POOL_SIZE + 1}, "Register.pool_size: 1025"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "successor": 4},
     "Register: ring neighbours, revision or numbers without a peer id to rejoin as"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "rejoin": 3,
                "high_water": (1 << 48) + 1}, "Register.high_water: .* exceeds 2\\*\\*48"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "rejoin": 3,
                "predecessor_gone": True}, "predecessor_gone without a predecessor"),
    (Register, {"protocol_version": 1, "peer_group": 0, "p2p_port": 1, "predecessor_gone": True},
     "Register: ring neighbours, revision or numbers without a peer id to rejoin as"),
    (PeerEndpoint, {"peer_id": 1, "host": "h", "port": 0}, "PeerEndpoint.port"),
    (PeerEndpoint, {"peer_id": 1, "host": "h", "port": 1, "pool_size": 0},
     "PeerEndpoint.pool_size"),
    (PeerEndpoint, {"peer_id": 1, "host": "h", "port": U16_MAX + 1}, "PeerEndpoint.port"),
    (WorldSizes, {"global_world_size": -1, "peer_group_world_size": 1,
                  "num_distinct_peer_groups": 1, "largest_peer_group_world_size": 1},
     "WorldSizes.global_world_size"),
    (P2PInfo, {"round": 1, "ring": [1], "neighbours": (), "world": WORLD}, "P2PInfo.ring"),
    (P2PInfo, {"round": 1, "ring": (1,), "neighbours": ({"peer_id": 2},), "world": WORLD},
     r"P2PInfo.neighbours\[0\]"),
    (P2PInfo, {"round": 1, "ring": (1,), "neighbours": (), "world": (1, 1, 1, 1)},
     "P2PInfo.world"),
    (P2PEstablishResult, {"round": 1, "success": 1, "ring": (), "world": WORLD},
     "P2PEstablishResult.success"),
    (P2PEstablishResult, {"round": 1, "success": True, "ring": (), "world": WORLD, "stripes": 0},
     "P2PEstablishResult.stripes: 0 is not in"),
    (PeersPendingResult, {"pending": "yes"}, "PeersPendingResult.pending"),
    # A measurement without an error needs a positive rate and a non-negative latency.
    (LinkMeasured, {"optimization": 1, "sender": 2}, "LinkMeasured: bandwidth 0"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": 0.0, "latency": 1e-3},
     "LinkMeasured: bandwidth 0"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": -5e6, "latency": 1e-3},
     "LinkMeasured: bandwidth -5000000"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": 5e6, "latency": -1e-3},
     "LinkMeasured: bandwidth .* latency -0.001"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": math.inf}, "LinkMeasured.bandwidth"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": math.nan}, "LinkMeasured.bandwidth"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "bandwidth": 1.0, "latency": math.inf},
     "LinkMeasured.latency"),
    (LinkMeasured, {"optimization": 1, "sender": -2, "bandwidth": 1.0}, "LinkMeasured.sender"),
    (LinkMeasured, {"optimization": 1, "sender": 2, "error": None}, "LinkMeasured.error"),
    (MeasureLink, {"optimization": 1, "source": (2, "h", 1), "nbytes": 1}, "MeasureLink.source"),
    (MeasureLink, {"optimization": True, "source": NEIGHBOURS[0], "nbytes": 1},
     "MeasureLink.optimization"),
    (MeasureLink, {"optimization": 1, "source": NEIGHBOURS[0], "nbytes": -1}, "MeasureLink.nbytes"),
    (ExpectBenchmark, {"optimization": 1, "measurer": None, "nbytes": 1},
     "ExpectBenchmark.measurer"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2), "bandwidth": (0.0, 1.0, 1.0)},
     "TopologyOptimized.bandwidth: 3 values for 2 peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2), "latency": (0.0,) * 5},
     "TopologyOptimized.latency: 5 values for 2 peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (), "bandwidth": (0.0,)},
     "TopologyOptimized.bandwidth: 1 values for 0 peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2), "bandwidth": (0.0, 1.0, -1.0, 0.0)},
     "TopologyOptimized.bandwidth: a negative value"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2), "latency": (0.0, -1e-3, 0.0, 0.0)},
     "TopologyOptimized.latency: a negative value"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2, 1)},
     "TopologyOptimized.peers: a peer appears twice"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2, 3), "ring": (1, 2)},
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2, 3), "ring": (1, 2, 2)},
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2, 3), "ring": (1, 2, 4)},
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2, 3), "ring": (1, 2, 3, 1)},
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, {"optimization": 1, "peers": (1, 2), "unreachable": (1, 4)},
     "TopologyOptimized.unreachable: index out of range"),
    (TopologyOptimized, {"optimization": 1, "unreachable": (0,)},
     "TopologyOptimized.unreachable: index out of range"),
    (TopologyOptimized, {"optimization": 1, "predicted_seconds": math.nan},
     "TopologyOptimized.predicted_seconds"),
    (TopologyOptimized, {"optimization": 1, "optimal": 1}, "TopologyOptimized.optimal"),
]


@pytest.mark.parametrize(("cls", "kwargs", "match"), INVALID_RECORDS,
                         ids=[f"{cls.__name__}-{i}" for i, (cls, _, _) in enumerate(INVALID_RECORDS)])
def test_invalid_record_cannot_be_built(cls: type[Any], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    "record",
    [
        P2PEstablished(round=U64_MAX, success=True, failed_peers=tuple(range(MAX_SEQUENCE))),
        Kick(reason="é" * MAX_STRING),  # the limit counts characters, not bytes
        Register(protocol_version=0, peer_group=U32_MAX, p2p_port=U16_MAX),
        Register(protocol_version=0, peer_group=0, p2p_port=1),
        Register(protocol_version=0, peer_group=0, p2p_port=1, pool_size=MAX_POOL_SIZE),
        Welcome(peer_id=0, heartbeat_interval=1, liveness_timeout=2.5),  # an int is a float
        PeerEndpoint(peer_id=0, host="", port=1),
        P2PInfo(round=0, ring=(), neighbours=(), world=WORLD),
        # An error needs no measurement; a latency of 0 is one.
        LinkMeasured(optimization=1, sender=2, error="unreachable"),
        LinkMeasured(optimization=1, sender=2, bandwidth=5e-324, latency=0.0),
        LinkMeasured(optimization=1, sender=2, bandwidth=1, latency=0),  # ints are floats
        # The refusal of a vote: nothing but the error.
        TopologyOptimized(optimization=0, error="refused"),
        # A group too large for the matrices: peers and ring only.
        TopologyOptimized(optimization=3, peers=(4, 2, 9), ring=(9, 4, 2), predicted_seconds=-1.0),
        TopologyOptimized(optimization=3, peers=(4, 2), bandwidth=(0.0,) * 4, latency=(0.0,) * 4,
                          unreachable=(3, 1), ring=(2, 4)),
    ],
    ids=["max-ints-and-sequence", "max-string", "max-port-and-group", "min-port", "int-as-float",
         "max-pool", "empty-host", "empty-ring", "measurement-error", "tiny-rate", "int-rate",
         "refused-optimization", "report-without-matrices", "report-with-matrices"],
)
def test_boundary_values_are_valid_and_round_trip(record: Any) -> None:
    if isinstance(record, Message):
        assert decode_message(record.KIND, encode_message(record)) == record


def test_defaults() -> None:
    assert Register(protocol_version=1, peer_group=0, p2p_port=1).advertised_host == ""
    assert Register(protocol_version=1, peer_group=0, p2p_port=1).pool_size == 1
    assert PeerEndpoint(peer_id=1, host="h", port=1).pool_size == 1
    assert SharedStatePlan(sync=1, revision=0, fetches=(), distributors=()).fetchers == ()
    assert P2PEstablished(round=1, success=True).failed_peers == ()
    assert Welcome(peer_id=1, heartbeat_interval=1, liveness_timeout=2).content_digest is False
    assert SharedStateEntry(key="k", hash=0, dtype=0, count=0,
                            allow_content_inequality=False).digest == b""
    assert SharedStateFetch(key="k", hash=0, verify=True).digest == b""


def test_records_are_frozen_and_keyword_only() -> None:
    kick = Kick(reason="kicked")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kick.reason = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Kick("positional")  # type: ignore[call-arg]


def test_kinds_are_grouped_by_direction() -> None:
    ranges = {C2M: range(1, 64), M2C: range(64, 128), P2P: range(128, 192)}
    for kind, cls in message_kinds().items():
        assert cls.KIND == kind
        assert kind in ranges[cls.DIRECTION], cls.__name__


def test_message_kinds_is_read_only() -> None:
    with pytest.raises(TypeError):
        message_kinds()[999] = Kick  # type: ignore[index]


# --- decoding -------------------------------------------------------------------------

INVALID_WIRE: list[tuple[type[Message], Any, str]] = [
    # wrong field count or shape
    (Register, wire_fields(SAMPLES[Register])[:-1], "Register: expected 13 fields, got 12"),
    (Register, [*wire_fields(SAMPLES[Register]), 0], "Register: expected 13 fields, got 14"),
    # Maps are refused by msgpack itself, before any object is built.
    (Register, {"protocol_version": 1}, "Register: undecodable payload .*max_map_len"),
    (Register, 5, "Register: expected 13 fields, got int"),
    (Heartbeat, [1], "Heartbeat: expected 0 fields, got 1"),
    (VoteEstablish, None, "VoteEstablish: expected 1 fields, got NoneType"),
    # wrong types and ranges
    (Register, replaced(SAMPLES[Register], (0,), True), "Register.protocol_version"),
    (Register, replaced(SAMPLES[Register], (0,), -1), "Register.protocol_version"),
    (Register, replaced(SAMPLES[Register], (0,), 1.0), "Register.protocol_version"),
    (Register, replaced(SAMPLES[Register], (1,), U32_MAX + 1), "Register.peer_group"),
    (Register, replaced(SAMPLES[Register], (2,), 0), "Register.p2p_port"),
    (Register, replaced(SAMPLES[Register], (2,), U16_MAX + 1), "Register.p2p_port"),
    (Register, replaced(SAMPLES[Register], (3,), b"10.0.0.1"), "Register.advertised_host"),
    (Register, replaced(SAMPLES[Register], (3,), "h" * (MAX_STRING + 1)),
     "Register.advertised_host"),
    (Register, replaced(SAMPLES[Register], (4,), 0), "Register.pool_size"),
    (Kick, ["x" * (MAX_STRING + 1)], "Kick.reason"),
    (VoteEstablish, [1], "VoteEstablish.accept_new_peers"),
    (VoteEstablish, ["true"], "VoteEstablish.accept_new_peers"),
    (Welcome, [1, math.nan, 2.0, False], "Welcome.heartbeat_interval"),
    (Welcome, [1, 1.0, math.inf, False], "Welcome.liveness_timeout"),
    (Welcome, [1, -math.inf, 2.0, False], "Welcome.heartbeat_interval"),
    (Welcome, [1, None, 2.0, False], "Welcome.heartbeat_interval"),
    # A master (or an impostor) could make peers spin on heartbeats or never time out.
    (Welcome, [1, 0.0, 2.0, False], r"Welcome: heartbeat interval 0.0s .* not 0 < interval"),
    (Welcome, [1, 3.0, 2.0, False], r"not 0 < interval < timeout"),
    (Welcome, [1, 1.0, 1e9, False], r"timeout <= 3600.0s"),
    (P2PEstablished, [1, True, {"2": 2}, 0], "P2PEstablished: undecodable payload .*max_map_len"),
    (P2PEstablished, [1, True, [2, None], 0], r"P2PEstablished.failed_peers\[1\]"),
    (P2PEstablished, [1, True, [], MAX_POOL_SIZE + 1], r"P2PEstablished.pool: 1025 is not in"),
    (P2PEstablished, [1, True, list(range(MAX_SEQUENCE + 1)), 0],
     r"P2PEstablished: undecodable payload \(65537 exceeds max_array_len"),
    # nested records
    (P2PInfo, replaced(SAMPLES[P2PInfo], (1,), 5), "P2PInfo.ring: expected an array"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (1, 1), "2"), r"P2PInfo.ring\[1\]"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (2, 1), [5, "h"]),
     r"P2PInfo.neighbours\[1\]: expected 5 fields, got 2"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (2, 0), "peer"),
     r"P2PInfo.neighbours\[0\]: expected 5 fields, got str"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (2, 0, 2), 0), "PeerEndpoint.port"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (2, 0, 1), 7), "PeerEndpoint.host"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (2, 0, 3), MAX_POOL_SIZE + 1), "PeerEndpoint.pool_size"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (3,), [4, 3, 2]),
     "P2PInfo.world: expected 4 fields, got 3"),
    (P2PInfo, replaced(SAMPLES[P2PInfo], (3, 3), -3), "WorldSizes.largest_peer_group_world_size"),
    (P2PEstablishResult, replaced(SAMPLES[P2PEstablishResult], (3,), None),
     "P2PEstablishResult.world: expected 4 fields, got NoneType"),
    # topology optimization
    (LinkMeasured, [1, 2, 0.0, 0.0, ""], "LinkMeasured: bandwidth 0"),
    (LinkMeasured, [1, 2, -1.0, 0.0, ""], "LinkMeasured: bandwidth -1"),
    (LinkMeasured, [1, 2, 1e6, -1.0, ""], "LinkMeasured: bandwidth .* latency -1"),
    (LinkMeasured, replaced(SAMPLES[LinkMeasured], (2,), math.inf), "LinkMeasured.bandwidth"),
    (LinkMeasured, replaced(SAMPLES[LinkMeasured], (1,), "5"), "LinkMeasured.sender"),
    (LinkMeasured, wire_fields(SAMPLES[LinkMeasured])[:-1], "LinkMeasured: expected 5 fields, got 4"),
    (MeasureLink, replaced(SAMPLES[MeasureLink], (1, 2), 0), "PeerEndpoint.port"),
    (MeasureLink, replaced(SAMPLES[MeasureLink], (1,), None),
     "MeasureLink.source: expected 5 fields, got NoneType"),
    (ExpectBenchmark, replaced(SAMPLES[ExpectBenchmark], (2,), "1"), "ExpectBenchmark.nbytes"),
    (SharedStatePlan, replaced(SAMPLES[SharedStatePlan], (4, 0, 3, 1), [2, 0]),
     "TensorSpan.count: must be at least 1"),
    (SharedStatePlan, replaced(SAMPLES[SharedStatePlan], (4, 0, 2), b"\x01" * 31),
     "SharedStateFetcher.identity: a node identity has 32 bytes"),
    (SharedStatePlan, replaced(SAMPLES[SharedStatePlan], (3, 1, 4), b"\x01" * 33),
     "PeerEndpoint.identity: a node identity has 32 bytes"),
    # content digests: none, or exactly 32 bytes
    (SharedStatePlan, replaced(SAMPLES[SharedStatePlan], (2, 0, 3), b"\x01" * 31),
     "SharedStateFetch.digest: a content digest has 32 bytes .*got 31"),
    (SharedStatePlan, replaced(SAMPLES[SharedStatePlan], (2, 0, 3), "digest"),
     "SharedStateFetch.digest: invalid value 'digest'"),
    (SharedStateVote, replaced(SAMPLES[SharedStateVote], (2, 0, 5), b"\x01" * 33),
     "SharedStateEntry.digest: a content digest has 32 bytes .*got 33"),
    (SharedStateVote, replaced(SAMPLES[SharedStateVote], (2, 1, 5), b"\x01"),
     "SharedStateEntry.digest: a content digest has 32 bytes .*got 1"),
    (SharedStateVote, wire_fields(SAMPLES[SharedStateVote])[:2] + [[["w", 1, 10, 4, False]]],
     r"SharedStateVote.entries\[0\]: expected 6 fields, got 5"),
    (Welcome, replaced(SAMPLES[Welcome], (3,), 1), "Welcome.content_digest"),
    (Welcome, wire_fields(SAMPLES[Welcome])[:3], "Welcome: expected 4 fields, got 3"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (2,), [1, 2, 2]),
     "TopologyOptimized.peers: a peer appears twice"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (3,), [0.0] * 8),
     "TopologyOptimized.bandwidth: 8 values for 3 peers"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (4,), [0.0] * 10),
     "TopologyOptimized.latency: 10 values for 3 peers"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (4, 1), -0.5),
     "TopologyOptimized.latency: a negative value"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (5,), [9]),
     "TopologyOptimized.unreachable: index out of range"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (6,), [2, 1]),
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (6,), [2, 1, 7]),
     "TopologyOptimized.ring: not an order of the peers"),
    (TopologyOptimized, replaced(SAMPLES[TopologyOptimized], (7,), math.inf),
     "TopologyOptimized.predicted_seconds"),
]


@pytest.mark.parametrize(("cls", "fields", "match"), INVALID_WIRE,
                         ids=[f"{cls.__name__}-{i}" for i, (cls, _, _) in enumerate(INVALID_WIRE)])
def test_invalid_fields_on_the_wire(cls: type[Message], fields: Any, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        decode(cls, fields)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.packb([True]) + b"\x00", b"\x92\x01"],
    ids=["empty", "reserved-byte", "trailing-bytes", "truncated-array"],
)
def test_undecodable_payload(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="VoteEstablish: undecodable payload"):
        decode_message(VoteEstablish.KIND, payload)


@pytest.mark.parametrize("kind", [0, 30, 63, 127, 200, 0xFFFF])
def test_unknown_kind(kind: int) -> None:
    with pytest.raises(RemoteProtocolError, match=f"unknown message kind {kind}"):
        decode_message(kind, msgpack.packb([]))


def test_decode_accepts_a_memoryview() -> None:
    payload = encode_message(SAMPLES[P2PInfo])
    assert decode_message(P2PInfo.KIND, memoryview(payload)) == SAMPLES[P2PInfo]


# --- properties -----------------------------------------------------------------------

#: Fields whose valid range is narrower than their type's.
NARROWER: dict[tuple[type[Any], str], st.SearchStrategy[Any]] = {
    (Register, "peer_group"): st.integers(0, U32_MAX),
    (Register, "p2p_port"): st.integers(1, U16_MAX),
    (Register, "pool_size"): st.integers(1, MAX_POOL_SIZE),
    (PeerEndpoint, "port"): st.integers(1, U16_MAX),
    (PeerEndpoint, "pool_size"): st.integers(1, MAX_POOL_SIZE),
    (P2PEstablished, "pool"): st.integers(0, MAX_POOL_SIZE),
    (P2PEstablishResult, "stripes"): st.integers(1, MAX_POOL_SIZE),
    # A complete plan has nothing to fetch or serve: built by the flows, not drawn.
    (SharedStatePlan, "complete"): st.just(False),
    (TensorSpan, "count"): st.integers(1, U64_MAX),
    (CollectiveInitiate, "dtype"): st.integers(0, len(DTYPE_NAMES) - 1),
    (CollectiveInitiate, "quantized_dtype"): st.integers(0, len(DTYPE_NAMES) - 1),
    (CollectiveInitiate, "op"): st.integers(0, len(OP_NAMES) - 1),
    (CollectiveInitiate, "quantization"): st.integers(0, len(QUANTIZATION_NAMES) - 1),
    (CollectiveInitiate, "distribution_hint"): st.integers(0, len(DISTRIBUTION_HINT_NAMES) - 1),
    # A barrier carries no data: drawn fields would mostly make one invalid (see
    # ``test_a_barrier_vote_carries_no_data``).
    (CollectiveInitiate, "kind"): st.just(CollectiveKind.ALL_REDUCE),
    (CollectiveInitiate, "root"): st.just(0),  # only a broadcast has one
    # Only a Top-k all-reduce keeps entries: see ``test_a_topk_vote_names_what_it_keeps``.
    (CollectiveInitiate, "topk"): st.just(0),
    (CollectiveInitiate, "topk_chunk"): st.just(0),
    (CollectiveInitiate, "topk_bits"): st.just(0),
    (LeaseReport, "topk"): st.just(0),
    (LeaseReport, "topk_chunk"): st.just(0),
    (LeaseReport, "topk_bits"): st.just(0),
    # One size per ring member: see ``test_an_all_gather_vote_is_plain``.
    (CollectiveCommence, "sizes"): st.just(()),
    (CollectiveVerdict, "outcome"): st.sampled_from(OUTCOMES),
    (SharedStateEntry, "key"): st.text(min_size=1, max_size=30),
    (SharedStateEntry, "dtype"): st.integers(0, len(DTYPE_NAMES) - 1),
    (SharedStateFetch, "key"): st.text(min_size=1, max_size=30),
    (SharedStateRange, "key"): st.text(min_size=1, max_size=30),
    (SharedStateRequest, "frame_bytes"): st.integers(1, U64_MAX),
    (BenchmarkRequest, "frame_bytes"): st.integers(1, U64_MAX),
    (BenchmarkRequest, "nbytes"): st.integers(1, 1 << 30),
    (SharedStateVote, "strategy"): st.integers(0, len(STRATEGY_NAMES) - 1),
    (VotePeersPending, "wait"): st.floats(0, MAX_PENDING_WAIT),
    (SharedStateVote, "entries"): st.deferred(
        lambda: st.lists(records(SharedStateEntry), max_size=5, unique_by=lambda e: e.key)
    ).map(tuple),
    (SharedStatePlan, "fetches"): st.deferred(
        lambda: st.lists(records(SharedStateFetch), max_size=5, unique_by=lambda f: f.key)
    ).map(tuple),
}


@st.composite
def link_measurements(draw: st.DrawFn) -> LinkMeasured:
    """A measurement (positive rate, non-negative latency) or an error (any numbers)."""
    error = draw(st.text(max_size=30), label="error")
    finite = st.floats(allow_nan=False, allow_infinity=False)
    if error:
        bandwidth, latency = draw(finite), draw(finite)
    else:
        bandwidth = draw(st.floats(min_value=0.0, exclude_min=True, allow_infinity=False)
                         | st.integers(1, 1 << 40))
        latency = draw(st.floats(min_value=0.0, allow_infinity=False) | st.integers(0, 1000))
    return LinkMeasured(
        optimization=draw(valid(int)), sender=draw(valid(int)), bandwidth=bandwidth,
        latency=latency, error=error,
    )


@st.composite
def topology_reports(draw: st.DrawFn) -> TopologyOptimized:
    """Distinct peers; matrices of n * n non-negative values or none; unreachable flat
    indices in range; a ring that orders the peers, or none."""
    peers = draw(st.lists(st.integers(0, U64_MAX), unique=True, max_size=4), label="peers")
    n = len(peers)
    matrix = st.lists(st.floats(min_value=0.0, allow_infinity=False) | st.integers(0, 1 << 40),
                      min_size=n * n, max_size=n * n).map(tuple)
    return TopologyOptimized(
        optimization=draw(valid(int)),
        error=draw(valid(str)),
        peers=tuple(peers),
        bandwidth=draw(st.just(()) | matrix),
        latency=draw(st.just(()) | matrix),
        unreachable=tuple(draw(st.lists(st.integers(0, n * n - 1), max_size=4)) if n else ()),
        ring=draw(st.just(()) | st.permutations(peers).map(tuple)),
        predicted_seconds=draw(valid(float)),
        reference_bytes=draw(valid(int)),
        optimal=draw(valid(bool)),
    )


#: Messages whose fields constrain each other: built whole.
def welcomes() -> st.SearchStrategy[Welcome]:
    """Timers with 0 < heartbeat interval < liveness timeout <= MAX_TIMER."""
    return st.builds(
        lambda peer_id, timeout, share, digest: Welcome(
            peer_id=peer_id, heartbeat_interval=timeout * share, liveness_timeout=timeout,
            content_digest=digest,
        ),
        st.integers(0, U64_MAX),
        st.floats(min_value=0.001, max_value=MAX_TIMER),
        st.floats(min_value=0.01, max_value=0.99),
        st.booleans(),
    )


def registrations() -> st.SearchStrategy[Register]:
    """A new peer's registration, or a member's coming back (its fields only then)."""
    def build(
        fields: dict[str, Any], rejoin: int, back: tuple[int, int, int, int],
        keys: tuple[bytes, bytes], gone: bool,
    ) -> Register:
        if rejoin:
            fields.update(zip(("predecessor", "successor", "next_revision", "high_water"),
                              back, strict=True))
            fields.update(predecessor_identity=keys[0], successor_identity=keys[1],
                          predecessor_gone=gone and back[0] != 0)
        return Register(**fields, rejoin=rejoin)

    return st.builds(
        build,
        st.fixed_dictionaries({
            "protocol_version": st.integers(0, U64_MAX),
            "peer_group": st.integers(0, U32_MAX),
            "p2p_port": st.integers(1, U16_MAX),
            "advertised_host": st.text(max_size=30),
            "pool_size": st.integers(1, MAX_POOL_SIZE),
        }),
        st.integers(0, 1 << 48),
        st.tuples(*[st.integers(0, 1 << 48)] * 4),
        st.tuples(*[st.sampled_from([b"", bytes(32), b"\x07" * 32])] * 2),
        st.booleans(),
    )


@st.composite
def verdicts(draw: st.DrawFn) -> CollectiveVerdict:
    """Any outcome; a success of a numbered attempt may grant a lease of 1 to
    MAX_LEASE_SPAN numbers."""
    outcome = draw(st.sampled_from(OUTCOMES), label="outcome")
    seq = draw(valid(int), label="seq")
    lease = last = 0
    if outcome == Outcome.SUCCESS and seq and draw(st.booleans(), label="leased"):
        lease = draw(st.integers(1, U64_MAX - MAX_LEASE_SPAN), label="lease")
        last = lease + draw(st.integers(0, MAX_LEASE_SPAN - 1), label="span")
    return CollectiveVerdict(
        tag=draw(valid(int)), seq=seq, outcome=outcome, reason=draw(valid(str)), lease=lease,
        lease_last=last,
    )


@st.composite
def lease_reports(draw: st.DrawFn) -> LeaseReport:
    """A report on a lease: no attempt (NONE), or one within the lease in any other
    state; only a failed one may say why its data is invalid."""
    lease = draw(st.integers(1, U64_MAX - MAX_LEASE_SPAN), label="lease")
    state = draw(st.sampled_from(list(LeaseState)), label="state")
    seq = 0 if state == LeaseState.NONE else lease + draw(st.integers(0, MAX_LEASE_SPAN - 1))
    return LeaseReport(
        tag=draw(valid(int)), lease=lease, seq=seq, state=state,
        count=draw(valid(int)), dtype=draw(NARROWER[(CollectiveInitiate, "dtype")]),
        op=draw(NARROWER[(CollectiveInitiate, "op")]),
        quantized_dtype=draw(NARROWER[(CollectiveInitiate, "quantized_dtype")]),
        quantization=draw(NARROWER[(CollectiveInitiate, "quantization")]),
        distribution_hint=draw(NARROWER[(CollectiveInitiate, "distribution_hint")]),
        slice_bytes=draw(valid(int)),
        invalid=draw(valid(str)) if state == LeaseState.FAILED else "",
        kind=CollectiveKind.ALL_REDUCE,
    )


JOINT: dict[type[Any], st.SearchStrategy[Any]] = {
    CollectiveVerdict: verdicts(),
    LeaseReport: lease_reports(),
    Register: registrations(),
    LinkMeasured: link_measurements(),
    TopologyOptimized: topology_reports(),
    Welcome: welcomes(),
}


def valid(hint: Any) -> st.SearchStrategy[Any]:
    """Any value valid for a field of type ``hint``."""
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(0, U64_MAX)
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 1000)
    if hint is str:
        return st.text(max_size=30)
    if hint is bytes:  # node identities and content digests: both none or 32 bytes
        return st.sampled_from([b"", bytes(32)]) | st.binary(min_size=32, max_size=32)
    if typing.get_origin(hint) is tuple:
        return st.lists(valid(typing.get_args(hint)[0]), max_size=5).map(tuple)
    return records(hint)


def records(cls: type[Any]) -> st.SearchStrategy[Any]:
    if cls in JOINT:
        return JOINT[cls]
    return st.builds(
        cls,
        **{
            name: NARROWER[(cls, name)] if (cls, name) in NARROWER else valid(hint)
            for name, hint in cls._HINTS.items()
        },
    )


any_message = st.sampled_from(sorted(message_kinds().values(), key=lambda c: c.KIND)).flatmap(
    records
)


@DETERMINISTIC
@given(any_message)
def test_every_valid_message_round_trips(message: Message) -> None:
    assert decode_message(message.KIND, encode_message(message)) == message


@DETERMINISTIC
@given(message=any_message, data=st.data())
def test_a_mutated_field_decodes_or_names_the_message(message: Message, data: st.DataObject) -> None:
    check_mutation(message, data)


def check_mutation(message: Message, data: st.DataObject) -> None:
    """One field of ``message`` replaced by anything: it decodes to the same fields, or
    the error names the message (or a nested record)."""
    fields = wire_fields(message)
    if fields:
        index = data.draw(st.integers(0, len(fields) - 1), label="field")
        fields[index] = data.draw(
            st.none() | st.booleans() | st.integers(-(1 << 63), U64_MAX) | st.floats()
            | st.text(max_size=5) | st.binary(max_size=5)
            | st.lists(st.integers(-5, 5) | st.text(max_size=3), max_size=4),
            label="value",
        )
    else:
        fields.append(data.draw(st.integers(-(1 << 63), U64_MAX), label="extra"))
    try:
        decoded = decode(type(message), fields)
    except RemoteProtocolError as exc:
        nested = {"PeerEndpoint", "WorldSizes"}
        assert str(exc).startswith((type(message).__name__, *nested)), str(exc)
    else:
        assert type(decoded) is type(message)
        assert wire_fields(decoded) == fields


@DETERMINISTIC
@given(kind=st.sampled_from(sorted(message_kinds())), payload=st.binary(max_size=64))
def test_arbitrary_payload_decodes_or_raises_remote_protocol_error(
    kind: int, payload: bytes
) -> None:
    try:
        message = decode_message(kind, payload)
    except RemoteProtocolError:
        return
    assert type(message) is message_kinds()[kind]


topology_messages = st.sampled_from(
    [VoteOptimizeTopology, LinkMeasured, MeasureLink, ExpectBenchmark, TopologyOptimized]
).flatmap(records)


@DETERMINISTIC
@given(topology_messages)
def test_every_valid_topology_message_round_trips(message: Message) -> None:
    # The generic property above spreads its examples over every kind; these have
    # fields that constrain each other, so they get examples of their own.
    assert decode_message(message.KIND, encode_message(message)) == message


@DETERMINISTIC
@given(message=topology_messages, data=st.data())
def test_a_mutated_topology_message_decodes_or_names_the_message(
    message: Message, data: st.DataObject
) -> None:
    check_mutation(message, data)


def test_samples_use_non_default_nested_values() -> None:
    # Guards the fixtures the other tests lean on.
    info = SAMPLES[P2PInfo]
    assert isinstance(info, P2PInfo) and info.neighbours == NEIGHBOURS
    assert len({type(m) for m in SAMPLES.values()}) == len(message_kinds())


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (lambda: SharedStateEntry(key="", hash=0, dtype=0, count=0, allow_content_inequality=False),
         "SharedStateEntry.key"),
        (lambda: SharedStateEntry(key="k" * 1025, hash=0, dtype=0, count=0,
                                  allow_content_inequality=False), "SharedStateEntry.key"),
        (lambda: SharedStateEntry(key="k", hash=0, dtype=len(DTYPE_NAMES), count=0,
                                  allow_content_inequality=False), "SharedStateEntry.dtype"),
        (lambda: SharedStateVote(revision=0, strategy=len(STRATEGY_NAMES), entries=()),
         "SharedStateVote.strategy"),
        (lambda: SharedStateVote(revision=0, strategy=0, entries=(
            SharedStateEntry(key="a", hash=1, dtype=0, count=1, allow_content_inequality=False),
            SharedStateEntry(key="a", hash=2, dtype=0, count=1, allow_content_inequality=False),
        )), "key 'a' appears twice"),
        (lambda: SharedStatePlan(sync=1, revision=0, distributors=(), fetches=(
            SharedStateFetch(key="a", hash=1, verify=True),
            SharedStateFetch(key="a", hash=1, verify=True),
        )), "key 'a' appears twice"),
        (lambda: SharedStateEntry(key="k", hash=0, dtype=0, count=0,
                                  allow_content_inequality=False, digest=bytes(16)),
         "SharedStateEntry.digest: a content digest has 32 bytes"),
        (lambda: SharedStateFetch(key="k", hash=0, verify=True, digest=bytes(64)),
         "SharedStateFetch.digest: a content digest has 32 bytes"),
        (lambda: SharedStateRange(key="", offset=0, nbytes=1), "SharedStateRange.key"),
        (lambda: TensorSpan(first=3, count=0), "TensorSpan.count"),
    ],
)
def test_shared_state_records_refuse_bad_fields(message: Any, words: str) -> None:
    with pytest.raises(RemoteProtocolError, match=words):
        message()


def test_a_barrier_vote_carries_no_data_and_only_a_broadcast_has_a_root() -> None:
    """A barrier is a collective of no data: its vote round trips and names itself,
    and one that claims data, or a kind no peer makes, names the message."""
    barrier = CollectiveInitiate(
        tag=3, count=0, dtype=0, op=0, quantized_dtype=0, quantization=0,
        kind=CollectiveKind.BARRIER,
    )
    assert decode(CollectiveInitiate, wire_fields(barrier)) == barrier
    assert barrier.describe() == "barrier()"
    broadcast = dataclasses.replace(barrier, kind=CollectiveKind.BROADCAST, root=5, count=4)
    assert decode(CollectiveInitiate, wire_fields(broadcast)) == broadcast
    assert broadcast.describe().startswith("broadcast root=5 count=4")
    for fields, error in (
        ({"count": 4}, "a barrier carries no data"),
        ({"quantization": 1}, "a barrier carries no data"),
        ({"kind": 7}, "CollectiveInitiate.kind: unknown value 7"),
        ({"kind": CollectiveKind.REDUCE_SCATTER, "count": 4, "quantization": 1},
         "a reduce_scatter is not quantized"),
        ({"kind": CollectiveKind.BROADCAST, "count": 4, "quantization": 1},
         "a broadcast is not quantized"),
        ({"kind": CollectiveKind.ALL_REDUCE, "count": 4, "root": 3}, "only a broadcast has a root"),
    ):
        with pytest.raises(RemoteProtocolError, match=error):
            dataclasses.replace(barrier, **fields)



def test_an_all_gather_vote_is_plain_and_its_commence_carries_a_size_per_member() -> None:
    """An all-gather's vote carries its own part's count, and is neither quantized,
    reduced nor leased; its commence carries one size per ring member, in range."""
    gather = CollectiveInitiate(
        tag=3, count=7, dtype=0, op=0, quantized_dtype=0, quantization=0,
        kind=CollectiveKind.ALL_GATHER,
    )
    assert decode(CollectiveInitiate, wire_fields(gather)) == gather
    assert gather.describe().startswith("all_gather count=7 (its own)")
    for fields in ({"quantization": 1}, {"op": 1}, {"lease": True}):
        with pytest.raises(RemoteProtocolError, match="neither quantized, reduced nor leased"):
            dataclasses.replace(gather, **fields)
    commence = CollectiveCommence(tag=3, seq=1, ring=(2, 1, 3), sizes=(7, 0, 5))
    assert decode(CollectiveCommence, wire_fields(commence)) == commence
    for sizes, error in (((7, 0), "2 sizes for a ring of 3"), ((1, -1, 2), "invalid value -1"),
                         ((1, 1 << 62, 2), "out of range")):
        with pytest.raises(RemoteProtocolError, match=error):
            CollectiveCommence(tag=3, seq=1, ring=(2, 1, 3), sizes=sizes)


def test_a_topk_vote_names_what_it_keeps_and_only_it_keeps_entries() -> None:
    topk = CollectiveInitiate(
        tag=1, count=100, dtype=0, op=0, quantized_dtype=0, quantization=0,
        kind=CollectiveKind.TOPK_ALL_REDUCE, topk=5, topk_chunk=50,
    )
    assert decode(CollectiveInitiate, wire_fields(topk)) == topk
    assert "all_reduce(compression=TopK) count=100" in topk.describe()
    assert "keeping 5 of every 50" in topk.describe()
    for fields, error in (
        ({"topk": 0}, "keeps 1 to topk_chunk"), ({"topk": 51}, "keeps 1 to topk_chunk"),
        ({"topk_chunk": 1 << 17, "topk": 5}, "keeps 1 to topk_chunk"),
        ({"kind": CollectiveKind.ALL_REDUCE}, "only a Top-k all_reduce keeps entries"),
        # Packed codes: 2 or 4 bits of quantized uint8 codes only.
        ({"topk_bits": 2}, "2-bit codes, where packed codes are 2 or 4 bits of uint8"),
        ({"topk_bits": 3, "quantization": 1}, "3-bit codes"),
        ({"topk_bits": 2, "quantization": 1, "quantized_dtype": 2}, "2-bit codes"),
    ):
        with pytest.raises(RemoteProtocolError, match=error):
            dataclasses.replace(topk, **fields)
    packed = dataclasses.replace(topk, quantization=1, topk_bits=2)
    assert decode(CollectiveInitiate, wire_fields(packed)) == packed
    assert "keeping 5 of every 50 as 2-bit codes" in packed.describe()
