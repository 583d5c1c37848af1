"""The DiLoCo example, ``examples/diloco.py``, in a short run of its demo: three peers,
one SIGKILLed while the others wait for it in an all-reduce, a joiner admitted later;
every peer ends with bit-identical outer parameters and momentum, and the loss fell;
dense, and Top-k sparse with uint8 values (the joiner's residual starting at zero)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import trio

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


@pytest.mark.parametrize("compress", [[], ["--compress", "topk:0.01", "--quantize"]],
                         ids=["dense", "topk"])
async def test_diloco_survives_a_kill_and_a_joiner_bit_identical(compress: list[str]) -> None:
    kill_at, hold_at, outer_steps = 2, 4, 6
    with trio.fail_after(150):
        result = await trio.run_process(
            [sys.executable, str(DILOCO), "--outer-steps", str(outer_steps), "--inner-steps", "20",
             "--kill-at", str(kill_at), "--hold-at", str(hold_at), "--seed", "3", "--timeout", "120",
             *compress],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    line = next(line for line in result.stdout.decode().splitlines() if line.startswith("RESULT "))
    summary = json.loads(line.removeprefix("RESULT "))
    assert summary["identical"] and summary["peers"] == 3, output
    assert summary["killed"] and summary["joiner_finished"], output
    # Three founders up to the kill; the two survivors for the step the victim never
    # reduced; three again from the hold on (the joiner took part for certain).
    worlds = summary["worlds"]
    assert len(worlds) == outer_steps, output
    assert worlds[:kill_at] == [3] * kill_at and worlds[kill_at] == 2, output
    assert worlds[hold_at:] == [3] * (outer_steps - hold_at), output
    sent = summary["tx_bytes_per_step"]
    if compress:
        # 1 % of the entries, uint8 values: over 40 times fewer bytes; in six outer
        # steps the sparse run's loss falls less far (docs/diloco.md).
        assert 0 < sent * 40 < DENSE_BYTES, output
        assert summary["final_loss"] < 0.75 * summary["first_loss"], output
    else:
        assert abs(sent - DENSE_BYTES) < 0.01 * DENSE_BYTES, output
        assert summary["final_loss"] < 0.5 * summary["first_loss"], output
