"""The master's bandwidth store and the scheduling of link measurements into rounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl_trio._core.bandwidth import BandwidthStore, measurement_rounds

from .support import DETERMINISTIC


def test_store_records_forgets_and_lists_what_is_missing() -> None:
    store = BandwidthStore()
    store.record(1, 2, 5e6, 0.001)
    store.mark_unreachable(2, 3)
    assert store.link(1, 2) is not None and store.link(2, 1) is None
    assert store.unreachable(2, 3)
    assert store.missing([1, 2, 3]) == [(1, 3), (2, 1), (3, 1), (3, 2)]
    store.record(2, 3, 1e6, 0.0)  # a later measurement clears the mark
    assert not store.unreachable(2, 3) and (2, 3) not in store.missing([1, 2, 3])
    store.forget(2)
    assert store.link(1, 2) is None and store.link(2, 3) is None
    assert store.missing([1, 2, 3]) == [(1, 2), (1, 3), (2, 1), (2, 3), (3, 1), (3, 2)]


@pytest.mark.parametrize(
    ("sender", "receiver", "bandwidth", "latency", "words"),
    [
        (1, 1, 1.0, 0.0, "itself"),
        (1, 2, 0.0, 0.0, "bandwidth"),
        (1, 2, math.nan, 0.0, "bandwidth"),
        (1, 2, math.inf, 0.0, "bandwidth"),
        (1, 2, 1.0, -1.0, "latency"),
        (1, 2, 1.0, math.inf, "latency"),
    ],
)
def test_store_refuses_impossible_measurements(
    sender: int, receiver: int, bandwidth: float, latency: float, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        BandwidthStore().record(sender, receiver, bandwidth, latency)


def test_cost_matrix_follows_the_members_order() -> None:
    store = BandwidthStore()
    store.record(7, 3, 1000.0, 0.5)
    store.record(3, 7, 500.0, 0.0)
    cost = store.cost_matrix([3, 7, 9], nbytes=3000)  # chunks of 1000 bytes
    assert cost[0, 1] == pytest.approx(2.0) and cost[1, 0] == pytest.approx(1.5)
    assert all(math.isinf(cost[i, j]) for i, j in [(0, 2), (2, 0), (1, 2), (2, 1), (0, 0)])


@DETERMINISTIC
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=60))
def test_rounds_cover_every_link_once_with_distinct_endpoints(pairs: list[tuple[int, int]]) -> None:
    links = {(a, b) for a, b in pairs if a != b}
    rounds = measurement_rounds(links)
    flat = [link for r in rounds for link in r]
    assert sorted(flat) == sorted(links)
    for r in rounds:
        peers = [p for link in r for p in link]
        assert len(peers) == len(set(peers)), r
    assert measurement_rounds(links) == rounds


@pytest.mark.parametrize("n", range(2, 13))
def test_a_full_matrix_takes_close_to_the_fewest_rounds(n: int) -> None:
    rounds = measurement_rounds([(a, b) for a in range(n) for b in range(n) if a != b])
    fewest = 2 * (n - 1) if n % 2 == 0 else 2 * n
    assert fewest <= len(rounds) <= math.ceil(1.25 * fewest)
