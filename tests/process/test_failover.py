"""A run outlives its master across processes (``benchmarks/failover.py``, in short):
three peer processes train (all-reduce and shared-state sync every step); the master
process is SIGKILLed mid-run and restarted at the same address 2 s later, or a standby
in the peers' address list takes over. No peer exits, the revisions go on without a
gap, no sync moves a byte, every all-reduce is exact and the weights stay
bit-identical: the benchmark checks all of it and exits 1 otherwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

pytestmark = pytest.mark.process

FAILOVER = Path(__file__).resolve().parents[2] / "benchmarks" / "failover.py"


async def test_restart_and_standby_keep_the_run_going(tmp_path: Path) -> None:
    summary = tmp_path / "failover.json"
    with trio.fail_after(180):
        result = await trio.run_process(
            [sys.executable, str(FAILOVER), "--repeats", "1", "--steps-before", "5",
             "--steps-after", "5", "--json", str(summary)],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    figures = json.loads(summary.read_text())
    # Every peer stepped again in both cases (3 samples each), the restart one only
    # once the new master was up.
    assert len(figures["restart"]["samples"]) == len(figures["standby"]["samples"]) == 3
    assert min(figures["restart"]["samples"]) >= figures["restart_delay"]
