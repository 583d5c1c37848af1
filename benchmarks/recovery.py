"""Recovery after a peer dies mid-all-reduce: SIGKILL one of W peers in the middle of
an all-reduce and time, from the kill, until every survivor has finished its first
successful all-reduce of the new world.

Usage: python benchmarks/recovery.py [--world 3] [--megabytes 64] [--repeats 5]

Each repeat starts a master and W peer processes on loopback. The peers all-reduce
in a loop (retrying after an abort, as a trainer would); the driver SIGKILLs one peer
a random fraction into an all-reduce, and the survivors report (CLOCK_MONOTONIC is
shared by processes on one machine) when their first good all-reduce of the smaller
world completes. Prints each repeat and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, sys, time
import numpy as np, trio
import pccl_trio as pccl

async def main(master, world, megabytes):
    config = pccl.Config(liveness_timeout=5.0, heartbeat_interval=0.25)
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        data = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
        while True:
            data.fill(1.0)
            print(json.dumps({"event": "begin", "t": time.monotonic()}), flush=True)
            try:
                info = await comm.all_reduce(data)
            except pccl.CollectiveAborted:
                print(json.dumps({"event": "aborted", "t": time.monotonic()}), flush=True)
                continue
            print(json.dumps({"event": "ok", "t": time.monotonic(), "world": info.world_size,
                              "value": float(data[0])}), flush=True)
            if info.world_size < world:
                return

trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


def read_json(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("a peer exited unexpectedly")
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]


def one_repeat(world: int, megabytes: int, rng: random.Random) -> tuple[float, float, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    master = subprocess.Popen(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0",
         "--log-level", "ERROR", "--liveness-timeout", "5", "--heartbeat-interval", "0.25"],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    peers: list[subprocess.Popen[str]] = []
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        peers = [
            subprocess.Popen([sys.executable, "-c", WORKER, address, str(world), str(megabytes)],
                             stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(world)
        ]
        # Warm up: two good all-reduces, timing the second.
        durations = []
        for _ in range(2):
            starts = [read_json(p) for p in peers]
            ends = [read_json(p) for p in peers]
            durations.append(max(float(e["t"]) for e in ends) - min(float(s["t"]) for s in starts))
        op_time = durations[-1]
        for p in peers:
            read_json(p)  # the next "begin"
        time.sleep(rng.uniform(0.2, 0.8) * op_time)
        victim = peers.pop(rng.randrange(world))
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        recovered = []
        aborted = [killed_at]
        for p in peers:
            while True:
                record = read_json(p)
                if record["event"] == "aborted":
                    aborted.append(float(record["t"]))  # type: ignore[arg-type]
                if record["event"] == "ok" and int(record["world"]) == world - 1:  # type: ignore[call-overload]
                    recovered.append(float(record["t"]))  # type: ignore[arg-type]
                    break
        return max(recovered) - killed_at, max(aborted) - killed_at, op_time
    finally:
        for p in peers:
            p.kill()
            p.wait()
        master.terminate()
        master.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    for repeat in range(args.repeats):
        recovery, aborted, op_time = one_repeat(args.world, args.megabytes, rng)
        results.append(recovery)
        print(f"repeat {repeat}: kill -> first good all-reduce of the new world on every "
              f"survivor: {recovery * 1e3:.1f} ms (the abort reached the last survivor's caller "
              f"after {aborted * 1e3:.1f} ms; one all-reduce of the old world takes "
              f"{op_time * 1e3:.1f} ms)", flush=True)
    print(f"median over {args.repeats}: {statistics.median(results) * 1e3:.1f} ms "
          f"(W={args.world} -> {args.world - 1}, {args.megabytes} MiB float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
