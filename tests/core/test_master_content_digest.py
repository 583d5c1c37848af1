"""Content digests on the master: a run-wide option (``MasterCore(content_digest=True)``,
announced in ``Welcome``) under which every shared-state entry whose content must match
carries a BLAKE2b-256 digest beside its simplehash.

The election compares content by both: two entries with the same simplehash but
different digests are different content, so the minority fetches that key and is told
the popular digest to verify. A vote that does not carry digests exactly as the run
requires gets its peer kicked, naming the key; without the option nothing changes.
"""

from __future__ import annotations

import hashlib

import pytest

from pccl_trio._core.messages import (
    SharedStateComplete,
    SharedStateEntry,
    SharedStateFetch,
    SharedStatePlan,
    Welcome,
)
from pccl_trio._core.shared_state import elect

from .master_harness import MasterHarness, only, was_kicked
from .scenarios import ACC, IDLE, OPT, accepted, ballot, done, endpoint, fetcher, got, plan_of, vote

FLOAT = 10
#: One simplehash value that two different contents share: a forged collision.
COLLIDING = 0x5EED


def digest_of(content: bytes) -> bytes:
    return hashlib.blake2b(content, digest_size=32).digest()


GENUINE, FORGED = digest_of(b"genuine"), digest_of(b"forged")


def entry(key: str, digest: bytes, *, hash: int = COLLIDING) -> SharedStateEntry:
    return SharedStateEntry(
        key=key, hash=hash, dtype=FLOAT, count=4, allow_content_inequality=False, digest=digest
    )


W_GENUINE, W_FORGED = entry("w", GENUINE), entry("w", FORGED)
B = entry("b", digest_of(b"b"), hash=11)


# --- elect, directly --------------------------------------------------------------------


def test_equal_simplehash_different_digest_is_different_content() -> None:
    election = elect(
        {1: ballot(0, W_GENUINE, B), 2: ballot(0, W_GENUINE, B), 3: ballot(0, W_FORGED, B)},
        None,
    )
    assert election.kicks == {}
    assert election.distributors == (1, 2)
    # The minority fetches "w" only, told the popular hash and digest to verify.
    assert election.fetches == {
        1: (), 2: (),
        3: (SharedStateFetch(key="w", hash=COLLIDING, verify=True, digest=GENUINE),),
    }


def test_the_popular_digest_wins_whatever_the_lowest_peer_votes() -> None:
    election = elect(
        {1: ballot(0, W_FORGED), 2: ballot(0, W_GENUINE), 3: ballot(0, W_GENUINE)}, None
    )
    assert election.distributors == (2, 3)
    assert election.fetches[1] == (
        SharedStateFetch(key="w", hash=COLLIDING, verify=True, digest=GENUINE),
    )


def test_a_joiner_gets_the_popular_digests_and_content_unequal_keys_unverified() -> None:
    election = elect(
        {1: ballot(4, W_GENUINE, OPT), 2: ballot(4, W_GENUINE, OPT), 3: ballot(0, W_FORGED, OPT)},
        4,
    )
    assert election.revision == 4
    assert election.fetches[3] == (
        SharedStateFetch(key="w", hash=COLLIDING, verify=True, digest=GENUINE),
        SharedStateFetch(key="opt", hash=0, verify=False),
    )


# --- MasterCore ---------------------------------------------------------------------------


@pytest.mark.parametrize("required", [True, False])
def test_welcome_announces_whether_digests_are_required(required: bool) -> None:
    h = MasterHarness(content_digest=required)
    h.register(1)
    (welcome,) = h.received(1, Welcome)
    assert welcome.content_digest is required


def test_a_forged_collision_is_fetched_and_verified_against_the_popular_digest() -> None:
    h = MasterHarness(content_digest=True)
    accepted(h, 1, 2, 3)
    vote(h, 1, 0, W_GENUINE, B)
    vote(h, 2, 0, W_GENUINE, B)
    vote(h, 3, 0, W_FORGED, B)
    plans = {conn: plan_of(h, conn) for conn in (1, 2, 3)}
    number = plans[1].sync
    assert plans[3] == SharedStatePlan(
        sync=number, revision=0,
        fetches=(SharedStateFetch(key="w", hash=COLLIDING, verify=True, digest=GENUINE),),
        distributors=(endpoint(1), endpoint(2)),
    )
    assert plans[1].fetchers == plans[2].fetchers == (fetcher(3, (0, 1)),)
    for conn in (1, 2, 3):
        done(h, conn, number)
    for conn in (1, 2, 3):
        assert got(h, conn) == [SharedStateComplete(sync=number)]
        assert h.where(conn) == (ACC, IDLE)


def test_a_vote_lacking_a_required_digest_is_kicked_and_the_others_sync() -> None:
    h = MasterHarness(content_digest=True)
    accepted(h, 1, 2, 3)
    vote(h, 1, 0, W_GENUINE, OPT)
    vote(h, 2, 0, W_GENUINE, OPT)
    actions = vote(h, 3, 0, entry("w", b""), OPT)
    assert was_kicked(only(actions, 3), 3)
    reason = h.kick_reason(3) or ""
    assert reason.startswith("illegal SharedStateVote: ") and "'w'" in reason, reason
    assert "carries no content digest" in reason and "--content-digest" in reason, reason
    # The others no longer wait for it: their sync runs, nothing to fetch.
    plans = {conn: plan_of(h, conn) for conn in (1, 2)}
    assert all(p.sync > 0 and p.fetches == () and not p.error for p in plans.values())


@pytest.mark.parametrize(
    ("required", "entries", "words"),
    [
        (False, (W_GENUINE,), "this run uses none (the master runs without --content-digest)"),
        (True, (W_GENUINE, SharedStateEntry(key="opt", hash=0, dtype=FLOAT, count=4,
                                            allow_content_inequality=True, digest=GENUINE)),
         "its content may differ (allow_content_inequality)"),
    ],
    ids=["unrequested", "content-unequal"],
)
def test_a_vote_with_a_digest_where_none_belongs_is_kicked(
    required: bool, entries: tuple[SharedStateEntry, ...], words: str
) -> None:
    h = MasterHarness(content_digest=required)
    accepted(h, 1)
    assert was_kicked(only(vote(h, 1, 0, *entries), 1), 1)
    reason = h.kick_reason(1) or ""
    assert "carries a content digest" in reason and words in reason, reason

