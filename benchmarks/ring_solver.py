"""Ring solver quality and speed on random asymmetric cost matrices.

Usage: python benchmarks/ring_solver.py [--peers 64] [--instances 5] [--seconds 1] [--long 20]

For each instance (uniform costs in [1, 100), seeded), runs the heuristic for
``--seconds`` of wall time and, as the anchor, for ``--long`` seconds with another seed,
and prints both rings' slowest hop and their ratio (the predicted all-reduce time is
proportional to it). Also times the exact solver at 8, 10 and 12 peers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy

from pccl_trio.topology import solve_exact, solve_heuristic


def costs(n: int, seed: int) -> numpy.ndarray:
    cost = numpy.random.default_rng([n, seed]).uniform(1.0, 100.0, (n, n))
    numpy.fill_diagonal(cost, numpy.inf)
    return cost


def timed(seconds: float, cost: numpy.ndarray, seed: int) -> float:
    deadline = time.perf_counter() + seconds
    ring = solve_heuristic(cost, iterations=10**9, seed=seed,
                           should_stop=lambda: time.perf_counter() >= deadline)
    return ring.bottleneck


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--instances", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--long", type=float, default=20.0)
    args = parser.parse_args()
    ratios = []
    for instance in range(args.instances):
        cost = costs(args.peers, instance)
        quick = timed(args.seconds, cost, 1)
        anchor = timed(args.long, cost, 2)
        ratios.append(quick / anchor)
        print(f"instance {instance}: {args.seconds:g} s -> {quick:.3f}, {args.long:g} s -> "
              f"{anchor:.3f}, ratio {quick / anchor:.3f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    for n in (8, 10, 12):
        start = time.perf_counter()
        solve_exact(costs(n, 0))
        print(f"exact solver, {n} peers: {time.perf_counter() - start:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
