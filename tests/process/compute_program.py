"""A peer process that computes inline between two all-reduces. Prints JSON lines.

Joins a run of ``--world`` peers, all-reduces once, then (with ``--block``) blocks its
event loop with ``time.sleep``, as a trainer's forward and backward pass would, and
all-reduces again. ``--no-keepalive`` switches the master link's keepalive thread off.
Stays until a line arrives on stdin.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np
import trio

import pccl_trio as pccl
from pccl_trio.testing import PeerSeam


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def reduce(comm: pccl.Communicator, value: float) -> float:
    data = np.full(1024, value, dtype=np.float32)
    await comm.all_reduce(data)
    return float(data[0])


async def main(args: argparse.Namespace) -> None:
    comm = pccl.Communicator(args.master, 0, p2p_host="127.0.0.1")
    PeerSeam(comm).keepalive = not args.no_keepalive
    try:
        await comm.connect()
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < args.world:
            await comm.update_topology()
        rank = comm.ring.index(comm.peer_id)
        emit(event="first", sum=await reduce(comm, rank + 1))
        if args.block:
            started = time.monotonic()
            time.sleep(args.block)  # noqa: ASYNC251 - the point: the loop blocks
            emit(event="blocked", seconds=time.monotonic() - started)
        emit(event="second", sum=await reduce(comm, rank + 1),
             world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE))
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
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--block", type=float, default=0.0)
    parser.add_argument("--no-keepalive", action="store_true")
    trio.run(main, parser.parse_args())
