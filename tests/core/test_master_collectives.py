"""MasterCore collectives: consensus, rejection, stale rings, aborts, legality, and a
seeded simulation of a peer group running many tagged all-reduces through churn.

The harness checks on every action that each initiate gets at most one verdict (seq 0
if it never ran, else the seq of its commence), that aborts go only to running,
uncompleted attempts and at most once, and that commence seqs only grow; the tests here
check the rest: who gets what, when, and why.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Callable

import pytest

from pccl_trio._core.master import Action, CancelSolve, Close, PeerPhase, PeerState, Send, Solve
from pccl_trio._core.messages import (
    ABORTED,
    REJECTED,
    SUCCESS,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    Heartbeat,
    Kick,
    Message,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
    Welcome,
)

from .master_harness import (
    COUNT,
    FLOAT,
    HEARTBEAT_INTERVAL,
    LIVENESS_TIMEOUT,
    SUM,
    MasterHarness,
    only,
    was_kicked,
)
from .test_master_simulation import MASTER_STATE
from .test_master_transitions import (
    Setup,
    accepted_connecting,
    accepted_failed_after_round,
    accepted_failed_mid_round,
    accepted_idle,
    accepted_optimize_voted,
    accepted_optimizing,
    accepted_voted,
    accepted_waiting,
    joiner_connecting,
    joiner_failed,
    joiner_waiting,
    registered_mid_round,
    registered_waiting,
)

ACC = PeerPhase.ACCEPTED
IDLE, FAIL = PeerState.IDLE, PeerState.CONNECT_FAILED
DOUBLE, AVG, MIN_MAX, ZPS, UINT8, FLOAT16 = 11, 1, 1, 2, 0, 8
STALE_REASON = "must be re-established"


# --- helpers --------------------------------------------------------------------------


def run_with(h: MasterHarness, groups: dict[int, int]) -> None:
    """Make the peers on ``groups``' conns (conn -> peer group; peer id == conn) the
    accepted peers, each IDLE, after one successful round."""
    conns = list(groups)
    h.register(conns[0], groups[conns[0]])
    h.report(conns[0])
    for conn in conns[1:]:
        h.register(conn, groups[conn])
    if len(conns) > 1:
        h.vote(conns[0])
        for conn in conns:
            h.report(conn)
    for conn in conns:
        assert h.where(conn) == (ACC, IDLE)
        assert h.peer_ids[conn] == conn
    h.take_all()


def accepted(h: MasterHarness, *conns: int) -> None:
    run_with(h, dict.fromkeys(conns, 0))


def got(h: MasterHarness, conn: int) -> list[Message]:
    """What ``conn`` was sent since the last look, heartbeats aside."""
    return [m for m in h.take(conn) if not isinstance(m, Heartbeat)]


def started(h: MasterHarness, tag: int, *conns: int) -> int:
    """Every one of ``conns`` (the whole group) initiates ``tag`` alike; it commences
    once the last did, on the group's ring. Returns its seq."""
    h.take_all()
    for conn in conns[:-1]:
        h.initiate(conn, tag)
        assert all(got(h, c) == [] for c in conns)
    h.initiate(conns[-1], tag)
    seq = h.last(conns[0], CollectiveCommence).seq
    ring = tuple(h.core.ring(group_of(h, conns[0])))
    assert sorted(ring) == sorted(conns)
    for conn in conns:
        assert got(h, conn) == [CollectiveCommence(tag=tag, seq=seq, ring=ring)]
    return seq


def group_of(h: MasterHarness, conn: int) -> int:
    view = h.view(conn)
    assert view is not None
    return view.peer_group


def only_verdict(h: MasterHarness, conn: int) -> CollectiveVerdict:
    """``conn`` was sent exactly one message since the last look: a verdict."""
    messages = got(h, conn)
    assert len(messages) == 1 and isinstance(messages[0], CollectiveVerdict), messages
    return messages[0]


def reestablish(h: MasterHarness, *conns: int) -> None:
    """``conns`` (every member) vote without admitting anyone; the round succeeds."""
    for conn in conns:
        h.vote(conn, accept=False)
    for conn in conns:
        h.report(conn)
    for conn in conns:
        assert h.last(conn, P2PEstablishResult).success
        assert h.where(conn) == (ACC, IDLE)
    h.take_all()


def fall_silent(h: MasterHarness, conn: int, *others: int) -> None:
    """``conn`` says nothing while ``others`` keep talking, until the master drops it."""
    while h.view(conn) is not None:
        for other in others:
            h.heartbeat(other)
        h.tick(h.now + HEARTBEAT_INTERVAL)
    assert (h.kick_reason(conn) or "").startswith("no message for")


# --- commence and success -------------------------------------------------------------


def test_collective_commences_once_every_member_initiated() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    seq = started(h, 5, 1, 2, 3)
    assert seq == 1


def test_collective_succeeds_once_every_participant_completed() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    seq = started(h, 5, 3, 1, 2)
    h.complete(1, 5)
    h.complete(3, 5)
    assert all(got(h, c) == [] for c in (1, 2, 3))  # no verdict before the last
    h.complete(2, 5)
    for conn in (1, 2, 3):
        assert got(h, conn) == [CollectiveVerdict(tag=5, seq=seq, outcome=SUCCESS)]


def test_a_tag_is_free_again_after_its_verdict() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    first = started(h, 5, 1, 2)
    h.complete(1, 5)
    h.complete(2, 5)
    second = started(h, 5, 2, 1)
    assert second > first


def test_waiting_peers_take_no_part() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.register(3)  # waits for a round that admits it
    h.take_all()
    seq = started(h, 5, 1, 2)
    h.complete(1, 5)
    h.complete(2, 5)
    assert only_verdict(h, 1).seq == seq
    assert got(h, 3) == []


def test_a_lone_member_runs_alone() -> None:
    # The master has no minimum group size (the peer refuses a one-peer all-reduce).
    h = MasterHarness()
    accepted(h, 1)
    seq = started(h, 0, 1)
    h.complete(1, 0)
    assert only_verdict(h, 1) == CollectiveVerdict(tag=0, seq=seq, outcome=SUCCESS)


def test_concurrent_tags_commence_in_consensus_order_with_fresh_seqs() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    orders = {1: (1, 2, 3), 2: (3, 2, 1), 3: (2, 3, 1)}
    for position in range(3):
        for conn, tags in orders.items():
            h.initiate(conn, tags[position])
    # Tag 2 is agreed first (at peer 2's second initiate), then 3, then 1.
    for conn in (1, 2, 3):
        assert [(m.tag, m.seq) for m in h.received(conn, CollectiveCommence)] == [
            (2, 1), (3, 2), (1, 3)
        ]
    h.take_all()
    # Aborting one tag leaves the others running.
    h.complete(2, 3, aborted=True)
    assert got(h, 1) == [CollectiveAbort(tag=3, seq=2, reason="peer 2 failed during the collective")]
    for conn in (1, 2, 3):
        for tag in (1, 2):
            h.complete(conn, tag)
    h.complete(1, 3)
    h.complete(3, 3)
    outcomes = {(v.tag, v.seq, v.outcome) for c in (1, 2, 3) for v in h.received(c, CollectiveVerdict)}
    assert outcomes == {(1, 3, SUCCESS), (2, 1, SUCCESS), (3, 2, ABORTED)}
    assert all(len(h.received(c, CollectiveVerdict)) == 3 for c in (1, 2, 3))


def test_the_same_tag_in_two_groups_is_two_collectives() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    h.initiate(1, 5)
    h.initiate(3, 5)
    h.initiate(2, 5)
    assert got(h, 1) == got(h, 2) == [CollectiveCommence(tag=5, seq=1, ring=(1, 2))]
    assert got(h, 3) == []  # group 1 still waits for peer 4
    h.initiate(4, 5, count=COUNT + 1)  # a disagreement in group 1 only
    assert only_verdict(h, 3).outcome == only_verdict(h, 4).outcome == REJECTED
    h.complete(1, 5)
    h.complete(2, 5)
    assert only_verdict(h, 1).outcome == only_verdict(h, 2).outcome == SUCCESS


# --- disagreement -------------------------------------------------------------------

DISAGREEMENTS: dict[str, tuple[dict[str, int], dict[str, int], tuple[str, ...]]] = {
    # field: (what peers 1 and 2 pass, what the odd one passes, what the reason must say)
    "count": ({}, {"count": COUNT + 1}, ("count=16", "count=17")),
    "dtype": ({}, {"dtype": DOUBLE}, ("dtype=FLOAT", "dtype=DOUBLE")),
    "op": ({}, {"op": AVG}, ("op=SUM", "op=AVG")),
    "quantization": (
        {}, {"quantization": MIN_MAX, "quantized_dtype": UINT8}, ("quantization=MIN_MAX",)
    ),
    "quantized_dtype": (
        {"quantization": MIN_MAX, "quantized_dtype": UINT8},
        {"quantization": MIN_MAX, "quantized_dtype": FLOAT16},
        ("MIN_MAX->UINT8", "MIN_MAX->FLOAT16"),
    ),
    "distribution_hint": (
        {"quantization": ZPS, "quantized_dtype": UINT8, "distribution_hint": 1},
        {"quantization": ZPS, "quantized_dtype": UINT8, "distribution_hint": 2},
        ("distribution_hint=NORMAL", "distribution_hint=UNIFORM"),
    ),
    "everything": (
        {}, {"count": 3, "dtype": DOUBLE, "op": AVG}, ("count=3", "dtype=DOUBLE", "op=AVG")
    ),
}


@pytest.mark.parametrize("odd", [1, 3], ids=["odd-first", "odd-last"])
@pytest.mark.parametrize("field", list(DISAGREEMENTS))
def test_disagreeing_initiates_are_rejected_for_everyone(field: str, odd: int) -> None:
    common, different, mentions = DISAGREEMENTS[field]
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    for conn in (1, 2, 3):
        h.initiate(conn, 5, **(different if conn == odd else common))
        if conn != 3:
            assert all(got(h, c) == [] for c in (1, 2, 3))  # decided only once all voted
    verdicts = [only_verdict(h, conn) for conn in (1, 2, 3)]
    assert len(set(verdicts)) == 1
    (verdict,) = set(verdicts)
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, 0, REJECTED)
    assert "tag 5" in verdict.reason
    assert all(f"peer {conn}:" in verdict.reason for conn in (1, 2, 3))
    assert all(text in verdict.reason for text in mentions), verdict.reason
    # A disagreement is no failure: the ring is fine, and the tag is free again.
    started(h, 5, 1, 2, 3)


def test_quantized_dtype_counts_even_without_quantization() -> None:
    # All five fields must match, even the quantized dtype of an unquantized all-reduce
    # (the shipped peer sends its dtype there, so peers that agree on dtype agree on it).
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5, quantized_dtype=FLOAT)
    h.initiate(2, 5, quantized_dtype=DOUBLE)
    verdict = only_verdict(h, 1)
    assert verdict.outcome == REJECTED and only_verdict(h, 2) == verdict
    assert "peer 1:" in verdict.reason and "peer 2:" in verdict.reason


def test_an_invalid_completion_rejects_the_collective_for_everyone() -> None:
    # A peer that cannot quantize its data reports why; the others are stopped and
    # every participant gets the same REJECTED verdict carrying that reason.
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    seq = started(h, 5, 1, 2, 3)
    h.complete(2, 5, aborted=True, invalid="NaN among the values")
    assert got(h, 1) == got(h, 3) == [
        CollectiveAbort(tag=5, seq=seq, reason="peer 2: NaN among the values")
    ]
    h.complete(1, 5, aborted=True)
    assert got(h, 1) == []  # no verdict before everyone completed
    h.complete(3, 5, aborted=True)
    verdicts = {only_verdict(h, conn) for conn in (1, 2, 3)}
    assert verdicts == {
        CollectiveVerdict(tag=5, seq=seq, outcome=REJECTED, reason="peer 2: NaN among the values")
    }


def test_an_invalid_completion_after_an_abort_keeps_the_abort() -> None:
    # The first cause decides: a failure already aborted it, so a retry makes sense.
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    started(h, 5, 1, 2, 3)
    h.complete(1, 5, aborted=True)
    h.complete(2, 5, aborted=True, invalid="NaN among the values")
    h.complete(3, 5, aborted=True)
    verdicts = {v for c in (1, 2, 3) for v in h.received(c, CollectiveVerdict)}
    assert {(v.outcome, v.reason) for v in verdicts} == {
        (ABORTED, "peer 1 failed during the collective")
    }


def test_disagreement_wins_over_a_stale_ring() -> None:
    # Both would end it at consensus; the rejection says what the callers must fix.
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.close(3)
    h.initiate(1, 5)
    h.initiate(2, 5, op=AVG)
    assert only_verdict(h, 1).outcome == only_verdict(h, 2).outcome == REJECTED


# --- a stale ring -------------------------------------------------------------------


def leave_by_close(h: MasterHarness) -> tuple[int, ...]:
    h.close(4)
    return (1, 2, 3)


def leave_by_break(h: MasterHarness) -> tuple[int, ...]:
    h.broken(4)
    return (1, 2, 3)


def leave_by_silence(h: MasterHarness) -> tuple[int, ...]:
    fall_silent(h, 4, 1, 2, 3)
    return (1, 2, 3)


def leave_by_kick(h: MasterHarness) -> tuple[int, ...]:
    assert was_kicked(h.send(4, CollectiveComplete(tag=9, seq=1, aborted=False)), 4)
    return (1, 2, 3)


def leave_mid_round(h: MasterHarness) -> tuple[int, ...]:
    for conn in (1, 2, 3, 4):
        h.vote(conn, accept=False)
    h.report(1)
    h.close(4)
    h.report(2)
    h.report(3)
    assert not h.last(1, P2PEstablishResult).success
    return (1, 2, 3)


def failed_round(h: MasterHarness) -> tuple[int, ...]:
    for conn in (1, 2, 3, 4):
        h.vote(conn, accept=False)
    h.report(1, ok=False)
    for conn in (2, 3, 4):
        h.report(conn)
    assert h.where(1) == (ACC, FAIL)
    return (1, 2, 3, 4)


def joiner_lost_mid_round(h: MasterHarness) -> tuple[int, ...]:
    h.register(5)
    for conn in (1, 2, 3, 4):
        h.vote(conn, accept=True)
    h.close(5)
    for conn in (1, 2, 3, 4):
        h.report(conn)
    assert not h.last(1, P2PEstablishResult).success
    return (1, 2, 3, 4)


STALENESS = [
    leave_by_close, leave_by_break, leave_by_silence, leave_by_kick, leave_mid_round,
    failed_round, joiner_lost_mid_round,
]


@pytest.mark.parametrize("make_stale", STALENESS, ids=lambda f: f.__name__)
def test_stale_ring_aborts_at_consensus_until_reestablished(
    make_stale: Callable[[MasterHarness], tuple[int, ...]],
) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3, 4)
    members = make_stale(h)
    h.take_all()
    for conn in members[:-1]:
        h.initiate(conn, 5)
        assert all(got(h, c) == [] for c in members)
    h.initiate(members[-1], 5)
    verdicts = {only_verdict(h, conn) for conn in members}
    assert len(verdicts) == 1
    (verdict,) = verdicts
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, 0, ABORTED)
    assert STALE_REASON in verdict.reason
    # Still stale for the next tag, until a round succeeds.
    for conn in members:
        h.initiate(conn, 6)
    assert {only_verdict(h, conn).outcome for conn in members} == {ABORTED}
    reestablish(h, *members)
    started(h, 5, *members)


def test_staleness_reaches_a_collective_already_waiting() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.initiate(1, 5)
    h.close(3)
    assert got(h, 1) == []  # peer 2 has not initiated yet
    h.initiate(2, 5)
    assert only_verdict(h, 1) == only_verdict(h, 2)
    assert h.last(1, CollectiveVerdict).outcome == ABORTED


def test_initiators_that_all_left_leave_nothing_behind() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.initiate(1, 5)
    h.close(1)
    h.initiate(2, 5)
    h.initiate(3, 5)  # peer 1's vote went with it: this is a fresh consensus (stale)
    assert only_verdict(h, 2).outcome == only_verdict(h, 3).outcome == ABORTED
    reestablish(h, 2, 3)
    started(h, 5, 2, 3)


def test_a_waiting_peer_leaving_leaves_the_ring_fresh() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.register(3)
    h.close(3)
    started(h, 5, 1, 2)


def test_a_stale_ring_in_another_group_does_not_matter() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    h.close(4)
    started(h, 5, 1, 2)
    h.initiate(3, 5)  # alone in group 1 now, whose ring is stale
    assert only_verdict(h, 3).outcome == ABORTED


def test_a_new_run_in_an_emptied_group_starts_fresh() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    started(h, 5, 1, 2)
    h.close(1)
    h.close(2)  # the collective ends with nobody to tell
    h.register(3)  # admitted at once: nobody is left to ask
    h.report(3)
    assert h.last(3, P2PEstablishResult).success
    h.take_all()
    seq = started(h, 5, 3)
    assert seq == 2


# The bug this found: a failure reported mid-round did not mark the ring stale until the
# round ended, so peers whose own report had failed could commence on the old ring while
# the rest of the round was still connecting (and a joiner of that round was then
# kicked for initiating the tag "running without it").


def failed_before_a_joiner_reports(h: MasterHarness) -> tuple[int, ...]:
    accepted(h, 1, 2)
    h.register(3)
    h.vote(1)
    h.vote(2)
    return (3,)


def failed_before_another_group_reports(h: MasterHarness) -> tuple[int, ...]:
    run_with(h, {1: 0, 2: 0, 3: 1})
    for conn in (1, 2, 3):
        h.vote(conn, accept=False)
    return (3,)


@pytest.mark.parametrize(
    "setup", [failed_before_a_joiner_reports, failed_before_another_group_reports],
    ids=lambda f: f.__name__,
)
def test_a_failure_reported_mid_round_makes_the_ring_stale_at_once(
    setup: Callable[[MasterHarness], tuple[int, ...]],
) -> None:
    h = MasterHarness()
    late = setup(h)
    h.report(1, ok=False)
    h.report(2, ok=False)
    assert h.core.round_in_progress
    h.take_all()
    h.initiate(1, 5)
    h.initiate(2, 5)
    verdicts = [only_verdict(h, conn) for conn in (1, 2)]
    assert verdicts[0] == verdicts[1]
    assert (verdicts[0].seq, verdicts[0].outcome) == (0, ABORTED)
    for conn in late:
        h.report(conn)
    assert not h.last(1, P2PEstablishResult).success
    everyone = (1, 2, *late)
    reestablish(h, *everyone)
    started(h, 5, *(c for c in everyone if group_of(h, c) == 0))


# --- a member voting to re-establish --------------------------------------------------


def test_a_member_voting_to_reestablish_aborts_the_waiting_collectives() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.initiate(1, 5)
    h.initiate(1, 6)
    h.initiate(2, 5)
    h.vote(3, accept=False)
    one = h.take(1)
    assert all(isinstance(v, CollectiveVerdict) for v in one)
    verdicts = [v for v in one if isinstance(v, CollectiveVerdict)]
    assert [(v.tag, v.seq, v.outcome) for v in verdicts] == [(5, 0, ABORTED), (6, 0, ABORTED)]
    assert only_verdict(h, 2) == verdicts[0]
    assert all("peer 3 voted to re-establish" in v.reason for v in verdicts)
    assert got(h, 3) == []
    # Free of collectives, the others may vote too: the round starts.
    h.vote(1, accept=False)
    h.vote(2, accept=False)
    assert all(h.last(c, P2PInfo) for c in (1, 2, 3))


def test_initiating_while_a_member_votes_is_aborted_at_once() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.vote(2)
    h.initiate(1, 5)
    verdict = only_verdict(h, 1)
    assert (verdict.seq, verdict.outcome) == (0, ABORTED) and "peer 2" in verdict.reason


def test_a_voter_in_another_group_does_not_abort() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.vote(3)
    started(h, 5, 1, 2)


def in_flight_initiated(h: MasterHarness) -> None:
    h.initiate(1, 5)


def in_flight_running(h: MasterHarness) -> None:
    started(h, 5, 1, 2)


def in_flight_completed(h: MasterHarness) -> None:
    started(h, 5, 1, 2)
    h.complete(1, 5)  # the verdict waits for peer 2


@pytest.mark.parametrize(
    "in_flight", [in_flight_initiated, in_flight_running, in_flight_completed],
    ids=lambda f: f.__name__,
)
def test_vote_with_a_collective_in_flight_is_kicked(in_flight: Callable[[MasterHarness], None]) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    in_flight(h)
    h.take_all()
    assert was_kicked(h.vote(1), 1)
    assert "collectives in flight (tags [5])" in (h.kick_reason(1) or "")
    if in_flight is in_flight_initiated:
        assert got(h, 2) == []
    else:
        (abort,) = got(h, 2)
        assert isinstance(abort, CollectiveAbort) and "peer 1 left" in abort.reason
        h.complete(2, 5)
        assert only_verdict(h, 2).outcome == ABORTED


def test_vote_after_the_verdict_is_fine() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    started(h, 5, 1, 2)
    h.complete(1, 5, aborted=True)
    h.complete(2, 5)
    h.take_all()
    assert only(h.vote(1, accept=False), 1) == []
    assert h.where(1) == (ACC, PeerState.VOTE_ESTABLISH)


# --- the pending-peers vote against a topology vote ----------------------------------


@pytest.mark.parametrize("voter_group", [0, 1], ids=["same-group", "other-group"])
def test_pending_vote_is_refused_while_a_member_votes_to_reestablish(voter_group: int) -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: voter_group})
    h.pending(1)
    assert got(h, 1) == []
    h.vote(3)
    (result,) = got(h, 1)
    assert isinstance(result, PeersPendingResult)
    assert not result.pending and "peer 3 called update_topology" in result.error
    assert got(h, 2) == got(h, 3) == []
    h.pending(2)  # asked after the vote: refused at once
    (result,) = got(h, 2)
    assert isinstance(result, PeersPendingResult) and result.error
    # Refused, the askers may vote too, and the round starts.
    h.vote(1)
    h.vote(2)
    assert all(h.last(c, P2PInfo) for c in (1, 2, 3))


# --- aborting a running collective ----------------------------------------------------


def abort_by_failure(h: MasterHarness) -> str:
    h.complete(1, 5, aborted=True)
    return "peer 1 failed during the collective"


def abort_by_close(h: MasterHarness) -> str:
    h.close(1)
    return "peer 1 left the run (connection closed)"


def abort_by_break(h: MasterHarness) -> str:
    h.broken(1)
    return "peer 1 left the run (malformed input"


def abort_by_silence(h: MasterHarness) -> str:
    fall_silent(h, 1, 2, 3, 4)
    return "peer 1 left the run (no message for"


def abort_by_kick(h: MasterHarness) -> str:
    h.complete(1, 5, seq=99)
    return "peer 1 left the run (illegal CollectiveComplete"


ABORTS = [abort_by_failure, abort_by_close, abort_by_break, abort_by_silence, abort_by_kick]


@pytest.mark.parametrize("done_before", [0, 1, 3], ids=lambda n: f"{n}-done-before")
@pytest.mark.parametrize("abort", ABORTS, ids=lambda f: f.__name__)
def test_an_abort_reaches_every_unfinished_participant_once(
    abort: Callable[[MasterHarness], str], done_before: int
) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3, 4)
    seq = started(h, 5, 1, 2, 3, 4)
    done = (2, 3, 4)[:done_before]
    for conn in done:
        h.complete(conn, 5)
    reason = abort(h)
    stays = abort is abort_by_failure
    rest = [c for c in (2, 3, 4) if c not in done]
    for conn in rest:
        (message,) = got(h, conn)
        assert isinstance(message, CollectiveAbort)
        assert (message.tag, message.seq) == (5, seq) and message.reason.startswith(reason)
    for conn in rest:  # they finish, aborted or not
        assert got(h, conn) == []
        h.complete(conn, 5, aborted=conn == 3)
    survivors = [1, *done, *rest] if stays else [*done, *rest]
    verdicts = {only_verdict(h, conn) for conn in sorted(survivors)}
    assert len(verdicts) == 1
    (verdict,) = verdicts
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, seq, ABORTED)
    assert verdict.reason.startswith(reason)  # the first cause
    if not stays:
        assert h.received(1, CollectiveVerdict) == []
        assert 1 in h.closed


def test_a_second_failure_sends_no_second_abort() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3, 4)
    seq = started(h, 5, 1, 2, 3, 4)
    h.complete(1, 5, aborted=True)
    h.close(2)
    h.complete(3, 5, aborted=True)
    assert len(h.received(3, CollectiveAbort)) == len(h.received(4, CollectiveAbort)) == 1
    h.take_all()
    h.complete(4, 5, aborted=True)
    for conn in (1, 3, 4):
        assert only_verdict(h, conn) == CollectiveVerdict(
            tag=5, seq=seq, outcome=ABORTED, reason="peer 1 failed during the collective"
        )


def test_a_collective_every_participant_left_just_ends() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    started(h, 5, 1, 2, 3)
    h.complete(3, 5)
    h.close(1)
    h.close(2)
    assert only_verdict(h, 3).outcome == ABORTED
    for conn in (1, 2):
        assert h.received(conn, CollectiveVerdict) == []


def test_an_abort_makes_no_ring_stale_by_itself() -> None:
    # A local failure aborts the attempt; the peers decide to re-establish (the shipped
    # peer does), the master does not insist.
    h = MasterHarness()
    accepted(h, 1, 2)
    started(h, 5, 1, 2)
    h.complete(1, 5, aborted=True)
    h.complete(2, 5)
    h.take_all()
    started(h, 5, 1, 2)


# --- what a peer may send when --------------------------------------------------------

INITIATE_BY_STATE: list[tuple[Setup, str | None]] = [
    (registered_waiting, "before being accepted"),
    (registered_mid_round, "before being accepted"),
    (joiner_connecting, "before being accepted"),
    (joiner_waiting, "before being accepted"),
    (joiner_failed, "before being accepted"),
    (accepted_idle, None),
    (accepted_voted, "not allowed in state VOTE_ESTABLISH"),
    (accepted_connecting, "not allowed in state CONNECTING"),
    (accepted_waiting, "not allowed in state WAITING"),
    (accepted_failed_mid_round, None),
    (accepted_failed_after_round, None),
    (accepted_optimize_voted, "not allowed in state VOTE_OPTIMIZE"),
    (accepted_optimizing, "not allowed in state OPTIMIZING"),
]


@pytest.mark.parametrize(
    ("setup", "kicked_for"), INITIATE_BY_STATE, ids=[s.__name__ for s, _ in INITIATE_BY_STATE]
)
def test_initiate_in_state(setup: Setup, kicked_for: str | None) -> None:
    h = MasterHarness()
    subject, other = setup(h)
    before, other_before = h.view(subject), h.view(other)
    h.take_all()
    actions = h.initiate(subject, 5)
    if kicked_for is not None:
        assert was_kicked(actions, subject)
        assert kicked_for in (h.kick_reason(subject) or "")
        assert only(actions, other) == []
        return
    assert actions == []  # a vote, waiting for the other peer
    assert h.view(subject) == before and h.view(other) == other_before


def running(h: MasterHarness) -> int:
    """Peers 1 and 2 (group 0) run tag 5 as its second attempt; peer 3 (group 1) and
    a waiting peer 4 (group 0) look on. Returns the seq."""
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.register(4)
    started(h, 5, 1, 2)
    h.complete(1, 5)
    h.complete(2, 5)
    h.take_all()
    return started(h, 5, 1, 2)


# name -> (who sends, the message (from the running seq), the kick reason or None)
COMPLETES: dict[str, tuple[int, Callable[[int], CollectiveComplete], str | None]] = {
    "ok": (1, lambda s: CollectiveComplete(tag=5, seq=s, aborted=False), None),
    "ok-aborted": (1, lambda s: CollectiveComplete(tag=5, seq=s, aborted=True), None),
    "next-seq": (1, lambda s: CollectiveComplete(tag=5, seq=s + 1, aborted=False),
                 "attempt 2 runs"),
    "previous-seq": (1, lambda s: CollectiveComplete(tag=5, seq=s - 1, aborted=False),
                     "attempt 2 runs"),
    "seq-0": (1, lambda s: CollectiveComplete(tag=5, seq=0, aborted=False), "attempt 2 runs"),
    "unknown-tag": (1, lambda s: CollectiveComplete(tag=6, seq=s, aborted=False),
                    "not running"),
    "other-group": (3, lambda s: CollectiveComplete(tag=5, seq=s, aborted=False),
                    "not running"),
    "waiting-peer": (4, lambda s: CollectiveComplete(tag=5, seq=s, aborted=False),
                     "not running"),
}


@pytest.mark.parametrize("name", list(COMPLETES))
def test_complete(name: str) -> None:
    sender, make, kicked_for = COMPLETES[name]
    h = MasterHarness()
    seq = running(h)
    assert seq == 2
    actions = h.send(sender, make(seq))
    if kicked_for is None:
        assert only(actions, sender) == []
        return
    assert was_kicked(actions, sender)
    assert kicked_for in (h.kick_reason(sender) or "")
    if sender == 1:  # a participant left: the attempt is aborted for the other
        assert isinstance(h.last(2, CollectiveAbort), CollectiveAbort)


def test_complete_twice_is_kicked() -> None:
    h = MasterHarness()
    seq = running(h)
    h.complete(1, 5)
    assert was_kicked(h.complete(1, 5, seq), 1)
    assert "twice" in (h.kick_reason(1) or "")


def test_complete_while_only_initiated_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5)
    assert was_kicked(h.complete(1, 5, seq=1), 1)
    assert "not running" in (h.kick_reason(1) or "")


def test_complete_after_the_verdict_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    seq = started(h, 5, 1, 2)
    h.complete(1, 5)
    h.complete(2, 5)
    assert was_kicked(h.complete(1, 5, seq), 1)
    assert "not running" in (h.kick_reason(1) or "")


def dup_waiting(h: MasterHarness) -> None:
    h.initiate(1, 5)


def dup_running(h: MasterHarness) -> None:
    started(h, 5, 1, 2, 3)


def dup_completed(h: MasterHarness) -> None:
    started(h, 5, 1, 2, 3)
    h.complete(1, 5)


@pytest.mark.parametrize("first", [dup_waiting, dup_running, dup_completed], ids=lambda f: f.__name__)
def test_initiating_a_tag_in_flight_is_kicked(first: Callable[[MasterHarness], None]) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    first(h)
    assert was_kicked(h.initiate(1, 5), 1)
    assert "tag 5 is already in flight" in (h.kick_reason(1) or "")
    if first is dup_waiting:  # the others' collective goes on, and ends as stale
        h.initiate(2, 5)
        h.initiate(3, 5)
        assert only_verdict(h, 2).outcome == ABORTED
    else:
        h.complete(2, 5)
        h.complete(3, 5)
        assert h.last(2, CollectiveVerdict).outcome == ABORTED


# --- a seeded simulation -------------------------------------------------------------
#
# One peer group of 3 to 6 accepted peers, plus joiners now and then, next to a bystander
# group (one peer at first) that takes part in rounds, reports slowly and runs no
# collective. Each simulated peer behaves like the shipped client: it initiates tags
# (sometimes with a descriptor that disagrees), completes what commenced (sometimes
# failing), and once it has nothing in flight votes to re-establish the ring (without
# admitting anyone) after an ABORTED verdict or a failed round, or now and then calls
# update_topology (admitting joiners). Unlike the shipped client, a member whose own
# report failed sometimes initiates before the round is over (legal; this found a bug).
# Some rounds are doomed (every report fails). Peers die, break their connections and
# fall silent. After every step the simulation checks, from the messages alone:
#   - every participant (seq 0: every live initiator) gets exactly one verdict, in the
#     step that decides it, and all of them the same one;
#   - the outcome is the one the protocol prescribes (an oracle from the model);
#   - no commence while the group's ring is stale or a round runs; a commence goes to
#     every live member, on a ring of exactly the live members;
#   - an abort reaches each unfinished live participant once, only after a failure;
#   - nothing is stuck: no collective waits once every live member initiated it, or
#     once every live participant completed it, or while a member votes;
#   - seqs are unique and increasing;
# and in the end, with churn over, everyone settles, re-establishes and runs one more
# collective that succeeds.

TAGS = range(4)
GOOD_KICKS = ("no message for", "malformed input", "did not report on its p2p connections")


def canonical(tag: int) -> CollectiveInitiate:
    return CollectiveInitiate(
        tag=tag, count=COUNT + tag, dtype=FLOAT, op=SUM, quantized_dtype=0, quantization=0
    )


def key(message: CollectiveInitiate) -> tuple[int, ...]:
    return (message.count, message.dtype, message.op, message.quantized_dtype,
            message.quantization)


@dataclasses.dataclass
class SimTag:
    seq: int = 0  # 0 until it commences here
    completed: bool = False
    abort_seen: bool = False


@dataclasses.dataclass
class SimPeer:
    conn: int
    group: int = 0  # 1: a bystander, in rounds but in no collective
    peer_id: int = 0
    status: str = "waiting"  # as in test_master_simulation
    member: bool = False
    silent: bool = False
    pending_out: bool = False
    ring_stale: bool = False  # an ABORTED verdict or a failed round since its last good one
    tags: dict[int, SimTag] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Epoch:
    """One use of a tag, from its first initiate to its verdicts."""

    tag: int
    initiates: dict[int, CollectiveInitiate] = dataclasses.field(default_factory=dict)
    seq: int = 0
    participants: set[int] = dataclasses.field(default_factory=set)  # live ones
    completed: set[int] = dataclasses.field(default_factory=set)
    cause: str = ""  # why the running attempt aborts
    cause_step: int = -1
    aborts: set[int] = dataclasses.field(default_factory=set)  # sent CollectiveAbort
    expected: set[int] | None = None  # who must hear this step's commence or verdict
    heard: set[int] = dataclasses.field(default_factory=set)
    verdict: CollectiveVerdict | None = None


class CollectiveSimulation:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.h = MasterHarness()
        self.size = 3 + seed % 4
        self.peers: dict[int, SimPeer] = {}  # live peers by conn
        self.epochs: dict[int, Epoch] = {}  # open ones by tag
        self.stale = False  # group 0's ring is stale (our model of the master)
        self.next_conn = 1
        self.step = 0
        self.max_seq = 0
        self.stats: Counter[str] = Counter()
        self.breaking = 0
        self.mismatch = 0.06
        self.round = 0
        self.doomed = False  # every report of the current round fails
        for _ in range(self.size):
            self.do("join", 0, group=0)
        self.do("join", 0, group=1)
        self.settle()
        assert len(self.members(0)) == self.size and len(self.members(1)) == 1

    # --- choices -------------------------------------------------------------------

    def members(self, group: int | None = None) -> list[SimPeer]:
        return [p for p in self.peers.values() if p.member and group in (None, p.group)]

    def options(self) -> list[tuple[str, int, float]]:
        found: list[tuple[str, int, float]] = [("advance", 0, 1.0)]
        if len(self.peers) < 8:
            found.append(("join", 0, 0.15))
        polling = any(p.pending_out for p in self.peers.values())
        voting = any(p.status == "voted" for p in self.peers.values())
        for conn, peer in self.peers.items():
            if peer.silent:
                continue
            found += [("die", conn, 0.03), ("silence", conn, 0.01)]
            if peer.status == "in_round":  # a bystander is slow: others report first
                found.append(("report", conn, 0.25 if peer.group else 3.0))
            for tag, state in peer.tags.items():
                if state.seq and not state.completed:
                    found.append((f"complete:{tag}", conn, 3.0 if state.abort_seen else 1.0))
            collective = peer.member and peer.group == 0 and len(peer.tags) < len(TAGS)
            if collective and peer.status == "reported_failed":
                # Legal, if not what the shipped client does: its own report failed, the
                # round is not over. The ring is stale already: this must not commence.
                found.append(("initiate", conn, 1.5))
            if not peer.member or peer.status not in ("idle", "failed"):
                continue
            if collective:
                found.append(("initiate", conn, 0.4 if peer.ring_stale else 2.5))
            if not peer.tags and not peer.pending_out:
                must = peer.ring_stale or voting or peer.status == "failed"
                found.append(("vote", conn, 4.0 if must else 0.08))
                found.append(("pending", conn, 2.0 if polling else 0.05))
        return found

    def random_step(self) -> None:
        options = self.options()
        (name, conn, _weight), = self.rng.choices(options, weights=[w for *_, w in options])
        self.do(name, conn)

    def do(
        self,
        name: str,
        conn: int,
        *,
        group: int | None = None,
        ok: bool | None = None,
        accept: bool | None = None,
        tag: int | None = None,
        descriptor: CollectiveInitiate | None = None,
        aborted: bool | None = None,
        seconds: float | None = None,
    ) -> None:
        """One step; the keywords fix what is otherwise left to chance."""
        self.step += 1
        h, rng = self.h, self.rng
        peer = self.peers.get(conn)
        match name.split(":"):
            case ["join"]:
                conn = self.next_conn
                self.next_conn += 1
                if group is None:
                    group = 1 if rng.random() < 0.15 else 0
                self.peers[conn] = SimPeer(conn=conn, group=group)
                self.deliver(h.register(conn, self.peers[conn].group))
            case ["report"]:
                assert peer is not None
                if ok is None:
                    ok = not self.doomed and rng.random() < 0.9
                peer.status = "reported_ok" if ok else "reported_failed"
                if not ok:
                    self.stale = True  # the round has failed, whoever reports next
                self.deliver(h.report(conn, ok=ok))
            case ["vote"]:
                assert peer is not None and not peer.tags
                # After an abort or a failed round: re-establish only; else update_topology.
                if accept is None:
                    accept = not peer.ring_stale and peer.status != "failed"
                peer.status = "voted"
                self.stats["vote"] += 1
                self.deliver(h.vote(conn, accept))
            case ["pending"]:
                assert peer is not None
                peer.pending_out = True
                self.deliver(h.pending(conn))
            case ["initiate"]:
                assert peer is not None
                self.initiate(peer, tag, descriptor)
            case ["complete", which]:
                assert peer is not None
                tag = int(which)
                state = peer.tags[tag]
                if aborted is None:
                    aborted = rng.random() < (0.5 if state.abort_seen else 0.07)
                epoch = self.epochs[tag]
                state.completed = True
                epoch.completed.add(peer.peer_id)
                if aborted and not epoch.cause:
                    epoch.cause, epoch.cause_step = f"peer {peer.peer_id} failed", self.step
                self.deliver(h.complete(conn, tag, state.seq, aborted=aborted))
            case ["die"] if rng.random() < 0.3:
                self.breaking = conn
                self.deliver(h.broken(conn))
            case ["die"]:
                self.deliver(h.close(conn))
            case ["silence"]:
                assert peer is not None
                peer.silent = True
            case ["advance"]:
                if seconds is None:
                    seconds = rng.uniform(0.05, 0.6) * LIVENESS_TIMEOUT
                self.advance(seconds)
            case _:  # pragma: no cover
                raise AssertionError(name)
        self.check()

    def initiate(
        self, peer: SimPeer, tag: int | None, descriptor: CollectiveInitiate | None
    ) -> None:
        if tag is None:
            free = [t for t in TAGS if t not in peer.tags]
            # Mostly join what the others started (they wait for us).
            joined = [t for t in free if t in self.epochs]
            tag = self.rng.choice(joined if joined and self.rng.random() < 0.8 else free)
        if descriptor is None:
            descriptor = canonical(tag)
            if self.rng.random() < self.mismatch:
                change = self.rng.choice(["count", "dtype", "op"])
                descriptor = dataclasses.replace(
                    descriptor, **{change: {"count": COUNT + 40, "dtype": DOUBLE, "op": AVG}[change]}
                )
        epoch = self.epochs.setdefault(tag, Epoch(tag=tag))
        assert epoch.seq == 0 and peer.peer_id not in epoch.initiates
        epoch.initiates[peer.peer_id] = descriptor
        peer.tags[tag] = SimTag()
        self.stats["initiate"] += 1
        if peer.status == "reported_failed":
            self.stats["initiate-mid-round"] += 1
        self.deliver(self.h.send(peer.conn, descriptor))

    def advance(self, seconds: float) -> None:
        for conn, peer in list(self.peers.items()):
            if not peer.silent:
                self.deliver(self.h.heartbeat(conn))
        target = self.h.now + seconds
        while (deadline := self.h.core.next_deadline()) <= target:
            self.deliver(self.h.tick(deadline))
        self.deliver(self.h.tick(target))

    # --- what the master said -------------------------------------------------------

    def live_members(self) -> set[int]:
        """The collective's group: the live accepted peers of group 0."""
        return {p.peer_id for p in self.members(0)}

    def deliver(self, actions: list[Action]) -> None:
        touched: list[Epoch] = []
        results: set[bool] = set()
        for action in actions:
            # Nobody here optimizes the topology, so no ring search may start or stop.
            assert not isinstance(action, Solve | CancelSolve), action
            if isinstance(action, Close):
                self.on_close(action.conn)
                continue
            assert isinstance(action, Send)
            message = action.message
            if isinstance(message, Kick):
                assert message.reason.startswith(GOOD_KICKS), message.reason
                if message.reason.startswith("malformed"):
                    assert action.conn == self.breaking
                if message.reason.startswith("no message"):
                    assert self.peers[action.conn].silent
                self.stats["kick"] += 1
                continue
            peer = self.peers[action.conn]
            match message:
                case Welcome(peer_id=peer_id):
                    peer.peer_id = peer_id
                case P2PInfo(round=number):
                    if number != self.round:  # a new round: sometimes a network split dooms it
                        self.round, self.doomed = number, self.rng.random() < 0.2
                    assert peer.status in ("waiting", "voted") and not peer.tags
                    peer.status, peer.pending_out = "in_round", False
                case P2PEstablishResult(success=success):
                    results.add(success)
                    assert peer.status in ("reported_ok", "reported_failed")
                    peer.member = True
                    peer.status = "idle" if success else "failed"
                    peer.ring_stale = not success
                    self.stale = not success
                    self.stats[f"round-{'ok' if success else 'failed'}"] += 1
                case PeersPendingResult(pending=pending, error=error):
                    assert peer.member and peer.pending_out
                    peer.pending_out = False
                    if error:
                        assert any(p.status == "voted" for p in self.members())
                        self.stats["pending-refused"] += 1
                    else:
                        assert pending == any(not p.member for p in self.peers.values())
                case CollectiveCommence():
                    touched.append(self.on_commence(peer, message))
                case CollectiveAbort():
                    self.on_abort(peer, message)
                case CollectiveVerdict():
                    touched.append(self.on_verdict(peer, message))
                case Heartbeat():
                    pass
                case _:  # pragma: no cover
                    raise AssertionError(message)
        assert len(results) <= 1, "one round, one verdict"
        for epoch in dict.fromkeys(touched):
            assert epoch.heard == epoch.expected, (epoch, "not everyone heard it")
            epoch.expected, epoch.heard = None, set()
            if epoch.verdict is not None:
                del self.epochs[epoch.tag]

    def on_commence(self, peer: SimPeer, message: CollectiveCommence) -> Epoch:
        epoch = self.epochs[message.tag]
        if epoch.expected is None:  # the first of them
            members = self.live_members()
            assert epoch.seq == 0 and not self.stale, "commence on a stale ring"
            assert not self.h.core.round_in_progress
            assert members <= epoch.initiates.keys()
            assert len({key(epoch.initiates[p]) for p in members}) == 1
            assert sorted(message.ring) == sorted(members)
            assert message.ring == tuple(self.h.core.ring(0))
            assert message.seq > self.max_seq, "seqs unique and increasing"
            self.max_seq = message.seq
            epoch.seq, epoch.participants, epoch.expected = message.seq, set(members), set(members)
            self.stats["commence"] += 1
        assert message.seq == epoch.seq and peer.peer_id not in epoch.heard
        epoch.heard.add(peer.peer_id)
        peer.tags[message.tag].seq = message.seq
        return epoch

    def on_abort(self, peer: SimPeer, message: CollectiveAbort) -> None:
        epoch = self.epochs[message.tag]
        assert epoch.cause and message.seq == epoch.seq
        assert epoch.cause_step == self.step, "aborts go out when the failure happens"
        assert peer.peer_id in epoch.participants - epoch.completed
        assert peer.peer_id not in epoch.aborts
        epoch.aborts.add(peer.peer_id)
        peer.tags[message.tag].abort_seen = True
        self.stats["abort"] += 1

    def on_verdict(self, peer: SimPeer, verdict: CollectiveVerdict) -> Epoch:
        epoch = self.epochs[verdict.tag]
        if epoch.expected is None:  # the first of them: was it due, and is it right?
            members = self.live_members()
            assert verdict.seq == epoch.seq
            if epoch.seq:
                assert epoch.participants <= epoch.completed, "verdict before all completed"
                assert verdict.outcome == (ABORTED if epoch.cause else SUCCESS), (epoch, verdict)
                epoch.expected = set(epoch.participants)
            else:
                everyone = members <= epoch.initiates.keys()
                agree = len({key(d) for d in epoch.initiates.values()}) == 1
                voting = any(p.status == "voted" for p in self.members(0))
                if verdict.outcome == REJECTED:
                    assert everyone and not agree, epoch
                else:
                    assert verdict.outcome == ABORTED, verdict
                    if STALE_REASON in verdict.reason:
                        assert everyone and agree and self.stale, epoch
                    else:
                        assert voting and "voted to re-establish" in verdict.reason, verdict
                epoch.expected = set(epoch.initiates)
            epoch.verdict = verdict
            self.stats[f"verdict-{verdict.outcome}-{'ran' if verdict.seq else 'seq0'}"] += 1
            if STALE_REASON in verdict.reason:
                self.stats["stale-abort"] += 1
            elif "voted to re-establish" in verdict.reason:
                self.stats["vote-abort"] += 1
        assert verdict == epoch.verdict, "everyone hears the same verdict"
        assert peer.peer_id not in epoch.heard
        epoch.heard.add(peer.peer_id)
        del peer.tags[verdict.tag]
        if verdict.outcome == ABORTED:
            peer.ring_stale = True
        return epoch

    def on_close(self, conn: int) -> None:
        peer = self.peers.pop(conn)
        if peer.member and peer.group == 0:
            self.stale = True
        self.stats["left"] += 1
        for epoch in self.epochs.values():
            epoch.initiates.pop(peer.peer_id, None)
            if peer.peer_id in epoch.participants:
                epoch.participants.discard(peer.peer_id)
                epoch.completed.discard(peer.peer_id)
                if not epoch.cause:
                    epoch.cause, epoch.cause_step = f"peer {peer.peer_id} left", self.step

    # --- invariants ----------------------------------------------------------------

    def check(self) -> None:
        core = self.h.core
        views = {v.peer_id: v for v in core.peers()}
        by_id = {p.peer_id: p for p in self.peers.values()}
        assert views.keys() == by_id.keys()
        for peer_id, peer in by_id.items():
            assert views[peer_id].phase is (PeerPhase.ACCEPTED if peer.member else PeerPhase.REGISTERED)
            assert views[peer_id].state is MASTER_STATE[peer.status], (peer, views[peer_id])
        members = self.live_members()
        voting = any(p.status == "voted" for p in self.members(0))
        for tag, epoch in list(self.epochs.items()):
            if epoch.seq == 0:
                if not epoch.initiates:  # every initiator left: nobody to tell
                    del self.epochs[tag]
                    continue
                assert epoch.initiates.keys() <= members
                assert not members <= epoch.initiates.keys(), f"tag {tag} stuck at consensus"
                assert not voting, f"tag {tag} waits for a member that votes"
            else:
                if not epoch.participants:  # every participant left: nobody to tell
                    del self.epochs[tag]
                    continue
                assert epoch.participants <= members
                assert not epoch.participants <= epoch.completed, f"tag {tag} stuck, all done"
                if epoch.cause_step == self.step:
                    # Each unfinished participant got the abort (one may since have left).
                    assert epoch.participants - epoch.completed <= epoch.aborts
            for peer_id in epoch.participants or epoch.initiates:
                assert tag in by_id[peer_id].tags
        for peer in self.peers.values():
            assert peer.tags.keys() <= self.epochs.keys()
            assert self.h.in_flight[peer.conn].keys() == peer.tags.keys()
        assert core.next_deadline() > self.h.now

    # --- the end ---------------------------------------------------------------------

    def settle(self) -> None:
        """No more churn: everything in flight ends, the ring is re-established, joiners
        are admitted."""
        for _ in range(400):
            peers = list(self.peers.values())
            if any(p.silent for p in peers):
                self.do("advance", 0, seconds=0.6 * LIVENESS_TIMEOUT)
            elif in_round := [p for p in peers if p.status == "in_round"]:
                self.do("report", in_round[0].conn, ok=True)
            elif running := [(p, t) for p in peers for t, s in p.tags.items()
                             if s.seq and not s.completed]:
                peer, tag = running[0]
                self.do(f"complete:{tag}", peer.conn, aborted=False)
            elif waiting := [(p, e) for e in self.epochs.values() if not e.seq
                             for p in self.members(0) if p.peer_id not in e.initiates]:
                peer, epoch = waiting[0]
                descriptor = next(iter(epoch.initiates.values()))
                self.do("initiate", peer.conn, tag=epoch.tag, descriptor=descriptor)
            elif any(p.tags for p in peers):  # pragma: no cover
                raise AssertionError("collectives stuck while settling")
            elif (self.stale or any(p.ring_stale or p.status != "idle" for p in peers)
                  or not self.peers):
                if not self.peers:
                    self.do("join", 0, group=0)
                    continue
                voters = [p for p in self.members() if p.status != "voted" and not p.pending_out]
                if not voters:  # pragma: no cover
                    raise AssertionError("stuck: nobody can vote while settling")
                self.do("vote", voters[0].conn, accept=True)
            else:
                return
        raise AssertionError("did not settle")  # pragma: no cover

    def final_collective(self) -> None:
        self.settle()
        assert not self.stale and not self.epochs
        if not self.members(0):
            self.do("join", 0, group=0)
            self.settle()
        assert len(self.members()) == len(self.peers)
        members = self.members(0)
        tag = max(TAGS) + 1
        for peer in members:
            self.do("initiate", peer.conn, tag=tag, descriptor=canonical(tag))
        seq = self.h.last(members[0].conn, CollectiveCommence).seq
        for peer in members:
            self.do(f"complete:{tag}", peer.conn, aborted=False)
        for peer in members:
            assert self.h.last(peer.conn, CollectiveVerdict) == CollectiveVerdict(
                tag=tag, seq=seq, outcome=SUCCESS
            )
        assert not self.epochs


SEEDS = range(16)
STEPS = 1500


@functools.cache
def simulate(seed: int) -> CollectiveSimulation:
    sim = CollectiveSimulation(seed)
    for _ in range(STEPS):
        sim.random_step()
    sim.final_collective()
    return sim


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_collective_churn(seed: int) -> None:
    sim = simulate(seed)
    assert sim.stats["commence"] >= 10, sim.stats
    assert sim.stats[f"verdict-{SUCCESS}-ran"] >= 5, sim.stats


def test_simulation_exercises_every_outcome() -> None:
    # Guards the simulation itself: across the seeds, every way a collective can end
    # happens, and so does everything that ends one early.
    stats: Counter[str] = Counter()
    for seed in SEEDS:
        stats += simulate(seed).stats
    for what in (
        f"verdict-{SUCCESS}-ran", f"verdict-{ABORTED}-ran", f"verdict-{REJECTED}-seq0",
        "stale-abort", "vote-abort", "abort", "pending-refused", "round-ok", "round-failed",
        "kick", "left", "initiate-mid-round",
    ):
        assert stats[what] > 0, (what, stats)
