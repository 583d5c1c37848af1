"""The table between the wire's :class:`DataType` and numpy dtypes.

cupy arrays carry numpy dtypes too, so this one table serves both array modules. bfloat16 has no
numpy builtin; ``ml_dtypes`` supplies the dtype and its ufunc loops. Importing it takes most of a
second, so it is imported once a bfloat16 buffer or :class:`DataType` is first met (a bfloat16
array exists only once its maker imported ``ml_dtypes``), not with ``pccl_trio``: every process
of a run, the master's included, starts that much sooner.
"""

from __future__ import annotations

from typing import Any

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
    # DataType.BFLOAT16: entered by ``_bfloat16``, see the module docstring.
    DataType.FLOAT: numpy.dtype(numpy.float32),
    DataType.DOUBLE: numpy.dtype(numpy.float64),
}

#: Dtypes already resolved (a dict lookup matches a dtype equal to a key, as the scan
#: below would), so a call of many buffers pays the scan once per dtype.
_SEEN: dict[numpy.dtype[Any], DataType] = {}
_SEEN_MAX = 64

_NAMES = {**{t: str(dtype) for t, dtype in _NUMPY_DTYPES.items()}, DataType.BFLOAT16: "bfloat16"}
#: The supported dtypes' names (numpy's, which torch shares: bfloat16 is ml_dtypes').
SUPPORTED = frozenset(_NAMES.values())
#: The same, for messages, in DataType's order.
SUPPORTED_NAMES = ", ".join(_NAMES[t] for t in DataType)


def _bfloat16() -> numpy.dtype[Any]:
    """ml_dtypes' bfloat16, entered into the table (see the module docstring)."""
    if DataType.BFLOAT16 not in _NUMPY_DTYPES:
        import ml_dtypes

        _NUMPY_DTYPES[DataType.BFLOAT16] = numpy.dtype(ml_dtypes.bfloat16)
    return _NUMPY_DTYPES[DataType.BFLOAT16]


def to_numpy_dtype(data_type: DataType) -> numpy.dtype[Any]:
    """The numpy dtype (native byte order) that holds elements of ``data_type``."""
    if data_type is DataType.BFLOAT16:
        return _bfloat16()
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
        if not (isinstance(dtype, str) and dtype == _NAMES[DataType.BFLOAT16]):
            raise InvalidArgument(f"{dtype!r} is not a dtype; supported dtypes: {SUPPORTED_NAMES}") from error
        resolved = _bfloat16()  # numpy knows the name once ml_dtypes is imported
    # A linear scan with == rather than a dict lookup: equal dtypes need not be the same object
    # (int64 may be spelled 'l' or 'q'), and == is what numpy defines as "the same dtype".
    if resolved.name == _NAMES[DataType.BFLOAT16]:
        _bfloat16()
    for data_type, candidate in _NUMPY_DTYPES.items():
        if resolved == candidate:
            if len(_SEEN) < _SEEN_MAX:
                _SEEN[resolved] = data_type
            return data_type
    raise InvalidArgument(
        f"dtype {resolved} is not supported; supported dtypes (native byte order): {SUPPORTED_NAMES}"
    )
