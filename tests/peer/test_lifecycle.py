"""Which membership calls block an all-reduce: read from the master's table."""

from __future__ import annotations

import pytest

from pccl_trio._core import peers
from pccl_trio.peer._lifecycle import Call

#: The calls a peer refuses an all-reduce during, as users meet them.
BLOCKING = {Call.UPDATE_TOPOLOGY, Call.SYNC_SHARED_STATE, Call.OPTIMIZE_TOPOLOGY}


def test_the_core_names_the_votes_that_block_each_call() -> None:
    assert peers.votes_blocking(peers.Call.ALL_REDUCE) == {
        peers.Call.UPDATE_TOPOLOGY, peers.Call.SYNC_SHARED_STATE, peers.Call.OPTIMIZE_TOPOLOGY,
    }
    assert peers.votes_blocking(peers.Call.SYNC_SHARED_STATE) == {
        peers.Call.UPDATE_TOPOLOGY, peers.Call.OPTIMIZE_TOPOLOGY,
    }
    assert peers.votes_blocking(peers.Call.OPTIMIZE_TOPOLOGY) == {peers.Call.UPDATE_TOPOLOGY}
    assert peers.votes_blocking(peers.Call.UPDATE_TOPOLOGY) == frozenset()


@pytest.mark.parametrize("call", list(Call), ids=[call.name for call in Call])
def test_blocks_all_reduce(call: Call) -> None:
    assert call.blocks_all_reduce is (call in BLOCKING)


@pytest.mark.parametrize("call", [c for c in Call if c in BLOCKING], ids=lambda c: str(c))
def test_a_blocking_call_is_one_whose_vote_the_master_blocks_an_all_reduce_with(
    call: Call,
) -> None:
    """The peer's rule and the master's agree: a peer waiting in the vote of a call
    that blocks an all-reduce here is the peer the master names as the blocker."""
    (state,) = [s for s, vote in peers.VOTES.items() if vote.call is call.vote]
    voter = peers.Peer(peer_id=1, conn=1, peer_group=0, host="h", port=1, state=state)
    assert peers.find_blocker(peers.Call.ALL_REDUCE, 0, [voter]) is voter


def test_the_re_establishment_makes_a_blocking_vote_and_is_waited_for() -> None:
    """It votes as update_topology does, which would block an all-reduce at the
    master; an all-reduce launched meanwhile waits for it instead."""
    assert Call.REESTABLISH.vote is Call.UPDATE_TOPOLOGY.vote
    assert not Call.REESTABLISH.blocks_all_reduce


def test_calls_keep_their_spelling() -> None:
    assert Call.UPDATE_TOPOLOGY.spelling == "update_topology()"
    assert Call.CONNECT.vote is None
    assert len({call.spelling for call in Call}) == len(Call)
