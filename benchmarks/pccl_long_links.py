"""Real PCCL (PyPI ``pypccl`` 1.0.0) over the WAN emulator, next to its ceiling.

Usage (as root, with iproute2 and /dev/net/tun, after
``../shared/bench/run_pccl.sh --setup-only`` prepared PCCL's environment):
    python benchmarks/pccl_long_links.py [--world 3] [--sizes 64M] [--rtt 0.1]
        [--rate 1gbit] [--pools 1,8] [--iters 3] [--warmup 1] [--json FILE]

The same emulator and method as ``long_links.py``: ``--world`` peer hosts and one for
the master, every path ``--rtt``/2 one way, uploads shaped to ``--rate``, MTU 65000;
the ceiling is plain TCP in the ring's pattern, 16 streams per host, measured first;
then, per ``--pools`` value (PCCL's ``p2p_connection_pool_size``, fixed per
communicator), one launch of a PCCL master and ``--world`` peers, which time
``all_reduce(send, recv, SUM)`` of float32 arrays as PCCL's own anchor benchmark does
(``../shared/bench/pccl_allreduce.py``): a barrier (a 16-value all-reduce) before each
timed call, the slowest peer's time, the median of ``--iters`` after ``--warmup``,
checked against the exact sum first. busbw is S x 2(W-1)/W over the time.

PCCL runs under its own interpreter (``python-pccl`` from run_pccl.sh's venv, CPython
3.12 with Debian trixie's libraries); this script drives it from this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pccl_trio._bench import format_size, parse_size
from pccl_trio.testing import Wan, WanPlan, wan_available

PORT = 48150
ANCHOR_HOME = Path(os.environ.get("PCCL_ANCHOR_HOME", Path.home() / ".cache" / "pccl-anchor"))

MASTER = r"""
import sys, pccl
master = pccl.MasterNode(listen_address=sys.argv[1])
master.run()
print("MASTER_READY", flush=True)
sys.stdin.read()
master.interrupt()
"""

PEER = r"""
import json, os, sys, time
import numpy as np
import pccl
from pccl import Communicator, ReduceOp

master, sizes = sys.argv[1], sys.argv[4]
world, pool, iters, warmup = (int(sys.argv[i]) for i in (2, 3, 5, 6))
comm = Communicator(master, 0, pool)
comm.connect(n_attempts=30)
while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
    if comm.are_peers_pending():
        comm.update_topology()
    else:
        time.sleep(0.01)
rank = int(os.environ["RANK"])
bar_s, bar_r = np.zeros(16), np.zeros(16)
out = {}
for size in map(int, sizes.split(",")):
    n = size // 4
    send = (np.arange(n, dtype=np.float32) % 1024) + rank
    recv = np.zeros(n, dtype=np.float32)
    for _ in range(warmup + 1):
        comm.all_reduce(send, recv, op=ReduceOp.SUM)
    expected = (np.arange(n, dtype=np.float32) % 1024) * world + sum(range(world))
    ok = bool((recv == expected).all())
    times = []
    for _ in range(iters):
        comm.all_reduce(bar_s, bar_r, op=ReduceOp.MAX)
        start = time.perf_counter()
        comm.all_reduce(send, recv, op=ReduceOp.SUM)
        bar_s[:] = time.perf_counter() - start
        comm.all_reduce(bar_s, bar_r, op=ReduceOp.MAX)
        times.append(float(bar_r[0]))
    out[size] = {"ok": ok, "times": times}
comm.all_reduce(bar_s, bar_r, op=ReduceOp.MAX)
print(json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)
"""


def launch(wan: Wan, python: str, world: int, pool: int, sizes: list[int], iters: int,
           warmup: int, timeout: float) -> dict[int, Any]:
    """One PCCL master and ``world`` peers: rank 0's results, by size."""
    address = f"{wan.address(world)}:{PORT}"
    master = wan.start(world, python, "-c", MASTER, address, stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
    peers: list[subprocess.Popen[str]] = []
    try:
        assert master.stdout is not None
        if "MASTER_READY" not in master.stdout.readline():
            raise RuntimeError("the PCCL master did not start")
        for rank in range(world):
            peers.append(wan.start(
                rank, python, "-c", PEER, address, str(world), str(pool),
                ",".join(map(str, sizes)), str(iters), str(warmup),
                env=dict(os.environ, RANK=str(rank)), stdout=subprocess.PIPE, text=True,
            ))
        outputs = [p.communicate(timeout=timeout)[0] for p in peers]
        lines = [line for line in outputs[0].splitlines() if line.startswith("{")]
        if len(lines) != 1:
            raise RuntimeError(f"PCCL peer 0 printed no result: {outputs[0][-500:]!r}")
        return {int(k): v for k, v in json.loads(lines[0]).items()}
    finally:
        for process in peers:
            process.kill()
            process.wait()
        if master.stdin is not None:
            master.stdin.close()
        master.kill()
        master.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--sizes", default="64M")
    parser.add_argument("--rtt", type=float, default=0.1)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--pools", default="1,8")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--python", default=str(ANCHOR_HOME / "venv" / "bin" / "python-pccl"),
                        help="an interpreter that imports pccl (run_pccl.sh's launcher)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not wan_available():
        print("needs root, iproute2 and /dev/net/tun", file=sys.stderr)
        return 2
    if not Path(args.python).exists():
        print(f"no PCCL interpreter at {args.python}: run ../shared/bench/run_pccl.sh "
              "--setup-only first", file=sys.stderr)
        return 2
    world, sizes = args.world, [parse_size(s) for s in args.sizes.split(",")]
    plan = WanPlan(hosts=world + 1, delay=args.rtt / 2, rate=args.rate)
    rows = []
    with Wan(plan) as wan:
        ring = [(i, (i + 1) % world) for i in range(world)]
        ceiling = min(wan.ceiling(ring)) * 8
        print(f"# W={world}, every path {args.rtt * 1e3:g} ms RTT, uploads {args.rate}, MTU "
              f"{plan.mtu}; ceiling (plain TCP, ring pattern, 16 streams) "
              f"{ceiling / 1e6:.0f} Mbit/s", flush=True)
        for pool in (int(p) for p in args.pools.split(",")):
            result = launch(wan, args.python, world, pool, sizes, args.iters, args.warmup,
                            args.timeout)
            for size in sizes:
                if not result[size]["ok"]:
                    raise RuntimeError(f"PCCL's sum was wrong: pool {pool}, {size} bytes")
                median = statistics.median(result[size]["times"])
                rate = size * 2 * (world - 1) / world / median * 8
                rows.append({"pool": pool, "size": size, "median_s": median,
                             "busbw_bits": rate, "of_ceiling": rate / ceiling,
                             "times": result[size]["times"]})
                print(f"PCCL pool={pool:<3} {format_size(size):>8} {median:7.3f} s "
                      f"{rate / 1e6:7.0f} Mbit/s {rate / ceiling:5.0%} of the ceiling",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps({"world": world, "rtt": args.rtt, "rate": args.rate,
                                         "ceiling_bits": ceiling, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
