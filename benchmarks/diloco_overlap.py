"""Compute utilisation of ``pccl_trio.torch.DiLoCo`` over long fat links, with and
without ``overlap``.

Usage (as root, with iproute2 and /dev/net/tun):
    python benchmarks/diloco_overlap.py [--world 3] [--rtt 0.1] [--rate 1gbit]
        [--params 64M] [--step-seconds 0.1] [--inner-steps 20] [--rounds 6] [--json FILE]

The WAN emulator (``pccl_trio.testing.Wan``) has ``--world`` peer hosts and one for the
master, every path ``--rtt``/2 one way, every host's upload shaped to ``--rate``. Each
peer is a synchronous trainer with ``DiLoCo`` over a ``pccl_trio.sync.Communicator``,
on a model of ``--params`` float32 parameters.

An inner step stands for a GPU's: the trainer's thread waits ``--step-seconds`` (as
it waits on a CUDA stream), which leaves this machine's CPU to the communication, as
a GPU trainer's host has it; the last inner step of a round also moves the parameters
(one real optimizer step on a fixed gradient), so that every round has a
pseudo-gradient to average. *Compute utilisation* is the time in inner steps over
the wall time, from the end of the first boundary (every peer joined) to the end of
the last, on each peer; the figures are the median over the peers. The same sitting
measures the run without overlap (the outer all-reduce's share of a round is what it
costs), then with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pccl_trio._bench import format_size, parse_size
from pccl_trio.testing import Wan, WanPlan, wan_available


def peer(argv: list[str]) -> None:
    """One trainer (``peer MASTER HOST``): prints one JSON line with its timings."""
    import torch
    from torch import nn

    import pccl_trio as pccl
    import pccl_trio.sync
    import pccl_trio.torch

    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("host")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, required=True)
    parser.add_argument("--inner-steps", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Linear(args.params, 1, bias=False)  # params x 1 weights: one tensor
    gradient = torch.randn(args.params // 1024).repeat(1024).view_as(model.weight) * 1e-3
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = pccl.Config(insecure=True, liveness_timeout=10.0, heartbeat_interval=1.0)
    comm = pccl_trio.sync.Communicator(args.master, config=config, p2p_host=args.host)
    inner = []  # seconds in inner steps, per round
    with pccl_trio.torch.DiLoCo(model, optimizer, communicator=comm,
                                sync_every=args.inner_steps, overlap=args.overlap,
                                min_peers=args.world) as diloco:
        start = time.perf_counter()
        boundaries = []
        for _ in range(args.rounds):
            inner.append(0.0)
            for step in range(args.inner_steps):
                began = time.perf_counter()
                time.sleep(args.step_seconds)  # the GPU's step
                if step == args.inner_steps - 1:
                    model.weight.grad = gradient
                    optimizer.step()
                inner[-1] += time.perf_counter() - began
                diloco.step()
            boundaries.append(time.perf_counter() - start)
        wall = time.perf_counter() - start
        digest = pccl.state_digest(diloco.shared_state)
    print(json.dumps({"inner": inner, "wall": wall, "boundaries": boundaries,
                      "outer_steps": diloco.outer_steps, "digest": digest}), flush=True)


def run(wan: Wan, args: argparse.Namespace, overlap: bool) -> list[dict[str, Any]]:
    """One run of ``--world`` trainers: each one's timings."""
    master, address = wan.start_master(args.world, "--liveness-timeout", "10",
                                       "--heartbeat-interval", "1")
    try:
        peers = [
            wan.start(i, sys.executable, __file__, "peer", address, wan.address(i),
                      "--params", str(args.params), "--step-seconds", str(args.step_seconds),
                      "--inner-steps", str(args.inner_steps), "--rounds", str(args.rounds),
                      "--world", str(args.world), *(["--overlap"] if overlap else []),
                      stdout=subprocess.PIPE)
            for i in range(args.world)
        ]
        results = []
        for process in peers:
            out, _ = process.communicate(timeout=args.timeout)
            if process.returncode != 0:
                raise RuntimeError(f"a trainer failed ({process.returncode})")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        master.terminate()
        master.wait()
    if len({r["digest"] for r in results}) != 1:
        raise RuntimeError("the trainers did not end with the same shared state")
    return results


def utilisation(result: dict[str, Any], args: argparse.Namespace) -> float:
    """Time in inner steps over wall time, after the first round."""
    wall = result["wall"] - result["boundaries"][0]
    return sum(result["inner"][1:]) / wall


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        peer(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rtt", type=float, default=0.1)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--params", default="64M", help="float32 parameters of the model")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.params = parse_size(args.params)
    if not wan_available():
        print("needs root, iproute2 and /dev/net/tun", file=sys.stderr)
        return 2
    plan = WanPlan(hosts=args.world + 1, delay=args.rtt / 2, rate=args.rate, mtu=65000)
    compute = args.inner_steps * args.step_seconds
    print(f"# W={args.world}, every path {args.rtt * 1e3:g} ms RTT, uploads {args.rate}; "
          f"{format_size(args.params * 4)} of float32 parameters; a round: "
          f"{args.inner_steps} inner steps of {args.step_seconds:g} s = {compute:g} s of "
          f"compute; {args.rounds} rounds", flush=True)
    figures: dict[str, list[float]] = {}
    with Wan(plan) as wan:
        for repeat in range(args.repeats):
            for overlap in (False, True):
                results = run(wan, args, overlap)
                name = "overlap" if overlap else "plain"
                median = statistics.median(utilisation(r, args) for r in results)
                rounds = [
                    (r["wall"] - r["boundaries"][0]) / (args.rounds - 1) for r in results
                ]
                figures.setdefault(f"{name} utilisation", []).append(median)
                figures.setdefault(f"{name} round seconds", []).append(statistics.median(rounds))
                print(f"repeat {repeat}: {name:<8} utilisation {median:6.1%}  round "
                      f"{statistics.median(rounds):6.2f} s (compute {compute:g} s)", flush=True)
    plain = statistics.median(figures["plain round seconds"])
    print(f"\nwithout overlap the boundary takes {(plain - compute) / plain:.1%} of a round")
    for key, values in figures.items():
        print(f"{key:<26} median {statistics.median(values):.4g}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json"}, "figures": figures},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
