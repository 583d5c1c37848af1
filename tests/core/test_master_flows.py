"""MasterCore scenarios: joining, rounds, failures, pending votes, liveness and kicks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl_trio._core.errors import LocalProtocolError, RemoteProtocolError
from pccl_trio._core.master import (
    Close,
    ConnectionBroken,
    ConnectionClosed,
    MasterCore,
    MessageReceived,
    Send,
)
from pccl_trio._core.messages import (
    C2M,
    MAX_PENDING_WAIT,
    PROTOCOL_VERSION,
    Heartbeat,
    Kick,
    Message,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    Register,
    VoteEstablish,
    VotePeersPending,
    Welcome,
    WorldSizes,
)
from pccl_trio._core.ring import ring_edges

from .master_harness import HEARTBEAT_INTERVAL, LIVENESS_TIMEOUT, MasterHarness, only, was_kicked
from .scenarios import ACC, CONN, FAIL, IDLE, REG, accepted, endpoint
from .support import DETERMINISTIC, SAMPLES


def world(global_: int, group: int, groups: int, largest: int) -> WorldSizes:
    return WorldSizes(
        global_world_size=global_,
        peer_group_world_size=group,
        num_distinct_peer_groups=groups,
        largest_peer_group_world_size=largest,
    )


def new_round(h: MasterHarness, *conns: int) -> int:
    """Every one of ``conns`` votes (accepting new peers); the round's number."""
    for conn in conns:
        h.vote(conn)
    number = h.last(conns[0], P2PInfo).round
    assert all(h.last(conn, P2PInfo).round == number for conn in conns)
    return number


# --- joining --------------------------------------------------------------------------


def test_first_peer_is_admitted_by_a_one_member_round() -> None:
    h = MasterHarness()
    h.register(1)
    assert h.take(1) == [
        Welcome(peer_id=1, heartbeat_interval=HEARTBEAT_INTERVAL, liveness_timeout=LIVENESS_TIMEOUT),
        P2PInfo(round=1, ring=(1,), neighbours=(), world=world(1, 1, 1, 1)),
    ]
    assert h.where(1) == (REG, CONN)
    assert h.core.round_in_progress

    h.report(1)
    assert h.take(1) == [
        P2PEstablishResult(round=1, success=True, ring=(1,), world=world(1, 1, 1, 1))
    ]
    assert h.where(1) == (ACC, IDLE)
    assert not h.core.round_in_progress
    assert h.core.ring(0) == [1]


def test_second_peer_waits_for_the_accepted_peer_to_vote() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    assert h.take(2) == [
        Welcome(peer_id=2, heartbeat_interval=HEARTBEAT_INTERVAL, liveness_timeout=LIVENESS_TIMEOUT)
    ]
    assert h.take(1) == []
    assert h.where(2) == (REG, IDLE)
    assert not h.core.round_in_progress

    h.vote(1)
    assert h.take(1) == [P2PInfo(round=2, ring=(1, 2), neighbours=(endpoint(2),),
                                 world=world(2, 2, 1, 2))]
    assert h.take(2) == [P2PInfo(round=2, ring=(1, 2), neighbours=(endpoint(1),),
                                 world=world(2, 2, 1, 2))]
    h.report(1)
    assert h.take(1) == []  # the round waits for every participant
    h.report(2)
    result = P2PEstablishResult(round=2, success=True, ring=(1, 2), world=world(2, 2, 1, 2))
    assert h.take(1) == [result]
    assert h.take(2) == [result]
    assert h.where(2) == (ACC, IDLE)


def test_peer_registering_mid_round_waits_for_the_next_round() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.vote(1)
    h.register(3)
    assert [type(m) for m in h.take(3)] == [Welcome]
    h.report(1)
    h.report(2)
    assert h.last(1, P2PEstablishResult).world.global_world_size == 2
    assert h.take(3) == []
    assert h.where(3) == (REG, IDLE)

    number = new_round(h, 1, 2)
    assert h.last(3, P2PInfo) == P2PInfo(
        round=number, ring=(1, 2, 3), neighbours=(endpoint(2), endpoint(1)), world=world(3, 3, 1, 3)
    )


@pytest.mark.parametrize(
    ("accept_1", "accept_2"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_joiners_are_admitted_only_if_every_voter_accepts(accept_1: bool, accept_2: bool) -> None:
    admitted = accept_1 and accept_2
    h = MasterHarness()
    accepted(h, 1, 2)
    h.register(3)
    h.vote(1, accept_1)
    h.vote(2, accept_2)
    assert h.last(1, P2PInfo).ring == ((1, 2, 3) if admitted else (1, 2))
    assert bool(h.received(3, P2PInfo)) == admitted
    for conn in (1, 2, 3) if admitted else (1, 2):
        h.report(conn)
    assert h.last(1, P2PEstablishResult).success
    assert h.where(3) == ((ACC, IDLE) if admitted else (REG, IDLE))


def test_world_sizes_and_rings_per_group() -> None:
    h = MasterHarness()
    h.join(1, group=0)
    h.register(2, group=0)
    h.register(3, group=0)
    h.register(4, group=1)
    h.vote(1)
    big, small = world(4, 3, 2, 3), world(4, 1, 2, 3)
    for conn in (1, 2, 3):
        info = h.last(conn, P2PInfo)
        assert (info.ring, info.world) == ((1, 2, 3), big)
    assert h.last(4, P2PInfo) == P2PInfo(round=2, ring=(4,), neighbours=(), world=small)

    for conn in (1, 2, 3, 4):
        h.report(conn)
    for conn in (1, 2, 3):
        assert h.last(conn, P2PEstablishResult) == P2PEstablishResult(
            round=2, success=True, ring=(1, 2, 3), world=big
        )
    assert h.last(4, P2PEstablishResult) == P2PEstablishResult(
        round=2, success=True, ring=(4,), world=small
    )
    assert (h.core.ring(0), h.core.ring(1), h.core.ring(2)) == ([1, 2, 3], [4], [])


def test_every_member_of_a_group_learns_the_largest_pool_of_its_ring() -> None:
    """All-reduces cut a ring step by the ring's largest pool (``stripes``): every
    member of a group gets the same number, each group its own, and a member that
    reports no pool (alone) counts as one connection."""
    h = MasterHarness()
    h.join(1, group=0)
    assert h.last(1, P2PEstablishResult).stripes == 1
    for conn, group in ((2, 0), (3, 0), (4, 1), (5, 1)):
        h.register(conn, group=group)
    h.vote(1)
    for conn, pool in ((1, 1), (2, 8), (3, 3), (4, 2), (5, 0)):
        h.report(conn, pool=pool)
    assert [h.last(conn, P2PEstablishResult).stripes for conn in (1, 2, 3, 4, 5)] == [8, 8, 8, 2, 2]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5], ids=lambda n: f"ring-of-{n}")
def test_neighbours_are_the_ring_predecessor_and_successor(size: int) -> None:
    h = MasterHarness()
    conns = range(1, size + 1)
    for conn in conns:
        h.register(conn, host=f"192.168.0.{conn}", advertised_host=f"10.0.0.{conn}")
        if conn == 1:
            h.report(1)
    if size > 1:
        h.vote(1)
    for index, conn in enumerate(conns):
        info = h.last(conn, P2PInfo)
        assert info.ring == tuple(conns)
        before, after = conns[index - 1], conns[(index + 1) % size]
        expected = {1: [], 2: [before], 3: [before, after]}[min(size, 3)]
        assert info.neighbours == tuple(endpoint(c, f"10.0.0.{c}") for c in expected)


def test_endpoints_carry_the_pool_size_each_peer_registered_with() -> None:
    """A receiver admits ring connections only into slots below its predecessor's pool
    size, so the size travels with the predecessor's endpoint."""
    h = MasterHarness()
    h.register(1, pool_size=3)
    h.report(1)
    h.register(2, pool_size=1024)
    h.vote(1)
    assert h.last(1, P2PInfo).neighbours == (
        PeerEndpoint(peer_id=2, host="127.0.0.1", port=10002, pool_size=1024),
    )
    assert h.last(2, P2PInfo).neighbours == (
        PeerEndpoint(peer_id=1, host="127.0.0.1", port=10001, pool_size=3),
    )


def test_endpoint_host_defaults_to_the_address_the_master_sees() -> None:
    h = MasterHarness()
    h.join(1)
    h.register(2, host="127.0.0.2")
    h.vote(1)
    assert h.last(1, P2PInfo).neighbours == (endpoint(2, "127.0.0.2"),)
    assert [p.host for p in h.core.peers()] == ["127.0.0.1", "127.0.0.2"]


# --- failed rounds --------------------------------------------------------------------


def test_failed_round_fails_for_everyone_and_promotes_the_joiners() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.register(3)
    h.vote(1)
    h.report(1)
    h.report(2, ok=False)
    h.report(3)
    failed = P2PEstablishResult(round=2, success=False, ring=(1, 2, 3), world=world(3, 3, 1, 3))
    for conn in (1, 2, 3):
        assert h.received(conn, P2PEstablishResult) == (
            [P2PEstablishResult(round=1, success=True, ring=(1,), world=world(1, 1, 1, 1)), failed]
            if conn == 1 else [failed]
        )
        assert h.where(conn) == (ACC, FAIL)

    # The joiners are members now: the next round waits for their votes too.
    h.vote(1)
    h.vote(2)
    assert not h.core.round_in_progress
    h.vote(3)
    assert h.last(3, P2PInfo).round == 3
    for conn in (1, 2, 3):
        h.report(conn)
    assert h.last(3, P2PEstablishResult).success


def test_next_ring_avoids_edges_reported_unreachable() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    assert h.core.ring(0) == [1, 2, 3]
    new_round(h, 1, 2, 3)
    h.report(1, ok=False, failed=(2,))
    h.report(2)
    h.report(3)
    assert not h.last(1, P2PEstablishResult).success

    new_round(h, 1, 2, 3)
    ring = h.last(1, P2PInfo).ring
    assert (1, 2) not in ring_edges(ring)
    assert ring == (1, 3, 2)
    for conn in (1, 2, 3):
        h.report(conn)
    assert h.last(2, P2PEstablishResult).ring == (1, 3, 2)
    assert h.core.ring(0) == [1, 3, 2]


def test_peer_no_ring_can_include_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    new_round(h, 1, 2, 3)
    h.report(1, ok=False, failed=(3,))
    h.report(2, ok=False, failed=(3,))
    h.report(3)
    # 1->3 and 2->3 are blocked: every ring of three needs one of them.
    h.vote(3)
    h.vote(1)
    actions = h.vote(2)
    assert was_kicked(actions, 3)
    assert "no ring can include this peer" in (h.kick_reason(3) or "")
    for conn in (1, 2):
        assert h.last(conn, P2PInfo).ring == (1, 2)
        assert h.last(conn, P2PInfo).world == world(2, 2, 1, 2)
    assert [p.peer_id for p in h.core.peers()] == [1, 2]


def test_two_peers_that_cannot_connect_leave_one() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    new_round(h, 1, 2)
    h.report(1, ok=False, failed=(2,))
    h.report(2)
    h.vote(1)
    actions = h.vote(2)
    # Both touch the one blocked edge; the tie goes against the later peer.
    assert was_kicked(actions, 2)
    assert h.last(1, P2PInfo).ring == (1,)


def test_unreachable_peers_outside_the_run_are_ignored() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    new_round(h, 1, 2)
    h.report(1, ok=False, failed=(1, 99))  # itself and a peer that does not exist
    h.report(2)
    new_round(h, 1, 2)
    assert h.last(1, P2PInfo).ring == (1, 2)


# --- departures -----------------------------------------------------------------------


def silence(h: MasterHarness, conn: int, others: tuple[int, ...]) -> list[Send | Close]:
    """Let ``conn`` go silent while ``others`` keep talking, until the master drops it."""
    h.now += LIVENESS_TIMEOUT / 2
    for other in others:
        h.heartbeat(other)
    return h.tick(h.now + LIVENESS_TIMEOUT / 2)


@pytest.mark.parametrize("how", ["close", "broken", "kicked", "silent"])
def test_peer_leaving_mid_vote_lets_the_round_start(how: str) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.vote(1)
    h.vote(2)
    assert not h.core.round_in_progress
    match how:
        case "close":
            actions = h.close(3)
            assert only(actions, 3) == [Close(conn=3, reason="connection closed")]
        case "broken":
            actions = h.broken(3)
            assert was_kicked(actions, 3)
        case "kicked":
            actions = h.send(3, SAMPLES[Register])
            assert was_kicked(actions, 3)
        case "silent":
            actions = silence(h, 3, others=(1, 2))
            assert was_kicked(actions, 3)
    for conn in (1, 2):
        assert h.last(conn, P2PInfo) == P2PInfo(
            round=3, ring=(1, 2), neighbours=(endpoint(3 - conn),), world=world(2, 2, 1, 2)
        )
    assert h.view(3) is None


@pytest.mark.parametrize("when", ["before-the-reports", "after-the-reports"])
def test_peer_leaving_mid_round_fails_the_round(when: str) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    number = new_round(h, 1, 2, 3)
    if when == "before-the-reports":
        h.close(3)
        assert h.core.round_in_progress
        h.report(1)
        h.report(2)
    else:
        h.report(1)
        h.report(2)
        assert h.core.round_in_progress
        h.close(3)
    for conn in (1, 2):
        assert h.last(conn, P2PEstablishResult) == P2PEstablishResult(
            round=number, success=False, ring=(1, 2), world=world(2, 2, 1, 2)
        )
        assert h.where(conn) == (ACC, FAIL)
    assert [r.round for r in h.received(3, P2PEstablishResult)] == [number - 1]  # not this one
    new_round(h, 1, 2)
    assert h.last(1, P2PInfo).ring == (1, 2)


def test_waiting_peers_are_admitted_when_every_member_is_gone() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.register(3)
    assert not h.core.round_in_progress
    h.close(1)
    for conn in (2, 3):
        assert h.last(conn, P2PInfo).ring == (2, 3)
        assert h.last(conn, P2PInfo).round == 2


def test_round_whose_every_participant_left_ends_and_admits_the_waiting() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.vote(1, accept=False)  # round 2: peer 1 alone
    assert h.last(1, P2PInfo).round == 2
    actions = h.close(1)
    # Round 2 ends with nobody to tell; round 3 admits peer 2 at once.
    assert [a.message for a in actions if isinstance(a, Send)] == [
        P2PInfo(round=3, ring=(2,), neighbours=(), world=world(1, 1, 1, 1))
    ]


def test_a_kick_leaves_the_other_peers_as_they_were() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.vote(1)
    h.pending(2)
    before = {conn: h.view(conn) for conn in (1, 2)}
    actions = h.send(3, P2PEstablished(round=1, success=True))  # no round is running
    assert was_kicked(actions, 3)
    assert only(actions, 1) == only(actions, 2) == []
    assert {conn: h.view(conn) for conn in (1, 2)} == before


# --- the pending-peers vote -----------------------------------------------------------


@pytest.mark.parametrize("waiting", [False, True], ids=["none-waiting", "one-waiting"])
def test_pending_vote_tells_every_voter_whether_peers_wait(waiting: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    if waiting:
        h.register(3)
    h.pending(1)
    assert h.take(1) == []
    h.pending(2)
    assert h.take(1) == h.take(2) == [PeersPendingResult(pending=waiting)]
    assert h.received(3, PeersPendingResult) == []  # only members take part


def test_pending_vote_starts_afresh_after_an_answer() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.pending(1)
    h.pending(2)
    h.take_all()
    h.pending(1)  # a new vote, not a second one
    assert h.take(1) == []
    h.pending(2)
    assert h.take(1) == h.take(2) == [PeersPendingResult(pending=False)]


def test_lone_member_gets_its_pending_answer_at_once() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.take_all()
    h.pending(1)
    assert h.take(1) == [PeersPendingResult(pending=True)]


def test_double_pending_vote_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.pending(1)
    actions = h.pending(1)
    assert was_kicked(actions, 1)
    assert "twice" in (h.kick_reason(1) or "")
    # The survivor's own vote now decides alone.
    h.pending(2)
    assert h.take(2) == [PeersPendingResult(pending=False)]


def test_pending_vote_by_a_registered_peer_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    actions = h.pending(2)
    assert was_kicked(actions, 2)
    assert "before being accepted" in (h.kick_reason(2) or "")


def test_pending_vote_is_answered_when_the_last_holdout_leaves() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.pending(1)
    h.close(2)
    assert h.take(1) == [PeersPendingResult(pending=False)]


def test_a_round_voids_pending_votes() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.pending(1)
    new_round(h, 1, 2)
    h.report(1)
    h.report(2)
    h.take_all()
    h.pending(2)
    assert h.take(2) == []  # peer 1's vote went with the round
    h.pending(1)  # and voting again is no double vote
    assert h.take(1) == h.take(2) == [PeersPendingResult(pending=False)]


def test_a_waiting_question_is_answered_when_a_peer_registers() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.take_all()
    h.pending(1, wait=MAX_PENDING_WAIT)
    assert h.take(1) == []  # held: nobody waits to be admitted
    h.now = 2.0
    h.heartbeat(1)
    h.tick(h.now)
    assert h.received(1, PeersPendingResult) == []
    h.register(2)
    assert h.received(1, PeersPendingResult) == [PeersPendingResult(pending=True)]


def test_a_waiting_question_is_answered_at_once_when_a_peer_waits_already() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.take_all()
    h.pending(1, wait=60.0)
    assert h.take(1) == [PeersPendingResult(pending=True)]


def test_a_waiting_question_ends_with_the_shortest_wait() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.take_all()
    h.pending(1, wait=3.0)  # at 0: due at 3
    h.now = 1.0
    h.pending(2, wait=100.0)  # due at 101: the earlier one decides
    h.now = 2.0
    h.heartbeat(1)
    h.heartbeat(2)
    h.tick(2.5)
    assert h.received(1, PeersPendingResult) == h.received(2, PeersPendingResult) == []
    assert h.core.next_deadline() == 3.0  # the answer is due (heartbeats are later)
    h.tick()
    assert h.received(1, PeersPendingResult) == h.received(2, PeersPendingResult) == [
        PeersPendingResult(pending=False)
    ]
    assert h.core.next_deadline() > 3.0  # no Tick loop on an answered question


def test_a_waiting_question_is_still_refused_beside_a_topology_vote() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.take_all()
    h.pending(1, wait=60.0)
    h.vote(2)
    [answer] = h.received(1, PeersPendingResult)
    assert not answer.pending and "update_topology" in answer.error


def test_a_waiting_question_is_answered_when_the_last_holdout_leaves() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.take_all()
    h.pending(1, wait=60.0)
    h.pending(2, wait=60.0)
    h.register(4)
    h.close(3)  # the holdout leaves while peer 4 waits: the askers learn it at once
    assert h.take(1) == h.take(2) == [PeersPendingResult(pending=True)]


@pytest.mark.parametrize("wait", [-1.0, MAX_PENDING_WAIT * 2])
def test_a_wait_out_of_range_is_refused_on_the_wire(wait: float) -> None:
    with pytest.raises(RemoteProtocolError, match="VotePeersPending.wait"):
        VotePeersPending(wait=wait)


# --- liveness -------------------------------------------------------------------------


def test_silent_unregistered_connection_is_closed() -> None:
    h = MasterHarness()
    h.open(1)
    assert h.core.next_deadline() == LIVENESS_TIMEOUT
    assert h.tick(LIVENESS_TIMEOUT - 0.001) == []
    assert h.core.next_deadline() == LIVENESS_TIMEOUT
    actions = h.tick()
    assert was_kicked(actions, 1)
    assert "liveness timeout" in (h.kick_reason(1) or "")
    assert h.core.next_deadline() == math.inf


def test_silent_peer_gets_heartbeats_then_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1)
    deadlines, sent = [], []
    while (deadline := h.core.next_deadline()) < math.inf:
        deadlines.append(deadline)
        sent.append([type(a.message) for a in h.tick() if isinstance(a, Send)])
    assert deadlines == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert sent == [[Heartbeat]] * 4 + [[Kick]]
    assert h.kick_reason(1) == "no message for 5.00s (liveness timeout 5.0s)"
    assert h.view(1) is None


def test_tick_before_a_deadline_does_nothing() -> None:
    h = MasterHarness()
    accepted(h, 1)
    deadline = h.core.next_deadline()
    assert h.tick(deadline - 1e-9) == []
    assert h.core.next_deadline() == deadline


def test_heartbeats_go_only_to_quiet_links() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.now = 0.5
    h.register(3)  # the master just sent to 3, so its link is not quiet
    actions = h.tick(1.0)
    assert {a.conn for a in actions} == {1, 2}
    assert all(isinstance(a, Send) and a.message == Heartbeat() for a in actions)
    assert h.core.next_deadline() == 1.5
    assert [a.conn for a in h.tick()] == [3]


def test_master_traffic_postpones_the_heartbeat() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.now = 0.5
    h.pending(1)  # answered at once: the master sent at 0.5
    assert h.core.next_deadline() == 1.5
    assert h.tick(1.0) == []


def test_peer_that_sends_heartbeats_stays() -> None:
    h = MasterHarness()
    accepted(h, 1)
    next_beat = 2.0
    while h.now < 100.0:
        deadline = h.core.next_deadline()
        if next_beat <= deadline:
            h.now = next_beat
            h.heartbeat(1)
            next_beat += 2.0
        else:
            h.tick()
            assert h.core.next_deadline() > deadline
    assert h.where(1) == (ACC, IDLE)
    assert len(h.received(1, Heartbeat)) >= 90  # one a second from the master


@pytest.mark.parametrize(
    ("start", "heartbeat_interval", "liveness_timeout"),
    [(0.7, 0.05, 0.1), (0.7, 0.1, 0.5), (1e15, 0.1, 0.3)],
)
def test_tick_exactly_at_the_deadline_acts(
    start: float, heartbeat_interval: float, liveness_timeout: float
) -> None:
    # The deadline is a float sum; judging it by a difference can round the other way
    # and leave the deadline in the past, where a shell would spin.
    h = MasterHarness(heartbeat_interval=heartbeat_interval, liveness_timeout=liveness_timeout)
    h.now = start
    h.open(1)
    h.register(2)
    while (deadline := h.core.next_deadline()) < math.inf:
        assert h.tick() != []
        assert h.core.next_deadline() > deadline
    assert h.closed.keys() == {1, 2}


@DETERMINISTIC
@given(
    start=st.floats(0, 1e9),
    heartbeat_interval=st.floats(1e-3, 10),
    ratio=st.floats(1.01, 20),
)
def test_every_deadline_tick_makes_progress(
    start: float, heartbeat_interval: float, ratio: float
) -> None:
    h = MasterHarness(
        heartbeat_interval=heartbeat_interval, liveness_timeout=heartbeat_interval * ratio
    )
    h.now = start
    h.open(1)
    h.register(2)
    for _ in range(100):
        deadline = h.core.next_deadline()
        if deadline == math.inf:
            break
        assert h.tick() != []
        assert h.core.next_deadline() > deadline
    assert h.closed.keys() == {1, 2}


def test_time_never_runs_backwards() -> None:
    h = MasterHarness()
    h.tick(10.0)
    h.now = 5.0
    h.open(1)
    assert h.core.next_deadline() == 10.0 + LIVENESS_TIMEOUT


# --- bad peers ------------------------------------------------------------------------


@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1])
def test_protocol_version_mismatch_is_kicked(version: int) -> None:
    h = MasterHarness()
    accepted(h, 1)
    actions = h.register(2, version=version)
    assert was_kicked(actions, 2)
    assert f"protocol version {version} is not supported" in (h.kick_reason(2) or "")
    assert [p.peer_id for p in h.core.peers()] == [1]


@pytest.mark.parametrize(
    ("first", "host", "advertised", "mixed"),
    [
        ("127.0.0.1", "10.0.0.2", "", True),
        ("10.0.0.1", "127.0.0.1", "", True),
        ("127.0.0.1", "127.0.0.1", "10.0.0.2", True),
        ("127.0.0.1", "::1", "", False),
        ("127.0.0.1", "localhost", "", False),
        ("10.0.0.1", "127.0.0.1", "10.0.0.2", False),
    ],
    ids=["loopback-then-lan", "lan-then-loopback", "advertised-lan", "ipv6-loopback",
         "localhost", "advertised-over-loopback-link"],
)
def test_loopback_and_non_loopback_peers_do_not_mix(
    first: str, host: str, advertised: str, mixed: bool
) -> None:
    h = MasterHarness()
    h.register(1, host=first)
    h.report(1)
    view = h.view(1)
    actions = h.register(2, host=host, advertised_host=advertised)
    assert was_kicked(actions, 2) == mixed
    if mixed:
        assert "mixes loopback and non-loopback" in (h.kick_reason(2) or "")
    assert h.view(1) == view


@pytest.mark.parametrize(
    "message",
    [VoteEstablish(accept_new_peers=True), P2PEstablished(round=1, success=True),
     VotePeersPending(), Heartbeat()],
    ids=lambda m: type(m).__name__,
)
def test_message_before_register_is_kicked(message: Message) -> None:
    h = MasterHarness()
    h.open(1)
    actions = h.send(1, message)
    assert was_kicked(actions, 1)
    assert h.kick_reason(1) == f"{type(message).__name__} before Register"


NOT_FROM_PEERS = [m for m in SAMPLES.values() if m.DIRECTION != C2M]


@pytest.mark.parametrize("registered", [False, True], ids=["unregistered", "registered"])
@pytest.mark.parametrize("message", NOT_FROM_PEERS, ids=lambda m: type(m).__name__)
def test_message_a_peer_may_not_send_is_kicked(message: Message, registered: bool) -> None:
    h = MasterHarness()
    if registered:
        accepted(h, 1)
    else:
        h.open(1)
    actions = h.send(1, message)
    assert was_kicked(actions, 1)
    assert h.kick_reason(1) == f"{type(message).__name__} is not a message a peer may send"


@pytest.mark.parametrize("registered", [False, True], ids=["unregistered", "registered"])
def test_broken_connection_is_kicked_as_malformed_input(registered: bool) -> None:
    h = MasterHarness()
    if registered:
        accepted(h, 1)
    else:
        h.open(1)
    actions = h.broken(1, "frame of 9999 bytes exceeds the 4096-byte limit")
    assert was_kicked(actions, 1)
    assert h.kick_reason(1) == "malformed input: frame of 9999 bytes exceeds the 4096-byte limit"
    assert h.core.peers() == []


def test_closed_connection_is_dropped_without_a_kick() -> None:
    h = MasterHarness()
    accepted(h, 1)
    assert h.close(1) == [Close(conn=1, reason="connection closed")]
    assert h.core.peers() == []
    assert h.core.next_deadline() == math.inf


def test_events_for_unknown_connections_are_ignored() -> None:
    h = MasterHarness()
    accepted(h, 1)
    h.register(2)
    h.close(2)
    before = h.core.peers()
    for conn in (2, 99):  # one that is gone, one that never was
        assert h.handle(MessageReceived(conn=conn, message=VoteEstablish(accept_new_peers=True))) == []
        assert h.handle(MessageReceived(conn=conn, message=Heartbeat())) == []
        assert h.handle(ConnectionBroken(conn=conn, reason="x")) == []
        assert h.handle(ConnectionClosed(conn=conn)) == []
    assert h.core.peers() == before


def test_connection_opened_twice_is_our_bug() -> None:
    h = MasterHarness()
    h.open(1)
    with pytest.raises(LocalProtocolError, match="opened twice"):
        h.open(1)


@pytest.mark.parametrize(
    ("heartbeat_interval", "liveness_timeout"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 1.0), (2.0, 1.0)]
)
def test_timers_must_be_ordered(heartbeat_interval: float, liveness_timeout: float) -> None:
    with pytest.raises(ValueError, match="heartbeat_interval < liveness_timeout"):
        MasterCore(heartbeat_interval=heartbeat_interval, liveness_timeout=liveness_timeout)


def test_participant_that_never_reports_is_removed_at_the_round_deadline() -> None:
    h = MasterHarness()
    h.join(1)
    h.register(2)
    h.vote(1)
    number = h.latest_round
    h.report(1, number, ok=True)
    start = h.now
    # Both stay alive (heartbeats), but peer 2 never reports on its connections.
    while h.now < start + 30.0 - 1.0:
        h.tick(h.now + 1.0)
        h.heartbeat(1)
        h.heartbeat(2)
        assert h.view(2) is not None
    actions = h.tick(start + 30.0)
    assert was_kicked(actions, 2)
    assert "did not report" in (h.kick_reason(2) or "")
    result = h.last(1, P2PEstablishResult)
    assert result.round == number and not result.success  # the round failed without it
