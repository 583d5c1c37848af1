"""pccl_trio over the WAN emulator: 60 ms round trips and 0.1% packet loss on every
path, every host's upload shaped to 200 Mbit/s. Peer processes (``wan_peer.py``) in
the README's loop all-reduce exactly and quantized, sync their shared state, take in a
joiner, lose a peer mid-operation and get their master back after it restarted; every
peer that took a step holds the same results, bit for bit. No timing is asserted: each
wait is for a line the peers print.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pccl_trio.testing import Wan, WanPlan, wan_available

from .wan_peer import contribution

pytestmark = pytest.mark.skipif(not wan_available(), reason="needs root, iproute2 and /dev/net/tun")

PEER = Path(__file__).with_name("wan_peer.py")
PLAN = dict(delay=0.03, loss=0.001, rate="200mbit", seed=3)
#: Seconds any one awaited line may take: generous, as the machine may be loaded.
WAIT = 120.0


class Process:
    """A process on a host of the WAN, its stdout's JSON lines read by a thread."""

    def __init__(self, wan: Wan, host: int, *argv: str, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as stderr:  # the child keeps its own descriptor
            self.popen = wan.start(host, *argv, stdout=subprocess.PIPE, stderr=stderr, env=env)
        self.records: list[dict[str, Any]] = []
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            text = line.decode().strip()
            if text.startswith("{"):
                self._lines.put(json.loads(text))
            elif text:
                self._lines.put({"event": "line", "text": text})
        self._lines.put(None)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        for record in self.records:
            if predicate(record):
                return record
        while True:
            try:
                record = self._lines.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(f"no such line within {WAIT:g}s; saw {self.records}") from None
            if record is None:
                raise AssertionError(f"exited (code {self.popen.wait()}) before the line; saw {self.records}")
            self.records.append(record)
            if predicate(record):
                return record

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == kind]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()
        self._reader.join(timeout=WAIT)  # the end of its output
        assert self.popen.stdout is not None
        self.popen.stdout.close()


class Run:
    """A master on the WAN's last host and peers on the others, with one run secret."""

    def __init__(self, wan: Wan, logs: Path) -> None:
        self.wan = wan
        self.logs = logs
        self.master_host = wan.plan.hosts - 1
        self.address = f"{wan.address(self.master_host)}:48148"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PCCL_TRIO_RUN_SECRET=secrets.token_hex(32))
        self.processes: list[Process] = []

    def master(self) -> Process:
        process = Process(
            self.wan, self.master_host, sys.executable, "-m", "pccl_trio.master", "--listen",
            self.address, "--liveness-timeout", "4", "--heartbeat-interval", "0.5",
            "--log-level", "INFO", env=self.env, log=self._log("master"),
        )
        process.wait_for(lambda r: r.get("text", "").startswith("pccl-trio master listening"))
        self.processes.append(process)
        return process

    def peer(self, host: int, *extra: str) -> Process:
        process = Process(self.wan, host, sys.executable, str(PEER), self.address, "--host",
                          self.wan.address(host), *extra, env=self.env, log=self._log(f"peer{host}"))
        self.processes.append(process)
        return process

    def _log(self, name: str) -> Path:
        return self.logs / f"{len(self.processes)}-{name}.stderr"

    def close(self) -> None:
        """Stop every process and print the end of each one's log (pytest shows it when
        the test failed)."""
        for process in self.processes:
            process.kill()
            lines = process.log.read_text(errors="replace").splitlines()[-40:]
            print(f"--- {process.log.name} ---", *lines, sep="\n")


@pytest.fixture
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Run]:
    hosts = request.param
    with Wan(WanPlan(hosts=hosts, **PLAN), prefix=f"pwl{os.getpid() % 10000}") as wan:  # type: ignore[arg-type]
        started = Run(wan, tmp_path)
        try:
            yield started
        finally:
            started.close()


def steps_agree(peers: list[Process]) -> dict[int, dict[str, Any]]:
    """Every step any peer took, which every peer that took it took alike."""
    taken: dict[int, dict[str, Any]] = {}
    for peer in peers:
        for record in peer.events("step"):
            key = {k: record[k] for k in ("world", "exact", "quantized", "weights")}
            assert taken.setdefault(record["step"], key) == key, (record, taken[record["step"]])
    return taken


def exact_sum(peer_ids: list[int], step: int) -> str:
    total = sum(contribution(p, step).astype(np.float64) for p in peer_ids)
    return hashlib.sha256(np.asarray(total, dtype=np.float32).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("run", [3], indirect=True)
def test_exact_and_quantized_all_reduces_and_a_joiner_over_lossy_long_links(run: Run) -> None:
    run.master()
    founders = [run.peer(0, "--steps", "6"), run.peer(1, "--steps", "6")]
    ids = sorted(f.wait_for(lambda r: r["event"] == "joined")["peer"] for f in founders)
    for founder in founders:
        founder.wait_for(lambda r: r["event"] == "step" and r["step"] >= 2)
    # A third peer on the master's host joins mid-run (a host of the WAN like any).
    joiner = run.peer(run.master_host, "--steps", "6", "--world", "1")
    synced = joiner.wait_for(lambda r: r["event"] == "synced")
    assert synced["rx"] == 4 * 200_000  # the run's weights, fetched over the long link
    for peer in [*founders, joiner]:
        peer.wait_for(lambda r: r["event"] == "finished")
    taken = steps_agree([*founders, joiner])
    assert sorted(taken) == [1, 2, 3, 4, 5, 6]
    assert taken[1]["exact"] == exact_sum(ids, 0)  # exact: the founders' integers, summed
    assert taken[6]["world"] == 3
    assert {p.events("finished")[0]["weights"] for p in [*founders, joiner]} == {taken[6]["weights"]}


@pytest.mark.parametrize("run", [4], indirect=True)
def test_a_peer_killed_mid_all_reduce_and_the_master_restarted(run: Run) -> None:
    master = run.master()
    peers = [run.peer(0, "--steps", "6", "--world", "3"), run.peer(1, "--steps", "6", "--world", "3"),
             run.peer(2, "--steps", "6", "--world", "3", "--pause-at", "2")]
    victim, survivors = peers[2], peers[:2]
    victim.wait_for(lambda r: r["event"] == "in_all_reduce")
    victim.kill()
    for survivor in survivors:
        survivor.wait_for(lambda r: r["event"] == "step" and r["step"] >= 3 and r["world"] == 2)
    # The master dies; a new one starts at the same address, and the run goes on.
    master.kill()
    run.master()
    for survivor in survivors:
        survivor.wait_for(lambda r: r["event"] == "finished")
    taken = steps_agree(survivors)
    assert sorted(taken) == list(range(1, 7))
    assert all(taken[step]["world"] == 2 for step in range(4, 7))
    assert len({s.events("finished")[0]["weights"] for s in survivors}) == 1
