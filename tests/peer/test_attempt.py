"""``AllReduceAttempt`` on its own: writer accounting under errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from pccl_trio._types import ReduceOp
from pccl_trio.peer._allreduce import AllReduceAttempt
from pccl_trio.peer._staging import BufferPool, HostStaging


class _Reader:
    def __init__(self) -> None:
        self.cut = False

    def close_now(self) -> None:
        self.cut = True


class _NoMemory(BufferPool):
    def take(self, nbytes: int) -> Any:
        raise MemoryError("no backup buffer")


async def test_a_failed_backup_leaves_no_writer_behind() -> None:
    """If saving the input fails as a direct receive starts, the attempt must not wait
    forever for that writer when it settles."""
    with trio.fail_after(10):
        data = np.arange(12, dtype=np.float32)
        staging = HostStaging()
        staging.pool = _NoMemory()
        attempt = AllReduceAttempt(staging=staging, send=data, result=data, op=ReduceOp.SUM,
                                   tag=0, ring=(1, 2, 3), rank=0, slice_bytes=64)
        attempt.seq = 1
        # The all-gather segment carrying this rank's own chunk: its first write.
        segment = next(s for s in attempt.schedule.recv if not s.reduce and s.chunk == 0)
        claimed = attempt.claim(0, segment.stream_offset, attempt.schedule.slice_range(segment, 0)[1]
                                - attempt.schedule.slice_range(segment, 0)[0])
        reader = _Reader()
        with pytest.raises(MemoryError):
            attempt.direct_target(*claimed, reader)
        attempt.stop()
        await attempt.settle()
        attempt.restore()
        assert not reader.cut  # it was no longer registered when the attempt stopped
        assert data.tobytes() == np.arange(12, dtype=np.float32).tobytes()
