"""The members' agreement on a leased attempt (``peer/_agreement.py``), as a state
machine: a ring of agreements whose notices travel over links with their own delays,
driven by a discrete-event simulation.

What must hold for any completion times and link delays (Hypothesis): no member
agrees before every member completed (safety); every member agrees and is ``done``
(liveness), also where some members send forward only; a member sends at most
``W - 1`` notices per direction; with every member
completing at once over equal links, agreement takes ``floor(W / 2)`` hops (both ways)
where one way took ``W - 1``."""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio.peer._agreement import BACKWARD, FORWARD, Agreement
from pccl_trio.peer._ledger import Ledger


class _Ring:
    """W agreements whose notices a simulated clock delivers, in order per link."""

    def __init__(self, world: int, *, forward: list[float], back: list[float],
                 both_ways: bool | list[bool] = True) -> None:
        self.world = world
        self.delays = (forward, back)  # member i's link to its successor / predecessor
        self.ledgers = [Ledger(tag=7, recv_slices=[1], send_slices=[]) for _ in range(world)]
        self.agreements = [Agreement(world=world, ledger=ledger) for ledger in self.ledgers]
        backs = both_ways if isinstance(both_ways, list) else [both_ways] * world
        for agreement, back_too in zip(self.agreements, backs, strict=True):
            # Connections the trio thread sends on (no sockets): every notice is claimed
            # and sent by the driver below, as ``_agree`` does. A member without a
            # connection back sends forward only (``_pools.RingPools.back_connection``).
            agreement.attach(object(), object() if back_too else None)  # type: ignore[arg-type]
        self.completed_at: list[float | None] = [None] * world
        self.agreed_at: list[float | None] = [None] * world
        self.sent = [[0, 0] for _ in range(world)]
        self._events: list[tuple[float, int, int, str, int, int]] = []
        self._order = itertools.count()

    def complete(self, member: int, at: float) -> None:
        heapq.heappush(self._events, (at, next(self._order), member, "complete", 0, 0))

    def run(self) -> None:
        while self._events:
            now, _, member, what, came, count = heapq.heappop(self._events)
            agreement = self.agreements[member]
            if what == "complete":
                with agreement.lock:
                    self.ledgers[member].remaining = 0
                self.completed_at[member] = now
            else:
                agreement.on_notice(count, came=came)
            self._send_due(member, now)
            if agreement.agreed and self.completed_at[member] is not None:
                if self.agreed_at[member] is None:
                    self.agreed_at[member] = now
                # Safety: agreeing means every member completed by now.
                assert all(at is not None and at <= now for at in self.completed_at), (
                    member, now, self.completed_at)

    def _send_due(self, member: int, now: float) -> None:
        agreement = self.agreements[member]
        if self.completed_at[member] is None:
            return  # a member sends only once its own part is complete
        while True:
            with agreement.lock:
                claimed = agreement.claim()
            if claimed is None:
                return
            direction, count = claimed
            self.sent[member][direction] += 1
            target = (member + (1 if direction == FORWARD else -1)) % self.world
            delay = self.delays[direction][member]
            # Links keep order: equal delays per link, and ties broken by send order.
            heapq.heappush(self._events,
                           (now + delay, next(self._order), target, "notice", direction, count))
            with agreement.lock:
                agreement.sent(direction, count, ok=True)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=2, max_value=9).flatmap(lambda world: st.tuples(
        st.just(world),
        st.lists(st.floats(0, 10), min_size=world, max_size=world),
        st.lists(st.floats(0.01, 5), min_size=world, max_size=world),
        st.lists(st.floats(0.01, 5), min_size=world, max_size=world),
        st.lists(st.booleans(), min_size=world, max_size=world),
    ))
)
def test_members_agree_only_after_all_completed_and_all_agree(case: tuple) -> None:
    """Also in a ring that mixes members sending notices both ways with members
    sending them forward only."""
    world, completions, forward, back, both_ways = case
    ring = _Ring(world, forward=forward, back=back, both_ways=both_ways)
    for member, at in enumerate(completions):
        ring.complete(member, at)
    ring.run()
    for member, agreement in enumerate(ring.agreements):
        with agreement.lock:
            assert agreement.agreed and agreement.done, member
        assert max(ring.sent[member]) <= world - 1
        if world == 2 or not both_ways[member]:
            assert ring.sent[member][BACKWARD] == 0


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("both_ways", [True, False])
def test_agreement_takes_half_the_ring_in_hops_both_ways(world: int, both_ways: bool) -> None:
    ring = _Ring(world, forward=[1.0] * world, back=[1.0] * world, both_ways=both_ways)
    for member in range(world):
        ring.complete(member, 0.0)
    ring.run()
    expected = world // 2 if both_ways and world > 2 else world - 1
    assert ring.agreed_at == [float(expected)] * world


def test_the_last_member_to_complete_is_known_to_both_neighbours_after_one_hop() -> None:
    """Member 2 of 5 completes long after the others."""
    ring = _Ring(5, forward=[1.0] * 5, back=[1.0] * 5)
    for member in range(5):
        ring.complete(member, 0.0 if member != 2 else 10.0)
    ring.run()
    assert ring.agreed_at[1] == ring.agreed_at[3] == 11.0
    # It had heard of all the others before it completed: it knows at once.
    assert ring.agreed_at[2] == 10.0
    # Its neighbours tell theirs that the whole ring completed, one hop later.
    assert ring.agreed_at[0] == ring.agreed_at[4] == 12.0


def test_a_count_no_member_of_the_ring_can_send_is_refused() -> None:
    agreement = Agreement(world=3, ledger=Ledger(tag=0, recv_slices=[1], send_slices=[]))
    for count in (0, 3, -1):
        with pytest.raises(RemoteProtocolError, match="completion notice of"):
            agreement.on_notice(count, came=BACKWARD)
