"""A peer process for the shared-state process tests: a founder holding a known state, or
a joiner with zeros; prints one JSON line per event.

Usage: shared_state_program.py MASTER founder|joiner --founders N --megabytes M
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging

import numpy as np
import trio

import pccl_trio as pccl
from pccl_trio.peer import _shared_state as sharing


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def state(megabytes: int, *, zero: bool) -> pccl.SharedState:
    count = megabytes * (1 << 20) // 4 // 2
    tensors = []
    for i in range(2):
        array = np.zeros(count, dtype=np.float32)
        if not zero:
            array[:] = np.arange(count, dtype=np.float32) * np.float32(1e-3) + np.float32(i)
        tensors.append(pccl.TensorInfo(f"t{i}", array))
    return pccl.SharedState(tensors, revision=0)


def digest(s: pccl.SharedState) -> str:
    h = hashlib.sha256()
    for t in s.tensors:
        h.update(t.data.tobytes())
    return h.hexdigest()[:16]


def announce_serving() -> None:
    """Print one line when this peer first sends shared-state bytes (from any thread)."""
    original = sharing.Serving.sent
    said: list[bool] = []

    def sent(self: sharing.Serving, nbytes: int) -> None:
        original(self, nbytes)
        if not said:
            said.append(True)
            emit(event="serving")

    sharing.Serving.sent = sent  # type: ignore[method-assign]


async def main(master: str, role: str, founders: int, megabytes: int) -> None:
    sharing.PIECE_BYTES = 4 << 20  # many pieces: a death lands mid-transfer
    sharing.FRAME_BYTES = 1 << 20
    announce_serving()
    config = pccl.Config(liveness_timeout=2.0, heartbeat_interval=0.2)
    async with pccl.Communicator(master, 0, config=config, p2p_host="127.0.0.1") as comm:
        if role == "founder":
            s = state(megabytes, zero=False)
            while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < founders:
                await comm.update_topology()
            await comm.sync_shared_state(s)
            emit(event="ready", digest=digest(s))
            while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < founders + 1:
                await comm.update_topology()
            s.revision += 1
            try:
                info = await comm.sync_shared_state(s)
            except pccl.PCCLError as exc:
                emit(event="synced", ok=False, error=f"{type(exc).__name__}: {exc}")
            else:
                emit(event="synced", ok=True, tx=info.tx_bytes, revision=s.revision)
        else:
            s = state(megabytes, zero=True)
            zeros = digest(s)
            emit(event="begin", zeros=zeros)
            try:
                info = await comm.sync_shared_state(s)
            except pccl.PCCLError as exc:
                emit(event="synced", ok=False, error=f"{type(exc).__name__}: {exc}",
                     digest=digest(s), revision=s.revision, zeros=zeros)
            else:
                emit(event="synced", ok=True, rx=info.rx_bytes, digest=digest(s),
                     revision=s.revision)


if __name__ == "__main__":
    # To stderr, which the tests keep and print when they fail.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("role", choices=["founder", "joiner"])
    parser.add_argument("--founders", type=int, default=2)
    parser.add_argument("--megabytes", type=int, default=64)
    args = parser.parse_args()
    trio.run(main, args.master, args.role, args.founders, args.megabytes)
