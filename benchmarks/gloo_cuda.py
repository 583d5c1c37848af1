"""The Gloo anchor for GPU buffers: torch.distributed's gloo backend all-reducing CUDA
tensors (gloo stages them through host memory), on loopback.

The same methodology and command line as the host anchor that ``pccl-trio bench
--gloo`` runs, so the two compare: W fresh processes per launch, warm-up, then
``--iters`` timed all-reduces of float32 ones (SUM, in place), each after a barrier;
an iteration's time is the maximum over the ranks. It writes
``{"results": [{"size_bytes", "times_s": [[...]], "correct"}]}`` to ``--json``.

    pccl-trio bench --device cuda --gloo benchmarks/gloo_cuda.py --world 2,3,4 \\
        --sizes 64M,256M
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from typing import Any

from pccl_trio._bench import parse_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, size: int, iters: int, warmup: int,
            results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    clock = torch.zeros(1, dtype=torch.float64)
    for _ in range(warmup):
        x.fill_(1.0)
        dist.all_reduce(x)
    x.fill_(1.0)
    dist.all_reduce(x)
    correct = bool(torch.all(x == float(world)).item())
    times = []
    for _ in range(iters):
        x.fill_(1.0)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        clock[0] = time.perf_counter() - start
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        times.append(float(clock[0]))
    dist.barrier()
    if rank == 0:
        results.put({"correct": correct, "times": times})
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="2,3,4")
    parser.add_argument("--sizes", default="64M,256M")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=["cuda"], default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    records = []
    for world in (int(w) for w in args.world.split(",")):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            runs, correct = [], True
            for _ in range(args.repeats):
                queue = context.Queue()
                port = _free_port()
                processes = [
                    context.Process(target=_worker, args=(rank, world, port, size, args.iters,
                                                          args.warmup, queue))
                    for rank in range(world)
                ]
                for process in processes:
                    process.start()
                result = queue.get(timeout=600)
                for process in processes:
                    process.join(timeout=60)
                runs.append(result["times"])
                correct &= result["correct"]
            records.append({"world": world, "size_bytes": size, "times_s": runs,
                            "correct": correct})
            print(json.dumps(records[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"library": "torch.distributed/gloo, CUDA tensors", "results": records}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
