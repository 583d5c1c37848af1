"""``state_digest``: the same for the same shared content wherever it lives, different
when one byte, a name or a dtype differs, blind to the revision and to the tensors
whose content may differ."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import pccl_trio as pccl
from pccl_trio.testing import StrictDevice


def state(*tensors: pccl.TensorInfo, revision: int = 0) -> pccl.SharedState:
    return pccl.SharedState(list(tensors), revision=revision)


WEIGHTS = np.random.default_rng(0).standard_normal(1000).astype(np.float32)


def test_the_same_content_in_numpy_and_torch_at_any_revision_has_one_digest() -> None:
    numpy_state = state(pccl.TensorInfo("w", WEIGHTS.copy()), revision=3)
    torch_state = state(pccl.TensorInfo("w", torch.from_numpy(WEIGHTS.copy())), revision=9)
    digest = pccl.state_digest(numpy_state)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert pccl.state_digest(torch_state) == digest


def test_a_state_on_a_device_has_the_digest_of_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    device = StrictDevice()
    monkeypatch.setitem(sys.modules, "cupy", device)
    on_device = state(pccl.TensorInfo("w", device.asarray(WEIGHTS)))
    assert pccl.state_digest(on_device) == pccl.state_digest(state(pccl.TensorInfo("w", WEIGHTS.copy())))


def test_one_byte_a_name_or_a_dtype_changes_it() -> None:
    digest = pccl.state_digest(state(pccl.TensorInfo("w", WEIGHTS.copy())))
    changed = WEIGHTS.copy()
    changed.view(np.uint8)[517] ^= 1
    assert pccl.state_digest(state(pccl.TensorInfo("w", changed))) != digest
    assert pccl.state_digest(state(pccl.TensorInfo("v", WEIGHTS.copy()))) != digest
    same_bytes = WEIGHTS.copy().view(np.int32)
    assert pccl.state_digest(state(pccl.TensorInfo("w", same_bytes))) != digest


def test_the_order_of_tensors_counts_and_free_tensors_do_not() -> None:
    a, b = pccl.TensorInfo("a", WEIGHTS[:500].copy()), pccl.TensorInfo("b", WEIGHTS[500:].copy())
    assert pccl.state_digest(state(a, b)) != pccl.state_digest(state(b, a))
    rng_a = pccl.TensorInfo("rng", np.arange(4), allow_content_inequality=True)
    rng_b = pccl.TensorInfo("rng", np.arange(4) + 7, allow_content_inequality=True)
    assert pccl.state_digest(state(a, b, rng_a)) == pccl.state_digest(state(a, b, rng_b)) == (
        pccl.state_digest(state(a, b))
    )


def test_not_a_state_is_an_invalid_argument() -> None:
    with pytest.raises(pccl.InvalidArgument, match="expected a pccl_trio.SharedState"):
        pccl.state_digest([WEIGHTS])
