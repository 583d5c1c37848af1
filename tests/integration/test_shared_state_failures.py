"""Shared-state sync under failures and odd settings: silent distributors, tensors that may
differ, small frames, cancellation, threads without the threaded data path."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio.peer import _shared_state as sharing

from .conftest import (
    WITH_BLOCKING,
    Cluster,
    big_state,
    form_run,
    joined,
    run_all,
    same_content,
    state_bytes,
    sync_all,
)

NETWORKS = WITH_BLOCKING


def count_frames(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Small pieces and frames; returns the list of frames the fetching peer received."""
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    monkeypatch.setattr(sharing, "FRAME_BYTES", 64 << 10)
    original = sharing.Fetcher.count
    frames: list[int] = []

    def count(self: sharing.Fetcher, nbytes: int) -> None:
        original(self, nbytes)
        frames.append(nbytes)

    monkeypatch.setattr(sharing.Fetcher, "count", count)
    return frames


# A distributor that dies silently (host frozen, network partition: no FIN/RST) is
# kicked by the master after the liveness timeout; its shared-state connection makes no
# progress, fails after twice the liveness timeout, and its piece goes to another
# distributor.
async def test_a_silently_dead_distributor_does_not_hang_the_sync(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cluster.memory is None:
        pytest.skip("silent partitions need the memory network")
    # The partitioned distributor waits for its master for the grace, then fails.
    cluster.config = dataclasses.replace(cluster.config, master_grace=10.0)
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        comms = await joined(cluster, states)
        fresh = big_state(7, zero=True)
        frames = count_frames(monkeypatch)
        memory = cluster.memory

        async def partition_f0_mid_transfer() -> None:
            while len(frames) < 3:
                await trio.lowlevel.checkpoint()
            memory.partition("f0")

        results: list[object] = []
        with trio.move_on_after(60):  # 20 liveness timeouts
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partition_f0_mid_transfer)
                results = await sync_all(comms, [*states, fresh])
        assert results, "the sync still runs 60 s after f0 was partitioned (kicked at ~3 s)"
        assert isinstance(results[1], pccl.SharedStateSyncInfo), results
        assert isinstance(results[2], pccl.SharedStateSyncInfo), results
        assert same_content([states[1], fresh])


def with_random_state(seed: int, *, zero: bool = False) -> pccl.SharedState:
    weights = np.arange(1 << 18, dtype=np.float32)
    rng_state = np.full(1 << 20, seed, dtype=np.uint8)  # 1 MiB: four 256 KiB pieces
    if zero:
        weights[:], rng_state[:] = 0, 0
    return pccl.SharedState(
        [
            pccl.TensorInfo("weights", weights),
            pccl.TensorInfo("rng", rng_state, allow_content_inequality=True),
        ],
        revision=0,
    )


# An allow_content_inequality tensor differs between distributors by definition: it is
# fetched whole from one of them (and from its first byte again after a failover), so
# the joiner holds one peer's copy, never a splice.
async def test_a_joiner_gets_one_peers_copy_of_a_tensor_that_may_differ(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    with trio.fail_after(120):
        states = [with_random_state(1), with_random_state(2)]
        comms = await joined(cluster, states)
        fresh = with_random_state(0, zero=True)
        infos = await sync_all(comms, [*states, fresh])
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        got = fresh.tensors[1].data.tobytes()
        copies = [s.tensors[1].data.tobytes() for s in states]
        assert got in copies, np.unique(fresh.tensors[1].data, return_counts=True)


# Distributors send frames no larger than the requester accepts (its
# Config.max_data_frame travels in the request).
async def test_sync_works_with_a_smaller_max_data_frame(cluster: Cluster, clock: object) -> None:
    cluster.config = dataclasses.replace(
        cluster.config, max_data_frame=(1 << 20) + 64, slice_bytes=1 << 20
    )
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        states = [big_state(1), big_state(2)]
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert same_content(states)


@pytest.mark.async_only
# Cancelling sync_shared_state while it fetches puts the old bytes back, as a
# cancelled all_reduce restores its input.
async def test_a_cancelled_fetch_restores_the_old_state(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        comms = await joined(cluster, states)
        fresh = big_state(7)  # its own content, at revision 0
        before = [t.data.copy() for t in fresh.tensors]
        frames = count_frames(monkeypatch)
        counted = sharing.Fetcher.count
        token = trio.lowlevel.current_trio_token()
        scope = trio.CancelScope()

        def count(self: sharing.Fetcher, nbytes: int) -> None:
            counted(self, nbytes)
            in_thread = threading.current_thread() is not threading.main_thread()
            if len(frames) == 3:  # mid-transfer: the caller cancels
                if in_thread:
                    token.run_sync_soon(scope.cancel)
                else:
                    scope.cancel()
            if len(frames) >= 3 and in_thread:
                time.sleep(1)  # the fetch threads wait to be cut

        monkeypatch.setattr(sharing.Fetcher, "count", count)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all, comms[:2], lambda i, c: c.sync_shared_state(states[i]))
            with scope:
                await comms[2].sync_shared_state(fresh)
        assert scope.cancelled_caught
        assert len(frames) >= 3 and sum(frames) < state_bytes(fresh), frames
        assert fresh.revision == 0
        assert all(
            t.data.tobytes() == b.tobytes() for t, b in zip(fresh.tensors, before, strict=True)
        )


# Hashing and the backup copy leave the trio thread on real networks, whatever
# Config.threaded_data_path says, so heartbeats keep flowing during a long hash.
async def test_hashing_leaves_the_event_loop_free_without_threaded_data_path(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cluster.memory is not None:
        pytest.skip("under virtual time hashing runs inline by design")
    cluster.config = dataclasses.replace(cluster.config, threaded_data_path=False)
    on_loop: list[bool] = []
    original = sharing.Tensor.content_hash

    def content_hash(self: sharing.Tensor, threads: int = 1) -> int:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return original(self, threads)

    monkeypatch.setattr(sharing.Tensor, "content_hash", content_hash)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        infos = await sync_all(comms, [big_state(1), big_state(1)])
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert on_loop and not any(on_loop), on_loop


# A peer that syncs while the others all-reduce (its sync failed, theirs succeeded, and
# it syncs again): their all-reduce ends before it ran, leaving the ring as it is, so
# their own sync, which comes next, meets this peer's vote instead of a re-establishment
# that would refuse it.
@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("call", ["all_reduce", "all_reduce_multiple_with_retry"])
async def test_an_all_reduce_facing_a_sync_ends_before_it_runs_and_the_sync_follows(
    cluster: Cluster, clock: object, call: str
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        states = [big_state(0) for _ in comms]
        grads = [np.full(1000, float(i), dtype=np.float32) for i in range(3)]
        rounds_before = [c.ring for c in comms]

        async def reduce(index: int, comm: pccl.Communicator) -> object:
            if call == "all_reduce":
                return await comm.all_reduce(grads[index])
            return await comm.all_reduce_multiple_with_retry([grads[index]])

        async with trio.open_nursery() as nursery:
            synced: list[object] = []

            async def sync_first() -> None:
                synced.append(await comms[0].sync_shared_state(states[0]))

            nursery.start_soon(sync_first)
            results = await run_all(comms[1:], reduce)
            assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
            assert all("synchronize the shared state" in str(r) for r in results)
            assert all(np.all(grads[i] == i) for i in (1, 2))  # inputs untouched
            # Their ring was not made stale: their sync is the next vote, and it runs
            # (a re-establishment first would refuse peer 0's sync).
            results = await run_all(comms[1:], lambda i, c: c.sync_shared_state(states[i + 1]))
            assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert len(synced) == 1 and [c.ring for c in comms] == rounds_before
        await run_all(comms, lambda i, c: c.all_reduce(grads[i]))
        assert all(np.all(g == 3) for g in grads)
        for comm in comms:
            await comm.aclose()
