"""Input crafted to make the master build a message it cannot send.

Every text the master sends may quote what a peer sent (a key, a host, a reason) or
list every peer of a group; each is cut to ``MAX_REASON`` characters, so no reply can
exceed the limits the master itself enforces, and handling the input never raises.
"""

from __future__ import annotations

import pytest

from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.messages import (
    CollectiveVerdict,
    Kick,
    Outcome,
    Register,
    SharedStateEntry,
    SharedStatePlan,
    SharedStateVote,
)
from pccl_trio._core.records import MAX_REASON, bounded

from .master_harness import MasterHarness
from .scenarios import accepted, got, started, sync_vote

NUL_KEY = "\x00" * 1024  # repr() makes it 4,096 characters: over MAX_STRING once quoted


def test_bounded_cuts_long_texts_and_says_so() -> None:
    assert bounded("short") == "short"
    text = bounded("x" * 5000)
    assert len(text) == MAX_REASON and text.endswith("(4000 more characters)")
    assert bounded("y" * MAX_REASON) == "y" * MAX_REASON


def test_a_decode_error_quoting_a_huge_value_kicks_with_a_bounded_reason() -> None:
    h = MasterHarness()
    h.open(1)
    h.broken(1, "SharedStateVote.entries: duplicate key " + repr(NUL_KEY))
    kick = h.last(1, Kick)
    assert len(kick.reason) <= MAX_REASON and kick.reason.startswith("malformed input")


def test_a_vote_whose_key_differs_by_a_huge_key_kicks_with_a_bounded_reason() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    popular = sync_vote()
    odd = SharedStateEntry(key=NUL_KEY, hash=7, dtype=10, count=4, allow_content_inequality=False)
    h.send(1, popular)
    h.send(2, popular)
    h.send(3, SharedStateVote(revision=0, strategy=0, entries=(odd,)))
    reason = h.kick_reason(3)
    assert reason is not None and len(reason) <= MAX_REASON
    assert h.last(1, SharedStatePlan).error == ""


def test_a_huge_invalid_report_ends_the_collective_with_a_bounded_verdict() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    seq = started(h, 5, 1, 2)
    h.complete(1, 5, seq, aborted=True, invalid="z" * 4096)
    h.complete(2, 5, seq)
    for conn in (1, 2):
        verdict = h.last(conn, CollectiveVerdict)
        assert verdict.outcome == Outcome.REJECTED and len(verdict.reason) <= MAX_REASON


def test_a_hundred_and_twenty_disagreeing_peers_get_a_bounded_verdict() -> None:
    h = MasterHarness()
    conns = list(range(1, 121))
    accepted(h, *conns)
    for conn in conns:
        h.initiate(conn, 9, count=conn)
    verdicts = [m for c in conns for m in got(h, c) if isinstance(m, CollectiveVerdict)]
    assert len(verdicts) == len(conns)
    assert {v.outcome for v in verdicts} == {Outcome.REJECTED}
    assert all(len(v.reason) <= MAX_REASON for v in verdicts)
    assert "peer 1: all_reduce count=1" in verdicts[0].reason  # what fits still says who disagreed


def test_a_register_with_an_impossible_host_is_refused_by_name() -> None:
    with pytest.raises(RemoteProtocolError, match="Register.advertised_host: 4096 characters"):
        Register(protocol_version=1, peer_group=0, p2p_port=1, advertised_host="h" * 4096)
