"""One peer of the demo's training run: a small softmax classifier on synthetic data,
data-parallel, gradients averaged with ``all_reduce`` every step.

Every peer starts from the same weights and applies the same averaged gradient, so
all peers hold bit-identical weights at every step. A peer that joins mid-run gets
the current weights from the others with one MAX all-reduce (it contributes -inf).
A peer that dies mid-step makes the all-reduce abort for everyone; the survivors
retry the step. Prints one JSON line per event for ``examples/demo.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
    x, y = make_data(seed)
    params = np.zeros(WEIGHTS, dtype=np.float32)  # the same start everywhere
    step = 0
    config = pccl.Config(liveness_timeout=3.0)
    async with pccl.Communicator(master, 0, config=config, p2p_host="127.0.0.1") as comm:
        emit(event="joined", peer=comm.peer_id)
        known: set[int] = set()
        while step < steps:
            if known and await comm.are_peers_pending():
                await comm.update_topology()
            ring = set(comm.ring)
            if ring - known:
                # Someone (maybe us) is new: bring them to the others' weights and
                # step. Existing peers all hold the same values; a newcomer offers
                # -inf, so MAX hands everyone exactly the current state.
                state = np.append(params, np.float32(step))
                if not known:
                    state[:] = -np.inf
                try:
                    await comm.all_reduce(state, op=pccl.ReduceOp.MAX, tag=1)
                except pccl.CollectiveAborted:
                    continue  # someone died meanwhile: the next pass sorts it out
                except pccl.TooFewPeers:
                    pass  # alone: our own state is the run's state
                else:
                    params, step = state[:-1].copy(), int(state[-1])
                emit(event="synced", peer=comm.peer_id, step=step, world=len(ring))
            known = ring
            if len(ring) < 2:
                await trio.sleep(step_seconds)  # alone: wait for company
                continue
            loss, grad = loss_and_gradient(params, x, y)
            try:
                info = await comm.all_reduce(grad, op=pccl.ReduceOp.AVG, tag=0)
            except pccl.CollectiveAborted as exc:
                emit(event="aborted", peer=comm.peer_id, step=step, reason=str(exc)[:120])
                continue  # the ring was rebuilt without the dead peer: retry the step
            params -= np.float32(0.5) * grad
            step += 1
            emit(event="step", peer=comm.peer_id, step=step, world=info.world_size,
                 loss=round(loss, 4),
                 weights=hashlib.sha256(params.tobytes()).hexdigest()[:12])
            await trio.sleep(step_seconds)  # stands in for a bigger model's compute
        emit(event="finished", peer=comm.peer_id, step=step)


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
