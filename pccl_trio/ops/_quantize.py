"""Quantized encodings of all-reduce slices: min-max and zero-point/scale, to unsigned integers.

Theory of operation
-------------------
A quantized all-reduce sends every slice as one *block*: 16 bytes of metadata (two little-endian
float64) followed by one unsigned integer per element. Each block carries its own metadata, so
every hop quantizes with the spread of exactly the values it sends, and a slice can be encoded
the moment it is ready (the ring stays pipelined).

With ``Q = 2**bits - 1`` and ``x`` the block's values:

* **MIN_MAX**: metadata ``(lo, step)`` with ``lo = min(x)`` and ``step`` the smallest number of
  the compute dtype (below) with ``Q * step >= max(x) - lo``;
  ``q = clip(rint((x - lo) / step), 0, Q)`` (round to nearest), decoded as ``lo + q * step``.
  A constant block has ``step = 0`` and decodes exactly (``-0.0`` included).
* **ZERO_POINT_SCALE**: metadata ``(scale, zero_point)``, ``zero_point`` an integer;
  ``q = clip(rint(x / scale) + zero_point, 0, Q)``, decoded as ``(q - zero_point) * scale``. The
  range ``[lo, hi]`` that ``scale = (hi - lo) / Q`` spans is the data's range, narrowed to
  ``mean ± 6 standard deviations`` under ``DistributionHint.NORMAL`` (values outside are
  clamped, and counted). Zero, when in range, decodes exactly to zero. A constant block ``c``
  uses ``scale = |c|`` and decodes exactly.

Error: a value inside the block's range decodes within ``step / 2`` (``scale / 2``) of itself,
plus the rounding of the arithmetic (a few units in the last place of the compute dtype) and of
the final cast to the buffer's dtype.

The arithmetic runs in float32 for float16, bfloat16 and float32 buffers quantized to 8 or 16
bits when the block's metadata is exact in float32, its step (scale) is a normal float32 and
``|lo| + Q * step`` (``scale * (|zero_point| + Q)``) is below ``2**100``, with a zero point within
``2**23``; otherwise in float64, where decoding scales by ``2**-64`` and back when values come
near float64's largest. The compute dtype is a function of the metadata alone, and decoding
depends only on the block's bytes, so every peer that decodes the same block gets the same bits:
that is what keeps quantized results bit-identical. Decoded values are clipped to the buffer
dtype's finite range, and the NORMAL hint's mean and deviation are taken on values scaled by a
power of two, so no intermediate overflows.

The metadata is computed only by the peer that encodes, so it need not be reproducible elsewhere.
Non-finite values (NaN, inf) cannot be quantized: encoding them raises :class:`NonFiniteData`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from .._core.errors import RemoteProtocolError
from .._errors import InvalidArgument
from .._types import DataType, DistributionHint, QuantizationAlgorithm, ReduceOp
from ._buffers import Array, ArrayModule
from ._crossings import CROSSINGS
from ._dtypes import from_numpy_dtype, to_numpy_dtype
from ._kernels import UFUNC_NAMES

__all__ = ["META_BYTES", "Codec", "NonFiniteData", "check_quantization"]

#: Bytes of metadata in front of every encoded block.
META_BYTES = 16

_META = numpy.dtype("<f8")

_SOURCES = frozenset({DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE})
_TARGETS = {
    QuantizationAlgorithm.MIN_MAX: (DataType.UINT8, DataType.UINT16, DataType.UINT32),
    QuantizationAlgorithm.ZERO_POINT_SCALE: (DataType.UINT8, DataType.UINT16),
}
_ZPS_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG})

#: ``DistributionHint.NORMAL`` keeps values within this many standard deviations of the mean.
NORMAL_RANGE_SIGMAS = 6.0

# float32 holds every integer up to 2**24; a zero point up to 2**23 plus a 16-bit code stays
# below that, beyond it the zero point needs float64.
_FLOAT32_EXACT_INTEGERS = float(1 << 23)
_FLOAT32 = numpy.dtype(numpy.float32)
_FLOAT64 = numpy.dtype(numpy.float64)
# float32 arithmetic is used only where steps are normal floats and every intermediate value is
# far from overflow; float64 decoding scales down by a power of two beyond _FLOAT64_REACH.
_FLOAT32_TINY = float(numpy.finfo(numpy.float32).tiny)
_FLOAT32_REACH = 2.0**100
_FLOAT64_REACH = 2.0**1000
_UNSCALE = 2.0**-64
_SCALE = 2.0**64
# ZERO_POINT_SCALE's scale is at least this fraction of the largest magnitude in range, which
# keeps the zero point below 2**51 (exact in float64).
_ZERO_POINT_RESOLUTION = 2.0**-50
_SMALLEST_SCALE = 2.0**-1000

class NonFiniteData(Exception):
    """A block to encode holds NaN or inf, which no quantized code can represent."""


def check_quantization(
    algorithm: QuantizationAlgorithm, quantized: DataType, dtype: Any, op: ReduceOp | None = None
) -> None:
    """Refuse a combination the codecs do not implement, naming what would work.

    Raises:
        InvalidArgument: no codec for ``algorithm``; wrong buffer dtype, code dtype or op
            (unless None) for it.
    """
    if algorithm not in _TARGETS:
        raise InvalidArgument(
            f"quantization {algorithm.name} has no codec; use MIN_MAX or ZERO_POINT_SCALE"
        )
    source = from_numpy_dtype(dtype)
    if source not in _SOURCES:
        raise InvalidArgument(
            f"quantization {algorithm.name} needs a floating-point buffer (float16, bfloat16, "
            f"float32 or float64); this one is {numpy.dtype(dtype)}"
        )
    targets = _TARGETS[algorithm]
    if quantized not in targets:
        raise InvalidArgument(
            f"quantization {algorithm.name} quantizes to "
            f"{', '.join(t.name for t in targets)}; got quantized_datatype={quantized.name}"
        )
    if to_numpy_dtype(quantized).itemsize > numpy.dtype(dtype).itemsize:
        raise InvalidArgument(
            f"quantizing {numpy.dtype(dtype)} to {quantized.name} would send more bytes than "
            "the buffer holds; pick a narrower quantized_datatype"
        )
    if (
        algorithm is QuantizationAlgorithm.ZERO_POINT_SCALE
        and op is not None
        and op not in _ZPS_OPS
    ):
        raise InvalidArgument(
            f"quantization ZERO_POINT_SCALE supports op SUM and AVG only, got {op.name}; use "
            "MIN_MAX for PROD, MAX and MIN"
        )


def _finfo(dtype: numpy.dtype[Any]) -> Any:
    """numpy's ``finfo``, or ml_dtypes' for its bfloat16 (imported by then, as the buffer's
    maker did: ``_dtypes`` says why not before)."""
    if dtype.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    return numpy.finfo(dtype)


class Codec:
    """Encodes and decodes blocks of one buffer dtype (see the module docstring).

    Args:
        xp: the array module of the buffers (blocks on the wire are numpy uint8 arrays).
        dtype: the buffer's dtype.
        algorithm: MIN_MAX or ZERO_POINT_SCALE.
        quantized: the code dtype, as checked by :func:`check_quantization`.
        hint: how ZERO_POINT_SCALE picks its range.
    """

    def __init__(
        self,
        xp: ArrayModule,
        dtype: Any,
        algorithm: QuantizationAlgorithm,
        quantized: DataType,
        hint: DistributionHint = DistributionHint.NONE,
    ) -> None:
        self.xp = xp
        self.dtype = numpy.dtype(dtype)
        self.algorithm = algorithm
        self.hint = hint
        check_quantization(algorithm, quantized, dtype)
        self.code_dtype = to_numpy_dtype(quantized)
        self.code_size = self.code_dtype.itemsize
        self.levels = (1 << (8 * self.code_size)) - 1  # Q
        wide = self.dtype == numpy.float64 or self.code_size > 2
        self.compute = numpy.dtype(numpy.float64 if wide else numpy.float32)
        # Decoded values are clipped to the dtype's finite range.
        self._limit = float(_finfo(self.dtype).max)

    def block_bytes(self, count: int) -> int:
        """Bytes of an encoded block of ``count`` elements."""
        return META_BYTES + count * self.code_size

    # --- encoding --------------------------------------------------------------------

    def encode(self, values: Array, block: numpy.ndarray) -> int:
        """Encode ``values`` into ``block`` (``block_bytes(values.size)`` uint8).

        Returns:
            how many values were clamped to the range (ZERO_POINT_SCALE with a NORMAL hint).

        Raises:
            NonFiniteData: ``values`` holds NaN or inf, or spans more than float64 holds.
            ValueError: ``block`` has the wrong size.
        """
        return self._encode(values, block)[0]

    def encode_own(self, values: Array, block: numpy.ndarray) -> int:
        """``encode``, then write into ``values`` what decoding ``block`` gives (what
        every peer that receives the block will hold). On a GPU the codes are decoded
        where they were made: they cross to the host once, and never back."""
        clamped, codes = self._encode(values, block)
        if values.size:
            with numpy.errstate(all="ignore"):
                self.xp.copyto(values, self._decoded(block, codes), casting="unsafe")
        return clamped

    def _encode(self, values: Array, block: numpy.ndarray) -> tuple[int, Array | None]:
        """``encode``'s work; also the codes on the device (None for host buffers, or
        when none were computed there)."""
        count = int(values.size)
        if block.size != self.block_bytes(count):
            raise ValueError(
                f"a block for {count} values needs {self.block_bytes(count)} bytes, got {block.size}"
            )
        meta = block[:META_BYTES].view(_META)
        codes = block[META_BYTES:].view(self.code_dtype)
        if count == 0:
            meta[:] = 0.0
            return 0, None
        with numpy.errstate(all="ignore"):
            lo, hi = float(values.min()), float(values.max())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise NonFiniteData(
                    f"NaN or inf among {count} values to quantize (their min is {lo}, max {hi})"
                )
            if self.algorithm is QuantizationAlgorithm.MIN_MAX:
                return self._encode_min_max(values, lo, hi, meta, codes)
            return self._encode_zero_point(values, lo, hi, meta, codes)

    def _encode_min_max(
        self, x: Array, lo: float, hi: float, meta: numpy.ndarray, codes: numpy.ndarray
    ) -> tuple[int, Array | None]:
        span = hi - lo
        if not math.isfinite(span):
            raise NonFiniteData(f"the values span {lo} .. {hi}, more than float64 can hold")
        if span == 0.0:
            meta[:] = (lo, 0.0)  # constant: decodes to lo exactly
            codes[:] = 0
            return 0, None
        # The smallest step whose Q steps cover the span, so that max(x) maps to a code <= Q
        # (which matters when the step is so small that its rounding is a large part of it).
        step = _at_least(span / self.levels, span, self.levels, numpy.float64)
        if self._narrow_min_max(lo, step, check_exact=False):
            step = _at_least(step, span, self.levels, numpy.float32)
        compute = self._min_max_compute(lo, step)
        c = compute.type
        t = self.xp.subtract(x, c(lo), dtype=compute)
        t /= c(step)
        on_device = self._store_codes(t, codes)
        meta[:] = (lo, step)
        return 0, on_device

    def _encode_zero_point(
        self, x: Array, lo: float, hi: float, meta: numpy.ndarray, codes: numpy.ndarray
    ) -> tuple[int, Array | None]:
        xp = self.xp
        if lo == hi:
            # Constant: one code away from the zero point, with the value as the scale.
            scale, zero_point = (abs(lo), 0.0 if lo > 0 else 1.0) if lo else (1.0, 0.0)
            meta[:] = (scale, zero_point)
            code = int(zero_point) + (1 if lo > 0 else -1 if lo < 0 else 0)
            codes[:] = code
            # On a GPU, the same codes made there (a fill, not a copy).
            return 0, None if xp is numpy else xp.full(codes.shape, code, dtype=self.code_dtype)
        low, high = lo, hi
        if self.hint is DistributionHint.NORMAL:
            low, high = self._normal_range(x, lo, hi)
            if not high > low:
                low, high = lo, hi
        if not math.isfinite(high - low):
            raise NonFiniteData(f"the values span {lo} .. {hi}, more than float64 can hold")
        # A scale no finer than float64 resolves near the data, so the zero point stays
        # an exact integer, and no finer than float64's smallest normals.
        scale = max(
            (high - low) / self.levels,
            max(abs(low), abs(high)) * _ZERO_POINT_RESOLUTION,
            _SMALLEST_SCALE,
        )
        if self.compute == numpy.float32 and _FLOAT32_TINY <= scale <= _FLOAT32_REACH:
            scale = float(_round_up(scale, numpy.float32))
        zero_point = float(round(-low / scale))
        compute = self._zero_point_compute(scale, zero_point)
        t = xp.divide(x, compute.type(scale), dtype=compute)
        xp.rint(t, out=t)
        t += compute.type(zero_point)
        clamped = 0
        if low > lo or high < hi:
            clamped = int(xp.count_nonzero(t < 0)) + int(xp.count_nonzero(t > self.levels))
        on_device = self._store_codes(t, codes, rounded=True)
        meta[:] = (scale, zero_point)
        return clamped, on_device

    def _normal_range(self, x: Array, lo: float, hi: float) -> tuple[float, float]:
        """``mean ± NORMAL_RANGE_SIGMAS * sigma`` of ``x`` within ``[lo, hi]``, computed on
        ``x`` scaled down by a power of two to below 1 in magnitude, so that no sum overflows."""
        xp = self.xp
        count = int(x.size)
        _, exponent = math.frexp(max(abs(lo), abs(hi)))
        exponent = max(exponent, 0)  # scale down only
        c = self.compute.type
        scaled = xp.multiply(x, c(math.ldexp(1.0, -exponent)), dtype=self.compute)
        mean = float(scaled.sum(dtype=numpy.float64)) / count
        scaled -= c(mean)
        sigma = math.sqrt(float(xp.dot(scaled, scaled)) / count)
        # Clamped to the (scaled) data range first, the bounds scale back without overflow.
        low_scaled, high_scaled = math.ldexp(lo, -exponent), math.ldexp(hi, -exponent)
        low = max(low_scaled, min(high_scaled, mean - NORMAL_RANGE_SIGMAS * sigma))
        high = min(high_scaled, max(low_scaled, mean + NORMAL_RANGE_SIGMAS * sigma))
        return max(lo, math.ldexp(low, exponent)), min(hi, math.ldexp(high, exponent))

    def _narrow_min_max(self, lo: float, step: float, *, check_exact: bool = True) -> bool:
        """Whether a MIN_MAX block with this metadata is computed in float32: only for the
        narrow codecs, with float32-exact metadata well inside float32's normal range."""
        if self.compute != numpy.float32:
            return False
        if step == 0.0:
            return True
        if not (step >= _FLOAT32_TINY and abs(lo) + step * self.levels <= _FLOAT32_REACH):
            return False
        return not check_exact or (_exact_in(lo, numpy.float32) and _exact_in(step, numpy.float32))

    def _min_max_compute(self, lo: float, step: float) -> numpy.dtype[Any]:
        """The compute dtype of a MIN_MAX block: a function of its metadata, so that every
        peer decodes it alike."""
        return _FLOAT32 if self._narrow_min_max(lo, step) else _FLOAT64

    def _zero_point_compute(self, scale: float, zero_point: float) -> numpy.dtype[Any]:
        """The compute dtype of a ZERO_POINT_SCALE block: float32 only for the narrow codecs,
        with a float32-exact scale well inside float32's normal range and a zero point
        within float32's exact integers."""
        if (
            self.compute == numpy.float32
            and abs(zero_point) <= _FLOAT32_EXACT_INTEGERS
            and _FLOAT32_TINY <= scale
            and scale * (abs(zero_point) + self.levels) <= _FLOAT32_REACH
            and _exact_in(scale, numpy.float32)
        ):
            return _FLOAT32
        return _FLOAT64

    def _store_codes(self, t: Array, codes: numpy.ndarray, *, rounded: bool = False) -> Array | None:
        """Round (unless done), clip to ``[0, Q]`` and narrow ``t`` into ``codes``; on a
        GPU, return the codes as computed there."""
        xp = self.xp
        if not rounded:
            xp.rint(t, out=t)
        xp.clip(t, 0, self.levels, out=t)
        if xp is numpy:
            codes[:] = t  # exact: integral values in range
            return None
        on_device = t.astype(self.code_dtype)
        codes[:] = xp.asnumpy(on_device)
        CROSSINGS.to_host(codes.nbytes)
        return on_device

    # --- decoding --------------------------------------------------------------------

    def _decoded(self, block: numpy.ndarray, on_device: Array | None = None) -> Array:
        """The block's values in its compute dtype (a new array), clipped to the buffer
        dtype's finite range; from ``on_device`` if given (the block's codes, already
        where the buffers are). Runs under ``numpy.errstate(all="ignore")``.

        Raises:
            RemoteProtocolError: the metadata is not a valid encoding's.
        """
        xp = self.xp
        first, second = (float(v) for v in block[:META_BYTES].view(_META))
        codes = block[META_BYTES:].view(self.code_dtype) if on_device is None else on_device
        if self.algorithm is QuantizationAlgorithm.MIN_MAX:
            lo, step = first, second
            if not (math.isfinite(lo) and math.isfinite(step) and step >= 0.0):
                raise RemoteProtocolError(f"quantized block with bad metadata lo={lo} step={step}")
            compute = self._min_max_compute(lo, step)
            if step == 0.0:  # constant, -0.0 included: no code is read
                out = xp.full(codes.shape, lo, dtype=compute)
            elif abs(lo) + step * self.levels <= _FLOAT64_REACH:
                out = xp.multiply(self._here(codes), compute.type(step), dtype=compute)
                out += compute.type(lo)
            else:  # near float64's largest values: scale down by a power of two and back
                out = xp.multiply(self._here(codes), step * _UNSCALE, dtype=compute)
                out += lo * _UNSCALE
                out *= _SCALE
            reach = abs(lo) + step * self.levels
        else:
            scale, zero_point = first, second
            if not (math.isfinite(scale) and scale > 0.0 and abs(zero_point) <= 2.0**53
                    and zero_point == round(zero_point)):
                raise RemoteProtocolError(
                    f"quantized block with bad metadata scale={scale} zero_point={zero_point}"
                )
            compute = self._zero_point_compute(scale, zero_point)
            out = xp.subtract(self._here(codes), compute.type(zero_point), dtype=compute)
            out *= compute.type(scale)
            reach = scale * (abs(zero_point) + self.levels)
        if not reach <= self._limit:
            # Codes at the edge may decode beyond the largest finite value of the buffer's
            # dtype (by half a step when honest, by anything when not); keep them finite.
            xp.clip(out, -self._limit, self._limit, out=out)
        return out

    def _here(self, codes: Array) -> Array:
        """``codes`` where the buffers are: a host block's are copied to the GPU."""
        if self.xp is numpy or not isinstance(codes, numpy.ndarray):
            return codes
        CROSSINGS.to_device(codes.nbytes)
        return self.xp.asarray(codes)

    def decode(self, block: numpy.ndarray, out: Array) -> None:
        """Write the block's values into ``out`` (the buffer's dtype, its element count).

        Raises:
            RemoteProtocolError: the block's metadata is invalid, or its size is wrong.
        """
        self._check_size(block, out)
        if out.size == 0:
            return
        with numpy.errstate(all="ignore"):
            self.xp.copyto(out, self._decoded(block), casting="unsafe")

    def decode_combine(self, block: numpy.ndarray, dst: Array, local: Array, op: ReduceOp) -> None:
        """``dst = local OP decode(block)``, in the buffer's dtype (``dst`` may be ``local``).

        Raises:
            RemoteProtocolError: the block's metadata is invalid, or its size is wrong.
        """
        self._check_size(block, dst)
        if dst.size == 0:
            return
        with numpy.errstate(all="ignore"):
            incoming = self._decoded(block)
            if incoming.dtype != self.dtype:
                incoming = incoming.astype(self.dtype)
            # The same ufunc as an unquantized reduction (AVG accumulates as SUM).
            getattr(self.xp, UFUNC_NAMES[op])(local, incoming, out=dst)

    def _check_size(self, block: numpy.ndarray, values: Array) -> None:
        if block.size != self.block_bytes(int(values.size)):
            raise RemoteProtocolError(
                f"quantized block of {block.size} bytes; {values.size} values need "
                f"{self.block_bytes(int(values.size))}"
            )


def _exact_in(value: float, dtype: Any) -> bool:
    """Whether ``value`` is exactly representable in ``dtype``."""
    return float(dtype(value)) == value


def _round_up(value: float, dtype: Any) -> Any:
    """The smallest ``dtype`` value at least ``value``."""
    rounded = dtype(value)
    return rounded if float(rounded) >= value else numpy.nextafter(rounded, dtype(math.inf))


def _at_least(step: float, span: float, levels: int, dtype: Any) -> float:
    """The smallest ``dtype`` value from ``step`` up whose ``levels`` multiples reach ``span``."""
    candidate = _round_up(step, dtype)
    while float(candidate) * levels < span:
        candidate = numpy.nextafter(candidate, dtype(math.inf))
    return float(candidate)
