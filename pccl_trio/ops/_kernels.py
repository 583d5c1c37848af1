"""Elementwise kernels of the ring all-reduce, for numpy and cupy alike.

Every kernel works in place, in the array's own dtype: a reduce step folds a received chunk into the
local one (``dst = dst OP src``) and the last step divides by the world size for AVG. Results never
widen, so integers wrap on overflow and half-precision floats round at every step, exactly as they
would in the peers' C counterparts. Each peer runs the same loops on the same bytes, so results are
bitwise reproducible.

numpy reports overflow, inf - inf and NaN comparisons as floating-point errors (RuntimeWarning, or
an exception under a strict errstate). For a reduction they are ordinary IEEE or wraparound
results, so the kernels silence them. cupy reports no such errors; numpy's errstate is harmless
around cupy calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy

from .._errors import InvalidArgument
from .._types import DataType, ReduceOp
from ._buffers import Array, ArrayModule
from ._dtypes import from_numpy_dtype

__all__ = ["UFUNC_NAMES", "combine_into", "combine_parts", "copy_into", "finalize_average", "reduce_into"]

#: The numpy/cupy ufunc of each reduction. AVG accumulates as SUM; finalize_average
#: divides once, after the last reduce step.
UFUNC_NAMES = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PROD: "multiply",
    # maximum/minimum (not fmax/fmin) so that a NaN anywhere is a NaN in the result.
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
}

_FLOATS = frozenset({DataType.FLOAT16, DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE})
_SIGNED = frozenset({DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64})

# The largest world size finalize_average accepts: any larger has no int64 divisor.
_MAX_WORLD_SIZE = 2**63 - 1


def reduce_into(xp: ArrayModule, dst: Array, src: Array, op: ReduceOp) -> None:
    """Fold ``src`` into ``dst`` elementwise: ``dst = dst OP src``, in place and in ``dst``'s dtype.

    AVG accumulates as SUM; :func:`finalize_average` divides at the end.

    Raises:
        InvalidArgument: the arrays differ in dtype or shape.
    """
    _check_same_layout(dst, src, what="reduce_into")
    ufunc = getattr(xp, UFUNC_NAMES[op])
    with numpy.errstate(all="ignore"):
        ufunc(dst, src, out=dst)


def combine_into(xp: ArrayModule, dst: Array, local: Array, src: Array, op: ReduceOp) -> None:
    """``dst = local OP src`` elementwise in one pass, in their common dtype.

    The same operands in the same order as ``copy_into(dst, local)`` followed by
    ``reduce_into(dst, src)``, so the result is bit-identical to that, without the copy.

    Raises:
        InvalidArgument: the arrays differ in dtype or shape.
    """
    _check_same_layout(dst, local, what="combine_into")
    _check_same_layout(dst, src, what="combine_into")
    ufunc = getattr(xp, UFUNC_NAMES[op])
    with numpy.errstate(all="ignore"):
        ufunc(local, src, out=dst)


def combine_parts(
    xp: ArrayModule, dst: Array, parts: Iterable[tuple[Array, int, int]], src: Array, op: ReduceOp
) -> None:
    """``combine_into`` with the local operand in parts: ``dst[a:b] = part OP src[a:b]``
    for each ``(part, a, b)``, the same operands in the same order, so the same values
    (where both operands are NaN, which NaN's payload is kept may differ: numpy's
    vector and tail loops keep different ones).
    For many small parts (a fused bucket's tensors): the checks are the caller's.
    """
    ufunc = getattr(xp, UFUNC_NAMES[op])
    with numpy.errstate(all="ignore"):
        for part, a, b in parts:
            ufunc(part, src[a:b], out=dst[a:b])


def copy_into(xp: ArrayModule, dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` elementwise.

    Raises:
        InvalidArgument: the arrays differ in dtype or shape.
    """
    _check_same_layout(dst, src, what="copy_into")
    xp.copyto(dst, src)


def finalize_average(xp: ArrayModule, array: Array, world_size: int) -> None:
    """Divide ``array`` by ``world_size`` in place, in the array's own dtype.

    Floats (float16 and bfloat16 included) divide by ``world_size`` rounded to their dtype (so a
    bfloat16 average over 257 peers divides by 256, and float16 cannot average over more than
    65504). Signed integers truncate toward zero, as C does (-7 / 2 == -3); unsigned integers
    floor, which for them is the same thing.

    Raises:
        InvalidArgument: ``world_size`` is not a positive int below 2**63.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not (
        1 <= world_size <= _MAX_WORLD_SIZE
    ):
        raise InvalidArgument(f"world_size must be an int in [1, 2**63 - 1], got {world_size!r}")
    data_type = from_numpy_dtype(array.dtype)
    with numpy.errstate(all="ignore"):
        if data_type in _FLOATS:
            xp.divide(array, array.dtype.type(world_size), out=array)
        elif world_size <= numpy.iinfo(array.dtype).max:
            _divide_integers(xp, array, array.dtype.type(world_size), signed=data_type in _SIGNED)
        else:
            # The divisor does not fit the dtype; divide in int64, where it does. Every quotient
            # is no larger in magnitude than its dividend, so the narrowing copy back is exact.
            wide = array.astype(xp.int64)
            _divide_integers(xp, wide, numpy.int64(world_size), signed=True)
            xp.copyto(array, wide, casting="unsafe")


def _divide_integers(xp: ArrayModule, array: Array, divisor: numpy.integer, *, signed: bool) -> None:
    """Divide integers in place, truncating toward zero; ``divisor`` is positive."""
    if not signed:
        xp.floor_divide(array, divisor, out=array)
        return
    # floor_divide by a scalar is fast (libdivide); fmod and remainder are ~10x slower. Floor
    # differs from truncation only on negative inexact quotients, which it puts one lower.
    quotient = xp.floor_divide(array, divisor)
    # quotient * divisor may wrap near the dtype's minimum, but it differs from the dividend by the
    # remainder, 0 <= r < divisor <= the dtype's max, which no multiple of 2**bits cancels.
    rounded_down = xp.not_equal(xp.multiply(quotient, divisor), array)
    rounded_down &= quotient < 0
    xp.add(quotient, rounded_down, out=array)


def _check_same_layout(dst: Array, src: Array, *, what: str) -> None:
    """Refuse arrays that an elementwise kernel cannot pair up without casting or broadcasting."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise InvalidArgument(
            f"{what}: dst and src must have the same dtype and shape, got dst {dst.dtype}"
            f"{tuple(dst.shape)} and src {src.dtype}{tuple(src.shape)}"
        )
