"""``pccl-trio bench``: all-reduce throughput of a master and W local peer processes.

Methodology (the same as the Gloo anchor's, so the two compare): W fresh peer
processes on loopback; per size, a few warm-up all-reduces, then ``--iters`` timed
ones, each preceded by a barrier (a tiny all-reduce); an iteration's time is the
maximum over the peers (taken with a MAX all-reduce). One "repeat" is one fresh set of
processes; the table shows the median over repeats of the per-repeat medians.
algbw = size / time; busbw = algbw * 2(W-1)/W (the NCCL-tests convention).

``--gloo`` also runs the Gloo anchor (torch.distributed, from the given script) in
the same session, alternating with pccl_trio, and prints the ratio. ``--protection``
runs pccl_trio once per data protection listed (``none``: no run secret; ``mac``: a
run secret, every frame authenticated; ``encrypt``: payloads encrypted too), alternating
within each repeat, and prints each one's speed relative to the first. ``--metrics
both`` runs each of those without and with metrics (the master serving Prometheus
metrics, every peer recording its own), alternating, to show what they cost. ``--device
cuda`` puts the buffers in GPU memory (cupy arrays; needs the ``gpu`` extra and a
GPU), staged through pinned host memory; ``--device cpu,cuda`` alternates host and GPU
buffers; pass ``--gloo benchmarks/gloo_cuda.py`` to compare with Gloo all-reducing the
same CUDA tensors. For GPU buffers the table also gives the bytes one peer copied to
the host and to the GPU in an all-reduce (``pccl_trio.ops.CROSSINGS``), beside what it
sent; the JSON has them for every row.

The data is ones, whose sum is checked exactly. Quantized, it is zeros and ones in
turn, so that every block carries codes that are read and copied (a constant block's
are not): they encode as the lowest and highest code, which decode to within a few
float32 ulps, and the sum is checked to that. ``--topk F`` times Top-k all-reduces of
ones instead (``compression=pccl.TopK(F)``, its values quantized with ``--quantize``),
the residual zeroed before each, so that every peer keeps the same entries every time:
each kept entry must hold W and every other 0, and the residual must be 0 exactly where
an entry was kept. Its busbw is of the dense size, what the sparse call stands in for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ._config import Config

__all__ = ["bench_main"]

PROTECTIONS = ("none", "mac", "encrypt")
DEVICES = ("cpu", "cuda")
#: What one peer moved in its last timed all-reduce, per size: on the wire, and
#: between host and GPU memory (zero for host buffers).
MOVED = ("tx_bytes", "rx_bytes", "to_host_bytes", "to_device_bytes")


def parse_size(text: str) -> int:
    """'1M', '64MiB', '512K', '1G' or plain bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    scale = 1
    if t and t[-1] in "KMG":
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[t[-1]]
        t = t[:-1]
    return int(float(t) * scale)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a rendezvous that needs one named
    in advance, such as Gloo's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def master_process(*options: str, **popen: Any) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A master CLI listening on 127.0.0.1 (a free port; ``options`` added to its
    command line, ``popen`` passed to ``subprocess.Popen``) for a benchmark's run: the
    process and the address it listens on. Terminated at the end."""
    master = subprocess.Popen(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0", *options],
        stdout=subprocess.PIPE, text=True, **popen,
    )
    try:
        assert master.stdout is not None
        line = master.stdout.readline()
        while line and "listening on" not in line:  # e.g. where its metrics are
            line = master.stdout.readline()
        if not line:
            raise RuntimeError("the master exited before it listened")
        yield master, line.split()[-1]
    finally:
        master.terminate()
        master.wait()


def format_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


# --- the peer process ------------------------------------------------------------------


class _Inputs:
    """One size's buffers of a peer and the check of their result (the module
    docstring says which data each kind of all-reduce gets)."""

    def __init__(self, xp: Any, count: int, world: int, into_recv: bool,
                 quantization: Any, topk: float) -> None:
        import numpy as np

        import pccl_trio as pccl

        self._xp, self._world, self._quantization = xp, world, quantization
        self.base = xp.ones(count, dtype=np.float32)
        if quantization is not None and not topk:
            self.base = (xp.arange(count) % 2).astype(np.float32)
        self.data = xp.empty_like(self.base)
        self.out = xp.empty_like(self.data) if into_recv else None
        self.residual = None
        self.options: dict[str, Any] = {"quantization": quantization}
        if topk:
            self.residual = xp.zeros_like(self.base)
            self.options = {
                "compression": pccl.TopK(topk, residual=self.residual, values=quantization)
            }

    def refill(self) -> None:
        """The input again (and a zero residual: every Top-k call keeps the same)."""
        self._xp.copyto(self.data, self.base)
        if self.residual is not None:
            self.residual.fill(0)

    def correct(self) -> bool:
        """Whether the last all-reduce's result is right."""
        xp, world = self._xp, self._world
        result = self.data if self.out is None else self.out
        if self.residual is not None:  # the kept entries hold the world's sum, others 0
            kept = int(xp.count_nonzero(result))
            return bool(kept and (result[result != 0] == world).all()
                        and kept == int(xp.count_nonzero(self.residual == 0)))
        error = abs(result - self.base * world).max()
        return bool(error == 0 if self._quantization is None else error <= 1e-5 * world)


async def _worker(master: str, world: int, sizes: list[int], iters: int, warmup: int,
                  pool: int, slice_bytes: int, into_recv: bool, host: str, quantize: str,
                  algorithm: str, protection: str, device: str, metrics: bool,
                  leases: bool, congestion_control: str | None, back_to_back: bool,
                  topk: float) -> None:
    import numpy as np

    import pccl_trio as pccl
    from pccl_trio.ops import CROSSINGS

    # The buffers' array module: numpy, or cupy for GPU memory.
    xp: Any = np
    if device == "cuda":
        import cupy  # type: ignore[import-not-found,unused-ignore]

        xp = cupy

    quantization = None
    if quantize != "none":
        quantization = pccl.QuantizationOptions(
            quantized_datatype=pccl.DataType[quantize.upper()],
            algorithm=pccl.QuantizationAlgorithm[algorithm.upper()],
        )
    # The run secret, if any, comes from the environment the driver set.
    registry = None
    if metrics:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    config = pccl.Config(
        slice_bytes=slice_bytes, liveness_timeout=10.0, heartbeat_interval=1.0,
        data_protection="encrypt" if protection == "encrypt" else "mac",
        insecure=protection == "none", metrics=registry, leases=leases,
        congestion_control=congestion_control,
    )
    async with pccl.Communicator(master, 0, pool, config=config, p2p_host=host) as comm:
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            await comm.update_topology()
        barrier = np.zeros(1, dtype=np.float32)
        clock = np.zeros(1, dtype=np.float64)
        results = {}
        for size in sizes:
            inputs = _Inputs(xp, size // 4, world, into_recv, quantization, topk)
            data, out, options = inputs.data, inputs.out, inputs.options
            for _ in range(warmup):
                inputs.refill()
                await comm.all_reduce(data, out, **options)
            inputs.refill()
            await comm.all_reduce(data, out, **options)
            ok = inputs.correct()
            times = []
            if back_to_back:
                # One barrier, then the timed all-reduces one after the other (each peer
                # starts the next as soon as its last returned), each the slowest peer's.
                await comm.all_reduce(barrier, tag=1)
                for _ in range(iters):
                    inputs.refill()
                    start = time.perf_counter()
                    info = await comm.all_reduce(data, out, **options)
                    times.append(time.perf_counter() - start)
                slowest = np.array(times, dtype=np.float64)
                await comm.all_reduce(slowest, op=pccl.ReduceOp.MAX, tag=2)
                times = [float(t) for t in slowest]
                to_host = to_device = 0
            else:
                for _ in range(iters):
                    inputs.refill()
                    await comm.all_reduce(barrier, tag=1)
                    host_before, device_before = CROSSINGS.snapshot()
                    start = time.perf_counter()
                    info = await comm.all_reduce(data, out, **options)
                    clock[0] = time.perf_counter() - start
                    host_after, device_after = CROSSINGS.snapshot()
                    to_host, to_device = host_after - host_before, device_after - device_before
                    await comm.all_reduce(clock, op=pccl.ReduceOp.MAX, tag=2)
                    times.append(float(clock[0]))
            # The last timed one is checked too (outside the clock).
            ok = ok and inputs.correct()
            # This peer's bytes in the last timed all-reduce: on the wire, and (GPU
            # buffers) across PCIe; the barrier and clock are host arrays.
            results[size] = {"ok": ok, "times": times, "tx_bytes": info.tx_bytes,
                             "rx_bytes": info.rx_bytes, "to_host_bytes": to_host,
                             "to_device_bytes": to_device}
        await comm.all_reduce(barrier, tag=1)
        if comm.ring[0] == comm.peer_id:
            print(json.dumps({str(k): v for k, v in results.items()}), flush=True)


def _worker_main(argv: Sequence[str]) -> int:
    import trio

    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pool", type=int, default=0)
    parser.add_argument("--slice-bytes", type=int, default=Config().slice_bytes)
    parser.add_argument("--into-recv", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--algorithm", default="min_max")
    parser.add_argument("--protection", choices=PROTECTIONS, default="none")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--no-leases", action="store_true")
    parser.add_argument("--congestion-control", default=None)
    parser.add_argument("--back-to-back", action="store_true")
    parser.add_argument("--topk", type=float, default=0.0)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    trio.run(_worker, args.master, args.world, sizes, args.iters, args.warmup, args.pool,
             args.slice_bytes, args.into_recv, args.host, args.quantize, args.algorithm,
             args.protection, args.device, args.metrics, not args.no_leases,
             args.congestion_control, args.back_to_back, args.topk)
    return 0


# --- the driver ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the bench's processes run: command prefixes (e.g. ``ip netns exec NS``)
    and addresses. The default is every process on loopback."""

    master_prefix: tuple[str, ...] = ()
    master_listen: str = "127.0.0.1:0"
    worker_prefixes: tuple[tuple[str, ...], ...] = ()
    worker_hosts: tuple[str, ...] = ()

    def worker(self, index: int) -> tuple[tuple[str, ...], str]:
        prefix = self.worker_prefixes[index] if self.worker_prefixes else ()
        host = self.worker_hosts[index] if self.worker_hosts else "127.0.0.1"
        return prefix, host


def _run_pccl(world: int, sizes: list[int], args: argparse.Namespace,
              placement: Placement = Placement(), protection: str = "none",
              metrics: bool = False, device: str = "cpu", leases: bool = True) -> dict[int, Any]:
    """One repeat: a master and ``world`` worker processes; the first worker's results.

    ``args`` needs iters, warmup, pool, slice_bytes, into_recv, timeout and
    (optionally) quantize, algorithm, congestion_control and back_to_back (the timed
    all-reduces one after the other after one barrier, instead of a barrier before
    each). Without protection the run has no secret (and is started insecure, for
    placements off loopback); with it, a fresh secret.
    """
    from ._config import SECRET_ENVIRONMENT

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(SECRET_ENVIRONMENT, None)
    if protection != "none":
        env[SECRET_ENVIRONMENT] = secrets.token_hex(32)
    master = subprocess.Popen(
        [*placement.master_prefix, sys.executable, "-m", "pccl_trio.master",
         "--listen", placement.master_listen, *(["--insecure"] if protection == "none" else []),
         "--log-level", "ERROR", "--liveness-timeout", "10", "--heartbeat-interval", "1",
         *(["--metrics", "127.0.0.1:0"] if metrics else [])],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert master.stdout is not None
        line = master.stdout.readline()
        while line and "listening on" not in line:  # e.g. where its metrics are
            line = master.stdout.readline()
        address = line.split()[-1]
        workers = []
        for index in range(world):
            prefix, host = placement.worker(index)
            workers.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "pccl_trio._bench", "worker", address,
                 "--world", str(world), "--sizes", ",".join(map(str, sizes)),
                 "--iters", str(args.iters), "--warmup", str(args.warmup),
                 "--pool", str(args.pool), "--slice-bytes", str(args.slice_bytes),
                 "--host", host, "--quantize", getattr(args, "quantize", "none"),
                 "--algorithm", getattr(args, "algorithm", "min_max"),
                 "--protection", protection, "--device", device,
                 *(["--metrics"] if metrics else []),
                 *([] if leases else ["--no-leases"]),
                 *(["--congestion-control", args.congestion_control]
                   if getattr(args, "congestion_control", None) else []),
                 *(["--back-to-back"] if getattr(args, "back_to_back", False) else []),
                 *(["--topk", str(args.topk)] if getattr(args, "topk", 0.0) else []),
                 *(["--into-recv"] if args.into_recv else [])],
                stdout=subprocess.PIPE, text=True, env=env,
            ))
        outputs = [w.communicate(timeout=args.timeout)[0] for w in workers]
        lines = [line for out in outputs for line in out.splitlines() if line.startswith("{")]
        if len(lines) != 1 or any(w.returncode for w in workers):
            raise RuntimeError(f"pccl_trio workers failed: {[w.returncode for w in workers]}")
        return {int(k): v for k, v in json.loads(lines[0]).items()}
    finally:
        master.terminate()
        master.wait()


def _run_gloo(script: Path, world: int, sizes: list[int], args: argparse.Namespace,
              device: str = "cpu") -> dict[int, Any]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gloo-{os.getpid()}.json"
    subprocess.run(
        [args.gloo_python or sys.executable, str(script), "--world", str(world),
         "--sizes", ",".join(str(s) for s in sizes), "--iters", str(args.iters),
         "--warmup", str(args.warmup), "--repeats", "1", "--json", str(out),
         *(["--device", device] if device != "cpu" else [])],
        check=True, stdout=subprocess.DEVNULL, timeout=args.timeout,
    )
    records = json.loads(out.read_text())["results"]
    out.unlink()
    return {r["size_bytes"]: {"times": r["times_s"][0], "ok": r.get("correct", True)}
            for r in records if r.get("times_s")}


def bench_main(argv: Sequence[str] | None = None, prog: str = "pccl-trio bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return _worker_main(argv[1:])
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="2,3,4", help="comma list of world sizes")
    parser.add_argument("--sizes", default="1M,64M,256M", help="comma list, K/M/G suffixes")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool", type=int, default=0, help="p2p connections per neighbour")
    parser.add_argument("--slice-bytes", type=int, default=Config().slice_bytes)
    parser.add_argument("--into-recv", action="store_true",
                        help="all_reduce(send, recv) instead of in place: no input to keep "
                             "for a restore, so one copy less per all-reduce (Gloo still runs "
                             "in place)")
    parser.add_argument("--quantize", choices=["none", "uint8", "uint16", "uint32"],
                        default="none", help="quantize the all-reduce to this code dtype")
    parser.add_argument("--algorithm", choices=["min_max", "zero_point_scale"],
                        default="min_max", help="quantization algorithm (with --quantize)")
    parser.add_argument("--topk", type=float, default=0.0, metavar="F",
                        help="a Top-k all-reduce keeping the fraction F of the entries, with "
                             "error feedback (--quantize: its kept values' codes); busbw is "
                             "then of the dense size")
    parser.add_argument("--gloo", metavar="SCRIPT", type=Path, default=None,
                        help="path to the Gloo anchor (gloo_allreduce.py); needs torch")
    parser.add_argument("--gloo-python", metavar="PYTHON", default=None,
                        help="interpreter with torch for the Gloo anchor (default: this one)")
    parser.add_argument("--protection", default="none",
                        help="comma list of data protections to compare: none (no run "
                             "secret), mac (a run secret; frames authenticated), encrypt "
                             "(payloads encrypted too); default none")
    parser.add_argument("--device", default="cpu",
                        help="comma list of where the buffers live: cpu (host memory) or cuda "
                             "(GPU memory, cupy arrays); several alternate, and --gloo then "
                             "all-reduces CUDA tensors")
    parser.add_argument("--metrics", choices=["off", "on", "both"], default="off",
                        help="Prometheus metrics at the master and every peer; both: each run "
                        "without and with them, alternating (needs the observability extra)")
    parser.add_argument("--leases", choices=["on", "off", "both"], default="on",
                        help="leases on repeated tags (Config.leases); both: each run with "
                        "and without them, alternating")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    protections = args.protection.split(",")
    if not protections or any(p not in PROTECTIONS for p in protections):
        parser.error(f"--protection takes a comma list of {', '.join(PROTECTIONS)}")
    devices = args.device.split(",")
    if any(d not in DEVICES for d in devices) or len(set(devices)) < len(devices):
        parser.error(f"--device takes a comma list of {', '.join(DEVICES)}, each once")
    kinds = [
        ("pccl_trio" if p == "none" else f"pccl+{p}", p, False) for p in protections
    ] if args.metrics != "on" else []
    if args.metrics != "off":
        kinds += [
            ("pccl+metrics" if p == "none" else f"pccl+{p}+met", p, True) for p in protections
        ]
    # What runs, alternating: (label, protection, metrics, device, leases).
    leasing = {"on": [True], "off": [False], "both": [True, False]}[args.leases]
    variants = [
        (label + ("" if lease or args.leases == "off" else "-nolease")
         + (f"@{'gpu' if d == 'cuda' else 'host'}" if len(devices) > 1 else ""), p, m, d, lease)
        for d in devices for label, p, m in kinds for lease in leasing
    ]
    first = variants[0][0]
    gloo_device = "cuda" if "cuda" in devices else "cpu"
    width = max(13, *(len(v[0]) for v in variants))  # of the library column

    quantized = "" if args.quantize == "none" else f" quantized {args.algorithm}->{args.quantize}"
    if args.topk:
        quantized = f" Top-k {args.topk:g} (values{quantized or ' float32'})"
    print(f"# all-reduce float32 SUM{quantized} {'into recv' if args.into_recv else 'in place'} "
          f"{' and '.join('GPU' if d == 'cuda' else 'host' for d in devices)} buffers on 127.0.0.1, "
          f"iters={args.iters} warmup={args.warmup} "
          f"repeats={args.repeats} pool={args.pool or 'default'} (GB = 1e9 bytes)")
    header = (f"{'W':>2} {'size':>9} {'library':>{width}} {'median ms':>10} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11}")
    if args.gloo or len(variants) > 1:
        header += f" {'vs ' + ('gloo' if args.gloo else first):>12}"
    print(header)
    print("-" * len(header))
    rows = []
    for world in worlds:
        medians: dict[str, dict[int, list[float]]] = {v[0]: {} for v in variants}
        moved: dict[str, dict[int, dict[str, int]]] = {v[0]: {} for v in variants}
        medians["gloo"] = {}
        for _ in range(args.repeats):
            # Alternate the runs so drift on a shared machine hits all alike.
            for label, protection, metrics, device, lease in variants:
                result = _run_pccl(world, sizes, args, protection=protection, metrics=metrics,
                                   device=device, leases=lease)
                for size in sizes:
                    if not result[size]["ok"]:
                        raise RuntimeError(f"wrong all-reduce result at W={world}, {size} bytes")
                    medians[label].setdefault(size, []).append(
                        statistics.median(result[size]["times"]))
                    moved[label][size] = {k: result[size][k] for k in MOVED}
            if args.gloo:
                gloo = _run_gloo(args.gloo, world, sizes, args, gloo_device)
                for size in sizes:
                    medians["gloo"].setdefault(size, []).append(statistics.median(gloo[size]["times"]))
        factor = 2 * (world - 1) / world
        for size in sizes:
            anchor = statistics.median(medians["gloo" if args.gloo else first][size])
            for label, protection, metrics, device, lease in variants:
                ours = statistics.median(medians[label][size])
                row = {"world": world, "size": size, "protection": protection,
                       "metrics": metrics, "device": device, "leases": lease, "pccl_trio_s": ours,
                       "pccl_trio_busbw": size / ours * factor, **moved[label][size]}
                line = (f"{world:>2} {format_size(size):>9} {label:>{width}} "
                        f"{ours * 1e3:>10.2f} {size / ours / 1e9:>11.3f} "
                        f"{size / ours * factor / 1e9:>11.3f}")
                if args.gloo or len(variants) > 1:
                    line += f" {anchor / ours:>11.2f}x"
                # Each repeat's median too: the spread between launches, and the ratio
                # of the launches run side by side (they share the machine's moment).
                row["pccl_trio_repeats_s"] = medians[label][size]
                if args.gloo:
                    row.update(gloo_device=gloo_device, gloo_s=anchor,
                               gloo_busbw=size / anchor * factor,
                               gloo_repeats_s=medians["gloo"][size])
                print(line)
                rows.append(row)
            for label, _, _, device, _ in variants:
                if device == "cuda":  # what one peer moved in one all-reduce
                    m = moved[label][size]
                    print(f"{'':>{width + 13}} {label}: one peer sent {m['tx_bytes'] / 1e6:.1f} MB, copied "
                          f"{m['to_host_bytes'] / 1e6:.1f} MB to the host and "
                          f"{m['to_device_bytes'] / 1e6:.1f} MB to the GPU")
            if args.gloo:
                print(f"{world:>2} {format_size(size):>9} {'gloo':>{width}} {anchor * 1e3:>10.2f} "
                      f"{size / anchor / 1e9:>11.3f} {size / anchor * factor / 1e9:>11.3f}")
            sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(bench_main())
