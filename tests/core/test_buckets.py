"""The bucket packer: deterministic, grouped by key, large tensors alone."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pccl_trio as pccl
from pccl_trio._core.buckets import plan_buckets

from .support import DETERMINISTIC

F32, F16 = "float32", "float16"


def test_small_tensors_share_a_bucket_until_it_is_full() -> None:
    items = [(F32, 400)] * 7
    assert plan_buckets(items, 1000) == [(0, 1), (2, 3), (4, 5), (6,)]


def test_a_tensor_filling_the_bucket_exactly_joins_it() -> None:
    assert plan_buckets([(F32, 600), (F32, 400), (F32, 1)], 1000) == [(0, 1), (2,)]


def test_large_tensors_go_alone_and_do_not_close_the_open_bucket() -> None:
    items = [(F32, 100), (F32, 1000), (F32, 5000), (F32, 100), (F32, 999)]
    assert plan_buckets(items, 1000) == [(0, 3), (1,), (2,), (4,)]


def test_dtypes_never_share_a_bucket_and_buckets_are_ordered_by_first_member() -> None:
    items = [(F32, 10), (F16, 10), (F32, 10), ("int32", 10), (F16, 10), (F32, 10)]
    assert plan_buckets(items, 1000) == [(0, 2, 5), (1, 4), (3,)]


def test_unfusable_tensors_go_alone() -> None:
    items: list[tuple[Hashable | None, int]] = [(None, 4), (None, 4), (F32, 4), (F32, 4)]
    assert plan_buckets(items, 1000) == [(0,), (1,), (2, 3)]


def test_no_fusion_is_one_bucket_per_tensor_in_order() -> None:
    items = [(F32, 0), (F32, 4), (F16, 2)]
    assert plan_buckets(items, 0) == [(0,), (1,), (2,)]


def test_empty_tensors_fuse() -> None:
    assert plan_buckets([(F32, 0), (F32, 0), (F32, 8)], 8) == [(0, 1), (2,)]


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([(F32, 4)], -1)
    with pytest.raises(ValueError, match="item 1"):
        plan_buckets([(F32, 4), (F32, -4)], 16)


def test_config_checks_bucket_bytes() -> None:
    assert pccl.Config(bucket_bytes=0).bucket_bytes == 0
    for bad in (-1, 1.5, "4", True, None):
        with pytest.raises(ValueError, match="bucket_bytes"):
            pccl.Config(bucket_bytes=bad)  # type: ignore[arg-type]


items_strategy = st.lists(
    st.tuples(st.sampled_from([F32, F16, "int8", None]), st.integers(0, 3000)), max_size=60
)


@DETERMINISTIC
@given(items=items_strategy, bucket_bytes=st.integers(0, 4096))
def test_every_plan_is_a_partition_by_the_rules(
    items: list[tuple[str | None, int]], bucket_bytes: int
) -> None:
    buckets = plan_buckets(items, bucket_bytes)
    assert plan_buckets(list(items), bucket_bytes) == buckets  # deterministic
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(items)))
    assert [bucket[0] for bucket in buckets] == sorted(bucket[0] for bucket in buckets)
    for bucket in buckets:
        assert list(bucket) == sorted(bucket)
        if len(bucket) > 1:
            keys = {items[i][0] for i in bucket}
            assert len(keys) == 1 and None not in keys
            assert sum(items[i][1] for i in bucket) <= bucket_bytes
            assert all(items[i][1] < bucket_bytes for i in bucket)
    # Greedy: a fusable tensor opened a new bucket only when its key's open one was full.
    for position, bucket in enumerate(buckets):
        key, nbytes = items[bucket[0]]
        if key is None or nbytes >= bucket_bytes:
            continue
        earlier = [b for b in buckets[:position] if len(b) and items[b[0]][0] == key
                   and items[b[0]][1] < bucket_bytes]
        if earlier:
            assert sum(items[i][1] for i in earlier[-1]) + nbytes > bucket_bytes
