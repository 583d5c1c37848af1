"""MasterCore leases: granted by a success every member asked for, ended by a report, a
vote outside the lease or a member leaving, and resolved from the members' reports so
that every member gets the verdict it could have reached on its own.

The harness checks that verdicts about leased attempts go only to peers that reported
on the lease, that aborts go only to attempts reported running, and that every other
collective rule holds as without leases.
"""

from __future__ import annotations

import pytest

from pccl_trio._core.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveVerdict,
    LeaseEnd,
    LeaseState,
    Outcome,
    SharedStateVote,
)

from .master_harness import COUNT, MasterHarness, was_kicked
from .scenarios import RING, accepted, come_back, got

SPAN = 100
TAG = 5
RUNNING, COMPLETE, FAILED, NONE = (
    LeaseState.RUNNING, LeaseState.COMPLETE, LeaseState.FAILED, LeaseState.NONE,
)


def granted(h: MasterHarness, *conns: int, tag: int = TAG) -> int:
    """Every one of ``conns`` (the whole group) runs ``tag`` through the master, asking
    for a lease, and it succeeds; returns the lease's first number."""
    for conn in conns:
        h.initiate(conn, tag, lease=True)
    for conn in conns:
        h.complete(conn, tag)
    verdicts = [h.last(conn, CollectiveVerdict) for conn in conns]
    assert len(set(verdicts)) == 1 and verdicts[0].outcome == Outcome.SUCCESS
    assert verdicts[0].lease > verdicts[0].seq and verdicts[0].lease_last == verdicts[0].lease + SPAN - 1
    h.take_all()
    return verdicts[0].lease


def ended(h: MasterHarness, conns: tuple[int, ...], lease: int, *, tag: int = TAG) -> None:
    """Each of ``conns`` was told that the lease ends, and nothing else."""
    for conn in conns:
        messages = got(h, conn)
        assert [type(m) for m in messages] == [LeaseEnd], messages
        assert messages[0].tag == tag and messages[0].lease == lease


@pytest.fixture
def h() -> MasterHarness:
    harness = MasterHarness(lease_span=SPAN)
    accepted(harness, 1, 2, 3)
    return harness


# --- granting ----------------------------------------------------------------------------


def test_a_success_every_member_asked_for_grants_a_lease_above_every_number(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    # The next attempt through the master is numbered past the lease.
    for conn in (1, 2, 3):
        h.initiate(conn, 7)
    assert h.last(1, CollectiveCommence).seq > first + SPAN - 1


@pytest.mark.parametrize("outcome", ["one did not ask", "aborted", "rejected"])
def test_no_lease_unless_every_member_asked_and_it_succeeded(h: MasterHarness, outcome: str) -> None:
    for conn in (1, 2, 3):
        h.initiate(conn, TAG, lease=not (outcome == "one did not ask" and conn == 3))
    for conn in (1, 2, 3):
        h.complete(
            conn, TAG, aborted=outcome == "aborted" and conn == 1,
            invalid="NaN" if outcome == "rejected" and conn == 2 else "",
        )
    verdict = h.last(1, CollectiveVerdict)
    assert verdict.lease == verdict.lease_last == 0


def test_no_lease_for_a_single_member() -> None:
    h = MasterHarness(lease_span=SPAN)
    accepted(h, 1)
    h.initiate(1, TAG, lease=True)
    h.complete(1, TAG)
    assert h.last(1, CollectiveVerdict).lease == 0


# --- what ends a lease -------------------------------------------------------------------


def test_a_failure_report_ends_the_lease_and_every_member_gets_aborted(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first, FAILED)
    ended(h, (1, 2, 3), first)
    h.lease_report(2, TAG, first, first, RUNNING)
    assert got(h, 2) == []
    h.lease_report(3, TAG, first, first, RUNNING)
    # Resolved: the running parts are stopped; the verdict waits for them.
    for conn in (2, 3):
        (abort,) = got(h, conn)
        assert isinstance(abort, CollectiveAbort) and abort.seq == first
    h.complete(2, TAG, first, aborted=True)
    h.complete(3, TAG, first, aborted=False)  # too late to stop: it completed
    for conn in (1, 2, 3):
        verdict = h.last(conn, CollectiveVerdict)
        assert (verdict.seq, verdict.outcome) == (first, Outcome.ABORTED)
        assert verdict.lease == 0


def test_every_member_complete_is_a_success_whatever_the_master_sent(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first + 3, RUNNING)  # ran long, reported on its own
    ended(h, (1, 2, 3), first)
    h.lease_report(2, TAG, first, first + 3, COMPLETE)
    h.lease_report(3, TAG, first, first + 3, COMPLETE)
    assert all(got(h, conn) == [] for conn in (1, 2, 3))
    h.complete(1, TAG, first + 3)
    for conn in (1, 2, 3):
        assert h.last(conn, CollectiveVerdict) == CollectiveVerdict(
            tag=TAG, seq=first + 3, outcome=Outcome.SUCCESS
        )


def test_reports_of_every_member_complete_settle_it_at_once(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    for conn in (1, 2, 3):
        h.lease_report(conn, TAG, first, first + 9, COMPLETE)
    for conn in (1, 2, 3):
        assert got(h, conn)[-1] == CollectiveVerdict(tag=TAG, seq=first + 9, outcome=Outcome.SUCCESS)
    # The tag goes through the master again, and is leased anew.
    assert granted(h, 1, 2, 3) > first + SPAN - 1


def test_a_straggler_hears_that_the_attempt_before_the_latest_succeeded(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first + 4, RUNNING)
    h.take_all()
    h.lease_report(2, TAG, first, first + 3, COMPLETE)  # waits for the others' word on it
    h.lease_report(3, TAG, first, first + 4, RUNNING)
    assert got(h, 2) == [CollectiveVerdict(tag=TAG, seq=first + 3, outcome=Outcome.SUCCESS)]
    # Peer 2 never started first + 4: it joins it when it calls the tag.
    assert got(h, 1) == got(h, 3) == []
    h.initiate(2, TAG, lease=True)
    ring = tuple(h.core.ring(0))
    assert got(h, 2) == [CollectiveCommence(tag=TAG, seq=first + 4, ring=ring)]
    for conn in (1, 2, 3):
        h.complete(conn, TAG, first + 4)
    for conn in (1, 2, 3):
        verdict = h.last(conn, CollectiveVerdict)
        assert (verdict.seq, verdict.outcome, verdict.lease) == (first + 4, Outcome.SUCCESS, 0)


def test_a_vote_with_another_descriptor_ends_the_lease_and_rejects_it_everywhere(
    h: MasterHarness,
) -> None:
    first = granted(h, 1, 2, 3)
    h.initiate(3, TAG, count=COUNT + 1, lease=True)
    ended(h, (1, 2, 3), first)
    h.lease_report(1, TAG, first, first + 2, RUNNING)
    h.lease_report(2, TAG, first, first + 2, RUNNING)
    h.lease_report(3, TAG, first, first + 1, COMPLETE)
    # Peer 3's call is its call of first + 2: the descriptors disagree.
    assert got(h, 3) == [CollectiveVerdict(tag=TAG, seq=first + 1, outcome=Outcome.SUCCESS)]
    for conn in (1, 2):
        (abort,) = got(h, conn)
        assert isinstance(abort, CollectiveAbort) and "disagree" in abort.reason
        h.complete(conn, TAG, first + 2, aborted=True)
    verdicts = {conn: h.last(conn, CollectiveVerdict) for conn in (1, 2, 3)}
    assert {v.outcome for v in verdicts.values()} == {Outcome.REJECTED}
    assert (verdicts[1].seq, verdicts[2].seq, verdicts[3].seq) == (first + 2, first + 2, 0)
    assert f"count={COUNT + 1}" in verdicts[3].reason


def test_the_same_descriptor_outside_the_lease_joins_the_attempt_the_others_started(
    h: MasterHarness,
) -> None:
    first = granted(h, 1, 2, 3)
    h.initiate(3, TAG, lease=True)  # say its lease ran out, or it could not use it
    ended(h, (1, 2, 3), first)
    h.lease_report(1, TAG, first, first, RUNNING)
    h.lease_report(2, TAG, first, first, RUNNING)
    h.lease_report(3, TAG, first, 0, NONE)
    assert got(h, 3) == [CollectiveCommence(tag=TAG, seq=first, ring=tuple(h.core.ring(0)))]
    for conn in (1, 2, 3):
        h.complete(conn, TAG, first)
    assert {h.last(c, CollectiveVerdict).outcome for c in (1, 2, 3)} == {Outcome.SUCCESS}


def test_a_member_leaving_ends_the_lease_and_stops_who_waits_for_it(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.close(3)
    ended(h, (1, 2), first)
    h.lease_report(1, TAG, first, first + 1, RUNNING)
    h.lease_report(2, TAG, first, first + 1, RUNNING)
    for conn in (1, 2):
        (abort,) = got(h, conn)
        assert isinstance(abort, CollectiveAbort) and "peer 3 left" in abort.reason
    h.complete(1, TAG, first + 1, aborted=True)
    h.complete(2, TAG, first + 1, aborted=True)
    assert {h.last(c, CollectiveVerdict).outcome for c in (1, 2)} == {Outcome.ABORTED}


def test_a_member_that_left_after_completing_does_not_undo_a_success(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.close(3)
    h.take_all()
    h.lease_report(1, TAG, first, first + 1, COMPLETE)
    h.lease_report(2, TAG, first, first + 1, RUNNING)
    (abort,) = got(h, 2)
    assert isinstance(abort, CollectiveAbort)
    h.complete(2, TAG, first + 1, aborted=False)  # it had all it needed
    assert {h.last(c, CollectiveVerdict).outcome for c in (1, 2)} == {Outcome.SUCCESS}


def test_members_that_did_not_start_are_awaited_and_the_stale_ring_aborts_it_then(
    h: MasterHarness,
) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first + 1, FAILED)
    h.lease_report(2, TAG, first, first + 1, FAILED)
    h.lease_report(3, TAG, first, first, COMPLETE)  # computing: never started first + 1
    h.take_all()
    assert h.core.status().waiting  # waits for peer 3's call, like a vote
    h.initiate(3, TAG, lease=True)
    verdicts = {c: h.last(c, CollectiveVerdict) for c in (1, 2, 3)}
    assert {v.outcome for v in verdicts.values()} == {Outcome.ABORTED}
    assert (verdicts[1].seq, verdicts[3].seq) == (first + 1, 0)


def test_a_member_in_a_sync_blocks_the_attempt_the_others_started(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.send(3, SharedStateVote(revision=1, strategy=0, entries=()))
    h.lease_report(1, TAG, first, first + 1, RUNNING)
    h.lease_report(3, TAG, first, first, COMPLETE)
    h.lease_report(2, TAG, first, first + 1, RUNNING)
    for conn in (1, 2):
        (abort,) = [m for m in got(h, conn) if isinstance(m, CollectiveAbort)]
        assert "peer 3 voted to synchronize" in abort.reason
        h.complete(conn, TAG, first + 1, aborted=True)
    for conn in (1, 2):
        verdict = h.last(conn, CollectiveVerdict)
        assert (verdict.seq, verdict.outcome) == (first + 1, Outcome.BLOCKED)
    # Peer 3 is told too (its data path drops the attempt's frames).
    assert h.last(3, CollectiveVerdict) == CollectiveVerdict(
        tag=TAG, seq=first + 1, outcome=Outcome.BLOCKED, reason=h.last(1, CollectiveVerdict).reason
    )


def test_nothing_started_under_the_lease_ends_it_quietly(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, 0, NONE)
    ended(h, (1, 2, 3), first)
    for conn in (2, 3):
        h.lease_report(conn, TAG, first, 0, NONE)
    assert all(got(h, conn) == [] for conn in (1, 2, 3))


# --- what a lease does not survive ----------------------------------------------------------


def leased_count(h: MasterHarness) -> tuple[int, int]:
    """(leases ended, all-reduces counted as run under them), as the master's status
    counts them."""
    counts = [c for c in h.core.status().counts if c.event == "lease_ended"]
    return sum(c.count for c in counts), sum(c.total for c in counts)


def test_a_new_ring_ends_the_lease_and_counts_what_ran_under_it(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    for conn in (1, 2, 3):
        h.vote(conn, accept=False)
    for conn in (1, 2, 3):
        h.report(conn)
    # The ring was installed anew: every member hears that the lease ends.
    for conn in (1, 2, 3):
        (end,) = h.received(conn, LeaseEnd)
        assert (end.tag, end.lease) == (TAG, first)
    h.take_all()
    # Ten attempts ran under it; the members report that, and hear that the last one
    # succeeded (which each of them knew).
    for conn in (1, 2, 3):
        h.lease_report(conn, TAG, first, first + 9, COMPLETE)
    for conn in (1, 2, 3):
        (verdict,) = got(h, conn)
        assert verdict == CollectiveVerdict(tag=TAG, seq=first + 9, outcome=Outcome.SUCCESS)
    assert leased_count(h) == (1, 10)
    # A vote for the tag now is a plain vote: no lease to end.
    for conn in (1, 2, 3):
        h.initiate(conn, TAG, lease=True)
    for conn in (1, 2, 3):
        assert [type(m) for m in got(h, conn)] == [CollectiveCommence]
    # Late reports of the ended lease are nobody's business.
    h.lease_report(1, TAG, first, first, COMPLETE)
    assert got(h, 1) == []


@pytest.mark.parametrize("leaving", [(3,), (3, 2), (3, 2, 1)])
def test_members_that_leave_after_reporting_are_counted(
    h: MasterHarness, leaving: tuple[int, ...]
) -> None:
    first = granted(h, 1, 2, 3)
    # Seven attempts ran; the members leaving report before their connection closes.
    for conn in leaving:
        h.lease_report(conn, TAG, first, first + 6, COMPLETE)
        h.close(conn)
    for conn in (1, 2, 3):
        if conn not in leaving:
            h.lease_report(conn, TAG, first, first + 6, COMPLETE)
    assert leased_count(h) == (1, 7)


def test_an_attempt_a_member_gone_had_started_is_not_counted(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(3, TAG, first, first + 4, RUNNING)  # started the fifth, then died
    h.close(3)
    for conn in (1, 2):
        h.lease_report(conn, TAG, first, first + 3, COMPLETE)
    assert leased_count(h) == (1, 4)


def test_an_attempt_the_master_settles_is_counted_with_its_verdict(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    for conn in (1, 2, 3):
        h.lease_report(conn, TAG, first, first + 2, RUNNING)
    assert leased_count(h) == (1, 2)  # the first two; the third runs on
    for conn in (1, 2, 3):
        h.complete(conn, TAG, first + 2)
    assert {h.last(c, CollectiveVerdict).outcome for c in (1, 2, 3)} == {Outcome.SUCCESS}
    successes = [c for c in h.core.status().counts if (c.event, c.label) == ("completed", "success")]
    assert sum(c.count for c in successes) == 2  # the granting one, and this one


# --- a master that took the run over -------------------------------------------------------


def test_a_report_of_a_lease_this_master_never_granted_ends_it_with_the_members_it_knows() -> None:
    h = MasterHarness(lease_span=SPAN)
    accepted(h, 1, 2, 3)
    h.lease_report(2, TAG, 7000, 7003, RUNNING)
    ended(h, (1, 2, 3), 7000)
    h.lease_report(1, TAG, 7000, 7003, RUNNING)
    h.lease_report(3, TAG, 7000, 7003, RUNNING)
    assert all(got(h, conn) == [] for conn in (1, 2, 3))
    for conn in (1, 2, 3):
        h.complete(conn, TAG, 7003)
    assert {h.last(c, CollectiveVerdict).seq for c in (1, 2, 3)} == {7003}


# --- hostile reports ---------------------------------------------------------------------------


def test_a_report_beyond_the_lease_kicks_its_sender(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    assert was_kicked(h.lease_report(2, TAG, first, first + SPAN, RUNNING), 2)


def test_a_report_that_contradicts_the_others_kicks_its_sender(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first + 5, RUNNING)
    h.lease_report(2, TAG, first, first + 5, RUNNING)
    # Two attempts behind: no member may start an attempt before all finished the last.
    actions = h.lease_report(3, TAG, first, first + 3, COMPLETE)
    assert was_kicked(actions, 3)
    # Without it, the other two settle the lease.
    for conn in (1, 2):
        assert isinstance(got(h, conn)[-1], CollectiveAbort)


def test_a_vote_while_running_an_attempt_under_the_lease_kicks_the_voter(h: MasterHarness) -> None:
    first = granted(h, 1, 2, 3)
    h.lease_report(1, TAG, first, first + 1, RUNNING)
    h.lease_report(2, TAG, first, first + 1, RUNNING)
    h.lease_report(3, TAG, first, first, COMPLETE)
    assert was_kicked(h.initiate(1, TAG, lease=True), 1)


def test_a_master_taking_over_ends_a_lease_once_every_member_is_back() -> None:
    """Members come back to a new master one by one; the first reports its lease at
    once. Only once the group is back is the lease ended with every member, the late
    one included, and the attempt they ran settled for all."""
    h = MasterHarness(lease_span=SPAN)
    come_back(h, 1, RING[0], high_water=7100)
    h.lease_report(1, TAG, 7000, 7003, RUNNING)
    come_back(h, 2, RING[1], high_water=7100)
    h.lease_report(2, TAG, 7000, 7003, FAILED)
    assert not any(isinstance(m, LeaseEnd) for c in (1, 2) for m in h.sent[c])
    come_back(h, 3, RING[2], high_water=7100)  # the ring is whole again
    for conn in (1, 2, 3):
        assert [type(m) for m in got(h, conn) if isinstance(m, LeaseEnd)] == [LeaseEnd]
    h.lease_report(3, TAG, 7000, 7003, RUNNING)
    for conn in (1, 3):
        assert isinstance(h.last(conn, CollectiveAbort), CollectiveAbort)
        h.complete(conn, TAG, 7003, aborted=True)
    assert {h.last(c, CollectiveVerdict).outcome for c in (1, 2, 3)} == {Outcome.ABORTED}


def test_reports_of_unknown_leases_cannot_grow_the_master_without_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pccl_trio._core.leases as leases

    monkeypatch.setattr(leases, "MAX_LEARNED", 3)
    h = MasterHarness(lease_span=SPAN)
    accepted(h, 1, 2, 3)
    h.take_all()
    for tag in range(3):
        h.lease_report(2, tag, 7000, 7001, RUNNING)
    assert was_kicked(h.lease_report(2, 3, 7000, 7001, RUNNING), 2)
