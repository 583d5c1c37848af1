"""The demo: a master and local peer processes training a small model together,
losing a peer mid-step and admitting a late joiner, narrated as it happens.

Run it with ``scripts/demo``. It ends by itself in well under a minute and checks that
every peer ended with bit-identical weights.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent
START = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"[{time.monotonic() - START:6.2f}s] {who:<8} {text}", flush=True)


class Peer:
    def __init__(self, name: str, process: trio.Process) -> None:
        self.name = name
        self.process = process
        self.peer_id: int | None = None
        self.step = 0
        self.world = 0
        self.hashes: dict[int, str] = {}  # step -> weights digest
        self.changed = trio.Event()

    async def follow(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        while chunk := await self.process.stdout.receive_some(65536):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self.on_record(json.loads(line))
        self.changed.set()

    @property
    def who(self) -> str:
        """How the narration names it: its peer id once it joined the run."""
        return self.name if self.peer_id is None else f"peer {self.peer_id}"

    def on_record(self, record: dict[str, object]) -> None:
        event = record["event"]
        if event == "joined":
            self.peer_id = int(record["peer"])  # type: ignore[call-overload]
            say(self.name, f"joined the run as peer {self.peer_id}")
        elif event == "synced":
            rx, tx = int(record["rx"]), int(record["tx"])  # type: ignore[call-overload]
            what = f"received {rx} bytes of shared state" if rx else f"sent {tx} bytes of shared state"
            say(self.who, f"{what} at step {record['step']} (world {record['world']})")
        elif event == "step":
            step, world = int(record["step"]), int(record["world"])  # type: ignore[call-overload]
            self.hashes[step] = str(record["weights"])
            if world != self.world or step % 20 == 0:
                say(self.who, f"step {step:4d}  world {world}  loss {record['loss']:.4f}  "
                               f"weights {record['weights']}")
            self.step, self.world = step, world
        elif event == "optimized" and record["ring"] and record["ring"][0] == self.peer_id:
            say(self.who, f"optimize_topology: ring {record['ring']}, predicted "
                           f"{record['predicted_ms']} ms per gradient all-reduce")
        elif event == "waiting":
            say(self.who, f"alone in the run at step {record['step']}: waiting for a peer to "
                          "join (the master answers when one asks)")
        elif event == "aborted":
            say(self.who, f"step {record['step']} aborted for every peer, retrying: "
                          f"{record['reason']}")
        elif event == "error":
            say(self.who, f"{record['kind']}: {record['message']}")
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, predicate: Callable[[Peer], bool]) -> None:
        while not predicate(self):
            if self.process.returncode is not None:
                raise RuntimeError(f"{self.name} exited early")
            await self.changed.wait()


async def main() -> None:
    # One secret for the run: the master and every peer read it from the environment,
    # so every connection between them is authenticated.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PCCL_TRIO_RUN_SECRET=secrets.token_hex(32))
    say("demo", "starting a master on a free loopback port, with a fresh run secret")
    master = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0",
         "--log-level", "WARNING", "--liveness-timeout", "3", "--heartbeat-interval", "0.25"],
        stdout=subprocess.PIPE, env=env,
    )
    assert master.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        line += await master.stdout.receive_some(1)
    address = line.decode().split()[-1]
    say("master", line.decode().strip())

    peers: list[Peer] = []
    victim: Peer | None = None
    async with trio.open_nursery() as nursery:

        async def spawn(name: str, seed: int) -> Peer:
            process = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "train_peer.py"), address, "--seed", str(seed)],
                stdout=subprocess.PIPE, env=env,
            )
            peer = Peer(name, process)
            peers.append(peer)
            nursery.start_soon(peer.follow)
            say("demo", f"started {name} (pid {process.pid}), training on data shard {seed}")
            return peer

        try:
            with trio.fail_after(60):
                first = [await spawn(f"proc-{i}", i) for i in range(3)]
                for peer in first:
                    await peer.wait_until(lambda p: p.world == 3 and p.step >= 30)
                victim = first[1]
                say("demo", f"SIGKILL {victim.name} (peer {victim.peer_id}) in the middle of "
                            "its training loop")
                victim.process.kill()
                survivors = [p for p in first if p is not victim]
                for peer in survivors:
                    await peer.wait_until(lambda p: p.world == 2)
                say("demo", "the survivors carry on with world size 2")
                late = await spawn("late", 7)
                for peer in [*survivors, late]:
                    await peer.wait_until(lambda p: p.world == 3)
                joined_at = late.step
                say("demo", f"{late.who} was admitted and took the run's weights at step "
                            f"{joined_at} from the shared-state sync")
                for peer in [*survivors, late]:
                    await peer.wait_until(lambda p: p.step >= joined_at + 30)
        finally:
            for peer in peers:
                if peer.process.returncode is None:
                    peer.process.send_signal(signal.SIGTERM)
        for peer in peers:
            await peer.process.wait()
    master.send_signal(signal.SIGTERM)
    code = await master.wait()
    final = [p for p in peers if p is not victim]
    common = max(set.intersection(*(set(p.hashes) for p in final)))
    digests = {p.hashes[common] for p in final}
    say("demo", f"master exited with code {code}")
    say("demo", "weights at step " + str(common) + ": "
        + ", ".join(f"{p.who} {p.hashes[common]}" for p in final))
    if code != 0 or len(digests) != 1:
        raise SystemExit("demo failed: the peers did not end bit-identical")
    say("demo", "all peers hold bit-identical weights: done")


if __name__ == "__main__":
    trio.run(main)
