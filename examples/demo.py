"""The demo: a master and local peer processes forming a run, losing a peer, and
admitting a late joiner, narrated as it happens.

Run it with ``scripts/demo``. It ends by itself in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent
START = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"[{time.monotonic() - START:6.2f}s] {who:<8} {text}", flush=True)


class Peer:
    def __init__(self, name: str, group: int, process: trio.Process) -> None:
        self.name = name
        self.group = group
        self.process = process
        self.peer_id: int | None = None
        self.steps = 0
        self.world = 0
        self.changed = trio.Event()
        self.last_world: int | None = None

    async def follow(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        while chunk := await self.process.stdout.receive_some(4096):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.on_record(json.loads(line))
        say(self.name, "process ended")

    def on_record(self, record: dict[str, object]) -> None:
        event = record["event"]
        if event == "joined":
            self.peer_id = int(record["peer"])  # type: ignore[arg-type]
            say(self.name, f"joined the run as peer {self.peer_id} (group {self.group})")
        elif event == "step":
            self.steps = int(record["step"])  # type: ignore[arg-type]
            self.world = int(record["world"])  # type: ignore[arg-type]
            if self.world != self.last_world:
                say(self.name, f"step {self.steps:3d}: world size {self.world}, group size "
                               f"{record['group_world']}, ring {record['ring']}")
                self.last_world = self.world
        elif event == "error":
            say(self.name, f"{record['kind']}: {record['message']}")
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, predicate) -> None:  # type: ignore[no-untyped-def]
        while not predicate(self):
            await self.changed.wait()


async def main() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    say("demo", "starting a master on a free loopback port")
    master = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0",
         "--log-level", "WARNING", "--liveness-timeout", "2", "--heartbeat-interval", "0.25"],
        stdout=subprocess.PIPE, env=env,
    )
    assert master.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        line += await master.stdout.receive_some(1)
    address = line.decode().split()[-1]
    say("master", line.decode().strip())

    peers: list[Peer] = []
    async with trio.open_nursery() as nursery:

        async def spawn(name: str, group: int) -> Peer:
            process = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "peer.py"), address, "--group", str(group)],
                stdout=subprocess.PIPE, env=env,
            )
            peer = Peer(name, group, process)
            peers.append(peer)
            nursery.start_soon(peer.follow)
            say("demo", f"started {name} (pid {process.pid}) in peer group {group}")
            return peer

        try:
            with trio.fail_after(60):
                first = [await spawn(f"peer-{i}", 0) for i in range(3)]
                first.append(await spawn("peer-3", 1))
                for peer in first:
                    await peer.wait_until(lambda p: p.world == 4)
                say("demo", "all four peers are in: 3 in group 0, 1 in group 1")
                for peer in first:
                    await peer.wait_until(lambda p, base=peer.steps: p.steps >= base + 5)

                victim = first[1]
                say("demo", f"SIGKILL {victim.name} (peer {victim.peer_id}) in the middle of the run")
                victim.process.kill()
                survivors = [p for p in first if p is not victim]
                for peer in survivors:
                    await peer.wait_until(lambda p: p.world == 3)
                say("demo", "the survivors carried on with world size 3")

                late = await spawn("late", 0)
                for peer in [*survivors, late]:
                    await peer.wait_until(lambda p: p.world == 4)
                say("demo", f"{late.name} was admitted at the next update_topology")
                for peer in [*survivors, late]:
                    await peer.wait_until(lambda p, base=peer.steps: p.steps >= base + 5)
        finally:
            for peer in peers:
                if peer.process.returncode is None:
                    peer.process.send_signal(signal.SIGTERM)
        for peer in peers:
            await peer.process.wait()
    master.send_signal(signal.SIGTERM)
    code = await master.wait()
    say("demo", f"master exited with code {code}")
    final = [p for p in peers if p is not victim]
    say("demo", "final view: " + ", ".join(f"{p.name}: world {p.world} after {p.steps} steps"
                                            for p in final))
    if code != 0 or any(p.world != 4 for p in final):
        raise SystemExit("demo failed: the run did not end as expected")
    say("demo", "done")


if __name__ == "__main__":
    trio.run(main)
