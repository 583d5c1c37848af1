"""``pccl-trio status`` against a running master CLI (with a run secret), the master's
JSON log lines, and its metrics endpoint, all in real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import trio

import pccl_trio as pccl

from .conftest import SECRET, environment

pytestmark = pytest.mark.process


def status(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pccl_trio", "status", *argv], capture_output=True, text=True,
        check=False, timeout=60, env=environment(),
    )


def watch(address: str, secret: Path) -> int:
    """Run ``status --watch`` into a pipe until it printed two views of the run; how
    many it printed."""
    views = 0
    with subprocess.Popen(
        [sys.executable, "-m", "pccl_trio", "status", address, "--secret-file", str(secret),
         "--watch", "--interval", "0.1"],
        stdout=subprocess.PIPE, text=True, env=environment(),
    ) as watcher:
        deadline = threading.Timer(60, watcher.kill)  # a watcher printing only errors
        deadline.start()
        try:
            assert watcher.stdout is not None
            for line in watcher.stdout:
                views += "2 peers in 1 groups" in line
                if views == 2:
                    break
        finally:
            deadline.cancel()
            watcher.kill()
    return views


def test_watch_into_a_pipe_that_closes_exits_quietly() -> None:
    """``status --watch | head -1``: the reader goes away; the watcher ends with 0
    and no traceback (no master is needed: it prints why it cannot reach one)."""
    with subprocess.Popen(
        [sys.executable, "-m", "pccl_trio", "status", "127.0.0.1:1", "--watch", "--interval",
         "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
    ) as watcher:
        assert watcher.stdout is not None and watcher.stderr is not None
        assert "could not reach a master" in watcher.stdout.readline()
        watcher.stdout.close()
        assert watcher.wait(timeout=60) == 0
        assert "Traceback" not in watcher.stderr.read()


def start_master(secret: Path) -> tuple[subprocess.Popen[str], str, str]:
    """A master CLI with a run secret, metrics and JSON logs; it, where its metrics are
    served, and where it listens."""
    master = subprocess.Popen(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0", "--secret-file",
         str(secret), "--metrics", "127.0.0.1:0", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
    )
    assert master.stdout is not None
    metrics_line = master.stdout.readline().strip()
    assert metrics_line.startswith("pccl-trio master metrics on http://"), metrics_line
    address = master.stdout.readline().strip().rsplit(" ", 1)[1]
    return master, metrics_line.rsplit(" ", 1)[1], address


def stop(master: subprocess.Popen[str]) -> str:
    """Stop the master; what it logged."""
    master.terminate()
    return master.communicate(timeout=60)[1]


async def test_status_shows_peers_groups_and_rings(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    master, url, address = start_master(secret)
    try:
        config = pccl.Config(run_secret=SECRET)
        comms = [pccl.Communicator(address, config=config, p2p_host="127.0.0.1") for _ in range(2)]
        with trio.fail_after(60):
            await comms[0].connect()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(comms[1].connect)  # admitted by the member's update
                while comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < 2:
                    await comms[0].update_topology()
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(comm.all_reduce, np.ones(100, dtype=np.float32))

            shown = await trio.to_thread.run_sync(status, address, "--secret-file", str(secret))
            assert shown.returncode == 0, shown.stderr
            ids = sorted(c.peer_id for c in comms)
            assert "2 peers in 1 groups" in shown.stdout
            assert "1 succeeded" in shown.stdout
            for peer_id in ids:
                assert any(line.split()[:2] == [str(peer_id), "0"]
                           for line in shown.stdout.splitlines()), shown.stdout
            as_json = await trio.to_thread.run_sync(
                status, address, "--secret-file", str(secret), "--json"
            )
            reply = json.loads(as_json.stdout)
            assert sorted(p["peer_id"] for p in reply["peers"]) == ids
            assert [sorted(g["ring"]) for g in reply["groups"]] == [ids]
            # Without the secret the master says nothing.
            stranger = await trio.to_thread.run_sync(status, address)
            assert stranger.returncode == 1 and "did not answer" in stranger.stderr
            assert "--secret-file PATH or $PCCL_TRIO_RUN_SECRET" in stranger.stderr
            # Into a pipe, --watch prints each view as it comes.
            views = await trio.to_thread.run_sync(watch, address, secret)
            assert views == 2

            text = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(url, timeout=10).read().decode()
            )
            assert 'pccl_master_collectives_total{outcome="success"} 1.0' in text
            for comm in comms:
                await comm.aclose()
    finally:
        err = stop(master)
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    joined = [line for line in lines if line.get("event") == "joined"]
    assert sorted(line["peer"] for line in joined) == ids
    assert all(line["logger"] == "pccl_trio.master.run" for line in joined)
