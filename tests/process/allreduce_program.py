"""A peer process for the all-reduce process tests. Prints JSON lines.

Modes:
  matrix  every dtype x op x size, in place and into recv; prints a digest per case.
  kill    one big all-reduce that a peer is killed during; prints the verdict, whether
          the input survived, then (after update_topology) the retry's correctness.
  retry   all_reduce_multiple_with_retry over several tensors; prints their digests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys

import ml_dtypes
import numpy as np
import trio

import pccl_trio as pccl

DTYPES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "bfloat16", "float32", "float64"]


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()[:16]


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


async def join(comm: pccl.Communicator, world: int) -> None:
    await comm.connect()
    while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
        await comm.update_topology()
    emit(event="ready", peer=comm.peer_id, rank=comm.ring.index(comm.peer_id))


async def matrix(comm: pccl.Communicator, world: int, seed: int) -> None:
    rank = comm.ring.index(comm.peer_id)
    for name in DTYPES:
        for op in pccl.ReduceOp:
            for count in (1, 3, 1025, 100003):
                for in_place in (True, False):
                    rng = np.random.default_rng([seed, rank, count])
                    send = rng.integers(1, 4, size=count).astype(dtype_of(name))
                    original = send.copy()
                    recv = None if in_place else np.zeros_like(send)
                    info = await comm.all_reduce(send, recv, op=op, tag=1)
                    result = send if in_place else recv
                    assert result is not None
                    emit(event="case", dtype=name, op=op.name, count=count, in_place=in_place,
                         digest=digest(result), input=digest(original),
                         untouched=in_place or digest(send) == digest(original),
                         tx=info.tx_bytes, rx=info.rx_bytes,
                         values=result[:3].astype(np.float64).tolist())
    emit(event="done")


async def off_loop(work, *args):
    """Big array work (filling, hashing 256 MiB) in a worker thread: on the trio thread
    it would stop this peer's heartbeats for seconds on a loaded machine, and the
    master would rightly declare it dead."""
    return await trio.to_thread.run_sync(work, *args)


def fill(count: int, value: float, dtype: type = np.float32) -> np.ndarray:
    return np.full(count, value, dtype=dtype)


def summary(data: np.ndarray) -> tuple[float, bool, str]:
    return float(data[0]), bool((data == data[0]).all()), digest(data)


async def kill_target(comm: pccl.Communicator, megabytes: int) -> None:
    rank = comm.ring.index(comm.peer_id)
    count = megabytes * (1 << 20) // 4
    data = await off_loop(fill, count, float(rank + 1))
    original = await off_loop(digest, data)
    emit(event="begin")
    try:
        await comm.all_reduce(data)
        emit(event="verdict", outcome="success", digest=await off_loop(digest, data))
    except pccl.CollectiveAborted as exc:
        emit(event="verdict", outcome="aborted",
             restored=await off_loop(digest, data) == original, message=str(exc))
        await comm.update_topology()
        data = await off_loop(fill, count, float(rank + 1))
        await comm.all_reduce(data)
        first, uniform, result = await off_loop(summary, data)
        emit(event="retry", world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE),
             first=first, uniform=uniform, digest=result)


async def retry(comm: pccl.Communicator, tensors: int, megabytes: int) -> None:
    rank = comm.ring.index(comm.peer_id)
    count = megabytes * (1 << 20) // 8
    arrays = [await off_loop(fill, count, float(10 ** rank + t), np.float64)
              for t in range(tensors)]
    emit(event="begin")
    await comm.all_reduce_multiple_with_retry(arrays, max_in_flight=4)
    summaries = [await off_loop(summary, a) for a in arrays]
    emit(event="retried", world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE),
         firsts=[s[0] for s in summaries], uniform=[s[1] for s in summaries],
         digests=[s[2] for s in summaries])


async def main(args: argparse.Namespace) -> None:
    config = pccl.Config(liveness_timeout=5.0, heartbeat_interval=0.25)
    comm = pccl.Communicator(args.master, 0, args.pool, config=config, p2p_host="127.0.0.1")
    try:
        await join(comm, args.world)
        if args.mode == "matrix":
            await matrix(comm, args.world, args.seed)
        elif args.mode == "kill":
            await kill_target(comm, args.megabytes)
        else:
            await retry(comm, args.tensors, args.megabytes)
        # Stay until told to go, so no peer leaves while others still work.
        await trio.wrap_file(sys.stdin).readline()
    except pccl.PCCLError as exc:
        emit(event="error", kind=type(exc).__name__, message=str(exc))
    finally:
        await comm.aclose()


if __name__ == "__main__":
    # To stderr, which the tests keep and print when they fail.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("mode", choices=["matrix", "kill", "retry"])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--pool", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=8)
    trio.run(main, parser.parse_args())
