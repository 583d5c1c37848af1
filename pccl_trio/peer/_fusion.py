"""Tensor fusion for ``all_reduce_multiple_with_retry``: buckets in, results out.

Theory of operation
-------------------
The call's tensors are checked one by one (``ReduceOptions.request``), then
``_core.buckets.plan_buckets`` groups them into buckets of up to
``Config.bucket_bytes`` from their order, dtype and size alone, so every peer that
passes the same list makes the same buckets. A tensor may fuse when it lives in host
memory (numpy, or a CPU tensor viewed through DLPack) and the call is not quantized:
quantization encodes each slice of a buffer with the range of its values, so a tensor
fused with others would be quantized with their range, and its error would depend on
its neighbours and on ``bucket_bytes`` (see ``docs/allreduce.md``).

A bucket of one tensor is that tensor's own request: zero-copy, the caller's buffer
is the all-reduce buffer, as without fusion. A bucket of several is a view of one
staging buffer, taken for the whole call from a pool that keeps its pages between
steps; the members are copied into it when the bucket's attempt is made, before it can
move a byte (a retry copies them again, unchanged). Each bucket is one
all-reduce whose tag is the bucket's index (``RetriedReduces.run``
retries it as it retries a tensor), from the packed input into a second view of the
staging buffer: the input is never written, so a retry starts from it, and no backup
is taken, which makes up for the copy of packing. The caller's tensors are not
written until the bucket succeeded; then, and only then, its result is copied back
into its members. Each tensor therefore ends with its input, the old world's result or the
new world's, as without fusion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .._core.buckets import plan_buckets
from .._types import ReduceInfo
from ._requests import ReduceRequest
from ._retry import RetriedReduces
from ._staging import BufferPool

__all__ = ["Fusion"]

#: Each bucket starts on a cache line of the staging buffer (its members follow each
#: other without gaps).
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Packed:
    """A bucket of several tensors: its two views of the staging buffer (the packed
    inputs, the result), and where each member's elements lie in them."""

    send: np.ndarray
    result: np.ndarray
    members: tuple[ReduceRequest, ...]
    starts: tuple[int, ...]  # element offsets (the members, packed in order)

    def pack(self) -> None:
        np.concatenate([member.send for member in self.members], out=self.send)

    def unpack(self) -> None:
        result = self.result
        for member, start in zip(self.members, self.starts, strict=True):
            # Item assignment of equal dtypes: a plain copy, cheaper to call than copyto.
            member.result[...] = result[start:start + member.result.size]


class Fusion:
    """``all_reduce_multiple_with_retry``'s buckets (see the module docstring)."""

    def __init__(self, retried: RetriedReduces, *, bucket_bytes: int) -> None:
        self._retried = retried
        self._bucket_bytes = bucket_bytes
        self._staging = BufferPool()

    @staticmethod
    def _key(request: ReduceRequest) -> Hashable | None:
        """What a tensor fuses by (None: it goes alone): its dtype, since the op and the
        quantization are the call's, the same for every tensor."""
        if request.quantization is not None or request.xp is not np:
            return None
        dtype: np.dtype[Any] = request.result.dtype
        return dtype

    def plan(self, requests: Sequence[ReduceRequest]) -> list[tuple[int, ...]]:
        """The buckets of the call's tensors (``requests``, tag = index)."""
        return plan_buckets(
            [(self._key(r), int(r.result.nbytes)) for r in requests], self._bucket_bytes
        )

    async def reduce(self, requests: Sequence[ReduceRequest], max_in_flight: int) -> ReduceInfo:
        """All-reduce every tensor of ``requests`` in its bucket, retrying after
        dropouts; the results are in the tensors (see ``RetriedReduces.run``)."""
        buckets = self.plan(requests)
        layout: list[tuple[int, int]] = []  # per bucket of several: (offset, nbytes)
        total = 0
        for members in buckets:
            if len(members) > 1:
                nbytes = sum(int(requests[i].result.nbytes) for i in members)
                layout.append((total, nbytes))
                total += _aligned(nbytes)
        # Inputs in the first half, results in the second: a bucket is reduced into
        # its result half, so its packed input stays as it is for a retry, and no
        # backup of it is taken (an in-place all-reduce would copy it once more).
        staging = self._staging.take(2 * total) if total else None
        packed: dict[int, _Packed] = {}
        bucket_requests: list[ReduceRequest] = []
        offsets = iter(layout)
        for index, members in enumerate(buckets):
            first = requests[members[0]]
            if len(members) == 1:
                bucket_requests.append(dataclasses.replace(first, tag=index))
                continue
            assert staging is not None
            offset, nbytes = next(offsets)
            dtype = first.result.dtype
            send = staging[offset:offset + nbytes].view(dtype)
            result = staging[total + offset:total + offset + nbytes].view(dtype)
            starts, start = [], 0
            for i in members:
                starts.append(start)
                start += int(requests[i].result.size)
            bucket = packed[index] = _Packed(
                send=send, result=result, members=tuple(requests[i] for i in members),
                starts=tuple(starts),
            )
            bucket_requests.append(
                dataclasses.replace(first, tag=index, send=send, result=result, fill=bucket.pack)
            )

        def written(index: int) -> None:
            bucket = packed.get(index)
            if bucket is not None:
                bucket.unpack()

        info = await self._retried.run(
            bucket_requests, max_in_flight, members=buckets, on_success=written
        )
        # Only after a normal return: every attempt is over, nothing writes to it.
        if staging is not None:
            self._staging.give(staging)
        return info
