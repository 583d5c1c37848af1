"""Quantized codecs (MIN_MAX and ZERO_POINT_SCALE) against the formulas of their module docstring.

The error bound every round trip is held to: a value inside the block's range decodes within half
a quantization step (``step`` for MIN_MAX, ``scale`` for ZERO_POINT_SCALE, both read back from the
block's metadata) of itself, plus two roundings:

* the arithmetic, done in the compute dtype ``c`` (float32, or float64 for float64 buffers, 32-bit
  codes and large zero points). Encoding is one subtraction or division and one multiplication,
  each off by at most one unit roundoff ``u = eps(c) / 2`` relative to a magnitude of at most the
  block's span (<= 2 max|x|); decoding is one multiplication and one addition of the same size.
  That moves the index by at most ~4 u Q, i.e. ~4 u span in value, and the decoded value by ~3 u
  span more: about 14 u max|x| in all, so ``8 eps(c) max|x|`` (16 u) covers it, and a few of
  ``c``'s smallest subnormals cover underflow, where relative bounds stop holding;
* the final cast to the buffer dtype, which moves a value by at most half an ulp of the result.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pccl_trio import DataType, DistributionHint, InvalidArgument, QuantizationAlgorithm, ReduceOp
from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio.ops import META_BYTES, Codec, NonFiniteData, check_quantization, to_numpy_dtype

MIN_MAX = QuantizationAlgorithm.MIN_MAX
ZPS = QuantizationAlgorithm.ZERO_POINT_SCALE
SOURCES = [DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE]
CODES = {
    MIN_MAX: [DataType.UINT8, DataType.UINT16, DataType.UINT32],
    ZPS: [DataType.UINT8, DataType.UINT16],
}
SCHEMES = [(algorithm, code) for algorithm, codes in CODES.items() for code in codes]


def accepted(source: DataType, code: DataType) -> bool:
    """check_quantization refuses codes wider than the buffer's elements."""
    return to_numpy_dtype(code).itemsize <= to_numpy_dtype(source).itemsize


#: Every (buffer dtype, algorithm, code dtype) that check_quantization accepts.
COMBINATIONS = [
    (source, algorithm, code) for source in SOURCES for algorithm, code in SCHEMES
    if accepted(source, code)
]
OPS = {MIN_MAX: list(ReduceOp), ZPS: [ReduceOp.SUM, ReduceOp.AVG]}
UFUNCS = {
    ReduceOp.SUM: numpy.add,
    ReduceOp.AVG: numpy.add,  # AVG accumulates as SUM
    ReduceOp.PROD: numpy.multiply,
    ReduceOp.MAX: numpy.maximum,
    ReduceOp.MIN: numpy.minimum,
}

#: The same examples on every run, no example database, no per-example deadline.
DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)


def name_of_case(value: Any) -> str:
    """Test ids that also spell out strings and metadata tuples."""
    if isinstance(value, str):
        return value
    if isinstance(value, tuple) and all(isinstance(part, float) for part in value):
        return "meta=" + ",".join(repr(part) for part in value)
    return name_of(value)


def name_of(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(f"{part:g}" for part in value)
    if isinstance(value, tuple):
        return "-".join(name_of(part) for part in value)
    return str(value.name)


def rng_for(*parts: Any) -> numpy.random.Generator:
    """A generator seeded by the test's parameters, so every case is reproducible on its own."""
    return numpy.random.default_rng([abs(p) if isinstance(p, int) else p.value for p in parts])


def finfo(dtype: Any) -> Any:
    return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]


def largest(source: DataType) -> float:
    return float(finfo(to_numpy_dtype(source)).max)


def levels(code: DataType) -> int:
    return (1 << (8 * to_numpy_dtype(code).itemsize)) - 1


def codec_for(
    source: DataType,
    algorithm: QuantizationAlgorithm,
    code: DataType,
    hint: DistributionHint = DistributionHint.NONE,
) -> Codec:
    return Codec(numpy, to_numpy_dtype(source), algorithm, code, hint)


def encode(codec: Codec, values: Any) -> tuple[numpy.ndarray, int]:
    """The block of ``values`` (written over garbage) and the count of clamped values."""
    block = numpy.full(codec.block_bytes(values.size), 0xA5, numpy.uint8)
    clamped = codec.encode(values, block)
    return block, clamped


def decode(codec: Codec, block: numpy.ndarray, count: int) -> Any:
    out = numpy.full(count, numpy.nan, codec.dtype)
    codec.decode(block, out)
    return out


def round_trip(codec: Codec, values: Any) -> tuple[Any, numpy.ndarray, int]:
    block, clamped = encode(codec, values)
    return decode(codec, block, values.size), block, clamped


def metadata(block: numpy.ndarray) -> tuple[float, float]:
    first, second = block[:META_BYTES].view("<f8").tolist()
    return first, second


def forge(codec: Codec, meta: tuple[float, float], codes: list[int]) -> numpy.ndarray:
    """A block with the given metadata and codes, as a peer could send it."""
    block = numpy.zeros(codec.block_bytes(len(codes)), numpy.uint8)
    block[:META_BYTES].view("<f8")[:] = meta
    block[META_BYTES:].view(codec.code_dtype)[:] = codes
    return block


def as_float64(values: Any) -> Any:
    return numpy.asarray(values).astype(numpy.float64)


def same_bytes(a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())


@contextmanager
def quiet() -> Iterator[None]:
    """Ignore numpy's RuntimeWarnings: for tests about values (warnings have their own tests)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def compute_dtype(dtype: Any, code: DataType, zero_point: float = 0.0) -> numpy.dtype[Any]:
    """The docstring's compute dtype: float64 for float64 buffers, 32-bit codes, or a zero point
    beyond 2**23 (a 16-bit code added stays within float32's exact integers); float32 otherwise,
    though the codec may use float64 there too (which only tightens the bound)."""
    wide = (
        numpy.dtype(dtype) == numpy.float64
        or to_numpy_dtype(code).itemsize > 2
        or abs(zero_point) > 2.0**23
    )
    return numpy.dtype(numpy.float64 if wide else numpy.float32)


def half_ulp(values: Any, dtype: Any) -> Any:
    """Half the spacing above each ``|value|`` in ``dtype``: the most that rounding a number to
    nearest can move it, when the rounded result is ``value``."""
    info = finfo(dtype)
    magnitude = numpy.abs(as_float64(values))
    _, exponent = numpy.frexp(magnitude)  # |v| = m * 2**exponent with 0.5 <= m < 1
    exponent = numpy.where(magnitude == 0.0, info.minexp, numpy.maximum(exponent - 1, info.minexp))
    return numpy.ldexp(0.5, exponent - int(info.nmant))


def step_and_edges(codec: Codec, code: DataType, block: numpy.ndarray) -> tuple[float, float, float, float]:
    """``(step, lowest, highest, zero_point)``: the quantization step and the values that the
    codes 0 and Q decode to (exactly, in float64), from the block's metadata."""
    first, second = metadata(block)
    q = levels(code)
    with numpy.errstate(over="ignore"):
        if codec.algorithm is MIN_MAX:
            return second, first, float(numpy.float64(first) + q * numpy.float64(second)), 0.0
        return first, -second * first, float((q - second) * numpy.float64(first)), second


def assert_within_bound(
    codec: Codec, code: DataType, values: Any, block: numpy.ndarray, decoded: Any, *,
    clamp_to_range: bool = False, step: float | None = None,
) -> None:
    """Every decoded value is within ``step / 2`` of its value (or, with ``clamp_to_range``, of
    its value clamped to the block's encoded range), plus the arithmetic's and the cast's
    rounding (see the module docstring). ``step`` defaults to the one in the metadata."""
    meta_step, lowest, highest, zero_point = step_and_edges(codec, code, block)
    step = meta_step if step is None else step
    x = as_float64(values)
    got = as_float64(decoded)
    assert numpy.isfinite(got).all(), f"non-finite decoded values: {got[~numpy.isfinite(got)]}"
    target = numpy.clip(x, lowest, highest) if clamp_to_range else x
    compute = finfo(compute_dtype(codec.dtype, code, zero_point))
    biggest = float(numpy.abs(x).max()) if x.size else 0.0
    arithmetic = 8 * float(compute.eps) * biggest + 4 * float(compute.smallest_subnormal)
    bound = step / 2 + arithmetic + half_ulp(decoded, codec.dtype)
    error = numpy.abs(got - target)
    bad = numpy.flatnonzero(~(error <= bound))
    assert bad.size == 0, (
        f"{bad.size} values beyond the bound, first: x={x[bad[0]]!r} decoded={got[bad[0]]!r} "
        f"error={error[bad[0]]!r} bound={bound[bad[0]]!r} (step={step!r}, meta={metadata(block)})"
    )


# --- strategies ----------------------------------------------------------------------------


def finite_arrays(source: DataType) -> st.SearchStrategy[Any]:
    """Finite arrays of ``source``: values from anywhere in the dtype's range (but spanning less
    than its largest finite value, see test_wide_spans_round_trip), and clusters of values close
    together far from zero."""
    dtype = to_numpy_dtype(source)
    limit = largest(source) * (1.0 if source is DataType.FLOAT16 else 0.49)
    anywhere = st.lists(
        st.floats(-limit, limit, allow_nan=False, allow_infinity=False), min_size=1, max_size=40
    )
    clustered = st.builds(
        lambda base, spread, units: [base + spread * unit for unit in units],
        st.floats(-min(limit, 1e6), min(limit, 1e6)),
        st.floats(1e-6, 1e3),
        st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=40),
    )
    return st.one_of(anywhere, clustered).map(
        lambda xs: numpy.clip(numpy.array(xs), -limit, limit).astype(dtype)
    )


# --- the error bound ---------------------------------------------------------------------


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
@DETERMINISTIC
@given(data=st.data())
def test_round_trip_is_within_half_a_step(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType, data: st.DataObject
) -> None:
    hint = data.draw(st.sampled_from(list(DistributionHint)), label="hint")
    values = data.draw(finite_arrays(source), label="values")
    codec = codec_for(source, algorithm, code, hint)
    with quiet():
        decoded, block, clamped = round_trip(codec, values)
    assert decoded.dtype == values.dtype
    x = as_float64(values)
    lo, hi = float(x.min()), float(x.max())
    narrowed = algorithm is ZPS and hint is DistributionHint.NORMAL
    if not narrowed:
        assert clamped == 0
    assert_within_bound(codec, code, values, block, decoded, clamp_to_range=narrowed)
    first, second = metadata(block)
    if algorithm is MIN_MAX:
        # No resolution wasted: the step is the data's span over Q, rounded up (at most to the
        # next float32) so that Q steps cover the span.
        span = hi - lo
        assert first == lo
        assert second * levels(code) >= span
        smallest = float(finfo(numpy.float64).smallest_subnormal)
        assert second <= span / levels(code) * (1 + 2.0**-22) + 2 * smallest
    else:
        scale, zero_point = first, second
        assert zero_point == round(zero_point)
        if not narrowed and lo != hi:
            # The data's span over Q, or the floors that keep the zero point an exact integer
            # (2**-50 of the largest magnitude) and the scale a normal float (2**-1000).
            floor = max(abs(lo), abs(hi)) * 2.0**-50
            # It may be rounded up to the next float32.
            assert scale <= max((hi - lo) / levels(code), floor, 2.0**-1000) * (1 + 2.0**-22)
        if 0 <= zero_point <= levels(code):
            # Zero is in the encoded range: it decodes to exactly zero.
            assert (as_float64(decoded[x == 0.0]) == 0.0).all()
        if not narrowed and lo <= 0.0 <= hi:
            assert 0 <= zero_point <= levels(code)


# Where the step is well above the buffer's resolution, so that rounding to the buffer's dtype
# cannot hide a bias of half a step.
COARSE = [
    *[(source, algorithm, DataType.UINT8) for source in SOURCES for algorithm in (MIN_MAX, ZPS)],
    *[(source, algorithm, DataType.UINT16)
      for source in (DataType.FLOAT, DataType.DOUBLE) for algorithm in (MIN_MAX, ZPS)],
    (DataType.DOUBLE, MIN_MAX, DataType.UINT32),
]


@pytest.mark.parametrize(("source", "algorithm", "code"), COARSE, ids=name_of)
def test_codes_round_to_nearest_without_bias(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    """Truncating instead of rounding would shift every value by -step/2 on average."""
    values = rng_for(source, algorithm, code).standard_normal(20_001).astype(to_numpy_dtype(source))
    codec = codec_for(source, algorithm, code)
    decoded, block, _ = round_trip(codec, values)
    step, *_ = step_and_edges(codec, code, block)
    error = as_float64(decoded) - as_float64(values)
    # Errors about uniform in +-step/2: their mean has a standard deviation of ~0.002 step.
    assert abs(float(error.mean())) < step / 32
    assert float(numpy.abs(error).max()) > step / 4  # the step read back is the one in use


@pytest.mark.parametrize("algorithm", [MIN_MAX, ZPS], ids=name_of)
def test_values_between_levels_go_to_the_nearest_level(algorithm: QuantizationAlgorithm) -> None:
    # [0, 255] in 8 bits: step 1 (and zero point 0), so each value's level is plain to see.
    values = numpy.array([0.0, 255.0, 3.4, 3.6, 100.49, 100.51, 254.6, 0.3, 17.0])
    codec = codec_for(DataType.DOUBLE, algorithm, DataType.UINT8)
    decoded, block, _ = round_trip(codec, values)
    assert metadata(block) == ((0.0, 1.0) if algorithm is MIN_MAX else (1.0, 0.0))
    assert block[META_BYTES:].tolist() == [0, 255, 3, 4, 100, 101, 255, 0, 17]
    assert decoded.tolist() == [0.0, 255.0, 3.0, 4.0, 100.0, 101.0, 255.0, 0.0, 17.0]


# --- constants and ranges ------------------------------------------------------------------

CONSTANTS = [0.0, 1.0, -1.0, 42.0, 85.0, -85.0, 0.1, -1e-3, 65504.0, -65504.0]


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_constant_blocks_decode_exactly(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    dtype = to_numpy_dtype(source)
    info = finfo(dtype)
    specials = [float(info.max), -float(info.max), float(info.smallest_subnormal), float(info.tiny)]
    codec = codec_for(source, algorithm, code)
    for constant in [*CONSTANTS, *specials]:
        values = numpy.full(7, constant).astype(dtype)
        decoded, block, clamped = round_trip(codec, values)
        assert clamped == 0
        assert as_float64(decoded).tolist() == as_float64(values).tolist(), constant
        if algorithm is MIN_MAX:
            assert metadata(block)[1] == 0.0


@pytest.mark.parametrize(("algorithm", "code"), SCHEMES, ids=name_of)
@pytest.mark.parametrize("source", [DataType.FLOAT, DataType.DOUBLE], ids=name_of)
@pytest.mark.parametrize("offset", [-10.0, 9.0, -1000.5], ids=["negative", "positive", "far-negative"])
def test_one_signed_data_uses_its_own_range(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType, offset: float
) -> None:
    """All-negative data quantizes with its real max (all-positive with its real min), not a range
    stretched to zero: the error is within half of (max - min) / Q."""
    rng = rng_for(source, algorithm, code, int(offset))
    values = (offset + rng.uniform(0.0, 1.0, 1001)).astype(to_numpy_dtype(source))
    codec = codec_for(source, algorithm, code)
    decoded, block, _ = round_trip(codec, values)
    x = as_float64(values)
    span_step = (float(x.max()) - float(x.min())) / levels(code)
    assert_within_bound(codec, code, values, block, decoded, step=span_step * (1 + 2.0**-40))


# MIN_MAX decodes near the largest values of float64 by scaling down and back (``codes * step``
# alone would overflow while ``lo + codes * step`` is in range), and float32 buffers with such
# spans are computed in float64.
WIDE_SPANS = {
    # From -max to max (beyond float64 for float64 buffers).
    "full": lambda top: [-top, -top / 3, 0.0, 1.0, top / 2, top],
    # A span of exactly max.
    "half": lambda top: [-top / 2, -1.0, 0.0, top / 2],
}


@pytest.mark.parametrize(
    ("span", "source", "algorithm", "code"),
    [(span, *combination) for span in WIDE_SPANS for combination in COMBINATIONS],
    ids=name_of_case,
)
def test_wide_spans_round_trip(
    span: str, source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    dtype = to_numpy_dtype(source)
    values = numpy.array(WIDE_SPANS[span](largest(source))).astype(dtype)
    codec = codec_for(source, algorithm, code)
    if span == "full" and source is DataType.DOUBLE:
        with pytest.raises(NonFiniteData):
            encode(codec, values)
        return
    with quiet():  # test_codec_is_silent_on_extreme_data checks the warnings
        decoded, block, _ = round_trip(codec, values)
    assert_within_bound(codec, code, values, block, decoded)


@pytest.mark.parametrize("hint", list(DistributionHint), ids=name_of)
@pytest.mark.parametrize("code", CODES[ZPS], ids=name_of)
@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_zero_decodes_to_exactly_zero(source: DataType, code: DataType, hint: DistributionHint) -> None:
    rng = rng_for(source, code, hint)
    dtype = to_numpy_dtype(source)
    codec = codec_for(source, ZPS, code, hint)
    cases = [
        rng.standard_normal(501) * 3.0 + 0.7,  # zero off-centre
        rng.uniform(0.0, 5.0, 501),  # zero below the data, then as its min
        -rng.uniform(0.0, 1e-3, 501),  # zero above the data, then as its max
        rng.uniform(-1e4, 10.0, 501),
    ]
    for values in cases:
        values[::7] = 0.0
        values = values.astype(dtype)
        decoded, _, _ = round_trip(codec, values)
        assert as_float64(decoded[::7]).tolist() == [0.0] * len(decoded[::7])


# --- values that cannot be quantized -------------------------------------------------------


@pytest.mark.parametrize("hint", list(DistributionHint), ids=name_of)
@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_non_finite_values_raise(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType, hint: DistributionHint
) -> None:
    codec = codec_for(source, algorithm, code, hint)
    for bad in (math.nan, math.inf, -math.inf):
        for position in (0, 5, 10):
            values = numpy.linspace(-2.0, 3.0, 11)
            values[position] = bad
            block = numpy.zeros(codec.block_bytes(values.size), numpy.uint8)
            with pytest.raises(NonFiniteData):
                codec.encode(values.astype(codec.dtype), block)
    lone = numpy.full(1, math.nan).astype(codec.dtype)
    with pytest.raises(NonFiniteData):
        codec.encode(lone, numpy.zeros(codec.block_bytes(1), numpy.uint8))


@pytest.mark.parametrize(("algorithm", "code"), SCHEMES, ids=name_of)
@pytest.mark.parametrize(
    "values",
    [[-1e308, 1e308], [-1e308, 0.0, 1e308], [1.7e308, 3.0, -0.2e308]],
    ids=["two", "with-zero", "lopsided"],
)
def test_a_span_beyond_float64_raises(
    algorithm: QuantizationAlgorithm, code: DataType, values: list[float]
) -> None:
    for hint in (DistributionHint.NONE, DistributionHint.UNIFORM):
        codec = codec_for(DataType.DOUBLE, algorithm, code, hint)
        block = numpy.zeros(codec.block_bytes(len(values)), numpy.uint8)
        with pytest.raises(NonFiniteData):
            codec.encode(numpy.array(values), block)


# --- determinism and decode_combine ---------------------------------------------------------


def sample(source: DataType, *seed: Any) -> Any:
    rng = rng_for(source, *seed)
    return (rng.standard_normal(1003) * 3.0 + 0.5).astype(to_numpy_dtype(source))


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_decoding_depends_only_on_the_block(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    values = sample(source, algorithm, code)
    codec = codec_for(source, algorithm, code, DistributionHint.NORMAL)
    block, _ = encode(codec, values)
    first = decode(codec, block, values.size)
    # Into an array holding other values, by another codec (another hint), from an unaligned copy.
    again = numpy.ones(values.size, codec.dtype)
    other = codec_for(source, algorithm, code, DistributionHint.UNIFORM)
    unaligned = numpy.zeros(block.size + 1, numpy.uint8)[1:]
    unaligned[:] = block
    other.decode(unaligned, again)
    assert same_bytes(first, again)
    assert same_bytes(decode(codec, block.copy(), values.size), first)
    # Encoding is deterministic too.
    assert same_bytes(encode(codec, values.copy())[0], block)


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_decode_combine_is_decode_then_the_ufunc(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    values = sample(source, algorithm, code)
    local = sample(source, algorithm, code, 1)
    codec = codec_for(source, algorithm, code)
    block, _ = encode(codec, values)
    decoded = decode(codec, block, values.size)
    for op in OPS[algorithm]:
        expected = numpy.empty_like(local)
        with numpy.errstate(all="ignore"):
            UFUNCS[op](local, decoded, out=expected)
        dst = numpy.full_like(local, numpy.nan)
        codec.decode_combine(block, dst, local, op)
        assert same_bytes(dst, expected), op
        in_place = local.copy()
        codec.decode_combine(block, in_place, in_place, op)
        assert same_bytes(in_place, expected), op


# --- empty blocks and sizes -----------------------------------------------------------------


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_empty_arrays(source: DataType, algorithm: QuantizationAlgorithm, code: DataType) -> None:
    for hint in DistributionHint:
        codec = codec_for(source, algorithm, code, hint)
        empty = numpy.empty(0, codec.dtype)
        assert codec.block_bytes(0) == META_BYTES
        first = numpy.full(META_BYTES, 0xA5, numpy.uint8)
        second = numpy.full(META_BYTES, 0x5A, numpy.uint8)
        assert codec.encode(empty, first) == 0
        assert codec.encode(empty, second) == 0
        assert same_bytes(first, second)  # the metadata is written, whatever was there
        out = numpy.empty(0, codec.dtype)
        codec.decode(first, out)
        codec.decode_combine(first, out, empty, ReduceOp.SUM)
        assert out.shape == (0,)
        with pytest.raises(RemoteProtocolError):
            codec.decode(numpy.zeros(META_BYTES + codec.code_size, numpy.uint8), out)
        with pytest.raises(RemoteProtocolError):
            codec.decode(numpy.zeros(META_BYTES - 1, numpy.uint8), out)


@pytest.mark.parametrize(("algorithm", "code"), SCHEMES, ids=name_of)
def test_block_bytes(algorithm: QuantizationAlgorithm, code: DataType) -> None:
    codec = codec_for(DataType.FLOAT, algorithm, code)
    size = to_numpy_dtype(code).itemsize
    assert codec.code_size == size
    for count in [*range(100), 4095, 1 << 20, (1 << 31) + 3]:
        assert codec.block_bytes(count) == META_BYTES + count * size


def test_encode_refuses_a_block_of_the_wrong_size() -> None:
    codec = codec_for(DataType.FLOAT, MIN_MAX, DataType.UINT8)
    values = numpy.ones(10, numpy.float32)
    for nbytes in (0, META_BYTES, codec.block_bytes(10) - 1, codec.block_bytes(10) + 1):
        with pytest.raises(ValueError, match="needs 26 bytes"):
            codec.encode(values, numpy.zeros(nbytes, numpy.uint8))


# --- blocks from a broken or hostile peer ---------------------------------------------------

BAD_METADATA = {
    MIN_MAX: [
        (math.nan, 1.0), (math.inf, 1.0), (-math.inf, 1.0), (0.0, math.nan), (0.0, math.inf),
        (0.0, -math.inf), (0.0, -1.0), (0.0, -5e-324), (math.nan, math.nan),
    ],
    ZPS: [
        (math.nan, 0.0), (math.inf, 0.0), (-math.inf, 0.0), (0.0, 0.0), (-0.0, 0.0), (-1.0, 0.0),
        (-5e-324, 3.0), (1.0, 0.5), (1.0, -0.5), (1.0, 127.25), (1.0, math.nan), (1.0, math.inf),
        (1.0, -math.inf), (1.0, 2.0**53 + 2), (1.0, -(2.0**53) - 2), (1.0, 1e300),
    ],
}
GOOD_METADATA = {
    MIN_MAX: [(0.0, 0.0), (-3.0, 0.25), (1e-300, 5e-324), (-0.0, 0.0)],
    ZPS: [(1.0, 0.0), (0.5, -7.0), (5e-324, 3.0), (1.0, 2.0**53), (1e-3, -(2.0**53)), (2.0, 255.0)],
}


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_bad_metadata_is_a_protocol_error(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    codec = codec_for(source, algorithm, code)
    codes = [0, 1, 2, levels(code)]
    out = numpy.zeros(len(codes), codec.dtype)
    for meta in BAD_METADATA[algorithm]:
        block = forge(codec, meta, codes)
        with pytest.raises(RemoteProtocolError):
            codec.decode(block, out)
        with pytest.raises(RemoteProtocolError):
            codec.decode_combine(block, out, out.copy(), ReduceOp.SUM)
    for meta in GOOD_METADATA[algorithm]:
        with quiet():  # values beyond the dtype are test_hostile_metadata_is_clipped_to_finite's
            codec.decode(forge(codec, meta, codes), out)
        assert numpy.isfinite(as_float64(out)).all(), meta


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_a_block_of_the_wrong_size_is_a_protocol_error(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    codec = codec_for(source, algorithm, code)
    block, _ = encode(codec, sample(source)[:10])
    out = numpy.zeros(10, codec.dtype)
    for size in (block.size - 1, block.size + 1, block.size - codec.code_size,
                 block.size + codec.code_size, META_BYTES, 0):
        wrong = numpy.zeros(size, numpy.uint8)
        wrong[: min(size, block.size)] = block[:size]
        with pytest.raises(RemoteProtocolError):
            codec.decode(wrong, out)
        with pytest.raises(RemoteProtocolError):
            codec.decode_combine(wrong, out, out.copy(), ReduceOp.SUM)
    for count in (9, 11):  # a valid block, for another count of values
        with pytest.raises(RemoteProtocolError):
            codec.decode(block, numpy.zeros(count, codec.dtype))


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_hostile_metadata_is_clipped_to_finite(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    """Finite metadata that decodes beyond the dtype's range gives its largest finite values."""
    top = largest(source)
    q = levels(code)
    codec = codec_for(source, algorithm, code)
    codes = [0, 1, q // 2, q - 1, q]
    cases: list[tuple[tuple[float, float], list[float | None]]]
    if algorithm is MIN_MAX:
        # From -max up to 3 max; and all of it beyond max.
        cases = [((-top, top / q * 4), [-top, None, None, top, top]),
                 ((top, top / q), [top] * 5)]
    else:
        # From about -16 max to 16 max (the middle code decodes to zero), and all beyond max.
        cases = [((top / 8, q // 2), [-top, -top, 0.0, top, top]),
                 ((top, -3.0), [top] * 5)]
    for meta, expected in cases:
        out = numpy.zeros(len(codes), codec.dtype)
        codec.decode(forge(codec, meta, codes), out)
        got = as_float64(out)
        assert numpy.isfinite(got).all(), (meta, got)
        assert (numpy.abs(got) <= top).all()
        for value, want in zip(got.tolist(), expected, strict=True):
            assert want is None or value == want, (meta, got)


# --- ZERO_POINT_SCALE's distribution hint ---------------------------------------------------


@pytest.mark.parametrize("code", CODES[ZPS], ids=name_of)
@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_normal_hint_clamps_an_outlier_and_resolves_the_bulk(source: DataType, code: DataType) -> None:
    dtype = to_numpy_dtype(source)
    bulk = rng_for(source, code).standard_normal(10_000)
    values = numpy.append(bulk, 1000.0).astype(dtype)
    normal = codec_for(source, ZPS, code, DistributionHint.NORMAL)
    plain = codec_for(source, ZPS, code, DistributionHint.NONE)
    narrow, narrow_block, clamped = round_trip(normal, values)
    wide, wide_block, wide_clamped = round_trip(plain, values)
    assert clamped == 1 and wide_clamped == 0
    # Mean ~0.1 and sigma ~10 with the outlier: a range ~[-4, 60] instead of [-4, 1000].
    narrow_scale, wide_scale = metadata(narrow_block)[0], metadata(wide_block)[0]
    assert narrow_scale < wide_scale / 10
    assert_within_bound(normal, code, values[:-1], narrow_block, narrow[:-1])
    assert_within_bound(plain, code, values, wide_block, wide)
    if code is DataType.UINT8:
        bulk_error = numpy.abs(as_float64(narrow[:-1]) - as_float64(values[:-1])).max()
        wide_error = numpy.abs(as_float64(wide[:-1]) - as_float64(values[:-1])).max()
        assert bulk_error < wide_error / 5
    # The outlier decodes to the top of the range.
    _, _, highest, _ = step_and_edges(normal, code, narrow_block)
    assert 40.0 < float(narrow[-1]) < 100.0
    assert abs(float(narrow[-1]) - highest) <= 1e-2 * highest
    # Without an outlier nothing is clamped, and UNIFORM quantizes as NONE does.
    assert round_trip(normal, values[:-1])[2] == 0
    uniform = codec_for(source, ZPS, code, DistributionHint.UNIFORM)
    assert same_bytes(encode(uniform, values)[0], wide_block)


# --- tiny spans -----------------------------------------------------------------------------


def tiny_spans(source: DataType) -> dict[str, list[float]]:
    dtype = to_numpy_dtype(source)
    sub = float(finfo(dtype).smallest_subnormal)
    one = numpy.ones(1, dtype)

    def after(value: float) -> float:
        start = numpy.full(1, value).astype(dtype)
        return float(numpy.nextafter(start, start * 2)[0])

    return {
        "subnormals": [sub, 2 * sub, 3 * sub, sub],
        "subnormals-around-zero": [-sub, 0.0, sub],
        "one-ulp": [float(one[0]), after(1.0)],
        "one-ulp-negative": [-after(3.0), -3.0],
        "one-ulp-large": [largest(source) / 4, after(largest(source) / 4)],
    }


TINY = ["subnormals", "subnormals-around-zero", "one-ulp", "one-ulp-negative", "one-ulp-large"]


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_tiny_spans(source: DataType, algorithm: QuantizationAlgorithm, code: DataType, case: str) -> None:
    values = numpy.array(tiny_spans(source)[case]).astype(to_numpy_dtype(source))
    for hint in DistributionHint:
        codec = codec_for(source, algorithm, code, hint)
        with quiet():  # test_codec_is_silent_on_extreme_data checks the warnings
            decoded, block, clamped = round_trip(codec, values)
        assert clamped == 0
        assert not numpy.isnan(as_float64(block[:META_BYTES].view("<f8"))).any()
        assert_within_bound(codec, code, values, block, decoded)


# --- check_quantization ---------------------------------------------------------------------

INTEGER_TYPES = [DataType.UINT8, DataType.INT8, DataType.UINT16, DataType.INT16, DataType.UINT32,
                 DataType.INT32, DataType.UINT64, DataType.INT64]


@pytest.mark.parametrize("algorithm", [MIN_MAX, ZPS], ids=name_of)
@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_check_quantization_accepts_what_is_implemented(
    source: DataType, algorithm: QuantizationAlgorithm
) -> None:
    for code in CODES[algorithm]:
        for op in OPS[algorithm]:
            if accepted(source, code):
                check_quantization(algorithm, code, to_numpy_dtype(source), op)


@pytest.mark.parametrize("source", [DataType.FLOAT16, DataType.BFLOAT16], ids=name_of)
def test_check_quantization_refuses_codes_wider_than_the_buffer(source: DataType) -> None:
    dtype = to_numpy_dtype(source)
    with pytest.raises(InvalidArgument, match="narrower quantized_datatype") as raised:
        check_quantization(MIN_MAX, DataType.UINT32, dtype, ReduceOp.SUM)
    assert str(dtype) in str(raised.value) and "UINT32" in str(raised.value)


@pytest.mark.parametrize("algorithm", [MIN_MAX, ZPS], ids=name_of)
@pytest.mark.parametrize("integer", INTEGER_TYPES, ids=name_of)
def test_check_quantization_refuses_integer_buffers(
    integer: DataType, algorithm: QuantizationAlgorithm
) -> None:
    dtype = to_numpy_dtype(integer)
    with pytest.raises(InvalidArgument, match="floating-point buffer") as raised:
        check_quantization(algorithm, DataType.UINT8, dtype, ReduceOp.SUM)
    assert str(dtype) in str(raised.value)


@pytest.mark.parametrize(
    ("algorithm", "code"),
    [(MIN_MAX, code) for code in DataType if code not in CODES[MIN_MAX]]
    + [(ZPS, code) for code in DataType if code not in CODES[ZPS]],
    ids=name_of,
)
def test_check_quantization_refuses_other_code_dtypes(
    algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    for source in SOURCES:
        with pytest.raises(InvalidArgument) as raised:
            check_quantization(algorithm, code, to_numpy_dtype(source), ReduceOp.SUM)
        message = str(raised.value)
        assert code.name in message and algorithm.name in message
        assert all(allowed.name in message for allowed in CODES[algorithm])


@pytest.mark.parametrize("op", [ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN], ids=name_of)
def test_check_quantization_refuses_zero_point_scale_beyond_sums(op: ReduceOp) -> None:
    for source in SOURCES:
        for code in CODES[ZPS]:
            with pytest.raises(InvalidArgument, match=f"SUM and AVG only, got {op.name}") as raised:
                check_quantization(ZPS, code, to_numpy_dtype(source), op)
            assert "MIN_MAX" in str(raised.value)


# --- floating-point conditions -------------------------------------------------------------


def silent(call: Callable[[], object]) -> None:
    """Run ``call`` with every numpy floating-point condition an error, as a strict caller may."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with numpy.errstate(all="raise"):
            call()


@pytest.mark.parametrize(("source", "algorithm", "code"), COMBINATIONS, ids=name_of)
def test_codec_is_silent_on_ordinary_data(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType
) -> None:
    """A caller's strict errstate and warning filters do not break encoding or decoding."""
    values, local = sample(source, algorithm, code), sample(source, algorithm, code, 1)
    for hint in DistributionHint:
        codec = codec_for(source, algorithm, code, hint)
        block = numpy.zeros(codec.block_bytes(values.size), numpy.uint8)
        out = numpy.zeros_like(values)
        silent(functools.partial(codec.encode, values, block))
        silent(functools.partial(codec.decode, block, out))
        silent(functools.partial(codec.decode_combine, block, out, local, ReduceOp.SUM))


def _encode_full_range_min_max() -> None:
    codec = codec_for(DataType.FLOAT, MIN_MAX, DataType.UINT8)
    top = largest(DataType.FLOAT)
    encode(codec, numpy.array([-top, 0.0, top], numpy.float32))


def _decode_combine_full_range_zps() -> None:
    codec = codec_for(DataType.FLOAT, ZPS, DataType.UINT8)
    top = largest(DataType.FLOAT)
    block, _ = encode(codec, numpy.array([-top, 0.0, top], numpy.float32))
    out = numpy.zeros(3, numpy.float32)
    codec.decode_combine(block, out, out.copy(), ReduceOp.SUM)


def _decode_combine_hostile_block() -> None:
    codec = codec_for(DataType.FLOAT, MIN_MAX, DataType.UINT8)
    top = largest(DataType.FLOAT)
    out = numpy.zeros(2, numpy.float32)
    codec.decode_combine(forge(codec, (-top, top / 255 * 4), [0, 255]), out, out.copy(), ReduceOp.SUM)


def _normal_hint_float64_sum_overflows() -> None:
    codec = codec_for(DataType.DOUBLE, ZPS, DataType.UINT8, DistributionHint.NORMAL)
    encode(codec, numpy.array([1.7e308, 1.7e308, 1.6e308]))


def _normal_hint_float32_squares_overflow() -> None:
    codec = codec_for(DataType.FLOAT, ZPS, DataType.UINT8, DistributionHint.NORMAL)
    encode(codec, (rng_for(DataType.FLOAT).standard_normal(100) * 1e20).astype(numpy.float32))


def _zps_float32_subnormals() -> None:
    codec = codec_for(DataType.FLOAT, ZPS, DataType.UINT8)
    sub = float(finfo(numpy.float32).smallest_subnormal)
    encode(codec, numpy.array([-sub, 0.0, sub], numpy.float32))


# --- extreme data -------------------------------------------------------------------------


# Overflows inside the arithmetic (clipped afterwards), and ZERO_POINT_SCALE scales below float32's
# range, raise no numpy warning or FloatingPointError, whatever the caller's errstate: under
# ``-W error`` (as in this test suite) they would be exceptions.
@pytest.mark.parametrize(
    "call",
    [
        _encode_full_range_min_max,
        _decode_combine_full_range_zps,
        _decode_combine_hostile_block,
        _normal_hint_float64_sum_overflows,
        _normal_hint_float32_squares_overflow,
        _zps_float32_subnormals,
    ],
    ids=lambda call: call.__name__.strip("_"),
)
def test_codec_is_silent_on_extreme_data(call: Callable[[], None]) -> None:
    silent(call)


# Metadata that is finite in float64 but beyond float32's range (a hostile or broken peer's) is
# decoded in float64 and clipped, or refused (RemoteProtocolError): never NaN, as ``0 * inf`` in
# float32 would be.
@pytest.mark.parametrize(
    ("source", "algorithm", "code", "meta"),
    [
        (DataType.FLOAT, MIN_MAX, DataType.UINT8, (0.0, 1e39)),
        (DataType.FLOAT, MIN_MAX, DataType.UINT16, (-1e39, 1e39)),
        (DataType.FLOAT16, MIN_MAX, DataType.UINT8, (0.0, 1e39)),
        (DataType.FLOAT, ZPS, DataType.UINT8, (1e39, 0.0)),
        (DataType.FLOAT16, ZPS, DataType.UINT16, (1e39, 3.0)),
        (DataType.BFLOAT16, ZPS, DataType.UINT8, (1e39, 0.0)),
    ],
    ids=name_of_case,
)
def test_metadata_beyond_float32_decodes_to_no_nan(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType, meta: tuple[float, float]
) -> None:
    codec = codec_for(source, algorithm, code)
    codes = [0, 1, 3, levels(code)]
    block = forge(codec, meta, codes)
    out = numpy.zeros(len(codes), codec.dtype)
    try:
        with quiet():
            codec.decode(block, out)
    except RemoteProtocolError:
        return
    got = as_float64(out)
    assert numpy.isfinite(got).all(), got


# DistributionHint.NORMAL's sum of squares would overflow for large magnitudes (|x| above ~1e19 in
# float32, ~1e154 in float64) and silently fall back to the full range; it is taken on scaled
# values, so the outlier is still clamped.
@pytest.mark.parametrize(("source", "magnitude"), [(DataType.FLOAT, 1e20), (DataType.DOUBLE, 1e160)],
                         ids=["FLOAT", "DOUBLE"])
def test_normal_hint_works_at_large_magnitudes(source: DataType, magnitude: float) -> None:
    bulk = rng_for(source).standard_normal(10_000)
    values = (numpy.append(bulk, 1000.0) * magnitude).astype(to_numpy_dtype(source))
    codec = codec_for(source, ZPS, DataType.UINT8, DistributionHint.NORMAL)
    with quiet():
        _, _, clamped = round_trip(codec, values)
    assert clamped == 1


# A step or scale below float32's smallest normal moves the block to float64 arithmetic; one
# below float64's (a subnormal, with little relative precision) is the rounded-up step the codes
# are computed from, so ``lo + q * step`` still lands within half a step plus a few ulps.
@pytest.mark.parametrize(
    ("source", "algorithm", "code", "values"),
    [
        (DataType.FLOAT, MIN_MAX, DataType.UINT16, [0.0, 2.0**-126]),
        (DataType.FLOAT, MIN_MAX, DataType.UINT8, [0.0, 2.0**-127, 2.0**-126]),
        (DataType.FLOAT, ZPS, DataType.UINT16, [2.0**-126, 2.0**-125]),
        (DataType.DOUBLE, MIN_MAX, DataType.UINT32, [0.0, 2.225073858507e-311]),
        (DataType.DOUBLE, MIN_MAX, DataType.UINT32, [-1e-306, 1e-306]),
    ],
    ids=name_of,
)
def test_subnormal_steps(
    source: DataType, algorithm: QuantizationAlgorithm, code: DataType, values: list[float]
) -> None:
    codec = codec_for(source, algorithm, code)
    array = numpy.array(values).astype(to_numpy_dtype(source))
    decoded, block, _ = round_trip(codec, array)
    assert_within_bound(codec, code, array, block, decoded)
