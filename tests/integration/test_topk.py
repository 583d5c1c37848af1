"""``all_reduce(compression=TopK(...))``: the result is the fixed-order sum of every
peer's selected entries, the same bits on every peer; ``residual + sent == input + old
residual`` exactly; on an abort the tensor and the residual hold their inputs and a
retry is exact; mismatched calls refused, naming each; in
``all_reduce_multiple_with_retry`` too; the bytes it saves, counted."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._types import DataType
from pccl_trio.ops import TopKLayout

from .conftest import WITH_BLOCKING, Cluster, die_mid_all_reduce, make_run, retried_after_an_abort, run_all

NETWORKS = WITH_BLOCKING

WORLD = 3
UINT8 = pccl.QuantizationOptions(quantized_datatype=DataType.UINT8)


def selected(compensated: np.ndarray, chunk: int, k: int) -> np.ndarray:
    """Where a peer's ``k`` largest of each chunk are (written plainly: a sort)."""
    out = []
    for start in range(0, len(compensated), chunk):
        part = np.abs(compensated[start:start + chunk])
        out.extend(start + np.argsort(-part, kind="stable")[:k])
    return np.array(out, dtype=np.int64)


def expected_sum(
    compensated: list[np.ndarray], order: list[int], chunk: int, k: int, op: pccl.ReduceOp,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The sum of every peer's selected entries in ``order`` (ascending peer id), and
    each peer's selected positions."""
    total = np.zeros(len(compensated[0]), dtype=compensated[0].dtype)
    where = [selected(c, chunk, k) for c in compensated]
    for i in order:
        total[where[i]] += compensated[i][where[i]]
    if op is pccl.ReduceOp.AVG:
        total /= total.dtype.type(len(compensated))
    return total, where


@pytest.mark.parametrize(("dtype", "op"), [(np.float32, pccl.ReduceOp.SUM), (np.float64, pccl.ReduceOp.AVG)])
async def test_the_result_is_the_fixed_order_sum_of_every_selection_and_the_residual_exact(
    cluster: Cluster, clock: object, dtype: type, op: pccl.ReduceOp,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        order = sorted(range(WORLD), key=lambda i: comms[i].peer_id)  # type: ignore[arg-type,return-value]
        rng = np.random.default_rng(3)
        for count in (0, 5, 3001):
            inputs = [(rng.standard_normal(count) * 10.0 ** i).astype(dtype) for i in range(WORLD)]
            old = [(rng.standard_normal(count) * 0.5).astype(dtype) for _ in range(WORLD)]
            tensors = [x.copy() for x in inputs]
            residuals = [r.copy() for r in old]
            infos = await run_all(comms, lambda i, c, t=tensors, r=residuals: c.all_reduce(
                t[i], op=op, tag=2, compression=pccl.TopK(0.05, residual=r[i], chunk=256),
            ))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            compensated = [(x + r).astype(dtype) for x, r in zip(inputs, old, strict=True)]
            want, where = expected_sum(compensated, order, 256, round(0.05 * 256), op)
            for i in range(WORLD):
                assert tensors[i].tobytes() == want.tobytes()
                sent = np.zeros(count, dtype=dtype)
                sent[where[i]] = compensated[i][where[i]]
                assert (residuals[i] + sent).tobytes() == compensated[i].tobytes()
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory", "tcp"])
@pytest.mark.parametrize("bits", [None, 2], ids=["uint8", "2-bit"])
async def test_quantized_values_give_every_peer_the_same_bits_into_recv(
    cluster: Cluster, clock: object, bits: int | None,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        rng = np.random.default_rng(4)
        count = 20_000
        inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(WORLD)]
        sends = [x.copy() for x in inputs]
        outs = [np.full(count, np.nan, np.float32) for _ in range(WORLD)]
        residuals = [np.zeros(count, np.float32) for _ in range(WORLD)]
        await run_all(comms, lambda i, c: c.all_reduce(
            sends[i], outs[i], tag=1,
            compression=pccl.TopK(0.01, residual=residuals[i], values=UINT8, value_bits=bits),
        ))
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        assert all(s.tobytes() == x.tobytes() for s, x in zip(sends, inputs, strict=True))
        assert np.isfinite(outs[0]).all()
        k = round(0.01 * 4096)
        for i in range(WORLD):
            where = selected(inputs[i], 4096, k)
            rest = np.setdiff1d(np.arange(count), where)
            assert residuals[i][rest].tobytes() == inputs[i][rest].tobytes()
            # Sent entries leave what their code could not say (at most a step).
            levels = 255 if bits is None else (1 << bits) - 1
            assert np.abs(residuals[i][where]).max() <= 2 * np.abs(inputs[i]).max() / levels
        await run_all(comms, lambda i, c: c.aclose())


async def test_a_peer_killed_mid_topk_leaves_tensors_and_residuals_as_they_were_and_a_retry_is_exact(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD, pool=2)
        count = 600_000
        inputs = [np.arange(count, dtype=np.float32) * (i + 1) for i in range(WORLD)]
        old = [np.full(count, 0.25, np.float32) for _ in range(WORLD)]
        tensors = [x.copy() for x in inputs]
        residuals = [r.copy() for r in old]

        def call(i: int, c: pccl.Communicator) -> object:
            return c.all_reduce(tensors[i], compression=pccl.TopK(0.5, residual=residuals[i]))

        results = await die_mid_all_reduce(cluster, comms, 2, call)
        assert len({type(r) for r in results}) == 1, results
        if isinstance(results[0], pccl.CollectiveAborted):
            for i in range(2):
                assert tensors[i].tobytes() == inputs[i].tobytes()
                assert residuals[i].tobytes() == old[i].tobytes()
        else:  # it completed before the kill landed: then it holds for both
            assert tensors[0].tobytes() == tensors[1].tobytes()
            for i in range(2):
                tensors[i][...] = inputs[i]
                residuals[i][...] = old[i]
        survivors = comms[:2]
        *_, infos = await retried_after_an_abort(survivors, call)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        order = sorted(range(2), key=lambda i: survivors[i].peer_id)  # type: ignore[arg-type,return-value]
        compensated = [(x + r).astype(np.float32) for x, r in zip(inputs[:2], old[:2], strict=True)]
        want, _ = expected_sum(compensated, order, 4096, 2048, pccl.ReduceOp.SUM)
        assert tensors[0].tobytes() == tensors[1].tobytes() == want.tobytes()
        await run_all(survivors, lambda i, c: c.aclose())


async def test_calls_that_would_sum_differently_are_refused_naming_each(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        tensors = [np.ones(100, np.float32) for _ in range(WORLD)]
        residuals = [np.zeros(100, np.float32) for _ in range(WORLD)]

        async def call(i: int, comm: pccl.Communicator) -> object:
            if i == 0:
                return await comm.all_reduce(tensors[i], tag=4)
            fraction = 0.1 if i == 1 else 0.2
            return await comm.all_reduce(
                tensors[i], tag=4, compression=pccl.TopK(fraction, residual=residuals[i], chunk=50),
            )

        results = await run_all(comms, call)
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        message = str(results[0])
        assert f"peer {comms[0].peer_id}: all_reduce count=100" in message
        assert f"peer {comms[1].peer_id}: all_reduce(compression=TopK) count=100" in message
        assert "keeping 5 of every 50" in message and "keeping 10 of every 50" in message
        assert all((t == 1.0).all() for t in tensors) and not any(r.any() for r in residuals)

        # The same entries kept, but their codes packed differently: refused too.
        async def packed(i: int, comm: pccl.Communicator) -> object:
            return await comm.all_reduce(tensors[i], tag=5, compression=pccl.TopK(
                0.1, residual=residuals[i], chunk=50, values=UINT8, value_bits=2 if i else None,
            ))

        results = await run_all(comms, packed)
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert "as 2-bit codes" in str(results[0])
        assert all((t == 1.0).all() for t in tensors) and not any(r.any() for r in residuals)
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_values_that_cannot_be_quantized_fail_the_call_for_everyone(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(60):
        comms = await make_run(cluster, WORLD)
        tensors = [np.ones(100, np.float32) for _ in range(WORLD)]
        tensors[1][7] = np.nan
        residuals = [np.zeros(100, np.float32) for _ in range(WORLD)]
        results = await run_all(comms, lambda i, c: c.all_reduce(
            tensors[i], compression=pccl.TopK(0.1, residual=residuals[i], values=UINT8),
        ))
        assert all(isinstance(r, pccl.InvalidArgument) for r in results), results
        assert "NaN or infinity" in str(results[0])
        assert np.isnan(tensors[1][7]) and (tensors[0] == 1.0).all()
        assert not any(r.any() for r in residuals)
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_bad_arguments_are_refused_before_any_vote(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        (comm, other) = await make_run(cluster, 2)
        x = np.ones(10, np.float32)
        cases = [
            (dict(compression=pccl.TopK(0.1, residual=np.zeros(9, np.float32))), "must match"),
            (dict(compression=pccl.TopK(0.1, residual=x)), "shares memory"),
            (dict(compression=pccl.TopK(0.1, residual=np.zeros(10, np.float32)), op=pccl.ReduceOp.MAX),
             "SUM or AVG"),
            (dict(compression=pccl.TopK(0.1, residual=np.zeros(10, np.float32)), quantization=UINT8),
             "TopK\\(values="),
            (dict(compression="topk"), "pccl_trio.TopK"),
            (dict(compression=pccl.TopK(0.1)), "needs residual="),
        ]
        for kwargs, words in cases:
            with pytest.raises(pccl.InvalidArgument, match=words):
                await comm.all_reduce(x, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(pccl.InvalidArgument, match="floating-point"):
            await comm.all_reduce(
                np.ones(4, np.int32), compression=pccl.TopK(0.5, residual=np.zeros(4, np.int32))
            )
        with pytest.raises(pccl.InvalidArgument, match="one residual per tensor"):
            await comm.all_reduce_multiple_with_retry(
                [x], compression=pccl.TopK(0.5, residual=np.zeros(10, np.float32))
            )
        assert (x == 1.0).all()
        await run_all([comm, other], lambda i, c: c.aclose())


async def test_in_all_reduce_multiple_with_retry_each_tensor_has_its_residual(
    cluster: Cluster, clock: object,
) -> None:
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        order = sorted(range(WORLD), key=lambda i: comms[i].peer_id)  # type: ignore[arg-type,return-value]
        rng = np.random.default_rng(8)
        sizes = (10, 3000, 1)
        inputs = [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(WORLD)]
        tensors = [[x.copy() for x in row] for row in inputs]
        residuals = [[np.zeros(n, np.float32) for n in sizes] for _ in range(WORLD)]
        await run_all(comms, lambda i, c: c.all_reduce_multiple_with_retry(
            tensors[i], op=pccl.ReduceOp.AVG,
            compression=pccl.TopK(0.1, residual=residuals[i], chunk=100),
        ))
        for j, n in enumerate(sizes):
            want, where = expected_sum(
                [inputs[i][j] for i in range(WORLD)], order, 100, 10, pccl.ReduceOp.AVG
            )
            for i in range(WORLD):
                assert tensors[i][j].tobytes() == want.tobytes()
                sent = np.zeros(n, np.float32)
                sent[where[i]] = inputs[i][j][where[i]]
                assert (residuals[i][j] + sent).tobytes() == inputs[i][j].tobytes()
        await run_all(comms, lambda i, c: c.aclose())


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_uint8_values_at_one_percent_send_over_fifty_times_fewer_bytes(
    cluster: Cluster, clock: object,
) -> None:
    """Counted from what the calls report moving, at W=3: the dense float32 ring
    all-reduce against Top-k at 0.01 with uint8 values."""
    with trio.fail_after(120):
        comms = await make_run(cluster, WORLD)
        count = 1 << 20
        dense = [np.ones(count, np.float32) for _ in range(WORLD)]
        residuals = [np.zeros(count, np.float32) for _ in range(WORLD)]
        plain = await run_all(comms, lambda i, c: c.all_reduce(dense[i], tag=1))
        sparse = await run_all(comms, lambda i, c: c.all_reduce(
            dense[i], tag=2, compression=pccl.TopK(0.01, residual=residuals[i], values=UINT8),
        ))
        two_bit = await run_all(comms, lambda i, c: c.all_reduce(
            dense[i], tag=3,
            compression=pccl.TopK(0.01, residual=residuals[i], values=UINT8, value_bits=2),
        ))
        layout = TopKLayout.of(count, np.dtype(np.float32), fraction=0.01, chunk=4096, values=UINT8)
        packed = TopKLayout.of(
            count, np.dtype(np.float32), fraction=0.01, chunk=4096, values=UINT8, value_bits=2
        )
        for p, s, t in zip(plain, sparse, two_bit, strict=True):
            assert isinstance(p, pccl.ReduceInfo) and isinstance(s, pccl.ReduceInfo)
            assert isinstance(t, pccl.ReduceInfo)
            assert s.tx_bytes == (WORLD - 1) * layout.payload_bytes
            assert t.tx_bytes == (WORLD - 1) * packed.payload_bytes
            assert p.tx_bytes / s.tx_bytes >= 50, (p.tx_bytes, s.tx_bytes)
            assert p.tx_bytes / t.tx_bytes >= 60, (p.tx_bytes, t.tx_bytes)
        await run_all(comms, lambda i, c: c.aclose())
