"""Real processes on loopback TCP: the master CLI and peer programs.

Each process's stderr (where the peer programs log at INFO) goes to a file of the
test's own, and the fixture prints the last lines of each as it ends: pytest shows
that output when the test failed, so a peer's local reason for a failure (e.g. "tag 1
failed locally: ...") is in the report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

PEER_PROGRAM = Path(__file__).with_name("peer_program.py")
LIVENESS_TIMEOUT = 2.0
#: Lines of each process's stderr a failed test prints.
LOG_TAIL = 40


class LineReader:
    """Reads a process's stdout line by line (JSON lines for peers)."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""
        self.lines: list[str] = []

    async def next_line(self) -> str | None:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some(4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        text = line.decode()
        self.lines.append(text)
        return text

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            line = await self.next_line()
            if line is None:
                raise AssertionError(f"process exited before the expected line; saw {self.lines}")
            record = json.loads(line)
            if predicate(record):
                return record


class Processes:
    def __init__(self, nursery: trio.Nursery, logs: Path) -> None:
        self.nursery = nursery
        self.logs = logs
        self.started: list[trio.Process] = []
        self.log_files: list[Path] = []

    async def start(self, *argv: str, stdout: bool = True, stdin: bool = False) -> trio.Process:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        name = Path(argv[1] if argv[0] == "-m" else argv[0]).name
        log = self.logs / f"{len(self.started)}-{name}.stderr"
        with log.open("wb") as stderr:  # the child keeps its own descriptor
            process = await trio.lowlevel.open_process(
                [sys.executable, *argv],
                stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                stderr=stderr,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                env=env,
            )
        self.started.append(process)
        self.log_files.append(log)
        return process

    def print_logs(self) -> None:
        """The last ``LOG_TAIL`` lines of every process's stderr, with its pid."""
        for process, log in zip(self.started, self.log_files, strict=True):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            print(f"--- {log.name} (pid {process.pid}, exit {process.returncode}) ---")
            print("\n".join(lines))

    async def master(self, *extra: str) -> tuple[trio.Process, str]:
        process = await self.start(
            "-m", "pccl_trio.master", "--listen", "127.0.0.1:0",
            "--liveness-timeout", str(LIVENESS_TIMEOUT), "--heartbeat-interval", "0.2", *extra,
        )
        line = await LineReader(process).next_line()
        assert line is not None and line.startswith("pccl-trio master listening on "), line
        return process, line.rsplit(" ", 1)[1]

    async def peer(self, master: str, group: int = 0) -> LineReader:
        process = await self.start(str(PEER_PROGRAM), master, "--group", str(group))
        return LineReader(process)

    def cleanup(self) -> None:
        for process in self.started:
            if process.returncode is None:
                try:
                    process.send_signal(signal.SIGCONT)
                    process.kill()
                except ProcessLookupError:
                    pass


@pytest.fixture
async def processes(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Processes]:
    procs = Processes(nursery, tmp_path)
    try:
        yield procs
    finally:
        procs.cleanup()
        with trio.CancelScope(shield=True):
            for process in procs.started:
                await process.wait()
        procs.print_logs()  # captured: pytest shows it when the test failed


def namespaces_work(tc: bool = True) -> bool:
    """Root with iproute2's ip (and tc, unless ``tc`` is False), in a kernel that lets
    us add a namespace."""
    if shutil.which("ip") is None or (tc and shutil.which("tc") is None):
        return False
    name = f"pccl-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    return made.returncode == 0


# --- a run with a secret, as several modules start it ---------------------------------

SECRET = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"



def environment(secret: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PCCL_TRIO_RUN_SECRET"}
    if secret is not None:
        env["PCCL_TRIO_RUN_SECRET"] = secret
    return env


async def run_demo(script: Path, *arguments: str) -> tuple[dict[str, Any], str]:
    """An example's demo run to its end (``script`` with ``arguments``, 150 s at
    most), which must exit 0: its ``RESULT`` line, parsed, and its whole output."""
    with trio.fail_after(150):
        result = await trio.run_process(
            [sys.executable, str(script), *arguments],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, output
    line = next(line for line in result.stdout.decode().splitlines() if line.startswith("RESULT "))
    summary: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return summary, output
