"""MasterCore topology optimization: the vote, measurement steps, solver jobs, the new
ring's round, the background search and its candidate ring.

The harness plays the shell (``master_harness``): the drivers (``scenarios``) answer
``MeasureLink`` with rates the test chooses and the solver jobs run synchronously, so
every scenario is deterministic; so is the simulation of random interleavings
(``sim_topology``). Peer ``n`` is registered on connection ``n`` throughout.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy
import pytest

from pccl_trio._core.bandwidth import MEASUREMENT_BYTES
from pccl_trio._core.master import KEEP_MARGIN, Action, CancelSolve, PeerPhase, Send, Solve
from pccl_trio._core.messages import (
    CollectiveCommence,
    CollectiveVerdict,
    ExpectBenchmark,
    LinkMeasured,
    MeasureLink,
    Outcome,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    SharedStatePlan,
    TopologyOptimized,
)
from pccl_trio._core.ring import ring_edges
from pccl_trio.topology import EXACT_LIMIT

from .master_harness import MasterHarness, default_solver, only, solver_actions, was_kicked
from .scenarios import (
    ACC,
    CONN,
    FAST,
    IDLE,
    LATENCY,
    MEDIUM,
    OPTIMIZING,
    OVOTED,
    REFERENCE,
    SLOW,
    VOTED,
    Link,
    Rate,
    accepted,
    asked,
    finish_round,
    measure_all,
    optimize_all,
    ring_rate,
    run_with,
    sync_vote,
)
from .sim_topology import SEEDS, Chaos

#: A directed ring faster than every other (when its links are FAST) ...
FAST_RING = (1, 3, 2, 4)
#: ... and its reverse, which shares none of its links.
REVERSE_RING = (1, 4, 2, 3)


def chunk_cost(rate: float, world: int) -> float:
    return LATENCY + REFERENCE / world / rate


def predicted(ring: Sequence[int], rate: Rate) -> float:
    world = len(ring)
    return 2 * (world - 1) * max(chunk_cost(rate(a, b), world) for a, b in ring_edges(ring))


def indices(peers: Sequence[int], ring: Sequence[int]) -> tuple[int, ...]:
    return tuple(peers.index(p) for p in ring)


# --- driving ---------------------------------------------------------------------------


def reports(h: MasterHarness, conn: int) -> list[TopologyOptimized]:
    return h.received(conn, TopologyOptimized)


def optimized(h: MasterHarness, conns: Sequence[int], rate: Rate | None = None,
              fail: Iterable[Link] = ()) -> list[list[Link]]:
    """One whole optimization of ``conns`` with the default solver, its round included."""
    optimize_all(h, conns)
    steps = measure_all(h, rate, fail)
    h.finish_solves(background=False)
    assert not h.core.optimization_in_progress
    finish_round(h, conns)
    return steps


def links_of(members: Sequence[int]) -> set[Link]:
    return {(a, b) for a in members for b in members if a != b}


# --- the whole flow --------------------------------------------------------------------


def test_full_flow_measures_every_link_once_and_installs_the_fastest_ring() -> None:
    h = MasterHarness(reference_bytes=REFERENCE, solve_seconds=2.5)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    assert h.core.ring(0) == [1, 2, 3, 4]
    before = h.core.topology(0)
    assert before.peers == conns and numpy.isnan(before.bandwidth).all()
    assert before.predicted_seconds == math.inf

    for conn in conns[:-1]:
        assert h.optimize(conn) == []  # waiting for the others
        assert h.where(conn) == (ACC, OVOTED)
    actions = h.optimize(4)
    assert h.core.optimization_in_progress
    assert all(h.where(c) == (ACC, OPTIMIZING) for c in conns)
    assert len(asked(actions)) == 2  # four peers: two links at once

    rate = ring_rate(FAST_RING)
    steps = measure_all(h, rate)
    measured = [link for step in steps for link in step]
    assert sorted(measured) == sorted(links_of(conns))  # each exactly once
    assert len(steps) == 2 * (len(conns) - 1)  # the fewest possible

    # Measured: one solver job, for the whole group, from the installed ring.
    (job,) = h.pending_solves()
    assert (job.group, job.peers, job.start, job.background) == (0, conns, (0, 1, 2, 3), False)
    assert job.seconds == 2.5
    for i, a in enumerate(conns):
        for j, b in enumerate(conns):
            expected = math.inf if a == b else chunk_cost(rate(a, b), 4)
            assert job.cost[i, j] == pytest.approx(expected)
    view = h.core.topology(0)
    assert view.bandwidth[0, 2] == FAST and view.bandwidth[0, 1] == SLOW
    assert view.latency[0, 2] == LATENCY
    assert reports(h, 1) == []  # nothing until the solver answers

    h.take_all()
    actions = h.finish_solves()
    for conn in conns:
        report, info = h.take(conn)
        assert isinstance(report, TopologyOptimized) and isinstance(info, P2PInfo)
        assert report.error == "" and report.optimization == 1
        assert report.peers == conns
        assert report.ring == FAST_RING and info.ring == FAST_RING
        assert report.optimal
        assert report.unreachable == ()
        assert report.reference_bytes == REFERENCE
        assert report.predicted_seconds == pytest.approx(predicted(FAST_RING, rate))
        assert report.bandwidth == tuple(
            0.0 if a == b else rate(a, b) for a in conns for b in conns
        )
        assert report.latency == tuple(0.0 if a == b else LATENCY for a in conns for b in conns)
        assert h.where(conn) == (ACC, CONN)
    assert not h.core.optimization_in_progress and h.core.round_in_progress
    assert solver_actions(actions) == []  # optimal: no background search

    assert finish_round(h, conns).ring == FAST_RING
    assert h.core.ring(0) == list(FAST_RING)
    view = h.core.topology(0)
    assert view.ring == FAST_RING
    assert view.predicted_seconds == pytest.approx(predicted(FAST_RING, rate))
    assert all(h.where(c) == (ACC, IDLE) for c in conns)

    # A collective now runs on the new ring.
    for conn in conns:
        h.initiate(conn, 7)
    assert {h.last(conn, CollectiveCommence).ring for conn in conns} == {FAST_RING}


def test_the_sender_of_each_link_is_told_whom_to_expect_first() -> None:
    """A peer serves benchmark bytes only to a measurement the master announced: the
    sender hears the receiver's endpoint (host included) and the byte budget before the
    receiver is asked, and the receiver is held to the same budget."""
    h = MasterHarness()
    for conn in (1, 2):
        h.register(conn, host=f"10.0.0.{conn}", pool_size=conn)
        if conn == 1:
            h.report(1)
    h.vote(1)
    for conn in (1, 2):
        h.report(conn)
    h.take_all()
    actions = optimize_all(h, (1, 2))
    sends = [(a.conn, a.message) for a in actions if isinstance(a, Send)]
    (first_conn, first), (second_conn, second) = sends
    assert isinstance(first, ExpectBenchmark) and isinstance(second, MeasureLink)
    receiver = second_conn
    sender = 3 - receiver
    assert first_conn == sender
    assert first == ExpectBenchmark(
        optimization=1,
        measurer=PeerEndpoint(peer_id=receiver, host=f"10.0.0.{receiver}",
                              port=10000 + receiver, pool_size=receiver),
        nbytes=MEASUREMENT_BYTES,
    )
    assert second.source.host == f"10.0.0.{sender}" and second.nbytes == MEASUREMENT_BYTES


def test_a_second_optimization_measures_nothing_and_solves_at_once() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimized(h, conns, ring_rate(FAST_RING))

    actions = optimize_all(h, conns)
    assert asked(actions) == [] and h.unanswered == {}
    (job,) = [a for a in solver_actions(actions) if isinstance(a, Solve)]
    assert job.start == indices(conns, FAST_RING)  # improving on the installed ring
    h.take_all()
    h.finish_solves()
    for conn in conns:
        report, info = h.take(conn)
        assert isinstance(report, TopologyOptimized) and report.optimization == 2
        assert report.ring == FAST_RING and report.optimal
        assert isinstance(info, P2PInfo) and info.ring == FAST_RING
    finish_round(h, conns)


def test_a_joiner_gets_only_its_own_links_measured() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimized(h, conns, ring_rate(FAST_RING))

    h.register(5)
    for conn in conns:
        h.vote(conn)
    finish_round(h, (*conns, 5))
    assert h.core.ring(0) == [*FAST_RING, 5]  # the joiner appended to the installed ring

    best = (1, 3, 5, 2, 4)  # peer 5 fits between 3 and 2
    rate = ring_rate(best)
    optimize_all(h, (*conns, 5))
    steps = measure_all(h, rate)
    measured = [link for step in steps for link in step]
    assert sorted(measured) == sorted(links_of((1, 2, 3, 4, 5)) - links_of(conns))
    assert len(measured) == 2 * (5 - 1) == len(steps)  # each step has one link of peer 5
    (job,) = h.pending_solves()
    assert job.start == (0, 2, 1, 3, 4)
    h.finish_solves()
    assert {h.last(c, TopologyOptimized).ring for c in (*conns, 5)} == {best}
    assert {h.last(c, P2PInfo).ring for c in (*conns, 5)} == {best}


def test_a_failed_measurement_marks_the_link_unreachable_and_the_ring_avoids_it() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    # The fast ring would need 1 -> 3, which cannot be measured; the medium ring
    # (1, 4, 3, 2) is the best without it.
    fast, medium = set(ring_edges(FAST_RING)), set(ring_edges((1, 4, 3, 2)))

    def rate(a: int, b: int) -> float:
        return FAST if (a, b) in fast else MEDIUM if (a, b) in medium else SLOW

    optimize_all(h, conns)
    measure_all(h, rate, fail=[(1, 3)])
    (job,) = h.pending_solves()
    assert job.cost[0, 2] == math.inf
    view = h.core.topology(0)
    assert view.bandwidth[0, 2] == 0.0 and view.bandwidth[2, 0] == SLOW
    h.finish_solves()
    report = h.last(1, TopologyOptimized)
    assert report.unreachable == (0 * 4 + 2,)
    assert report.bandwidth[2] == 0.0
    assert report.ring == (1, 4, 3, 2) and (1, 3) not in ring_edges(report.ring)
    assert h.last(1, P2PInfo).ring == (1, 4, 3, 2)
    assert report.predicted_seconds == pytest.approx(predicted((1, 4, 3, 2), rate))


def test_edges_a_round_could_not_use_are_not_measured() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3)
    accepted(h, *conns)
    for conn in conns:
        h.vote(conn)
    h.report(1, ok=False, failed=[2])  # 1 -> 2 is unreachable
    h.report(2)
    h.report(3)
    for conn in conns:
        h.vote(conn)
    finish_round(h, conns)
    optimize_all(h, conns)
    steps = measure_all(h)
    assert (1, 2) not in [link for step in steps for link in step]
    assert len([link for step in steps for link in step]) == 5
    h.finish_solves()
    report = h.last(1, TopologyOptimized)
    assert report.unreachable == (1,)  # row of peer 1, column of peer 2
    assert (1, 2) not in ring_edges(report.ring)
    assert h.last(1, P2PInfo).ring == report.ring


def test_a_group_of_one_or_two_needs_no_solver() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    optimize_all(h, (1, 2, 3))
    steps = measure_all(h)
    assert sorted(link for step in steps for link in step) == [(1, 2), (2, 1)]
    assert not h.core.optimization_in_progress and h.solves == {}
    assert h.last(1, TopologyOptimized).ring == h.last(2, TopologyOptimized).ring
    assert set(h.last(1, TopologyOptimized).ring) == {1, 2}
    assert h.last(3, TopologyOptimized).ring == (3,)
    assert h.last(3, TopologyOptimized).optimal
    assert h.last(3, P2PInfo).ring == (3,)


def test_a_lone_peer_optimizes_at_once() -> None:
    h = MasterHarness()
    accepted(h, 1)
    actions = h.optimize(1)
    report, info = [a.message for a in only(actions, 1)]  # type: ignore[union-attr]
    assert isinstance(report, TopologyOptimized) and report.ring == (1,) and report.optimal
    assert report.predicted_seconds == 0.0
    assert isinstance(info, P2PInfo) and info.ring == (1,)
    finish_round(h, (1,))


def test_a_large_group_is_solved_by_the_heuristic() -> None:
    n = EXACT_LIMIT + 1
    conns = tuple(range(1, n + 1))
    order = list(conns)
    random.Random(3).shuffle(order)
    best = tuple(order[order.index(1):] + order[:order.index(1)])
    rate = ring_rate(best)
    h = MasterHarness(reference_bytes=REFERENCE)
    accepted(h, *conns)
    optimize_all(h, conns)
    steps = measure_all(h, rate)
    assert sorted(link for step in steps for link in step) == sorted(links_of(conns))
    assert len(steps) >= 2 * n  # odd: at least 2 n steps
    (job,) = h.pending_solves()
    assert len(job.peers) == n
    h.finish_solves(background=False)
    report = h.last(1, TopologyOptimized)
    assert report.predicted_seconds == pytest.approx(predicted(best, rate))
    assert h.last(1, P2PInfo).ring == report.ring
    assert set(ring_edges(report.ring)) == set(ring_edges(best))


def test_predicted_seconds_are_unknown_while_the_ring_uses_a_link_not_measured() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3)
    accepted(h, *conns)
    optimize_all(h, conns)
    measure_all(h, fail=[(1, 2)])
    (job,) = h.pending_solves()
    h.answer(job.job, error="boom")  # the installed ring (1, 2, 3) stays, 1 -> 2 and all
    report = h.last(1, TopologyOptimized)
    assert report.ring == conns and report.predicted_seconds == -1.0
    assert h.core.topology(0).predicted_seconds == math.inf


# --- peers leaving -------------------------------------------------------------------


def test_after_a_departure_without_a_round_the_solver_starts_afresh() -> None:
    # The installed ring still names the departed peer: nothing to improve on.
    h = MasterHarness(reference_bytes=REFERENCE)
    accepted(h, 1, 2, 3, 4)
    h.close(4)
    optimize_all(h, (1, 2, 3))
    measure_all(h)
    (job,) = h.pending_solves()
    assert job.peers == (1, 2, 3) and job.start is None
    h.finish_solves()
    assert set(h.last(1, P2PInfo).ring) == {1, 2, 3}


def test_the_topology_of_an_empty_group() -> None:
    view = MasterHarness().core.topology(5)
    assert view.peers == () and view.ring == () and view.bandwidth.shape == (0, 0)
    assert view.predicted_seconds == 0.0


def test_a_departed_peers_links_are_forgotten_and_the_others_kept() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimized(h, conns, ring_rate(FAST_RING))
    h.close(4)
    survivors = (1, 2, 3)
    assert h.core.topology(0).peers == survivors
    for conn in survivors:
        h.vote(conn)
    finish_round(h, survivors)
    h.register(5)
    for conn in survivors:
        h.vote(conn)
    finish_round(h, (*survivors, 5))
    optimize_all(h, (*survivors, 5))
    steps = measure_all(h)
    assert sorted(link for step in steps for link in step) == sorted(
        links_of((1, 2, 3, 5)) - links_of(survivors)
    )


def test_a_receiver_dying_mid_step_is_not_waited_for() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    receiver = sorted(h.unanswered)[0]
    other = sorted(h.unanswered)[1]
    h.close(receiver)
    assert h.unanswered.keys() == {other}
    survivors = tuple(c for c in conns if c != receiver)
    steps = measure_all(h, ring_rate(FAST_RING))
    assert all(receiver not in link for step in steps for link in step)
    (job,) = h.pending_solves()
    assert job.peers == survivors
    h.finish_solves()
    for conn in survivors:
        assert h.last(conn, TopologyOptimized).peers == survivors
        assert set(h.last(conn, P2PInfo).ring) == set(survivors)
    assert not numpy.isnan(h.core.topology(0).bandwidth[~numpy.eye(3, dtype=bool)]).any()
    finish_round(h, survivors)


@pytest.mark.parametrize("late", ["measured", "failed"])
def test_a_sender_dying_mid_step_is_ignored_in_its_receivers_late_report(late: str) -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    receiver, message = sorted(h.unanswered.items())[0]
    sender = message.source.peer_id
    h.close(sender)
    if late == "failed":
        actions = h.measure(receiver, error="the sender went away")
    else:
        actions = h.measure(receiver, bandwidth=FAST, latency=LATENCY)
    assert h.view(receiver) is not None and not was_kicked(actions, receiver)
    survivors = tuple(c for c in conns if c != sender)
    assert h.core.topology(0).peers == survivors
    measure_all(h)
    h.finish_solves()
    for conn in survivors:
        report = h.last(conn, TopologyOptimized)
        assert report.peers == survivors and report.unreachable == ()
    finish_round(h, survivors)


def test_a_peer_dying_while_the_solver_runs() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    measure_all(h, ring_rate(FAST_RING))
    assert h.pending_solves()
    actions = h.close(2)
    assert solver_actions(actions) == []  # the job goes on
    assert h.core.optimization_in_progress
    h.finish_solves()
    survivors = (1, 3, 4)
    for conn in survivors:
        report = h.last(conn, TopologyOptimized)
        assert report.peers == survivors and set(report.ring) == set(survivors)
        assert h.last(conn, P2PInfo).ring == report.ring
    finish_round(h, survivors)


def test_a_whole_group_leaving_while_the_solvers_run() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    groups = {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    run_with(h, groups)
    optimize_all(h, groups)
    measure_all(h)
    assert len(h.pending_solves()) == 2
    for conn in (4, 5, 6):
        h.close(conn)
    h.finish_solves()
    assert h.last(1, TopologyOptimized).peers == (1, 2, 3)
    assert reports(h, 4) == []
    info = h.last(1, P2PInfo)
    assert set(info.ring) == {1, 2, 3} and info.world.num_distinct_peer_groups == 1
    finish_round(h, (1, 2, 3))


@pytest.mark.parametrize("when", ["measuring", "solving"])
def test_every_participant_leaving_drops_the_optimization(when: str) -> None:
    h = MasterHarness()
    conns = (1, 2, 3)
    accepted(h, *conns)
    optimize_all(h, conns)
    if when == "solving":
        measure_all(h)
    jobs = [j.job for j in h.pending_solves()]
    h.register(4)  # waits: no round admits it while the optimization runs
    assert h.received(4, P2PInfo) == []
    h.close(1)
    h.close(2)
    assert h.received(4, P2PInfo) == []
    actions = h.close(3)
    assert [a.job for a in solver_actions(actions) if isinstance(a, CancelSolve)] == jobs
    assert not h.core.optimization_in_progress
    assert h.last(4, P2PInfo).ring == (4,)  # nobody left to ask: admitted
    for job in jobs:  # the cancelled job's late answer changes nothing
        assert h.answer(job, order=(0, 1, 2), optimal=True) == []
    finish_round(h, (4,))
    assert reports(h, 4) == []


def test_a_receiver_that_does_not_report_is_kicked_at_the_step_deadline() -> None:
    h = MasterHarness(heartbeat_interval=10.0, liveness_timeout=20.0, round_timeout=3.0)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    h.tick(h.now + 1.0)
    optimize_all(h, conns)
    start = h.now
    first, lazy = sorted(h.unanswered)
    assert h.core.next_deadline() == start + 3.0
    h.tick(start + 2.0)
    h.measure(first, bandwidth=SLOW, latency=LATENCY)
    assert h.core.next_deadline() == start + 3.0  # still the step's deadline
    assert h.tick(start + 2.999) == [] and h.view(lazy) is not None
    actions = h.tick()
    assert h.now == start + 3.0
    assert was_kicked(actions, lazy)
    assert "did not report its link measurement within 3.0s" in (h.kick_reason(lazy) or "")
    assert h.view(lazy) is None
    assert asked(actions), "the next step starts at once"
    assert h.core.next_deadline() == start + 6.0
    survivors = tuple(c for c in conns if c != lazy)
    measure_all(h)
    h.finish_solves()
    assert {h.last(c, TopologyOptimized).peers for c in survivors} == {survivors}


# --- what a peer may send -------------------------------------------------------------


def running_optimization(h: MasterHarness) -> None:
    accepted(h, 1, 2, 3, 4)
    optimize_all(h, (1, 2, 3, 4))


def answer(h: MasterHarness, conn: int, **changes: int) -> LinkMeasured:
    """``conn``'s correct answer to its last MeasureLink, with ``changes``."""
    message = h.last(conn, MeasureLink)
    fields = {"optimization": message.optimization, "sender": message.source.peer_id}
    fields.update(changes)
    return LinkMeasured(bandwidth=SLOW, latency=LATENCY, **fields)


def _no_optimization(h: MasterHarness) -> tuple[int, LinkMeasured]:
    accepted(h, 1, 2)
    return 1, LinkMeasured(optimization=1, sender=2, bandwidth=SLOW)


def _wrong_optimization(h: MasterHarness) -> tuple[int, LinkMeasured]:
    running_optimization(h)
    conn = min(h.unanswered)
    return conn, answer(h, conn, optimization=2)


def _wrong_sender(h: MasterHarness) -> tuple[int, LinkMeasured]:
    running_optimization(h)
    conn, message = min(h.unanswered.items())
    other = next(p for p in (1, 2, 3, 4) if p not in (conn, message.source.peer_id))
    return conn, answer(h, conn, sender=other)


def _not_asked(h: MasterHarness) -> tuple[int, LinkMeasured]:
    running_optimization(h)
    senders = {m.source.peer_id for m in h.unanswered.values()}
    conn = min(senders - set(h.unanswered))
    return conn, LinkMeasured(optimization=1, sender=min(h.unanswered), bandwidth=SLOW)


def _twice(h: MasterHarness) -> tuple[int, LinkMeasured]:
    running_optimization(h)
    conn = min(h.unanswered)
    message = answer(h, conn)
    h.send(conn, message)
    return conn, message


def _registered(h: MasterHarness) -> tuple[int, LinkMeasured]:
    running_optimization(h)
    h.register(5)
    return 5, LinkMeasured(optimization=1, sender=1, bandwidth=SLOW)


def _after_the_end(h: MasterHarness) -> tuple[int, LinkMeasured]:
    accepted(h, 1, 2)
    optimize_all(h, (1, 2))
    first = min(h.unanswered)
    message = answer(h, first)
    measure_all(h)
    return first, message


ILLEGAL: dict[str, Callable[[MasterHarness], tuple[int, LinkMeasured]]] = {
    "no-optimization": _no_optimization,
    "wrong-optimization": _wrong_optimization,
    "wrong-sender": _wrong_sender,
    "not-asked": _not_asked,
    "twice": _twice,
    "registered-peer": _registered,
    "after-the-end": _after_the_end,
}


@pytest.mark.parametrize("name", list(ILLEGAL))
def test_a_measurement_not_asked_for_gets_the_peer_kicked(name: str) -> None:
    h = MasterHarness()
    conn, message = ILLEGAL[name](h)
    actions = h.send(conn, message)
    assert was_kicked(actions, conn)
    reason = h.kick_reason(conn) or ""
    assert reason.startswith("illegal LinkMeasured") and "not asked to measure" in reason


def test_the_optimization_goes_on_without_a_kicked_peer() -> None:
    h = MasterHarness()
    running_optimization(h)
    conn = min(h.unanswered)
    h.send(conn, answer(h, conn, optimization=9))
    survivors = tuple(c for c in (1, 2, 3, 4) if c != conn)
    measure_all(h)
    h.finish_solves()
    assert {h.last(c, TopologyOptimized).peers for c in survivors} == {survivors}
    finish_round(h, survivors)


def test_a_vote_with_collectives_in_flight_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5)
    assert was_kicked(h.optimize(1), 1)
    assert "collectives in flight" in (h.kick_reason(1) or "")


# --- the vote against other calls -----------------------------------------------------


def test_optimize_is_refused_when_another_peer_updates_the_topology() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.optimize(1)
    h.optimize(2)
    actions = h.vote(3)
    for conn in (1, 2):
        (refusal,) = [a.message for a in only(actions, conn)]  # type: ignore[union-attr]
        assert isinstance(refusal, TopologyOptimized) and refusal.optimization == 0
        assert "peer 3 called update_topology" in refusal.error
        assert "optimize_topology" in refusal.error and not refusal.rejoin
        assert h.where(conn) == (ACC, IDLE)
    assert h.where(3) == (ACC, VOTED) and only(actions, 3) == []
    # The refused peers follow the other call: the round runs.
    h.vote(1)
    h.vote(2)
    assert h.core.round_in_progress


def test_optimize_joins_a_round_that_only_re_establishes_the_ring() -> None:
    """Group 1 re-establishes its ring after an aborted all-reduce (as its own
    optimize_topology does first) while group 0 votes to optimize: group 0 is told to
    join that round (``rejoin``), and afterwards everyone optimizes together."""
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    h.vote(3, accept=False)
    actions = h.optimize(1) + h.optimize(2)
    for conn in (1, 2):
        (refusal,) = [a.message for a in only(actions, conn)]  # type: ignore[union-attr]
        assert isinstance(refusal, TopologyOptimized) and refusal.rejoin
        assert "re-establishes the ring" in refusal.error
        h.vote(conn, accept=False)
    h.vote(4, accept=False)
    finish_round(h, (1, 2, 3, 4))
    optimize_all(h, (1, 2, 3, 4))
    assert h.core.optimization_in_progress


def test_a_background_ring_using_a_link_found_unreachable_since_is_dropped() -> None:
    """The background search judges its ring on the links as measured when it began; the
    optimization's round then found one of that ring's links unreachable: the better
    ring it reports is not installed, the working ring stays."""
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    measure_all(h, two_rings_rate())
    (job,) = h.pending_solves()
    (search,) = solver_actions(
        h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=False)
    )
    assert isinstance(search, Solve)
    # The round on FAST_RING fails: peer 1 reports peer 4 unreachable (1 -> 4 is
    # REVERSE_RING's first hop); a retry round goes through.
    for conn in conns:
        h.report(conn, ok=conn != 1, failed=(4,) if conn == 1 else ())
    for conn in conns:
        h.vote(conn, accept=False)
    assert finish_round(h, conns).ring == FAST_RING
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == FAST_RING


def test_optimize_after_update_topology_is_refused_at_once() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.vote(2)
    actions = h.optimize(1)
    refusal = h.last(1, TopologyOptimized)
    assert refusal.optimization == 0 and "peer 2 called update_topology" in refusal.error
    assert only(actions, 2) == [] and h.where(1) == (ACC, IDLE)
    assert not h.core.optimization_in_progress


@pytest.mark.parametrize("first", ["initiate", "optimize"])
def test_a_vote_to_optimize_aborts_its_groups_collectives(first: str) -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    if first == "initiate":
        h.initiate(1, 7)
        h.optimize(2)
    else:
        h.optimize(2)
        h.initiate(1, 7)
    verdict = h.last(1, CollectiveVerdict)
    assert (verdict.tag, verdict.seq, verdict.outcome) == (7, 0, Outcome.ABORTED)
    assert "peer 2 voted to optimize the topology" in verdict.reason
    # The other group's collective runs.
    h.initiate(3, 7)
    h.initiate(4, 7)
    assert h.last(3, CollectiveCommence).ring == h.last(4, CollectiveCommence).ring == (3, 4)


@pytest.mark.parametrize("asker", [1, 3], ids=["same-group", "other-group"])
@pytest.mark.parametrize("first", ["pending", "optimize"])
def test_a_vote_to_optimize_refuses_pending_votes(first: str, asker: int) -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    if first == "pending":
        h.pending(asker)
        h.optimize(2)
    else:
        h.optimize(2)
        h.pending(asker)
    result = h.last(asker, PeersPendingResult)
    assert not result.pending
    assert "peer 2 called optimize_topology" in result.error


def test_a_vote_to_optimize_refuses_its_groups_sync_votes_only() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    h.send(1, sync_vote())
    h.optimize(2)
    plan = h.last(1, SharedStatePlan)
    assert plan.sync == 0 and "peer 2 called optimize_topology" in plan.error
    assert h.where(1) == (ACC, IDLE)
    # The other group syncs.
    h.send(3, sync_vote())
    h.send(4, sync_vote())
    assert h.last(3, SharedStatePlan).error == "" and h.last(3, SharedStatePlan).sync > 0
    # A sync vote after the optimize vote is refused at once.
    h.send(1, sync_vote())
    assert len(h.received(1, SharedStatePlan)) == 2 and h.where(1) == (ACC, IDLE)


def test_a_peer_waiting_to_register_is_not_admitted_by_the_optimization_round() -> None:
    h = MasterHarness()
    conns = (1, 2)
    accepted(h, *conns)
    h.optimize(1)
    h.register(3)  # during the vote
    h.optimize(2)
    h.register(4)  # during the optimization
    measure_all(h)
    assert h.last(1, P2PInfo).ring == (1, 2)
    assert h.received(3, P2PInfo) == h.received(4, P2PInfo) == []
    finish_round(h, conns)
    assert h.where(3) == h.where(4) == (PeerPhase.REGISTERED, IDLE)


def test_a_voter_leaving_lets_the_others_start() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.optimize(1)
    h.optimize(2)
    actions = h.close(3)
    assert asked(actions) and h.core.optimization_in_progress


# --- two groups ----------------------------------------------------------------------


def test_two_groups_are_measured_in_the_same_steps_and_solved_apart() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    groups = {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    run_with(h, groups)
    assert h.core.ring(0) == [1, 2, 3] and h.core.ring(1) == [4, 5, 6]
    optimize_all(h, groups)
    rate = ring_rate((1, 3, 2))  # group 1 keeps (4, 5, 6): every ring of 3 ties there
    steps = measure_all(h, rate)
    assert len(steps) == 6  # not 12: the groups' steps run together
    for step in steps:
        assert sorted(groups[a] for a, _b in step) == [0, 1]
    jobs = h.pending_solves()
    assert [(j.group, j.peers) for j in jobs] == [(0, (1, 2, 3)), (1, (4, 5, 6))]
    h.finish_solves()
    for conn, group in groups.items():
        report = h.last(conn, TopologyOptimized)
        members = (1, 2, 3) if group == 0 else (4, 5, 6)
        ring = (1, 3, 2) if group == 0 else (4, 5, 6)
        assert report.peers == members and report.ring == ring
        info = h.last(conn, P2PInfo)
        assert info.ring == ring
        assert (info.world.global_world_size, info.world.num_distinct_peer_groups) == (6, 2)
    finish_round(h, groups)
    assert h.core.ring(0) == [1, 3, 2] and h.core.ring(1) == [4, 5, 6]


# --- keeping the installed ring ------------------------------------------------------


def margin_rate(factor: float) -> Rate:
    """Every link at 10 MB/s but 1 -> 2, a link of the installed ring (1, 2, 3, 4), at
    ``factor`` times that."""
    return lambda a, b: 10e6 * factor if (a, b) == (1, 2) else 10e6


@pytest.mark.parametrize(("factor", "kept"), [(0.98, True), (0.9, False)])
def test_a_ring_only_marginally_faster_is_not_installed(factor: float, kept: bool) -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    rate = margin_rate(factor)
    old = predicted(conns, rate)
    optimize_all(h, conns)
    measure_all(h, rate)
    (job,) = h.pending_solves()
    solution = default_solver(job)
    best = tuple(job.peers[i] for i in solution.order)
    new = predicted(best, rate)
    assert new < old and (new * (1 + KEEP_MARGIN) >= old) == kept
    h.finish_solves(background=False)
    report = h.last(1, TopologyOptimized)
    expected = conns if kept else best
    assert report.ring == expected and h.last(1, P2PInfo).ring == expected
    assert report.predicted_seconds == pytest.approx(predicted(expected, rate))
    assert report.optimal is not kept  # a faster ring exists when the installed one stays
    finish_round(h, conns)
    assert h.core.topology(0).ring == expected


def test_a_ring_kept_for_its_margin_stays_at_the_next_update_topology() -> None:
    # The master decided the marginally faster ring is not worth re-connecting for
    # (KEEP_MARGIN): no background search may install it at the next update_topology.
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    measure_all(h, margin_rate(0.98))
    h.finish_solves(background=False)
    assert h.last(1, TopologyOptimized).ring == conns
    finish_round(h, conns)
    h.finish_solves()  # whatever search the shell still runs
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == conns


# --- the background search -----------------------------------------------------------


def two_rings_rate(a: float = MEDIUM, b: float = FAST) -> Rate:
    """FAST_RING's links at ``a``, REVERSE_RING's at ``b``, SLOW elsewhere."""
    first, second = set(ring_edges(FAST_RING)), set(ring_edges(REVERSE_RING))
    return lambda x, y: a if (x, y) in first else b if (x, y) in second else SLOW


def with_background(h: MasterHarness, conns: Sequence[int] = (1, 2, 3, 4)) -> Solve:
    """Optimize ``conns`` with a first answer of FAST_RING that is not optimal (the
    reverse ring is faster); return the background job, the round done."""
    accepted(h, *conns)
    optimize_all(h, conns)
    measure_all(h, two_rings_rate())
    (job,) = h.pending_solves()
    actions = h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=False)
    (search,) = solver_actions(actions)
    assert isinstance(search, Solve)
    report = h.last(1, TopologyOptimized)
    assert report.ring == FAST_RING and not report.optimal
    assert h.last(1, P2PInfo).ring == FAST_RING
    finish_round(h, conns)
    return search


def test_a_first_answer_not_optimal_starts_a_background_search() -> None:
    h = MasterHarness(reference_bytes=REFERENCE, search_seconds=42.0)
    search = with_background(h)
    assert search.background and search.seconds == 42.0
    assert search.group == 0 and search.peers == (1, 2, 3, 4)
    assert search.start == indices(search.peers, FAST_RING)
    assert h.pending_solves() == [search]


def test_no_background_search_without_search_seconds() -> None:
    h = MasterHarness(search_seconds=0.0)
    accepted(h, 1, 2, 3, 4)
    optimize_all(h, (1, 2, 3, 4))
    measure_all(h, two_rings_rate())
    (job,) = h.pending_solves()
    actions = h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=False)
    assert solver_actions(actions) == [] and h.pending_solves() == []


@pytest.mark.parametrize("solver", ["given", "heuristic"])
def test_a_better_background_ring_is_installed_by_the_next_update_topology(solver: str) -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    if solver == "given":
        actions = h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    else:
        actions = h.finish_solves()
    assert actions == []  # nothing changes until the peers ask
    assert h.core.ring(0) == list(FAST_RING)
    for conn in conns:
        h.vote(conn)
    assert {h.last(c, P2PInfo).ring for c in conns} == {REVERSE_RING}
    assert finish_round(h, conns).ring == REVERSE_RING
    assert h.core.topology(0).ring == REVERSE_RING
    # Installed once: the round after keeps it without another search.
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == REVERSE_RING


def test_a_background_ring_no_better_is_dropped() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    assert h.answer(search.job, order=indices(search.peers, (3, 2, 4, 1))) == []  # a rotation
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == FAST_RING


def test_a_background_ring_only_marginally_better_is_dropped() -> None:
    # KEEP_MARGIN applies to the background search's ring too.
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    accepted(h, *conns)
    optimize_all(h, conns)
    rate = two_rings_rate(a=20e6, b=20.4e6)
    measure_all(h, rate)
    (job,) = h.pending_solves()
    h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=False)
    (search,) = h.pending_solves()
    finish_round(h, conns)
    assert predicted(REVERSE_RING, rate) < predicted(FAST_RING, rate)
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == FAST_RING


@pytest.mark.parametrize("order", [(0, 0, 1, 2), (0, 1, 2), (0, 1, 2, 3, 4), (0, 1, 2, 7), ()])
def test_a_bogus_background_answer_is_dropped(order: tuple[int, ...]) -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    assert h.answer(search.job, order=order, optimal=True) == []
    for conn in conns:
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == FAST_RING


def test_a_peer_leaving_cancels_the_background_search() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    search = with_background(h)
    actions = h.close(4)
    assert [a for a in solver_actions(actions)] == [CancelSolve(job=search.job)]
    assert h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True) == []
    for conn in (1, 2, 3):
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == (1, 3, 2)


def test_a_peer_leaving_drops_the_better_ring_found() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    search = with_background(h)
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    assert solver_actions(h.close(4)) == []  # nothing to cancel: it finished
    for conn in (1, 2, 3):
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == (1, 3, 2)  # FAST_RING less 4, not REVERSE_RING less 4


def test_a_peer_joining_cancels_the_background_search() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    h.register(5)
    actions: list[Action] = []
    for conn in conns:
        actions = h.vote(conn)
    assert [a for a in actions if isinstance(a, CancelSolve)] == [CancelSolve(job=search.job)]
    assert h.last(5, P2PInfo).ring == (*FAST_RING, 5)
    assert h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True) == []
    finish_round(h, (*conns, 5))
    for conn in (*conns, 5):
        h.vote(conn)
    assert h.last(5, P2PInfo).ring == (*FAST_RING, 5)


def test_a_peer_joining_drops_the_better_ring_found() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    h.register(5)
    for conn in conns:
        h.vote(conn)
    assert h.last(5, P2PInfo).ring == (*FAST_RING, 5)


def test_a_peer_joining_another_group_keeps_the_background_search() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    h.register(5, group=1)
    actions: list[Action] = []
    for conn in conns:
        actions = h.vote(conn)
    assert [a for a in actions if isinstance(a, CancelSolve)] == []
    finish_round(h, (*conns, 5))
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    for conn in (*conns, 5):
        h.vote(conn)
    assert h.last(1, P2PInfo).ring == REVERSE_RING and h.last(5, P2PInfo).ring == (5,)


def test_a_new_optimization_cancels_the_background_search_and_starts_from_its_ring() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    actions = optimize_all(h, conns)
    cancel, first = solver_actions(actions)  # type: ignore[misc]
    assert cancel == CancelSolve(job=search.job)
    assert isinstance(first, Solve) and not first.background
    assert first.start == indices(first.peers, FAST_RING)


def test_a_new_optimization_starts_from_the_better_ring_found() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)
    actions = optimize_all(h, conns)
    (first,) = solver_actions(actions)
    assert isinstance(first, Solve) and first.start == indices(first.peers, REVERSE_RING)
    h.finish_solves()
    assert h.last(1, TopologyOptimized).ring == REVERSE_RING
    assert h.last(1, P2PInfo).ring == REVERSE_RING


@pytest.mark.parametrize("answer", ["error", "bogus", "installed-ring"])
def test_the_reported_ring_is_the_ring_its_round_installs(answer: str) -> None:
    # The background search found a better ring, which waits for the group's next
    # round. Then an optimization keeps the installed ring (its solver failed, or
    # answered nothing faster). Its report must name the ring that the round following
    # it installs, whichever that is: peers act on the report (TopologyInfo), and the
    # round's P2PInfo is what they connect to.
    h = MasterHarness(reference_bytes=REFERENCE)
    conns = (1, 2, 3, 4)
    search = with_background(h, conns)
    h.answer(search.job, order=indices(search.peers, REVERSE_RING), optimal=True)

    optimize_all(h, conns)
    (job,) = h.pending_solves(background=False)
    assert job.start == indices(job.peers, REVERSE_RING)  # it starts from the better ring
    if answer == "error":
        h.answer(job.job, error="the solver crashed")
    elif answer == "bogus":
        h.answer(job.job, order=(0, 0, 0, 0), optimal=True)
    else:
        h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=False)
    for conn in conns:
        report, info = h.last(conn, TopologyOptimized), h.last(conn, P2PInfo)
        assert report.optimization == 2 and info.round == h.latest_round
        assert info.ring == report.ring, (
            f"TopologyOptimized names the ring {report.ring}, its round installs {info.ring}"
        )
        assert report.predicted_seconds == pytest.approx(predicted(info.ring, two_rings_rate()))


# --- solver answers --------------------------------------------------------------------


def solving(h: MasterHarness) -> Solve:
    accepted(h, 1, 2, 3, 4)
    optimize_all(h, (1, 2, 3, 4))
    measure_all(h, ring_rate(FAST_RING))
    (job,) = h.pending_solves()
    return job


def test_a_solver_error_keeps_the_installed_ring() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    job = solving(h)
    h.answer(job.job, error="RuntimeError: out of memory")
    report = h.last(1, TopologyOptimized)
    assert report.ring == (1, 2, 3, 4) and not report.optimal and report.error == ""
    assert h.last(1, P2PInfo).ring == (1, 2, 3, 4)
    finish_round(h, (1, 2, 3, 4))


@pytest.mark.parametrize(
    "order", [(0, 0, 1, 2), (0, 1, 2), (0, 1, 2, 3, 4), (0, 1, 2, 7), (), (3, 2, 1, 0, 0)]
)
def test_a_bogus_order_is_a_failed_search(order: tuple[int, ...]) -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    job = solving(h)
    h.answer(job.job, order=order, optimal=True)
    report = h.last(1, TopologyOptimized)
    assert report.ring == (1, 2, 3, 4) and not report.optimal
    assert h.last(1, P2PInfo).ring == (1, 2, 3, 4)
    finish_round(h, (1, 2, 3, 4))


def test_answers_for_unknown_or_finished_jobs_are_ignored() -> None:
    h = MasterHarness(reference_bytes=REFERENCE)
    assert h.answer(99, order=(0,), optimal=True) == []  # nothing runs at all
    job = solving(h)
    assert h.answer(job.job + 1, order=(0, 1, 2, 3), optimal=True) == []
    assert h.core.optimization_in_progress
    assert h.answer(job.job, order=indices(job.peers, FAST_RING), optimal=True)
    assert h.last(1, P2PInfo).ring == FAST_RING
    assert h.answer(job.job, order=(0, 1, 2, 3), optimal=True) == []  # answered twice
    finish_round(h, (1, 2, 3, 4))
    assert h.core.ring(0) == list(FAST_RING)


# --- random interleavings (``sim_topology``) ---------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleavings_end_with_one_report_and_one_round(seed: int) -> None:
    Chaos(seed).run()


def test_random_interleavings_exercise_every_kind_of_event() -> None:
    # Guards the test above: across its seeds, each kind of event occurs.
    stats: Counter[str] = Counter()
    for seed in SEEDS:
        chaos = Chaos(seed)
        chaos.run()
        stats += chaos.stats
    expected = {
        "earlier", "measure", "measure-error", "late-report", "kill", "kill-measuring",
        "step-deadline", "join", "stray-kicked", "solve", "solve-not-optimal", "solve-error",
        "solve-bogus", "solve-shuffled", "solve-after-death", "reported", "newcomers-admitted",
        "background",
    }
    assert expected <= stats.keys(), expected - stats.keys()
