"""A fused bucket's input read in place: the same bytes and bits as a packed copy."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl_trio import ReduceOp
from pccl_trio.ops import Gathered, _gathered, combine_into

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.int8]


def _members(rng: np.random.Generator, sizes: list[int], dtype: Any) -> list[np.ndarray]:
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-100, 100, size).astype(dtype) for size in sizes]
    return [rng.standard_normal(size).astype(dtype) for size in sizes]


@pytest.mark.parametrize("small_pieces", [0, 1 << 30], ids=["per-tensor", "copied-first"])
@settings(derandomize=True, database=None, deadline=None, max_examples=80)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(list(ReduceOp)),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    seed=st.integers(0, 2**16),
)
def test_a_range_reads_as_the_packed_input_would(
    small_pieces: int, sizes: list[int], dtype: Any, op: ReduceOp, cut: tuple[float, float],
    seed: int,
) -> None:
    # Both ways of combining: a kernel call per tensor, and the tensors copied into
    # the target first (below ``SMALL_PIECES`` bytes per tensor).
    saved, _gathered.SMALL_PIECES = _gathered.SMALL_PIECES, small_pieces
    try:
        _check_a_range(sizes, dtype, op, cut, seed)
    finally:
        _gathered.SMALL_PIECES = saved


def _check_a_range(
    sizes: list[int], dtype: Any, op: ReduceOp, cut: tuple[float, float], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    members = _members(rng, sizes, dtype)
    packed = np.concatenate(members)
    gathered = Gathered(members)
    assert gathered.size == packed.size and gathered.nbytes == packed.nbytes
    first, last = sorted(int(c * packed.size) for c in cut)
    itemsize = packed.itemsize
    # gather: the range lands at its own offsets, nothing else is written.
    out = np.full(packed.nbytes, 0xAB, np.uint8)
    gathered.gather(out, first * itemsize, last * itemsize)
    expected = np.full(packed.nbytes, 0xAB, np.uint8)
    expected[first * itemsize:last * itemsize] = packed.view(np.uint8)[first * itemsize:last * itemsize]
    assert out.tobytes() == expected.tobytes()
    # combine: bit for bit what one kernel call over the packed input gives.
    incoming = _members(rng, [last - first], dtype)[0]
    target = np.zeros(last - first, dtype)
    gathered.combine(target, incoming, first * itemsize, op)
    want = np.zeros(last - first, dtype)
    combine_into(np, want, packed[first:last], incoming, op)
    assert target.tobytes() == want.tobytes()
    # The members were only read.
    assert np.concatenate(members).tobytes() == packed.tobytes()


def test_scatter_writes_each_member_its_part() -> None:
    members = [np.zeros(3, np.float32), np.zeros(0, np.float32), np.zeros(2, np.float32)]
    Gathered(members).scatter(np.arange(5, dtype=np.float32))
    assert [m.tolist() for m in members] == [[0, 1, 2], [], [3, 4]]


def test_ranges_must_be_whole_elements_of_the_input() -> None:
    gathered = Gathered([np.zeros(4, np.float32)])
    out = np.zeros(16, np.uint8)
    for start, stop in [(1, 8), (0, 6), (0, 20), (8, 4)]:
        with pytest.raises(ValueError, match="whole elements"):
            gathered.gather(out, start, stop)


def test_members_must_be_flat_and_of_one_dtype() -> None:
    with pytest.raises(ValueError, match="one dtype"):
        Gathered([np.zeros(2, np.float32), np.zeros(2, np.float64)])
    with pytest.raises(ValueError, match="flat"):
        Gathered([np.zeros((2, 2), np.float32)])
    with pytest.raises(ValueError, match="at least one"):
        Gathered([])
