"""Packing many small all-reduces into a few buckets, a pure function.

Theory of operation
-------------------
A training step all-reduces a few hundred tensors, most of them small. Each
all-reduce costs a fixed overhead (a vote with the master, a verdict, the ring's
start-up) that dwarfs the transfer of a few KiB, so
``all_reduce_multiple_with_retry`` packs the small tensors into *buckets*: one flat
buffer per bucket, reduced as one collective, its slices copied back to the tensors.

``plan_buckets`` decides the buckets from what every peer knows alike: the tensors'
order, their grouping key (their dtype; the call's op and quantization are shared by
all its tensors) and their sizes in bytes. It reads nothing else, so every peer that
passes the same list makes the same buckets, numbered alike, and votes the same
descriptors. The rule, walking the tensors in order:

- a tensor that may not be fused (its key is None), or of ``bucket_bytes`` or more,
  goes alone (``bucket_bytes`` 0: every tensor goes alone, no fusion);
- otherwise it joins the open bucket of its key if it fits in ``bucket_bytes``,
  else it opens a new bucket for its key (the old one is closed for good).

Tensors of different keys never share a bucket (an elementwise reduction needs one
dtype), and a bucket's members keep their relative order. Buckets are numbered by
their first member's position, which is the order the call launches them in; with
no fusion bucket ``i`` is tensor ``i``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["plan_buckets"]


def plan_buckets(
    items: Sequence[tuple[Hashable | None, int]], bucket_bytes: int
) -> list[tuple[int, ...]]:
    """The buckets of ``items``, each the indices of its members in order.

    Args:
        items: per tensor, ``(key, nbytes)``: tensors fuse only with tensors of an
            equal key; None means the tensor goes alone.
        bucket_bytes: the most bytes a bucket of several tensors holds (0: no fusion).

    Returns:
        every index exactly once, grouped into buckets ordered by first member.

    Raises:
        ValueError: ``bucket_bytes`` or a size is negative.
    """
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be non-negative, got {bucket_bytes}")
    buckets: list[list[int]] = []
    open_bucket: dict[Hashable, int] = {}  # key -> its open bucket's position
    filled: dict[Hashable, int] = {}  # key -> bytes in its open bucket
    for index, (key, nbytes) in enumerate(items):
        if nbytes < 0:
            raise ValueError(f"item {index} has a negative size ({nbytes})")
        if key is None or nbytes >= bucket_bytes:
            buckets.append([index])
            continue
        position = open_bucket.get(key)
        if position is not None and filled[key] + nbytes <= bucket_bytes:
            buckets[position].append(index)
            filled[key] += nbytes
        else:
            open_bucket[key] = len(buckets)
            filled[key] = nbytes
            buckets.append([index])
    return [tuple(bucket) for bucket in buckets]
