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
never on time. ``run_churn`` is the demos' run: founders, one of them stalled and
killed, a joiner; ``churn_arguments`` checks the flags that place it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
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


async def run_churn(
    command: Callable[[int, list[str]], list[str]], env: dict[str, str], *, world: int,
    kill_at: int, on_record: Callable[[Peer, dict[str, Any]], None],
) -> list[Peer]:
    """The demo's run: ``world`` peer processes (``command(index, extra)``, the
    joiner's index ``world``); with ``kill_at`` > 0 the second stalls after that outer
    step and is SIGKILLed once it says so, and a joiner starts once a survivor took a
    step without it. Returns every peer once each live one printed ``finished`` (or
    ``error``); the processes are the caller's to end (``end``), except when this
    fails or is cancelled (the caller's ``trio.fail_after``): then it ends them."""
    peers: list[Peer] = []
    async with trio.open_nursery() as nursery:

        async def spawn(name: str, index: int, *extra: str) -> Peer:
            process = await trio.lowlevel.open_process(
                command(index, list(extra)), stdout=subprocess.PIPE, env=env,
            )
            peer = Peer(name, process)
            peers.append(peer)
            nursery.start_soon(peer.follow, on_record)
            say("launch", f"started {name} (pid {process.pid})")
            return peer

        try:
            first = [
                await spawn(f"proc-{i}", i, *(["--stall-after", str(kill_at)]
                                              if kill_at > 0 and i == 1 else []))
                for i in range(world)
            ]
            if kill_at > 0:
                victim, survivors = first[1], first[:1] + first[2:]
                await victim.wait_for(lambda r: r["event"] == "stalled")
                say("launch", f"SIGKILL {victim.name} (peer {victim.peer_id})")
                victim.process.kill()
                await survivors[0].wait_for(
                    lambda r: r["event"] == "step" and r["world"] == world - 1)
                await spawn("joiner", world)
            for peer in peers:
                if peer.process.returncode is None and peer.last("stalled") is None:
                    await peer.wait_for(lambda r: r["event"] in ("finished", "error"))
        except BaseException:
            await end(peers)
            raise
        nursery.cancel_scope.cancel()
    return peers


async def end(peers: list[Peer], master: trio.Process | None = None) -> None:
    """Kill the peers still running, stop the master, and wait for all of them."""
    for peer in peers:
        if peer.process.returncode is None:
            peer.process.kill()
    if master is not None and master.returncode is None:
        master.send_signal(signal.SIGTERM)
    with trio.CancelScope(shield=True):
        for peer in peers:
            await peer.process.wait()
        if master is not None:
            await master.wait()


def add_churn_flags(parser: argparse.ArgumentParser, *, timeout: float) -> None:
    """The flags that place the demo's churn (``churn_arguments`` checks them), the
    victim's own, and the demo's time limit."""
    parser.add_argument("--kill-at", type=int, default=None,
                        help="demo: the outer step after which a peer is killed and a joiner "
                             "started (default T/3; 0: no kill, no joiner)")
    parser.add_argument("--hold-at", type=int, default=None,
                        help="at this outer step the run waits until it has --world peers "
                             "(default 2T/3: the demo's joiner takes part for certain)")
    parser.add_argument("--stall-after", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="demo: give up after this many seconds (default %(default)s)")


def churn_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    *, churn: bool) -> None:
    """``--kill-at`` and ``--hold-at`` checked and defaulted (T/3 and 2T/3 of
    ``--outer-steps``); without ``churn`` (a single peer, one process) neither."""
    if not churn or args.world == 1 or args.kill_at == 0:
        args.kill_at = 0  # no churn
        args.hold_at = -1 if args.hold_at is None else args.hold_at
        return
    if args.kill_at is None:
        args.kill_at = max(1, args.outer_steps // 3)
    if args.hold_at is None:
        args.hold_at = max(args.kill_at + 1, math.ceil(2 * args.outer_steps / 3))
    if not 0 < args.kill_at < args.hold_at < args.outer_steps:
        parser.error(f"the demo needs 0 < --kill-at ({args.kill_at}) < --hold-at ({args.hold_at}) "
                     f"< --outer-steps ({args.outer_steps}); --kill-at 0 runs it without churn")
