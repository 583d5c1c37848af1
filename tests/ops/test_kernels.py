"""Reduction kernels against straightforward Python references, for every dtype and op."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy
import pytest

from pccl_trio import DataType, InvalidArgument, ReduceOp
from pccl_trio.ops import combine_into, copy_into, finalize_average, reduce_into, to_numpy_dtype

INTEGERS = [d for d in DataType if numpy.issubdtype(to_numpy_dtype(d), numpy.integer)]
FLOATS = [DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE]
HALVES = [DataType.FLOAT16, DataType.BFLOAT16]

# AVG accumulates as SUM: the division is finalize_average's.
PYTHON_OPS: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: operator.add,
    ReduceOp.AVG: operator.add,
    ReduceOp.PROD: operator.mul,
    ReduceOp.MAX: max,
    ReduceOp.MIN: min,
}

# Odd, and longer than any SIMD register, so vector loops and their scalar tails both run.
LENGTH = 1003


def by_name(value: DataType | ReduceOp) -> str:
    return value.name


def rng_for(*parts: DataType | ReduceOp | int) -> numpy.random.Generator:
    """A generator seeded by the test's parameters, so every case is reproducible on its own."""
    return numpy.random.default_rng([p if isinstance(p, int) else p.value for p in parts])


def wrap(value: int, dtype: numpy.dtype[Any]) -> int:
    """``value`` reduced into ``dtype``'s range the way two's-complement hardware wraps it."""
    low, bits = int(numpy.iinfo(dtype).min), int(numpy.iinfo(dtype).bits)
    return (value - low) % (1 << bits) + low


def random_integers(rng: numpy.random.Generator, dtype: numpy.dtype[Any]) -> Any:
    """Integers across the whole range of ``dtype``, led by the extremes."""
    info = numpy.iinfo(dtype)
    extremes = numpy.array(sorted({info.min, info.min + 1, 0, 1, info.max - 1, info.max}), dtype)
    body = rng.integers(info.min, info.max, size=LENGTH - extremes.size, dtype=dtype, endpoint=True)
    return numpy.concatenate([extremes, body])


def pairwise(op: ReduceOp, dst: Any, src: Any, convert: Callable[[Any], Any]) -> list[Any]:
    """The reference: ``op`` applied in Python to each pair of elements, converted first."""
    return [PYTHON_OPS[op](convert(x), convert(y)) for x, y in zip(dst.tolist(), src.tolist(), strict=True)]


def same_bytes(a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and a.tobytes() == b.tobytes())


@pytest.mark.parametrize("op", list(ReduceOp), ids=by_name)
@pytest.mark.parametrize("data_type", INTEGERS, ids=by_name)
def test_reduce_into_integers_wraps_like_twos_complement(data_type: DataType, op: ReduceOp) -> None:
    dtype = to_numpy_dtype(data_type)
    rng = rng_for(data_type, op)
    dst, src = random_integers(rng, dtype), random_integers(rng, dtype)[::-1].copy()
    expected = numpy.array([wrap(value, dtype) for value in pairwise(op, dst, src, int)], dtype)
    reduce_into(numpy, dst, src, op)
    assert same_bytes(dst, expected)


@pytest.mark.parametrize(
    ("dtype", "a", "b", "op", "result"),
    [
        (numpy.int8, 127, 1, ReduceOp.SUM, -128),
        (numpy.uint8, 255, 1, ReduceOp.SUM, 0),
        (numpy.int16, -32768, -1, ReduceOp.SUM, 32767),
        (numpy.int32, 2**16, 2**16, ReduceOp.PROD, 0),
        (numpy.int64, 2**63 - 1, 1, ReduceOp.AVG, -(2**63)),
        (numpy.uint64, 2**64 - 1, 2**64 - 1, ReduceOp.PROD, 1),
    ],
)
def test_integer_overflow_wraps_silently(dtype: Any, a: int, b: int, op: ReduceOp, result: int) -> None:
    dst = numpy.array([a, a], dtype)
    with numpy.errstate(all="raise"):  # a caller's strict errstate must not turn wraparound into errors
        reduce_into(numpy, dst, numpy.array([b, b], dtype), op)
    assert dst.tolist() == [result, result]


@pytest.mark.parametrize("op", list(ReduceOp), ids=by_name)
@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_reduce_into_floats_is_exact_on_small_integers(data_type: DataType, op: ReduceOp) -> None:
    dtype = to_numpy_dtype(data_type)
    rng = rng_for(data_type, op)
    # |sum| <= 16 and |product| <= 64: exact in every float dtype, bfloat16's 8 bits included.
    dst = rng.integers(-8, 9, size=LENGTH).astype(dtype)
    src = rng.integers(-8, 9, size=LENGTH).astype(dtype)
    expected = pairwise(op, dst, src, float)
    reduce_into(numpy, dst, src, op)
    assert dst.dtype == dtype
    assert [float(x) for x in dst.tolist()] == expected


@pytest.mark.parametrize("op", list(ReduceOp), ids=by_name)
@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_reduce_into_floats_rounds_once_to_nearest_even(data_type: DataType, op: ReduceOp) -> None:
    """Each result is the exact result rounded once to the dtype, bit for bit, on every run.

    Computing in binary64 and rounding to the dtype is a correct reference: binary64 holds
    products of these dtypes exactly, and its own rounding of a sum cannot change the final one
    (53 >= 2 * 24 + 2). For bfloat16 this checks ml_dtypes' ufunc loops against it.
    """
    dtype = to_numpy_dtype(data_type)
    rng = rng_for(data_type, op, 1)
    # Magnitudes from 2**-6 to 2**6: products stay normal and finite even in float16.
    scales = numpy.exp2(rng.integers(-4, 5, size=(2, LENGTH)))
    dst, src = (rng.uniform(-4.0, 4.0, size=(2, LENGTH)) * scales).astype(dtype)
    expected = numpy.array(pairwise(op, dst, src, float)).astype(dtype)
    again = dst.copy()
    reduce_into(numpy, dst, src, op)
    reduce_into(numpy, again, src, op)
    assert same_bytes(dst, expected)
    assert same_bytes(again, dst)


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN], ids=by_name)
@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_max_and_min_propagate_nan(data_type: DataType, op: ReduceOp) -> None:
    dtype = to_numpy_dtype(data_type)
    nan, inf = float("nan"), float("inf")
    dst = numpy.array([nan, 1.0, nan, 2.0, -inf], dtype)
    src = numpy.array([1.0, nan, nan, -inf, inf], dtype)
    reduce_into(numpy, dst, src, op)
    assert numpy.isnan(dst[:3].astype(numpy.float64)).all()
    expected = [2.0, inf] if op is ReduceOp.MAX else [-inf, -inf]
    assert [float(x) for x in dst[3:].tolist()] == expected


@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_invalid_float_operations_give_nan_without_warnings(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    dst = numpy.array([float("inf"), 0.0, float("nan")], dtype)
    with numpy.errstate(all="raise"):
        reduce_into(numpy, dst, numpy.array([-float("inf"), 1.0, 1.0], dtype), ReduceOp.SUM)
        reduce_into(numpy, dst, numpy.array([0.0, float("inf"), 1.0], dtype), ReduceOp.PROD)
    values = dst.astype(numpy.float64)
    assert numpy.isnan(values[0]) and values[1] == float("inf") and numpy.isnan(values[2])


@pytest.mark.parametrize("op", list(ReduceOp), ids=by_name)
@pytest.mark.parametrize("data_type", list(DataType), ids=by_name)
def test_reduce_into_empty_arrays_is_a_no_op(data_type: DataType, op: ReduceOp) -> None:
    dtype = to_numpy_dtype(data_type)
    dst = numpy.empty(0, dtype)
    reduce_into(numpy, dst, numpy.empty(0, dtype), op)
    assert dst.shape == (0,) and dst.dtype == dtype


def test_reduce_into_writes_through_a_view_of_the_callers_buffer() -> None:
    buffer = numpy.arange(8, dtype=numpy.int32)
    reduce_into(numpy, buffer[2:5], numpy.full(3, 10, numpy.int32), ReduceOp.SUM)
    assert buffer.tolist() == [0, 1, 12, 13, 14, 5, 6, 7]


@pytest.mark.parametrize("kernel", [copy_into, lambda xp, a, b: reduce_into(xp, a, b, ReduceOp.SUM)])
def test_mismatched_arrays_are_rejected(kernel: Callable[[Any, Any, Any], None]) -> None:
    with pytest.raises(InvalidArgument, match="same dtype and shape"):
        kernel(numpy, numpy.zeros(4, numpy.float32), numpy.zeros(4, numpy.float64))
    with pytest.raises(InvalidArgument, match="same dtype and shape"):
        kernel(numpy, numpy.zeros(4, numpy.float32), numpy.zeros(3, numpy.float32))


@pytest.mark.parametrize("data_type", list(DataType), ids=by_name)
def test_copy_into_copies_the_bytes(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    src = numpy.frombuffer(rng_for(data_type).bytes(dtype.itemsize * LENGTH), dtype)
    dst = numpy.zeros(LENGTH, dtype)
    copy_into(numpy, dst, src)
    assert same_bytes(dst, src)


def truncated(value: int, world_size: int) -> int:
    """C's integer division: the quotient rounded toward zero."""
    quotient = abs(value) // world_size
    return -quotient if value < 0 else quotient


# Small, odd, powers of two, and (for the narrow dtypes) larger than the dtype can hold.
WORLD_SIZES = [1, 2, 3, 4, 7, 64, 127, 128, 129, 200, 255, 256, 257, 1000, 40_000, 2**31 - 1, 2**40]


@pytest.mark.parametrize("data_type", INTEGERS, ids=by_name)
def test_finalize_average_truncates_integers_toward_zero(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    info = numpy.iinfo(dtype)
    values = (
        numpy.arange(info.min, info.max + 1, dtype=dtype)
        if info.bits == 8
        else random_integers(rng_for(data_type), dtype)
    )
    for world_size in [*WORLD_SIZES, min(int(info.max), 2**63 - 1), 2**63 - 1]:
        array = values.copy()
        finalize_average(numpy, array, world_size)
        expected = numpy.array([truncated(int(v), world_size) for v in values.tolist()], dtype)
        assert same_bytes(array, expected), world_size


@pytest.mark.parametrize(
    ("dtype", "values", "world_size", "result"),
    [
        (numpy.int32, [-7, 7, -6, -1, 0], 2, [-3, 3, -3, 0, 0]),
        (numpy.int8, [-128, 127, -127], 128, [-1, 0, 0]),
        (numpy.int64, [-(2**63), 2**63 - 1], 2**63 - 1, [-1, 1]),
        (numpy.uint8, [255, 7, 1], 2, [127, 3, 0]),
        (numpy.uint64, [2**64 - 1], 2**63 - 1, [2]),
    ],
)
def test_finalize_average_integer_examples(
    dtype: Any, values: list[int], world_size: int, result: list[int]
) -> None:
    array = numpy.array(values, dtype)
    finalize_average(numpy, array, world_size)
    assert array.tolist() == result


@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_finalize_average_divides_floats_in_their_dtype(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    rng = rng_for(data_type)
    values = rng.standard_normal(LENGTH).astype(dtype)
    for world_size in [1, 2, 3, 5, 7, 10, 96, 1000]:  # each exact in every float dtype
        array = values.copy()
        finalize_average(numpy, array, world_size)
        # binary64 division rounded to the dtype is the correctly rounded division (see above).
        expected = (values.astype(numpy.float64) / world_size).astype(dtype)
        assert same_bytes(array, expected), world_size


def test_finalize_average_divides_by_the_world_size_rounded_to_the_dtype() -> None:
    # bfloat16 has 8 significant bits: 257 rounds to 256.
    array = numpy.array([512.0, -1024.0], ml_dtypes.bfloat16)
    finalize_average(numpy, array, 257)
    assert array.astype(numpy.float64).tolist() == [2.0, -4.0]


@pytest.mark.parametrize("data_type", FLOATS, ids=by_name)
def test_finalize_average_keeps_nan_and_inf(data_type: DataType) -> None:
    array = numpy.array([float("nan"), float("inf"), -float("inf"), -0.0], to_numpy_dtype(data_type))
    with numpy.errstate(all="raise"):
        finalize_average(numpy, array, 3)
    values = array.astype(numpy.float64)
    assert numpy.isnan(values[0]) and values[1:].tolist() == [float("inf"), -float("inf"), -0.0]
    assert numpy.signbit(values[3])


@pytest.mark.parametrize("data_type", list(DataType), ids=by_name)
def test_finalize_average_is_deterministic_and_handles_empty_arrays(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    values = numpy.frombuffer(rng_for(data_type, 2).bytes(dtype.itemsize * LENGTH), dtype)
    first, second = values.copy(), values.copy()
    finalize_average(numpy, first, 6)
    finalize_average(numpy, second, 6)
    assert same_bytes(first, second)
    empty = numpy.empty(0, dtype)
    finalize_average(numpy, empty, 6)
    assert empty.shape == (0,)


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, 2**63, "2"])
def test_finalize_average_rejects_bad_world_sizes(world_size: Any) -> None:
    with pytest.raises(InvalidArgument, match="world_size"):
        finalize_average(numpy, numpy.ones(2, numpy.float32), world_size)


@pytest.mark.parametrize("op", list(ReduceOp), ids=by_name)
@pytest.mark.parametrize("data_type", list(DataType), ids=by_name)
def test_combine_into_equals_copy_then_reduce(data_type: DataType, op: ReduceOp) -> None:
    """The out-of-place step must give the in-place step's exact bytes (bit-identical
    results whichever form a peer uses), NaN, infinities and wraparound included."""
    dtype = to_numpy_dtype(data_type)
    rng = rng_for(data_type, op, 7)
    if numpy.issubdtype(dtype, numpy.integer):
        local, src = random_integers(rng, dtype), random_integers(rng, dtype)[::-1].copy()
    else:
        specials = numpy.array([numpy.nan, numpy.inf, -numpy.inf, 0.0, -0.0, 6e4, -6e4])
        local = numpy.concatenate([specials, rng.normal(0, 100, LENGTH)]).astype(dtype)
        src = numpy.concatenate([specials[::-1], rng.normal(0, 100, LENGTH)]).astype(dtype)
    expected = numpy.empty_like(local)
    copy_into(numpy, expected, local)
    reduce_into(numpy, expected, src, op)
    dst = numpy.empty_like(local)
    with numpy.errstate(all="raise"):
        combine_into(numpy, dst, local, src, op)
    assert same_bytes(dst, expected)


def test_combine_into_refuses_mismatched_arrays() -> None:
    a = numpy.zeros(4, numpy.float32)
    with pytest.raises(InvalidArgument, match="combine_into"):
        combine_into(numpy, a, numpy.zeros(4, numpy.float64), a, ReduceOp.SUM)
    with pytest.raises(InvalidArgument, match="combine_into"):
        combine_into(numpy, a, a, numpy.zeros(5, numpy.float32), ReduceOp.SUM)
