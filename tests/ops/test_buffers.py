"""Zero-copy views of callers' buffers: what is accepted, what is refused and why."""

from __future__ import annotations

import importlib.util
from typing import Any

import ml_dtypes
import numpy
import pytest

from pccl_trio import DataType, InvalidArgument
from pccl_trio.ops import as_array, byte_view, to_numpy_dtype

from .support import needs_writable_dlpack


class DLPackExporter:
    """A foreign array that offers nothing but the DLPack protocol, like a torch tensor."""

    def __init__(self, array: Any, *, device: tuple[int, int] = (1, 0)) -> None:
        self._array = array
        self._device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def assert_flat_view_of(xp: Any, view: Any, original: Any) -> None:
    assert xp is numpy
    assert type(view) is numpy.ndarray and view.ndim == 1 and view.flags.c_contiguous
    assert view.size == original.size and view.dtype == original.dtype
    assert numpy.shares_memory(view, original) or original.size == 0


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (2, 3), (2, 3, 4), (3, 0, 2)])
@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.name)
def test_numpy_arrays_of_any_shape_are_viewed_flat(shape: tuple[int, ...], data_type: DataType) -> None:
    original = numpy.zeros(shape, to_numpy_dtype(data_type))
    xp, view = as_array(original, name="send")
    assert_flat_view_of(xp, view, original)


def test_writing_the_view_writes_the_callers_buffer() -> None:
    original = numpy.zeros((2, 3), numpy.float32)
    _, view = as_array(original, name="recv")
    view[:] = numpy.arange(6)
    assert original.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_contiguous_slice_is_viewed_in_place() -> None:
    buffer = numpy.zeros(10, numpy.int64)
    _, view = as_array(buffer[3:6], name="send")
    view += 1
    assert buffer.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]


def test_bfloat16_numpy_arrays_are_accepted() -> None:
    original = numpy.ones(4, ml_dtypes.bfloat16)
    xp, view = as_array(original, name="send")
    assert_flat_view_of(xp, view, original)


@pytest.mark.parametrize(
    "make",
    [
        lambda: numpy.zeros(10, numpy.float32)[::2],
        lambda: numpy.zeros((3, 4), numpy.float32).T,
        lambda: numpy.zeros((3, 4), numpy.float32, order="F"),
        lambda: numpy.zeros((3, 4), numpy.float32)[:, 1:],
    ],
    ids=["strided", "transposed", "fortran", "column-slice"],
)
def test_non_contiguous_arrays_are_rejected(make: Any) -> None:
    fixes = r"ascontiguousarray.*\.contiguous\(\)"
    with pytest.raises(InvalidArgument, match=rf"^send: .*not C-contiguous.*{fixes}"):
        as_array(make(), name="send")


def test_read_only_arrays_are_rejected() -> None:
    original = numpy.zeros(4, numpy.float32)
    original.setflags(write=False)
    with pytest.raises(InvalidArgument, match=r"^recv: .*read-only.*writable"):
        as_array(original, name="recv")
    with pytest.raises(InvalidArgument, match=r"^recv: .*read-only"):
        as_array(numpy.frombuffer(b"\0" * 8, numpy.float32), name="recv")


@pytest.mark.parametrize("dtype", [numpy.bool_, numpy.complex64, object, ">f4", "U2"])
def test_unsupported_dtypes_are_rejected(dtype: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"^send: dtype .* is not supported.*astype") as info:
        as_array(numpy.zeros(3, dtype), name="send")
    assert "bfloat16" in str(info.value)  # the message lists what would have worked


class _Subclass(numpy.ndarray):
    pass


def test_known_dtypes_are_checked_as_fully_as_new_ones() -> None:
    # Once float32 was seen, a plain array of it takes the short path: it must still
    # refuse what the full check refuses, and leave subclasses to the full check.
    as_array(numpy.zeros(2, numpy.float32), name="send")
    with pytest.raises(InvalidArgument, match=r"^send: .*not C-contiguous"):
        as_array(numpy.zeros(10, numpy.float32)[::2], name="send")
    read_only = numpy.zeros(4, numpy.float32)
    read_only.setflags(write=False)
    with pytest.raises(InvalidArgument, match=r"^send: .*read-only"):
        as_array(read_only, name="send")
    with pytest.raises(InvalidArgument, match=r"^send: dtype >f4 is not supported"):
        as_array(numpy.zeros(3, ">f4"), name="send")
    subclass = numpy.zeros((2, 2), numpy.float32).view(_Subclass)
    xp, view = as_array(subclass, name="send")
    assert_flat_view_of(xp, view, subclass)
    one_dimensional = numpy.zeros(5, numpy.float32)
    _, view = as_array(one_dimensional, name="send")
    view += 2
    assert one_dimensional.tolist() == [2.0] * 5


@pytest.mark.parametrize("obj", [[1.0, 2.0], b"abcd", bytearray(4), 3.0, None, memoryview(bytearray(4))])
def test_other_objects_are_rejected(obj: object) -> None:
    with pytest.raises(InvalidArgument, match=r"^send: expected .*numpy.ndarray.*__dlpack__.*, got"):
        as_array(obj, name="send")


@needs_writable_dlpack
def test_dlpack_exporters_are_viewed_through_dlpack() -> None:
    original = numpy.arange(6, dtype=numpy.int16).reshape(2, 3)
    xp, view = as_array(DLPackExporter(original), name="send")
    assert_flat_view_of(xp, view, original)
    view[0] = 100
    assert original[0, 0] == 100


@needs_writable_dlpack
def test_dlpack_exporters_are_checked_like_arrays() -> None:
    with pytest.raises(InvalidArgument, match="^send: .*not C-contiguous"):
        as_array(DLPackExporter(numpy.zeros(6, numpy.float32)[::2]), name="send")
    with pytest.raises(InvalidArgument, match="^send: dtype bool is not supported"):
        as_array(DLPackExporter(numpy.zeros(3, numpy.bool_)), name="send")
    read_only = numpy.zeros(3, numpy.float32)
    read_only.setflags(write=False)
    # numpy >= 2.1 imports it read-only; older numpy refuses to export it ("readonly").
    with pytest.raises(InvalidArgument, match="^send: .*read-?only"):
        as_array(DLPackExporter(read_only), name="send")


class LegacyExporter:
    """An exporter of the unversioned DLPack protocol only, which cannot say "writable"."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._array.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def test_read_only_dlpack_imports_explain_numpys_part() -> None:
    with pytest.raises(InvalidArgument, match=r"^send: numpy .* imported .*read-only.*upgrade numpy"):
        as_array(LegacyExporter(numpy.zeros(3, numpy.float32)), name="send")


class RefusingExporter(DLPackExporter):
    """An exporter that refuses, as torch does for a tensor that requires grad."""

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")


def test_dlpack_export_failures_become_invalid_argument_with_the_exporters_advice() -> None:
    refusing = RefusingExporter(numpy.zeros(3, numpy.float32))
    with pytest.raises(InvalidArgument, match=r"^send: could not view .*DLPack.*tensor\.detach\(\)"):
        as_array(refusing, name="send")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_gpu_buffers_without_cupy_say_cupy_is_needed() -> None:
    gpu = DLPackExporter(numpy.zeros(3, numpy.float32), device=(2, 0))  # kDLCUDA
    with pytest.raises(InvalidArgument, match=r"^send: .*GPU memory, which needs cupy.*pccl_trio\[gpu\]"):
        as_array(gpu, name="send")


@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.name)
def test_byte_view_is_a_writable_flat_view_of_the_bytes(data_type: DataType) -> None:
    dtype = to_numpy_dtype(data_type)
    original = numpy.zeros((2, 3), dtype)
    xp, array = as_array(original, name="send")
    view = byte_view(xp, array)
    assert view.format == "B" and view.ndim == 1 and not view.readonly
    assert view.nbytes == original.nbytes
    view[: dtype.itemsize] = numpy.ones(1, dtype).tobytes()
    assert original.reshape(-1)[0] == 1 and original.reshape(-1)[1] == 0


def test_byte_view_of_an_empty_array_is_empty() -> None:
    assert byte_view(numpy, numpy.empty(0, numpy.float64)).nbytes == 0


def test_byte_view_refuses_other_array_modules_and_unsuitable_arrays() -> None:
    with pytest.raises(InvalidArgument, match="numpy array"):
        byte_view(object(), numpy.zeros(3))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        byte_view(numpy, numpy.zeros(6)[::2])
    read_only = numpy.zeros(3)
    read_only.setflags(write=False)
    with pytest.raises(InvalidArgument, match="writable"):
        byte_view(numpy, read_only)
