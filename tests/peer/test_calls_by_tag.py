"""A peer's calls by tag (``CallsByTag``): a concurrent call of a tag is refused, a
call after a cancelled one waits for it (unless it cannot wait), a call that never
started gives the tag back to the one before, and ``wound_down`` waits for every
cancelled call."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl_trio import InvalidUsage
from pccl_trio.peer._results import CallsByTag, ReduceResult


def cancelled() -> ReduceResult:
    result = ReduceResult()
    result.cancelled = True
    return result


def test_a_live_call_refuses_another_of_its_tag() -> None:
    calls = CallsByTag()
    assert calls.reserve(4, ReduceResult(), may_wait=True) is None
    with pytest.raises(InvalidUsage, match="tag 4 is already in flight"):
        calls.reserve(4, ReduceResult(), may_wait=True)
    assert calls.reserve(5, ReduceResult(), may_wait=True) is None
    assert sorted(calls.tags) == [4, 5]


def test_calls_after_cancelled_ones_chain_and_free_the_tag_in_turn() -> None:
    calls = CallsByTag()
    first, second, third = cancelled(), cancelled(), ReduceResult()
    calls.reserve(4, first, may_wait=True)
    with pytest.raises(InvalidUsage):
        calls.reserve(4, ReduceResult(), may_wait=False)  # cannot wait: refused
    assert calls.reserve(4, second, may_wait=True) is first
    assert calls.reserve(4, third, may_wait=True) is second
    calls.release(4, first, None)  # the oldest ends: the latest still holds the tag
    calls.release(4, second, first)
    assert list(calls.tags) == [4] and first.ended.is_set() and second.ended.is_set()
    calls.release(4, third, None)
    assert not calls.tags


def test_a_call_that_never_started_gives_the_tag_back() -> None:
    calls = CallsByTag()
    first = cancelled()
    calls.reserve(4, first, may_wait=True)
    failed = ReduceResult()
    before = calls.reserve(4, failed, may_wait=True)
    calls.release(4, failed, before)  # its launch failed: the cancelled one holds it again
    with pytest.raises(InvalidUsage):
        calls.reserve(4, ReduceResult(), may_wait=False)
    calls.release(4, first, None)
    assert not calls.tags


async def test_wound_down_waits_for_every_cancelled_call() -> None:
    calls = CallsByTag()
    gone, live = [cancelled(), cancelled()], ReduceResult()
    calls.reserve(1, gone[0], may_wait=True)
    calls.reserve(2, gone[1], may_wait=True)
    calls.reserve(3, live, may_wait=True)
    done = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            await calls.wound_down()
            done.append(True)

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        calls.release(1, gone[0], None)
        await trio.testing.wait_all_tasks_blocked()
        assert not done
        calls.release(2, gone[1], None)
    assert done  # the live call is not waited for
    assert list(calls.tags) == [3]
