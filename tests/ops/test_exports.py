"""The ops package exports each public name once, from its private modules."""

from __future__ import annotations

import pccl_trio.ops as ops

PUBLIC = {
    "Array", "ArrayModule", "as_array", "byte_view", "in_kind_of", "combine_into", "combine_parts",
    "copy_into",
    "finalize_average", "from_numpy_dtype", "reduce_into", "to_numpy_dtype", "Codec", "NonFiniteData",
    "check_quantization", "META_BYTES", "simplehash", "CROSSINGS", "Gathered", "InputBackup",
    "BufferPool", "DeviceStaging", "HostStaging", "Lander", "Sender", "Staging",
    "gpu_of", "staging_for", "Selection", "TopKLayout", "topk_feed_back", "topk_select", "topk_sum",
    "Recycled",
}


def test_the_public_names() -> None:
    assert {name for name in vars(ops) if not name.startswith("_")} == PUBLIC


def test_functions_live_in_private_modules() -> None:
    for name in PUBLIC - {"Array", "ArrayModule", "META_BYTES", "CROSSINGS", "Staging"}:
        module = getattr(ops, name).__module__
        assert module.startswith("pccl_trio.ops._"), (name, module)
