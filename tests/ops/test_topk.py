"""Top-k selection, its wire form and the dense sum (``ops/_topk.py``): against a
reference written plainly (a sort per chunk; ties kept either way), exact error
feedback, quantized values decoded alike by sender and receivers, hostile indexes
dropped alike, and the same results on the strict device stand-in."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pccl_trio import InvalidArgument, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from pccl_trio._types import DataType
from pccl_trio.ops import TopKLayout, topk_feed_back, topk_select, topk_sum
from pccl_trio.testing import StrictDevice

UINT8 = QuantizationOptions(quantized_datatype=DataType.UINT8)


def assert_largest_kept(compensated: np.ndarray, kept: np.ndarray, chunk: int, k: int) -> None:
    """``kept`` (positions, ascending) holds, of every chunk, ``k`` distinct entries (all
    of a shorter last chunk) whose magnitudes are the ``k`` largest: among equal
    magnitudes any may be kept (the partition's choice differs between CPUs)."""
    assert np.array_equal(kept, np.unique(kept))
    for start in range(0, len(compensated), chunk):
        part = np.abs(compensated[start:start + chunk].astype(np.float32))
        mine = kept[(kept >= start) & (kept < start + chunk)] - start
        assert len(mine) == min(k, len(part))
        assert np.array_equal(np.sort(part[mine]), np.sort(part)[len(part) - len(mine):])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize(("count", "chunk", "fraction"), [(1, 8, 0.5), (1000, 64, 0.05), (4096, 4096, 0.01)])
def test_selection_keeps_the_largest_of_each_chunk_and_feeds_back_the_rest_exactly(
    dtype: Any, count: int, chunk: int, fraction: float,
) -> None:
    rng = np.random.default_rng(count)
    send = rng.standard_normal(count).astype(dtype)
    residual = (rng.standard_normal(count) * 0.1).astype(dtype)
    layout = TopKLayout.of(count, np.dtype(dtype), fraction=fraction, chunk=chunk, values=None)
    before = (send.copy(), residual.copy())
    selection = topk_select(np, layout, send, residual)
    assert send.tobytes() == before[0].tobytes() and residual.tobytes() == before[1].tobytes()
    compensated = (send + residual).astype(dtype)
    real = selection.indexes.reshape(-1)
    real = real[real < count]
    # Only the last chunk may be short: when it has fewer than k entries, all are kept.
    assert_largest_kept(compensated, np.sort(real), chunk, layout.k)
    assert len(selection.payload) == layout.payload_bytes
    out = np.empty(count, dtype=dtype)
    topk_sum(np, layout, [selection.payload], op=ReduceOp.SUM, out=out)
    sent = np.zeros(count, dtype=dtype)
    sent[real] = compensated[real]
    assert out.tobytes() == sent.tobytes()
    topk_feed_back(np, layout, selection, residual)
    # residual + sent == input + old residual, exactly.
    assert (residual + sent).tobytes() == compensated.tobytes()
    assert not residual[real].any()


def test_the_sum_adds_every_selection_in_the_order_given_and_an_average_divides() -> None:
    rng = np.random.default_rng(5)
    count, world = 3000, 3
    layout = TopKLayout.of(count, np.dtype(np.float32), fraction=0.1, chunk=512, values=None)
    sends = [(rng.standard_normal(count) * 10.0 ** i).astype(np.float32) for i in range(world)]
    selections = [topk_select(np, layout, s, np.zeros(count, np.float32)) for s in sends]
    expected = np.zeros(count, dtype=np.float32)
    for send, selection in zip(sends, selections, strict=True):
        where = selection.indexes.reshape(-1)
        where = where[where < count]
        expected[where] += send[where]
    out = np.empty(count, np.float32)
    topk_sum(np, layout, [s.payload for s in selections], op=ReduceOp.SUM, out=out)
    assert out.tobytes() == expected.tobytes()
    topk_sum(np, layout, [s.payload for s in selections], op=ReduceOp.AVG, out=out)
    assert out.tobytes() == (expected / np.float32(world)).astype(np.float32).tobytes()


@pytest.mark.parametrize(("codes", "bits"), [
    (DataType.UINT8, None), (DataType.UINT16, None), (DataType.UINT8, 4), (DataType.UINT8, 2),
], ids=["uint8", "uint16", "4-bit", "2-bit"])
def test_quantized_values_decode_alike_at_the_sender_and_the_receivers(
    codes: DataType, bits: int | None
) -> None:
    rng = np.random.default_rng(9)
    count = 5000
    values = QuantizationOptions(quantized_datatype=codes)
    layout = TopKLayout.of(
        count, np.dtype(np.float32), fraction=0.02, chunk=1024, values=values, value_bits=bits
    )
    send = rng.standard_normal(count).astype(np.float32)
    residual = np.zeros(count, np.float32)
    selection = topk_select(np, layout, send, residual)
    assert selection.invalid is None
    width = 8 * np.dtype(codes.name.lower()).itemsize if bits is None else bits
    # 5 chunks of 20 entries: 100 codes, packed whole into bytes.
    assert layout.payload_bytes == layout.entries * 2 + -(-layout.entries * width // 8) + 8 * layout.chunks
    assert len(selection.payload) == layout.payload_bytes
    out = np.empty(count, np.float32)
    topk_sum(np, layout, [selection.payload], op=ReduceOp.SUM, out=out)
    where = selection.indexes.reshape(-1)
    where = where[where < count]
    # What the receivers decode is what the sender decoded: the residual keeps the rest.
    assert out[where].tobytes() == selection.decoded.reshape(-1)[: len(where)].tobytes()
    topk_feed_back(np, layout, selection, residual)
    assert residual[where].tobytes() == (send[where] - out[where]).tobytes()
    # A code is within half a step of its value: the step is a chunk's span / levels.
    span = np.abs(send[where]).max() * 2
    assert np.abs(residual[where]).max() <= span / ((1 << width) - 1) / 2 * 1.001
    if bits is not None:
        assert len(np.unique(out[where])) <= layout.chunks * (1 << bits)
    rest = np.setdiff1d(np.arange(count), where)
    assert residual[rest].tobytes() == send[rest].tobytes()


def test_non_finite_values_to_quantize_make_the_selection_invalid() -> None:
    layout = TopKLayout.of(100, np.dtype(np.float32), fraction=0.1, chunk=50, values=UINT8)
    send = np.ones(100, np.float32)
    send[3] = np.inf
    assert "NaN or infinity" in (topk_select(np, layout, send, np.zeros(100, np.float32)).invalid or "")


def test_an_index_past_its_chunk_is_dropped_alike() -> None:
    layout = TopKLayout.of(100, np.dtype(np.float32), fraction=0.1, chunk=50, values=None)
    selection = topk_select(np, layout, np.arange(100, dtype=np.float32), np.zeros(100, np.float32))
    hostile = selection.payload.copy()
    hostile[:2] = np.frombuffer(np.uint16(60000).tobytes(), np.uint8)  # chunk 0's first index
    out = np.empty(100, np.float32)
    topk_sum(np, layout, [hostile], op=ReduceOp.SUM, out=out)
    honest = np.empty(100, np.float32)
    topk_sum(np, layout, [selection.payload], op=ReduceOp.SUM, out=honest)
    assert np.count_nonzero(out != honest) == 1  # that one entry, dropped


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dtype": np.dtype(np.int32)}, "floating-point"),
        ({"fraction": 0.0}, "TopK.fraction"),
        ({"fraction": 1.5}, "TopK.fraction"),
        ({"chunk": 0}, "TopK.chunk"),
        ({"chunk": 1 << 17}, "TopK.chunk"),
        ({"values": QuantizationOptions(algorithm=QuantizationAlgorithm.ZERO_POINT_SCALE)}, "MIN_MAX"),
        ({"values": QuantizationOptions(quantized_datatype=DataType.FLOAT16)}, "UINT8 or UINT16"),
        ({"value_bits": 2}, "value_bits packs uint8 codes"),
        ({"values": UINT8, "value_bits": 3}, "to 2 or 4 bits"),
        ({"values": UINT8, "value_bits": 2.0}, "to 2 or 4 bits"),
        ({"values": UINT8, "value_bits": True}, "to 2 or 4 bits"),
        ({"values": QuantizationOptions(quantized_datatype=DataType.UINT16), "value_bits": 2},
         "value_bits packs uint8 codes"),
    ],
)
def test_bad_options_are_refused_naming_them(kwargs: dict[str, Any], words: str) -> None:
    options: dict[str, Any] = {"dtype": np.dtype(np.float32), "fraction": 0.1, "chunk": 64, "values": None}
    options.update(kwargs)
    dtype = options.pop("dtype")
    with pytest.raises(InvalidArgument, match=words):
        TopKLayout.of(100, dtype, **options)


@pytest.mark.parametrize(("values", "bits"), [(None, None), (UINT8, None), (UINT8, 2)],
                         ids=["float32", "uint8", "2-bit"])
def test_the_device_path_gives_the_host_paths_bytes(
    values: QuantizationOptions | None, bits: int | None
) -> None:
    device = StrictDevice()
    rng = np.random.default_rng(2)
    count = 3000
    layout = TopKLayout.of(
        count, np.dtype(np.float32), fraction=0.05, chunk=700, values=values, value_bits=bits
    )
    sends = [rng.standard_normal(count).astype(np.float32) for _ in range(2)]
    residual = (rng.standard_normal(count) * 0.1).astype(np.float32)
    host = [topk_select(np, layout, s, residual) for s in sends]
    on_device = [topk_select(device, layout, device.asarray(s), device.asarray(residual)) for s in sends]
    for h, d in zip(host, on_device, strict=True):
        assert device.asnumpy(d.payload).tobytes() == h.payload.tobytes()
    out_host = np.empty(count, np.float32)
    topk_sum(np, layout, [h.payload for h in host], op=ReduceOp.AVG, out=out_host)
    out_device = device.empty(count, np.float32)
    topk_sum(device, layout, [d.payload for d in on_device], op=ReduceOp.AVG, out=out_device)
    assert device.asnumpy(out_device).tobytes() == out_host.tobytes()
    kept = device.asarray(residual)
    topk_feed_back(device, layout, on_device[0], kept)
    topk_feed_back(np, layout, host[0], residual)
    assert device.asnumpy(kept).tobytes() == residual.tobytes()
