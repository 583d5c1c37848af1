"""simplehash: the published test vectors, and agreement with a plain loop implementation."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl_trio.ops import simplehash

MASK = 0xFFFFFFFF


def lcg_bytes(count: int) -> numpy.ndarray:
    """``s = 1664525 s + 1013904223 mod 2**32`` from ``s = 42``; byte ``i`` is ``s_{i+1} % 256``
    (computed in jumps: ``s_{k+j} = A_j s_k + C_j``)."""
    a, c, jump = 1664525, 1013904223, 1 << 16
    powers = numpy.empty(jump, numpy.uint64)
    offsets = numpy.empty(jump, numpy.uint64)
    power, offset = 1, 0
    for j in range(jump):
        power, offset = (power * a) & MASK, (offset * a + c) & MASK
        powers[j], offsets[j] = power, offset
    out = numpy.empty(count, numpy.uint8)
    state = 42
    for start in range(0, count, jump):
        size = min(jump, count - start)
        states = (powers[:size] * numpy.uint64(state) + offsets[:size]) & numpy.uint64(MASK)
        out[start : start + size] = states % 256
        state = int(states[-1])
    return out


@pytest.mark.parametrize(
    ("size", "expected"),
    [(1, 344386053), (4, 3765247898), (25, 3651434421), (154_533_888, 3391090508)],
)
def test_published_vectors(size: int, expected: int) -> None:
    assert simplehash(numpy, lcg_bytes(size)) == expected


def combine(a: int, b: int) -> int:
    a ^= (b + 0x9E3779B1) & MASK
    a = ((a << 7) | (a >> 25)) & MASK
    return (a * 0x85EBCA6B) & MASK


def warp_reduce(values: list[int]) -> int:
    v = list(values)
    offset = 16
    while offset:
        for i in range(offset):
            v[i] = combine(v[i], v[i + offset])
        offset //= 2
    return v[0]


def block_reduce(lanes: list[int]) -> int:
    warps = [warp_reduce(lanes[w * 32 : (w + 1) * 32]) for w in range(8)]
    return warp_reduce(warps + [0] * 24)


def reference(data: bytes) -> int:
    """The algorithm as specified, one thread and one word at a time."""
    n = len(data)
    if n == 0:
        return 0
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, n - n % 4, 4)]
    n_vec = len(words) // 4
    h = 0
    if n_vec:
        grid = min(-(-n_vec // 256), 960)
        per_block = -(-n_vec // grid)
        block_hashes = []
        for block in range(grid):
            start, end = block * per_block, min((block + 1) * per_block, n_vec)
            acc = [0] * 256
            for i in range(start, end, 256):
                for t in range(min(256, end - i)):
                    for w in words[4 * (i + t) : 4 * (i + t) + 4]:
                        acc[t] = combine(acc[t], w)
            block_hashes.append(block_reduce(acc))
        final = [0] * 256
        for section in range(0, grid, 256):
            for t, value in enumerate(block_hashes[section : section + 256]):
                final[t] = combine(final[t], value)
        h = block_reduce(final)
    for w in words[4 * n_vec :]:
        h = combine(h, w)
    if n % 4:
        h = combine(h, int.from_bytes(data[n - n % 4 :], "little"))
    return h


# Sizes around the shape changes: no vector, one block, several full blocks, a short last
# block, and blocks left empty (n_vec = 2049: 9 blocks of 228 vectors, the last with 225).
SIZES = [0, 1, 3, 15, 16, 17, 4095, 4096, 4100, 16 * 257, 16 * 300 + 7, 16 * 2049, 16 * 2049 + 5,
         16 * 5000 + 2]


@pytest.mark.parametrize("size", SIZES)
def test_agrees_with_the_plain_algorithm(size: int) -> None:
    data = numpy.random.default_rng(size).integers(0, 256, size, dtype=numpy.uint8)
    assert simplehash(numpy, data) == reference(data.tobytes())


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@given(st.binary(max_size=6000))
def test_agrees_on_any_bytes(data: bytes) -> None:
    assert simplehash(numpy, numpy.frombuffer(data, numpy.uint8)) == reference(data)


def test_many_blocks_and_sections() -> None:
    """Over 960 blocks' worth of vectors (grid capped, four sections of block hashes)."""
    n_vec = 960 * 256 + 1000
    data = numpy.random.default_rng(1).integers(0, 256, n_vec * 16 + 9, dtype=numpy.uint8)
    assert simplehash(numpy, data) == reference(data.tobytes())


@pytest.mark.parametrize(
    "dtype", [numpy.float32, numpy.float16, ml_dtypes.bfloat16, numpy.int64, numpy.uint8]
)
def test_hashes_bytes_whatever_the_dtype_and_shape(dtype: object) -> None:
    raw = numpy.random.default_rng(3).integers(0, 256, 8 * 999, dtype=numpy.uint8)
    typed = raw.view(dtype)  # type: ignore[call-overload]
    assert simplehash(numpy, typed) == simplehash(numpy, raw)
    assert simplehash(numpy, typed.reshape(3, -1)) == simplehash(numpy, raw)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_do_not_change_the_hash(threads: int) -> None:
    data = numpy.random.default_rng(threads).integers(0, 256, (1 << 24) + 5, dtype=numpy.uint8)
    assert simplehash(numpy, data, threads=threads) == simplehash(numpy, data)


def test_one_flipped_bit_changes_the_hash() -> None:
    data = numpy.random.default_rng(5).integers(0, 256, 1 << 20, dtype=numpy.uint8)
    before = simplehash(numpy, data)
    for position in (0, 12345, data.size - 1):
        data[position] ^= 1
        assert simplehash(numpy, data) != before
        data[position] ^= 1
    assert simplehash(numpy, data) == before


class OtherArrayModule:
    """numpy under another name: drives the code path taken for array modules other than
    numpy (CuPy), whose arrays are not numpy arrays and come back through ``asnumpy``."""

    def __getattr__(self, name: str) -> object:
        return getattr(numpy, name)

    @staticmethod
    def asnumpy(array: object) -> numpy.ndarray:
        return numpy.asarray(array)


@pytest.mark.parametrize("size", [1, 4100, 16 * 2049 + 5, (1 << 22) + 3])
def test_the_other_array_module_path_gives_the_same_hash(size: int) -> None:
    data = numpy.random.default_rng(size).integers(0, 256, size, dtype=numpy.uint8)
    assert simplehash(OtherArrayModule(), data, threads=4) == simplehash(numpy, data)  # type: ignore[arg-type]
