"""The DiLoCo example, ``examples/diloco.py``, in a short run of its demo: three peers,
one SIGKILLed while the others wait for it in an all-reduce, a joiner admitted later;
every peer ends with bit-identical outer parameters and momentum, and the loss fell.
And Top-k sparse with 2-bit values, without churn: bit-identical, over 40 times fewer
bytes than dense."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_demo as run_process_demo

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None,
        reason="needs the examples extra (torch, scikit-learn)",
    ),
]

DILOCO = Path(__file__).resolve().parents[2] / "examples" / "diloco.py"


#: Payload bytes per outer step and peer of the dense float32 all-reduce of the model's
#: 4,810 parameters among three peers: 2 (W - 1) / W of them (up to the ring's rounding).
DENSE_BYTES = 2 * 2 * 4810 * 4 // 3


async def run_demo(*arguments: str) -> tuple[dict[str, Any], str]:
    """The demo with ``arguments``: its ``RESULT`` and its whole output; three peers
    ended bit-identical."""
    summary, output = await run_process_demo(DILOCO, "--seed", "3", "--timeout", "120",
                                             *arguments)
    assert summary["identical"] and summary["peers"] == 3, output
    return summary, output


async def test_diloco_survives_a_kill_and_a_joiner_bit_identical() -> None:
    kill_at, hold_at, outer_steps = 2, 4, 6
    summary, output = await run_demo(
        "--outer-steps", str(outer_steps), "--inner-steps", "20", "--kill-at", str(kill_at),
        "--hold-at", str(hold_at),
    )
    assert summary["killed"] and summary["joiner_finished"], output
    # Three founders up to the kill; the two survivors for the step the victim never
    # reduced; three again from the hold on (the joiner took part for certain).
    worlds = summary["worlds"]
    assert len(worlds) == outer_steps, output
    assert worlds[:kill_at] == [3] * kill_at and worlds[kill_at] == 2, output
    assert worlds[hold_at:] == [3] * (outer_steps - hold_at), output
    assert abs(summary["tx_bytes_per_step"] - DENSE_BYTES) < 0.01 * DENSE_BYTES, output
    assert summary["final_loss"] < 0.5 * summary["first_loss"], output


async def test_diloco_with_topk_sends_few_bytes_and_stays_bit_identical() -> None:
    summary, output = await run_demo(
        "--outer-steps", "6", "--inner-steps", "20", "--kill-at", "0",
        "--compress", "topk:0.01", "--quantize", "--value-bits", "2",
    )
    assert not summary["killed"], output
    # 1 % of the entries, 2-bit values: over 40 times fewer bytes; in six outer steps
    # the sparse run's loss falls less far than dense's (docs/diloco.md).
    assert 0 < summary["tx_bytes_per_step"] * 40 < DENSE_BYTES, output
    assert summary["final_loss"] < 0.75 * summary["first_loss"], output
