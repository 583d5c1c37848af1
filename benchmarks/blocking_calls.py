"""What a blocking call costs against the async one: ``pccl_trio.sync.Communicator``
against ``pccl_trio.Communicator``, on 127.0.0.1, in one sitting.

W peers (one process each) of one mode run back to back ``--iters`` barriers, then
``--iters`` all-reduces of each size (fewer for large sizes); the table reports per call
the slowest rank's loop time, as a median over ``--repeats`` fresh launches that
alternate between the modes, and the ratio of the blocking time to the async one. A
blocking call crosses from the calling thread to the communicator's event loop thread
and back; the async one runs in the caller's event loop.

Usage::

    python benchmarks/blocking_calls.py --world 3 --sizes 4,1M --repeats 3 --json out.json

Run from the repository root.
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

from pccl_trio._bench import format_size, master_process, parse_size

MODES = ("async", "sync")


def _iters(size: int, iters: int) -> int:
    """Fewer calls of large sizes: about the same bytes as ``iters`` calls of 1 MiB."""
    return max(5, min(iters, iters * (1 << 20) // max(size, 1)))


def _config() -> Any:
    import pccl_trio as pccl

    return pccl.Config(liveness_timeout=10.0, heartbeat_interval=1.0, insecure=True)


def _timed(calls: dict[str, Any], iters: dict[str, int]) -> dict[str, float]:
    """Per call, seconds: each of ``calls`` made ``iters[name]`` times after 3 untimed."""
    times = {}
    for name, call in calls.items():
        for _ in range(3):
            call()
        start = time.perf_counter()
        for _ in range(iters[name]):
            call()
        times[name] = (time.perf_counter() - start) / iters[name]
    return times


def _sync_worker(master: str, world: int, sizes: list[int], iters: int) -> None:
    import numpy as np

    import pccl_trio as pccl
    import pccl_trio.sync

    with pccl_trio.sync.Communicator(master, config=_config(), p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            comm.update_topology()
        buffers = {size: np.ones(size // 4, np.float32) for size in sizes}
        calls: dict[str, Any] = {"barrier": lambda: comm.barrier(tag=1)}
        counts = {"barrier": iters}
        for size in sizes:
            calls[f"all_reduce {size}"] = lambda b=buffers[size]: comm.all_reduce(b, tag=2)
            counts[f"all_reduce {size}"] = _iters(size, iters)
        comm.barrier(tag=3)
        times = _timed(calls, counts)
        slowest = {}
        for name, seconds in times.items():
            value = np.array([seconds])
            comm.all_reduce(value, op=pccl.ReduceOp.MAX, tag=4)
            slowest[name] = float(value[0])
        print(json.dumps(slowest), flush=True)
        comm.barrier(tag=5)


async def _async_worker(master: str, world: int, sizes: list[int], iters: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    async with pccl.Communicator(master, config=_config(), p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        buffers = {size: np.ones(size // 4, np.float32) for size in sizes}
        calls: dict[str, Any] = {"barrier": lambda: comm.barrier(tag=1)}
        counts = {"barrier": iters}
        for size in sizes:
            calls[f"all_reduce {size}"] = lambda b=buffers[size]: comm.all_reduce(b, tag=2)
            counts[f"all_reduce {size}"] = _iters(size, iters)
        await comm.barrier(tag=3)
        times = {}
        for name, call in calls.items():  # as _timed, awaiting each call
            for _ in range(3):
                await call()
            start = time.perf_counter()
            for _ in range(counts[name]):
                await call()
            times[name] = (time.perf_counter() - start) / counts[name]
        slowest = {}
        for name, seconds in times.items():
            value = np.array([seconds])
            await comm.all_reduce(value, op=pccl.ReduceOp.MAX, tag=4)
            slowest[name] = float(value[0])
        print(json.dumps(slowest), flush=True)
        await comm.barrier(tag=5)


def launch(mode: str, world: int, sizes: list[int], iters: int) -> dict[str, float]:
    """One launch of W peers of ``mode``: the slowest rank's seconds per call."""
    with master_process(
        "--liveness-timeout", "10", "--heartbeat-interval", "1", stderr=subprocess.DEVNULL,
    ) as (_master, address):
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--role", mode, "--master", address,
                 "--world", str(world), "--sizes", ",".join(map(str, sizes)),
                 "--iters", str(iters)],
                stdout=subprocess.PIPE, text=True,
            )
            for _ in range(world)
        ]
        records = []
        for worker in workers:
            out, _ = worker.communicate(timeout=900)
            if worker.returncode != 0:
                raise SystemExit(f"a {mode} worker failed (exit {worker.returncode})")
            records.append(json.loads(out.strip().splitlines()[-1]))
    return records[0]  # every rank prints the same slowest figures


def main(args: argparse.Namespace) -> None:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    launches: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            launches[mode].append(launch(mode, args.world, sizes, args.iters))
        print(f"launch {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    print(f"# W={args.world}, float32, calls back to back, median of {args.repeats} launches "
          f"each; {os.cpu_count()} CPUs")
    print(f"{'call':>12} {'size':>8} {'async ms':>9} {'sync ms':>9} {'sync/async':>11}")
    rows = []
    for name in launches["async"][0]:
        theirs = statistics.median(launch[name] for launch in launches["async"])
        ours = statistics.median(launch[name] for launch in launches["sync"])
        call, *size = name.split()
        label = format_size(int(size[0])) if size else "-"
        print(f"{call:>12} {label:>8} {theirs * 1e3:9.3f} {ours * 1e3:9.3f} {ours / theirs:11.2f}")
        rows.append({"call": name, "async_s": theirs, "sync_s": ours, "ratio": ours / theirs})
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"world": args.world, "sizes": sizes, "iters": args.iters, "cpus": os.cpu_count(),
             "launches": launches, "rows": rows}, indent=1
        ))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--sizes", default="4,1M")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.role == "sync":
        _sync_worker(parsed.master, parsed.world, [parse_size(s) for s in parsed.sizes.split(",")],
                     parsed.iters)
    elif parsed.role == "async":
        import trio

        trio.run(_async_worker, parsed.master, parsed.world,
                 [parse_size(s) for s in parsed.sizes.split(",")], parsed.iters)
    else:
        main(parsed)
