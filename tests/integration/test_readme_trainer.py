"""The README's quickstart trainer, run as written: a founder and a peer joining it
mid-run, over loopback TCP, end with the same bits.

The block after the ``readme-trainer`` marker in README.md is executed as it stands;
the test gives ``train`` its model and batches and runs each peer's ``train`` on a
worker thread of its trio run, as each would run in a process of its own. The test
holds the founder once, between two inner steps (in ``next(batches)``), until the
joiner asks to join, so that the run cannot end before it is admitted; for that
``pccl_trio.sync.Communicator`` is replaced, for the test's duration, by a subclass that
records which communicator each thread made (the block's own call makes it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import trio
from torch import nn

import pccl_trio.sync

from .conftest import Masters
from .marked_blocks import ROOT, python_block_after

NETWORKS = ("tcp",)

README = ROOT / "README.md"
MARKER = "<!-- readme-trainer: tests/integration/test_readme_trainer.py runs the next block -->"
OUTER_STEPS = 6
SYNC_EVERY = 50  # the block's
HOLD_AT = 2 * SYNC_EVERY  # the batch the founder waits before (at outer step 2)


def trainer_block() -> str:
    """The python block right after the marker in README.md."""
    return python_block_after(README, MARKER)


def batches(shard: int, hold: Callable[[], None] | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This shard's batches, for ever; ``hold()`` runs before batch ``HOLD_AT``."""
    generator = torch.Generator().manual_seed(shard)
    for index in range(10**9):
        if index == HOLD_AT and hold is not None:
            hold()
        inputs = torch.randn(16, 8, generator=generator)
        yield inputs, (inputs[:, :4].argmax(1) + shard) % 4


def parameters(model: nn.Module) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


async def test_the_readme_trainer_runs_with_a_joiner(
    masters: Masters, clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PCCL_TRIO_RUN_SECRET", raising=False)
    made: dict[int, pccl_trio.sync.Communicator] = {}

    class Recorded(pccl_trio.sync.Communicator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, p2p_host="127.0.0.1", **kwargs)
            made[threading.get_ident()] = self

    monkeypatch.setattr(pccl_trio.sync, "Communicator", Recorded)
    namespace: dict[str, Any] = {"__name__": "readme_trainer"}
    exec(compile(trainer_block(), str(README), "exec"), namespace)
    train = namespace["train"]

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    initial = parameters(models[0])
    token = trio.lowlevel.current_trio_token()
    founder_held = trio.Event()

    def hold() -> None:
        """The founder (alone in the run, so its vote is the run's) waits until the
        joiner asks to join."""
        trio.from_thread.run_sync(founder_held.set, trio_token=token)
        made[threading.get_ident()].are_peers_pending(wait=math.inf)

    with trio.fail_after(120):
        address, _ = await masters.start("master")

        async def peer(shard: int, hold: Callable[[], None] | None) -> None:
            await trio.to_thread.run_sync(
                train, address, models[shard], batches(shard, hold), OUTER_STEPS,
                abandon_on_cancel=True,
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer, 0, hold)
            await founder_held.wait()
            nursery.start_soon(peer, 1, None)
    assert len({parameters(model) for model in models}) == 1
    assert parameters(models[1]) != initial
    for comm in made.values():
        comm.close()
