"""All-reduce acceptance over real peer processes on loopback TCP."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from .conftest import LineReader, Processes

pytestmark = pytest.mark.process

PROGRAM = str(Path(__file__).with_name("allreduce_program.py"))
OPS = ["SUM", "AVG", "PROD", "MAX", "MIN"]


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    wide = np.array([a.astype(np.float64) for a in inputs])
    out = {
        "SUM": lambda: wide.sum(0),
        "AVG": lambda: wide.sum(0) / len(inputs),
        "PROD": lambda: wide.prod(0),
        "MAX": lambda: wide.max(0),
        "MIN": lambda: wide.min(0),
    }[op]()
    if op == "AVG" and np.issubdtype(inputs[0].dtype, np.integer):
        out = np.trunc(out)
    return out.astype(inputs[0].dtype)


async def peers(processes: Processes, address: str, mode: str, world: int,
                *extra: str) -> list[LineReader]:
    readers = []
    for _ in range(world):
        process = await processes.start(PROGRAM, address, mode, "--world", str(world), *extra,
                                        stdin=True)
        readers.append(LineReader(process))
    return readers


async def records(reader: LineReader, until: str) -> list[dict[str, Any]]:
    found = []
    while True:
        line = await reader.next_line()
        assert line is not None, f"peer exited early; saw {reader.lines[-5:]}"
        record = json.loads(line)
        assert record["event"] != "error", record
        found.append(record)
        if record["event"] == until:
            return found


async def release(readers: list[LineReader]) -> None:
    for reader in readers:
        if reader.process.returncode is None and reader.process.stdin is not None:
            await reader.process.stdin.send_all(b"go\n")
    for reader in readers:
        await reader.process.wait()


async def test_every_dtype_op_and_size_over_four_processes(processes: Processes) -> None:
    with trio.fail_after(300):
        _master, address = await processes.master("--liveness-timeout", "5")
        readers = await peers(processes, address, "matrix", 4)
        ranks = [(await reader.wait_for(lambda r: r["event"] == "ready"))["rank"]
                 for reader in readers]
        # Read every peer at once: a peer whose stdout pipe fills blocks, and a blocked
        # peer stops heartbeating.
        logs: list[list[dict[str, Any]]] = [[] for _ in readers]

        async def collect(index: int) -> None:
            logs[index] = await records(readers[index], "done")

        async with trio.open_nursery() as nursery:
            for index in range(len(readers)):
                nursery.start_soon(collect, index)
        await release(readers)
    cases = [[r for r in log if r["event"] == "case"] for log in logs]
    assert len({len(c) for c in cases}) == 1 and len(cases[0]) == 12 * 5 * 4 * 2
    for index, case in enumerate(cases[0]):
        same = [c[index] for c in cases]
        assert len({c["digest"] for c in same}) == 1, case  # bit-identical on every peer
        assert all(c["untouched"] for c in same), case
        dtype = dtype_of(case["dtype"])
        inputs = [
            np.random.default_rng([0, rank, case["count"]])
            .integers(1, 4, size=case["count"]).astype(dtype)
            for rank in range(4)
        ]
        by_rank = dict(zip(ranks, [c["input"] for c in same], strict=True))
        for rank in range(4):
            assert hashlib.sha256(inputs[rank].tobytes()).hexdigest()[:16] == by_rank[rank]
        want = reference(inputs, case["op"])
        assert hashlib.sha256(want.tobytes()).hexdigest()[:16] == case["digest"], case
        if case["count"] == 100003:
            ideal = 2 * 3 / 4 * case["count"] * dtype.itemsize
            for c in same:
                assert abs(c["tx"] - ideal) / ideal < 0.02 and abs(c["rx"] - ideal) / ideal < 0.02


async def test_sigkill_during_a_large_all_reduce(processes: Processes) -> None:
    with trio.fail_after(300):
        _master, address = await processes.master("--liveness-timeout", "5")
        readers = await peers(processes, address, "kill", 4, "--megabytes", "128")
        ranks = [(await reader.wait_for(lambda r: r["event"] == "ready"))["rank"]
                 for reader in readers]
        for reader in readers:
            await reader.wait_for(lambda r: r["event"] == "begin")
        victim = ranks.index(1)
        readers[victim].process.kill()
        survivors = [r for i, r in enumerate(readers) if i != victim]
        verdicts = [await r.wait_for(lambda rec: rec["event"] == "verdict") for r in survivors]
        assert len({v["outcome"] for v in verdicts}) == 1, verdicts
        if verdicts[0]["outcome"] == "success":
            assert len({v["digest"] for v in verdicts}) == 1
        else:
            assert all(v["restored"] for v in verdicts), verdicts
            retries = [await r.wait_for(lambda rec: rec["event"] == "retry") for r in survivors]
            want = float(sum(rank + 1 for rank in range(4) if rank != 1))
            for retry in retries:
                assert retry["world"] == 3 and retry["uniform"] and retry["first"] == want
            assert len({r["digest"] for r in retries}) == 1
        await release(survivors)


@pytest.mark.parametrize(("tensors", "megabytes"), [(8, 16), (60, 1)],
                         ids=["alone", "fused"])
async def test_sigkill_inside_all_reduce_multiple_with_retry(
    processes: Processes, tensors: int, megabytes: int
) -> None:
    """16 MiB tensors go alone; 1 MiB ones are fused into buckets of 25 (the default
    bucket_bytes)."""
    with trio.fail_after(300):
        _master, address = await processes.master("--liveness-timeout", "5")
        readers = await peers(processes, address, "retry", 3, "--tensors", str(tensors),
                              "--megabytes", str(megabytes))
        ranks = [(await reader.wait_for(lambda r: r["event"] == "ready"))["rank"]
                 for reader in readers]
        for reader in readers:
            await reader.wait_for(lambda r: r["event"] == "begin")
        victim = ranks.index(2)
        readers[victim].process.send_signal(signal.SIGKILL)
        survivors = [r for i, r in enumerate(readers) if i != victim]
        done = [await r.wait_for(lambda rec: rec["event"] == "retried") for r in survivors]
        for t in range(tensors):
            old = float(sum(10 ** rank + t for rank in range(3)))
            new = float(sum(10 ** rank + t for rank in range(3) if rank != 2))
            firsts = {d["firsts"][t] for d in done}
            assert len(firsts) == 1 and firsts <= {old, new}, (t, firsts)
            assert all(d["uniform"][t] for d in done)
            assert len({d["digests"][t] for d in done}) == 1
        await release(survivors)
