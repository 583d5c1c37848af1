"""The language-model example, ``examples/char_lm.py``, in a short run of its demo with
``--overlap`` and uint8 pseudo-gradients: three peers, one SIGKILLed while the others
wait for it, a joiner admitted later; every peer ends with the same shared state, and
the held-out loss fell."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .conftest import run_demo

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]

CHAR_LM = Path(__file__).resolve().parents[2] / "examples" / "char_lm.py"


async def test_char_lm_with_overlap_survives_a_kill_and_a_joiner_bit_identical() -> None:
    kill_at, hold_at, outer_steps = 2, 4, 6
    summary, output = await run_demo(
        CHAR_LM, "--outer-steps", str(outer_steps), "--inner-steps", "5", "--kill-at",
        str(kill_at), "--hold-at", str(hold_at), "--batch", "8", "--context", "32",
        "--width", "32", "--layers", "1", "--overlap", "--compress", "uint8",
        "--timeout", "120",
    )
    assert summary["identical"] and summary["peers"] == 3, output
    assert summary["killed"] and summary["joiner_finished"], output
    worlds = summary["worlds"]
    assert worlds[:kill_at] == [3] * kill_at and 2 in worlds and worlds[-1] == 3, output
    assert summary["final_loss"] < summary["first_loss"], output
