"""A peer of the long-link tests: the README's loop, printing one JSON line per event.

Each step it syncs its shared state (a weight vector and the step's revision), then
all-reduces an exact vector (small integers in float32, so the sum is exact whatever
the order) and the same values uint8-quantized, prints both results' digests, and
moves its weights by the exact sum. Every peer of a step prints the same digests, and
a joiner's first sync brings the weights. ``--pause-at STEP`` makes it print
``in_all_reduce`` and wait inside that step's all-reduce until it is killed or the
run goes on without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math

import numpy as np
import trio

import pccl_trio as pccl

COUNT = 200_000


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()[:16]


def contribution(peer: int, step: int) -> np.ndarray:
    """This peer's exact input of ``step``: small integers, so any order sums alike."""
    rng = np.random.default_rng(peer * 1_000 + step)
    return rng.integers(-50, 50, COUNT).astype(np.float32)


async def train(master: str, host: str, world: int, steps: int, pause_at: int) -> None:
    weights = np.zeros(COUNT, dtype=np.float32)
    state = pccl.SharedState([pccl.TensorInfo("weights", weights)])
    config = pccl.Config(liveness_timeout=4.0, heartbeat_interval=0.5, connect_timeout=5.0)
    quantized = pccl.QuantizationOptions(quantized_datatype=pccl.DataType.UINT8)
    while state.revision < steps:
        async with pccl.Communicator(master, 0, config=config, p2p_host=host) as comm:
            emit(event="joined", peer=comm.peer_id)
            joined, resync, stepped = True, False, False
            while state.revision < steps:
                try:
                    if not resync:
                        # Before the first step it waits for ``world`` peers; later, only
                        # alone, for company.
                        size = comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
                        alone = size < (world if state.revision == 0 else 2)
                        if joined or await comm.are_peers_pending(wait=math.inf if alone else 0):
                            if not joined:
                                await comm.update_topology()
                            joined = False
                            await comm.optimize_topology()
                        if comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < 2:
                            continue
                    resync = False
                    synced = await comm.sync_shared_state(state)
                    if synced.rx_bytes:
                        emit(event="synced", peer=comm.peer_id, step=state.revision,
                             rx=synced.rx_bytes, weights=digest(weights))
                    exact = contribution(comm.peer_id or 0, state.revision)
                    if state.revision == pause_at:
                        emit(event="in_all_reduce", peer=comm.peer_id, step=state.revision)
                        pause_at = -1
                    info = await comm.all_reduce(exact)
                    coarse = exact.copy()
                    await comm.all_reduce(coarse, quantization=quantized, tag=1)
                except (pccl.CollectiveAborted, pccl.SharedStateSyncFailed) as exc:
                    emit(event="aborted", peer=comm.peer_id, step=state.revision, reason=str(exc))
                    resync = True
                    continue
                except (pccl.TooFewPeers, pccl.UpdateTopologyFailed,
                        pccl.TopologyOptimizationFailed):
                    continue
                except pccl.Kicked:
                    if not stepped:
                        raise
                    state.revision = 0
                    break
                weights += np.float32(1e-3) * exact
                state.revision += 1
                stepped = True
                emit(event="step", peer=comm.peer_id, step=state.revision,
                     world=info.world_size, exact=digest(exact), quantized=digest(coarse),
                     weights=digest(weights))
    emit(event="finished", weights=digest(weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("master")
    parser.add_argument("--host", required=True, help="this peer's address on the WAN")
    parser.add_argument("--world", type=int, default=2, help="peers it waits for before step 1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    trio.run(train, args.master, args.host, args.world, args.steps, args.pause_at)


if __name__ == "__main__":
    main()
