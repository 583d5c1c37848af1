"""Content hash of shared-state tensors: PCCL's *simplehash*, vectorized on the array module.

Theory of operation
-------------------
Peers compare shared state by hash, so every peer must compute the same hash for the
same bytes, whether its tensors live in host memory (numpy) or on a GPU (CuPy). The
algorithm is the one PCCL specifies for its CPU and CUDA paths, which makes hashes
comparable with it too. It is defined over the bytes as little-endian 32-bit words:

``combine(a, b) = rotl32(a ^ (b + 0x9E3779B1), 7) * 0x85EBCA6B`` (mod 2**32).

The words are grouped into *vectors* of 4; ``n_vec`` vectors are split into ``grid =
min(ceil(n_vec / 256), 960)`` blocks of ``vpb = ceil(n_vec / grid)`` consecutive vectors
(the last block may be shorter). In a block, 256 accumulators (*lanes*) start at 0, and
lane ``t`` folds the 4 words of vectors ``t, t + 256, t + 512, ...`` of the block, in
order. A block's hash reduces its 256 lanes with ``block_reduce`` (a tree of
``combine`` within each 32-lane warp, then over the 8 warp results padded with zeros).
The block hashes are folded into 256 lanes again (block ``i`` into lane ``i % 256``) and
reduced the same way. Leftover words, and then leftover bytes (packed little-endian
into one zero-padded word), are combined into the result one by one.

Every lane's fold is a sequential chain, but the lanes are independent: the hash is
computed one *step* at a time (one vector per lane of every block) with whole-array
operations over up to 960 x 256 lanes, reading the data in place through a strided
view. Hashing 1 GiB takes ``274 x 4`` such steps.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy

from ._buffers import Array, ArrayModule
from ._crossings import CROSSINGS

__all__ = ["simplehash"]

_ADD = 0x9E3779B1
_MULTIPLY = 0x85EBCA6B
_MASK = 0xFFFFFFFF
_LANES = 256
_WARP = 32
_MAX_BLOCKS = 960


def _combine_int(a: int, b: int) -> int:
    """``combine`` on Python integers (for the few words outside the vectors)."""
    a ^= (b + _ADD) & _MASK
    a = ((a << 7) | (a >> 25)) & _MASK
    return (a * _MULTIPLY) & _MASK


def _combine_into(xp: ArrayModule, a: Array, b: Array, scratch: Array) -> None:
    """``a = combine(a, b)`` element-wise, in place (``scratch``: a's shape, uint32)."""
    xp.add(b, numpy.uint32(_ADD), out=scratch)
    xp.bitwise_xor(a, scratch, out=a)
    xp.left_shift(a, numpy.uint32(7), out=scratch)
    xp.right_shift(a, numpy.uint32(25), out=a)
    xp.bitwise_or(a, scratch, out=a)
    xp.multiply(a, numpy.uint32(_MULTIPLY), out=a)


def _combine(xp: ArrayModule, a: Array, b: Array) -> Array:
    out = a.copy()
    _combine_into(xp, out, b, xp.empty_like(out))
    return out


def _warp_reduce(xp: ArrayModule, values: Array) -> Array:
    """Reduce the last axis (32 values) as a warp does: ``v[i] = combine(v[i], v[i +
    offset])`` for offsets 16, 8, 4, 2, 1; the result is ``v[0]``."""
    v = values.copy()
    offset = _WARP // 2
    while offset:
        v[..., :offset] = _combine(xp, v[..., :offset], v[..., offset : 2 * offset])
        offset //= 2
    return v[..., 0]


def _block_reduce(xp: ArrayModule, lanes: Array) -> Array:
    """Reduce the last axis (256 lanes) to one value: each warp of 32, then the 8 warp
    results padded with 24 zeros."""
    shape = lanes.shape[:-1]
    warps = _warp_reduce(xp, lanes.reshape(*shape, _LANES // _WARP, _WARP))
    padded = xp.zeros((*shape, _WARP), dtype=numpy.uint32)
    padded[..., : _LANES // _WARP] = warps
    return _warp_reduce(xp, padded)


def _fold_blocks(xp: ArrayModule, vectors: Array, blocks: int, length: int) -> Array:
    """The 256 lanes of each of ``blocks`` consecutive blocks of ``length`` vectors each,
    starting at ``vectors[0]``; shape ``(blocks, 256)``."""
    lanes = xp.zeros((blocks, _LANES), dtype=numpy.uint32)
    if blocks == 0 or length == 0:
        return lanes
    itemsize = vectors.strides[1]
    view = xp.lib.stride_tricks.as_strided(
        vectors, shape=(blocks, length, 4), strides=(length * 4 * itemsize, 4 * itemsize, itemsize)
    )
    scratch = xp.empty_like(lanes)
    for start in range(0, length, _LANES):
        active = min(_LANES, length - start)
        acc = lanes[:, :active] if active < _LANES else lanes
        tmp = scratch[:, :active] if active < _LANES else scratch
        for word in range(4):
            _combine_into(xp, acc, view[:, start : start + active, word], tmp)
    return lanes


#: Vectors below which a hash runs in one thread whatever ``threads`` says.
_PARALLEL_VECTORS = 1 << 20


def simplehash(xp: ArrayModule, array: Array, *, threads: int = 1) -> int:
    """The simplehash of ``array``'s bytes (a C-contiguous array of ``xp``), as an
    unsigned 32-bit integer; 0 for an empty array.

    ``threads`` > 1 folds disjoint ranges of blocks in that many threads (numpy
    releases the GIL in its loops); the result does not depend on it.
    """
    data = array.reshape(-1).view(numpy.uint8)
    size = int(data.size)
    if size == 0:
        return 0
    n_words = size // 4
    n_vec = n_words // 4
    h = 0
    if n_vec:
        vectors = data[: n_vec * 16].view(numpy.uint32).reshape(n_vec, 4)
        grid = min(-(-n_vec // _LANES), _MAX_BLOCKS)
        per_block = -(-n_vec // grid)
        full, rest = divmod(n_vec, per_block)
        workers = min(threads, full) if xp is numpy and n_vec >= _PARALLEL_VECTORS else 1
        if workers > 1:
            bounds = [full * i // workers for i in range(workers + 1)]
            with ThreadPoolExecutor(workers, thread_name_prefix="pccl_trio hash") as pool:
                parts = list(
                    pool.map(
                        lambda span: _fold_blocks(
                            xp, vectors[span[0] * per_block :], span[1] - span[0], per_block
                        ),
                        zip(bounds, bounds[1:], strict=False),
                    )
                )
        else:
            parts = [_fold_blocks(xp, vectors, full, per_block)]
        if rest:
            parts.append(_fold_blocks(xp, vectors[full * per_block :], 1, rest))
        empty = grid - full - (1 if rest else 0)
        if empty:
            parts.append(xp.zeros((empty, _LANES), dtype=numpy.uint32))
        block_hashes = _block_reduce(xp, xp.concatenate(parts))
        final = xp.zeros(_LANES, dtype=numpy.uint32)
        scratch = xp.empty_like(final)
        for section in range(0, grid, _LANES):
            chunk = block_hashes[section : section + _LANES]
            _combine_into(xp, final[: chunk.size], chunk, scratch[: chunk.size])
        h = int(_block_reduce(xp, final))
    tail = data[n_vec * 16 :]
    if xp is not numpy:  # the last few bytes, from the device
        tail = xp.asnumpy(tail)
        CROSSINGS.to_host(tail.nbytes)
    tail_bytes = bytes(numpy.asarray(tail))
    for offset in range(0, len(tail_bytes) - len(tail_bytes) % 4, 4):
        h = _combine_int(h, int.from_bytes(tail_bytes[offset : offset + 4], "little"))
    if len(tail_bytes) % 4:
        h = _combine_int(h, int.from_bytes(tail_bytes[len(tail_bytes) // 4 * 4 :], "little"))
    return h


