"""A joiner receiving the shared state: time a new peer's first sync of an S-byte state,
against raw loopback TCP measured in the same run.

Usage: python benchmarks/shared_state.py [--size 1G] [--founders 2] [--tensors 4]
           [--repeats 3] [--anchor ../shared/bench/loopback_tcp.py] [--json out.json]
           [--wan RTT [--rate 1gbit]]

Each repeat starts a master and ``--founders`` peer processes holding the same state
(``--tensors`` float32 tensors adding up to ``--size``), which sync once (nothing moves),
then a joiner process with a zeroed state of the same shape. The founders admit it and
all sync again at the next revision: the joiner fetches every byte. Reported per repeat,
from the joiner's process:

* ``sync``: the whole ``sync_shared_state`` call (hashing its own state for the vote,
  copying the tensors aside in case the fetch fails, the transfer, verifying the hashes);
* ``transfer``: from the first piece taken (its request leaves next) to the last byte
  received, the window the anchor measures; and the rates (bytes / seconds, GB = 1e9
  bytes) of both.

The anchor is one Python TCP stream on 127.0.0.1 (``loopback_tcp.py`` from the anchor
benchmarks), run before the repeats; ratios are to its median.

With ``--wan RTT`` (as root, with iproute2 and /dev/net/tun) every process runs on a
host of its own on the WAN emulator (``pccl_trio.testing.Wan``: every path RTT seconds
round trip, every upload shaped to ``--rate``, MTU 65000, the run without a secret),
and the anchor is the emulator's own ceiling instead: plain TCP from the first
founder's host to the joiner's, 16 streams, measured at the start of every repeat;
ratios are to the median of those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pccl_trio._bench import parse_size
from pccl_trio.testing import Wan, WanPlan, wan_available

WORKER = r"""
import json, sys, time
import numpy as np, trio
import pccl_trio as pccl
from pccl_trio.peer import _shared_state as sharing

role, master = sys.argv[1], sys.argv[2]
founders, size, tensors = (int(a) for a in sys.argv[3:6])
host = sys.argv[6]

def state(zero):
    count = size // 4 // tensors
    out = []
    for i in range(tensors):
        array = np.empty(count, dtype=np.float32)
        if zero:
            array.fill(0)
        else:
            array[:] = np.arange(count, dtype=np.float32) * np.float32(1e-3) + np.float32(i)
        out.append(pccl.TensorInfo(f"t{i}", array))
    return pccl.SharedState(out, revision=0)

# Record the transfer window: from the first piece taken (its request is sent next) to
# the last byte received (counted once a data frame has landed).
window = []
original_take, original_count = sharing.Fetcher.take, sharing.Fetcher.count
def take(self):
    if not window:
        window.append(time.perf_counter())
    return original_take(self)
def count(self, nbytes):
    original_count(self, nbytes)
    window[1:] = [time.perf_counter()]
sharing.Fetcher.take, sharing.Fetcher.count = take, count


async def main():
    config = pccl.Config(liveness_timeout=10.0, heartbeat_interval=0.5,
                         insecure=host != "127.0.0.1")
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host=host) as comm:
        if role == "founder":
            s = state(False)
            while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < founders:
                await comm.update_topology()
            await comm.sync_shared_state(s)
            print(json.dumps({"event": "ready"}), flush=True)
            while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < founders + 1:
                await comm.update_topology()
            s.revision += 1
            info = await comm.sync_shared_state(s)
            print(json.dumps({"event": "done", "tx": info.tx_bytes}), flush=True)
        else:
            s = state(True)
            t0 = time.perf_counter()
            info = await comm.sync_shared_state(s)
            t1 = time.perf_counter()
            expected = state(False)
            ok = all(a.data.tobytes() == b.data.tobytes() for a, b in zip(s.tensors, expected.tensors))
            print(json.dumps({"event": "done", "rx": info.rx_bytes, "sync": t1 - t0,
                              "transfer": window[1] - window[0], "revision": s.revision,
                              "ok": ok}), flush=True)

trio.run(main)
"""


def read_json(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a process exited unexpectedly (code {process.wait()})")
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]


def one_repeat(size: int, founders: int, tensors: int, wan: Wan | None = None) -> dict[str, float]:
    """Founders on hosts 0 .. founders - 1, the joiner on the next, the master on the
    last (all on loopback without ``wan``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def where(index: int) -> tuple[list[str], str]:
        if wan is None:
            return [], "127.0.0.1"
        return wan.command(index), wan.address(index)

    master_prefix, master_host = where(founders + 1)
    master = subprocess.Popen(
        [*master_prefix, sys.executable, "-m", "pccl_trio.master", "--listen", f"{master_host}:0",
         "--log-level", "ERROR", "--liveness-timeout", "10", "--heartbeat-interval", "0.5",
         *(["--insecure"] if wan is not None else [])],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    processes: list[subprocess.Popen[str]] = []
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        args = [address, str(founders), str(size), str(tensors)]

        def start(index: int, role: str) -> subprocess.Popen[str]:
            prefix, host = where(index)
            return subprocess.Popen([*prefix, sys.executable, "-c", WORKER, role, *args, host],
                                    stdout=subprocess.PIPE, text=True, env=env)

        processes = [start(index, "founder") for index in range(founders)]
        for process in processes:
            assert read_json(process)["event"] == "ready"
        joiner = start(founders, "joiner")
        processes.append(joiner)
        result = read_json(joiner)
        sent = [float(read_json(p)["tx"]) for p in processes[:-1]]  # type: ignore[arg-type]
        if not result["ok"] or result["rx"] != size or sum(sent) != size:
            raise RuntimeError(f"bad transfer: {result}, founders sent {sent}")
        return {
            "sync": float(result["sync"]),  # type: ignore[arg-type]
            "transfer": float(result["transfer"]),  # type: ignore[arg-type]
            "sent_min_share": min(sent) / size,
        }
    finally:
        for process in [*processes, master]:
            process.kill()
            process.wait()


def anchor(path: Path, size: int) -> float:
    """Median GB/s of one raw TCP stream moving ``size`` bytes per trial."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tcp.json"
        subprocess.run(
            [sys.executable, str(path), "--total", str(size), "--trials", "5", "--json", str(out)],
            check=True, capture_output=True,
        )
        return float(json.loads(out.read_text())["median_Bps"]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1G")
    parser.add_argument("--founders", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    default_anchor = Path(__file__).resolve().parents[2] / "shared" / "bench" / "loopback_tcp.py"
    parser.add_argument("--anchor", type=Path, default=default_anchor)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--wan", type=float, default=None, metavar="RTT",
                        help="run every process on a host of its own, every path RTT seconds "
                             "round trip (the WAN emulator)")
    parser.add_argument("--rate", default="1gbit", help="with --wan: every host's upload")
    args = parser.parse_args()
    size = parse_size(args.size)
    size -= size % (4 * args.tensors)
    if args.wan is not None:
        if not wan_available():
            print("--wan needs root, iproute2 and /dev/net/tun", file=sys.stderr)
            return 2
        with Wan(WanPlan(hosts=args.founders + 2, delay=args.wan / 2, rate=args.rate)) as wan:
            return measure(args, size, wan)
    return measure(args, size, None)


def measure(args: argparse.Namespace, size: int, wan: Wan | None) -> int:
    ceilings: list[float] = []
    if wan is None:
        raw = anchor(args.anchor, size) if args.anchor.exists() else float("nan")
        print(f"anchor: one raw TCP stream on loopback, median {raw:.2f} GB/s")
    else:
        print(f"# WAN emulator: every path {args.wan * 1e3:g} ms RTT, uploads {args.rate}, "
              f"MTU {wan.plan.mtu}", flush=True)
    runs = []
    for repeat in range(args.repeats):
        if wan is not None:
            # The path the joiner's fetch crosses, from the first founder's host.
            ceilings.append(min(wan.ceiling([(0, args.founders)])) / 1e9)
            print(f"repeat {repeat + 1}: ceiling {ceilings[-1] * 8:.3f} Gbit/s", flush=True)
        run = one_repeat(size, args.founders, args.tensors, wan)
        runs.append(run)
        print(
            f"repeat {repeat + 1}: sync {run['sync']:.3f} s ({size / run['sync'] / 1e9:.2f} GB/s), "
            f"transfer {run['transfer']:.3f} s ({size / run['transfer'] / 1e9:.2f} GB/s), "
            f"smallest founder share {run['sent_min_share']:.0%}",
            flush=True,
        )
        time.sleep(0.5)
    if wan is not None:
        raw = statistics.median(ceilings)
        print(f"ceiling (plain TCP, 16 streams, founder 0 to the joiner): median {raw:.3f} GB/s")
    anchor_name = "raw TCP" if wan is None else "the ceiling"
    sync = statistics.median(r["sync"] for r in runs)
    transfer = statistics.median(r["transfer"] for r in runs)
    summary = {
        "size": size, "founders": args.founders, "tensors": args.tensors,
        "anchor_GBps": raw,
        "anchor": "loopback TCP stream" if wan is None else "WAN emulator ceiling",
        "wan_rtt": args.wan, "rate": args.rate if wan is not None else None,
        "ceilings_GBps": ceilings,
        "sync_s": sync, "sync_GBps": size / sync / 1e9,
        "transfer_s": transfer, "transfer_GBps": size / transfer / 1e9,
        "transfer_ratio": size / transfer / 1e9 / raw,
        "sync_ratio": size / sync / 1e9 / raw,
        "runs": runs,
    }
    print(
        f"median: sync {sync:.3f} s = {summary['sync_GBps']:.2f} GB/s "
        f"({summary['sync_ratio']:.2f}x {anchor_name}); transfer {transfer:.3f} s = "
        f"{summary['transfer_GBps']:.2f} GB/s ({summary['transfer_ratio']:.2f}x {anchor_name})"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
