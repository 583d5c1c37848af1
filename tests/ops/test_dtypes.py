"""The DataType <-> numpy dtype table."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import ml_dtypes
import numpy
import pytest

from pccl_trio import DataType, InvalidArgument
from pccl_trio.ops import _dtypes, from_numpy_dtype, to_numpy_dtype

EXPECTED: dict[DataType, Any] = {
    DataType.UINT8: numpy.uint8,
    DataType.INT8: numpy.int8,
    DataType.UINT16: numpy.uint16,
    DataType.INT16: numpy.int16,
    DataType.UINT32: numpy.uint32,
    DataType.INT32: numpy.int32,
    DataType.UINT64: numpy.uint64,
    DataType.INT64: numpy.int64,
    DataType.FLOAT16: numpy.float16,
    DataType.BFLOAT16: ml_dtypes.bfloat16,
    DataType.FLOAT: numpy.float32,
    DataType.DOUBLE: numpy.float64,
}


def test_the_table_covers_every_data_type() -> None:
    assert set(EXPECTED) == set(DataType)


@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.name)
def test_every_data_type_round_trips(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    assert dtype == numpy.dtype(EXPECTED[data_type])
    assert from_numpy_dtype(dtype) is data_type
    assert from_numpy_dtype(EXPECTED[data_type]) is data_type
    assert from_numpy_dtype(numpy.empty(0, dtype).dtype) is data_type


def test_equal_dtypes_spelled_differently_map_to_one_data_type() -> None:
    assert from_numpy_dtype("=f4") is DataType.FLOAT
    assert from_numpy_dtype(numpy.dtype("q")) is DataType.INT64
    assert from_numpy_dtype(numpy.dtype("Q")) is DataType.UINT64
    assert from_numpy_dtype("bfloat16") is DataType.BFLOAT16


@pytest.mark.parametrize(
    "dtype", [numpy.bool_, numpy.complex64, numpy.complex128, object, "U3", ">f4"]
)
def test_unsupported_dtypes_are_rejected_with_the_supported_list(dtype: Any) -> None:
    with pytest.raises(InvalidArgument, match="not supported") as info:
        from_numpy_dtype(dtype)
    message = str(info.value)
    assert str(numpy.dtype(dtype)) in message
    assert "float32" in message and "bfloat16" in message and "uint64" in message


def test_a_non_dtype_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="not a dtype"):
        from_numpy_dtype("no such dtype")


def test_resolved_dtypes_answer_as_the_scan_does_and_the_memo_stays_bounded() -> None:
    # Every spelling of int64 resolves alike, first and later (from the memo).
    for _ in range(2):
        assert from_numpy_dtype(numpy.dtype("l")) is DataType.INT64
        assert from_numpy_dtype(numpy.dtype("q")) is DataType.INT64
        assert from_numpy_dtype(numpy.dtype("<f4")) is DataType.FLOAT
    # A non-native order is never remembered as its native twin.
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="not supported"):
            from_numpy_dtype(numpy.dtype(">f4"))
    # Dtypes with metadata compare equal to their plain twin; however many there are,
    # the memo does not grow past its bound.
    for index in range(3 * _dtypes._SEEN_MAX):
        tagged = numpy.dtype(numpy.float32, metadata={"n": index})
        assert from_numpy_dtype(tagged) is DataType.FLOAT
    assert len(_dtypes._SEEN) <= _dtypes._SEEN_MAX


def test_ml_dtypes_is_imported_only_once_bfloat16_is_met() -> None:
    """Importing ml_dtypes takes most of a second of every process's start, so
    ``import pccl_trio`` leaves it out; bfloat16 still works from its first use, as a
    DataType (how a torch bfloat16 tensor is viewed) or a dtype name."""
    program = textwrap.dedent("""
        import sys
        import pccl_trio
        from pccl_trio.ops import from_numpy_dtype, to_numpy_dtype
        assert "ml_dtypes" not in sys.modules
        assert from_numpy_dtype("bfloat16") is pccl_trio.DataType.BFLOAT16
        assert str(to_numpy_dtype(pccl_trio.DataType.BFLOAT16)) == "bfloat16"
    """)
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)
