"""The soak driver, ``benchmarks/soak.py``, in short runs: clean through kills, a freeze
and spawns, and failing with the right message when a peer is broken on purpose."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

pytestmark = pytest.mark.process

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


async def soak(tmp_path: Path, *options: str) -> tuple[int, str, dict[str, Any]]:
    summary = tmp_path / "summary.json"
    result = await trio.run_process(
        [sys.executable, str(SOAK), "--json", str(summary), "--progress", "600",
         "--heartbeat-interval", "0.2", *options],
        capture_stdout=True, capture_stderr=True, check=False,
    )
    output = result.stdout.decode() + result.stderr.decode()
    return result.returncode, output, json.loads(summary.read_text())


@pytest.mark.parametrize("seed", [3])
async def test_short_soak_is_clean(tmp_path: Path, seed: int) -> None:
    with trio.fail_after(120):
        code, output, summary = await soak(
            tmp_path, "--minutes", "0.2", "--seed", str(seed), "--interval", "1.5",
            "--initial-peers", "3", "--max-peers", "4", "--freeze-fraction", "0.3",
            "--liveness-timeout", "2",
        )
    assert code == 0, output
    assert summary["clean"] and summary["failure"] is None
    assert summary["kills"] > 0 and summary["spawns"] > 3, output
    assert summary["steps"] > 0 and summary["all_reduces"] >= 2 * summary["steps"], output
    assert summary["max_stall_s"] <= summary["stall_bound_s"]
    assert "soak clean" in output


@pytest.mark.parametrize(
    ("fault", "messages"),
    [
        ("wrong-sum", ("wrong all-reduce result",)),
        # The step's digest or the next sync's received bytes, whichever is read first.
        ("divergence", ("shared state differs", "had diverged")),
        ("hang", ("stall: peer",)),
    ],
)
async def test_soak_catches_a_broken_peer(tmp_path: Path, fault: str, messages: tuple[str, ...]) -> None:
    # One of them runs with a run secret: the master and the peers must still form a run.
    secret = ["--secret"] if fault == "wrong-sum" else []
    with trio.fail_after(120):
        code, output, summary = await soak(
            tmp_path, "--minutes", "1", "--inject", fault, "--interval", "1000", "--initial-peers", "2",
            "--liveness-timeout", "1", "--retry-seconds", "1", *secret,
        )
    assert code == 1, output
    assert not summary["clean"]
    assert any(message in summary["failure"] for message in messages), output
    assert "soak FAILED" in output
