"""What a stranger or a broken peer can send the master: it costs the sender its
connection, never the master or the honest peers (over both networks).

Each test replays an input that once ended or froze the master: frames are judged
from their header before their body is read, msgpack refuses oversized arrays before
building them, long votes are validated off the event loop, every reply text is
bounded, and a failure while handling one connection's event drops that connection.
"""

from __future__ import annotations

import struct
import threading

import msgpack
import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.events import MessageReceived
from pccl_trio._core.master import MasterCore
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    Kick,
    Message,
    Register,
    SharedStateEntry,
    SharedStateVote,
    Welcome,
)
from pccl_trio._core.records import MAX_SEQUENCE
from pccl_trio._core.wire import Undecoded, encode_control
from pccl_trio.master import _server

from .conftest import Cluster, exchange_raw, form_run

NUL_KEY = "\x00" * 1024


def control_frame(kind: int, fields: object) -> bytes:
    """A control frame with any msgpack ``fields``, valid or not."""
    body = struct.pack(">BH", 1, kind) + msgpack.packb(fields, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def register_frame(peer_group: int = 0, host: str = "") -> bytes:
    return encode_control(
        Register(protocol_version=PROTOCOL_VERSION, peer_group=peer_group, p2p_port=9,
                 advertised_host=host)
    )


def entry(key: str) -> list[object]:
    return [key, 0, 10, 4, False, b""]


async def honest_run(cluster: Cluster, world: int = 2) -> list[pccl.Communicator]:
    return await form_run([], [cluster.communicator(f"honest{i}") for i in range(world)])


async def still_serves(cluster: Cluster, comms: list[pccl.Communicator]) -> None:
    """The honest peers still reduce correctly, and a newcomer can still join."""
    data = [np.full(1000, float(i + 1), dtype=np.float32) for i in range(len(comms))]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, data, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    want = float(sum(range(1, len(comms) + 1)))
    assert all((array == want).all() for array in data)
    late = cluster.communicator("late")
    everyone = await form_run(comms, [late])
    assert {c.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) for c in everyone} == {len(comms) + 1}
    for comm in everyone:
        await comm.aclose()


async def test_a_strangers_vote_with_a_duplicate_huge_key_is_refused_unread(
    cluster: Cluster, clock: object
) -> None:
    """Once: 2,075 bytes, no Register, and the decode error quoting the key made a kick
    too long to send, which ended the master."""
    with trio.fail_after(60):
        comms = await honest_run(cluster)
        vote = control_frame(SharedStateVote.KIND, [0, 0, [entry(NUL_KEY), entry(NUL_KEY)]])
        assert len(vote) == 2079  # 2,075 before entries carried a (here empty) digest
        reply = await exchange_raw(cluster, "stranger", vote)
        assert isinstance(reply, Kick), reply
        assert "SharedStateVote is not accepted as the first message" in reply.reason
        # Registered first, the same vote is decoded: the error is a bounded kick.
        reply = await exchange_raw(cluster, "stranger2", register_frame(), vote)
        assert isinstance(reply, Welcome), reply
        await still_serves(cluster, comms)


@pytest.mark.parametrize("host_length", [300, 4096])
async def test_a_register_with_an_impossible_host_is_refused(
    cluster: Cluster, clock: object, host_length: int
) -> None:
    """Once: a 4,096-character host quoted in a kick ended the master."""
    with trio.fail_after(60):
        comms = await honest_run(cluster)
        frame = control_frame(
            Register.KIND, [PROTOCOL_VERSION, 0, 9, "h" * host_length, 1, 0, 0, 0, 0, 0, b"", b"", False]
        )
        reply = await exchange_raw(cluster, "stranger", frame)
        assert isinstance(reply, Kick), reply
        expected = (
            "Register.advertised_host: 300 characters" if host_length == 300
            else "exceeds its 1024-byte limit"
        )
        assert expected in reply.reason and len(reply.reason) <= 1000
        await still_serves(cluster, comms)


async def test_megabyte_frames_of_tiny_entries_cost_the_sender_only(
    cluster: Cluster, clock: object
) -> None:
    """Once: three 1 MiB frames of ~150k entries blocked the master's loop for ~1 s
    each while they were built, and every peer declared the master dead."""
    with trio.fail_after(120):
        comms = await honest_run(cluster)
        flood = control_frame(SharedStateVote.KIND, [0, 0, [["a", 0, 0, 0, False]] * 140_000])
        assert 900_000 < len(flood) <= pccl.Config().max_control_frame
        for index in range(3):  # refused from the header: nothing read past it
            reply = await exchange_raw(cluster, f"unregistered{index}", flood)
            # Over TCP the kick may be lost: the master hangs up with the rest unread.
            assert reply is None or "not accepted as the first message" in reply.reason  # type: ignore[attr-defined]
        for index in range(3):  # after a Register: msgpack refuses the array in C
            reply = await exchange_raw(cluster, f"registered{index}", register_frame(), flood)
            assert isinstance(reply, Welcome), reply
        await still_serves(cluster, comms)


@pytest.mark.parametrize("network_kind", ["tcp"])  # worker threads need the real clock
async def test_votes_expensive_to_validate_are_validated_off_the_event_loop(
    cluster: Cluster, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest valid vote (65,536 entries) takes a good fraction of a second to
    validate, on the event loop a stall of the master for every peer. Several at once,
    each from a fresh registered connection, are validated in a worker thread while
    the honest peers go on reducing."""
    decoded_in: list[tuple[int, bool]] = []  # (size, on the event loop's thread)
    decode = Undecoded.decode

    def watched(frame: Undecoded) -> Message:
        decoded_in.append((len(frame.fields), threading.current_thread() is threading.main_thread()))
        return decode(frame)

    monkeypatch.setattr(Undecoded, "decode", watched)
    with trio.fail_after(120):
        comms = await honest_run(cluster)
        heavy = encode_control(
            SharedStateVote(revision=0, strategy=0, entries=tuple(
                SharedStateEntry(
                    key=f"k{i}", hash=0, dtype=0, count=0, allow_content_inequality=False
                ) for i in range(MAX_SEQUENCE)
            ))
        )

        async def flood(index: int) -> None:
            for round_ in range(2):
                reply = await exchange_raw(
                    cluster, f"heavy{index}-{round_}", register_frame(), heavy
                )
                assert isinstance(reply, Welcome), reply

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(flood, index)
            for _ in range(10):
                await still_reducing(comms)
        await still_serves(cluster, comms)
    heavy_decodes = [on_loop for size, on_loop in decoded_in if size > len(heavy) // 2]
    assert heavy_decodes and not any(heavy_decodes)
    assert any(on_loop for size, on_loop in decoded_in if size < _server.THREAD_DECODE_BYTES)


async def still_reducing(comms: list[pccl.Communicator]) -> None:
    arrays = [np.ones(1 << 12, dtype=np.float32) for _ in comms]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    assert all((a == len(comms)).all() for a in arrays)


class _FailingCore(MasterCore):
    """A core with a bug: it raises on a Register for peer group 666."""

    def handle(self, event, now):  # type: ignore[no-untyped-def]
        if isinstance(event, MessageReceived) and isinstance(event.message, Register):
            if event.message.peer_group == 666:
                raise RuntimeError("a bug in the core")
        return super().handle(event, now)


@pytest.fixture
def failing_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_server, "MasterCore", _FailingCore)


async def test_a_failure_handling_one_connection_drops_only_it(
    failing_core: None, cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await honest_run(cluster)
        reply = await exchange_raw(cluster, "unlucky", register_frame(peer_group=666))
        assert isinstance(reply, Kick), reply
        assert "the master could not handle its message" in reply.reason
        await still_serves(cluster, comms)


async def test_connections_that_never_speak_are_capped(cluster: Cluster, clock: object) -> None:
    """Past ``MAX_NEW_CONNECTIONS`` silent connections, more are closed at once; the
    silent ones are dropped at the liveness timeout and joining works again."""
    with trio.fail_after(120):
        comms = await honest_run(cluster)
        host, port = cluster.master_address.rsplit(":", 1)
        silent = [
            await cluster.network(f"silent{i}").connect(host, int(port))
            for i in range(_server.MAX_NEW_CONNECTIONS)
        ]
        extra = await cluster.network("extra").connect(host, int(port))
        assert await extra.receive_some(1 << 16) == b""  # closed at once, nothing said
        await extra.aclose()
        for stream in silent:  # each is kicked for its silence, then closed
            while await stream.receive_some(1 << 16):
                pass
            await stream.aclose()
        await still_serves(cluster, comms)
