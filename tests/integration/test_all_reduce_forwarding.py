"""Small all-reduces over worker threads forward each slice from the reader that
wrote it (``peer/_outbound.py``): the same bits as the sender threads, a
fall-back to them when a send could block, and an abort when a forward fails."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio.peer import _outbound
from pccl_trio.transport import SocketLink

from .conftest import RUN_SECRET, TCP_CONFIG, Cluster, form_run, run_all

#: Forwarding needs worker threads: TCP (without and with a run secret, see below).
pytestmark = pytest.mark.parametrize("network_kind", ["tcp"])

OPS = [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG, pccl.ReduceOp.PROD]


@pytest.fixture(params=[None, RUN_SECRET], ids=["plain", "secret"])
def master_config(request: pytest.FixtureRequest) -> pccl.Config:
    return dataclasses.replace(TCP_CONFIG, run_secret=request.param)


async def make_run(cluster: Cluster, master_config: pccl.Config, pool: int
                   ) -> list[pccl.Communicator]:
    """Three peers with the master's secret and slices of 1 KiB (several per chunk)."""
    cluster.config = dataclasses.replace(
        cluster.config, run_secret=master_config.run_secret, slice_bytes=1024
    )
    return await form_run([], [cluster.communicator(f"p{i}", 0, pool) for i in range(3)])


def on_trio_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class SenderThreads:
    """Counts the sender protocols the attempts start."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = 0
        original = _outbound.Outbound._send_slices

        def counted(attempt: Any, *args: Any) -> Any:
            self.started += 1
            return original(attempt, *args)

        monkeypatch.setattr(_outbound.Outbound, "_send_slices", counted)


def inputs(seed: int) -> list[np.ndarray]:
    """float32 data whose sums round differently in different orders."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(3001).astype(np.float32) * 1e3 for _ in range(3)]


async def reduce_all(comms: list[pccl.Communicator], arrays: list[np.ndarray],
                     op: pccl.ReduceOp) -> None:
    results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], op=op))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results


async def test_forwarded_results_are_the_sender_threads_bits(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch,
    master_config: pccl.Config,
) -> None:
    """Forwarded (no sender thread started) and sent by sender threads (forwarding
    off), every op gives the same bits on every peer, and the pipeline's order."""
    # A forwarder that finds a connection busy waits for it rather than fall back,
    # however long the machine keeps the thread that holds it from running.
    monkeypatch.setattr(_outbound, "FORWARD_LOCK_WAIT", 60.0)
    with trio.fail_after(120):
        comms = await make_run(cluster, master_config, pool=2)
        senders = SenderThreads(monkeypatch)
        for seed, op in enumerate(OPS):
            data = inputs(seed)
            forwarded = [d.copy() for d in data]
            await reduce_all(comms, forwarded, op)
            assert senders.started == 0
            monkeypatch.setattr(_outbound, "FORWARD_MAX_BYTES", 0)
            threaded = [d.copy() for d in data]
            await reduce_all(comms, threaded, op)
            assert senders.started > 0
            monkeypatch.setattr(_outbound, "FORWARD_MAX_BYTES", 4 << 20)
            senders.started = 0
            for result in forwarded + threaded:
                assert result.tobytes() == forwarded[0].tobytes()
            if op is pccl.ReduceOp.SUM:
                np.testing.assert_allclose(forwarded[0], sum(d.astype(np.float64) for d in data),
                                           rtol=1e-5, atol=1e-2)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("where", ["readers", "everywhere"])
async def test_a_send_that_could_block_goes_to_the_sender_threads(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch, where: str,
    master_config: pccl.Config,
) -> None:
    """No room in the socket for a forward (in reader threads only, or for the trio
    thread's first slices too): the sender threads send what was not sent, once."""
    with trio.fail_after(120):
        comms = await make_run(cluster, master_config, pool=2)
        senders = SenderThreads(monkeypatch)
        original = SocketLink.has_room

        def room(link: SocketLink, nbytes: int) -> bool:
            if where == "everywhere" or not on_trio_thread():
                return False
            return original(link, nbytes)

        monkeypatch.setattr(SocketLink, "has_room", room)
        for seed, op in enumerate(OPS):
            data = inputs(seed)
            arrays = [d.copy() for d in data]
            await reduce_all(comms, arrays, op)
            monkeypatch.setattr(SocketLink, "has_room", original)
            again = [d.copy() for d in data]
            await reduce_all(comms, again, op)
            monkeypatch.setattr(SocketLink, "has_room", room)
            for result in arrays + again:
                assert result.tobytes() == again[0].tobytes()
        assert senders.started > 0
        for comm in comms:
            await comm.aclose()


async def test_a_forward_that_fails_aborts_for_every_peer(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch,
    master_config: pccl.Config,
) -> None:
    """A reader's forward breaks its link mid-all-reduce: every peer gets the abort,
    every input is restored bit for bit, and the retry (on a re-established ring) is
    exact."""
    with trio.fail_after(120):
        comms = await make_run(cluster, master_config, pool=1)
        original = SocketLink.send_data_locked
        broken = []

        def send(link: SocketLink, **frame: Any) -> None:
            if not broken and not on_trio_thread():
                broken.append(link)
                link.cut()
            original(link, **frame)

        monkeypatch.setattr(SocketLink, "send_data_locked", send)
        data = inputs(7)
        arrays = [d.copy() for d in data]
        results = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert broken
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        for array, given in zip(arrays, data, strict=True):
            assert array.tobytes() == given.tobytes()
        await reduce_all(comms, arrays, pccl.ReduceOp.SUM)
        for array in arrays:
            assert array.tobytes() == arrays[0].tobytes()
        for comm in comms:
            await comm.aclose()
