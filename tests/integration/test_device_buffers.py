"""All-reduce and shared state on GPU buffers: on ``StrictDevice`` (a strict stand-in
for cupy) everywhere, and on cupy with a real GPU where there is one.

The double keeps device arrays apart from host memory and runs an asynchronous copy
only when its stream is synchronized (or a kernel runs on that stream), so on a machine
without a GPU these tests check the GPU path's logic: every byte staged through pinned
host memory, kernels on the device, no read of a copy that was not waited for. It also
counts what crosses between host and device, which the tests check where they run on
it. Peers mix device and host buffers in one ring: the wire carries the same bytes
either way, so every peer must end with the host path's bits.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio.ops._staging import _DeviceSender
from pccl_trio.testing import StrictDevice

from .conftest import (
    CONFIGS,
    Cluster,
    die_mid_all_reduce,
    form_run,
    joined,
    kill_during_fetch,
    run_all,
    sync_all,
)

#: Small slices: many per segment, so each sender stages several in a row.
SLICES = 256
OPS = [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG, pccl.ReduceOp.PROD, pccl.ReduceOp.MAX,
       pccl.ReduceOp.MIN]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8]


@pytest.fixture(params=["memory", "tcp"])
def network_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def master_config(network_kind: str, request: pytest.FixtureRequest) -> pccl.Config:
    """The cluster's master config; on a real GPU over TCP with a longer liveness
    timeout: those tests push hundreds of MB through one process that holds three peers
    and computes the host reference, and a loaded machine (tests in parallel) can hold a
    heartbeat back past the 2 s the other TCP tests allow."""
    config = CONFIGS[network_kind]
    callspec = getattr(request.node, "callspec", None)
    if network_kind == "tcp" and callspec is not None and callspec.params.get("device") == "cuda":
        config = dataclasses.replace(config, liveness_timeout=30.0)
    return config


def _gpu() -> Any:
    """cupy, if it is installed and sees a GPU; else None."""
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, or no driver or device
        return None


@pytest.fixture(params=["strict", "cuda"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The array module of GPU buffers: the stand-in device, installed as ``cupy`` so
    its arrays are GPU buffers; or cupy itself on a machine with a GPU."""
    if request.param == "cuda":
        cupy = _gpu()
        if cupy is None:
            pytest.skip("needs cupy and a CUDA GPU")
        yield cupy
        return
    device = StrictDevice()
    monkeypatch.setitem(sys.modules, "cupy", device)
    yield device


def counted(device: Any) -> bool:
    """Whether ``device`` counts its crossings (the stand-in does, cupy does not)."""
    return isinstance(device, StrictDevice)


def values(dtype: Any, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 7, count).astype(dtype)
    return rng.normal(0, 3, count).astype(dtype)


async def run(cluster: Cluster, world: int, device: Any = None) -> list[pccl.Communicator]:
    """A run of ``world`` peers; with small slices, except on a real GPU (whose tests
    use the default slices, as users do)."""
    if device is None or counted(device):
        cluster.config = dataclasses.replace(cluster.config, slice_bytes=SLICES)
    return await form_run([], [cluster.communicator(f"p{i}") for i in range(world)])


def sizes(device: Any) -> tuple[int, ...]:
    """Element counts to reduce: one, and a few slices on the stand-in; on a GPU also
    many default slices per chunk, and a count no world size divides."""
    return (1, 1000) if counted(device) else (1, 1000, (24 << 20) + 7)


class CudaTensor:
    """A stand-in for a CUDA tensor of another library: it exports the device's memory
    through DLPack only."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()  # type: ignore[no-any-return]

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._array.__dlpack__(stream=stream)


def via_dlpack(device: Any, array: Any) -> Any:
    """``array`` (device memory) as a CUDA tensor of another library: a torch CUDA
    tensor on a GPU where torch has CUDA, else a bare DLPack exporter."""
    if not counted(device):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.from_dlpack(array)  # the same memory
        except ImportError:
            pass
    return CudaTensor(array)


def host(device: Any, array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else device.asnumpy(array)


@pytest.mark.parametrize("via", ["array", "dlpack"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_device_buffers_reduce_to_the_host_paths_bits(
    cluster: Cluster, clock: object, device: Any, dtype: Any, via: str
) -> None:
    """Every op, in place and into a separate result, device peers beside a host one:
    the result equals the all-reduce of the same inputs on host buffers, bit for bit.
    The device buffers are the array module's arrays, or CUDA tensors of another
    library (torch's on a GPU) that reach it through DLPack."""
    wrap = (lambda a: a) if via == "array" else partial(via_dlpack, device)
    with trio.fail_after(300):
        comms = await run(cluster, 3, device)
        for op in OPS:
            for count in sizes(device):
                inputs = [values(dtype, count, seed) for seed in range(3)]
                reference = [x.copy() for x in inputs]
                await run_all(comms, lambda i, c, r=reference, o=op: c.all_reduce(r[i], op=o))
                # Peers 0 and 1 on the device (0 in place, 1 into a result), 2 on the host.
                sends = [device.asarray(inputs[0]), device.asarray(inputs[1]), inputs[2].copy()]
                recvs = [None, device.empty(count, dtype=dtype), None]
                passed = [wrap(sends[0]), wrap(sends[1]), sends[2]]
                results_in = [None, wrap(recvs[1]), None]
                copies = device.pageable_async_copies if counted(device) else 0
                infos = await run_all(
                    comms,
                    lambda i, c, s=passed, r=results_in, o=op: c.all_reduce(s[i], r[i], op=o),
                )
                assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
                results = [host(device, recvs[i] if recvs[i] is not None else sends[i])
                           for i in range(3)]
                for result in results:
                    assert result.tobytes() == reference[0].tobytes(), (op, count)
                # The separate result left its input alone.
                assert device.asnumpy(sends[1]).tobytes() == inputs[1].tobytes()
                if counted(device):  # staged through pinned memory
                    assert device.pageable_async_copies == copies
        for comm in comms:
            await comm.aclose()


async def test_dlpack_tensors_on_the_device_reduce_in_place(
    cluster: Cluster, clock: object, device: Any
) -> None:
    """Tensors that reach the device's array module through DLPack (as torch CUDA
    tensors reach cupy's) are reduced in their own memory."""
    with trio.fail_after(120):
        comms = await run(cluster, 3, device)
        inputs = [values(np.float32, 3000, seed) for seed in range(3)]
        reference = [x.copy() for x in inputs]
        await run_all(comms, lambda i, c: c.all_reduce(reference[i]))
        arrays = [device.asarray(x) for x in inputs]
        await run_all(comms, lambda i, c: c.all_reduce(via_dlpack(device, arrays[i])))
        for array in arrays:
            assert device.asnumpy(array).tobytes() == reference[0].tobytes()
        for comm in comms:
            await comm.aclose()


async def test_only_each_slice_sent_crosses_to_the_host(
    cluster: Cluster, clock: object, device: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unquantized, what crosses device-to-host is what the peer sends, once; what
    crosses host-to-device is what it receives, once; and senders stage the next
    slice while they send one."""
    hits: list[bool] = []
    real_host = _DeviceSender.host

    def host(self: _DeviceSender, data: Any, key: object = None) -> memoryview:
        hits.append(key is not None and self._ahead == key)
        return real_host(self, data, key)

    monkeypatch.setattr(_DeviceSender, "host", host)
    if not counted(device):
        pytest.skip("counts what the stand-in device copies")
    with trio.fail_after(120):
        comms = await run(cluster, 3)
        arrays = [device.asarray(values(np.float32, 10_000, seed)) for seed in range(3)]
        before_host, before_device = device.to_host_bytes, device.to_device_bytes
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        sent = sum(info.tx_bytes for info in infos)  # type: ignore[attr-defined]
        received = sum(info.rx_bytes for info in infos)  # type: ignore[attr-defined]
        assert device.to_host_bytes - before_host == sent
        assert device.to_device_bytes - before_device == received
        assert any(hits), "no slice was staged ahead of its send"
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("op", [pccl.ReduceOp.SUM, pccl.ReduceOp.AVG])
async def test_quantized_on_the_device_matches_the_host_and_moves_only_codes(
    cluster: Cluster, clock: object, device: Any, op: pccl.ReduceOp
) -> None:
    """uint8 min-max quantization encoded and decoded on the device: the host path's
    bits on every peer, and a quarter of float32's bytes (plus each block's range)
    crossing to the host."""
    with trio.fail_after(120):
        comms = await run(cluster, 3)
        quantization = pccl.QuantizationOptions(
            quantized_datatype=pccl.DataType.UINT8,
            algorithm=pccl.QuantizationAlgorithm.MIN_MAX,
        )
        count = 20_000
        inputs = [values(np.float32, count, seed) for seed in range(3)]
        reference = [x.copy() for x in inputs]
        await run_all(comms, lambda i, c: c.all_reduce(reference[i], op=op, quantization=quantization))
        arrays = [device.asarray(inputs[0]), device.asarray(inputs[1]), inputs[2].copy()]
        before = device.to_host_bytes if counted(device) else 0
        await run_all(comms, lambda i, c: c.all_reduce(arrays[i], op=op, quantization=quantization))
        crossed = device.to_host_bytes - before if counted(device) else 0
        for array in arrays:
            assert host(device, array).tobytes() == reference[0].tobytes()
        if counted(device):
            # Each device peer encodes a third of its values per reduce step and its
            # own chunk once: one code byte per value, plus each block's min and max
            # read back; the float32 values never cross.
            codes = 2 * count
            assert codes <= crossed < 1.15 * codes, crossed
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("victim", [0, 2], ids=["kill-rank0", "kill-rank2"])
async def test_kill_mid_all_reduce_restores_device_buffers(
    cluster: Cluster, clock: object, device: Any, victim: int
) -> None:
    """A peer dies mid-operation: the same verdict everywhere; an abort leaves every
    survivor's device buffer holding its input, bit for bit; the retry is exact."""
    with trio.fail_after(120):
        cluster.config = dataclasses.replace(cluster.config, slice_bytes=4096)
        comms = await form_run([], [cluster.communicator(f"p{i}", 0, 2) for i in range(4)])
        count = 200_000
        data = [np.arange(count, dtype=np.float32) + i for i in range(4)]
        arrays = [device.asarray(d) for d in data]
        tensors = [via_dlpack(device, a) if i % 2 else a for i, a in enumerate(arrays)]
        survivors = [c for i, c in enumerate(comms) if i != victim]
        results = await die_mid_all_reduce(
            cluster, comms, victim, lambda i, c: c.all_reduce(tensors[i])
        )
        assert len({type(r) for r in results}) == 1, results
        if isinstance(results[0], pccl.CollectiveAborted):
            for comm in survivors:
                i = comms.index(comm)
                assert device.asnumpy(arrays[i]).tobytes() == data[i].tobytes()
            infos = await run_all(survivors, lambda i, c: c.all_reduce(tensors[comms.index(c)]))
            assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
            want = sum(d for i, d in enumerate(data) if i != victim)
        else:
            want = sum(data)
        for comm in survivors:
            assert device.asnumpy(arrays[comms.index(comm)]).tobytes() == want.tobytes()
        for comm in survivors:
            await comm.aclose()


# --- shared state on the device ------------------------------------------------------------


def device_state(device: Any, seed: int, *, zero: bool = False,
                 on_device: bool = True) -> pccl.SharedState:
    """Weights and optimizer moments (several of the sync's pieces), a step counter,
    and a tensor that may differ; on the device unless ``on_device`` is False."""
    rng = np.random.default_rng(seed)
    tensors = {
        "weights": rng.standard_normal(300_000).astype(np.float32),
        "moments": rng.standard_normal(70_000).astype(np.float64),
        "steps": np.arange(5, dtype=np.int64),
        "rng": rng.integers(0, 2**32, 4, dtype=np.uint32),
    }
    if zero:
        tensors = {k: np.zeros_like(v) for k, v in tensors.items()}
    place = device.asarray if on_device else (lambda a: a)
    return pccl.SharedState(
        [pccl.TensorInfo(name, place(array), allow_content_inequality=name == "rng")
         for name, array in tensors.items()],
        revision=0,
    )


def contents(device: Any, state: pccl.SharedState) -> list[bytes]:
    return [host(device, t.data).tobytes() for t in state.tensors if not t.allow_content_inequality]


async def test_a_joiner_syncs_device_tensors_from_device_and_host_peers(
    cluster: Cluster, clock: object, device: Any
) -> None:
    """Founders on the device and on the host; a joiner whose state is on the device
    receives it into its own device tensors, hashed on the device to the host's
    values; a diverged device tensor is fetched again, alone."""
    with trio.fail_after(120):
        founders = await form_run([], [cluster.communicator(f"f{i}") for i in range(2)])
        states = [device_state(device, 1), device_state(device, 1, on_device=False)]
        infos = await sync_all(founders, states)
        # Equal content hashes the same on device and host: nothing moved.
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)]  # type: ignore[union-attr]
        comms = await form_run(founders, [cluster.communicator("joiner")])
        joiner = device_state(device, 99, zero=True)
        buffers = [t.data for t in joiner.tensors]
        states.append(joiner)
        for state in states[:2]:
            state.revision += 1
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert contents(device, joiner) == contents(device, states[1])
        assert [t.data for t in joiner.tensors] == buffers  # received in place
        assert joiner.revision == 1
        # A device peer's weights diverge: only they are fetched again.
        weights = states[0].tensors[0].data
        weights[7:9] = device.asarray(np.float32([5.0, 6.0]))
        for state in states:
            state.revision += 1
        infos = await sync_all(comms, states)
        assert infos[0].rx_bytes == weights.nbytes  # type: ignore[union-attr]
        assert contents(device, states[0]) == contents(device, states[1])
        assert not counted(device) or device.pageable_async_copies == 0
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("survivor", [True, False], ids=["one-dies", "all-die"])
async def test_distributors_dying_mid_transfer_leave_device_state_whole(
    cluster: Cluster, clock: object, device: Any, monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery, survivor: bool,
) -> None:
    """A device joiner fetching from two device founders: if one dies mid-transfer it
    finishes from the other, exactly; if both die, its device tensors hold their old
    bytes again (copies still in flight to the device land before the restore)."""
    with trio.fail_after(120):
        states = [device_state(device, 1), device_state(device, 1)]
        comms = await joined(cluster, states)
        fresh = device_state(device, 7)
        before = contents(device, fresh)
        victims = {"f0": comms[0]} if survivor else {"f0": comms[0], "f1": comms[1]}
        kill_during_fetch(monkeypatch, cluster, victims, nursery, after_pieces=3)
        results = await sync_all(comms, [*states, fresh])
        if survivor:
            assert isinstance(results[2], pccl.SharedStateSyncInfo), results
            assert contents(device, fresh) == contents(device, states[1])
            assert fresh.revision == 1
        else:
            assert isinstance(results[2], pccl.SharedStateSyncFailed), results
            assert contents(device, fresh) == before
            assert fresh.revision == 0
        for comm in comms[1 if survivor else 2:]:
            await comm.aclose()


async def test_the_callers_queued_work_is_waited_for(
    cluster: Cluster, clock: object, device: Any
) -> None:
    """Buffers filled by work still queued on the caller's stream (here, asynchronous
    copies into them) are read only once that work is done: for an all-reduce and for
    a shared-state sync."""
    with trio.fail_after(120):
        comms = await run(cluster, 2, device)
        inputs = [values(np.float32, 5000, seed) for seed in range(2)]
        arrays = [device.empty(5000, dtype=np.float32) for _ in range(2)]
        pinned = [np.frombuffer(device.cuda.alloc_pinned_memory(x.nbytes), np.float32, x.size)
                  for x in inputs]
        streams = [device.cuda.Stream(non_blocking=True) for _ in range(2)]

        async def reduce(i: int, comm: pccl.Communicator) -> object:
            pinned[i][:] = inputs[i]
            with streams[i]:
                arrays[i].set(pinned[i], stream=streams[i])  # queued, not done
                handle = comm.all_reduce_async(arrays[i])
            return await handle.wait()

        await run_all(comms, reduce)
        for array in arrays:
            assert host(device, array).tobytes() == (inputs[0] + inputs[1]).tobytes()

        states = [pccl.SharedState([pccl.TensorInfo("w", device.empty(5000, dtype=np.float32))])
                  for _ in range(2)]

        async def sync(i: int, comm: pccl.Communicator) -> object:
            with streams[i]:
                states[i].tensors[0].data.set(pinned[0], stream=streams[i])  # queued
                return await comm.sync_shared_state(states[i])

        infos = await run_all(comms, sync)
        # Both hashed what the copies wrote (the same bytes): nothing had to move.
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)], infos  # type: ignore[union-attr]
        for comm in comms:
            await comm.aclose()


async def test_buffers_on_another_gpu_than_the_first(
    cluster: Cluster, clock: object, device: Any
) -> None:
    """One process per GPU: each peer's buffers on its own GPU, which the threads that
    stage and reduce them (created on GPU 0) must make current; the results are the
    host path's, and a shared state syncs the same way."""
    if counted(device):
        gpus = [1, 2, 3]
    else:
        count = device.cuda.runtime.getDeviceCount()
        if count < 2:
            pytest.skip("needs two GPUs")
        gpus = [i % count for i in range(1, 4)]
    with trio.fail_after(120):
        comms = await run(cluster, 3, device)
        inputs = [values(np.float32, 5000, seed) for seed in range(3)]
        reference = [x.copy() for x in inputs]
        await run_all(comms, lambda i, c: c.all_reduce(reference[i]))
        arrays = []
        for gpu, x in zip(gpus, inputs, strict=True):
            with device.cuda.Device(gpu):
                arrays.append(device.asarray(x))
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        for array in arrays:
            assert device.asnumpy(array).tobytes() == reference[0].tobytes()
        quantization = pccl.QuantizationOptions(
            quantized_datatype=pccl.DataType.UINT8, algorithm=pccl.QuantizationAlgorithm.MIN_MAX,
        )
        infos = await run_all(comms, lambda i, c: c.all_reduce(arrays[i], quantization=quantization))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        states = []
        for i, gpu in enumerate(gpus):
            with device.cuda.Device(gpu):
                data = device.asarray(np.full(70_000, 0.0 if i else 1.0, np.float32))
            states.append(pccl.SharedState([pccl.TensorInfo("w", data)]))
        infos = await sync_all(comms, states)
        assert all(isinstance(i, pccl.SharedStateSyncInfo) for i in infos), infos
        assert len({host(device, s.tensors[0].data).tobytes() for s in states}) == 1
        for comm in comms:
            await comm.aclose()


async def test_the_crossing_counters_count_what_the_device_copies(
    cluster: Cluster, clock: object
) -> None:
    """``ops.CROSSINGS`` (what the benchmark reports as PCIe bytes on a GPU) moves by
    what the stand-in saw cross, for a plain all-reduce, a quantized one and a
    shared-state sync with a device joiner: all but the few scalars read back per
    block encoded or tensor hashed."""
    from pccl_trio.ops import CROSSINGS

    device = StrictDevice()
    with pytest.MonkeyPatch.context() as patch, trio.fail_after(120):
        patch.setitem(sys.modules, "cupy", device)
        comms = await run(cluster, 3)
        arrays = [device.asarray(values(np.float32, 10_000, seed)) for seed in range(3)]

        async def measured(call: Any) -> tuple[int, int, int, int]:
            ours = CROSSINGS.snapshot()
            seen = device.to_host_bytes, device.to_device_bytes
            await run_all(comms, call)
            now = CROSSINGS.snapshot()
            return (now[0] - ours[0], now[1] - ours[1],
                    device.to_host_bytes - seen[0], device.to_device_bytes - seen[1])

        to_host, to_device, seen_host, seen_device = await measured(
            lambda i, c: c.all_reduce(arrays[i]))
        assert (to_host, to_device) == (seen_host, seen_device) != (0, 0)
        quantization = pccl.QuantizationOptions(
            quantized_datatype=pccl.DataType.UINT8, algorithm=pccl.QuantizationAlgorithm.MIN_MAX,
        )
        to_host, to_device, seen_host, seen_device = await measured(
            lambda i, c: c.all_reduce(arrays[i], quantization=quantization))
        # Each peer encodes its two reduce-scatter segments and its own chunk (a code
        # byte per value: all of its 10 000), a block per slice, reading back a float32
        # minimum and maximum for each.
        blocks = 3 * 3 * -(-(-(-10_000 // 3) * 4) // SLICES)
        assert to_device == seen_device
        # Each peer copies to the device the codes it receives, 2(W-1)/W of its values,
        # 40 000 over the three (its own chunk's codes, decoded where they were made,
        # never come back).
        assert to_device == 40_000
        assert 3 * 10_000 <= to_host <= seen_host <= to_host + 8 * blocks, (to_host, seen_host)
        states = [device_state(device, 1), device_state(device, 1, on_device=False),
                  device_state(device, 5, zero=True)]
        to_host, to_device, seen_host, seen_device = await measured(
            lambda i, c: c.sync_shared_state(states[i]))
        assert to_device == seen_device
        assert to_host <= seen_host <= to_host + 16 * 3 * len(states[0].tensors)  # hashes' scalars
        assert to_device >= sum(t.data.nbytes for t in states[2].tensors
                                if not t.allow_content_inequality)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("slice_bytes", [1 << 20, 4 << 20], ids=["1MiB", "4MiB"])
async def test_small_slices_for_gpu_buffers_are_advised_against_once(
    cluster: Cluster, clock: object, caplog: pytest.LogCaptureFixture, slice_bytes: int
) -> None:
    """GPU buffers larger than 4 MiB in smaller slices: one warning that says which
    setting to change and to what (the GPU path's speed depends on it), however many
    all-reduces follow; none with 4 MiB slices."""
    device = StrictDevice()
    with pytest.MonkeyPatch.context() as patch, trio.fail_after(120):
        patch.setitem(sys.modules, "cupy", device)
        cluster.config = dataclasses.replace(cluster.config, slice_bytes=slice_bytes)
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        arrays = [device.asarray(np.ones(1_200_000, np.float32)) for _ in range(2)]
        for _ in range(2):
            await run_all(comms, lambda i, c: c.all_reduce(arrays[i]))
        advice = [r.getMessage() for r in caplog.records if "Config(slice_bytes=4 << 20)" in r.getMessage()]
        if slice_bytes < 4 << 20:
            assert len(advice) == 1, advice
            assert "slices of 1048576 bytes" in advice[0]
        else:
            assert advice == []
        assert device.asnumpy(arrays[0]).tobytes() == np.full(1_200_000, 4, np.float32).tobytes()
        for comm in comms:
            await comm.aclose()


async def test_broadcast_and_reduce_scatter_on_device_buffers_match_the_host(
    cluster: Cluster, clock: object, device: Any,
) -> None:
    """A device peer beside host peers: a broadcast from the device peer writes the
    host peers' buffers, one from a host peer the device's; a reduce-scatter's shard is
    a device array on the device peer, a numpy one on the others, each with the bits of
    that range of the host all-reduce."""
    with trio.fail_after(300):
        comms = await run(cluster, 3, device)
        by_id = sorted(c.peer_id for c in comms)  # type: ignore[type-var]
        for count in sizes(device):
            inputs = [values(np.float32, count, seed) for seed in range(3)]
            buffers = [device.asarray(inputs[0]), inputs[1].copy(), inputs[2].copy()]
            for root in (0, 2):
                await run_all(
                    comms, lambda i, c, r=root, b=buffers: c.broadcast(b[i], root=comms[r].peer_id)
                )
                for i in range(3):
                    assert host(device, buffers[i]).tobytes() == host(device, buffers[root]).tobytes()
            reference = [x.copy() for x in inputs]
            await run_all(comms, lambda i, c, r=reference: c.all_reduce(r[i]))
            sends = [device.asarray(inputs[0]), inputs[1].copy(), inputs[2].copy()]
            shards = await run_all(comms, lambda i, c, s=sends: c.reduce_scatter(s[i]))
            for i, (comm, shard) in enumerate(zip(comms, shards, strict=True)):
                assert isinstance(shard, pccl.Shard), shard
                assert isinstance(shard.data, np.ndarray) == (i != 0)
                part = np.array_split(np.arange(count), 3)[by_id.index(comm.peer_id)]
                start = int(part[0]) if len(part) else shard.start
                assert shard.start == start and shard.stop == start + len(part)
                assert host(device, shard.data).tobytes() == (
                    reference[0][shard.start:shard.stop].tobytes()
                )
            assert device.asnumpy(sends[0]).tobytes() == inputs[0].tobytes()  # only read
        for comm in comms:
            await comm.aclose()


async def test_an_all_gather_of_a_device_part_gives_device_parts_there_and_host_parts_elsewhere(
    cluster: Cluster, clock: object, device: Any,
) -> None:
    """A device peer's all-gather gathers into a device buffer (its parts device
    arrays), the host peers' into host ones, every part the bytes its peer sent, the
    parts of different sizes; the device input only read."""
    with trio.fail_after(300):
        comms = await run(cluster, 3, device)
        for count in sizes(device):
            inputs = [values(np.float32, count + 7 * seed, seed) for seed in range(3)]
            sends = [device.asarray(inputs[0]), inputs[1].copy(), inputs[2].copy()]
            results = await run_all(comms, lambda i, c, s=sends: c.all_gather(s[i]))
            for i, parts in enumerate(results):
                assert isinstance(parts, dict), parts
                for j, comm in enumerate(comms):
                    got = parts[comm.peer_id]
                    assert isinstance(got, np.ndarray) == (i != 0)
                    assert host(device, got).tobytes() == inputs[j].tobytes()
            assert device.asnumpy(sends[0]).tobytes() == inputs[0].tobytes()  # only read
        for comm in comms:
            await comm.aclose()


async def test_a_topk_all_reduce_of_a_device_tensor_matches_the_host_peers_bits(
    cluster: Cluster, clock: object, device: Any,
) -> None:
    """A device peer's Top-k all-reduce selects, gathers and sums on the device: the
    same bits as the host peers', its residual fed back on the device."""
    with trio.fail_after(300):
        comms = await run(cluster, 3, device)
        values_kinds = (None, pccl.QuantizationOptions())
        for count in sizes(device):
            for quantized in values_kinds:
                inputs = [values(np.float32, count, seed) for seed in range(3)]
                tensors = [device.asarray(inputs[0]), inputs[1].copy(), inputs[2].copy()]
                residuals = [device.asarray(np.zeros(count, np.float32)),
                             np.zeros(count, np.float32), np.zeros(count, np.float32)]
                await run_all(comms, lambda i, c, t=tensors, r=residuals, q=quantized: c.all_reduce(
                    t[i], compression=pccl.TopK(0.05, residual=r[i], values=q, chunk=512),
                ))
                assert host(device, tensors[0]).tobytes() == tensors[1].tobytes() == tensors[2].tobytes()
                sent = inputs[0] - host(device, residuals[0])
                assert np.count_nonzero(sent) <= max(1, round(0.05 * 512)) * -(-count // 512)
        for comm in comms:
            await comm.aclose()
