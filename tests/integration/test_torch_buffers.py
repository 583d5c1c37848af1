"""All-reduce straight on torch tensors (DLPack, zero-copy, in place); needs torch."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import pccl_trio as pccl

from .conftest import Cluster, form_run, run_all

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
async def test_all_reduce_on_torch_tensors_in_place(
    cluster: Cluster, clock: object, dtype: str
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        tensors = [torch.full((4, 1000), i + 1, dtype=getattr(torch, dtype)) for i in range(3)]
        pointers = [t.data_ptr() for t in tensors]
        infos = await run_all(comms, lambda i, c: c.all_reduce(tensors[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        for tensor, pointer in zip(tensors, pointers, strict=True):
            assert tensor.data_ptr() == pointer  # the same memory, written in place
            assert bool((tensor == 6).all())
        outs = [torch.zeros(4000, dtype=getattr(torch, dtype)) for _ in range(3)]
        sources = [t.reshape(-1).clone() for t in tensors]
        await run_all(comms, lambda i, c: c.all_reduce(sources[i], outs[i], op=pccl.ReduceOp.MAX))
        assert all(bool((o == 6).all()) for o in outs)
        for comm in comms:
            await comm.aclose()
