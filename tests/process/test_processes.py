"""Acceptance over real processes: the master CLI, SIGKILL, SIGSTOP, hostile bytes."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.messages import PROTOCOL_VERSION, Kick, Welcome
from pccl_trio._core.wire import FrameDecoder

from .conftest import LIVENESS_TIMEOUT, LineReader, Processes, namespaces_work

pytestmark = pytest.mark.process

COMPUTE_PROGRAM = str(Path(__file__).with_name("compute_program.py"))


def world(size: int, group: int | None = None) -> object:
    def check(record: dict[str, object]) -> bool:
        attributes = record.get("attributes")
        return (
            record.get("event") == "world"
            and isinstance(attributes, list)
            and attributes[0] == size
            and (group is None or attributes[1] == group)
        )

    return check


async def test_cli_master_four_peers_kill_and_silence(processes: Processes) -> None:
    with trio.fail_after(120):
        master, address = await processes.master()
        peers = [await processes.peer(address, group=0) for _ in range(3)]
        peers.append(await processes.peer(address, group=1))
        views = [await peer.wait_for(world(4)) for peer in peers]
        for view in views[:3]:
            assert view["attributes"] == [4, 3, 2, 3]
            assert len(view["ring"]) == 3
        assert views[3]["attributes"] == [4, 1, 2, 3]

        # SIGKILL one peer of group 0: the rest, looping update_topology, see 3.
        peers[0].process.kill()
        views = [await peer.wait_for(world(3)) for peer in peers[1:]]
        assert [v["attributes"] for v in views] == [[3, 2, 2, 2], [3, 2, 2, 2], [3, 1, 2, 2]]

        # SIGSTOP another (no FIN, the socket stays open): the master drops it at its
        # liveness deadline and the others carry on without it.
        peers[1].process.send_signal(signal.SIGSTOP)
        views = [await peer.wait_for(world(2)) for peer in peers[2:]]
        assert [v["attributes"] for v in views] == [[2, 1, 2, 1], [2, 1, 2, 1]]
        peers[1].process.send_signal(signal.SIGCONT)
        # Once resumed it learns it was removed, and says so instead of hanging.
        record = await peers[1].wait_for(lambda r: r.get("event") == "error")
        assert record["kind"] in ("Kicked", "MasterConnectionError")

        master.send_signal(signal.SIGTERM)
        assert await master.wait() == 0


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "no-keepalive"])
async def test_a_peer_blocking_its_loop_for_minutes_stays_in_the_run(
    processes: Processes, monkeypatch: pytest.MonkeyPatch, keepalive: bool
) -> None:
    """A trainer computing inline (``time.sleep(6)``, three liveness timeouts) between two
    all-reduces: its keepalive thread heartbeats meanwhile, under a run secret, so the
    next all-reduce runs with the full world. Without the thread the master removes it
    (two liveness timeouts before the trainer resumes, a margin a loaded machine keeps)."""
    block = 6.0
    assert block >= 3 * LIVENESS_TIMEOUT
    monkeypatch.setenv("PCCL_TRIO_RUN_SECRET", "0123456789abcdef" * 2)
    with trio.fail_after(90):
        _master, address = await processes.master()
        argv = [COMPUTE_PROGRAM, address, "--world", "2"]
        if not keepalive:
            argv.append("--no-keepalive")
        steady = LineReader(await processes.start(*argv, stdin=True))
        computing = LineReader(await processes.start(*argv, "--block", str(block), stdin=True))
        firsts = [await p.wait_for(lambda r: r["event"] in ("first", "error"))
                  for p in (steady, computing)]
        assert [r.get("sum") for r in firsts] == [3.0, 3.0], firsts
        blocked = await computing.wait_for(lambda r: r["event"] == "blocked")
        assert blocked["seconds"] >= block
        after = await computing.wait_for(lambda r: r["event"] in ("second", "error"))
        if keepalive:
            assert after == {"event": "second", "sum": 3.0, "world": 2}, after
            assert await steady.wait_for(lambda r: r["event"] in ("second", "error")) == after
        else:
            # The master removed it at its liveness deadline; once resumed, it is told.
            assert after["event"] == "error", after
            assert after["kind"] in ("Kicked", "MasterConnectionError"), after
        for reader in (steady, computing):
            if reader.process.returncode is None:
                assert reader.process.stdin is not None
                await reader.process.stdin.send_all(b"go\n")
            await reader.process.wait()


def frame(kind: int, fields: list[object]) -> bytes:
    body = struct.pack(">BH", 1, kind) + msgpack.packb(fields)
    return struct.pack(">I", len(body)) + body


HOSTILE = {
    "random": bytes(range(256)) * 4,
    "truncated": frame(1, [PROTOCOL_VERSION, 0, 5000, ""])[:-3],
    "oversized": struct.pack(">I", 0xFFFFFFF0) + b"\x01" * 16,
    "illegal-vote": frame(1, [PROTOCOL_VERSION, 0, 5000, ""]) + frame(4, [7, True, []]),
    "unknown-kind": frame(999, []),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_hostile_bytes_cost_only_that_connection(processes: Processes, name: str) -> None:
    with trio.fail_after(60):
        master, address = await processes.master()
        first = await processes.peer(address)
        await first.wait_for(world(1))
        host, port = address.rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(HOSTILE[name])
        if name == "truncated":
            await stream.send_eof()
        received = b""
        while chunk := await stream.receive_some(65536):  # the master hangs up on us
            received += chunk
        await stream.aclose()
        # ... after telling us why (garbage we cut short is never even decoded).
        decoder = FrameDecoder(max_control_frame=1 << 20)
        decoder.receive_data(received)
        kick = decoder.next_frame()
        while isinstance(kick, Welcome):  # registered first, then broke the rules
            kick = decoder.next_frame()
        assert isinstance(kick, Kick), (name, received[:64])
        assert ("malformed input" in kick.reason) or ("illegal" in kick.reason), kick.reason
        # The master still serves: a new peer joins the existing one.
        second = await processes.peer(address)
        await second.wait_for(world(2))
        await first.wait_for(world(2))
        assert master.returncode is None
        master.send_signal(signal.SIGINT)
        assert await master.wait() == 0


async def test_cli_sigint_exits_zero_and_console_script(processes: Processes) -> None:
    with trio.fail_after(60):
        master, address = await processes.master()
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        master.send_signal(signal.SIGINT)
        assert await master.wait() == 0
        console_script = Path(sys.executable).with_name("pccl-trio")
        script = await trio.run_process(
            [str(console_script), "master", "--help"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
        assert script.returncode == 0 and b"--listen" in script.stdout
        bad = await trio.run_process(
            [sys.executable, "-m", "pccl_trio.master", "--listen", "nonsense"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
        assert bad.returncode == 2 and b"host:port" in bad.stderr


async def test_cli_stall_timeout_fails_a_call_a_member_never_makes(processes: Processes) -> None:
    """`--stall-timeout` reaches the master: two peers (in this process, over TCP)
    call all_reduce with tags 0 and 1; both calls fail at the stall timeout."""
    with trio.fail_after(60):
        _master, address = await processes.master("--stall-timeout", "1.5")
        config = pccl.Config(heartbeat_interval=0.2, liveness_timeout=2.0)
        comms = [pccl.Communicator(address, config=config, p2p_host="127.0.0.1") for _ in range(2)]
        await comms[0].connect()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(comms[1].connect)
            while comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < 2:
                await comms[0].update_topology()
        errors: list[BaseException] = []

        async def reduce(index: int) -> None:
            try:
                await comms[index].all_reduce(np.ones(16, np.float32), tag=index)
            except pccl.PCCLError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(reduce, index)
        assert len(errors) == 2 and all(isinstance(e, pccl.InvalidArgument) for e in errors)
        assert all("stall timeout is 1.5s" in str(e) for e in errors), errors
        for comm in comms:
            await comm.aclose()


def test_busy_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pccl_trio.master", "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, check=False, timeout=60,
        )
    assert result.returncode == 1
    assert "cannot listen" in result.stderr




@pytest.mark.parametrize(
    "mode", [[], ["--into-recv"], ["--quantize", "uint8"], ["--metrics", "both"],
             ["--topk", "0.01", "--quantize", "uint8"]],
    ids=["in_place", "into_recv", "uint8", "metrics", "topk"],
)
def test_bench_runs_and_checks_its_results(tmp_path: Path, mode: list[str]) -> None:
    """`pccl-trio bench` end to end at a tiny size: W peer processes, a verified result,
    and the JSON rows the benchmark docs are built from."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "pccl_trio._cli", "bench", "--world", "2", "--sizes", "4K,12K",
         "--iters", "2", "--warmup", "1", "--repeats", "1", "--json", str(out), *mode],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert ("into recv" if "--into-recv" in mode else "in place") in result.stdout
    if "--topk" in mode:
        assert "Top-k 0.01 (values quantized min_max->uint8)" in result.stdout
    rows = json.loads(out.read_text())
    if "--metrics" in mode:  # each size without, then with metrics
        assert [(r["size"], r["metrics"]) for r in rows] == [
            (4096, False), (4096, True), (12288, False), (12288, True)
        ]
        assert "pccl+metrics" in result.stdout
        rows = rows[::2]
    assert [(r["world"], r["size"]) for r in rows] == [(2, 4096), (2, 12288)]
    assert all(r["pccl_trio_s"] > 0 and r["pccl_trio_busbw"] > 0 for r in rows)
    # One repeat: its median is the row's median.
    assert all(r["pccl_trio_repeats_s"] == [r["pccl_trio_s"]] for r in rows)


@pytest.mark.skipif(not namespaces_work(), reason="needs root, ip and tc (network namespaces)")
def test_wan_bench_runs_over_shaped_namespaces(tmp_path: Path) -> None:
    """benchmarks/wan.py end to end at a tiny size: peers in their own namespaces behind
    tbf-shaped veths, plain and uint8 results verified, namespaces removed after."""
    out = tmp_path / "wan.json"
    prefix = f"pccl-t{os.getpid()}"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "wan.py"
    result = subprocess.run(
        [sys.executable, str(script), "--world", "3", "--sizes", "256K", "--iters", "1",
         "--warmup", "1", "--repeats", "1", "--rate", "200mbit", "--prefix", prefix,
         "--json", str(out)],
        capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["none", "uint8"]
    assert all(r["median_s"] > 0 for r in rows)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert prefix not in left.stdout
