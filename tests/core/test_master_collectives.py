"""MasterCore collectives: consensus, rejection, stale rings, aborts, legality, and the
seeded simulation of a peer group running many tagged all-reduces through churn
(``sim_collectives``).

The harness checks on every action that each initiate gets at most one verdict (seq 0
if it never ran, else the seq of its commence), that aborts go only to running,
uncompleted attempts and at most once, and that commence seqs only grow; the tests here
check the rest: who gets what, when, and why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pccl_trio._core.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveKind,
    CollectiveVerdict,
    Outcome,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
)

from .master_harness import COUNT, FLOAT, HEARTBEAT_INTERVAL, MasterHarness, only, was_kicked
from .scenarios import (
    ACC,
    FAIL,
    IDLE,
    VOTED,
    Setup,
    accepted,
    accepted_connecting,
    accepted_failed_after_round,
    accepted_failed_mid_round,
    accepted_idle,
    accepted_optimize_voted,
    accepted_optimizing,
    accepted_voted,
    accepted_waiting,
    got,
    group_of,
    joiner_connecting,
    joiner_failed,
    joiner_waiting,
    registered_mid_round,
    registered_waiting,
    run_with,
    started,
)
from .sim_collectives import SEEDS, STALE_REASON, simulate

DOUBLE, AVG, MIN_MAX, ZPS, UINT8, FLOAT16 = 11, 1, 1, 2, 0, 8


# --- helpers --------------------------------------------------------------------------


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


def aborted_once(h: MasterHarness) -> None:
    """Peers 1 and 2 ran tag 5 and peer 1 failed; both got the ABORTED verdict."""
    accepted(h, 1, 2)
    started(h, 5, 1, 2)
    h.complete(1, 5, aborted=True)
    h.complete(2, 5)
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
        assert got(h, conn) == [CollectiveVerdict(tag=5, seq=seq, outcome=Outcome.SUCCESS)]


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
    assert only_verdict(h, 1) == CollectiveVerdict(tag=0, seq=seq, outcome=Outcome.SUCCESS)


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
    assert outcomes == {(1, 3, Outcome.SUCCESS), (2, 1, Outcome.SUCCESS), (3, 2, Outcome.ABORTED)}
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
    assert only_verdict(h, 3).outcome == only_verdict(h, 4).outcome == Outcome.REJECTED
    h.complete(1, 5)
    h.complete(2, 5)
    assert only_verdict(h, 1).outcome == only_verdict(h, 2).outcome == Outcome.SUCCESS


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
    "slice_bytes": (
        {"slice_bytes": 1 << 20}, {"slice_bytes": 4 << 20},
        ("slice_bytes=1048576", "slice_bytes=4194304", "Config.slice_bytes"),
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
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, 0, Outcome.REJECTED)
    assert "tag 5" in verdict.reason
    assert all(f"peer {conn}:" in verdict.reason for conn in (1, 2, 3))
    assert all(text in verdict.reason for text in mentions), verdict.reason
    # A disagreement is no failure: the ring is fine, and the tag is free again.
    started(h, 5, 1, 2, 3)


def test_an_all_gathers_members_may_vote_different_counts_and_the_commence_tells_them() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    counts = {1: 4, 2: 0, 3: 9}
    for conn in (1, 2, 3):
        h.initiate(conn, 5, count=counts[conn], kind=CollectiveKind.ALL_GATHER)
    ring = tuple(h.core.ring(group_of(h, 1)))
    commences = {h.last(conn, CollectiveCommence) for conn in (1, 2, 3)}
    assert len(commences) == 1
    (commence,) = commences
    assert commence.ring == ring and commence.sizes == tuple(counts[p] for p in ring)
    # Other dtypes are still refused, each named.
    h.take_all()
    for conn in (1, 2, 3):
        h.complete(conn, 5)
    h.take_all()
    for conn in (1, 2, 3):
        h.initiate(conn, 6, count=2, dtype=DOUBLE if conn == 2 else FLOAT,
                   kind=CollectiveKind.ALL_GATHER)
    verdict = only_verdict(h, 1)
    assert verdict.outcome == Outcome.REJECTED
    assert "peer 2: all_gather count=2 (its own) dtype=DOUBLE" in verdict.reason, verdict.reason


def test_quantized_dtype_counts_even_without_quantization() -> None:
    # All five fields must match, even the quantized dtype of an unquantized all-reduce
    # (the shipped peer sends its dtype there, so peers that agree on dtype agree on it).
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5, quantized_dtype=FLOAT)
    h.initiate(2, 5, quantized_dtype=DOUBLE)
    verdict = only_verdict(h, 1)
    assert verdict.outcome == Outcome.REJECTED and only_verdict(h, 2) == verdict
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
        CollectiveVerdict(tag=5, seq=seq, outcome=Outcome.REJECTED, reason="peer 2: NaN among the values")
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
        (Outcome.ABORTED, "peer 1 failed during the collective")
    }


def test_disagreement_wins_over_a_stale_ring() -> None:
    # Both would end it at consensus; the rejection says what the callers must fix.
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.close(3)
    h.initiate(1, 5)
    h.initiate(2, 5, op=AVG)
    assert only_verdict(h, 1).outcome == only_verdict(h, 2).outcome == Outcome.REJECTED


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
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, 0, Outcome.ABORTED)
    assert STALE_REASON in verdict.reason
    # Still stale for the next tag, until a round succeeds.
    for conn in members:
        h.initiate(conn, 6)
    assert {only_verdict(h, conn).outcome for conn in members} == {Outcome.ABORTED}
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
    assert h.last(1, CollectiveVerdict).outcome == Outcome.ABORTED


def test_initiators_that_all_left_leave_nothing_behind() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.initiate(1, 5)
    h.close(1)
    h.initiate(2, 5)
    h.initiate(3, 5)  # peer 1's vote went with it: this is a fresh consensus (stale)
    assert only_verdict(h, 2).outcome == only_verdict(h, 3).outcome == Outcome.ABORTED
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
    assert only_verdict(h, 3).outcome == Outcome.ABORTED


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
    assert (verdicts[0].seq, verdicts[0].outcome) == (0, Outcome.ABORTED)
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
    assert [(v.tag, v.seq, v.outcome) for v in verdicts] == [(5, 0, Outcome.ABORTED), (6, 0, Outcome.ABORTED)]
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
    assert (verdict.seq, verdict.outcome) == (0, Outcome.ABORTED) and "peer 2" in verdict.reason


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
        assert only_verdict(h, 2).outcome == Outcome.ABORTED


def test_vote_after_the_verdict_is_fine() -> None:
    h = MasterHarness()
    aborted_once(h)
    assert only(h.vote(1, accept=False), 1) == []
    assert h.where(1) == (ACC, VOTED)


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
    assert (verdict.tag, verdict.seq, verdict.outcome) == (5, seq, Outcome.ABORTED)
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
            tag=5, seq=seq, outcome=Outcome.ABORTED, reason="peer 1 failed during the collective"
        )


def test_a_collective_every_participant_left_just_ends() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    started(h, 5, 1, 2, 3)
    h.complete(3, 5)
    h.close(1)
    h.close(2)
    assert only_verdict(h, 3).outcome == Outcome.ABORTED
    for conn in (1, 2):
        assert h.received(conn, CollectiveVerdict) == []


def test_an_abort_makes_no_ring_stale_by_itself() -> None:
    # A local failure aborts the attempt; the peers decide to re-establish (the shipped
    # peer does), the master does not insist.
    h = MasterHarness()
    aborted_once(h)
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
        assert only_verdict(h, 2).outcome == Outcome.ABORTED
    else:
        h.complete(2, 5)
        h.complete(3, 5)
        assert h.last(2, CollectiveVerdict).outcome == Outcome.ABORTED


# --- a seeded simulation (``sim_collectives``) -----------------------------------------


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_collective_churn(seed: int) -> None:
    sim = simulate(seed)
    assert sim.stats["commence"] >= 10, sim.stats
    assert sim.stats[f"verdict-{Outcome.SUCCESS}-ran"] >= 5, sim.stats


def test_simulation_exercises_every_outcome() -> None:
    # Guards the simulation itself: across the seeds, every way a collective can end
    # happens, and so does everything that ends one early.
    stats: Counter[str] = Counter()
    kicks: Counter[str] = Counter()
    for seed in SEEDS:
        stats += simulate(seed).stats
        kicks += simulate(seed).kicks
    for what in (
        f"verdict-{Outcome.SUCCESS}-ran", f"verdict-{Outcome.ABORTED}-ran",
        f"verdict-{Outcome.REJECTED}-seq0",
        "stale-abort", "vote-abort", "abort", "pending-refused", "round-ok", "round-failed",
        "left", "initiate-mid-round",
    ):
        assert stats[what] > 0, (what, stats)
    assert kicks, "no peer was kicked"
