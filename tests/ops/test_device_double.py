"""The ops layer on a device: the reduction kernels, the simplehash and the quantization
codec run on ``StrictDevice`` (a strict stand-in for cupy), bit for bit as on the host,
with no implicit host conversion and only the device-to-host copies they must make."""

from __future__ import annotations

import sys
from typing import Any

import numpy
import pytest

from pccl_trio import DataType, DistributionHint, QuantizationAlgorithm, ReduceOp
from pccl_trio._errors import InvalidArgument
from pccl_trio.ops import (
    Codec,
    as_array,
    byte_view,
    combine_into,
    finalize_average,
    reduce_into,
    simplehash,
    to_numpy_dtype,
)
from pccl_trio.ops._quantize import META_BYTES
from pccl_trio.testing import DeviceArray, StrictDevice

SIZES = (0, 1, 7, 1000)


def values(dtype: numpy.dtype[Any], size: int, seed: int) -> numpy.ndarray:
    rng = numpy.random.default_rng(seed)
    if dtype.kind not in "iu":  # floats, bfloat16 included
        return rng.normal(0, 100, size).astype(dtype)
    info = numpy.iinfo(dtype)
    return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)


# --- the double is strict ------------------------------------------------------------------


def test_a_device_array_never_becomes_a_host_array_implicitly() -> None:
    device = StrictDevice()
    array = device.asarray(numpy.arange(6, dtype=numpy.float32))
    host = numpy.ones(6, dtype=numpy.float32)
    with pytest.raises(TypeError, match="implicit conversion"):
        numpy.asarray(array)
    with pytest.raises(TypeError):
        memoryview(array)  # type: ignore[arg-type]  # no buffer: a socket cannot send it
    with pytest.raises(TypeError):
        numpy.add(array, array)
    with pytest.raises(TypeError, match="numpy function"):
        numpy.concatenate([array, array])
    with pytest.raises(TypeError, match="host array"):
        device.add(array, host)
    with pytest.raises(TypeError, match="host array"):
        array[:] = host
    with pytest.raises(TypeError):
        array.tobytes()
    assert device.to_host_bytes == 0


def test_crossings_are_explicit_and_counted() -> None:
    device = StrictDevice()
    array = device.asarray(numpy.arange(6, dtype=numpy.float32))
    assert device.to_device_bytes == 24
    doubled = device.add(array, array)
    assert isinstance(doubled, DeviceArray) and device.to_host_bytes == 0
    assert device.asnumpy(doubled).tolist() == [0, 2, 4, 6, 8, 10]
    assert device.to_host_bytes == 24
    assert int(device.count_nonzero(array > 2)) == 3  # a 0-d result: 8 bytes back
    assert device.to_host_bytes == 32
    array.set(numpy.zeros(6, dtype=numpy.float32))
    assert device.to_device_bytes == 48 and float(device.sum(array)) == 0.0


# --- the ops layer on it -----------------------------------------------------------------


@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.name)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_kernels_on_the_device_match_the_host_bit_for_bit(data_type: DataType, op: ReduceOp) -> None:
    dtype = to_numpy_dtype(data_type)
    device = StrictDevice()
    for size in SIZES:
        local, incoming, other = (values(dtype, size, seed) for seed in range(3))
        host = local.copy()
        combined = numpy.empty_like(local)
        reduce_into(numpy, host, incoming, op)
        combine_into(numpy, combined, local, other, op)
        on_device = device.asarray(local)
        device_combined = device.asarray(numpy.zeros_like(local))
        device.to_host_bytes = 0
        reduce_into(device, on_device, device.asarray(incoming), op)
        combine_into(device, device_combined, device.asarray(local), device.asarray(other), op)
        if op is ReduceOp.AVG:
            finalize_average(numpy, host, 3)
            finalize_average(device, on_device, 3)
        assert device.to_host_bytes == 0, "a kernel copied device data to the host"
        assert device.asnumpy(on_device).tobytes() == host.tobytes()
        assert device.asnumpy(device_combined).tobytes() == combined.tobytes()


@pytest.mark.parametrize("nbytes", [0, 3, 16, 17, 4096 + 5, 1 << 20])
def test_simplehash_on_the_device_is_the_hosts(nbytes: int) -> None:
    data = numpy.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=numpy.uint8)
    device = StrictDevice()
    on_device = device.asarray(data)
    assert simplehash(device, on_device) == simplehash(numpy, data)
    # Only the hash and the last few bytes come back, never the data.
    assert device.to_host_bytes <= 16 + 8


@pytest.mark.parametrize(
    ("algorithm", "quantized", "hint"),
    [(QuantizationAlgorithm.MIN_MAX, DataType.UINT8, DistributionHint.NONE),
     (QuantizationAlgorithm.MIN_MAX, DataType.UINT16, DistributionHint.NONE),
     (QuantizationAlgorithm.ZERO_POINT_SCALE, DataType.UINT8, DistributionHint.NONE),
     (QuantizationAlgorithm.ZERO_POINT_SCALE, DataType.UINT8, DistributionHint.NORMAL)],
    ids=["min_max-uint8", "min_max-uint16", "zero_point-uint8", "zero_point-uint8-normal"],
)
@pytest.mark.parametrize("data_type", [DataType.FLOAT, DataType.FLOAT16, DataType.DOUBLE],
                         ids=lambda d: d.name)
def test_quantization_encodes_on_the_device_and_only_the_codes_cross(
    algorithm: QuantizationAlgorithm, quantized: DataType, hint: DistributionHint,
    data_type: DataType,
) -> None:
    dtype = to_numpy_dtype(data_type)
    data = values(dtype, 4096, seed=5)
    device = StrictDevice()
    host_codec = Codec(numpy, dtype, algorithm, quantized, hint)
    device_codec = Codec(device, dtype, algorithm, quantized, hint)
    host_block = numpy.empty(host_codec.block_bytes(data.size), dtype=numpy.uint8)
    device_block = numpy.empty_like(host_block)
    on_device = device.asarray(data)
    device.to_device_bytes = 0
    assert device_codec.encode(on_device, device_block) == host_codec.encode(data, host_block)
    assert device_block.tobytes() == host_block.tobytes()
    codes = data.size * to_numpy_dtype(quantized).itemsize
    # The codes, and the range (two scalars): never the values themselves.
    assert codes <= device.to_host_bytes <= codes + META_BYTES + 64
    assert device.to_host_bytes < data.nbytes or to_numpy_dtype(quantized).itemsize >= dtype.itemsize
    # Decoding: the block goes to the device once, the values are made there.
    decoded = device.asarray(numpy.zeros_like(data))
    expected = numpy.zeros_like(data)
    device.to_device_bytes = 0
    device.to_host_bytes = 0
    device_codec.decode(device_block, decoded)
    host_codec.decode(host_block, expected)
    assert device.to_device_bytes <= host_block.nbytes and device.to_host_bytes <= 64
    assert device.asnumpy(decoded).tobytes() == expected.tobytes()
    # And combined with local data, as the reduce-scatter does.
    local = values(dtype, data.size, seed=6)
    on_device_local = device.asarray(local)
    device_out = device.asarray(numpy.zeros_like(local))
    host_out = numpy.zeros_like(local)
    device_codec.decode_combine(device_block, device_out, on_device_local, ReduceOp.SUM)
    host_codec.decode_combine(host_block, host_out, local, ReduceOp.SUM)
    assert device.asnumpy(device_out).tobytes() == host_out.tobytes()
    # An owner encoding its own chunk keeps what the others will decode: the same block
    # and values on both, and on the device no code comes back from the host.
    own_host, own_device = local.copy(), device.asarray(local)
    host_own_block, device_own_block = numpy.empty_like(host_block), numpy.empty_like(host_block)
    device.to_device_bytes = 0
    assert (device_codec.encode_own(own_device, device_own_block)
            == host_codec.encode_own(own_host, host_own_block))
    assert device.to_device_bytes == 0
    assert device_own_block.tobytes() == host_own_block.tobytes()
    host_codec.decode(host_own_block, expected)
    assert device.asnumpy(own_device).tobytes() == own_host.tobytes() == expected.tobytes()


@pytest.mark.parametrize("value", [2.5, 0.0, -1.0])
@pytest.mark.parametrize("algorithm", list(QuantizationAlgorithm)[1:], ids=lambda a: a.name)
def test_a_constant_block_needs_no_code_sent_back_to_the_device(
    algorithm: QuantizationAlgorithm, value: float
) -> None:
    """A constant slice (zero gradients, say): min-max decodes it from its metadata
    alone, so no code crosses to the device; either algorithm's owner keeps its own
    decoded values without copying codes back, bit for bit as on the host."""
    device = StrictDevice()
    dtype = numpy.dtype(numpy.float32)
    codec = Codec(device, dtype, algorithm, DataType.UINT8, DistributionHint.NONE)
    host_codec = Codec(numpy, dtype, algorithm, DataType.UINT8, DistributionHint.NONE)
    data = numpy.full(1000, value, numpy.float32)
    block, host_block = (numpy.empty(codec.block_bytes(1000), dtype=numpy.uint8) for _ in range(2))
    own, host_own = device.asarray(data), data.copy()
    device.to_device_bytes = 0
    codec.encode_own(own, block)
    host_codec.encode_own(host_own, host_block)
    assert device.to_device_bytes == 0
    assert block.tobytes() == host_block.tobytes()
    assert device.asnumpy(own).tobytes() == host_own.tobytes()
    out = device.asarray(numpy.zeros(1000, numpy.float32))
    device.to_device_bytes = 0
    codec.decode(block, out)
    if algorithm is QuantizationAlgorithm.MIN_MAX:
        assert device.to_device_bytes == 0
    assert device.asnumpy(out).tobytes() == host_own.tobytes()


# --- recognised as GPU buffers --------------------------------------------------------------


def test_device_arrays_are_viewed_flat_and_never_as_bytes_for_a_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = StrictDevice()
    monkeypatch.setitem(sys.modules, "cupy", device)
    array = device.asarray(numpy.arange(12, dtype=numpy.float32).reshape(3, 4))
    xp, flat = as_array(array, name="send")
    assert xp is device and isinstance(flat, DeviceArray) and flat.shape == (12,)
    flat[0] = 5.0  # a view: writes reach the caller's array
    assert float(array[0, 0]) == 5.0
    with pytest.raises(InvalidArgument, match="stage GPU arrays through a host"):
        byte_view(xp, flat)
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        as_array(array.T, name="send")
    with pytest.raises(InvalidArgument, match="not supported"):
        as_array(device.asarray(numpy.zeros(3, dtype=numpy.complex64)), name="send")
