"""What the examples' demos share: a master and peer processes on loopback, followed
through the JSON lines the peers print.

Theory of operation
-------------------
A demo starts ``pccl-trio master`` on 127.0.0.1 (a free port, a fresh run secret in
the environment every process inherits) and reads the line that says where it
listens. Each peer process prints one JSON object per line on stdout (``event`` names
what happened); ``Peer.follow`` reads them as they come, keeps them (``records``) and
hands each to the demo's narrator; ``wait_for`` blocks until a record matches, so the
demo acts on what the peers report (a peer stalled, a step taken without one) and
never on time.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

START = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"[{time.monotonic() - START:6.2f}s] {who:<7} {text}", flush=True)


def demo_environment() -> dict[str, str]:
    """The environment of the demo's processes: one fresh run secret for all."""
    return dict(os.environ, PYTHONUNBUFFERED="1", PCCL_TRIO_RUN_SECRET=secrets.token_hex(32))


async def start_master(env: dict[str, str]) -> tuple[trio.Process, str]:
    """A master on loopback (fast liveness, for a demo): its process and address."""
    master = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0", "--log-level",
         "WARNING", "--liveness-timeout", "2", "--heartbeat-interval", "0.2"],
        stdout=subprocess.PIPE, env=env,
    )
    assert master.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        chunk = await master.stdout.receive_some(1)
        if not chunk:
            raise SystemExit("the master exited before listening")
        line += chunk
    say("master", line.decode().strip())
    return master, line.decode().split()[-1]


class Peer:
    """A peer process and what its JSON lines said."""

    def __init__(self, name: str, process: trio.Process) -> None:
        self.name = name
        self.process = process
        self.peer_id: int | None = None
        self.records: list[dict[str, Any]] = []
        self.changed = trio.Event()
        self.ended = False  # its stdout reached EOF

    async def follow(self, on_record: Callable[[Peer, dict[str, Any]], None]) -> None:
        assert self.process.stdout is not None
        buffer = b""
        while chunk := await self.process.stdout.receive_some(65536):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                record = json.loads(line)
                if record["event"] == "joined":
                    self.peer_id = int(record["peer"])
                self.records.append(record)
                on_record(self, record)
                self.changed.set()
                self.changed = trio.Event()
        self.ended = True
        self.changed.set()

    @property
    def who(self) -> str:
        """How the narration names it: its peer id once it joined the run."""
        return self.name if self.peer_id is None else f"peer {self.peer_id}"

    def last(self, event: str) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r["event"] == event), None)

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        seen = 0
        while True:
            for record in self.records[seen:]:
                if predicate(record):
                    return record
            seen = len(self.records)
            if self.ended:
                raise RuntimeError(f"{self.name} exited before the expected line")
            await self.changed.wait()
