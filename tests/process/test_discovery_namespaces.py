"""Finding a master by its run's name over real mDNS, across emulated hosts.

Four network namespaces on one bridge (``benchmarks/wan.py``'s ``Topology``, links not
shaped): ``m`` (10.77.0.100), ``0``, ``1`` and ``2`` (10.77.0.1-3). Masters started
``pccl-trio master --listen 0.0.0.0:0 --advertise RUN --secret-file ...``:

* A: run ``alpha-run`` with secret 1, in ``m``;
* B: run ``alpha-run`` with secret 2, in ``0``;
* C: run ``other-run`` with secret 1, in ``2``;

and, in ``0``, a hostile advertiser of three broken records (one cut short, one of
``alpha-run`` whose protocol is no number, one of ``alpha-run`` at a loopback address)
and of a copy of A's advertisement pointing at B, whose instance name sorts first.

From ``1``, a peer with secret 1 discovering ``alpha-run`` must join A (after the copy
fails the handshake), and one with a third secret must fail naming what it saw. Then
D (``alpha-run``, secret 1) starts in ``2``: a peer must join whichever of A and D has
the lower instance name, and ``list_masters`` must return the copy, A and D. Every
master then exits 0 on SIGTERM, having withdrawn its advertisement; one started in
the bridge's namespace, which has no address to advertise, exits 1 saying so. Skipped without
root and ``ip`` (network namespaces).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import trio

from pccl_trio._core.discovery import auth_tag

from .conftest import LineReader, namespaces_work

pytest.importorskip("zeroconf")

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("discovery_program.py")
RUN, OTHER = "alpha-run", "other-run"
TIMEOUT = 120
pytestmark = pytest.mark.skipif(
    not namespaces_work(tc=False), reason="needs root and iproute2's ip (network namespaces)"
)


@pytest.fixture
def hosts() -> Iterator[Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import wan
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with wan.Topology(3, None, f"pccl-d{os.getpid()}") as topology:
        yield topology


def log_file(path: Path) -> BinaryIO:
    """``path`` opened for a process's stderr (it keeps its own descriptor)."""
    return open(path, "wb")


class Master:
    def __init__(self, process: trio.Process, port: int, instance: str, log: Path) -> None:
        self.process, self.port, self.instance, self.log = process, port, instance, log


class Runner:
    """Starts processes in namespaces; kills what is left at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[trio.Process] = []

    async def start(self, namespace: str, *argv: str, log: Path, stdin: bool = False) -> trio.Process:
        with log_file(log) as stderr:
            process = await trio.lowlevel.open_process(
                ["ip", "netns", "exec", namespace, sys.executable, *argv],
                stdout=subprocess.PIPE, stderr=stderr,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        self.started.append(process)
        return process

    async def master(self, namespace: str, run: str, secret: Path, name: str) -> Master:
        log = self.tmp_path / f"master-{name}.log"
        process = await self.start(
            namespace, "-m", "pccl_trio.master", "--listen", "0.0.0.0:0", "--secret-file",
            str(secret), "--advertise", run, "--heartbeat-interval", "0.2",
            "--liveness-timeout", "2", log=log,
        )
        reader = LineReader(process)
        listening, advertising = await reader.next_line(), await reader.next_line()
        assert listening is not None and listening.startswith("pccl-trio master listening on 0.0.0.0:"), (
            listening, log.read_text()
        )
        assert advertising is not None and advertising.startswith(
            f"pccl-trio master advertising run {run!r} as {run}-"
        ), (advertising, log.read_text())
        return Master(process, int(listening.rsplit(":", 1)[1]), advertising.rsplit(" ", 1)[1], log)

    async def peers(self, namespace: str, steps: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
        log = self.tmp_path / f"peers-{name}.log"
        process = await self.start(namespace, str(PROGRAM), "peers", json.dumps(steps), log=log)
        reader = LineReader(process)
        results = []
        for _ in steps:
            line = await reader.next_line()
            assert line is not None, (reader.lines, log.read_text())
            results.append(json.loads(line))
        assert await process.wait() == 0, log.read_text()
        return results

    def kill_all(self) -> None:
        for process in self.started:
            if process.returncode is None:
                process.kill()


async def no_address_to_advertise(runner: Runner, namespace: str, secret: Path) -> None:
    """A master whose host has no address but loopback cannot advertise: it says so
    and exits 1 (the hub's namespace has loopback and the bridge, without an address)."""
    log = runner.tmp_path / "master-hub.log"
    process = await runner.start(
        namespace, "-m", "pccl_trio.master", "--listen", "0.0.0.0:0", "--secret-file",
        str(secret), "--advertise", RUN, log=log,
    )
    assert await process.wait() == 1
    assert f"cannot advertise run {RUN!r}: this host has no address but loopback" in log.read_text()


async def test_peers_find_the_master_of_their_run_and_secret(hosts: Any, tmp_path: Path) -> None:
    secrets = []
    for index in range(3):
        path = tmp_path / f"secret{index}"
        path.write_text(f"{index}" * 32)
        secrets.append(path)
    one, two, three = secrets
    m, ns0, ns1, ns2 = hosts.master, *hosts.peers
    runner = Runner(tmp_path)
    masters: dict[str, Master] = {}

    async def start(name: str, namespace: str, run: str, secret: Path) -> None:
        masters[name] = await runner.master(namespace, run, secret, name)

    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start, "A", m, RUN, one)
                nursery.start_soon(start, "B", ns0, RUN, two)
                nursery.start_soon(start, "C", ns2, OTHER, one)
                nursery.start_soon(no_address_to_advertise, runner, hosts.hub, one)
            tag = auth_tag(one.read_bytes(), RUN)
            hostile = await runner.start(
                ns0, str(PROGRAM), "hostile", RUN, tag, "10.77.0.1", str(masters["B"].port),
                log=tmp_path / "hostile.log", stdin=True,
            )
            assert await LineReader(hostile).next_line() == "registered"

            def step(do: str, secret: Path, timeout: float) -> dict[str, Any]:
                return {"do": do, "run": RUN, "secret": secret.read_text(), "timeout": timeout}

            joined, refused = await runner.peers(
                ns1, [step("connect", one, 10), step("connect", three, 2)], "first"
            )
            assert joined["master"] == f"10.77.0.100:{masters['A'].port}", joined
            assert joined["world"] == 1, joined
            assert refused["error"] == "MasterConnectionError", refused
            message = refused["message"]
            assert f"no master advertises run {RUN!r} on this network within 2 s" in message
            assert f"run {RUN!r} with another run secret (3 masters)" in message, message
            assert f"run {OTHER!r}" in message, message
            assert "3 advertisements that could not be read" in message, message

            await start("D", ns2, RUN, one)
            joined, listed = await runner.peers(
                ns1, [step("connect", one, 10), step("list", one, 2)], "second"
            )
            first = min([masters["A"], masters["D"]], key=lambda master: master.instance)
            hosts_of = {"A": "10.77.0.100", "D": "10.77.0.3"}
            expected = {name: f"{hosts_of[name]}:{masters[name].port}" for name in ("A", "D")}
            assert joined["master"] == expected["A" if first is masters["A"] else "D"], (joined, expected)
            assert listed["masters"] == [[f"{RUN}--copycat", f"10.77.0.1:{masters['B'].port}"]] + sorted(
                [[masters[name].instance, expected[name]] for name in ("A", "D")]
            ), listed

            for master in masters.values():
                master.process.send_signal(signal.SIGTERM)
            assert hostile.stdin is not None
            await hostile.stdin.aclose()
            for name, master in masters.items():
                assert await master.process.wait() == 0, (name, master.log.read_text())
                assert "withdrew the advertisement of run" in master.log.read_text(), name
            assert await hostile.wait() == 0
    finally:
        runner.kill_all()
        with trio.CancelScope(shield=True):
            for process in runner.started:
                await process.wait()
