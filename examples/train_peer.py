"""One peer of the demo's training run: a small softmax classifier on synthetic data,
data-parallel, gradients averaged with ``all_reduce`` every step; the ring is re-ordered
by ``optimize_topology`` whenever peers were admitted.

The weights and the step counter are the run's shared state. Every step begins with a
shared-state sync: a peer that joins mid-run (with zeroed weights) receives the current
weights and step from the others there; after that every peer applies the same averaged
gradient in place, so all hold bit-identical weights and every sync moves 0 bytes. A
peer that dies mid-step makes the all-reduce abort for everyone; the survivors start the
step over at its sync. The loop is the hand-written loop of docs/loop.md (a peer alone waits for
company without polling; a failed sync is made again; a kick joins again). Prints one
JSON line per event for ``examples/demo.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal

import numpy as np
import trio

import pccl_trio as pccl

FEATURES, CLASSES = 32, 4
WEIGHTS = FEATURES * CLASSES + CLASSES


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def make_data(seed: int, n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """A shard of a fixed linearly separable problem (the same truth for every peer)."""
    truth = np.random.default_rng(0).normal(size=(FEATURES, CLASSES))
    x = np.random.default_rng(seed).normal(size=(n, FEATURES))
    return x.astype(np.float32), np.argmax(x @ truth, axis=1)


def loss_and_gradient(params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    w = params[: FEATURES * CLASSES].reshape(FEATURES, CLASSES)
    b = params[FEATURES * CLASSES :]
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-9).mean())
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    grad = np.concatenate([(x.T @ p).ravel(), p.sum(axis=0)]).astype(np.float32)
    return loss, grad


async def train(master: str, seed: int, steps: int, step_seconds: float) -> None:
    """The hand-written loop of docs/loop.md, with the demo's model and a line per event."""
    x, y = make_data(seed)
    params = np.zeros(WEIGHTS, dtype=np.float32)  # the same start everywhere
    step = np.zeros(1, dtype=np.int64)
    state = pccl.SharedState([pccl.TensorInfo("params", params), pccl.TensorInfo("step", step)])
    config = pccl.Config(liveness_timeout=3.0)
    while step[0] < steps:
        async with pccl.Communicator(master, 0, config=config, p2p_host="127.0.0.1") as comm:
            emit(event="joined", peer=comm.peer_id)
            await train_in_run(comm, state, x, y, steps, step_seconds)
    emit(event="finished", step=int(step[0]))


async def train_in_run(
    comm: pccl.Communicator, state: pccl.SharedState, x: np.ndarray, y: np.ndarray,
    steps: int, step_seconds: float,
) -> None:
    """Steps with one communicator; returns when this peer must join again."""
    params, step = (tensor.data for tensor in state.tensors)
    # connect() returned at the end of an update_topology of the others: a joiner's
    # first call is the one that follows it, not another pending query.
    joined, resync, stepped = True, False, False
    while step[0] < steps:
        try:
            if not resync:
                alone = world(comm) < 2
                if alone and not joined:
                    emit(event="waiting", peer=comm.peer_id, step=int(step[0]))
                # Alone: the master answers once a peer asks to join (no polling).
                if joined or await comm.are_peers_pending(wait=math.inf if alone else 0):
                    if not joined:
                        await comm.update_topology()
                    joined = False
                    # Every peer re-orders the ring after admitting someone (a joiner's
                    # first call): only the newcomers' links are measured.
                    await comm.optimize_topology()
                    if comm.topology is not None:
                        emit(event="optimized", peer=comm.peer_id, ring=list(comm.ring),
                             predicted_ms=round(comm.topology.predict(4 * WEIGHTS) * 1e3, 3))
                if world(comm) < 2:
                    continue
            resync = False
            # A joiner receives the weights, the step and the revision here; between
            # peers that stepped together nothing moves.
            synced = await comm.sync_shared_state(state)
            if synced.rx_bytes or synced.tx_bytes:
                emit(event="synced", peer=comm.peer_id, step=int(step[0]), world=world(comm),
                     rx=synced.rx_bytes, tx=synced.tx_bytes)
            loss, grad = loss_and_gradient(params, x, y)
            info = await comm.all_reduce(grad, op=pccl.ReduceOp.AVG, tag=0)
        except (pccl.CollectiveAborted, pccl.SharedStateSyncFailed) as exc:
            emit(event="aborted", peer=comm.peer_id, step=int(step[0]), reason=str(exc))
            resync = True  # the step starts over at its sync, at the same revision
            continue
        except (pccl.TooFewPeers, pccl.UpdateTopologyFailed, pccl.TopologyOptimizationFailed):
            continue  # the step starts over from the top
        except pccl.Kicked as exc:
            if not stepped:
                raise
            emit(event="error", kind=type(exc).__name__, message=f"{exc}; joining again")
            state.revision = 0  # a newcomer: its first sync brings the run's state
            return
        params -= np.float32(0.5) * grad  # in place: the shared state's memory
        step += 1
        state.revision += 1
        stepped = True
        emit(event="step", peer=comm.peer_id, step=int(step[0]), world=info.world_size,
             loss=round(loss, 4),
             weights=hashlib.sha256(params.tobytes()).hexdigest()[:12])
        await trio.sleep(step_seconds)  # stands in for a bigger model's compute


def world(comm: pccl.Communicator) -> int:
    return comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)


async def main(master: str, seed: int, steps: int, step_seconds: float) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop)
            try:
                await train(master, seed, steps, step_seconds)
            except pccl.PCCLError as exc:
                emit(event="error", kind=type(exc).__name__, message=str(exc))
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("master", help="HOST:PORT of the master")
    parser.add_argument("--seed", type=int, default=1, help="selects this peer's data shard")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()
    trio.run(main, args.master, args.seed, args.steps, args.step_seconds)
