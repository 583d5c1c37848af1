"""Shared-state sync over both networks: joiners, divergence, revisions, failures."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import Message, PeerEndpoint, SharedStateDone
from pccl_trio.peer import _shared_state as sharing
from pccl_trio.peer._session import MasterSession
from pccl_trio.testing import PeerSeam

from .conftest import (
    WITH_BLOCKING,
    Cluster,
    big_state,
    form_run,
    joined,
    kill_during_fetch,
    run_all,
    same_content,
    state_bytes,
    sync_all,
)

NETWORKS = WITH_BLOCKING


def make_state(seed: int, *, revision: int = 0, zero: bool = False) -> pccl.SharedState:
    rng = np.random.default_rng(seed)
    tensors = {
        "weights": rng.standard_normal(3000).astype(np.float32),
        "bias": rng.standard_normal(17).astype(np.float64),
        "steps": np.arange(5, dtype=np.int64),
        "rng": rng.integers(0, 2**32, 4, dtype=np.uint32),
    }
    if zero:
        tensors = {k: np.zeros_like(v) for k, v in tensors.items()}
    return pccl.SharedState(
        [
            pccl.TensorInfo(name, array, allow_content_inequality=name == "rng")
            for name, array in tensors.items()
        ],
        revision=revision,
    )


def step(state: pccl.SharedState, grad: np.ndarray) -> None:
    """A deterministic update of every comparable tensor, and the revision."""
    tensors = {t.name: t.data for t in state.tensors}
    tensors["weights"] -= np.float32(0.01) * grad
    tensors["bias"] *= 0.5
    tensors["steps"] += 1
    state.revision += 1


async def test_joiner_receives_the_state_then_every_sync_is_free(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(120):
        founders = await form_run([], [cluster.communicator(f"f{i}") for i in range(2)])
        states = [make_state(1), make_state(1)]
        infos = await sync_all(founders, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)]  # type: ignore[union-attr]
        assert [s.revision for s in states] == [0, 0]
        for k in range(3):
            grads = [np.full(3000, i + k, dtype=np.float32) for i in range(2)]
            await run_all(founders, lambda i, c, grads=grads: c.all_reduce(grads[i]))
            for i in range(2):
                step(states[i], grads[i])
            infos = await sync_all(founders, states)
            assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)]  # type: ignore[union-attr]
        assert [s.revision for s in states] == [3, 3]

        joiner = cluster.communicator("joiner")
        comms = await form_run(founders, [joiner])
        fresh = make_state(99, zero=True)
        states.append(fresh)
        for s in states[:2]:
            s.revision += 1
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert fresh.revision == 4
        assert same_content(states)
        # The joiner got every tensor, the may-differ one included (some founder's copy).
        assert infos[2].rx_bytes == state_bytes(fresh)  # type: ignore[union-attr]
        assert infos[2].tx_bytes == 0  # type: ignore[union-attr]
        assert infos[0].tx_bytes + infos[1].tx_bytes == state_bytes(fresh)  # type: ignore[union-attr]
        assert fresh.tensors[3].data.tobytes() in (
            states[0].tensors[3].data.tobytes(), states[1].tensors[3].data.tobytes()
        )
        for k in range(3):
            grads = [np.full(3000, i - k, dtype=np.float32) for i in range(3)]
            await run_all(comms, lambda i, c, grads=grads: c.all_reduce(grads[i]))
            for i in range(3):
                step(states[i], grads[i])
            infos = await sync_all(comms, states)
            assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0)] * 3  # type: ignore[union-attr]
            assert same_content(states)
        assert [s.revision for s in states] == [7, 7, 7]
        for comm in comms:
            await comm.aclose()


async def test_a_sync_in_which_nobody_fetches_is_over_with_its_plan(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal states: the plan says the sync is complete, so no peer reports to the
    master (one round trip, not two); once a peer must fetch, every peer reports."""
    reports: list[int] = []
    real = MasterSession.send

    async def send(self: MasterSession, message: Message, *, epoch: int | None = None) -> int:
        if isinstance(message, SharedStateDone):
            reports.append(message.sync)
        return await real(self, message, epoch=epoch)

    monkeypatch.setattr(MasterSession, "send", send)
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        states = [make_state(1), make_state(1)]
        for _ in range(2):
            infos = await sync_all(comms, states)
            assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
            for s in states:
                s.revision += 1
        assert reports == []
        assert [s.revision for s in states] == [2, 2]
        states[1].tensors[0].data[:] += 1  # peer 1 diverged: it fetches the weights
        await sync_all(comms, states)
        assert len(reports) == 2 and len(set(reports)) == 1
        assert same_content(states)
        await run_all(comms, lambda i, c: c.aclose())


async def test_a_joiner_fetches_over_as_many_connections_as_the_rings_pools_have(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools of 4 (as a long path gets them): the joiner's one distributor serves it
    on 4 connections at once, whose workers share the pieces; the state arrives whole."""
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)  # many pieces to share
    with trio.fail_after(120):
        founder = cluster.communicator("f0", 0, 4)
        await form_run([], [founder])
        states = [big_state(5)]
        await sync_all([founder], states)
        joiner = cluster.communicator("joiner", 0, 4)
        comms = await form_run([founder], [joiner])
        states[0].revision += 1
        fresh = big_state(6, zero=True)
        fresh.revision = 0
        seam = PeerSeam(joiner)
        fetch_from = seam.fetch_from
        workers: list[int] = []  # the distributor of each worker, as it ends

        async def counted(endpoint: PeerEndpoint, fetcher: sharing.Fetcher) -> None:
            await fetch_from(endpoint, fetcher)
            workers.append(endpoint.peer_id)

        seam.fetch_from = counted
        infos = await sync_all(comms, [states[0], fresh])
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert same_content([states[0], fresh])
        assert workers == [founder.peer_id] * 4
        await run_all(comms, lambda i, c: c.aclose())


async def test_diverged_peer_receives_only_the_differing_tensors(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        states = [make_state(5) for _ in range(3)]
        states[1].tensors[1].data[3] += 1.0  # bias differs on peer 1
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        bias = states[0].tensors[1].data.nbytes
        assert infos[1].rx_bytes == bias  # type: ignore[union-attr]
        assert infos[0].rx_bytes == infos[2].rx_bytes == 0  # type: ignore[union-attr]
        assert infos[0].tx_bytes + infos[2].tx_bytes == bias  # type: ignore[union-attr]
        assert same_content(states)
        # The may-differ tensor is never compared nor sent between current peers.
        states[2].tensors[3].data[:] = 7
        for s in states:
            s.revision += 1
        infos = await sync_all(comms, states)
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0)] * 3  # type: ignore[union-attr]
        assert (states[2].tensors[3].data == 7).all()
        for comm in comms:
            await comm.aclose()


async def test_a_peer_skipping_a_revision_is_kicked_and_the_others_sync(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        states = [make_state(2) for _ in range(3)]
        await sync_all(comms, states)
        for s in states:
            s.revision += 1
        states[2].revision += 1  # 2 instead of 1
        results = await sync_all(comms, states)
        assert isinstance(results[2], pccl.Kicked), results
        assert "skips ahead" in str(results[2])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results[:2]), results
        assert [s.revision for s in states[:2]] == [1, 1]
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("what", ["dtype", "name", "count"])
async def test_mismatched_tensors_get_the_peer_kicked_naming_the_key(
    cluster: Cluster, clock: object, what: str
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        states = [make_state(3) for _ in range(3)]
        odd = states[0].tensors
        if what == "dtype":
            odd[1] = pccl.TensorInfo("bias", odd[1].data.astype(np.float32))
        elif what == "name":
            odd[1] = pccl.TensorInfo("offset", odd[1].data)
        else:
            odd[1] = pccl.TensorInfo("bias", odd[1].data[:-1].copy())
        results = await sync_all(comms, states)
        assert isinstance(results[0], pccl.Kicked), results
        assert "bias" in str(results[0])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results[1:]), results
        for comm in comms:
            await comm.aclose()


async def test_bad_states_are_refused_before_voting(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        comm = comms[0]
        ok = np.zeros(4, dtype=np.float32)
        cases: list[tuple[object, str]] = [
            ("state", "SharedState"),
            (pccl.SharedState([pccl.TensorInfo("a", ok), pccl.TensorInfo("a", ok)]), "two tensors"),
            (pccl.SharedState([pccl.TensorInfo("", ok)]), "name"),
            (pccl.SharedState([pccl.TensorInfo("a", ok)], revision=-1), "revision"),
            (pccl.SharedState([pccl.TensorInfo("a", [1, 2])]), "expected"),
            (pccl.SharedState([ok]), "TensorInfo"),  # type: ignore[list-item]
            (pccl.SharedState([pccl.TensorInfo("a", np.zeros((4, 4))[:, 1])]), "contiguous"),
        ]
        for state, words in cases:
            with pytest.raises(pccl.InvalidArgument, match=words):
                await comm.sync_shared_state(state)  # type: ignore[arg-type]
        with pytest.raises(pccl.InvalidArgument, match="strategy"):
            await comm.sync_shared_state(make_state(1), strategy="popular")  # type: ignore[arg-type]
        # Nothing was voted: the run goes on.
        states = [make_state(4), make_state(4)]
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        for c in comms:
            await c.aclose()


async def test_a_distributor_dying_mid_transfer_leaves_no_torn_state(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery
) -> None:
    """Two founders serve a joiner; one dies after a few frames: the joiner finishes from
    the other, and holds exactly the popular state."""
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        comms = await joined(cluster, states)
        fresh = big_state(7, zero=True)
        frames = kill_during_fetch(monkeypatch, cluster, {"f0": comms[0]}, nursery, after_pieces=5)
        results = await sync_all(comms, [*states, fresh])
        assert len(frames) > 5
        assert isinstance(results[0], pccl.PCCLError), results
        assert isinstance(results[1], pccl.SharedStateSyncInfo), results
        assert isinstance(results[2], pccl.SharedStateSyncInfo), results
        assert results[2].rx_bytes == state_bytes(fresh)
        assert fresh.revision == 1
        assert same_content([states[1], fresh])
        for comm in comms[1:]:
            await comm.aclose()


async def test_every_distributor_dying_restores_the_old_state(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery
) -> None:
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        comms = await joined(cluster, states)
        fresh = big_state(7)  # its own content, at revision 0
        before = [t.data.copy() for t in fresh.tensors]
        kill_during_fetch(
            monkeypatch, cluster, {"f0": comms[0], "f1": comms[1]}, nursery, after_pieces=5
        )
        results = await sync_all(comms, [*states, fresh])
        assert isinstance(results[2], pccl.SharedStateSyncFailed), results
        assert "unchanged" in str(results[2])
        assert fresh.revision == 0
        assert all(
            t.data.tobytes() == b.tobytes() for t, b in zip(fresh.tensors, before, strict=True)
        )
        await comms[2].aclose()


async def test_fetches_are_spread_over_every_distributor(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sharing, "PIECE_BYTES", 256 << 10)
    with trio.fail_after(120):
        states = [big_state(1) for _ in range(3)]
        comms = await joined(cluster, states)
        fresh = big_state(3, zero=True)
        infos = await sync_all(comms, [*states, fresh])
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        sent = [i.tx_bytes for i in infos[:3]]  # type: ignore[union-attr]
        assert sum(sent) == infos[3].rx_bytes == state_bytes(fresh)  # type: ignore[union-attr]
        if cluster.memory is not None:  # deterministic: every distributor served a share
            assert all(s > 0 for s in sent), sent
        assert same_content([states[0], fresh])
        for comm in comms:
            await comm.aclose()
