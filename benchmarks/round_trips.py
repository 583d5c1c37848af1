"""How many one-way trips each call costs over a long link: every call of a training
loop, timed on the WAN emulator, in units of the path's one-way delay.

Usage (as root, with iproute2 and /dev/net/tun):
    python benchmarks/round_trips.py [--world 3] [--one-way 0.1] [--repeats 3]

The emulator has ``--world`` peer hosts and one for the master, every path
``--one-way`` seconds each way (long, so that trips dominate and count themselves),
uploads unshaped. Every peer makes the same calls in the same order, each timed on
every peer; a call's cost is the least time any peer took (the last peer to start it
waits for nobody), printed in seconds and in one-way trips (time / one-way delay,
rounded to a tenth: the rest is local work and the transfer of tiny payloads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from pccl_trio.testing import Wan, WanPlan, wan_available

SMALL = 1  # float32 values of the small all-reduces


async def peer(master: str, host: str, world: int, repeats: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    timings: dict[str, list[float]] = {}

    async def timed(name: str, call: Any) -> Any:
        start = time.perf_counter()
        result = await call
        timings.setdefault(name, []).append(time.perf_counter() - start)
        return result

    config = pccl.Config(insecure=True, liveness_timeout=20.0, heartbeat_interval=2.0,
                         connect_timeout=20.0)
    comm = pccl.Communicator(master, 0, config=config, p2p_host=host)
    await timed("connect (the least: the first peer, alone)", comm.connect())
    while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
        await comm.update_topology()
    state = pccl.SharedState([pccl.TensorInfo("w", np.zeros(16, np.float32))])
    small = np.ones(SMALL, np.float32)
    for _ in range(repeats):
        await timed("are_peers_pending(wait=0)", comm.are_peers_pending())
        await timed("update_topology (nobody waiting)", comm.update_topology())
        await timed("sync_shared_state (nothing to fetch)", comm.sync_shared_state(state))
        state.revision += 1
        await timed("all_reduce, 4 bytes, first of its tag (via the master)",
                    comm.all_reduce(small, tag=7))
        for _ in range(2):
            await timed("all_reduce, 4 bytes, under a lease", comm.all_reduce(small, tag=7))
        await timed("optimize_topology (links measured before)", comm.optimize_topology())
    print(json.dumps(timings), flush=True)
    await comm.aclose()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        import trio

        master, host, world, repeats = argv[1:]
        trio.run(peer, master, host, int(world), int(repeats))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--one-way", type=float, default=0.1, help="seconds each way on every path")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not wan_available():
        print("needs root, iproute2 and /dev/net/tun", file=sys.stderr)
        return 2
    world = args.world
    with Wan(WanPlan(hosts=world + 1, delay=args.one_way, rate=None)) as wan:
        master, address = wan.start_master(world, "--liveness-timeout", "20",
                                           "--heartbeat-interval", "2")
        peers = [wan.start(i, sys.executable, __file__, "peer", address, wan.address(i),
                           str(world), str(args.repeats), stdout=subprocess.PIPE, text=True,
                           stderr=subprocess.DEVNULL)
                 for i in range(world)]
        results = [json.loads(p.communicate(timeout=600)[0]) for p in peers]
        master.terminate()
        master.wait()
    print(f"# W={world}, every path {args.one_way * 1e3:g} ms one way; the least time any "
          f"peer took, median over {args.repeats} repeats")
    print(f"{'call':<58} {'seconds':>8} {'one-way trips':>14}")
    for name in results[0]:
        least = [min(r[name][i] for r in results) for i in range(len(results[0][name]))]
        seconds = statistics.median(least)
        print(f"{name:<58} {seconds:8.3f} {seconds / args.one_way:14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
