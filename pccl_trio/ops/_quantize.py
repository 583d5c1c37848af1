"""Quantized encodings of all-reduce slices: min-max and zero-point/scale, to unsigned integers.

Theory of operation
-------------------
A quantized all-reduce sends every slice as one *block*: 16 bytes of metadata (two little-endian
float64) followed by one unsigned integer per element. Each block carries its own metadata, so
every hop quantizes with the spread of exactly the values it sends, and a slice can be encoded
the moment it is ready (the ring stays pipelined).

With ``Q = 2**bits - 1`` and ``x`` the block's values:

* **MIN_MAX**: metadata ``(lo, step)`` with ``lo = min(x)``, ``step = (max(x) - lo) / Q``;
  ``q = clip(rint((x - lo) / step), 0, Q)`` (round to nearest), decoded as ``lo + q * step``.
  A constant block has ``step = 0`` and decodes exactly.
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
bits, and in float64 otherwise (float64 buffers, 32-bit codes, or a zero point too large for
float32's integers). Decoding depends only on the block's bytes, so every peer that decodes the
same block gets the same bits: that is what keeps quantized results bit-identical.

The metadata is computed only by the peer that encodes, so it need not be reproducible elsewhere.
Non-finite values (NaN, inf) cannot be quantized: encoding them raises :class:`NonFiniteData`.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy

from .._core.errors import RemoteProtocolError
from .._errors import InvalidArgument
from .._types import DataType, DistributionHint, QuantizationAlgorithm, ReduceOp
from ._buffers import Array, ArrayModule
from ._dtypes import from_numpy_dtype, to_numpy_dtype

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

# float32 holds every integer up to 2**24; beyond, a zero point needs float64.
_FLOAT32_EXACT_INTEGERS = float(1 << 23)
# ZERO_POINT_SCALE's scale is at least this fraction of the largest magnitude in range, which
# keeps the zero point below 2**51 (exact in float64).
_ZERO_POINT_RESOLUTION = 2.0**-50
_SMALLEST_SCALE = 2.0**-1000
# MIN_MAX multiplies by Q / span when that is safely finite in every compute dtype.
_SAFE_RECIPROCAL = 1e30

# Ufuncs folding the decoded block into the local values (AVG accumulates as SUM).
_UFUNC_NAMES = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PROD: "multiply",
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
}


class NonFiniteData(Exception):
    """A block to encode holds NaN or inf, which no quantized code can represent."""


def check_quantization(
    algorithm: QuantizationAlgorithm, quantized: DataType, dtype: Any, op: ReduceOp
) -> None:
    """Refuse a combination the codecs do not implement, naming what would work.

    Raises:
        InvalidArgument: wrong buffer dtype, code dtype or op for ``algorithm``.
    """
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
    if algorithm is QuantizationAlgorithm.ZERO_POINT_SCALE and op not in _ZPS_OPS:
        raise InvalidArgument(
            f"quantization ZERO_POINT_SCALE supports op SUM and AVG only, got {op.name}; use "
            "MIN_MAX for PROD, MAX and MIN"
        )


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
        assert algorithm is not QuantizationAlgorithm.NONE
        self.xp = xp
        self.dtype = numpy.dtype(dtype)
        self.algorithm = algorithm
        self.hint = hint
        self.code_dtype = to_numpy_dtype(quantized)
        self.code_size = self.code_dtype.itemsize
        self.levels = (1 << (8 * self.code_size)) - 1  # Q
        wide = self.dtype == numpy.float64 or self.code_size > 2
        self.compute = numpy.dtype(numpy.float64 if wide else numpy.float32)
        # Decoded values are clipped to the dtype's finite range.
        self._limit = float(ml_dtypes.finfo(self.dtype).max)  # type: ignore[no-untyped-call]

    def block_bytes(self, count: int) -> int:
        """Bytes of an encoded block of ``count`` elements."""
        return META_BYTES + count * self.code_size

    def count_of(self, nbytes: int) -> int | None:
        """Elements in an encoded block of ``nbytes``, or None if no block has that size."""
        count, rest = divmod(nbytes - META_BYTES, self.code_size)
        return count if nbytes >= META_BYTES and not rest else None

    # --- encoding --------------------------------------------------------------------

    def encode(self, values: Array, block: numpy.ndarray) -> int:
        """Encode ``values`` into ``block`` (``block_bytes(values.size)`` uint8).

        Returns:
            how many values were clamped to the range (ZERO_POINT_SCALE with a NORMAL hint).

        Raises:
            NonFiniteData: ``values`` holds NaN or inf.
        """
        count = int(values.size)
        assert block.size == self.block_bytes(count)
        meta = block[:META_BYTES].view(_META)
        codes = block[META_BYTES:].view(self.code_dtype)
        if count == 0:
            meta[:] = 0.0
            return 0
        x = values if values.dtype == self.compute else values.astype(self.compute)
        lo, hi = float(x.min()), float(x.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise NonFiniteData(
                f"NaN or inf among {count} values to quantize (their min is {lo}, max {hi})"
            )
        if self.algorithm is QuantizationAlgorithm.MIN_MAX:
            return self._encode_min_max(x, lo, hi, meta, codes)
        return self._encode_zero_point(x, lo, hi, meta, codes)

    def _encode_min_max(
        self, x: Array, lo: float, hi: float, meta: numpy.ndarray, codes: numpy.ndarray
    ) -> int:
        span = hi - lo
        if not math.isfinite(span):
            raise NonFiniteData(f"the values span {lo} .. {hi}, more than float64 can hold")
        if span == 0.0:
            meta[:] = (lo, 0.0)  # constant: every code 0 decodes to lo exactly
            codes[:] = 0
            return 0
        c = self.compute.type
        t = self.xp.subtract(x, c(lo), dtype=self.compute)
        if self.levels / span < _SAFE_RECIPROCAL:
            t *= c(self.levels / span)
        else:  # a span so small its reciprocal would overflow
            t /= c(span)
            t *= c(self.levels)
        self._store_codes(t, codes)
        meta[:] = (lo, span / self.levels)
        return 0

    def _encode_zero_point(
        self, x: Array, lo: float, hi: float, meta: numpy.ndarray, codes: numpy.ndarray
    ) -> int:
        xp = self.xp
        if lo == hi:
            # Constant: one code away from the zero point, with the value as the scale.
            scale, zero_point = (abs(lo), 0.0 if lo > 0 else 1.0) if lo else (1.0, 0.0)
            meta[:] = (scale, zero_point)
            codes[:] = int(zero_point) + (1 if lo > 0 else -1 if lo < 0 else 0)
            return 0
        low, high = lo, hi
        if self.hint is DistributionHint.NORMAL:
            count = int(x.size)
            mean = float(x.sum(dtype=numpy.float64)) / count
            centred = xp.subtract(x, self.compute.type(mean), dtype=self.compute)
            sigma = math.sqrt(float(xp.dot(centred, centred)) / count)
            low = max(lo, mean - NORMAL_RANGE_SIGMAS * sigma)
            high = min(hi, mean + NORMAL_RANGE_SIGMAS * sigma)
            if not high > low:
                low, high = lo, hi
        if not math.isfinite(high - low):
            raise NonFiniteData(f"the values span {lo} .. {hi}, more than float64 can hold")
        # A scale no finer than float64 resolves near the data, so the zero point stays
        # an exact integer, and no finer than the smallest normal float.
        scale = max(
            (high - low) / self.levels,
            max(abs(low), abs(high)) * _ZERO_POINT_RESOLUTION,
            _SMALLEST_SCALE,
        )
        zero_point = float(round(-low / scale))
        compute = self._compute_for(zero_point)
        t = xp.divide(x, compute.type(scale), dtype=compute)
        xp.rint(t, out=t)
        t += compute.type(zero_point)
        clamped = 0
        if low > lo or high < hi:
            clamped = int(xp.count_nonzero(t < 0)) + int(xp.count_nonzero(t > self.levels))
        self._store_codes(t, codes, rounded=True)
        meta[:] = (scale, zero_point)
        return clamped

    def _compute_for(self, zero_point: float) -> numpy.dtype[Any]:
        """The compute dtype of a ZERO_POINT_SCALE block: float64 if its zero point is
        beyond float32's exact integers."""
        if abs(zero_point) > _FLOAT32_EXACT_INTEGERS:
            return numpy.dtype(numpy.float64)
        return self.compute

    def _store_codes(self, t: Array, codes: numpy.ndarray, *, rounded: bool = False) -> None:
        """Round (unless done), clip to ``[0, Q]`` and narrow ``t`` into ``codes``."""
        xp = self.xp
        if not rounded:
            xp.rint(t, out=t)
        xp.clip(t, 0, self.levels, out=t)
        if xp is numpy:
            codes[:] = t  # exact: integral values in range
        else:  # pragma: no cover - needs a GPU
            codes[:] = xp.asnumpy(t.astype(self.code_dtype))

    # --- decoding --------------------------------------------------------------------

    def _decoded(self, block: numpy.ndarray) -> Array:
        """The block's values in the compute dtype (a new array), clipped to the
        buffer dtype's finite range.

        Raises:
            RemoteProtocolError: the metadata is not a valid encoding's.
        """
        xp = self.xp
        first, second = (float(v) for v in block[:META_BYTES].view(_META))
        codes = block[META_BYTES:].view(self.code_dtype)
        if xp is not numpy:  # pragma: no cover - needs a GPU
            codes = xp.asarray(codes)
        if self.algorithm is QuantizationAlgorithm.MIN_MAX:
            lo, step = first, second
            if not (math.isfinite(lo) and math.isfinite(step) and step >= 0.0):
                raise RemoteProtocolError(f"quantized block with bad metadata lo={lo} step={step}")
            compute = self.compute
            out = xp.multiply(codes, compute.type(step), dtype=compute)
            out += compute.type(lo)
            reach = max(abs(lo), abs(lo + step * self.levels))
        else:
            scale, zero_point = first, second
            if not (math.isfinite(scale) and scale > 0.0 and abs(zero_point) <= 2.0**53
                    and zero_point == round(zero_point)):
                raise RemoteProtocolError(
                    f"quantized block with bad metadata scale={scale} zero_point={zero_point}"
                )
            compute = self._compute_for(zero_point)
            out = xp.subtract(codes, compute.type(zero_point), dtype=compute)
            out *= compute.type(scale)
            reach = scale * max(abs(zero_point), abs(self.levels - zero_point))
        if not reach <= self._limit:
            # Codes at the edge may decode up to half a step beyond the largest finite
            # value of the buffer's dtype; keep them finite.
            xp.clip(out, -self._limit, self._limit, out=out)
        return out

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
        incoming = self._decoded(block)
        with numpy.errstate(all="ignore"):
            if incoming.dtype != self.dtype:
                incoming = incoming.astype(self.dtype)
            getattr(self.xp, _UFUNC_NAMES[op])(local, incoming, out=dst)

    def _check_size(self, block: numpy.ndarray, values: Array) -> None:
        if block.size != self.block_bytes(int(values.size)):
            raise RemoteProtocolError(
                f"quantized block of {block.size} bytes; {values.size} values need "
                f"{self.block_bytes(int(values.size))}"
            )
