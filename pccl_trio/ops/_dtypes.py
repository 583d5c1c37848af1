"""The table between the wire's :class:`DataType` and numpy dtypes.

cupy arrays carry numpy dtypes too, so this one table serves both array modules. bfloat16 has no
numpy builtin; ``ml_dtypes`` supplies the dtype and its ufunc loops.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy
import numpy.typing as npt

from .._errors import InvalidArgument
from .._types import DataType

__all__ = ["SUPPORTED", "SUPPORTED_NAMES", "from_numpy_dtype", "to_numpy_dtype"]

_NUMPY_DTYPES: dict[DataType, numpy.dtype[Any]] = {
    DataType.UINT8: numpy.dtype(numpy.uint8),
    DataType.INT8: numpy.dtype(numpy.int8),
    DataType.UINT16: numpy.dtype(numpy.uint16),
    DataType.INT16: numpy.dtype(numpy.int16),
    DataType.UINT32: numpy.dtype(numpy.uint32),
    DataType.INT32: numpy.dtype(numpy.int32),
    DataType.UINT64: numpy.dtype(numpy.uint64),
    DataType.INT64: numpy.dtype(numpy.int64),
    DataType.FLOAT16: numpy.dtype(numpy.float16),
    DataType.BFLOAT16: numpy.dtype(ml_dtypes.bfloat16),
    DataType.FLOAT: numpy.dtype(numpy.float32),
    DataType.DOUBLE: numpy.dtype(numpy.float64),
}

#: Dtypes already resolved (a dict lookup matches a dtype equal to a key, as the scan
#: below would), so a call of many buffers pays the scan once per dtype.
_SEEN: dict[numpy.dtype[Any], DataType] = {}
_SEEN_MAX = 64

#: The supported dtypes' names (numpy's, which torch shares: bfloat16 is ml_dtypes').
SUPPORTED = frozenset(str(dtype) for dtype in _NUMPY_DTYPES.values())
#: The same, for messages, in the table's order.
SUPPORTED_NAMES = ", ".join(str(dtype) for dtype in _NUMPY_DTYPES.values())


def to_numpy_dtype(data_type: DataType) -> numpy.dtype[Any]:
    """The numpy dtype (native byte order) that holds elements of ``data_type``."""
    return _NUMPY_DTYPES[data_type]


def from_numpy_dtype(dtype: npt.DTypeLike) -> DataType:
    """The :class:`DataType` of arrays whose elements have ``dtype``.

    Raises:
        InvalidArgument: the dtype has no DataType (e.g. bool, complex, object, or non-native byte
            order); the message lists the supported dtypes.
    """
    if isinstance(dtype, numpy.dtype):
        known = _SEEN.get(dtype)
        if known is not None:
            return known
    try:
        resolved = numpy.dtype(dtype)
    except TypeError as error:
        raise InvalidArgument(f"{dtype!r} is not a dtype; supported dtypes: {SUPPORTED_NAMES}") from error
    # A linear scan with == rather than a dict lookup: equal dtypes need not be the same object
    # (int64 may be spelled 'l' or 'q'), and == is what numpy defines as "the same dtype".
    for data_type, candidate in _NUMPY_DTYPES.items():
        if resolved == candidate:
            if len(_SEEN) < _SEEN_MAX:
                _SEEN[resolved] = data_type
            return data_type
    raise InvalidArgument(
        f"dtype {resolved} is not supported; supported dtypes (native byte order): {SUPPORTED_NAMES}"
    )
