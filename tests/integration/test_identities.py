"""Node identities: bound to peer ids by the master, checked by every p2p peer.

Each test runs on the in-memory network (virtual time) and over loopback TCP, with a
run secret (identities are proven in its handshake). The impostor here holds the run
secret but not the key of the peer it claims to be: it completes the handshake with
its own key, from the claimed peer's host, and must still be refused, with a reason
that names the identity, wherever it knocks (ring slot, shared-state fetch, link
measurement); a listener that answers for a peer without its key is refused by the
connecting side.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import pccl_trio as pccl
from pccl_trio._core.channel import Purpose
from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.identity import public_bytes
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    BenchmarkRequest,
    P2PHello,
    PeerEndpoint,
    SharedStateResponse,
)
from pccl_trio._identity import load_identity
from pccl_trio.testing import PeerSeam
from pccl_trio.transport import Credential, FramedStream, secure_client, secure_server

from .conftest import (
    CONFIGS,
    RUN_SECRET,
    Cluster,
    big_state,
    form_run,
    frames_until_closed,
    hold_fetches,
    joiner_state,
    reduce_exactly,
    run_all,
    shared_state_request,
    start_cluster,
    sync_all,
)

LIMITS = {"max_control_frame": 1 << 20, "max_data_frame": (64 << 20) + 64}


#: Its runs bring their own secrets (or none): the two networks only (``conftest``).
NETWORKS = ("memory", "tcp")


def base_config(kind: str) -> pccl.Config:
    base = CONFIGS[kind]
    return dataclasses.replace(base, run_secret=RUN_SECRET, slice_bytes=64 << 10)


@pytest.fixture
async def secured(network_kind: str, clock: object, nursery: trio.Nursery) -> AsyncIterator[Cluster]:
    cluster = await start_cluster(nursery, network_kind, base_config(network_kind))
    yield cluster
    cluster.master_scope.cancel()


class Keys:
    """Identity key files under one directory, by name, created on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    def public(self, name: str) -> bytes:
        return public_bytes(load_identity(self.path(name)))

    def private(self, name: str) -> Ed25519PrivateKey:
        return load_identity(self.path(name))


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


def peer(cluster: Cluster, host: str, keys: Keys | None) -> pccl.Communicator:
    """A communicator on ``host`` proving the identity named after its host (none
    without ``keys``)."""
    config = cluster.config
    if keys is not None:
        config = dataclasses.replace(config, identity=keys.path(host))
    return pccl.Communicator(
        cluster.master_address, 0, 1, config=config, network=cluster.network(host),
        **({"p2p_host": "127.0.0.1"} if cluster.memory is None else {}),
    )


async def impostor(
    cluster: Cluster, host: str, comm: pccl.Communicator, purpose: Purpose,
    key: Ed25519PrivateKey,
) -> FramedStream:
    """A connection from ``host`` to ``comm``'s p2p listener by a holder of the run
    secret proving ``key``."""
    address = PeerSeam(comm).p2p_address
    target = "127.0.0.1" if cluster.memory is None else address[0]
    stream = await cluster.network(host).connect(target, address[1])
    channel = await secure_client(stream, Credential(secret=RUN_SECRET, identity=key), purpose)
    return FramedStream(stream, channel=channel, **LIMITS)


async def test_identified_and_unidentified_peers_run_together(
    secured: Cluster, clock: object, keys: Keys
) -> None:
    """Two peers with identities and one without: all-reduce, topology optimization and
    a joiner's sync work as in any run, and every ring connection proved the identity
    of the peer at its other end (empty for the one without)."""
    with trio.fail_after(120):
        comms = await form_run([], [
            peer(secured, "p0", keys), peer(secured, "p1", keys), peer(secured, "p2", None),
        ])
        await reduce_exactly(comms)
        results = await run_all(comms, lambda i, c: c.optimize_topology())
        assert results == [None, None, None], results
        weights = np.random.default_rng(3).standard_normal(200_000).astype(np.float32)
        states = [pccl.SharedState([pccl.TensorInfo("w", weights.copy())]) for _ in comms]
        await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
        comms = await form_run(comms, [peer(secured, "joiner", keys)])
        states.append(pccl.SharedState([pccl.TensorInfo("w", np.zeros_like(weights))]))
        for state in states[:3]:
            state.revision += 1
        infos = await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
        assert infos[3].rx_bytes == weights.nbytes, infos  # type: ignore[union-attr]
        assert states[3].tensors[0].data.tobytes() == weights.tobytes()
        await reduce_exactly(comms, tag=5)
        identity = {c.peer_id: PeerSeam(c).identity for c in comms}
        assert identity[comms[0].peer_id] == keys.public("p0")
        assert identity[comms[2].peer_id] == b""
        for comm in comms:
            ring = comm.ring
            me = ring.index(comm.peer_id)
            successor, predecessor = ring[(me + 1) % len(ring)], ring[me - 1]
            for connection in PeerSeam(comm).connections():
                assert connection.channel is not None
                proven = connection.channel.peer_identity
                assert proven in (identity[successor], identity[predecessor])
            proven_all = {c.channel.peer_identity for c in PeerSeam(comm).connections()}  # type: ignore[union-attr]
            assert proven_all == {identity[successor], identity[predecessor]}
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("who", ["listed", "unlisted", "none"])
async def test_the_allowlist_admits_listed_identities_only(
    network_kind: str, clock: object, nursery: trio.Nursery, keys: Keys, who: str
) -> None:
    allowed = frozenset({keys.public("listed"), keys.public("other")})
    cluster = await start_cluster(
        nursery, network_kind, base_config(network_kind),
        dataclasses.replace(base_config(network_kind), allowed_identities=allowed),
    )
    with trio.fail_after(60):
        comm = peer(cluster, who, None if who == "none" else keys)
        if who == "listed":
            await comm.connect()
            assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
        else:
            with pytest.raises(pccl.Kicked) as caught:
                await comm.connect()
            expected = {
                "unlisted": f"node identity {keys.public('unlisted').hex()} is not in this "
                "master's allowlist",
                "none": "admits only listed node identities and this peer proved none",
            }[who]
            assert expected in str(caught.value)
        await comm.aclose()
    cluster.master_scope.cancel()


async def test_a_ring_slot_cannot_be_claimed_without_the_key(
    secured: Cluster, clock: object, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """An impostor from the predecessor's host, with the secret and a key of its own,
    says ``P2PHello`` as the predecessor: closed without an acknowledgement; the run
    goes on exactly."""
    caplog.set_level(logging.WARNING, logger="pccl_trio")
    with trio.fail_after(60):
        comms = await form_run([], [peer(secured, f"p{i}", keys) for i in range(3)])
        target = comms[0]
        ring = target.ring
        predecessor = ring[ring.index(target.peer_id) - 1]
        host = f"p{[c.peer_id for c in comms].index(predecessor)}"
        framed = await impostor(secured, host, target, Purpose.RING, keys.private("mallory"))
        await framed.send_message(
            P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=predecessor, slot=0)
        )
        assert await frames_until_closed(framed) == []
        assert any(
            f"P2PHello claiming to be peer {predecessor}, but the master named node identity "
            f"{keys.public(host)[:8].hex()}" in r.getMessage()
            and f"proved {keys.public('mallory')[:8].hex()}" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        await reduce_exactly(comms)
        for comm in comms:
            await comm.aclose()


async def test_shared_state_goes_only_to_the_fetchers_key(
    secured: Cluster, clock: object, keys: Keys
) -> None:
    """While the joiner's fetch is held, an impostor from the joiner's host with the
    joiner's id but another key is refused by every distributor, with the reason; the
    joiner's own fetch then completes."""
    with trio.fail_after(120):
        states = [big_state(1), big_state(1)]
        founders = await form_run([], [peer(secured, f"f{i}", keys) for i in range(2)])
        await sync_all(founders, states)
        comms = await form_run(founders, [peer(secured, "joiner", keys)])
        for state in states:
            state.revision += 1
        joiner = comms[2]
        fresh = joiner_state(states[0])
        held, release, syncs = hold_fetches(joiner)
        results: list[object] = []

        async def sync() -> None:
            results.extend(await sync_all(comms, [*states, fresh]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            await held.wait()
            assert joiner.peer_id is not None
            request = shared_state_request(joiner.peer_id, syncs[0], ("weights", 0, 4000))
            for distributor in founders:
                framed = await impostor(
                    secured, "joiner", distributor, Purpose.SHARED_STATE, keys.private("mallory")
                )
                await framed.send_message(request)
                frames = await frames_until_closed(framed)
                assert len(frames) == 1 and isinstance(frames[0], SharedStateResponse), frames
                assert (
                    f"a request claiming to be peer {joiner.peer_id}, but the master named node "
                    f"identity {keys.public('joiner')[:8].hex()}" in frames[0].error
                ), frames[0].error
            release.set()
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert results[2].rx_bytes == fresh.tensors[0].data.nbytes  # type: ignore[attr-defined]
        for comm in comms:
            await comm.aclose()


async def test_benchmark_bytes_go_only_to_the_measurers_key(
    secured: Cluster, clock: object, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """A measurement announced for peer 1's key: an impostor from its host with its id
    gets no byte, and the refusal names the identity."""
    caplog.set_level(logging.WARNING, logger="pccl_trio")
    with trio.fail_after(60):
        comms = await form_run([], [peer(secured, f"p{i}", keys) for i in range(2)])
        measurer, source = comms
        PeerSeam(source).expect_benchmark(PeerSeam(measurer).endpoint, 1 << 20)
        framed = await impostor(secured, "p0", source, Purpose.BENCHMARK, keys.private("mallory"))
        assert measurer.peer_id is not None
        await framed.send_message(BenchmarkRequest(
            protocol_version=PROTOCOL_VERSION, peer_id=measurer.peer_id, nbytes=1 << 20,
            frame_bytes=1 << 16,
        ))
        assert await frames_until_closed(framed) == []
        assert any(
            "refusing a benchmark connection claiming to be peer" in r.getMessage()
            and "the master named node identity" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        for comm in comms:
            await comm.aclose()


async def test_a_listener_answering_for_a_peer_must_prove_its_key(
    secured: Cluster, clock: object, keys: Keys, nursery: trio.Nursery
) -> None:
    """A peer connecting to an endpoint the master named with a key refuses a listener
    that proves another key (here: one that answers at that address), and accepts the
    same listener where the master named its key."""
    with trio.fail_after(60):
        comms = await form_run([], [peer(secured, "p0", keys)])
        if secured.memory is not None:
            listener = await secured.memory.host("rogue").listen("rogue", 7000)
            host = "rogue"
        else:
            listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
            host = "127.0.0.1"
        port = listener.socket.getsockname()[1] if secured.memory is None else 7000  # type: ignore[attr-defined]
        credential = Credential(secret=RUN_SECRET, identity=keys.private("mallory"))

        async def answer() -> None:
            async with listener:
                while True:
                    stream = await listener.accept()
                    try:
                        await secure_server(stream, credential, frozenset(Purpose))
                    except Exception:
                        pass
                    await stream.aclose()

        nursery.start_soon(answer)
        seam = PeerSeam(comms[0])
        named = PeerEndpoint(peer_id=9, host=host, port=port, identity=keys.public("p1"))
        with pytest.raises(RemoteProtocolError, match="proved node identity .* but the master named"):
            await seam.connect(named, Purpose.SHARED_STATE)
        framed = await seam.connect(
            dataclasses.replace(named, identity=keys.public("mallory")), Purpose.SHARED_STATE
        )
        await framed.aclose()
        await comms[0].aclose()


async def test_identities_need_a_run_secret(keys: Keys) -> None:
    with pytest.raises(pccl.InvalidArgument, match="node identities need a run secret"):
        pccl.Communicator("127.0.0.1:48148", config=pccl.Config(identity=keys.path("p")))
    with pytest.raises(ValueError, match="node identities need a run secret"):
        await pccl.serve_master([], config=pccl.Config(allowed_identities=frozenset()))



@pytest.mark.parametrize("expected", ["master", "other"])
async def test_peers_talk_only_to_a_master_proving_a_key_they_expect(
    network_kind: str, clock: object, nursery: trio.Nursery, keys: Keys, expected: str
) -> None:
    """A master started with a node key proves it; a peer that expects that key joins,
    one that expects another refuses the master with the reason."""
    cluster = await start_cluster(
        nursery, network_kind, base_config(network_kind),
        dataclasses.replace(base_config(network_kind), identity=keys.path("master")),
    )
    cluster.config = dataclasses.replace(
        cluster.config, master_identities=frozenset({keys.public(expected)})
    )
    with trio.fail_after(60):
        comm = peer(cluster, "p0", keys)
        if expected == "master":
            await comm.connect()
            assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
        else:
            with pytest.raises(pccl.MasterConnectionError, match="not one of Config.master_identities"):
                await comm.connect()
        await comm.aclose()
    cluster.master_scope.cancel()
