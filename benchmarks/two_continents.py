"""The latency-aware ring on two continents: the ring before and after
``optimize_topology``, and what a small all-reduce costs on each.

Usage (as root, with iproute2 and /dev/net/tun):
    python benchmarks/two_continents.py [--continents 3,3] [--inside 0.005]
        [--across 0.075] [--size 1M] [--json FILE]

The emulator (``pccl_trio.testing.Wan``) has one host per peer, ``--continents`` of
them on each continent (host order), paths ``--inside`` seconds one way within a
continent and ``--across`` between the two, and one more host for the master,
``--inside`` from everyone; uploads unshaped. The peers join alternating between the
continents (0, then the first of the second continent, then 1, ...), so the ring the
rounds build crosses the ocean at every hop. Every peer then all-reduces ``--size``
bytes twice (the second timed), calls ``optimize_topology`` (the links are measured,
latency and bandwidth, and the master installs the ring its solver found), and
all-reduces twice again. Prints both rings by host, how often each crosses between the
continents, and the slowest peer's time of each timed all-reduce.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pccl_trio._bench import parse_size
from pccl_trio.testing import Wan, WanPlan, two_continents, wan_available


async def peer(master: str, host: str, world: int, size: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    config = pccl.Config(insecure=True, liveness_timeout=20.0, heartbeat_interval=2.0,
                         connect_timeout=20.0)
    comm = pccl.Communicator(master, 0, config=config, p2p_host=host)
    await comm.connect()
    while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
        await comm.update_topology()
    data = np.ones(size // 4, np.float32)
    times = []
    rings = []
    for optimize in (False, True):
        if optimize:
            await comm.optimize_topology()
        rings.append(list(comm.ring))
        await comm.all_reduce(data)
        start = time.perf_counter()
        await comm.all_reduce(data)
        times.append(time.perf_counter() - start)
    print(json.dumps({"id": comm.peer_id, "host": host, "rings": rings, "times": times}),
          flush=True)
    await comm.aclose()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        import trio

        master, host, world, size = argv[1:]
        trio.run(peer, master, host, int(world), int(size))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--continents", default="3,3", help="peers on each of the two continents")
    parser.add_argument("--inside", type=float, default=0.005, help="one-way seconds within one")
    parser.add_argument("--across", type=float, default=0.075, help="one-way seconds between them")
    parser.add_argument("--size", default="1M")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not wan_available():
        print("needs root, iproute2 and /dev/net/tun", file=sys.stderr)
        return 2
    sizes = [int(n) for n in args.continents.split(",")]
    if len(sizes) != 2 or min(sizes) < 1:
        parser.error("--continents takes two counts, e.g. 3,3")
    world = sum(sizes)
    # The master's host counts as a third continent, ``--inside`` from every peer.
    delays = two_continents([*sizes, 1], inside=args.inside, across=args.across)
    for host in range(world):
        delays[(world, host)] = delays[(host, world)] = args.inside
    continent = [0] * sizes[0] + [1] * sizes[1]
    first, second = list(range(sizes[0])), list(range(sizes[0], world))
    order = [h for pair in zip(first, second, strict=False) for h in pair]
    order += first[len(second):] + second[len(first):]
    with Wan(WanPlan(hosts=world + 1, delays=delays, rate=None)) as wan:
        master, address = wan.start_master(world, "--liveness-timeout", "20",
                                           "--heartbeat-interval", "2")
        peers = []
        for host in order:  # one at a time, so that the rounds append them in this order
            peers.append(wan.start(host, sys.executable, __file__, "peer", address,
                                   wan.address(host), str(world), str(parse_size(args.size)),
                                   stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL))
            time.sleep(1.5)
        results = [json.loads(p.communicate(timeout=600)[0]) for p in peers]
        host_of = {r["id"]: wan_host(wan, r["host"], world) for r in results}
        master.terminate()
        master.wait()

    def crossings(ring: list[int]) -> int:
        sides = [continent[host_of[p]] for p in ring]
        return sum(sides[i] != sides[(i + 1) % len(sides)] for i in range(len(sides)))

    report: dict[str, Any] = {"continents": sizes, "inside": args.inside, "across": args.across,
                              "size": parse_size(args.size)}
    print(f"# {sizes[0]} + {sizes[1]} peers, {args.inside * 1e3:g} ms one way inside a "
          f"continent, {args.across * 1e3:g} ms across; all-reduce of {args.size}")
    for index, name in enumerate(("installed by the rounds", "after optimize_topology")):
        ring = results[0]["rings"][index]
        slowest = max(r["times"][index] for r in results)
        hosts = [host_of[p] for p in ring]
        print(f"{name:<24} ring by host {hosts}: crosses {crossings(ring)} times, "
              f"all-reduce {slowest:.3f} s")
        report[name] = {"ring_hosts": hosts, "crossings": crossings(ring), "seconds": slowest}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def wan_host(wan: Wan, address: str, hosts: int) -> int:
    """The host of the WAN at ``address``."""
    return next(h for h in range(hosts) if wan.address(h) == address)


if __name__ == "__main__":
    sys.exit(main())
