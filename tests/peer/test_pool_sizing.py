"""The connection-count rule of a pool sized to its path: one connection where a
connection's send buffer covers the bandwidth-delay product, more as the round trip
grows, never past the cap."""

from __future__ import annotations

import math

import pytest

from pccl_trio.peer._p2p import POOL_MOST, POOL_TARGET_RATE, pool_for
from pccl_trio.transport import SOCKET_BUFFER_BYTES


@pytest.mark.parametrize("round_trip", [0.0, -1.0, 50e-6, 1e-3, 10e-3])
def test_loopback_and_a_lan_take_one_connection(round_trip: float) -> None:
    assert pool_for(round_trip) == 1


@pytest.mark.parametrize(("round_trip", "connections"), [(0.05, 4), (0.1, 8), (0.2, 15), (1.0, 16)])
def test_a_long_link_takes_enough_to_hold_its_bandwidth_delay_product(
    round_trip: float, connections: int
) -> None:
    assert pool_for(round_trip) == connections
    # Enough: together their buffers hold what the target rate keeps in flight.
    if connections < POOL_MOST:
        assert connections * SOCKET_BUFFER_BYTES >= POOL_TARGET_RATE * round_trip
        assert (connections - 1) * SOCKET_BUFFER_BYTES < POOL_TARGET_RATE * round_trip


def test_the_count_grows_with_the_round_trip_and_the_window() -> None:
    trips = [i * 0.005 for i in range(100)]
    counts = [pool_for(t) for t in trips]
    assert counts == sorted(counts) and counts[-1] == POOL_MOST
    assert pool_for(0.1) < pool_for(0.1, window=SOCKET_BUFFER_BYTES // 2) <= 2 * pool_for(0.1)
    assert pool_for(0.1, window=1 << 30) == 1
    assert pool_for(math.inf) == POOL_MOST
