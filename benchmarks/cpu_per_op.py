"""Where the CPU of back-to-back all-reduces goes: pccl_trio's peers and master against Gloo.

For one size at W peers on 127.0.0.1, each library runs ``--iters`` all-reduces (float32
SUM, in place) back to back, with no barrier between them, and reports per all-reduce:

- wall: the slowest rank's loop time over ``--iters``;
- CPU per rank: user + system time of the whole process (every thread) over the loop
  (``time.process_time``);
- for pccl_trio, the master's CPU over the same loop (read by the first rank from
  ``/proc/<pid>/stat``, in clock ticks: at 1,000 all-reduces of about 1 ms each, a tick
  is 1 % of the figure);
- the total CPU of all the run's processes, and total CPU / wall: how many cores the
  run keeps busy. Near the machine's core count, the run is CPU-bound and its wall
  time is its CPU spread over the cores, whatever the network.

``--leases both`` adds pccl_trio without leases (``Config(leases=False)``: every
all-reduce through the master) as a third library; ``off`` runs only that.
``--slice-bytes 4M,1M`` adds pccl_trio with 1 MiB slices (``Config.slice_bytes``) as
another.

Launches alternate (pccl_trio, Gloo, pccl_trio, ...), ``--repeats`` of each, fresh
processes each time; the table shows medians over launches. The data are zeros (so
the loop can run any number of times), after one all-reduce of ones checked exact.

Usage::

    python benchmarks/cpu_per_op.py --world 3 --size 1M --iters 2000 --repeats 5

Linux only (``/proc``); needs torch for Gloo. Run from the repository root.
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

from pccl_trio import Config
from pccl_trio._bench import format_size, free_port, master_process, parse_size

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system seconds of process ``pid`` so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def own_cpu() -> float:
    """User + system seconds of this process (every thread), to the nanosecond."""
    return time.process_time()


# --- workers (one process each) -----------------------------------------------------------


async def _pccl_worker(
    master: str, master_pid: int, world: int, size: int, iters: int, leases: bool,
    slice_bytes: int,
) -> None:
    import numpy as np

    import pccl_trio as pccl

    config = pccl.Config(
        liveness_timeout=10.0, heartbeat_interval=1.0, insecure=True, leases=leases,
        slice_bytes=slice_bytes,
    )
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        data = np.ones(size // 4, dtype=np.float32)
        await comm.all_reduce(data)
        ok = bool((data == world).all())
        data.fill(0.0)
        for _ in range(20):
            await comm.all_reduce(data)
        first = comm.ring[0] == comm.peer_id
        master_before = process_cpu(master_pid) if first else 0.0
        cpu, start = own_cpu(), time.perf_counter()
        for _ in range(iters):
            await comm.all_reduce(data)
        wall, cpu = time.perf_counter() - start, own_cpu() - cpu
        master_cpu = process_cpu(master_pid) - master_before if first else None
        ok = ok and not data.any()
        print(json.dumps({"ok": ok, "wall": wall, "cpu": cpu, "master_cpu": master_cpu}),
              flush=True)
        await comm.all_reduce(np.zeros(1, dtype=np.float32), tag=1)  # leave together


def _gloo_worker(rank: int, world: int, port: int, size: int, iters: int) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as in benchmarks/steps.py: the default oversubscribes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=300))
    data = torch.ones(size // 4, dtype=torch.float32)
    dist.all_reduce(data)
    ok = bool((data == world).all())
    data.zero_()
    for _ in range(20):
        dist.all_reduce(data)
    cpu, start = own_cpu(), time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    wall, cpu = time.perf_counter() - start, own_cpu() - cpu
    ok = ok and not bool(data.any())
    print(json.dumps({"ok": ok, "wall": wall, "cpu": cpu, "master_cpu": None}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# --- driver ----------------------------------------------------------------------------------


def _collect(workers: list[subprocess.Popen[str]], iters: int, *, master: bool) -> dict[str, Any]:
    """One launch's figures from its workers' lines (``master``: exactly one rank must
    have read the master's CPU)."""
    records = []
    for worker in workers:
        out, _ = worker.communicate(timeout=600)
        if worker.returncode != 0:
            raise SystemExit(f"a worker failed (exit {worker.returncode})")
        records.append(json.loads(out.strip().splitlines()[-1]))
    if not all(r["ok"] for r in records):
        raise SystemExit("a worker's result was wrong")
    master_cpu = [r["master_cpu"] for r in records if r["master_cpu"] is not None]
    if len(master_cpu) != int(master):
        raise SystemExit(f"{len(master_cpu)} ranks read the master's CPU, expected {int(master)}")
    rank_cpu = [r["cpu"] / iters * 1e3 for r in records]
    launch = {
        "wall_ms": max(r["wall"] for r in records) / iters * 1e3,
        "rank_cpu_ms": statistics.mean(rank_cpu),
        "master_cpu_ms": master_cpu[0] / iters * 1e3 if master_cpu else 0.0,
    }
    launch["total_cpu_ms"] = sum(rank_cpu) + launch["master_cpu_ms"]
    launch["cores_busy"] = launch["total_cpu_ms"] / launch["wall_ms"]
    return launch


def launch_pccl(
    world: int, size: int, iters: int, leases: bool, slice_bytes: int
) -> dict[str, Any]:
    with master_process(
        "--liveness-timeout", "10", "--heartbeat-interval", "1", stderr=subprocess.DEVNULL
    ) as (master, address):
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--role", "pccl", "--master", address,
                 "--master-pid", str(master.pid), "--world", str(world), "--size", str(size),
                 "--iters", str(iters), "--slice-bytes", str(slice_bytes),
                 *([] if leases else ["--no-leases"])],
                stdout=subprocess.PIPE, text=True,
            )
            for _ in range(world)
        ]
        return _collect(workers, iters, master=True)


def launch_gloo(world: int, size: int, iters: int) -> dict[str, Any]:
    port = free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", "gloo", "--rank", str(rank), "--port",
             str(port), "--world", str(world), "--size", str(size), "--iters", str(iters)],
            stdout=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    return _collect(workers, iters, master=False)


def main(args: argparse.Namespace) -> None:
    size = parse_size(args.size)
    slices = [parse_size(s) for s in args.slice_bytes.split(",")]
    # Per variant: (leases, slice bytes).
    variants = {"on": {"pccl_trio": (True, slices[0])}, "off": {"pccl_trio": (False, slices[0])},
                "both": {"pccl_trio": (True, slices[0]), "no_leases": (False, slices[0])},
                }[args.leases]
    variants.update({f"slices_{format_size(b).replace(' ', '')}": (args.leases != "off", b)
                     for b in slices[1:]})
    launches: dict[str, list[dict[str, Any]]] = {**{v: [] for v in variants}, "gloo": []}
    for repeat in range(args.repeats):
        for variant, (leases, slice_bytes) in variants.items():
            launches[variant].append(
                launch_pccl(args.world, size, args.iters, leases, slice_bytes)
            )
        launches["gloo"].append(launch_gloo(args.world, size, args.iters))
        print(f"launch {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{name} {runs[-1]['wall_ms']:.2f} ms" for name, runs in launches.items()
        ), file=sys.stderr, flush=True)
    columns = ("wall_ms", "rank_cpu_ms", "master_cpu_ms", "total_cpu_ms", "cores_busy")
    summary = {
        library: {c: statistics.median(launch[c] for launch in runs) for c in columns}
        for library, runs in launches.items()
    }
    print(f"# W={args.world}, {format_size(size)} float32 SUM, {args.iters} all-reduces back "
          f"to back, median of {args.repeats} launches each; {os.cpu_count()} CPUs")
    print(f"{'library':>10} {'wall ms':>9} {'CPU/rank ms':>12} {'master ms':>10} "
          f"{'total CPU ms':>13} {'cores busy':>11}")
    for library, row in summary.items():
        print(f"{library:>10} {row['wall_ms']:9.3f} {row['rank_cpu_ms']:12.3f} "
              f"{row['master_cpu_ms']:10.3f} {row['total_cpu_ms']:13.3f} "
              f"{row['cores_busy']:11.2f}")
    ratio = summary["gloo"]["wall_ms"] / summary["pccl_trio"]["wall_ms"]
    print(f"pccl_trio vs gloo (wall): {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"world": args.world, "size": size, "iters": args.iters, "cpus": os.cpu_count(),
             "launches": launches, "medians": summary}, indent=1
        ))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--size", default="1M")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--leases", choices=["on", "off", "both"], default="on",
                        help="Config.leases for pccl_trio; both: a run without them too")
    parser.add_argument("--slice-bytes", default=str(Config().slice_bytes),
                        help="comma list of Config.slice_bytes: the first for pccl_trio, "
                             "each further one a variant (leases as pccl_trio's)")
    parser.add_argument("--no-leases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["pccl", "gloo"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--master-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.role == "pccl":
        import trio

        trio.run(_pccl_worker, parsed.master, parsed.master_pid, parsed.world,
                 parse_size(parsed.size), parsed.iters, not parsed.no_leases,
                 parse_size(parsed.slice_bytes))
    elif parsed.role == "gloo":
        _gloo_worker(parsed.rank, parsed.world, parsed.port, parse_size(parsed.size),
                     parsed.iters)
    else:
        main(parsed)
