"""Shared fixtures for the core tests: one valid instance of every message, and the
Hypothesis settings every property test here runs under."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import HealthCheck, settings

from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    BenchmarkRequest,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    ExpectBenchmark,
    Heartbeat,
    Kick,
    LeaseEnd,
    LeaseReport,
    LeaseState,
    LinkMeasured,
    MeasureLink,
    Message,
    Outcome,
    P2PEstablished,
    P2PEstablishResult,
    P2PHello,
    P2PHelloAck,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    Register,
    SharedStateComplete,
    SharedStateDone,
    SharedStateEntry,
    SharedStateFetch,
    SharedStateFetcher,
    SharedStatePlan,
    SharedStateRange,
    SharedStateRequest,
    SharedStateResponse,
    SharedStateVote,
    StatusReply,
    StatusRequest,
    TensorSpan,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
    Welcome,
    WorldSizes,
    encode_message,
)
from pccl_trio._core.status import (
    CollectiveStatus,
    GroupStatus,
    KickStatus,
    PeerStatus,
    PeerTally,
    RunCount,
    WaitStatus,
)

#: Deterministic and free of wall-clock judgements: the same examples on every run,
#: no example database, no per-example deadline, no "too slow" health check.
DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

WORLD = WorldSizes(
    global_world_size=4,
    peer_group_world_size=3,
    num_distinct_peer_groups=2,
    largest_peer_group_world_size=3,
)
NEIGHBOURS = (
    PeerEndpoint(peer_id=2, host="10.0.0.2", port=48149, pool_size=4),
    PeerEndpoint(peer_id=5, host="10.0.0.5", port=65535, pool_size=1024, identity=bytes(range(32))),
)

#: One valid, non-trivial instance per message class (every field away from its default).
SAMPLES: dict[type[Message], Message] = {
    Register: Register(
        protocol_version=PROTOCOL_VERSION, peer_group=7, p2p_port=48148, advertised_host="10.0.0.1",
        pool_size=3, rejoin=12, predecessor=9, successor=14, next_revision=31, high_water=77,
        predecessor_identity=bytes(range(32)), successor_identity=b"\x05" * 32,
    ),
    Heartbeat: Heartbeat(),
    VoteEstablish: VoteEstablish(accept_new_peers=True),
    P2PEstablished: P2PEstablished(round=3, success=False, failed_peers=(2, 5)),
    VotePeersPending: VotePeersPending(),
    Welcome: Welcome(peer_id=1, heartbeat_interval=0.5, liveness_timeout=2.0, content_digest=True),
    Kick: Kick(reason="kicked: ünïcödé ✓"),
    P2PInfo: P2PInfo(round=3, ring=(1, 2, 5), neighbours=NEIGHBOURS, world=WORLD),
    P2PEstablishResult: P2PEstablishResult(round=3, success=True, ring=(1, 2, 5), world=WORLD),
    PeersPendingResult: PeersPendingResult(pending=True, error="refused"),
    CollectiveInitiate: CollectiveInitiate(
        tag=9, count=1025, dtype=9, op=3, quantized_dtype=0, quantization=1, lease=True
    ),
    LeaseReport: LeaseReport(
        tag=9, lease=40, seq=43, state=LeaseState.FAILED, count=1025, dtype=9, op=3,
        quantized_dtype=2, quantization=1, distribution_hint=1, slice_bytes=1 << 20,
        invalid="NaN at peer 4",
    ),
    LeaseEnd: LeaseEnd(tag=9, lease=40, reason="peer 5 left"),
    CollectiveComplete: CollectiveComplete(tag=9, seq=4, aborted=True),
    CollectiveCommence: CollectiveCommence(tag=9, seq=4, ring=(5, 1, 2)),
    CollectiveAbort: CollectiveAbort(tag=9, seq=4, reason="peer 5 left"),
    CollectiveVerdict: CollectiveVerdict(
        tag=9, seq=4, outcome=Outcome.SUCCESS, reason="", lease=40, lease_last=1 << 20
    ),
    P2PHello: P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=3, slot=2),
    P2PHelloAck: P2PHelloAck(),
    SharedStateVote: SharedStateVote(
        revision=13,
        strategy=2,
        entries=(
            SharedStateEntry(key="w", hash=3391090508, dtype=10, count=1 << 20,
                             allow_content_inequality=False, digest=bytes(range(32, 64))),
            SharedStateEntry(key="ëtä", hash=0, dtype=9, count=3, allow_content_inequality=True),
        ),
    ),
    SharedStateDone: SharedStateDone(sync=4, success=False, reason="peer 2 left"),
    SharedStatePlan: SharedStatePlan(
        sync=4,
        revision=13,
        fetches=(
            SharedStateFetch(key="w", hash=3391090508, verify=True, digest=bytes(range(32, 64))),
        ),
        distributors=NEIGHBOURS,
        fetchers=(
            SharedStateFetcher(peer_id=3, host="10.0.0.3", identity=b"\x07" * 32, tensors=(
                TensorSpan(first=0, count=1), TensorSpan(first=2, count=40),
            )),
        ),
        error="refused",
    ),
    SharedStateComplete: SharedStateComplete(sync=4),
    SharedStateRequest: SharedStateRequest(
        protocol_version=PROTOCOL_VERSION,
        peer_id=3,
        sync=4,
        ranges=(SharedStateRange(key="w", offset=4096, nbytes=65536),),
        frame_bytes=1 << 23,
    ),
    SharedStateResponse: SharedStateResponse(error="not distributing"),
    BenchmarkRequest: BenchmarkRequest(
        protocol_version=PROTOCOL_VERSION, peer_id=3, nbytes=1 << 20, frame_bytes=65536
    ),
    VoteOptimizeTopology: VoteOptimizeTopology(),
    LinkMeasured: LinkMeasured(
        optimization=2, sender=5, bandwidth=1.25e9, latency=2.5e-4, error="refused: ✗"
    ),
    MeasureLink: MeasureLink(optimization=2, source=NEIGHBOURS[1], nbytes=96 << 20),
    ExpectBenchmark: ExpectBenchmark(optimization=2, measurer=NEIGHBOURS[0], nbytes=1 << 20),
    TopologyOptimized: TopologyOptimized(
        optimization=2,
        error="refused",
        peers=(1, 2, 5),
        bandwidth=(0.0, 1.25e9, 5e6, 1e9, 0.0, 0.0, 2.5e7, 1, 0.0),
        latency=(0.0, 1e-4, 2e-3, 1e-4, 0.0, 0.0, 5e-4, 0.25, 0.0),
        unreachable=(5,),
        ring=(2, 1, 5),
        predicted_seconds=0.75,
        reference_bytes=64 << 20,
        optimal=True,
    ),
    StatusRequest: StatusRequest(),
    StatusReply: StatusReply(
        uptime_seconds=12.5,
        reference_bytes=64 << 20,
        peers_total=3,
        tallies=(PeerTally(group=1, phase="accepted", count=3),),
        peers=(
            PeerStatus(peer_id=4, group=1, host="10.0.0.4", port=48149, phase="accepted",
                       state="vote_sync", silent_seconds=0.25, identity="ab12cd34"),
        ),
        groups=(
            GroupStatus(group=1, world=2, ring=(4, 9), stale=True, predicted_seconds=0.5,
                        has_revision=True, revision=7),
        ),
        waiting=(WaitStatus(call="sync", where="peer group 1", seconds=3.5, missing=(9,)),),
        collectives=(
            CollectiveStatus(group=1, tag=3, seq=8, seconds=0.75, incomplete=(4,)),
        ),
        kicks=(KickStatus(peer_id=5, cause="liveness", reason="silent", seconds_ago=2.0),),
        counts=(RunCount(event="synced", label="", count=2, total=4096),),
        truncated=True,
    ),
}


def wire_fields(message: Message) -> Any:
    """The message's fields as they travel: a (nested) list."""
    return msgpack.unpackb(encode_message(message), raw=False, use_list=True)
