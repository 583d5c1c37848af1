"""A run outlives its master across processes (``benchmarks/failover.py``, in short):
three peer processes train (all-reduce and shared-state sync every step); the master
process is SIGKILLed mid-run and restarted at the same address 1 s later, or a standby
in the peers' address list takes over. No peer exits, the revisions go on without a
gap, no sync moves a byte, every all-reduce is exact and the weights stay
bit-identical: the benchmark checks all of it and exits 1 otherwise. And with no
master at all: peers in network namespaces elect one of themselves to host it, elect
again when its process is SIGKILLed, and hand the run over to a master started by
hand beside the elected one (a split brain, resolved)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import trio

from .conftest import namespaces_work

pytestmark = pytest.mark.process

FAILOVER = Path(__file__).resolve().parents[2] / "benchmarks" / "failover.py"


def failed(output: str, logs: Path, lines: int = 40) -> str:
    """The benchmark's output, then the end of every peer's log: what a failure needs."""
    tails = [
        f"--- {log.name} (last {lines} lines)\n" + "\n".join(log.read_text().splitlines()[-lines:])
        for log in sorted(logs.glob("*.log"))
    ]
    return "\n".join([output, *tails])


async def test_restart_and_standby_keep_the_run_going(tmp_path: Path) -> None:
    summary = tmp_path / "failover.json"
    with trio.fail_after(180):
        result = await trio.run_process(
            [sys.executable, str(FAILOVER), "--repeats", "1", "--steps-before", "5",
             "--steps-after", "5", "--restart-delay", "1", "--json", str(summary),
             "--peer-logs", str(tmp_path)],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, failed(output, tmp_path)
    figures = json.loads(summary.read_text())
    # Every peer stepped again in both cases (3 samples each), the restart one only
    # once the new master was up.
    assert len(figures["restart"]["samples"]) == len(figures["standby"]["samples"]) == 3
    assert min(figures["restart"]["samples"]) >= figures["restart_delay"]


@pytest.mark.skipif(
    not namespaces_work(tc=False) or importlib.util.find_spec("zeroconf") is None,
    reason="needs root, iproute2's ip (network namespaces) and python-zeroconf",
)
async def test_peers_elect_a_master_elect_again_and_hand_over_to_one_started_by_hand(
    tmp_path: Path,
) -> None:
    """Three peer processes in namespaces of their own, given only the run's name: they
    elect one to host the master; SIGKILLing it (master and peer) leaves two survivors
    that elect again and go on, with every check of the restart case. Then, in a
    second run, a master started by hand beside the elected one: two masters of one
    run, and the elected one steps down, every peer going over to the other."""
    summary = tmp_path / "elect.json"
    with trio.fail_after(300):
        result = await trio.run_process(
            [sys.executable, str(FAILOVER), "--cases", "elect,takeover", "--repeats", "1",
             "--steps-before", "5", "--steps-after", "5", "--json", str(summary),
             "--peer-logs", str(tmp_path)],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, failed(output, tmp_path)
    figures = json.loads(summary.read_text())
    assert len(figures["elect"]["samples"]) == 2  # both survivors stepped again
    assert len(figures["takeover"]["samples"]) == 3  # every peer went over
