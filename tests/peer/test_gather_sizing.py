"""An all-gather's attempt gets its schedule from the sizes its commence carries:
sizes that do not give this peer its own part, or that no memory can hold, fail the
attempt with a reason rather than run it."""

from __future__ import annotations

import numpy as np

from pccl_trio._core.ring import RingSchedule
from pccl_trio.ops import HostStaging, Recycled
from pccl_trio.peer._attempt import RingAttempt
from pccl_trio.peer._collectives import _sizing
from pccl_trio.peer._requests import check_all_gather_arguments
from pccl_trio.peer._results import ReduceResult

RING = (4, 2, 9)  # this peer, 2, is at position 1


def gather_attempt(own: int) -> tuple[RingAttempt, ReduceResult]:
    request = check_all_gather_arguments(np.arange(own, dtype=np.float32), tag=3)
    result = ReduceResult()
    attempt = RingAttempt(
        schedule=RingSchedule(world=3, rank=1, itemsize=4, slice_bytes=64, send=(), recv=()),
        staging=HostStaging(), send=request.send, result=request.result, op=request.op,
        tag=3, ring=RING,
    )
    attempt.sizing = _sizing(
        attempt, request, result, slice_bytes=64, stripes=1, recycled=Recycled()
    )
    return attempt, result


def test_sizes_that_fit_make_the_schedule_and_the_parts_by_peer_id() -> None:
    attempt, result = gather_attempt(5)
    assert attempt.sizing is not None and attempt.sizing((3, 5, 2)) is None
    # By peer id: 2 (this peer), then 4, then 9.
    assert result.parts == {2: (0, 5), 4: (5, 3), 9: (8, 2)}
    assert result.gathered.shape == (10,) and result.gathered.dtype == np.float32
    assert sum(s.nbytes for s in attempt.schedule.recv) == (3 + 2) * 4
    assert attempt.schedule.send[0].start == 0 and attempt.schedule.send[0].nbytes == 20


def test_sizes_that_miscount_this_peers_part_fail_it() -> None:
    attempt, result = gather_attempt(5)
    assert attempt.sizing is not None
    problem = attempt.sizing((3, 4, 2))
    assert problem is not None and "do not give this peer its 5 elements" in problem
    assert attempt.sizing(()) is not None
    assert result.parts == {}


def test_sizes_no_memory_can_hold_fail_it() -> None:
    attempt, _ = gather_attempt(1)
    assert attempt.sizing is not None
    problem = attempt.sizing(((1 << 62) - 1, 1, 0))
    assert problem is not None and "no memory" in problem
