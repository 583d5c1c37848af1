"""MasterCore stall timer: votes waiting for members that never make the call.

Each test makes some members vote and others not (or vote for something else), lets
time pass deadline by deadline with every peer sending heartbeats, and checks that
nothing happens before the stall timeout, that the voters are refused exactly at it
with a reason naming each missing peer and what it waits in, that the warnings came at
the warning interval and its doublings, and that the run goes on afterwards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import pytest

from pccl_trio._core.messages import (
    CollectiveCommence,
    CollectiveVerdict,
    Outcome,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
    SharedStatePlan,
    TopologyOptimized,
)

from .master_harness import MasterHarness
from .scenarios import ACC, IDLE, accepted, got, run_with, started, sync_done, sync_vote

TIMEOUT = 100.0
WARNING = 10.0


def harness(timeout: float = TIMEOUT) -> MasterHarness:
    return MasterHarness(stall_timeout=timeout, stall_warning=WARNING)


def elapse(h: MasterHarness, until: float, talking: Iterable[int]) -> None:
    """Time passes to ``until``, deadline by deadline; every conn of ``talking`` sends
    a heartbeat before each step, so nobody falls silent."""
    talking = list(talking)
    while (deadline := h.core.next_deadline()) <= until:
        for conn in talking:
            h.heartbeat(conn)
        h.tick(deadline)
        assert h.core.next_deadline() > deadline, "a Tick at the deadline did nothing"
    for conn in talking:
        h.heartbeat(conn)
    h.tick(until)


def verdicts(h: MasterHarness, conn: int) -> list[CollectiveVerdict]:
    return h.received(conn, CollectiveVerdict)


def stall_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fails after" in r.getMessage()]


def test_a_member_that_never_votes_fails_the_all_reduce_at_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = harness()
    accepted(h, 1, 2, 3)
    h.now = 5.0
    h.initiate(1, 0)
    h.now = 7.0
    h.initiate(2, 0)
    caplog.set_level(logging.WARNING, "pccl_trio.master")
    elapse(h, 5.0 + TIMEOUT - 0.5, [1, 2, 3])
    assert verdicts(h, 1) == verdicts(h, 2) == []
    # Warnings after 10, 20, 40 and 80 s, each naming the peer that did not vote.
    lines = stall_lines(caplog)
    assert len(lines) == 4, lines
    assert all("all_reduce(tag=0) of peer group 0" in line for line in lines)
    assert all("peer 3 is in no call" in line for line in lines), lines
    assert "peer 1 " not in lines[0] and "peer 2 " not in lines[0]
    elapse(h, 5.0 + TIMEOUT, [1, 2, 3])
    for conn in (1, 2):
        (verdict,) = verdicts(h, conn)
        assert (verdict.tag, verdict.seq, verdict.outcome) == (0, 0, Outcome.REJECTED)
        assert "waited 100s for the peers that did not call it: peer 3 is in no call" in (
            verdict.reason
        )
        assert "stall timeout is 100s" in verdict.reason
    assert got(h, 3) == []
    # The tag is free again: the next all-reduce with it runs.
    assert started(h, 0, 1, 2, 3)


def test_tag_0_against_tag_1_names_each_peers_call() -> None:
    h = harness()
    accepted(h, 1, 2)
    h.initiate(1, 0)
    h.now = 3.0
    h.initiate(2, 1)
    elapse(h, TIMEOUT, [1, 2])
    (verdict,) = verdicts(h, 1)
    assert verdict.outcome == Outcome.REJECTED
    assert "all_reduce(tag=0)" in verdict.reason
    assert "peer 2 waits in all_reduce(tag=1)" in verdict.reason
    assert verdicts(h, 2) == []
    elapse(h, 3.0 + TIMEOUT, [1, 2])
    (verdict,) = verdicts(h, 2)
    assert "all_reduce(tag=1)" in verdict.reason and "peer 1 is in no call" in verdict.reason


def test_all_reduce_against_are_peers_pending_fails_both_naming_the_other() -> None:
    h = harness()
    accepted(h, 1, 2)
    h.initiate(1, 0)
    h.pending(2)
    elapse(h, TIMEOUT, [1, 2])
    (verdict,) = verdicts(h, 1)
    assert verdict.outcome == Outcome.REJECTED
    assert "peer 2 waits in are_peers_pending" in verdict.reason
    answer = h.last(2, PeersPendingResult)
    assert answer.error.startswith("are_peers_pending of the run waited 100s")
    # Written before either was refused: each names what the other still waited in.
    assert "peer 1 waits in all_reduce(tag=0)" in answer.error
    # Both are free: the pending vote works again.
    h.pending(1)
    h.pending(2)
    assert h.last(1, PeersPendingResult) == PeersPendingResult(pending=False)


def test_two_against_three_tensors_fails_the_third_for_the_peer_that_sent_it() -> None:
    h = harness()
    accepted(h, 1, 2)
    for tag in (0, 1):
        seq = started(h, tag, 1, 2)
        for conn in (1, 2):
            h.complete(conn, tag, seq)
    h.initiate(2, 2)
    elapse(h, TIMEOUT, [1, 2])
    successes = [v for v in verdicts(h, 1) if v.outcome == Outcome.SUCCESS]
    assert len(successes) == 2 and not [v for v in verdicts(h, 1) if v.tag == 2]
    (third,) = [v for v in verdicts(h, 2) if v.tag == 2]
    assert third.outcome == Outcome.REJECTED and "peer 1 is in no call" in third.reason


def test_update_topology_without_the_others_is_refused_and_can_be_voted_again() -> None:
    h = harness()
    accepted(h, 1, 2, 3)
    h.now = 1.0
    h.vote(1)
    h.initiate(2, 4)
    elapse(h, 1.0 + TIMEOUT, [1, 2, 3])
    refusal = h.last(1, P2PEstablishResult)
    assert (refusal.round, refusal.success) == (0, False)
    assert refusal.error.startswith("update_topology of the run waited 100s")
    # Peer 2's all-reduce was aborted at once by the vote (a proven deadlock), so by the
    # timeout it waits in nothing.
    assert "peer 2 is in no call; peer 3 is in no call" in refusal.error
    assert h.where(1) == (ACC, IDLE)
    # Voting again works once everyone does.
    for conn in (1, 2, 3):
        h.vote(conn)
    assert h.last(1, P2PInfo).round == h.latest_round


def test_a_sync_vote_without_the_group_is_refused() -> None:
    h = harness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.send(1, sync_vote())
    elapse(h, TIMEOUT, [1, 2, 3])
    plan = h.last(1, SharedStatePlan)
    assert plan.sync == 0 and "sync_shared_state of peer group 0" in plan.error
    assert "peer 2 is in no call" in plan.error and "peer 3" not in plan.error
    assert h.where(1) == (ACC, IDLE)
    # The group syncs normally afterwards.
    h.send(1, sync_vote())
    h.send(2, sync_vote())
    assert h.last(2, SharedStatePlan).sync
    h.send(1, sync_done(h, 1))


def test_an_optimization_vote_without_everyone_is_refused() -> None:
    h = harness()
    accepted(h, 1, 2)
    h.optimize(1)
    h.pending(2)  # refused at once: the optimization vote blocks it
    assert h.last(2, PeersPendingResult).error
    elapse(h, TIMEOUT, [1, 2])
    report = h.last(1, TopologyOptimized)
    assert report.optimization == 0 and not report.rejoin
    assert "optimize_topology of the run" in report.error and "peer 2 is in no call" in report.error
    assert h.where(1) == (ACC, IDLE)


def test_votes_that_complete_are_never_stalled(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "pccl_trio.master")
    h = harness()
    accepted(h, 1, 2)
    h.initiate(1, 0)
    elapse(h, TIMEOUT - 1, [1, 2])
    h.initiate(2, 0)
    assert [m for m in got(h, 2) if isinstance(m, CollectiveCommence)]
    # Running attempts wait for their participants, not for votes: never refused.
    elapse(h, 3 * TIMEOUT, [1, 2])
    assert verdicts(h, 1) == []
    assert len(stall_lines(caplog)) == 4  # 10, 20, 40, 80 s, then it commenced


def test_an_infinite_timeout_never_refuses() -> None:
    h = harness(timeout=math.inf)
    accepted(h, 1, 2)
    h.initiate(1, 0)
    elapse(h, 10 * TIMEOUT, [1, 2])
    assert verdicts(h, 1) == []


def test_the_timeout_counts_from_the_first_voter() -> None:
    h = harness()
    accepted(h, 1, 2, 3)
    h.pending(1)
    h.now = 60.0
    h.pending(2)
    elapse(h, TIMEOUT - 0.5, [1, 2, 3])
    assert not h.received(1, PeersPendingResult)
    elapse(h, TIMEOUT, [1, 2, 3])
    assert h.last(1, PeersPendingResult).error == h.last(2, PeersPendingResult).error
    assert "peer 3 is in no call" in h.last(2, PeersPendingResult).error


def test_a_joiner_the_members_never_admit_is_warned_about_then_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "pccl_trio.master")
    h = harness()
    accepted(h, 1, 2)
    h.now = 3.0
    h.register(3)
    h.vote(1)  # one member admits; peer 2 never asks
    elapse(h, 3.0 + TIMEOUT - 0.5, [1, 2, 3])
    assert h.kick_reason(3) is None
    lines = [line for line in stall_lines(caplog) if line.startswith("connect of peer")]
    assert len(lines) == 4, lines  # after 10, 20, 40 and 80 s
    assert all("did not admit it" in line and "peer 2 is in no call" in line for line in lines)
    assert all("peer 1 " not in line for line in lines), lines
    # The status shows what the joiner waits for.
    (waiting,) = [w for w in h.core.status().waiting if w.call == "connect"]
    assert waiting.missing == (h.peer_ids[2],)
    elapse(h, 3.0 + TIMEOUT, [1, 2, 3])
    reason = h.kick_reason(3)
    assert reason is not None and reason.startswith("connect of peer 3 waited 100s")
    assert "peer 2 is in no call" in reason and "are_peers_pending()" in reason
    assert h.view(3) is None
    # The members go on: peer 1's vote waits for peer 2 alone, then a round runs.
    h.vote(2)
    assert h.last(1, P2PInfo).round == h.latest_round


def test_a_joiner_the_members_admit_is_never_stalled() -> None:
    h = harness()
    accepted(h, 1, 2)
    h.register(3)
    h.vote(1)
    h.vote(2)  # the round admitting peer 3 starts
    for conn in (1, 2, 3):
        h.report(conn)
    assert h.where(3) == (ACC, IDLE)
    elapse(h, 3 * TIMEOUT, [1, 2, 3])
    assert h.kick_reason(3) is None


# --- a seeded random walk ------------------------------------------------------------
#
# Peers of two groups vote, initiate, ask, sync, optimize, complete, report, close and
# register at random while time passes; stalls fire often (a 10 s timeout). After
# every event: the stall timer's cached list of waiting votes is the one a fresh look
# finds, and after every Tick no vote has waited for the timeout or longer. Every text
# a refusal carries is bounded. (The harness checks one verdict per initiate.)

WALK_SEEDS = range(12)


def _check_stalls(h: MasterHarness) -> None:
    stalls = h.core._stalls
    cached, _deadline = stalls._waiting()
    fresh = [w for source in stalls._sources for w in source()]
    assert [(w.key, w.since) for w in cached] == [(w.key, w.since) for w in fresh]
    assert all(h.now < w.since + stalls._timeout for w in fresh), (h.now, fresh)


@pytest.mark.parametrize("seed", WALK_SEEDS)
def test_random_walk_keeps_the_stall_timer_exact(seed: int) -> None:
    import random

    from pccl_trio._core.messages import SharedStateDone
    from pccl_trio._core.peers import PeerState

    rng = random.Random(seed)
    h = MasterHarness(stall_timeout=10.0, stall_warning=1.0)
    run_with(h, {1: 0, 2: 0, 3: 0, 4: 1, 5: 1})
    next_conn = 6
    for _step in range(400):
        live = [c for c in h.peer_ids if c not in h.closed]
        if not live:
            break
        conn = rng.choice(live)
        where = h.where(conn)
        state = where[1] if where and where[0] is ACC else None  # joiners only wait
        free = state in (PeerState.IDLE, PeerState.CONNECT_FAILED)
        tags = h.in_flight[conn]
        roll = rng.random()
        if roll < 0.25 and free:
            tag = rng.randrange(3)
            if tag not in tags:
                h.initiate(conn, tag)
        elif roll < 0.35 and free and not h.core._table.peers[h.peer_ids[conn]].pending_vote:
            h.pending(conn)
        elif roll < 0.45 and free and not tags:
            h.vote(conn, accept=rng.random() < 0.5)
        elif roll < 0.5 and state is PeerState.IDLE and not tags:
            h.send(conn, sync_vote())
        elif roll < 0.53 and state is PeerState.IDLE and not tags:
            h.optimize(conn)
        elif roll < 0.56 and len(live) > 2:
            h.close(conn)
        elif roll < 0.58:
            h.register(next_conn, rng.randrange(2))
            next_conn += 1
        else:
            elapse(h, h.now + rng.uniform(0.1, 8.0), live)
        # Let the running parts finish: commenced attempts, rounds, syncs, measurements.
        for other in [c for c in h.peer_ids if c not in h.closed]:
            for tag, seq in list(h.in_flight[other].items()):
                if seq and (other, seq) not in h._completed and rng.random() < 0.7:
                    h.complete(other, tag, seq)
            position = h.where(other)
            if position is None:
                continue
            if position[1] is PeerState.CONNECTING:
                h.report(other)
            elif position[1] is PeerState.SYNCING:
                h.send(other, SharedStateDone(sync=h.last(other, SharedStatePlan).sync, success=True))
            if other in h.unanswered:
                h.measure(other)
            _check_stalls(h)
        h.finish_solves()
        _check_stalls(h)
    refusals = 0
    for messages in h.sent.values():
        for message in messages:
            for text in ("reason", "error"):
                assert len(getattr(message, text, "")) <= 1000, message
            refusals += "stall timeout" in getattr(message, "reason", getattr(message, "error", ""))
    assert refusals, "the walk never stalled: it tests nothing"
