"""Fuzzing the master's and a peer's p2p port over the network (both networks, and a run
with a secret): hundreds of connections of seeded random input, none of which may end
or freeze the master or a peer. Afterwards the run still admits a new peer and its
all-reduces are exact.

The input mixes what a parser meets in the wild: random bytes, frames of every kind
with random msgpack bodies, valid messages with flipped bits or cut short, lengths
announcing gigabytes, data frames with random headers, and (for a run with a secret)
handshake hellos followed by anything.
"""

from __future__ import annotations

import random
import struct

import msgpack
import numpy as np
import trio

import pccl_trio as pccl
from pccl_trio._core.channel import ClientHandshake, Purpose
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    BenchmarkRequest,
    Heartbeat,
    P2PHello,
    Register,
    message_kinds,
)
from pccl_trio._core.wire import DATA_HEADER, encode_control
from pccl_trio.testing import PeerSeam

from .conftest import Cluster, form_run

CONNECTIONS = 120
KINDS = sorted(message_kinds())


def random_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(7 if depth < 3 else 5)
    if choice == 0:
        return rng.randrange(-(1 << 40), 1 << 64)
    if choice == 1:
        return "".join(rng.choice("ab:.9\x00é") for _ in range(rng.randrange(0, 40)))
    if choice == 2:
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 3:
        return rng.choice([None, True, False, 1.5, float("nan")])
    if choice == 4:
        return rng.randrange(0, 300)
    if choice == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(i): random_value(rng, depth + 1) for i in range(rng.randrange(0, 3))}


def control(kind: int, body: bytes, length: int | None = None) -> bytes:
    size = 3 + len(body) if length is None else length
    return struct.pack(">IBH", size, 1, kind) + body


def valid_messages() -> list[bytes]:
    return [
        encode_control(Register(protocol_version=PROTOCOL_VERSION, peer_group=0, p2p_port=9)),
        encode_control(Heartbeat()),
        encode_control(P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=1, slot=0)),
        encode_control(BenchmarkRequest(
            protocol_version=PROTOCOL_VERSION, peer_id=1, nbytes=1 << 20, frame_bytes=1 << 16)),
    ]


def fuzz_input(rng: random.Random, secret: bytes | None) -> bytes:
    """One connection's bytes."""
    parts: list[bytes] = []
    if secret is not None and rng.random() < 0.5:
        parts.append(ClientHandshake(secret if rng.random() < 0.5 else b"x" * 32,
                                     rng.choice(list(Purpose))).hello())
    for _ in range(rng.randrange(1, 5)):
        pick = rng.randrange(7)
        if pick == 0:
            parts.append(rng.randbytes(rng.randrange(1, 200)))
        elif pick == 1:
            body = msgpack.packb(random_value(rng), use_bin_type=True)
            parts.append(control(rng.choice(KINDS + [0, 999, 65535]), body))
        elif pick == 2:
            frame = bytearray(rng.choice(valid_messages()))
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
            parts.append(bytes(frame))
        elif pick == 3:
            frame = rng.choice(valid_messages())
            parts.append(frame[: rng.randrange(1, len(frame))])
        elif pick == 4:
            parts.append(control(rng.choice(KINDS), b"", length=rng.choice([1 << 31, 0xFFFFFFFF, 0])))
        elif pick == 5:
            nbytes = rng.randrange(0, 64)
            parts.append(DATA_HEADER.pack(
                rng.choice([29 + nbytes, rng.randrange(1 << 32)]), 2, rng.randrange(1 << 64),
                rng.randrange(1 << 64), rng.randrange(1 << 64), nbytes) + rng.randbytes(nbytes))
        else:
            parts.append(rng.choice(valid_messages()))
    return b"".join(parts)


async def pour(cluster: Cluster, host: str, address: tuple[str, int], data: bytes) -> None:
    """Send ``data`` and read whatever comes back until the other side closes, or give
    up after a while (a port may rightly wait for more bytes)."""
    stream = await cluster.network(host).connect(*address)
    with trio.move_on_after(2 * cluster.config.connect_timeout):
        try:
            await stream.send_all(data)
            while await stream.receive_some(1 << 16):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


async def exact_all_reduce(comms: list[pccl.Communicator]) -> None:
    arrays = [np.arange(5_000, dtype=np.float64) * (i + 1) for i in range(len(comms))]
    async with trio.open_nursery() as nursery:
        for comm, array in zip(comms, arrays, strict=True):
            nursery.start_soon(comm.all_reduce, array)
    factor = sum(range(1, len(comms) + 1))
    for array in arrays:
        assert array.tobytes() == (np.arange(5_000, dtype=np.float64) * factor).tobytes()


async def test_fuzzed_ports_cost_the_run_nothing(cluster: Cluster, clock: object) -> None:
    rng = random.Random(14)
    secret = cluster.config.secret
    connections = CONNECTIONS if cluster.memory is not None else CONNECTIONS // 4
    with trio.fail_after(300):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        host, port = cluster.master_address.rsplit(":", 1)
        master = (host, int(port))
        p2p_host, p2p_port = PeerSeam(comms[0]).p2p_address
        peer = ("127.0.0.1" if cluster.memory is None else p2p_host, p2p_port)
        async with trio.open_nursery() as nursery:
            for index in range(connections):
                target = master if index % 2 == 0 else peer
                nursery.start_soon(pour, cluster, f"fuzz{index % 7}", target, fuzz_input(rng, secret))
                if index % 16 == 15:
                    await exact_all_reduce(comms)  # the run goes on meanwhile
        comms = await form_run(comms, [cluster.communicator("late")])
        await exact_all_reduce(comms)
        for comm in comms:
            await comm.aclose()
