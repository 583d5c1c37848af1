"""Content digests end to end: a master started with ``Config(content_digest=True)``
makes every peer vote a BLAKE2b-256 digest of its shared state beside the simplehash,
and a fetched tensor must match the popular digest as well as the simplehash.

Each test runs on the in-memory network (virtual time) and over loopback TCP. The
forged-collision test makes the simplehash collide honestly: it replaces the peers'
simplehash with one that gives the forged bytes the genuine bytes' value (what an
attacker who forged a collision offline achieves), and has the only distributor serve
the forged bytes while it votes the genuine ones. Without digests the joiner accepts
them (the control); with digests its sync fails through the hash-mismatch path, naming
the tensor, and its state and revision stay what they were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio import _cli
from pccl_trio._core.messages import (
    Message,
    SharedStateRequest,
    SharedStateResponse,
    SharedStateVote,
)
from pccl_trio.ops import ArrayModule, simplehash
from pccl_trio.peer import _shared_state as sharing
from pccl_trio.testing import PeerSeam
from pccl_trio.transport import FramedStream

from .conftest import CONFIGS, Cluster, form_run, start_cluster, sync_all

#: Its runs bring their own secrets (or none): the two networks only (``conftest``).
NETWORKS = ("memory", "tcp")


@pytest.fixture(params=[True, False], ids=["digests", "no-digests"])
def digests(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
async def cluster(
    network_kind: str, clock: object, digests: bool, nursery: trio.Nursery
) -> AsyncIterator[Cluster]:
    """Peers with the default config; a master with ``content_digest`` as ``digests``
    says (the peers' own setting plays no part: the master's ``Welcome`` decides)."""
    config = CONFIGS[network_kind]
    cluster = await start_cluster(
        nursery, network_kind, config, dataclasses.replace(config, content_digest=digests)
    )
    yield cluster
    cluster.master_scope.cancel()


def digest_of(data: np.ndarray) -> bytes:
    return hashlib.blake2b(data.tobytes(), digest_size=32).digest()


def model(seed: int, *, zero: bool = False) -> pccl.SharedState:
    """Weights and moments that must match, and an RNG state that may differ."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(1 << 16).astype(np.float32)
    moments = rng.standard_normal(3000).astype(np.float64)
    if zero:
        weights[:], moments[:] = 0, 0
    return pccl.SharedState(
        [
            pccl.TensorInfo("weights", weights),
            pccl.TensorInfo("moments", moments),
            pccl.TensorInfo("rng", np.full(64, seed, np.uint8), allow_content_inequality=True),
        ],
        revision=0,
    )


def spy_votes(comm: pccl.Communicator) -> list[SharedStateVote]:
    """Every shared-state vote ``comm`` sends from now on."""
    seam = PeerSeam(comm)
    original = seam.vote
    votes: list[SharedStateVote] = []

    async def vote(message: Message) -> int:
        if isinstance(message, SharedStateVote):
            votes.append(message)
        return await original(message)

    seam.vote = vote
    return votes


async def test_founders_and_a_joiner_sync_exact_bytes(
    cluster: Cluster, clock: object, digests: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[bool] = []  # per digest computed: whether in the trio thread
    original = sharing.Tensor.content_digest

    def content_digest(self: sharing.Tensor) -> bytes:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return original(self)

    monkeypatch.setattr(sharing.Tensor, "content_digest", content_digest)
    with trio.fail_after(120):
        states = [model(1), model(1)]
        founders = await form_run([], [cluster.communicator(f"f{i}") for i in range(2)])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in await sync_all(founders, states))
        comms = await form_run(founders, [cluster.communicator("joiner")])
        votes = [spy_votes(comm) for comm in comms]
        for state in states:
            state.revision += 1
        fresh = model(9, zero=True)
        results = await sync_all(comms, [*states, fresh])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert fresh.revision == 1
        for mine, theirs in zip(fresh.tensors, states[0].tensors, strict=True):
            assert mine.data.tobytes() == theirs.data.tobytes(), mine.name  # rng too: fetched
        # Every vote carried the digest of every tensor whose content must match (and
        # none for the RNG state), exactly when the master required digests; the joiner
        # voted its state before the fetch.
        for comm_votes, voted in zip(votes, [*states, model(9, zero=True)], strict=True):
            (vote,) = comm_votes
            assert [(e.key, e.digest) for e in vote.entries] == [
                (t.name, digest_of(t.data) if digests and not t.allow_content_inequality else b"")
                for t in voted.tensors
            ]
        # Digests are computed only where required, and off the event loop where
        # threads are allowed (real time), like the simplehash.
        assert bool(on_loop) == digests
        assert all(on_loop) if cluster.memory is not None else not any(on_loop)


def forging(forged: dict[str, bytes]) -> object:
    """A distributor's handler that serves ``forged`` bytes for every range asked."""

    async def serve(framed: FramedStream, request: SharedStateRequest) -> None:
        try:
            while True:
                await framed.send_message(SharedStateResponse())
                for index, wanted in enumerate(request.ranges):
                    data = memoryview(forged[wanted.key])
                    end = wanted.offset + wanted.nbytes
                    for start in range(wanted.offset, end, request.frame_bytes):
                        stop = min(end, start + request.frame_bytes)
                        await framed.send_data(
                            tag=index, seq=request.sync, offset=start, payload=data[start:stop]
                        )
                following = await framed.receive_message()
                assert isinstance(following, SharedStateRequest)
                request = following
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the fetching peer has what it asked for

    return serve


def collide(monkeypatch: pytest.MonkeyPatch, forged: bytes, genuine: np.ndarray) -> None:
    """The peers' simplehash gives ``forged`` the value of ``genuine``'s bytes."""
    value = simplehash(np, genuine)

    def colliding(xp: ArrayModule, array: np.ndarray, *, threads: int = 1) -> int:
        if np.asarray(array).tobytes() == forged:
            return value
        return simplehash(xp, array, threads=threads)

    monkeypatch.setattr(sharing, "simplehash", colliding)


async def test_a_forged_simplehash_collision_is_caught_by_the_digest(
    cluster: Cluster, clock: object, digests: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(120):
        genuine = model(1)
        weights = genuine.tensors[0].data
        forged_weights = weights.copy()
        forged_weights[::97] = 1e9  # other content
        forged = forged_weights.tobytes()
        collide(monkeypatch, forged, weights)
        assert sharing.Tensor(
            key="w", xp=np, array=forged_weights, raw=forged_weights.view(np.uint8),
            allow_content_inequality=False,
        ).content_hash() == simplehash(np, weights)

        (founder,) = await form_run([], [cluster.communicator("f0")])
        assert isinstance((await sync_all([founder], [genuine]))[0], pccl.SharedStateSyncInfo)
        comms = await form_run([founder], [cluster.communicator("joiner")])
        genuine.revision += 1
        seam = PeerSeam(founder)
        honest = seam.serve_shared_state
        seam.serve_shared_state = forging(  # type: ignore[assignment]
            {"weights": forged, **{t.name: t.data.tobytes() for t in genuine.tensors[1:]}}
        )
        fresh = model(9, zero=True)
        founder_result, joiner_result = await sync_all(comms, [genuine, fresh])
        assert isinstance(founder_result, pccl.SharedStateSyncInfo), founder_result
        if not digests:
            # The control: the simplehash alone lets the forged weights through.
            assert isinstance(joiner_result, pccl.SharedStateSyncInfo), joiner_result
            assert fresh.revision == 1 and fresh.tensors[0].data.tobytes() == forged
            return
        assert isinstance(joiner_result, pccl.SharedStateSyncFailed), joiner_result
        message = str(joiner_result)
        assert "['weights']" in message and "content digest (BLAKE2b-256) differs" in message
        assert "moments" not in message, message
        # The old state is back, and the revision unchanged.
        assert fresh.revision == 0
        assert not any(t.data.any() for t in fresh.tensors[:2])

        # An honest distributor again: the joiner now gets the genuine bytes.
        seam.serve_shared_state = honest
        genuine.revision += 1
        results = await sync_all(comms, [genuine, fresh])
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert fresh.revision == genuine.revision
        assert fresh.tensors[0].data.tobytes() == weights.tobytes()


async def test_a_vote_that_breaks_the_digest_rule_gets_its_peer_kicked(
    cluster: Cluster, clock: object, digests: bool
) -> None:
    """A peer that drops the digests the run requires (or adds one a run without them
    does not use) is kicked with the reason; the other peer syncs alone."""
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        seam = PeerSeam(comms[1])
        original = seam.vote

        async def vote(message: Message) -> int:
            if isinstance(message, SharedStateVote):
                message = dataclasses.replace(message, entries=tuple(
                    dataclasses.replace(e, digest=b"" if digests else bytes(32))
                    for e in message.entries
                ))
            return await original(message)

        seam.vote = vote
        states = [model(1), model(1)]
        results = await sync_all(comms, states)
        assert isinstance(results[0], pccl.SharedStateSyncInfo), results
        assert isinstance(results[1], pccl.Kicked), results
        words = "carries no content digest" if digests else "carries a content digest"
        assert "illegal SharedStateVote" in str(results[1]) and words in str(results[1])
        assert "'weights'" in str(results[1]), results[1]


@pytest.mark.parametrize("flag", [True, False])
def test_the_master_cli_flag_sets_the_config(flag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[pccl.Config] = []

    async def run_master(
        host: str, port: int, config: pccl.Config, advertise: str | None, metrics: object = None
    ) -> None:
        configs.append(config)

    monkeypatch.setattr(_cli, "_run_master", run_master)
    argv = ["--listen", "127.0.0.1:0", *(["--content-digest"] if flag else [])]
    assert _cli.master_main(argv) == 0
    assert [c.content_digest for c in configs] == [flag]


def test_the_config_field_is_a_bool() -> None:
    assert pccl.Config().content_digest is False
    with pytest.raises(ValueError, match="Config.content_digest must be a bool"):
        pccl.Config(content_digest=1)  # type: ignore[arg-type]
