"""Shared state on the master: the election (``elect``, a pure function) and the sync
phases of ``MasterCore`` (votes, plans, reports, completion, revisions, refusals, kicks).

The election cases port PCCL's ``test_shared_state_distribution.cpp`` scenarios (resume
at 13, popularity, drag-along, partial dirtiness, mask mismatch kicks, strategy
mixing) to direct calls; the flows drive ``MasterCore`` through ``MasterHarness``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from pccl_trio._core.master import PeerState
from pccl_trio._core.messages import (
    STRATEGY_NAMES,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveVerdict,
    Kick,
    Outcome,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    PeersPendingResult,
    SharedStateComplete,
    SharedStateDone,
    SharedStateEntry,
    SharedStateFetch,
    SharedStatePlan,
)
from pccl_trio._core.shared_state import (
    Ballot,
    Election,
    elect,
    tensor_spans,
)

from .master_harness import MasterHarness, only, was_kicked
from .scenarios import (
    ACC,
    DOUBLE,
    IDLE,
    OPT,
    SDONE,
    SVOTED,
    SYNCING,
    E,
    R,
    S,
    accepted,
    ballot,
    done,
    endpoint,
    entry,
    fetch,
    fetcher,
    got,
    plan_of,
    run_with,
    started,
    vote,
)

# Two versions of tensors "w" and "b", a third tensor "c", and an optimizer-like tensor
# whose content may differ between peers (hash 0, as PCCL's clients send it).
W1, W2, W3 = entry("w", 1), entry("w", 2), entry("w", 3)
B1, B2 = entry("b", 11), entry("b", 12)
C1 = entry("c", 21)


# --- elect, directly ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    ballots: dict[int, Ballot]
    expected: int | None = None
    revision: int
    fetches: dict[int, tuple[SharedStateFetch, ...]]
    distributors: tuple[int, ...]
    kicks: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # what each says


def check(election: Election, case: Case) -> None:
    assert election.revision == case.revision
    assert dict(election.fetches) == case.fetches
    assert election.distributors == case.distributors
    assert set(election.kicks) == set(case.kicks), election.kicks
    for peer_id, phrases in case.kicks.items():
        for phrase in phrases:
            assert phrase in election.kicks[peer_id], (phrase, election.kicks[peer_id])
    # Every voter is either kicked or told what to fetch; distributors need nothing.
    assert set(election.kicks).isdisjoint(election.fetches)
    assert set(election.kicks) | set(election.fetches) == set(case.ballots)
    assert all(election.fetches[d] == () for d in election.distributors)
    assert list(election.distributors) == sorted(election.distributors)


CASES: dict[str, Case] = {
    # PCCL's TestOneIncrementRuleViolationInitialization: the first sync may resume at
    # 13; a joiner at 0 is dragged to 13 and gets the differing keys and the keys whose
    # content may differ (joiners obtain some version of those).
    "resume-at-13-drags-a-joiner": Case(
        ballots={1: ballot(13, W1, B1, OPT), 2: ballot(13, W1, B1, OPT), 3: ballot(0, W2, B1, OPT)},
        revision=13,
        fetches={1: (), 2: (), 3: (fetch(W1), fetch(OPT))},
        distributors=(1, 2),
    ),
    "a-joiner-with-equal-content-still-gets-the-content-unequal-keys": Case(
        ballots={1: ballot(13, W1, OPT), 2: ballot(0, W1, OPT)},
        revision=13,
        fetches={1: (), 2: (fetch(OPT),)},
        distributors=(1,),
    ),
    "first-sync-highest-revision-is-current-whatever-the-numbers": Case(
        ballots={1: ballot(0, W2), 2: ballot(0, W2), 3: ballot(0, W2), 4: ballot(5, W1)},
        revision=5,
        fetches={1: (fetch(W1),), 2: (fetch(W1),), 3: (fetch(W1),), 4: ()},
        distributors=(4,),
    ),
    # TestPopularHashPrevelance: 2 vs 1, the minority (here the lowest id) loses.
    "popularity-2-vs-1": Case(
        ballots={1: ballot(0, W1, B1), 2: ballot(0, W2, B1), 3: ballot(0, W2, B1)},
        revision=0,
        fetches={1: (fetch(W2),), 2: (), 3: ()},
        distributors=(2, 3),
    ),
    "popularity-with-multiple-keys": Case(
        ballots={1: ballot(0, W1, B1), 2: ballot(0, W2, B2), 3: ballot(0, W2, B2)},
        revision=0,
        fetches={1: (fetch(W2), fetch(B2)), 2: (), 3: ()},
        distributors=(2, 3),
    ),
    "one-current-peer-beats-three-outdated-ones": Case(
        ballots={
            1: ballot(4, W2, B2), 2: ballot(4, W2, B2), 3: ballot(4, W2, B2), 4: ballot(5, W1, B1),
        },
        expected=5,
        revision=5,
        fetches={1: (fetch(W1), fetch(B1)), 2: (fetch(W1), fetch(B1)), 3: (fetch(W1), fetch(B1)), 4: ()},
        distributors=(4,),
    ),
    "tie-goes-to-the-lowest-peer-id": Case(
        ballots={5: ballot(0, W2), 2: ballot(0, W1)},
        revision=0,
        fetches={2: (), 5: (fetch(W1),)},
        distributors=(2,),
    ),
    "tie-2-vs-2-goes-to-the-list-of-the-lowest-peer-id": Case(
        ballots={3: ballot(0, W1), 4: ballot(0, W1), 2: ballot(0, W2), 5: ballot(0, W2)},
        revision=0,
        fetches={2: (), 3: (fetch(W2),), 4: (fetch(W2),), 5: ()},
        distributors=(2, 5),
    ),
    "tie-among-current-peers-only": Case(
        ballots={1: ballot(4, W1), 2: ballot(5, W2), 3: ballot(5, W3)},
        expected=5,
        revision=5,
        fetches={1: (fetch(W2),), 2: (), 3: (fetch(W2),)},
        distributors=(2,),
    ),
    # TestPartialSyncPartiallyDirtyState: only the differing key moves.
    "partial-dirtiness": Case(
        ballots={1: ballot(0, W1, B1, C1), 2: ballot(0, W1, B1, C1), 3: ballot(0, W1, B2, C1)},
        revision=0,
        fetches={1: (), 2: (), 3: (fetch(B1),)},
        distributors=(1, 2),
    ),
    # TestNoSyncIdenticalSharedState.
    "identical-state-moves-nothing": Case(
        ballots={1: ballot(0, W1, B1, OPT), 2: ballot(0, W1, B1, OPT), 3: ballot(0, W1, B1, OPT)},
        revision=0,
        fetches={1: (), 2: (), 3: ()},
        distributors=(1, 2, 3),
    ),
    "content-unequal-keys-are-never-compared-between-current-peers": Case(
        ballots={1: ballot(0, W1, entry("opt", 10, aci=True)), 2: ballot(0, W1, entry("opt", 20, aci=True))},
        revision=0,
        fetches={1: (), 2: ()},
        distributors=(1, 2),
    ),
    "an-outdated-peer-with-equal-content-only-adopts-the-revision": Case(
        ballots={1: ballot(3, W1, B1), 2: ballot(2, W1, B1)},
        expected=3,
        revision=3,
        fetches={1: (), 2: ()},
        distributors=(1, 2),
    ),
    "an-outdated-peer-with-other-content-fetches-it": Case(
        ballots={1: ballot(3, W1, B1), 2: ballot(3, W1, B1), 3: ballot(1, W2, B1)},
        expected=3,
        revision=3,
        fetches={1: (), 2: (), 3: (fetch(W1),)},
        distributors=(1, 2),
    ),
    "nobody-holds-the-expected-revision-the-highest-voted-is-the-target": Case(
        ballots={1: ballot(4, W1), 2: ballot(3, W2)},
        expected=6,
        revision=4,
        fetches={1: (), 2: (fetch(W1),)},
        distributors=(1,),
    ),
    # Strategies.
    "all-receive-only-same-content-everyone-kicked": Case(
        ballots={1: ballot(0, W1, strategy=R), 2: ballot(0, W1, strategy=R)},
        revision=0,
        fetches={},
        distributors=(),
        kicks={1: ("RECEIVE_ONLY", "nobody may send"), 2: ("RECEIVE_ONLY", "nobody may send")},
    ),
    "all-receive-only-different-content-everyone-kicked": Case(
        ballots={1: ballot(0, W1, strategy=R), 2: ballot(0, W2, strategy=R), 3: ballot(0, W2, strategy=R)},
        revision=0,
        fetches={},
        distributors=(),
        kicks={p: ("RECEIVE_ONLY",) for p in (1, 2, 3)},
    ),
    "a-lone-receive-only-peer-is-kicked": Case(
        ballots={1: ballot(0, W1, strategy=R)},
        revision=0,
        fetches={},
        distributors=(),
        kicks={1: ("RECEIVE_ONLY",)},
    ),
    # TestDifferentSharedStatetContentBothSendOnlyStrategyKick: the tie goes to peer 1;
    # peer 2 would have to receive, which a SEND_ONLY peer may not.
    "send-only-with-different-content-kicks-the-loser": Case(
        ballots={1: ballot(0, W1, B1, strategy=S), 2: ballot(0, W2, B1, strategy=S)},
        revision=0,
        fetches={1: ()},
        distributors=(1,),
        kicks={2: ("SEND_ONLY", "differs in key 'w'")},
    ),
    "send-only-minority-is-kicked-even-with-the-lowest-id": Case(
        ballots={1: ballot(0, W1, B2, strategy=S), 2: ballot(0, W1, B1, strategy=S),
                 3: ballot(0, W1, B1, strategy=S)},
        revision=0,
        fetches={2: (), 3: ()},
        distributors=(2, 3),
        kicks={1: ("SEND_ONLY", "differs in key 'b'")},
    ),
    "send-only-with-equal-content-all-distribute": Case(
        ballots={1: ballot(0, W1, strategy=S), 2: ballot(0, W1, strategy=S)},
        revision=0,
        fetches={1: (), 2: ()},
        distributors=(1, 2),
    ),
    "an-outdated-send-only-peer-is-kicked": Case(
        ballots={1: ballot(3, W1, strategy=S), 2: ballot(2, W1, strategy=S)},
        expected=3,
        revision=3,
        fetches={1: ()},
        distributors=(1,),
        kicks={2: ("SEND_ONLY", "is at revision 2, not 3")},
    ),
    # The async-DiLoCo "eavesdrop": SEND_ONLY peers distribute, a RECEIVE_ONLY joiner
    # (outdated, other content) fetches.
    "eavesdrop-send-only-distribute-receive-only-joiner-fetches": Case(
        ballots={1: ballot(4, W1, B1, OPT, strategy=S), 2: ballot(4, W1, B1, OPT, strategy=S),
                 3: ballot(0, W2, B1, OPT, strategy=R)},
        expected=4,
        revision=4,
        fetches={1: (), 2: (), 3: (fetch(W1), fetch(OPT))},
        distributors=(1, 2),
    ),
    "distributors-exclude-dirty-and-receive-only-peers": Case(
        ballots={1: ballot(0, W1, strategy=S), 2: ballot(0, W1, strategy=R),
                 3: ballot(0, W2, strategy=R), 4: ballot(0, W1, strategy=S)},
        revision=0,
        fetches={1: (), 2: (), 3: (fetch(W1),), 4: ()},
        distributors=(1, 4),
    ),
    "receive-only-votes-offer-no-candidate": Case(
        # Two RECEIVE_ONLY peers agree on W2, but only the SEND_ONLY peer's W1 is offered.
        ballots={1: ballot(0, W2, strategy=R), 2: ballot(0, W2, strategy=R), 3: ballot(0, W1, strategy=S)},
        revision=0,
        fetches={1: (fetch(W1),), 2: (fetch(W1),), 3: ()},
        distributors=(3,),
    ),
    "a-receive-only-peer-with-other-tensors-is-kicked": Case(
        ballots={1: ballot(0, W1, strategy=S), 2: ballot(0, B1, strategy=R)},
        revision=0,
        fetches={1: ()},
        distributors=(1,),
        kicks={2: ("'b'", "'w'")},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_elect(name: str) -> None:
    case = CASES[name]
    election = elect(case.ballots, case.expected)
    check(election, case)
    # The outcome does not depend on the order the votes came in.
    assert elect(dict(reversed(case.ballots.items())), case.expected) == election


# TestSharedStateMaskMismatchKick: a peer whose tensor list differs from the popular one
# in anything but hashes is kicked, with the first differing key named.
POPULAR = (W1, B1, OPT)
MISMATCHES: dict[str, tuple[tuple[SharedStateEntry, ...], tuple[str, ...]]] = {
    "key-name": ((entry("x", 1), B1, OPT), ("tensor 0", "'x'", "'w'")),
    "key-order": ((B1, W1, OPT), ("tensor 0", "'b'", "'w'")),
    "dtype": ((entry("w", 1, dtype=DOUBLE), B1, OPT), ("'w'", "DOUBLE", "FLOAT")),
    "count": ((W1, entry("b", 11, count=8), OPT), ("'b'", "8 x FLOAT", "4 x FLOAT")),
    "content-inequality-flag": ((W1, B1, entry("opt", 0, aci=False)), ("'opt'", "allow_content_inequality")),
    "extra-entry": ((W1, B1, OPT, entry("extra", 5)), ("'extra'", "4 tensors", "3")),
    "missing-entry": ((W1, B1), ("'opt'", "2 tensors", "3")),
    "no-entries": ((), ("'w'", "0 tensors")),
    "mismatch-and-other-content": ((W2, entry("b", 12, count=5), OPT), ("'b'", "5 x FLOAT")),
}


@pytest.mark.parametrize("outdated", [False, True], ids=["current", "outdated"])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_elect_kicks_a_mismatch_naming_the_key(name: str, outdated: bool) -> None:
    odd, phrases = MISMATCHES[name]
    # The odd one is peer 1: the lowest id does not save a minority.
    ballots = {1: ballot(2 if outdated else 3, *odd), 2: ballot(3, *POPULAR), 3: ballot(3, *POPULAR)}
    check(
        elect(ballots, 3),
        Case(
            ballots=ballots, revision=3, fetches={2: (), 3: ()}, distributors=(2, 3),
            kicks={1: phrases},
        ),
    )


MIXES = [(E, S), (E, R), (S, E), (R, E), (E, E, S), (E, E, R), (E, S, R), (S, R, E), (E, S, S)]


@pytest.mark.parametrize(
    "strategies", MIXES, ids=["-".join(STRATEGY_NAMES[s] for s in m) for m in MIXES]
)
def test_elect_kicks_strategies_mixed_with_enforce_popular(strategies: tuple[int, ...]) -> None:
    # The odd ones are kicked whatever they hold (with two of them, the more popular).
    ballots = {
        peer_id: ballot(0, W1 if strategy == E else W2, B1, strategy=strategy)
        for peer_id, strategy in enumerate(strategies, start=1)
    }
    enforcing = tuple(p for p, b in ballots.items() if b.strategy == E)
    check(
        elect(ballots, None),
        Case(
            ballots=ballots,
            revision=0,
            fetches=dict.fromkeys(enforcing, ()),
            distributors=enforcing,
            kicks={
                p: ("cannot be mixed with ENFORCE_POPULAR", STRATEGY_NAMES[b.strategy])
                for p, b in ballots.items() if b.strategy != E
            },
        ),
    )


# --- MasterCore: helpers --------------------------------------------------------------


def synced(h: MasterHarness, revision: int, states: dict[int, tuple[SharedStateEntry, ...]]) -> int:
    """Every conn in ``states`` (the whole group) votes ``revision`` and its entries; the
    sync runs to completion (with its plan, when nobody fetches). Returns its number."""
    h.take_all()
    for conn, entries in states.items():
        vote(h, conn, revision, *entries)
    plans = {conn: plan_of(h, conn) for conn in states}
    number = plans[next(iter(states))].sync
    assert number > 0
    assert all(p.sync == number and p.revision == revision and not p.error for p in plans.values())
    nobody_fetches = not any(p.fetches for p in plans.values())
    assert all(p.complete is nobody_fetches for p in plans.values())
    if nobody_fetches:
        assert all(h.where(conn) == (ACC, IDLE) for conn in states)
        return number
    for conn in states:
        done(h, conn, number)
    for conn in states:
        assert got(h, conn) == [SharedStateComplete(sync=number)]
        assert h.where(conn) == (ACC, IDLE)
    return number


def drop(h: MasterHarness, conn: int, how: str) -> None:
    match how:
        case "close":
            h.close(conn)
        case "broken":
            h.broken(conn)
        case "kick":  # an illegal message: a report outside any round
            assert was_kicked(h.send(conn, P2PEstablished(round=99, success=True)), conn)
    assert h.view(conn) is None


DROPS = ["close", "broken", "kick"]


# --- MasterCore: the sync phases ------------------------------------------------------


@pytest.mark.parametrize("third_succeeds", [True, False], ids=["success", "failure"])
def test_every_member_gets_one_plan_and_completion_waits_for_every_report(third_succeeds: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    assert vote(h, 1, 0, W1, B1, OPT) == []
    assert vote(h, 2, 0, W1, B1, OPT) == []
    assert h.where(1) == h.where(2) == (ACC, SVOTED)
    vote(h, 3, 0, W2, B1, OPT)
    plans = {conn: plan_of(h, conn) for conn in (1, 2, 3)}
    number = plans[1].sync
    assert number == 1
    # Distributors list the other up-to-date peers, never the peer itself, and the
    # peers that fetch from them with the tensors they fetch (by position).
    assert plans == {
        1: SharedStatePlan(sync=number, revision=0, fetches=(), distributors=(endpoint(2),),
                           fetchers=(fetcher(3, (0, 1)),)),
        2: SharedStatePlan(sync=number, revision=0, fetches=(), distributors=(endpoint(1),),
                           fetchers=(fetcher(3, (0, 1)),)),
        3: SharedStatePlan(
            sync=number, revision=0, fetches=(fetch(W1),), distributors=(endpoint(1), endpoint(2))
        ),
    }
    assert all(h.where(c) == (ACC, SYNCING) for c in (1, 2, 3))

    # The fetcher reports first (a failure counts as a report too), then the others.
    assert done(h, 3, number, success=third_succeeds) == []
    assert h.where(3) == (ACC, SDONE)
    assert done(h, 1, number) == []
    assert [h.where(c) for c in (1, 2, 3)] == [(ACC, SDONE), (ACC, SYNCING), (ACC, SDONE)]
    done(h, 2, number)
    for conn in (1, 2, 3):
        assert got(h, conn) == [SharedStateComplete(sync=number)]
        assert h.where(conn) == (ACC, IDLE)


def test_a_distributor_learns_each_fetcher_its_host_and_tensors() -> None:
    """Each distributor's plan names every peer that fetches, the host the master knows
    it at (the advertised one, else the address it connected from), and the positions
    of the tensors it fetches as runs; fetching peers and a peer that only adopts the
    revision are named nowhere, and only distributors get the list."""
    h = MasterHarness()
    hosts = {1: ("10.0.0.1", ""), 2: ("10.0.0.2", ""), 3: ("10.0.0.3", "node3"),
             4: ("10.0.0.4", ""), 5: ("10.0.0.5", "")}
    for conn, (host, advertised) in hosts.items():
        h.register(conn, host=host, advertised_host=advertised)
        if conn == 1:
            h.report(1)
    h.vote(1)
    for conn in hosts:
        h.report(conn)
    h.take_all()
    a, b, c, d, e = (entry(k, 1) for k in "abcde")
    popular = (a, b, c, d, e)
    zeros = tuple(entry(k, 0) for k in "abcde")
    vote(h, 1, 5, *popular)
    vote(h, 2, 5, *popular)
    vote(h, 3, 5, a, entry("b", 2), c, entry("d", 2), entry("e", 2))  # three keys differ
    vote(h, 4, 0, *zeros)  # a joiner: everything
    vote(h, 5, 4, *popular)  # behind, but holds the content: only adopts the revision
    plans = {conn: plan_of(h, conn) for conn in hosts}
    fetchers = (fetcher(3, (1, 1), (3, 2), host="node3"), fetcher(4, (0, 5), host="10.0.0.4"))
    assert {conn: plan.fetchers for conn, plan in plans.items()} == {
        1: fetchers, 2: fetchers, 3: (), 4: (), 5: fetchers,
    }
    assert [f.key for f in plans[3].fetches] == ["b", "d", "e"]
    assert len(plans[4].fetches) == 5 and plans[5].fetches == ()


@pytest.mark.parametrize(
    ("positions", "spans"),
    [((), ()), ((0,), ((0, 1),)), ((0, 1, 2, 3), ((0, 4),)), ((2, 3, 5, 7, 8, 9), ((2, 2), (5, 1), (7, 3)))],
)
def test_tensor_spans_are_runs_of_positions(
    positions: tuple[int, ...], spans: tuple[tuple[int, int], ...]
) -> None:
    assert tensor_spans(positions) == fetcher(0, *spans).tensors


def test_a_lone_member_syncs_alone() -> None:
    h = MasterHarness()
    h.join(1)
    h.take_all()
    vote(h, 1, 7, W1)
    # Nobody to fetch from, nothing to fetch: the sync is over with its plan.
    assert plan_of(h, 1) == SharedStatePlan(sync=1, revision=7, fetches=(), distributors=(),
                                            complete=True)
    assert h.where(1) == (ACC, IDLE)
    assert was_kicked(done(h, 1, 1), 1)  # there is nothing left to report


def test_waiting_peers_take_no_part_in_a_sync() -> None:
    h = MasterHarness()
    h.join(1)
    h.register(2)  # waits for a round that admits it
    h.take_all()
    vote(h, 1, 0, W1)
    assert plan_of(h, 1).sync == 1
    assert got(h, 2) == []


def test_resume_at_13_drags_a_joiner_along_then_every_peer_advances_by_one() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    vote(h, 3, 0, W2, B1, OPT)  # the joiner reaches the master first
    vote(h, 1, 13, W1, B1, OPT)
    vote(h, 2, 13, W1, B1, OPT)
    plan = plan_of(h, 3)
    assert plan.revision == 13 and plan.fetches == (fetch(W1), fetch(OPT))
    assert plan.distributors == (endpoint(1), endpoint(2))
    assert plan_of(h, 1).revision == plan_of(h, 2).revision == 13
    for conn in (1, 2, 3):
        done(h, conn, plan.sync)
    h.take_all()
    numbers = [synced(h, revision, dict.fromkeys((1, 2, 3), (W1, B1, OPT))) for revision in (14, 15, 16)]
    assert numbers == sorted(numbers) and len(set(numbers + [plan.sync])) == 4


@pytest.mark.parametrize("skipper_votes_first", [True, False], ids=["first", "last"])
def test_a_vote_skipping_ahead_is_kicked_and_the_others_sync_without_it(skipper_votes_first: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    first = synced(h, 5, dict.fromkeys((1, 2, 3), (W1,)))
    if skipper_votes_first:
        actions = vote(h, 3, 7, W1)
        vote(h, 1, 6, W2)
        assert got(h, 1) == []
        vote(h, 2, 6, W2)
    else:
        vote(h, 1, 6, W2)
        vote(h, 2, 6, W2)
        assert got(h, 1) == got(h, 2) == []
        actions = vote(h, 3, 7, W1)
    assert was_kicked(only(actions, 3), 3)
    reason = h.kick_reason(3) or ""
    assert "skips ahead" in reason and "7" in reason and "6" in reason
    plans = {conn: plan_of(h, conn) for conn in (1, 2)}
    number = plans[1].sync
    assert number > first
    # Both hold W2: nobody fetches, and the sync is over with its plan.
    assert plans == {
        1: SharedStatePlan(sync=number, revision=6, fetches=(), distributors=(), complete=True),
        2: SharedStatePlan(sync=number, revision=6, fetches=(), distributors=(), complete=True),
    }
    assert h.where(1) == h.where(2) == (ACC, IDLE)


def test_a_vote_at_an_old_revision_is_outdated_and_receives() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    synced(h, 0, dict.fromkeys((1, 2, 3), (W1, B1)))
    vote(h, 1, 1, W2, B1)
    vote(h, 2, 1, W2, B1)
    vote(h, 3, 0, W1, B1)  # it did not advance: stale revision, stale content
    plans = {conn: plan_of(h, conn) for conn in (1, 2, 3)}
    number = plans[1].sync
    assert plans == {
        1: SharedStatePlan(sync=number, revision=1, fetches=(), distributors=(endpoint(2),),
                           fetchers=(fetcher(3, (0, 1)),)),
        2: SharedStatePlan(sync=number, revision=1, fetches=(), distributors=(endpoint(1),),
                           fetchers=(fetcher(3, (0, 1)),)),
        3: SharedStatePlan(
            sync=number, revision=1, fetches=(fetch(W2),), distributors=(endpoint(1), endpoint(2))
        ),
    }
    for conn in (1, 2, 3):
        done(h, conn, number)
    h.take_all()
    # It holds revision 1 now, like the others: everyone goes on at 2.
    synced(h, 2, dict.fromkeys((1, 2, 3), (W2, B1)))


def test_a_step_aborted_after_its_sync_repeats_the_revision_and_moves_nothing() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    synced(h, 5, dict.fromkeys((1, 2, 3), (W1, B1)))
    # The step's all-reduce aborted: nobody advanced, everyone syncs 5 again.
    repeat = synced(h, 5, dict.fromkeys((1, 2, 3), (W1, B1)))
    assert repeat > 0
    # The group expects 6 again: the next step advances as usual, a skip is kicked.
    vote(h, 1, 6, W2, B1)
    vote(h, 2, 6, W2, B1)
    assert was_kicked(only(vote(h, 3, 7, W2, B1), 3), 3)
    assert plan_of(h, 1).revision == plan_of(h, 2).revision == 6


def test_a_repeat_drags_along_the_peer_whose_sync_failed() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    synced(h, 0, dict.fromkeys((1, 2, 3), (W1, B1)))
    h.take_all()
    vote(h, 1, 1, W2, B1)
    vote(h, 2, 1, W2, B1)
    vote(h, 3, 0, W1, B1)
    number = plan_of(h, 3).sync
    for conn in (1, 2):
        plan_of(h, conn)
    done(h, 1, number)
    done(h, 2, number)
    done(h, 3, number, success=False)  # peer 3 keeps revision 0 and its old weights
    h.take_all()
    # The others' step aborted without peer 3: they repeat 1, peer 3 is still at 0.
    vote(h, 1, 1, W2, B1)
    vote(h, 2, 1, W2, B1)
    vote(h, 3, 0, W1, B1)
    plans = {conn: plan_of(h, conn) for conn in (1, 2, 3)}
    assert {p.revision for p in plans.values()} == {1}
    assert plans[3].fetches == (fetch(W2),) and not plans[1].fetches and not plans[2].fetches


def test_an_outdated_peer_with_equal_content_only_adopts_the_revision() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    synced(h, 3, dict.fromkeys((1, 2), (W1,)))
    vote(h, 1, 4, W1)
    vote(h, 2, 3, W1)
    plan = plan_of(h, 2)
    assert (plan.revision, plan.fetches) == (4, ())
    assert plan_of(h, 1).revision == 4


def test_a_sync_with_no_distributor_left_is_refused() -> None:
    # The first sync targets the highest revision voted: the SEND_ONLY peer at 0 is then
    # outdated and kicked, and the RECEIVE_ONLY peer has nobody to fetch from.
    h = MasterHarness()
    accepted(h, 1, 2)
    vote(h, 1, 0, W1, strategy=S)
    actions = vote(h, 2, 5, W2, strategy=R)
    assert was_kicked(only(actions, 1), 1)
    assert "SEND_ONLY" in (h.kick_reason(1) or "")
    plan = plan_of(h, 2)
    assert plan.sync == 0 and plan.fetches == () and plan.distributors == ()
    assert "no peer that holds the popular shared state" in plan.error
    assert h.where(2) == (ACC, IDLE)


# --- MasterCore: election kicks -------------------------------------------------------


def test_a_mismatching_voter_is_kicked_and_the_others_sync() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3, 4)
    vote(h, 1, 0, entry("w", 1, dtype=DOUBLE), B1)  # the lowest id, but alone
    vote(h, 2, 0, W1, B1)
    vote(h, 3, 0, W1, B1)
    actions = vote(h, 4, 0, W1, B2)
    assert was_kicked(only(actions, 1), 1)
    reason = h.kick_reason(1) or ""
    assert "'w'" in reason and "DOUBLE" in reason
    plans = {conn: plan_of(h, conn) for conn in (2, 3, 4)}
    number = plans[2].sync
    assert plans == {
        2: SharedStatePlan(sync=number, revision=0, fetches=(), distributors=(endpoint(3),),
                           fetchers=(fetcher(4, (1, 1)),)),
        3: SharedStatePlan(sync=number, revision=0, fetches=(), distributors=(endpoint(2),),
                           fetchers=(fetcher(4, (1, 1)),)),
        4: SharedStatePlan(
            sync=number, revision=0, fetches=(fetch(B1),), distributors=(endpoint(2), endpoint(3))
        ),
    }
    for conn in (2, 3, 4):
        done(h, conn, number)
    assert got(h, 2) == got(h, 3) == got(h, 4) == [SharedStateComplete(sync=number)]


@pytest.mark.parametrize("strategies", [(E, S), (E, R), (R, E, S)], ids=["E-S", "E-R", "R-E-S"])
def test_strategies_mixed_with_enforce_popular_are_kicked(strategies: tuple[int, ...]) -> None:
    h = MasterHarness()
    conns = tuple(range(1, len(strategies) + 1))
    accepted(h, *conns)
    for conn, strategy in zip(conns, strategies, strict=True):
        vote(h, conn, 0, W1, strategy=strategy)
    for conn, strategy in zip(conns, strategies, strict=True):
        if strategy == E:
            assert plan_of(h, conn) == SharedStatePlan(sync=1, revision=0, fetches=(),
                                                       distributors=(), complete=True)
        else:
            assert h.view(conn) is None
            assert "cannot be mixed with ENFORCE_POPULAR" in (h.kick_reason(conn) or "")


@pytest.mark.parametrize("same_content", [True, False], ids=["same-content", "different-content"])
def test_a_group_all_receive_only_is_kicked_whole_and_its_revision_forgotten(same_content: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    synced(h, 4, dict.fromkeys((1, 2), (W1,)))
    vote(h, 1, 5, W1, strategy=R)
    actions = vote(h, 2, 5, W1 if same_content else W2, strategy=R)
    assert was_kicked(only(actions, 1), 1) and was_kicked(only(actions, 2), 2)
    assert all("RECEIVE_ONLY" in (h.kick_reason(c) or "") for c in (1, 2))
    # The group is empty: a new peer of it may start anywhere (it expected 5 before).
    h.join(3)
    h.take_all()
    vote(h, 3, 42, W1)
    assert plan_of(h, 3).revision == 42


def test_eavesdrop_send_only_peers_serve_a_receive_only_joiner() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    synced(h, 4, dict.fromkeys((1, 2, 3), (W1, OPT)))
    vote(h, 1, 5, W2, OPT, strategy=S)
    vote(h, 2, 5, W2, OPT, strategy=S)
    vote(h, 3, 0, W1, OPT, strategy=R)
    plans = {conn: plan_of(h, conn) for conn in (1, 2, 3)}
    number = plans[1].sync
    assert plans == {
        1: SharedStatePlan(sync=number, revision=5, fetches=(), distributors=(endpoint(2),),
                           fetchers=(fetcher(3, (0, 2)),)),
        2: SharedStatePlan(sync=number, revision=5, fetches=(), distributors=(endpoint(1),),
                           fetchers=(fetcher(3, (0, 2)),)),
        3: SharedStatePlan(
            sync=number, revision=5, fetches=(fetch(W2), fetch(OPT)),
            distributors=(endpoint(1), endpoint(2)),
        ),
    }


# --- MasterCore: peer groups ----------------------------------------------------------


def test_peer_groups_sync_independently() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    a1, a2 = entry("a", 1), entry("a", 2)
    z1, z2 = entry("z", 1, dtype=DOUBLE), entry("z", 2, dtype=DOUBLE)
    # Interleaved votes, different keys and revisions.
    vote(h, 1, 0, a1)
    vote(h, 3, 7, z1)
    vote(h, 2, 0, a2)
    plans = {conn: plan_of(h, conn) for conn in (1, 2)}
    assert got(h, 3) == got(h, 4) == []
    assert h.where(3) == (ACC, SVOTED) and h.where(4) == (ACC, IDLE)
    vote(h, 4, 7, z2)
    plans.update({conn: plan_of(h, conn) for conn in (3, 4)})
    n0, n1 = plans[1].sync, plans[3].sync
    assert n0 != n1
    assert plans == {
        1: SharedStatePlan(sync=n0, revision=0, fetches=(), distributors=(),
                           fetchers=(fetcher(2, (0, 1)),)),
        2: SharedStatePlan(sync=n0, revision=0, fetches=(fetch(a1),), distributors=(endpoint(1),)),
        3: SharedStatePlan(sync=n1, revision=7, fetches=(), distributors=(),
                           fetchers=(fetcher(4, (0, 1)),)),
        4: SharedStatePlan(sync=n1, revision=7, fetches=(fetch(z1),), distributors=(endpoint(3),)),
    }
    # Group 1 finishes first; group 0 is still syncing.
    done(h, 3, n1)
    done(h, 4, n1)
    assert got(h, 3) == got(h, 4) == [SharedStateComplete(sync=n1)]
    assert got(h, 1) == got(h, 2) == []
    assert h.where(1) == h.where(2) == (ACC, SYNCING)
    done(h, 1, n0)
    done(h, 2, n0)
    assert got(h, 1) == got(h, 2) == [SharedStateComplete(sync=n0)]

    # Each group expects its own next revision: 1 and 8. Group 0 syncs again, while in
    # group 1 peer 4 votes another tensor list and is kicked; neither disturbs the other.
    vote(h, 1, 1, a1)
    vote(h, 2, 1, a2)  # peer 2 fetches again: the sync runs until both report
    n0 = plan_of(h, 1).sync
    assert plan_of(h, 2).sync == n0
    vote(h, 3, 8, z1)
    actions = vote(h, 4, 8, a1)
    assert was_kicked(only(actions, 4), 4)
    assert only(actions, 1) == only(actions, 2) == []
    # Peer 3, alone in its group now, has nothing to fetch: over with its plan.
    assert plan_of(h, 3) == SharedStatePlan(sync=n0 + 1, revision=8, fetches=(),
                                            distributors=(), complete=True)
    assert h.where(3) == (ACC, IDLE)
    assert h.where(1) == h.where(2) == (ACC, SYNCING)
    done(h, 1, n0)
    done(h, 2, n0)
    assert got(h, 1) == got(h, 2) == [SharedStateComplete(sync=n0)]


def test_a_revision_skipping_ahead_in_one_group_is_judged_by_that_group() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 1})
    synced(h, 10, {1: (W1,)})
    synced(h, 0, {2: (W1,)})
    # 11 is right for group 0, and skips ahead in group 1 (which expects 1).
    vote(h, 1, 11, W1)
    actions = vote(h, 2, 11, W1)
    assert plan_of(h, 1).revision == 11
    assert was_kicked(only(actions, 2), 2)
    assert "skips ahead" in (h.kick_reason(2) or "")


def test_a_sync_vote_in_another_group_does_not_abort_a_collective() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1, 4: 1})
    vote(h, 1, 0, W1)
    h.initiate(3, 5)
    h.initiate(4, 5)
    assert [type(m) for m in got(h, 3)] == [CollectiveCommence]


# --- MasterCore: peers leaving --------------------------------------------------------


@pytest.mark.parametrize("how", DROPS)
@pytest.mark.parametrize("when", ["after-the-others-voted", "before-anyone-voted"])
def test_a_member_leaving_before_voting_lets_the_others_sync(how: str, when: str) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    if when == "before-anyone-voted":
        drop(h, 3, how)
    vote(h, 1, 0, W1)
    vote(h, 2, 0, W2)
    if when == "after-the-others-voted":
        assert got(h, 1) == got(h, 2) == []
        drop(h, 3, how)
    plans = {conn: plan_of(h, conn) for conn in (1, 2)}
    number = plans[1].sync
    # A tie between peers 1 and 2: peer 1's content wins.
    assert plans == {
        1: SharedStatePlan(sync=number, revision=0, fetches=(), distributors=(),
                           fetchers=(fetcher(2, (0, 1)),)),
        2: SharedStatePlan(sync=number, revision=0, fetches=(fetch(W1),), distributors=(endpoint(1),)),
    }
    done(h, 1, number)
    done(h, 2, number)
    assert got(h, 1) == got(h, 2) == [SharedStateComplete(sync=number)]


@pytest.mark.parametrize("how", DROPS)
@pytest.mark.parametrize(
    "reported", [0, 1, 2], ids=["nobody-reported", "one-reported", "all-others-reported"]
)
def test_a_member_leaving_during_distribution_lets_the_sync_complete(how: str, reported: int) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    vote(h, 1, 0, W1)
    vote(h, 2, 0, W2)
    vote(h, 3, 0, W1)  # peer 3 is a distributor for peer 2
    number = plan_of(h, 1).sync
    h.take_all()
    for conn in (1, 2)[:reported]:
        assert done(h, conn, number) == []
    drop(h, 3, how)
    if reported < 2:
        assert got(h, 1) == got(h, 2) == []
        for conn in (1, 2)[reported:]:
            done(h, conn, number, success=conn != 2)  # peer 2 may have lost its source
    assert got(h, 1) == got(h, 2) == [SharedStateComplete(sync=number)]
    assert h.where(1) == h.where(2) == (ACC, IDLE)
    # The revision advanced nonetheless.
    synced(h, 1, dict.fromkeys((1, 2), (W1,)))


def test_when_the_last_peer_of_a_group_leaves_its_revision_is_forgotten() -> None:
    h = MasterHarness()
    h.join(1)
    synced(h, 5, {1: (W1,)})
    h.close(1)
    h.join(2)  # admitted at once: nobody else is in the run
    h.take_all()
    vote(h, 2, 42, W1)  # 6 was expected while peer 1 was there
    assert plan_of(h, 2).revision == 42


def test_a_group_emptied_while_another_runs_starts_anywhere_and_the_other_keeps_its_revision() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 1})
    synced(h, 5, {1: (W1,)})
    synced(h, 3, {2: (W1,)})
    h.close(1)
    h.register(3, group=0)
    h.vote(2)
    h.report(2)
    h.report(3)
    assert h.last(3, P2PEstablishResult).success
    h.take_all()
    vote(h, 3, 42, W1)
    assert plan_of(h, 3).revision == 42
    actions = vote(h, 2, 5, W1)  # group 1 expects 4
    assert was_kicked(only(actions, 2), 2)
    assert "skips ahead" in (h.kick_reason(2) or "")


def test_the_revision_is_kept_while_a_member_remains() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    synced(h, 5, dict.fromkeys((1, 2), (W1,)))
    h.close(1)
    actions = vote(h, 2, 7, W1)
    assert was_kicked(actions, 2)
    assert "skips ahead of revision 6" in (h.kick_reason(2) or "")


# --- MasterCore: illegal reports ------------------------------------------------------

BadDone = Callable[[MasterHarness, int], SharedStateDone]


def wrong_number(h: MasterHarness, number: int) -> SharedStateDone:
    return SharedStateDone(sync=number + 1, success=True)


def twice(h: MasterHarness, number: int) -> SharedStateDone:
    assert done(h, 1, number) == []
    return SharedStateDone(sync=number, success=True)


def zero(h: MasterHarness, number: int) -> SharedStateDone:
    return SharedStateDone(sync=0, success=False)


@pytest.mark.parametrize("bad", [wrong_number, twice, zero], ids=lambda f: f.__name__)
def test_a_bad_report_during_a_sync_is_kicked_and_the_sync_goes_on(bad: BadDone) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    vote(h, 1, 0, W1)
    vote(h, 2, 0, W2)  # peer 2 fetches W1: the sync runs until both report
    number = plan_of(h, 1).sync
    h.take_all()
    actions = h.send(1, bad(h, number))
    assert was_kicked(actions, 1)
    assert "illegal SharedStateDone" in (h.kick_reason(1) or "")
    assert only(actions, 2) == []
    done(h, 2, number)
    assert got(h, 2) == [SharedStateComplete(sync=number)]


@pytest.mark.parametrize("when", ["before-any-sync", "after-the-sync", "while-voting"])
def test_a_report_outside_a_sync_is_kicked(when: str) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    number = 1
    if when == "after-the-sync":
        number = synced(h, 0, dict.fromkeys((1, 2), (W1,)))
    elif when == "while-voting":
        vote(h, 2, 0, W1)
        vote(h, 1, 0, W2)  # peer 1 fetches W1: both report
        number = plan_of(h, 1).sync
        done(h, 1, number)
        done(h, 2, number)
        h.take_all()
        vote(h, 1, 1, W1)  # the next sync: peer 2 has not voted yet
    actions = done(h, 1, number)
    assert was_kicked(actions, 1)
    assert "illegal SharedStateDone" in (h.kick_reason(1) or "")


def test_a_report_for_another_groups_sync_is_kicked() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    for conn, content in ((1, W1), (2, W2), (3, W1)):  # peer 2 fetches: sync n0 runs on
        vote(h, conn, 0, content)
    n0, n1 = plan_of(h, 1).sync, plan_of(h, 3).sync
    assert plan_of(h, 2).sync == n0 != n1
    actions = done(h, 3, n0)
    assert was_kicked(actions, 3)
    assert h.where(1) == h.where(2) == (ACC, SYNCING)
    done(h, 1, n0)
    done(h, 2, n0)
    assert got(h, 1) == got(h, 2) == [SharedStateComplete(sync=n0)]


# --- MasterCore: sync vs collectives, rounds and pending votes ------------------------


def test_a_sync_vote_with_a_running_collective_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    seq = started(h, 5, 1, 2)
    actions = vote(h, 1, 0, W1)
    assert was_kicked(actions, 1)
    assert "collectives in flight" in (h.kick_reason(1) or "")
    messages = got(h, 2)
    assert len(messages) == 1 and isinstance(messages[0], CollectiveAbort), messages
    assert (messages[0].tag, messages[0].seq) == (5, seq)


def test_a_sync_vote_with_an_initiated_collective_is_kicked() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5)  # peer 2 has not initiated yet
    actions = vote(h, 1, 0, W1)
    assert was_kicked(actions, 1)
    assert "collectives in flight (tags [5])" in (h.kick_reason(1) or "")
    assert only(actions, 2) == []
    vote(h, 2, 0, W1)
    assert plan_of(h, 2).sync == 1


@pytest.mark.parametrize("initiate_first", [True, False], ids=["initiate-first", "vote-first"])
def test_a_collective_initiated_while_a_member_votes_to_sync_is_blocked(initiate_first: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    if initiate_first:
        h.initiate(2, 5)
        h.initiate(3, 5)
        vote(h, 1, 0, W1)
    else:
        vote(h, 1, 0, W1)
        h.initiate(2, 5)
        h.initiate(3, 5)
    for conn in (2, 3):
        messages = got(h, conn)
        assert len(messages) == 1 and isinstance(messages[0], CollectiveVerdict), messages
        verdict = messages[0]
        # BLOCKED: it never ran and the ring is intact (nothing to re-establish first).
        assert (verdict.tag, verdict.seq, verdict.outcome) == (5, 0, Outcome.BLOCKED)
        assert "peer 1" in verdict.reason and "synchronize the shared state" in verdict.reason
    assert got(h, 1) == []
    assert h.where(1) == (ACC, SVOTED)
    # The others then vote too, and the sync runs.
    vote(h, 2, 0, W1)
    vote(h, 3, 0, W1)
    assert plan_of(h, 1).sync == plan_of(h, 2).sync == plan_of(h, 3).sync == 1


@pytest.mark.parametrize("establish_first", [True, False], ids=["establish-first", "sync-first"])
def test_a_vote_to_establish_refuses_the_sync_voters(establish_first: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    if establish_first:
        h.vote(3)
    vote(h, 1, 9, W1)
    if establish_first:
        refused = plan_of(h, 1)
        assert h.where(1) == (ACC, IDLE)
        vote(h, 2, 9, W1)
        plans = {1: refused, 2: plan_of(h, 2)}
    else:
        vote(h, 2, 9, W1)
        assert got(h, 1) == got(h, 2) == []
        h.vote(3)
        plans = {conn: plan_of(h, conn) for conn in (1, 2)}
    for plan in plans.values():
        assert (plan.sync, plan.revision, plan.fetches, plan.distributors) == (0, 9, (), ())
        assert "peer 3" in plan.error and "update_topology" in plan.error
    assert h.where(1) == h.where(2) == (ACC, IDLE)
    assert h.where(3) == (ACC, PeerState.VOTE_ESTABLISH)
    assert got(h, 3) == []
    # The others follow the establish vote; after the round a sync may start anywhere
    # (the refused one set no revision).
    h.vote(1)
    h.vote(2)
    for conn in (1, 2, 3):
        h.report(conn)
    assert all(h.last(c, P2PEstablishResult).success for c in (1, 2, 3))
    h.take_all()
    for conn in (1, 2, 3):
        vote(h, conn, 20, W1)
    assert plan_of(h, 1).revision == 20


@pytest.mark.parametrize("pending_first", [True, False], ids=["pending-first", "sync-first"])
def test_a_pending_vote_while_a_member_votes_to_sync_is_refused(pending_first: bool) -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    if pending_first:
        h.pending(2)
        assert got(h, 2) == []
        vote(h, 1, 0, W1)
    else:
        vote(h, 1, 0, W1)
        h.pending(2)
    messages = got(h, 2)
    assert len(messages) == 1 and isinstance(messages[0], PeersPendingResult), messages
    assert "peer 1" in messages[0].error and "sync_shared_state" in messages[0].error
    assert got(h, 1) == []
    assert h.where(1) == (ACC, SVOTED) and h.where(2) == (ACC, IDLE)
    vote(h, 2, 0, W1)
    assert plan_of(h, 1).sync == plan_of(h, 2).sync == 1


def test_a_pending_vote_in_another_group_waits() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    vote(h, 1, 0, W1)
    h.pending(3)
    assert got(h, 3) == []


def test_a_group_that_leaves_lets_another_groups_round_start() -> None:
    # Control for the next test: peer 3, the whole of group 1, closes its connection.
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.vote(1)
    h.vote(2)
    h.close(3)
    assert h.core.round_in_progress
    assert isinstance(got(h, 1)[-1], P2PInfo)


# An election that kicks every voter of a group removes the last peers another group's
# consensus waited for: the master checks every consensus again (groups {1, 2} and {3};
# peers 1 and 2 wait in a round vote, or a pending vote; peer 3 votes RECEIVE_ONLY alone
# and is kicked).
def test_a_group_kicked_whole_by_the_election_lets_another_groups_round_start() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.vote(1)
    h.vote(2)
    actions = vote(h, 3, 0, W1, strategy=R)
    assert was_kicked(actions, 3)
    assert h.core.round_in_progress
    assert isinstance(got(h, 1)[-1], P2PInfo)


def test_a_group_kicked_whole_by_the_election_lets_the_pending_vote_finish() -> None:
    h = MasterHarness()
    run_with(h, {1: 0, 2: 0, 3: 1})
    h.pending(1)
    h.pending(2)
    actions = vote(h, 3, 0, W1, strategy=R)
    assert was_kicked(actions, 3)
    assert got(h, 1) == got(h, 2) == [PeersPendingResult(pending=False)]


def test_kicks_are_announced_to_the_kicked_only() -> None:
    # A kick in a sync reaches the kicked peer as a Kick naming the key, and nobody else.
    h = MasterHarness()
    accepted(h, 1, 2)
    vote(h, 1, 0, W1)
    actions = vote(h, 2, 0, entry("w", 1, count=3))
    assert was_kicked(only(actions, 2), 2)
    assert isinstance(h.sent[2][-1], Kick)
    reason = h.kick_reason(2) or ""
    assert "'w'" in reason and "3 x FLOAT" in reason and "4 x FLOAT" in reason
    assert plan_of(h, 1) == SharedStatePlan(sync=1, revision=0, fetches=(), distributors=(),
                                            complete=True)
