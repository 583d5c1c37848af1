"""A shared-state distributor that trickles bytes cannot hold a sync forever (both
networks).

The distributor here answers a request, then sends one correct byte every 4 s: every
IO operation of the fetching peer makes progress, so no idle timeout ever fires. The
fetcher's minimum rate (``Config.shared_state_min_rate`` after
``Config.shared_state_grace``) cuts it off: its piece goes to another distributor, or,
when it is the only one, the sync fails with the reason and the old state is kept.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import SharedStateRequest, SharedStateResponse
from pccl_trio.peer import _shared_state as sharing
from pccl_trio.testing import PeerSeam
from pccl_trio.transport import FramedStream

from .conftest import Cluster, big_state, joined, same_content, sync_all

GRACE = 5.0
RATE = 64 * 1024.0
FRAME = 64 << 10  # the fetcher may owe one frame: GRACE + FRAME / RATE = 6 s


def trickle(state: pccl.SharedState) -> object:
    """A distributor's handler that sends one byte of the asked range every 4 s."""
    tensors = {t.name: memoryview(t.data).cast("B") for t in state.tensors}

    async def serve(framed: FramedStream, request: SharedStateRequest) -> None:
        try:
            await framed.send_message(SharedStateResponse())
            (wanted,) = request.ranges
            data = tensors[wanted.key]
            for offset in range(wanted.offset, wanted.offset + wanted.nbytes):
                await framed.send_data(
                    tag=0, seq=request.sync, offset=offset, payload=data[offset : offset + 1]
                )
                await trio.sleep(4)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the fetching peer cut us off

    return serve


@pytest.fixture
def slow_frames(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    monkeypatch.setattr(sharing, "FRAME_BYTES", FRAME)
    cluster.config = dataclasses.replace(
        cluster.config, shared_state_min_rate=RATE, shared_state_grace=GRACE
    )


async def test_a_trickling_distributor_is_replaced(
    cluster: Cluster, clock: object, slow_frames: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pccl_trio.peer")
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        comms = await joined(cluster, states)
        PeerSeam(comms[0]).serve_shared_state = trickle(states[0])  # type: ignore[assignment]
        fresh = big_state(7, zero=True)
        start = trio.current_time()
        results = await sync_all(comms, [*states, fresh])
        elapsed = trio.current_time() - start
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert same_content([states[1], fresh])
        cut = [r.getMessage() for r in caplog.records if "shared_state_min_rate" in r.getMessage()]
        assert cut and f"peer {comms[0].peer_id} failed" in cut[0], cut
        if cluster.memory is not None:  # cut off after the grace and one frame's time
            assert GRACE <= elapsed <= GRACE + FRAME / RATE + 1, elapsed


async def test_a_trickling_only_distributor_fails_the_sync(
    cluster: Cluster, clock: object, slow_frames: None
) -> None:
    with trio.fail_after(120):
        states = [big_state(1)]
        comms = await joined(cluster, states)
        PeerSeam(comms[0]).serve_shared_state = trickle(states[0])  # type: ignore[assignment]
        fresh = big_state(7, zero=True)
        start = trio.current_time()
        results = await sync_all(comms, [*states, fresh])
        elapsed = trio.current_time() - start
        assert isinstance(results[0], pccl.SharedStateSyncInfo), results
        error = results[1]
        assert isinstance(error, pccl.SharedStateSyncFailed), results
        assert "slower than Config.shared_state_min_rate" in str(error), error
        assert fresh.revision == 0 and not any(t.data.any() for t in fresh.tensors)
        if cluster.memory is not None:
            assert GRACE <= elapsed <= GRACE + FRAME / RATE + 1, elapsed
