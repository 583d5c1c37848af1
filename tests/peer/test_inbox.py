"""The inbox: messages waited on by kind and predicate, in arrival order; what a lost
master decided is kept.

In virtual time (pytest-trio's ``autojump_clock``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl_trio._core.messages import (
    CollectiveCommence,
    CollectiveVerdict,
    Heartbeat,
    Message,
    Outcome,
    P2PEstablishResult,
    PeersPendingResult,
    SharedStateComplete,
    SharedStatePlan,
    TopologyOptimized,
    WorldSizes,
)
from pccl_trio.peer._inbox import Inbox, decided


class Ended(Exception):
    """What a ``check`` raises to end a wait."""


def never() -> None:
    pass


def ended() -> None:
    raise Ended


def verdict(tag: int, seq: int = 1) -> CollectiveVerdict:
    return CollectiveVerdict(tag=tag, seq=seq, outcome=Outcome.SUCCESS, reason="")


def commence(tag: int, seq: int = 1) -> CollectiveCommence:
    return CollectiveCommence(tag=tag, seq=seq, ring=(1, 2))


async def test_a_queued_message_is_taken_at_once_without_a_checkpoint() -> None:
    inbox = Inbox()
    inbox.put(verdict(3))
    with trio.CancelScope() as scope:
        scope.cancel()  # a checkpoint would raise Cancelled
        taken = await inbox.wait_for(CollectiveVerdict, check=never)
    assert taken == verdict(3)


async def test_the_first_match_is_taken_and_the_others_stay_in_order() -> None:
    inbox = Inbox()
    for message in (verdict(1), commence(2), verdict(2), verdict(2, seq=5)):
        inbox.put(message)
    assert await inbox.wait_for(CollectiveVerdict, lambda m: m.tag == 2, check=never) == verdict(2)
    assert await inbox.wait_for((CollectiveCommence, CollectiveVerdict), check=never) == verdict(1)
    assert await inbox.wait_for(CollectiveVerdict, check=never) == verdict(2, seq=5)
    assert await inbox.wait_for(CollectiveCommence, check=never) == commence(2)


async def test_a_waiter_wakes_for_its_message(autojump_clock: trio.testing.MockClock) -> None:
    inbox = Inbox()
    taken: list[tuple[float, Message]] = []

    async def waiter() -> None:
        message = await inbox.wait_for(CollectiveVerdict, lambda m: m.tag == 7, check=never)
        taken.append((trio.current_time(), message))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(1)
            inbox.put(verdict(6))  # not this one: it stays queued
            await trio.sleep(1)
            inbox.put(verdict(7))
    assert taken == [(2.0, verdict(7))]
    assert await inbox.wait_for(CollectiveVerdict, check=never) == verdict(6)


async def test_check_ends_a_wait_when_woken(autojump_clock: trio.testing.MockClock) -> None:
    inbox = Inbox()
    over = False
    checks = 0

    def check() -> None:
        nonlocal checks
        checks += 1
        if over:
            raise Ended

    async def waiter() -> None:
        with pytest.raises(Ended):
            await inbox.wait_for(CollectiveVerdict, check=check)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            inbox.put(Heartbeat())  # another kind: the waiter looks, checks, waits again
            await trio.testing.wait_all_tasks_blocked()
            assert checks == 2
            over = True
            inbox.wake()
    assert checks == 3


async def test_discard_and_clear() -> None:
    inbox = Inbox()
    for tag in range(4):
        inbox.put(verdict(tag))
    inbox.discard(lambda m: isinstance(m, CollectiveVerdict) and m.tag % 2 == 0)
    assert await inbox.wait_for(CollectiveVerdict, check=never) == verdict(1)
    inbox.clear()
    with pytest.raises(Ended):
        await inbox.wait_for(CollectiveVerdict, check=ended)


WORLD = WorldSizes(
    global_world_size=2, peer_group_world_size=2, num_distinct_peer_groups=1,
    largest_peer_group_world_size=2,
)

#: What a lost master decided (kept) and what only it could follow up (dropped).
DECIDED: list[Message] = [
    PeersPendingResult(pending=False, error=""),
    P2PEstablishResult(round=3, success=True, ring=(1, 2), world=WORLD, error=""),
    SharedStateComplete(sync=2),
    verdict(4),
    SharedStatePlan(
        sync=2, revision=5, fetches=(), distributors=(), error="refused: a peer did not vote"
    ),
    TopologyOptimized(optimization=1, error="refused"),
]
UNDECIDED: list[Message] = [
    commence(4),
    SharedStatePlan(sync=2, revision=5, fetches=(), distributors=()),
    TopologyOptimized(optimization=1),
]


@pytest.mark.parametrize("message", DECIDED, ids=lambda m: type(m).__name__)
def test_outcomes_the_master_decided(message: Message) -> None:
    assert decided(message)


@pytest.mark.parametrize("message", UNDECIDED, ids=lambda m: type(m).__name__)
def test_work_only_the_lost_master_could_finish(message: Message) -> None:
    assert not decided(message)


async def test_keep_decided_keeps_only_the_outcomes() -> None:
    inbox = Inbox()
    for message in [*UNDECIDED, *DECIDED]:
        inbox.put(message)
    inbox.keep_decided()
    kept = []
    for _ in DECIDED:
        kept.append(await inbox.wait_for(
            (PeersPendingResult, P2PEstablishResult, SharedStateComplete, CollectiveVerdict,
             SharedStatePlan, TopologyOptimized, CollectiveCommence),
            check=never,
        ))
    assert kept == DECIDED
    with pytest.raises(Ended):
        await inbox.wait_for(CollectiveCommence, check=ended)
