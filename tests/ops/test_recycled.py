"""``Recycled``: a kept buffer comes back only while nobody holds it: not while a view
of it, a view of that view, or a torch tensor made from it through DLPack lives; and
only for the same size, dtype and device."""

from __future__ import annotations

import numpy as np
import torch

from pccl_trio.ops import Recycled
from pccl_trio.testing import StrictDevice

LIKE = np.empty(0, np.float32)


def test_a_buffer_nobody_holds_comes_back() -> None:
    recycled = Recycled()
    first = id(recycled.take("k", np, LIKE, 10))
    assert id(recycled.take("k", np, LIKE, 10)) == first


def test_a_buffer_held_through_a_view_a_view_of_it_or_a_tensor_is_not_handed_out() -> None:
    recycled = Recycled()
    for hold in (lambda b: b[2:5], lambda b: b[1:6][1:2], lambda b: torch.from_dlpack(b[:3])):
        buffer = recycled.take("k", np, LIKE, 10)
        held, kept = hold(buffer), id(buffer)
        buffer[...] = 7.0
        del buffer
        again = recycled.take("k", np, LIKE, 10)
        assert id(again) != kept
        again[...] = 0.0
        assert float(held[0]) == 7.0  # what the holder sees never changes
        del held, again


def test_another_size_dtype_or_device_gets_a_buffer_of_its_own() -> None:
    recycled = Recycled()
    assert recycled.take("k", np, LIKE, 10).shape == (10,)
    assert recycled.take("k", np, LIKE, 11).shape == (11,)
    assert recycled.take("k", np, np.empty(0, np.float64), 11).dtype == np.float64
    device = StrictDevice()
    on_device = recycled.take("k", device, device.empty(0, np.float32), 10)
    assert not isinstance(on_device, np.ndarray)
    kept = id(on_device)
    del on_device
    assert id(recycled.take("k", device, device.empty(0, np.float32), 10)) == kept
