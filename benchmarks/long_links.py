"""All-reduce over long fat links: pccl_trio, Gloo and plain TCP on the WAN emulator.

Usage (as root, with iproute2 and /dev/net/tun):
    python benchmarks/long_links.py [--world 3] [--sizes 64M] [--rtt 0.1] [--rate 1gbit]
        [--pools 0,4] [--congestion system,cubic] [--topk 0,0.01] [--quantize uint8]
        [--gloo] [--repeats 3] [--iters 3] [--json FILE]

The emulator (``pccl_trio.testing.Wan``) has ``--world`` peer hosts and one more for
the master, every path ``--rtt``/2 one way, every host's upload shaped to ``--rate``,
MTU 65000. Each repeat, in one sitting and in this order, measures:

- the *ceiling*: plain TCP in the ring all-reduce's pattern (every peer host sending to
  its successor at once), 16 streams each, steady state (after 3 s), the slowest of
  the hosts: what the path carries;
- pccl_trio with each ``--pools`` value (``0``: the default configuration) and each
  ``--congestion`` choice (``Config.congestion_control``; ``system``: the hosts'
  default), through the bench driver (``pccl_trio._bench``), float32 SUM in place; with
  ``--topk``, for each fraction listed (``0``: the dense all-reduce), a Top-k
  all-reduce keeping that fraction (``--quantize uint8``: its values as codes), whose
  busbw is of the dense size it stands in for;
- with ``--gloo``, torch.distributed's Gloo, one rank per peer host.

A ring all-reduce of S bytes moves 2(W-1)/W x S bytes over every link, so its busbw
(S x 2(W-1)/W / time) is directly comparable to the ceiling's per-link rate. Prints
the medians over the repeats, and writes every figure with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pccl_trio._bench import Placement, _run_pccl, format_size, parse_size
from pccl_trio.testing import Wan, WanPlan, wan_available

GLOO_PORT = 29511


def placement(wan: Wan, world: int) -> Placement:
    """The bench's master on host ``world``, its workers on hosts ``0 .. world - 1``."""
    return Placement(
        master_prefix=tuple(wan.command(world)),
        master_listen=f"{wan.address(world)}:0",
        worker_prefixes=tuple(tuple(wan.command(i)) for i in range(world)),
        worker_hosts=tuple(wan.address(i) for i in range(world)),
    )


def run_gloo(wan: Wan, world: int, sizes: list[int], iters: int, warmup: int,
             timeout: float) -> dict[int, list[float]]:
    """One Gloo process group over the WAN: rank r on host r; times per size (max
    over ranks)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="w0")
    ranks = [
        wan.start(rank, sys.executable, __file__, "gloo-rank", str(rank), str(world),
                  f"{wan.address(0)}:{GLOO_PORT}", ",".join(map(str, sizes)), str(iters),
                  str(warmup), stdout=subprocess.PIPE, env=env)
        for rank in range(world)
    ]
    outputs = [rank.communicate(timeout=timeout)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError("a Gloo rank failed")
    return {int(size): times for size, times in json.loads(outputs[0]).items()}


def gloo_rank(rank: int, world: int, rendezvous: str, sizes: list[int], iters: int,
              warmup: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank,
                            world_size=world)
    results: dict[int, list[float]] = {}
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        times = []
        for iteration in range(warmup + iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if iteration >= warmup:
                times.append(float(elapsed[0]))
        results[size] = times
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def busbw(size: int, world: int, seconds: float) -> float:
    """Bits per second over each link of a ring all-reduce of ``size`` bytes."""
    return size * 2 * (world - 1) / world / seconds * 8


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gloo-rank"]:
        rank, world, rendezvous, sizes, iters, warmup = argv[1:]
        gloo_rank(int(rank), int(world), rendezvous, [int(s) for s in sizes.split(",")],
                  int(iters), int(warmup))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--sizes", default="64M")
    parser.add_argument("--rtt", type=float, default=0.1, help="round-trip seconds of every path")
    parser.add_argument("--rate", default="1gbit", help="every host's upload (tc's spelling)")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--mtu", type=int, default=65000,
                        help="the hosts' MTU (65000 lets the delay line carry Gbit/s; a slow "
                             "link is closer to real with 1500)")
    parser.add_argument("--pools", default="0",
                        help="comma list of p2p_connection_pool_size values (0: the default)")
    parser.add_argument("--slice-bytes", default="4M", help="Config.slice_bytes of every peer")
    parser.add_argument("--congestion", default="",
                        help="comma list of Config.congestion_control values to time pccl_trio "
                             "with (empty entry or 'system': the hosts' default), e.g. system,cubic")
    parser.add_argument("--topk", default="0",
                        help="comma list of Top-k fractions to time pccl_trio with (0: dense)")
    parser.add_argument("--quantize", default="none", choices=["none", "uint8", "uint16"],
                        help="the code dtype of the Top-k values (with --topk)")
    parser.add_argument("--gloo", action="store_true", help="also time torch.distributed's Gloo")
    parser.add_argument("--gloo-sizes", default=None,
                        help="the sizes Gloo is timed at (default: --sizes; it is slow over long links)")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a kernel setting of every host (repeatable), for experiments")
    parser.add_argument("--back-to-back", action="store_true",
                        help="time pccl_trio's all-reduces one after the other, after one "
                             "barrier, instead of a barrier before each (a training loop's "
                             "rhythm, without the barrier's own skew)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ceiling-seconds", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not wan_available():
        print("needs root, iproute2 and /dev/net/tun", file=sys.stderr)
        return 2
    world, sizes = args.world, [parse_size(s) for s in args.sizes.split(",")]
    pools = [int(p) for p in args.pools.split(",")]
    congestions = [None if c in ("", "system") else c for c in args.congestion.split(",")]
    fractions = [float(f) for f in args.topk.split(",")]
    plan = WanPlan(hosts=world + 1, delay=args.rtt / 2, rate=args.rate, loss=args.loss, mtu=args.mtu,
                   sysctls=dict(item.split("=", 1) for item in args.sysctl))
    print(f"# W={world}, every path {args.rtt * 1e3:g} ms RTT, uploads {args.rate}, MTU "
          f"{plan.mtu}, loss {args.loss}; float32 SUM in place; iters={args.iters} "
          f"warmup={args.warmup}{' back to back' if args.back_to_back else ''}; busbw in "
          "Mbit/s per link", flush=True)
    figures: dict[str, list[Any]] = {"ceiling": []}
    ring = [(i, (i + 1) % world) for i in range(world)]
    with Wan(plan) as wan:
        system_congestion = wan.run(0, "cat", "/proc/sys/net/ipv4/tcp_congestion_control",
                                    capture_output=True, text=True).stdout.strip()
        print(f"# the hosts' congestion control: {system_congestion}", flush=True)
        for repeat in range(args.repeats):
            ceiling = min(wan.ceiling(ring, seconds=args.ceiling_seconds)) * 8
            figures["ceiling"].append(ceiling)
            print(f"repeat {repeat}: ceiling {ceiling / 1e6:7.0f}", flush=True)
            for pool, congestion, topk in (
                (p, c, f) for f in fractions for c in congestions for p in pools
            ):
                run = argparse.Namespace(iters=args.iters, warmup=args.warmup, pool=pool,
                                         slice_bytes=parse_size(args.slice_bytes),
                                         into_recv=False, congestion_control=congestion,
                                         back_to_back=args.back_to_back, topk=topk,
                                         quantize=args.quantize if topk else "none",
                                         timeout=args.timeout)
                result = _run_pccl(world, sizes, run, placement(wan, world))
                what = (f"pccl pool={pool}" + (f" cc={congestion}" if congestion else "")
                        + (f" topk={topk:g}" + (f"/{args.quantize}" if args.quantize != "none"
                                                 else "") if topk else ""))
                for size in sizes:
                    if not result[size]["ok"]:
                        raise RuntimeError(f"wrong result: {what}, {size} bytes")
                    median = statistics.median(result[size]["times"])
                    figures.setdefault(f"{what} {size}", []).append(median)
                    print(f"repeat {repeat}: {what} {format_size(size):>8} "
                          f"{median:7.3f} s {busbw(size, world, median) / 1e6:7.0f} "
                          f"(sent {result[size]['tx_bytes']:,} B)", flush=True)
            if args.gloo:
                gloo_sizes = [parse_size(s) for s in (args.gloo_sizes or args.sizes).split(",")]
                gloo = run_gloo(wan, world, gloo_sizes, args.iters, args.warmup, args.timeout)
                for size in gloo_sizes:
                    median = statistics.median(gloo[size])
                    figures.setdefault(f"gloo {size}", []).append(median)
                    print(f"repeat {repeat}: gloo {format_size(size):>8} {median:7.3f} s "
                          f"{busbw(size, world, median) / 1e6:7.0f}", flush=True)
    ceiling = statistics.median(figures["ceiling"])
    print(f"\nceiling (plain TCP, ring pattern, 16 streams): {ceiling / 1e6:.0f} Mbit/s per link")
    print(f"{'what':<34} {'size':>8} {'median s':>9} {'busbw':>7} {'of ceiling':>10}")
    rows = []
    for name, values in figures.items():
        if name == "ceiling":
            continue
        what, size_text = name.rsplit(" ", 1)
        size = int(size_text)
        median = statistics.median(values)
        rate = busbw(size, world, median)
        rows.append({"what": what, "size": size, "median_s": median, "busbw_bits": rate,
                     "of_ceiling": rate / ceiling, "repeats": values})
        print(f"{what:<34} {format_size(size):>8} {median:9.3f} {rate / 1e6:7.0f} "
              f"{rate / ceiling:9.0%}")
    if args.json:
        args.json.write_text(json.dumps({"world": world, "rtt": args.rtt, "rate": args.rate,
                                         "system_congestion": system_congestion,
                                         "loss": args.loss, "ceiling_bits": figures["ceiling"],
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
