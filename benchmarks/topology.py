"""Topology optimization over emulated hosts: one fast directed ring among slow links.

Usage (as root, with iproute2's ``ip`` and ``tc``):
    python benchmarks/topology.py [--world 5] [--fast-rate 400mbit] [--slow-rate 40mbit]
                                  [--rings scrambled,reversed] [--size 8M] [--iters 5]
                                  [--repeats 1] [--json FILE]

Topology: one network namespace per peer and one for the master, joined through a
bridge (``wan.Topology``, links unshaped there). Each peer's egress is shaped per
destination with an htb class and a u32 filter on the destination address: the hops of
one directed ring (``--rings``; ``scrambled`` is 0→2→4→1→3→0 for five hosts,
``reversed`` is 0→4→3→2→1→0, ``joined`` is 0→1→2→3→4→0) at ``--fast-rate``, every other
directed pair at ``--slow-rate``. The master's traffic is not limited.

Each run starts the master and the peers one after another (so the first ring is the
joining order, 0→1→2→3→4→0, all slow unless the fast ring is ``joined``), times
``--iters`` float32 SUM all-reduces of ``--size``, calls ``optimize_topology`` (timed),
and times the all-reduces again. An iteration's time is the slowest peer's. Printed:
the rings (as host indices), median times before and after, the fast ring's ideal time
``2 (W - 1) (size / W) / fast rate``, and after / ideal.

``worker`` is the peer process (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import wan  # noqa: E402

from pccl_trio._bench import format_size, parse_size  # noqa: E402
from pccl_trio.testing import rate_bits  # noqa: E402


def _scrambled(n: int) -> list[int]:
    """Even hosts, then odd ones: no hop joins hosts adjacent in the joining order
    (for five hosts, 0 2 4 1 3)."""
    return [*range(0, n, 2), *range(1, n, 2)]


RINGS = {
    "scrambled": _scrambled,
    "reversed": lambda n: [0, *range(n - 1, 0, -1)],
    "joined": lambda n: list(range(n)),
}


def shape_pairs(topology: wan.Topology, rates: dict[tuple[int, int], str]) -> None:
    """Shape each peer's egress per destination: ``rates[(i, j)]`` from peer ``i`` to
    peer ``j`` (an htb class each, selected by destination address)."""
    for i in range(topology.world):
        namespace, device = topology.peers[i], topology.device(i)
        wan.netns(namespace, "tc", "qdisc", "replace", "dev", device, "root", "handle", "1:",
                  "htb", "default", "1")
        wan.netns(namespace, "tc", "class", "add", "dev", device, "parent", "1:", "classid",
                  "1:1", "htb", "rate", "10gbit", "quantum", "60000")
        for j in range(topology.world):
            if i == j:
                continue
            classid = f"1:{10 + j}"
            rate = rates[(i, j)]
            wan.netns(namespace, "tc", "class", "add", "dev", device, "parent", "1:",
                      "classid", classid, "htb", "rate", rate, "ceil", rate, "quantum", "60000")
            wan.netns(namespace, "tc", "filter", "add", "dev", device, "parent", "1:",
                      "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst",
                      f"{topology.peer_ip(j)}/32", "flowid", classid)


def one_fast_ring(world: int, fast: Sequence[int], fast_rate: str, slow_rate: str
                  ) -> dict[tuple[int, int], str]:
    rates = {(i, j): slow_rate for i in range(world) for j in range(world) if i != j}
    for k, i in enumerate(fast):
        rates[(i, fast[(k + 1) % world])] = fast_rate
    return rates


# --- the peer process ------------------------------------------------------------------


async def _worker(master: str, host: str, world: int, size: int, iters: int,
                  before_iters: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    config = pccl.Config(liveness_timeout=10.0, heartbeat_interval=1.0)
    async with pccl.Communicator(master, config=config, p2p_host=host) as comm:
        print(json.dumps({"event": "connected", "peer_id": comm.peer_id}), flush=True)
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        data = np.ones(size // 4, dtype=np.float32)
        barrier = np.zeros(1, dtype=np.float32)
        slowest = np.zeros(1, dtype=np.float64)

        async def timed(call: object) -> float:
            await comm.all_reduce(barrier, tag=1)
            start = time.perf_counter()
            await call()  # type: ignore[operator]
            slowest[0] = time.perf_counter() - start
            await comm.all_reduce(slowest, op=pccl.ReduceOp.MAX, tag=2)
            return float(slowest[0])

        async def reduce_once() -> None:
            data.fill(1.0)
            await comm.all_reduce(data)
            if not (data == world).all():
                raise RuntimeError("wrong all-reduce result")

        ring_before = list(comm.ring)
        await reduce_once()  # warm-up
        before = [await timed(reduce_once) for _ in range(before_iters)]
        optimize = await timed(comm.optimize_topology)
        await reduce_once()
        after = [await timed(reduce_once) for _ in range(iters)]
        info = comm.topology
        assert info is not None
        print(json.dumps({
            "event": "result", "peer_id": comm.peer_id, "ring_before": ring_before,
            "ring_after": list(comm.ring), "before": before, "after": after,
            "optimize": optimize, "predicted": info.predict(size), "optimal": info.optimal,
            "peers": list(info.peers),
            "bandwidth": [[None if v != v else v for v in row] for row in info.bandwidth.tolist()],
        }), flush=True)
        await comm.all_reduce(barrier, tag=1)  # nobody leaves before everyone printed


def run(topology: wan.Topology, size: int, iters: int, timeout: float,
        before_iters: int | None = None) -> dict[str, object]:
    """One run: master and peers started in host order; returns the results in host
    indices (rings, matrix rows and columns). ``before_iters`` (default ``iters``) times
    fewer all-reduces on the first ring, whose hops are the slow ones."""
    # Hosts on a shared network: the run holds a secret, as such a run should.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PCCL_TRIO_RUN_SECRET=secrets.token_hex(32))
    placement = topology.placement()
    master = subprocess.Popen(
        [*placement.master_prefix, sys.executable, "-m", "pccl_trio.master", "--listen",
         placement.master_listen, "--log-level", "WARNING", "--liveness-timeout", "10",
         "--heartbeat-interval", "1"],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        host_of: dict[int, int] = {}
        for index in range(topology.world):
            prefix, host = placement.worker(index)
            worker = subprocess.Popen(
                [*prefix, sys.executable, __file__, "worker", address, "--host", host,
                 "--world", str(topology.world), "--size", str(size), "--iters", str(iters),
                 "--before-iters", str(iters if before_iters is None else before_iters)],
                stdout=subprocess.PIPE, text=True, env=env,
            )
            workers.append(worker)
            assert worker.stdout is not None
            line = json.loads(worker.stdout.readline())  # joined: start the next one
            host_of[line["peer_id"]] = index
        deadline = time.monotonic() + timeout
        results = []
        for worker in workers:
            out, _ = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if worker.returncode:
                raise RuntimeError(f"a peer failed with exit code {worker.returncode}")
            results.extend(json.loads(x) for x in out.splitlines() if x.startswith("{"))
        first = results[0]
        hosts = [host_of[p] for p in first["peers"]]
        n = len(hosts)
        matrix = [[0.0] * n for _ in range(n)]
        for a, row in enumerate(first["bandwidth"]):
            for b, value in enumerate(row):
                matrix[hosts[a]][hosts[b]] = value
        return {
            "ring_before": [host_of[p] for p in first["ring_before"]],
            "rings_after": [[host_of[p] for p in r["ring_after"]] for r in results],
            "before": first["before"], "after": first["after"],
            "optimize": first["optimize"], "predicted": first["predicted"],
            "optimal": first["optimal"], "bandwidth": matrix,
        }
    finally:
        for process in [*workers, master]:
            if process is master:
                process.terminate()
            elif process.poll() is None:
                process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()


def rotation_of(ring: Sequence[int], expected: Sequence[int]) -> bool:
    ring, expected = list(ring), list(expected)
    return len(ring) == len(expected) and any(
        ring == expected[i:] + expected[:i] for i in range(len(expected))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=5)
    parser.add_argument("--fast-rate", default="400mbit")
    parser.add_argument("--slow-rate", default="40mbit")
    parser.add_argument("--rings", default="scrambled,reversed",
                        help=f"comma list of fast rings: {', '.join(RINGS)}")
    parser.add_argument("--size", default="8M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--prefix", default=f"pccl-top{os.getpid()}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("needs iproute2's ip and tc, and root", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    ideal = 2 * (args.world - 1) * (size / args.world) / (rate_bits(args.fast_rate) / 8)
    print(f"# W={args.world}: one directed ring at {args.fast_rate}, the other pairs at "
          f"{args.slow_rate} (htb per destination); {format_size(size)} float32 SUM, "
          f"iters={args.iters}; the fast ring's ideal time {ideal:.3f} s", flush=True)
    rows = []
    for name in args.rings.split(","):
        fast = RINGS[name](args.world)
        for repeat in range(args.repeats):
            with wan.Topology(args.world, None, args.prefix) as topology:
                shape_pairs(topology, one_fast_ring(args.world, fast, args.fast_rate,
                                                    args.slow_rate))
                result = run(topology, size, args.iters, args.timeout)
            before = statistics.median(result["before"])  # type: ignore[arg-type]
            after = statistics.median(result["after"])  # type: ignore[arg-type]
            found = all(rotation_of(r, fast) for r in result["rings_after"])  # type: ignore[union-attr]
            row = {"fast_ring": name, "fast": fast, "repeat": repeat, "before_s": before,
                   "after_s": after, "ideal_s": ideal, "after_vs_ideal": after / ideal,
                   "speedup": before / after, "optimize_s": result["optimize"],
                   "found_fast_ring": found, **result}
            rows.append(row)
            print(f"{name:>10} ring {result['ring_before']} -> {result['rings_after'][0]}"  # type: ignore[index]
                  f" (fast {fast}, found: {found}); all-reduce {before:.3f} s -> {after:.3f} s"
                  f" = {after / ideal:.2f}x ideal, {before / after:.1f}x faster; "
                  f"optimize_topology {result['optimize']:.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        import trio

        worker_parser = argparse.ArgumentParser()
        worker_parser.add_argument("master")
        worker_parser.add_argument("--host", required=True)
        worker_parser.add_argument("--world", type=int, required=True)
        worker_parser.add_argument("--size", type=int, required=True)
        worker_parser.add_argument("--iters", type=int, required=True)
        worker_parser.add_argument("--before-iters", type=int, required=True)
        worker_args = worker_parser.parse_args(sys.argv[2:])
        trio.run(_worker, worker_args.master, worker_args.host, worker_args.world,
                 worker_args.size, worker_args.iters, worker_args.before_iters)
        sys.exit(0)
    sys.exit(main())
