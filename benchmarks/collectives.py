"""The collectives beyond all-reduce against Gloo's, on 127.0.0.1, in one sitting.

For each size, W peers of each library run, back to back (``--iters`` each, no barrier
between them), and the table reports per call the slowest rank's loop time over
``--iters``, as a median over ``--repeats`` fresh launches that alternate between the
libraries:

- ``broadcast`` of S bytes from the lowest peer (Gloo: ``src=0``); busbw = S / t;
- ``all_gather`` of S bytes from every peer, equal sizes as Gloo needs (Gloo: a list of
  W tensors); busbw = W * S / t * (W - 1) / W (the nccl-tests convention);
- ``barrier`` (Gloo: ``dist.barrier``), at the first size only;
- ``reduce_scatter`` of S bytes against ``all_reduce`` of the same vector, pccl_trio
  alone (Gloo's backend has no reduce-scatter): the ratio of their times.

Every call's result is checked once, exactly (float32: ones, or each peer's rank + 1),
before the timed loop. pccl_trio runs with its defaults (leases on) and
``Config(insecure=True)``, as Gloo has no authentication.

Usage::

    python benchmarks/collectives.py --world 3 --sizes 1M,64M --repeats 3 --json out.json

Needs torch for Gloo. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from pccl_trio._bench import format_size, free_port, master_process, parse_size

OPS = ("broadcast", "all_gather", "barrier", "reduce_scatter", "all_reduce")


def _iters(size: int, iters: int) -> int:
    """Fewer calls of large sizes: about the same bytes as ``iters`` calls of 1 MiB."""
    return max(5, min(iters, iters * (1 << 20) // max(size, 1)))


# --- workers (one process each) -----------------------------------------------------------


async def _pccl_worker(master: str, world: int, sizes: list[int], iters: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    config = pccl.Config(liveness_timeout=10.0, heartbeat_interval=1.0, insecure=True)
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        root = min(comm.ring)
        rank = sorted(comm.ring).index(comm.peer_id)
        ok = True
        times: dict[str, dict[int, float]] = {op: {} for op in OPS}
        for index, size in enumerate(sizes):
            n = size // 4
            mine = np.full(n, rank + 1, dtype=np.float32)
            data = mine.copy()
            calls: dict[str, Any] = {
                "broadcast": partial(comm.broadcast, data, root=root, tag=1),
                "all_gather": partial(comm.all_gather, mine, tag=2),
                "reduce_scatter": partial(comm.reduce_scatter, mine, tag=3),
                "all_reduce": partial(comm.all_reduce, data, tag=4),
            }
            if index == 0:
                calls["barrier"] = partial(comm.barrier, tag=5)
            # Checked once, exactly.
            await comm.broadcast(data, root=root, tag=1)
            ok = ok and bool((data == 1).all())
            parts = await comm.all_gather(mine, tag=2)
            ok = ok and all(bool((parts[p] == i + 1).all()) for i, p in enumerate(sorted(parts)))
            shard = await comm.reduce_scatter(mine, tag=3)
            ok = ok and bool((shard.data == world * (world + 1) // 2).all())
            for op, call in calls.items():
                count = _iters(size, iters)
                for _ in range(3):
                    await call()
                await comm.barrier(tag=6)
                start = time.perf_counter()
                for _ in range(count):
                    await call()
                times[op][size] = (time.perf_counter() - start) / count
            # The slowest rank's figures.
            for op in calls:
                slowest = np.array([times[op][size]], dtype=np.float64)
                await comm.all_reduce(slowest, op=pccl.ReduceOp.MAX, tag=7)
                times[op][size] = float(slowest[0])
        print(json.dumps({"ok": ok, "times": times}), flush=True)
        await comm.barrier(tag=8)


def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], iters: int) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=300))
    ok = True
    times: dict[str, dict[int, float]] = {op: {} for op in OPS[:3]}
    for index, size in enumerate(sizes):
        n = size // 4
        mine = torch.full((n,), float(rank + 1), dtype=torch.float32)
        data = mine.clone()
        parts = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
        calls: dict[str, Any] = {
            "broadcast": partial(dist.broadcast, data, src=0),
            "all_gather": partial(dist.all_gather, parts, mine),
        }
        if index == 0:
            calls["barrier"] = dist.barrier
        dist.broadcast(data, src=0)
        ok = ok and bool((data == 1).all())
        dist.all_gather(parts, mine)
        ok = ok and all(bool((p == i + 1).all()) for i, p in enumerate(parts))
        for op, call in calls.items():
            count = _iters(size, iters)
            for _ in range(3):
                call()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                call()
            elapsed = torch.tensor([(time.perf_counter() - start) / count], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[op][size] = float(elapsed[0])
    if rank == 0:
        print(json.dumps({"ok": ok, "times": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --- driver ----------------------------------------------------------------------------------


def _collect(workers: list[subprocess.Popen[str]]) -> dict[str, dict[int, float]]:
    """One launch's figures: the slowest rank's time per call, by op and size."""
    records = []
    for worker in workers:
        out, _ = worker.communicate(timeout=900)
        if worker.returncode != 0:
            raise SystemExit(f"a worker failed (exit {worker.returncode})")
        lines = out.strip().splitlines()
        if lines:
            records.append(json.loads(lines[-1]))
    if not records or not all(r["ok"] for r in records):
        raise SystemExit("a worker's result was wrong")
    return {op: {int(s): t for s, t in by_size.items()} for op, by_size in records[0]["times"].items()}


def launch_pccl(world: int, sizes: list[int], iters: int) -> dict[str, dict[int, float]]:
    with master_process(
        "--liveness-timeout", "10", "--heartbeat-interval", "1", stderr=subprocess.DEVNULL
    ) as (_master, address):
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--role", "pccl", "--master", address,
                 "--world", str(world), "--sizes", ",".join(map(str, sizes)),
                 "--iters", str(iters)],
                stdout=subprocess.PIPE, text=True,
            )
            for _ in range(world)
        ]
        return _collect(workers)


def launch_gloo(world: int, sizes: list[int], iters: int) -> dict[str, dict[int, float]]:
    port = free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", "gloo", "--rank", str(rank), "--port",
             str(port), "--world", str(world), "--sizes", ",".join(map(str, sizes)),
             "--iters", str(iters)],
            stdout=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    return _collect(workers)


def busbw(op: str, size: int, world: int, seconds: float) -> float:
    """Bus bandwidth in GB/s (nccl-tests' convention)."""
    if op == "broadcast":
        return size / seconds / 1e9
    if op == "all_gather":
        return world * size / seconds * (world - 1) / world / 1e9
    return float("nan")


def main(args: argparse.Namespace) -> None:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    launches: dict[str, list[dict[str, dict[int, float]]]] = {"pccl_trio": [], "gloo": []}
    for repeat in range(args.repeats):
        launches["pccl_trio"].append(launch_pccl(args.world, sizes, args.iters))
        launches["gloo"].append(launch_gloo(args.world, sizes, args.iters))
        print(f"launch {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    def median(library: str, op: str, size: int) -> float:
        return statistics.median(launch[op][size] for launch in launches[library])

    print(f"# W={args.world}, float32, calls back to back, median of {args.repeats} launches "
          f"each; {os.cpu_count()} CPUs")
    print(f"{'op':>15} {'size':>8} {'pccl_trio ms':>13} {'gloo ms':>9} "
          f"{'pccl busbw':>11} {'gloo busbw':>11} {'vs gloo':>8}")
    rows = []
    for size in sizes:
        for op in ("broadcast", "all_gather", "barrier"):
            if op == "barrier" and size != sizes[0]:
                continue
            ours, theirs = median("pccl_trio", op, size), median("gloo", op, size)
            label = "-" if op == "barrier" else format_size(size)
            # Higher is better in both: busbw for data, 1 / latency for the barrier.
            print(f"{op:>15} {label:>8} {ours * 1e3:13.3f} {theirs * 1e3:9.3f} "
                  f"{busbw(op, size, args.world, ours):11.3f} "
                  f"{busbw(op, size, args.world, theirs):11.3f} {theirs / ours:7.2f}x")
            rows.append({"op": op, "size": size, "pccl_s": ours, "gloo_s": theirs,
                         "speedup_vs_gloo": theirs / ours})
        scatter, reduce = median("pccl_trio", "reduce_scatter", size), median("pccl_trio", "all_reduce", size)
        print(f"{'reduce_scatter':>15} {format_size(size):>8} {scatter * 1e3:13.3f} "
              f"{'-':>9} {'':>11} {'':>11} {scatter / reduce:7.2f} of all_reduce "
              f"({reduce * 1e3:.3f} ms)")
        rows.append({"op": "reduce_scatter", "size": size, "pccl_s": scatter,
                     "all_reduce_s": reduce, "ratio_to_all_reduce": scatter / reduce})
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"world": args.world, "sizes": sizes, "iters": args.iters, "cpus": os.cpu_count(),
             "launches": launches, "rows": rows}, indent=1
        ))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--sizes", default="1M,64M")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["pccl", "gloo"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.role == "pccl":
        import trio

        trio.run(_pccl_worker, parsed.master, parsed.world,
                 [int(s) for s in parsed.sizes.split(",")], parsed.iters)
    elif parsed.role == "gloo":
        _gloo_worker(parsed.rank, parsed.world, parsed.port,
                     [int(s) for s in parsed.sizes.split(",")], parsed.iters)
    else:
        main(parsed)
