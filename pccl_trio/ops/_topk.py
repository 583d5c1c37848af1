"""Top-k sparsification with error feedback: what a peer sends of a vector, in what
wire form, and the dense sum of every peer's.

Theory of operation
-------------------
A peer's contribution is its input plus its *residual*, the part of earlier
contributions it has not sent yet: ``compensated = input + residual``, in the input's
dtype. The vector is cut into chunks of ``chunk`` elements (the last one padded with
zeros), and of each chunk the ``k`` entries largest in magnitude are kept (chunked
selection, as SparseLoCo does: the kept entries spread over the whole vector, each
chunk's indexes fit in 16 bits, and every peer's selection has the same size, so the
gather of selections needs no sizes). ``k`` is ``fraction * chunk`` rounded, at least
1.

The wire form of a selection (``TopKLayout.payload_bytes``, the same for every peer of
a call) is three arrays, one after the other: the kept entries' indexes within their
chunk (``uint16``, ascending within each chunk), their values (the input's dtype), or
their codes (``values=QuantizationOptions``: min-max over each chunk's kept values,
``uint8`` or ``uint16`` codes, or ``uint8`` codes of 2 or 4 bits, ``value_bits``, packed
four or two to a byte, the first code in the lowest bits, the last byte padded with
zeros), and for codes each chunk's ``lo`` and ``step`` (``float32``). A value that
travels as a code *is* its decoded value (``lo + code * step``, in float32, then in the
input's dtype), computed by the same operations from the same bytes on every peer, the
sender included.

What was not sent stays for later: the residual becomes ``compensated`` with each sent
entry replaced by what its decoded value left over (``compensated - decoded``, which is
0 unquantized), so ``residual + sent == input + old residual``.

The dense result sums the selections in ascending peer-id order: zeros, then each
peer's decoded values added at their indexes; ``AVG`` divides the sum by the world size
afterwards. The same bytes in the same order give every peer the same bits. An index
past its chunk, or into the padding, which no honest peer sends, is dropped by every
peer alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy

from .._core.messages import MAX_TOPK_CHUNK, TOPK_CODE_BITS
from .._errors import InvalidArgument
from .._types import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from ._buffers import Array, ArrayModule
from ._kernels import finalize_average

__all__ = ["Selection", "TopKLayout", "topk_feed_back", "topk_select", "topk_sum"]


_CODES = {DataType.UINT8: numpy.uint8, DataType.UINT16: numpy.uint16}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_HEADER = 8  # a chunk's lo and step, float32 each
_BLOCK = 1 << 20  # entries ``topk_select`` partitions at a time


@dataclasses.dataclass(frozen=True, slots=True)
class TopKLayout:
    """What every peer of a Top-k all-reduce must agree on, and the sizes it implies.

    Attributes:
        count: elements of the dense vector; dtype: its numpy dtype.
        chunk: elements per chunk; k: entries kept of each.
        codes: the numpy dtype of the values' codes (None: values as they are).
        bits: the codes' width when packed below a byte (0: not packed).
    """

    count: int
    dtype: numpy.dtype[Any]
    chunk: int
    k: int
    codes: numpy.dtype[Any] | None
    bits: int = 0

    @property
    def chunks(self) -> int:
        return -(-self.count // self.chunk)

    @property
    def entries(self) -> int:
        """Entries a peer sends (padding included)."""
        return self.chunks * self.k

    @property
    def values_bytes(self) -> int:
        """The bytes of a selection's values (or codes) on the wire."""
        if self.bits:
            return -(-self.entries * self.bits // 8)
        return self.entries * int((self.dtype if self.codes is None else self.codes).itemsize)

    @property
    def levels(self) -> int:
        """The highest code (codes only)."""
        assert self.codes is not None
        return (1 << self.bits) - 1 if self.bits else int(numpy.iinfo(self.codes).max)

    @property
    def payload_bytes(self) -> int:
        """The bytes of one peer's selection on the wire."""
        header = self.chunks * _HEADER if self.codes is not None else 0
        return self.entries * 2 + self.values_bytes + header

    @classmethod
    def of(
        cls, count: int, dtype: numpy.dtype[Any], *, fraction: float, chunk: int,
        values: QuantizationOptions | None, value_bits: int | None = None,
    ) -> TopKLayout:
        """The layout of a call, its options checked.

        Raises:
            InvalidArgument: which option is wrong, and how.
        """
        if str(dtype) not in _FLOATS:
            raise InvalidArgument(f"Top-k compression needs floating-point tensors, not {dtype}")
        if (isinstance(fraction, bool) or not isinstance(fraction, int | float)
                or not 0 < fraction <= 1):
            raise InvalidArgument(f"TopK.fraction must be a number in (0, 1], got {fraction!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_TOPK_CHUNK:
            raise InvalidArgument(f"TopK.chunk must be an int in [1, {MAX_TOPK_CHUNK}], got {chunk!r}")
        codes = None
        if values is not None:
            if not isinstance(values, QuantizationOptions):
                raise InvalidArgument(f"TopK.values must be QuantizationOptions or None, got {values!r}")
            algorithm, datatype = values.algorithm, values.quantized_datatype
            if algorithm is not QuantizationAlgorithm.MIN_MAX or datatype not in _CODES:
                raise InvalidArgument(
                    "TopK.values quantizes with MIN_MAX to UINT8 or UINT16, not "
                    f"{algorithm!r} to {datatype!r}"
                )
            codes = numpy.dtype(_CODES[datatype])
        bits = 0
        if value_bits is not None:
            if (isinstance(value_bits, bool) or not isinstance(value_bits, int)
                    or codes is None or codes != numpy.uint8 or value_bits not in TOPK_CODE_BITS):
                raise InvalidArgument(
                    f"TopK.value_bits packs uint8 codes (values=QuantizationOptions(UINT8)) "
                    f"to {' or '.join(map(str, TOPK_CODE_BITS))} bits; got value_bits="
                    f"{value_bits!r} with values={values!r}"
                )
            bits = int(value_bits)
        k = max(1, min(chunk, round(fraction * chunk)))
        return cls(count=count, dtype=dtype, chunk=chunk, k=k, codes=codes, bits=bits)


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """One peer's selection: its wire form, and what it takes to update its residual.

    Attributes:
        payload: the wire form (uint8, ``payload_bytes``).
        compensated: input + residual (the dense vector, padded to whole chunks).
        indexes: the kept entries' positions in it (chunks x k).
        decoded: their values as every peer decodes them (chunks x k).
        invalid: why the values cannot be quantized (non-finite among them), or None.
    """

    payload: Array
    compensated: Array
    indexes: Array
    decoded: Array
    invalid: str | None = None


def topk_select(xp: ArrayModule, layout: TopKLayout, send: Array, residual: Array) -> Selection:
    """What this peer sends of ``send + residual`` (flat arrays of ``layout``'s count
    and dtype); reads both, writes neither (see the module docstring)."""
    chunks, chunk, k = layout.chunks, layout.chunk, layout.k
    compensated = xp.zeros(chunks * chunk, dtype=layout.dtype)
    xp.add(send, residual, out=compensated[:layout.count])
    table = compensated.reshape(chunks, chunk)
    local = xp.empty((chunks, k), dtype=numpy.int64)
    # A block of chunks at a time: the partition's indexes (8 bytes per entry, of which
    # it keeps k per chunk) and the magnitudes stay a few MiB, instead of twice and
    # thrice the vector's size in fresh memory.
    rows = max(1, _BLOCK // chunk)
    for first in range(0, chunks, rows):
        block = table[first:first + rows]
        magnitude = xp.abs(block if block.dtype.itemsize >= 4 else block.astype(numpy.float32))
        kept = xp.argpartition(magnitude, chunk - k, axis=1)[:, chunk - k:]
        local[first:first + rows] = xp.sort(kept, axis=1)
    values = xp.take_along_axis(table, local, axis=1)
    indexes = local + (xp.arange(chunks) * chunk)[:, None]
    parts = [local.astype(numpy.uint16).reshape(-1).view(numpy.uint8)]
    invalid = None
    if layout.codes is None:
        decoded = values
        parts.append(values.reshape(-1).view(numpy.uint8))
    else:
        wide = values.astype(numpy.float32)
        lo = wide.min(axis=1)
        span = wide.max(axis=1) - lo
        if not bool(xp.isfinite(span).all()):
            invalid = "Top-k values to quantize hold NaN or infinity"
        levels = numpy.float32(layout.levels)
        with numpy.errstate(all="ignore"):
            step = (span / levels).astype(numpy.float32)
            safe = xp.where(step > 0, step, numpy.float32(1))
            scaled = xp.rint((wide - lo[:, None]) / safe[:, None])
        codes = xp.clip(xp.nan_to_num(scaled), 0, levels).astype(layout.codes)
        decoded = _decode(xp, layout, codes, lo, step)
        flat = codes.reshape(-1)
        wire = _pack(xp, flat, layout.bits) if layout.bits else flat.view(numpy.uint8)
        parts += [wire, lo.view(numpy.uint8), step.view(numpy.uint8)]
    payload = xp.concatenate(parts)
    assert int(payload.size) == layout.payload_bytes
    return Selection(payload, compensated, indexes, decoded, invalid)


def _decode(xp: ArrayModule, layout: TopKLayout, codes: Array, lo: Array, step: Array) -> Array:
    """Codes' values, in the input's dtype (the same operations on every peer; a
    non-finite range, which makes the call invalid, decodes to what it decodes to)."""
    with numpy.errstate(all="ignore"):
        wide = lo[:, None] + codes.astype(numpy.float32) * step[:, None]
    return wide.astype(layout.dtype)


def _pack(xp: ArrayModule, codes: Array, bits: int) -> Array:
    """``uint8`` codes below ``2 ** bits``, ``8 // bits`` to a byte, the first in the
    lowest bits (the last byte padded with zero codes)."""
    per_byte = 8 // bits
    padded = xp.zeros(-(-int(codes.size) // per_byte) * per_byte, dtype=numpy.uint8)
    padded[:codes.size] = codes
    table = padded.reshape(-1, per_byte)
    packed = xp.zeros(table.shape[0], dtype=numpy.uint8)
    for position in range(per_byte):
        packed |= table[:, position] << numpy.uint8(position * bits)
    return packed


def _unpack(xp: ArrayModule, packed: Array, bits: int, count: int) -> Array:
    """The first ``count`` codes of ``_pack``'s bytes."""
    per_byte = 8 // bits
    mask = numpy.uint8((1 << bits) - 1)
    table = xp.empty((int(packed.size), per_byte), dtype=numpy.uint8)
    for position in range(per_byte):
        table[:, position] = (packed >> numpy.uint8(position * bits)) & mask
    return table.reshape(-1)[:count]


def _parse(xp: ArrayModule, layout: TopKLayout, payload: Array) -> tuple[Array, Array]:
    """A selection's (global indexes, decoded values), both chunks x k."""
    chunks, k = layout.chunks, layout.k
    entries = layout.entries
    index_end = 2 * entries
    value_end = index_end + layout.values_bytes
    # Each part copied out first: a payload's place in the gathered buffer aligns it
    # to nothing, and a device reads wider elements only where they are aligned.
    local = payload[:index_end].copy().view(numpy.uint16).reshape(chunks, k).astype(numpy.int64)
    raw = payload[index_end:value_end].copy()
    if layout.codes is None:
        values = raw.view(layout.dtype).reshape(chunks, k)
    else:
        lo = payload[value_end:value_end + 4 * chunks].copy().view(numpy.float32)
        step = payload[value_end + 4 * chunks:].copy().view(numpy.float32)
        codes = _unpack(xp, raw, layout.bits, entries) if layout.bits else raw.view(layout.codes)
        values = _decode(xp, layout, codes.reshape(chunks, k), lo, step)
    # Past its chunk: no honest peer's; dropped alike everywhere, into a slot past the
    # chunks (``topk_sum``'s sink).
    sink = layout.chunk * chunks
    indexes = xp.where(
        local < layout.chunk, local + (xp.arange(chunks) * layout.chunk)[:, None], sink
    )
    return indexes, values


def topk_sum(
    xp: ArrayModule, layout: TopKLayout, payloads: list[Array], *, op: ReduceOp, out: Array,
) -> None:
    """The dense sum of ``payloads`` (every peer's selection, in ascending peer-id
    order) into ``out`` (flat, the layout's count and dtype); an average divided by
    their number."""
    total = xp.zeros(layout.chunks * layout.chunk + 1, dtype=layout.dtype)  # and a sink
    for payload in payloads:
        indexes, values = _parse(xp, layout, payload)
        total[indexes.reshape(-1)] += values.reshape(-1)
    result = total[:layout.count]
    if op is ReduceOp.AVG:
        finalize_average(xp, result, len(payloads))
    out[...] = result


def topk_feed_back(xp: ArrayModule, layout: TopKLayout, selection: Selection, residual: Array) -> None:
    """What this peer did not send, into ``residual`` (after its selection was
    summed: see the module docstring)."""
    kept = selection.compensated.copy()
    flat = selection.indexes.reshape(-1)
    kept[flat] = selection.compensated[flat] - selection.decoded.reshape(-1)
    residual[...] = kept[:layout.count]
