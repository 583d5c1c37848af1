"""Whole gradient steps: ``all_reduce_multiple_with_retry`` against Gloo, at W peers on loopback.

A step all-reduces (SUM, in place) every tensor of a gradient list. Workloads:

- ``100x256KiB``: 100 float32 tensors of 256 KiB;
- ``400x16KiB``: 400 float32 tensors of 16 KiB;
- ``transformer``: the parameter shapes of a small GPT-2-like model (vocabulary 8192,
  context 256, width 256, 4 layers of attention and a 4x MLP, biases and layer norms;
  52 tensors, 20.3 MiB), float32.

Libraries, each launched as W fresh processes per repeat, alternating within a repeat
so drift on a shared machine hits all alike:

- ``pccl B``: pccl_trio with ``Config(bucket_bytes=B)`` (``0``: one all-reduce per
  tensor), a master process from ``python -m pccl_trio.master``;
- ``gloo/tensor``: torch.distributed Gloo, ``all_reduce(async_op=True)`` per tensor,
  then wait for all;
- ``gloo/ddp``: Gloo with the buckets torch DDP would use (25 MiB, in order, one
  dtype each): flatten, ``all_reduce(async_op=True)`` per bucket, wait, unflatten.

Timing, as in ``pccl-trio bench`` and the Gloo anchor: a barrier, then the step; a
step's time is the maximum over the ranks; per launch the median of ``--iters`` steps
(after ``--warmup``), and the table the median over ``--repeats`` launches. Ratios are
Gloo's time over pccl_trio's (above 1: pccl_trio is faster).

Usage::

    python benchmarks/steps.py                      # the full sweep (~5 min), JSON in steps.json
    python benchmarks/steps.py --quick              # the default bucket size only, fewer steps
    python benchmarks/steps.py --buckets 0,1M,4M,16M,25M --repeats 5 --json out.json

Needs torch (for Gloo); run it from the repository root (or with pccl_trio installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pccl_trio import Config
from pccl_trio._bench import format_size, free_port, master_process, parse_size

WORKLOADS = ("100x256KiB", "400x16KiB", "transformer")
DDP_BUCKET = 25 << 20


def shapes(workload: str) -> list[tuple[int, ...]]:
    """The float32 tensor shapes of one step's gradients."""
    if workload == "100x256KiB":
        return [(65536,)] * 100
    if workload == "400x16KiB":
        return [(4096,)] * 400
    if workload == "transformer":
        vocab, context, width, layers = 8192, 256, 256, 4
        out: list[tuple[int, ...]] = [(vocab, width), (context, width)]
        for _ in range(layers):
            out += [(width,), (width,),  # layer norm 1
                    (3 * width, width), (3 * width,),  # attention: qkv
                    (width, width), (width,),  # attention: output projection
                    (width,), (width,),  # layer norm 2
                    (4 * width, width), (4 * width,),  # MLP up
                    (width, 4 * width), (width,)]  # MLP down
        return [*out, (width,), (width,)]  # final layer norm (the head is tied)
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


# --- pccl_trio worker --------------------------------------------------------------------


async def _pccl_worker(master: str, world: int, bucket_bytes: int, iters: int, warmup: int,
                       workloads: list[str], slice_bytes: int) -> None:
    import numpy as np

    import pccl_trio as pccl

    config = pccl.Config(bucket_bytes=bucket_bytes, slice_bytes=slice_bytes,
                         liveness_timeout=10.0, heartbeat_interval=1.0, insecure=True)
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host="127.0.0.1") as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        barrier = np.zeros(1, dtype=np.float32)
        clock = np.zeros(1, dtype=np.float64)
        tag = 1 << 40  # apart from the step's tags (not that they could overlap in time)
        results: dict[str, Any] = {}
        for workload in workloads:
            tensors = [np.ones(shape, dtype=np.float32) for shape in shapes(workload)]
            times, ok = [], True
            for step in range(warmup + iters):
                for t in tensors:
                    t.fill(1.0)
                await comm.all_reduce(barrier, tag=tag)
                start = time.perf_counter()
                await comm.all_reduce_multiple_with_retry(tensors)
                clock[0] = time.perf_counter() - start
                await comm.all_reduce(clock, op=pccl.ReduceOp.MAX, tag=tag + 1)
                # Every step is checked (after the clock stopped): leased steps run
                # another path than the first.
                ok = ok and all(bool((t == world).all()) for t in tensors)
                if step >= warmup:
                    times.append(float(clock[0]))
            results[workload] = {"ok": ok, "times": times}
        await comm.all_reduce(barrier, tag=tag)
        if comm.ring[0] == comm.peer_id:
            print(json.dumps(results), flush=True)


# --- Gloo worker -------------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, port: int, mode: str, iters: int, warmup: int,
                 workloads: list[str], threads: int) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist

    if threads > 0:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=300))
    clock = torch.zeros(1, dtype=torch.float64)
    results: dict[str, Any] = {}
    for workload in workloads:
        tensors = [torch.ones(shape, dtype=torch.float32) for shape in shapes(workload)]
        buckets: list[list[torch.Tensor]] = []
        filled = DDP_BUCKET
        for t in tensors:  # DDP's rule: in order, up to 25 MiB (one dtype here)
            nbytes = t.numel() * t.element_size()
            if not buckets or filled + nbytes > DDP_BUCKET:
                buckets.append([])
                filled = 0
            buckets[-1].append(t)
            filled += nbytes
        times, ok = [], True
        for step in range(warmup + iters):
            for t in tensors:
                t.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            if mode == "tensor":
                for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                    assert work is not None
                    work.wait()
            else:
                flats = [torch.cat([t.reshape(-1) for t in bucket]) for bucket in buckets]
                for work in [dist.all_reduce(flat, async_op=True) for flat in flats]:
                    assert work is not None
                    work.wait()
                for flat, bucket in zip(flats, buckets, strict=True):
                    offset = 0
                    for t in bucket:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
            clock[0] = time.perf_counter() - start
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            if step == 0:
                ok = all(bool((t == world).all()) for t in tensors)
            if step >= warmup:
                times.append(float(clock[0]))
        results[workload] = {"ok": ok, "times": times}
    dist.barrier()
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------


def _collect(workers: list[subprocess.Popen[str]], timeout: float, what: str) -> dict[str, Any]:
    outputs = [w.communicate(timeout=timeout)[0] for w in workers]
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("{")]
    if len(lines) != 1 or any(w.returncode for w in workers):
        raise RuntimeError(f"{what} workers failed: {[w.returncode for w in workers]}")
    result: dict[str, Any] = json.loads(lines[0])
    return result


def _common(args: argparse.Namespace) -> list[str]:
    return ["--world", str(args.world), "--iters", str(args.iters), "--warmup",
            str(args.warmup), "--workloads", ",".join(args.workloads)]


def run_pccl(args: argparse.Namespace, bucket_bytes: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PCCL_TRIO_RUN_SECRET", None)
    with master_process(
        "--insecure", "--log-level", "ERROR", "--liveness-timeout", "10",
        "--heartbeat-interval", "1", env=env,
    ) as (_master, address):
        workers = [subprocess.Popen(
            [sys.executable, __file__, "pccl-worker", address, "--bucket-bytes",
             str(bucket_bytes), "--slice-bytes", str(args.slice_bytes), *_common(args)],
            stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(args.world)]
        return _collect(workers, args.timeout, "pccl_trio")


def run_gloo(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    port = free_port()
    workers = [subprocess.Popen(
        [sys.executable, __file__, "gloo-worker", "--rank", str(rank), "--port", str(port),
         "--mode", mode, "--torch-threads", str(args.torch_threads), *_common(args)],
        stdout=subprocess.PIPE, text=True, env=env)
        for rank in range(args.world)]
    return _collect(workers, args.timeout, "gloo")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="driver",
                        choices=["driver", "pccl-worker", "gloo-worker"])
    parser.add_argument("master", nargs="?", default="")
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--buckets", default=None,
                        help="comma list of Config.bucket_bytes to sweep (K/M suffixes; 0: "
                             "no fusion); default 0,1M,4M,16M,25M and the library default")
    parser.add_argument("--iters", type=int, default=None, help="steps per launch (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the default bucket size only, 5 steps unless --iters says")
    parser.add_argument("--slice-bytes", type=parse_size, default=Config().slice_bytes,
                        help="pccl_trio's Config.slice_bytes (default: the library's)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch.set_num_threads in the Gloo workers (0: torch's default; "
                             "W processes of torch's default on few cores oversubscribe them)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=Path("steps.json"))
    # worker arguments
    parser.add_argument("--bucket-bytes", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", default="tensor")
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    if args.role == "pccl-worker":
        import trio

        trio.run(_pccl_worker, args.master, args.world, args.bucket_bytes, args.iters,
                 args.warmup, args.workloads, args.slice_bytes)
        return 0
    if args.role == "gloo-worker":
        _gloo_worker(args.rank, args.world, args.port, args.mode, args.iters, args.warmup,
                     args.workloads, args.torch_threads)
        return 0

    import pccl_trio as pccl

    default = pccl.Config().bucket_bytes
    if args.iters is None:
        args.iters = 5 if args.quick else 10
    if args.quick:
        buckets = [default]
    elif args.buckets:
        buckets = [parse_size(b) for b in args.buckets.split(",")]
    else:
        buckets = sorted({0, 1 << 20, 4 << 20, 16 << 20, 25 << 20, default})
    libraries = [f"pccl {format_size(b) if b else '0 (no fusion)'}" for b in buckets]
    libraries += ["gloo/tensor", "gloo/ddp"]
    medians: dict[str, dict[str, list[float]]] = {lib: {} for lib in libraries}
    print(f"# steps at W={args.world} on 127.0.0.1: iters={args.iters} warmup={args.warmup} "
          f"repeats={args.repeats}; pccl_trio default bucket_bytes={format_size(default)}",
          flush=True)
    for repeat in range(args.repeats):
        for library in libraries:
            if library.startswith("pccl"):
                result = run_pccl(args, buckets[libraries.index(library)])
            else:
                result = run_gloo(args, library.split("/")[1])
            for workload in args.workloads:
                if not result[workload]["ok"]:
                    raise RuntimeError(f"{library}: wrong result on {workload}")
                medians[library].setdefault(workload, []).append(
                    statistics.median(result[workload]["times"]))
        print(f"# repeat {repeat + 1}/{args.repeats} done", flush=True)
    rows = []
    header = (f"{'workload':>12} {'library':>18} {'median ms':>10} {'range ms':>17} "
              f"{'vs gloo/tensor':>15} {'vs gloo/ddp':>12}")
    print(header)
    print("-" * len(header))
    for workload in args.workloads:
        per_tensor = statistics.median(medians["gloo/tensor"][workload])
        ddp = statistics.median(medians["gloo/ddp"][workload])
        for library in libraries:
            runs = medians[library][workload]
            ours = statistics.median(runs)
            print(f"{workload:>12} {library:>18} {ours * 1e3:>10.2f} "
                  f"{min(runs) * 1e3:>8.2f}..{max(runs) * 1e3:<8.2f}"
                  f"{per_tensor / ours:>14.2f}x {ddp / ours:>11.2f}x")
            rows.append({"workload": workload, "library": library, "median_s": ours,
                         "launch_medians_s": runs, "vs_gloo_tensor": per_tensor / ours,
                         "vs_gloo_ddp": ddp / ours})
        # A library 3x as fast as Gloo per tensor is this much faster than Gloo's
        # buckets: what the same bytes in the same buckets would have to reach.
        print(f"{'':>12} 3x gloo/tensor = {3 * ddp / per_tensor:.2f}x gloo/ddp")
    meta = {"world": args.world, "iters": args.iters, "warmup": args.warmup,
            "repeats": args.repeats, "default_bucket_bytes": default,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
