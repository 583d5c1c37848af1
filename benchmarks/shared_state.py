"""A joiner receiving the shared state: time a new peer's first sync of an S-byte state,
against raw loopback TCP measured in the same run.

Usage: python benchmarks/shared_state.py [--size 1G] [--founders 2] [--tensors 4]
           [--repeats 3] [--anchor ../shared/bench/loopback_tcp.py] [--json out.json]

Each repeat starts a master and ``--founders`` peer processes holding the same state
(``--tensors`` float32 tensors adding up to ``--size``), which sync once (nothing moves),
then a joiner process with a zeroed state of the same shape. The founders admit it and
all sync again at the next revision: the joiner fetches every byte. Reported per repeat,
from the joiner's process:

* ``sync``: the whole ``sync_shared_state`` call (hashing its own state for the vote,
  copying the tensors aside in case the fetch fails, the transfer, verifying the hashes);
* ``transfer``: from the first received byte to the last, the same window the anchor
  measures; and the rates (bytes / seconds, GB = 1e9 bytes) of both.

The anchor is one Python TCP stream on 127.0.0.1 (``loopback_tcp.py`` from the anchor
benchmarks), run before the repeats; ratios are to its median.
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

WORKER = r"""
import json, sys, time
import numpy as np, trio
import pccl_trio as pccl
from pccl_trio.peer import _shared_state as sharing

role, master = sys.argv[1], sys.argv[2]
founders, size, tensors = (int(a) for a in sys.argv[3:6])

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

# Record the transfer window: first and last received byte.
window = []
original = sharing.Fetcher.count
def count(self, nbytes):
    now = time.perf_counter()
    if not window:
        window.append(now)
    original(self, nbytes)
    window[1:] = [now]
sharing.Fetcher.count = count


async def main():
    config = pccl.Config(liveness_timeout=10.0, heartbeat_interval=0.5)
    async with pccl.Communicator(master, 0, 0, config=config, p2p_host="127.0.0.1") as comm:
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


def one_repeat(size: int, founders: int, tensors: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    master = subprocess.Popen(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0", "--log-level",
         "ERROR", "--liveness-timeout", "10", "--heartbeat-interval", "0.5"],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    processes: list[subprocess.Popen[str]] = []
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[-1]
        args = [address, str(founders), str(size), str(tensors)]
        processes = [
            subprocess.Popen([sys.executable, "-c", WORKER, "founder", *args],
                             stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(founders)
        ]
        for process in processes:
            assert read_json(process)["event"] == "ready"
        joiner = subprocess.Popen([sys.executable, "-c", WORKER, "joiner", *args],
                                  stdout=subprocess.PIPE, text=True, env=env)
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
    args = parser.parse_args()
    size = parse_size(args.size)
    size -= size % (4 * args.tensors)

    raw = anchor(args.anchor, size) if args.anchor.exists() else float("nan")
    print(f"anchor: one raw TCP stream on loopback, median {raw:.2f} GB/s")
    runs = []
    for repeat in range(args.repeats):
        run = one_repeat(size, args.founders, args.tensors)
        runs.append(run)
        print(
            f"repeat {repeat + 1}: sync {run['sync']:.3f} s ({size / run['sync'] / 1e9:.2f} GB/s), "
            f"transfer {run['transfer']:.3f} s ({size / run['transfer'] / 1e9:.2f} GB/s), "
            f"smallest founder share {run['sent_min_share']:.0%}",
            flush=True,
        )
        time.sleep(0.5)
    sync = statistics.median(r["sync"] for r in runs)
    transfer = statistics.median(r["transfer"] for r in runs)
    summary = {
        "size": size, "founders": args.founders, "tensors": args.tensors,
        "anchor_GBps": raw,
        "sync_s": sync, "sync_GBps": size / sync / 1e9,
        "transfer_s": transfer, "transfer_GBps": size / transfer / 1e9,
        "transfer_ratio": size / transfer / 1e9 / raw,
        "sync_ratio": size / sync / 1e9 / raw,
        "runs": runs,
    }
    print(
        f"median: sync {sync:.3f} s = {summary['sync_GBps']:.2f} GB/s "
        f"({summary['sync_ratio']:.2f}x raw TCP); transfer {transfer:.3f} s = "
        f"{summary['transfer_GBps']:.2f} GB/s ({summary['transfer_ratio']:.2f}x raw TCP)"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
