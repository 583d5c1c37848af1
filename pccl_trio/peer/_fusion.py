"""Tensor fusion for ``all_reduce_multiple_with_retry``: buckets in, results out.

Theory of operation
-------------------
The call's tensors are checked one by one (``ReduceOptions.request``), then
``_core.buckets.plan_buckets`` groups them into buckets of up to
``Config.bucket_bytes`` from their order, dtype and size alone, so every peer that
passes the same list makes the same buckets. A tensor may fuse when it lives in host
memory (numpy, or a CPU tensor viewed through DLPack) and the call is neither
quantized nor Top-k compressed (each tensor's selection is its own): quantization
encodes each slice of a buffer with the range of its values, so a tensor fused with
others would be quantized with their range, and its error would depend on
its neighbours and on ``bucket_bytes`` (see ``docs/allreduce.md``).

A bucket of one tensor is that tensor's own request: zero-copy, the caller's buffer
is the all-reduce buffer, as without fusion. A bucket of several is one all-reduce
whose tag is the bucket's index (``RetriedReduces.run`` retries it as it retries a
tensor). Its input is its members where they lie (``_gathered.Gathered``: the ring
reads them in place, nothing packs them), its result a view of one staging buffer,
taken for the whole call from a pool that keeps its pages between steps. The caller's
tensors are not written until the bucket succeeded, so a retry reads the same input
again and no backup is taken; then, and only then, the result is copied into the
members. Each tensor therefore ends with its input, the old world's result or the new
world's, as without fusion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .._core.buckets import plan_buckets
from .._types import ReduceInfo
from ..ops import BufferPool, Gathered
from ._requests import ReduceRequest
from ._retry import RetriedReduces

__all__ = ["Fusion"]

#: Each bucket starts on a cache line of the staging buffer (its members follow each
#: other without gaps).
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


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
        if request.quantization is not None or request.topk is not None or request.xp is not np:
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
        # A bucket of several tensors: its input is its members (in place, so also
        # where its result goes once it succeeded), its result a view of the staging
        # buffer, at an offset of its own.
        several = {
            index: Gathered([requests[i].send for i in members])
            for index, members in enumerate(buckets) if len(members) > 1
        }
        offsets: dict[int, int] = {}
        total = 0
        for index, bucket in several.items():
            offsets[index] = total
            total += _aligned(bucket.nbytes)
        # (Buckets of empty tensors only are empty all-reduces, of an empty result.)
        staging = self._staging.take(total) if total else np.empty(0, np.uint8)
        bucket_requests: list[ReduceRequest] = []
        for index, members in enumerate(buckets):
            first = requests[members[0]]
            gathered = several.get(index)
            if gathered is None:
                bucket_requests.append(dataclasses.replace(first, tag=index))
                continue
            offset = offsets[index]
            result = staging[offset:offset + gathered.nbytes].view(gathered.dtype)
            bucket_requests.append(
                dataclasses.replace(first, tag=index, send=gathered, result=result)
            )

        def written(index: int) -> None:
            done = several.get(index)
            if done is not None:
                done.scatter(bucket_requests[index].result)

        info = await self._retried.run(
            bucket_requests, max_in_flight, members=buckets, on_success=written
        )
        # Only after a normal return: every attempt is over, nothing writes to it.
        if total:
            self._staging.give(staging)
        return info
