"""All-reduce straight on torch tensors (DLPack, zero-copy, in place); needs torch."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import pccl_trio as pccl

from .conftest import WITH_BLOCKING, Cluster, form_run, run_all, sync_all

NETWORKS = WITH_BLOCKING

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
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


def model_state(seed: int, dtype: str) -> tuple[torch.nn.Module, pccl.SharedState]:
    """A small model whose parameters (requiring grad) and optimizer moments are the state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    ).to(getattr(torch, dtype))
    moments = [torch.zeros_like(p, requires_grad=False) for p in model.parameters()]
    infos = [pccl.TensorInfo(f"param.{name}", p) for name, p in model.named_parameters()]
    infos += [pccl.TensorInfo(f"moment.{i}", m) for i, m in enumerate(moments)]
    return model, pccl.SharedState(infos, revision=0)


def assert_identical(models: list[torch.nn.Module]) -> None:
    """Every model's parameters bit for bit the first's."""
    for model in models[1:]:
        for mine, theirs in zip(model.parameters(), models[0].parameters(), strict=True):
            assert torch.equal(mine.detach().view(torch.uint8), theirs.detach().view(torch.uint8))


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
async def test_a_joiner_receives_model_parameters_in_place_and_training_stays_identical(
    cluster: Cluster, clock: object, dtype: str
) -> None:
    with trio.fail_after(60):
        founders = await form_run([], [cluster.communicator(f"f{i}") for i in range(2)])
        models, states = zip(*(model_state(1, dtype) for _ in range(2)), strict=True)
        await sync_all(founders, states)
        joiner_model, joiner_state = model_state(99, dtype)  # different weights
        pointers = [p.data_ptr() for p in joiner_model.parameters()]
        comms = await form_run(founders, [cluster.communicator("joiner")])
        models, states = [*models, joiner_model], [*states, joiner_state]
        for state in states[:2]:
            state.revision += 1
        infos = await sync_all(comms, states)
        assert infos[2].rx_bytes > 0  # type: ignore[attr-defined]
        assert [p.data_ptr() for p in joiner_model.parameters()] == pointers  # in place
        assert_identical(models)
        for step in range(2):  # a training step: local gradients, averaged, applied alike
            grads = []
            for i, model in enumerate(models):
                model.zero_grad()
                inputs = torch.full((8, 16), float(i + step), dtype=getattr(torch, dtype))
                model(inputs).square().mean().backward()
                grads.append([p.grad for p in model.parameters()])
            await run_all(comms, lambda i, c, grads=grads: c.all_reduce_multiple_with_retry(
                grads[i], op=pccl.ReduceOp.AVG))
            for model in models:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            for state in states:
                state.revision += 1
            infos = await sync_all(comms, states)
            assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0)] * 3  # type: ignore[attr-defined]
            assert_identical(models)
        for comm in comms:
            await comm.aclose()
