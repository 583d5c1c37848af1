"""Soak: a master and 2-6 peer processes on loopback, peers randomly killed, frozen and
spawned for ``--minutes``, every step of every peer checked.

Usage: python benchmarks/soak.py [--minutes 5] [--seed 1] [--secret] [--identities N]
                                 [--content-digest] [--log PATH] [--json PATH]

Theory of operation
-------------------
The driver starts a master (``python -m pccl_trio.master``) and ``--initial-peers``
peer processes (``soak_peer.py``, next to this file), which train a stand-in model
with the public API and print one JSON line per event (see its docstring). Every
``--interval`` seconds on average (uniformly 0.5-1.5 times it) the driver, with a
``random.Random(--seed)``, either spawns a peer (while fewer than ``--max-peers`` peer
processes live) or removes one: SIGKILL, or, with probability ``--freeze-fraction``,
SIGSTOP and then SIGKILL 1.5 liveness timeouts later, so that the master has to
notice the silence (a peer that hangs rather than dies). A removal never leaves
fewer than ``--min-peers`` peers that have completed a step and are not frozen, so
the run always holds peers with the current state; a peer still joining may be
killed. Only one peer is frozen at a time. The seed fixes the choices; which peers
are eligible at a given moment depends on process timing.

Every report is checked as it arrives; the first violation ends the run with exit
code 1 and a message naming the peer, with its last output:

* **All-reduce results are exact.** Each peer compares its result with the sum it
  computes from the ring (the peer reports ``wrong``). Across peers, every report of
  one revision must name the same world size, ring and result digest.
* **Shared state is bit-identical.** Every weights digest reported for a revision
  (after a step produced it, or after a sync at it) must be the same; and a peer that
  synced before must receive nothing in a sync (``rx_bytes == 0``): bytes received
  then would mean its weights had diverged.
* **No stall.** A stall is the time between two consecutive completed steps of one
  peer, by the peer's ``time.monotonic()`` (one clock for all processes on this
  machine), counted from the peer's first step, so a joiner's own admission is not
  one. Every stall must be at most ``--liveness-timeout`` plus ``--retry-seconds``,
  the time one retried step may take (re-establishing the ring without the dead peer,
  an admission round, the sync and the all-reduce again): the liveness timeout
  covers a frozen peer going unnoticed, the rest one retry. A peer that stops
  reporting altogether (a hang) is caught once its silence exceeds that bound by
  ``GRACE`` seconds (the driver's own reading lag), also at the end of the run. A
  spawned peer must complete its first step within ``--join-timeout``.
* **No surprises.** A peer or the master exiting without being killed fails the
  run (a peer reports why in its ``error`` line); at the end the master must exit 0
  on SIGTERM.

At the end the driver prints a summary (``--json`` writes it as JSON too): minutes
run, kills and spawns, steps (revisions the run advanced by), all-reduces (successful
calls, summed over peers), aborted attempts that were retried, syncs, joiners' state
transfers, and the longest stall. ``--secret`` gives the master and every peer a
fresh random run secret in ``PCCL_TRIO_RUN_SECRET``. ``--identities N`` (which implies
``--secret``) creates N node keys, starts the master with an allowlist of them and
gives each spawned peer one of them in turn (so a key comes back while an earlier
holder may still be registered, frozen). ``--content-digest`` starts the master with
``--content-digest``. ``--log`` writes every report,
tagged with the peer's name, as JSON lines. ``--inject KIND`` breaks the first peer
on purpose after its 10th step (``soak_peer.py`` describes the kinds) and keeps it from
being removed: the run must then fail, which is how the checks themselves are tested.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import dataclasses
import enum
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import trio

from pccl_trio._identity import load_identity, public_hex

PEER_PROGRAM = Path(__file__).with_name("soak_peer.py")
GRACE = 1.0  # seconds: the driver's reading lag allowed before a silent peer counts as hung
TAIL = 12  # output lines kept per process for failure messages


class PeerState(enum.Enum):
    JOINING = "joining"  # spawned, no step yet
    STEPPING = "stepping"
    FROZEN = "frozen"  # SIGSTOPped, to be killed
    KILLED = "killed"


@dataclasses.dataclass
class Peer:
    name: str
    process: trio.Process
    spawned_at: float
    state: PeerState = PeerState.JOINING
    peer_id: int | None = None
    last_step: float | None = None  # peer's clock
    revision: int | None = None  # of its state, as last reported
    steps: int = 0
    tail: collections.deque[str] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=TAIL)
    )

    def describe(self) -> str:
        ident = f"id {self.peer_id}" if self.peer_id is not None else "no id yet"
        return (f"{self.name} (pid {self.process.pid}, {ident}, {self.state.value}, "
                f"{self.steps} steps); "
                f"last output:\n{indented(self.tail)}")


def indented(lines: collections.abc.Iterable[str]) -> str:
    return "\n".join(f"    {line}" for line in lines) or "    (no output)"


@dataclasses.dataclass(frozen=True)
class Revision:
    """What the first report of a revision said; later ones must agree."""

    reporter: str
    weights: str
    world: int | None = None
    ring: tuple[int, ...] | None = None
    result: str | None = None


@dataclasses.dataclass
class Tally:
    kills: int = 0
    frozen_first: int = 0
    spawns: int = 0
    peer_steps: int = 0
    aborted_retried: int = 0
    other_retries: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    syncs: int = 0
    joiner_syncs: int = 0
    joiner_bytes: int = 0
    max_stall: float = 0.0
    max_stall_at: str = ""
    worlds: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)


class Soak:
    """The driver: spawns and removes processes, reads and checks every report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.bound = args.liveness_timeout + args.retry_seconds
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.secret or args.identities:
            self.env["PCCL_TRIO_RUN_SECRET"] = secrets.token_hex(32)
        self.keys = tempfile.TemporaryDirectory(prefix="soak-keys-")
        self.identities = [
            Path(self.keys.name) / f"node{i}.key" for i in range(args.identities)
        ]
        self.peers: list[Peer] = []
        self.revisions: dict[int, Revision] = {}
        self.newest_revision = 0
        self.steps = 0  # revisions a step produced
        self.tally = Tally()
        self.failure: str | None = None
        self.stopping = False
        self.started = time.monotonic()
        self.finished = self.started
        self.master: trio.Process | None = None
        self.master_tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self.address = ""
        self.log: IO[str] | None = None
        self._nursery: trio.Nursery | None = None

    # --- running --------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.start_master(nursery)
                self.started = time.monotonic()
                for _ in range(self.args.initial_peers):
                    await self.spawn()
                nursery.start_soon(self.chaos)
                nursery.start_soon(self.watchdog)
                await trio.sleep(self.args.minutes * 60)
                self.finished = time.monotonic()
                self.check_silences(self.finished)
                self.stopping = True
                nursery.cancel_scope.cancel()
        finally:
            self.stopping = True
            if self.failure is not None:
                self.finished = time.monotonic()
            with trio.CancelScope(shield=True):
                await self.shut_down()

    def fail(self, message: str) -> None:
        """Record the first violation and stop the run."""
        if self.failure is None and not self.stopping:
            self.failure = message
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()

    async def start_master(self, nursery: trio.Nursery) -> None:
        a = self.args
        master = self.master = await trio.lowlevel.open_process(
            [sys.executable, "-m", "pccl_trio.master", "--listen", "127.0.0.1:0",
             "--log-level", "WARNING", "--liveness-timeout", str(a.liveness_timeout),
             "--heartbeat-interval", str(a.heartbeat_interval), *self.master_options()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
        )
        assert master.stdout is not None and master.stderr is not None
        first = await read_first_line(master.stdout)
        if not first.startswith("pccl-trio master listening on "):
            raise SystemExit(f"soak: the master did not start: {first!r}")
        self.address = first.rsplit(" ", 1)[1]
        nursery.start_soon(read_lines, master.stderr, self.master_tail.append)
        nursery.start_soon(self.watch_master, master)

    def master_options(self) -> list[str]:
        options = ["--content-digest"] if self.args.content_digest else []
        if self.identities:
            allowlist = Path(self.keys.name) / "allowed"
            allowlist.write_text("".join(
                public_hex(load_identity(path)) + "\n" for path in self.identities
            ))
            options += ["--allow-identities", str(allowlist)]
        return options

    async def watch_master(self, master: trio.Process) -> None:
        code = await master.wait()
        self.fail(f"the master exited with code {code} during the run; last output:\n"
                  + indented(self.master_tail))

    async def spawn(self) -> None:
        a = self.args
        argv = [sys.executable, str(PEER_PROGRAM), self.address, "--elements", str(a.elements),
                "--step-seconds", str(a.step_seconds)]
        if not a.optimize:
            argv.append("--no-optimize")
        if self.identities:
            argv += ["--identity", str(self.identities[len(self.peers) % len(self.identities)])]
        if a.inject is not None and not self.peers:
            argv += ["--inject", a.inject, "--inject-at", "10"]
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env
        )
        peer = Peer(name=f"p{len(self.peers)}", process=process, spawned_at=time.monotonic())
        self.peers.append(peer)
        self.tally.spawns += 1
        assert self._nursery is not None and process.stderr is not None
        self._nursery.start_soon(self.follow, peer)
        self._nursery.start_soon(read_lines, process.stderr, peer.tail.append)

    async def follow(self, peer: Peer) -> None:
        """Read a peer's reports until it exits; an exit we did not cause fails the run."""
        assert peer.process.stdout is not None
        await read_lines(peer.process.stdout, lambda line: self.on_line(peer, line))
        code = await peer.process.wait()
        if peer.state not in (PeerState.KILLED, PeerState.FROZEN):
            self.fail(f"peer {peer.name} exited with code {code} without being killed: "
                      + peer.describe())

    # --- chaos ----------------------------------------------------------------------

    def alive(self) -> list[Peer]:
        return [p for p in self.peers if p.state is not PeerState.KILLED]

    def removable(self) -> list[Peer]:
        """Peers whose removal leaves at least ``--min-peers`` stepping peers."""
        stepping = [p for p in self.peers if p.state is PeerState.STEPPING]
        joining = [p for p in self.peers if p.state is PeerState.JOINING]
        candidates = joining
        if len(stepping) - 1 >= self.args.min_peers:
            candidates = stepping + joining
        if self.args.inject is not None:
            candidates = [p for p in candidates if p is not self.peers[0]]
        return candidates

    async def chaos(self) -> None:
        a = self.args
        while True:
            await trio.sleep(self.rng.uniform(0.5, 1.5) * a.interval)
            can_spawn = len(self.alive()) < a.max_peers
            victims = self.removable()
            actions = (["spawn"] if can_spawn else []) + (["remove"] if victims else [])
            if not actions:
                continue
            if self.rng.choice(actions) == "spawn":
                await self.spawn()
                continue
            victim = self.rng.choice(victims)
            frozen = any(p.state is PeerState.FROZEN for p in self.peers)
            if (self.rng.random() < a.freeze_fraction and not frozen
                    and victim.state is PeerState.STEPPING):
                self.freeze(victim)
            else:
                self.kill(victim)

    def kill(self, peer: Peer) -> None:
        peer.state = PeerState.KILLED
        self.tally.kills += 1
        try:
            peer.process.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass

    def freeze(self, peer: Peer) -> None:
        peer.state = PeerState.FROZEN
        self.tally.frozen_first += 1
        try:
            peer.process.send_signal(signal.SIGSTOP)
        except ProcessLookupError:
            pass

        async def kill_later() -> None:
            await trio.sleep(1.5 * self.args.liveness_timeout)
            self.kill(peer)

        assert self._nursery is not None
        self._nursery.start_soon(kill_later)

    async def watchdog(self) -> None:
        while True:
            await trio.sleep(0.25)
            self.check_silences(time.monotonic())

    def check_silences(self, now: float) -> None:
        for peer in self.peers:
            if peer.state is PeerState.STEPPING and peer.last_step is not None:
                if now - peer.last_step > self.bound + GRACE:
                    self.fail(f"stall: peer {peer.name} completed no step for "
                              f"{now - peer.last_step:.2f} s (bound {self.bound:.2f} s): "
                              + peer.describe())
            elif peer.state is PeerState.JOINING and now - peer.spawned_at > self.args.join_timeout:
                self.fail(f"peer {peer.name} did not complete a first step within "
                          f"{self.args.join_timeout:.0f} s of its spawn: " + peer.describe())

    # --- checking -------------------------------------------------------------------

    def on_line(self, peer: Peer, line: str) -> None:
        peer.tail.append(line)
        if self.stopping:
            return
        try:
            record = json.loads(line)
            event = record["event"]
        except (ValueError, KeyError, TypeError):
            self.fail(f"peer {peer.name} printed something that is not a report: " + peer.describe())
            return
        if self.log is not None:
            self.log.write(json.dumps({"name": peer.name, **record}) + "\n")
        handler = {"joined": self.on_joined, "sync": self.on_sync, "step": self.on_step,
                   "retry": self.on_retry}.get(event)
        if handler is not None:
            handler(peer, record)

    def on_joined(self, peer: Peer, record: dict[str, Any]) -> None:
        peer.peer_id = int(record["peer"])
        for other in self.peers:
            if other is not peer and other.peer_id == peer.peer_id:
                self.fail(f"peers {other.name} and {peer.name} both got id {peer.peer_id}")

    def on_sync(self, peer: Peer, record: dict[str, Any]) -> None:
        self.tally.syncs += 1
        revision, rx = int(record["rev"]), int(record["rx"])
        if not record["first"] and revision != peer.revision:
            self.fail(f"peer {peer.name} synced at revision {revision} after its step to "
                      f"revision {peer.revision} " + peer.describe())
            return
        peer.revision = revision
        if record["first"]:
            if rx:
                self.tally.joiner_syncs += 1
                self.tally.joiner_bytes += rx
        elif rx:
            self.fail(f"peer {peer.name} received {rx} bytes in its sync at revision {revision}: "
                      "its shared state had diverged from the others' " + peer.describe())
            return
        self.agree(peer, revision, Revision(reporter=peer.name, weights=str(record["weights"])))

    def on_step(self, peer: Peer, record: dict[str, Any]) -> None:
        revision, t = int(record["rev"]), float(record["t"])
        if peer.revision is None or revision != peer.revision + 1:
            self.fail(f"peer {peer.name} stepped to revision {revision} from revision "
                      f"{peer.revision} " + peer.describe())
            return
        peer.revision = revision
        if record["wrong"] is not None:
            self.fail(f"wrong all-reduce result at peer {peer.name} for revision {revision - 1}: "
                      f"{record['wrong']} " + peer.describe())
            return
        self.agree(peer, revision, Revision(
            reporter=peer.name, weights=str(record["weights"]), world=int(record["world"]),
            ring=tuple(record["ring"]), result=str(record["result"]),
        ))
        if peer.last_step is not None:
            stall = t - peer.last_step
            if stall > self.tally.max_stall:
                self.tally.max_stall = stall
                self.tally.max_stall_at = f"{peer.name}, {self.minute(t):.2f} min into the run"
            if stall > self.bound:
                self.fail(f"stall: peer {peer.name} took {stall:.2f} s between two steps "
                          f"(bound {self.bound:.2f} s), ending at revision {revision}: "
                          + peer.describe())
        if peer.state is PeerState.JOINING:
            peer.state = PeerState.STEPPING
        peer.last_step = t
        peer.steps += 1
        self.tally.peer_steps += 1
        self.tally.aborted_retried += int(record["aborts"])
        self.tally.worlds[int(record["world"])] += 1

    def on_retry(self, peer: Peer, record: dict[str, Any]) -> None:
        if record["call"] != "all_reduce":  # aborted all-reduces are counted with the step
            self.tally.other_retries[f"{record['call']}: {record['kind']}"] += 1

    def agree(self, peer: Peer, revision: int, seen: Revision) -> None:
        """Compare a report with the first one of its revision."""
        first = self.revisions.get(revision)
        if seen.world is not None and (first is None or first.world is None):
            self.steps += 1
        if first is None:
            self.revisions[revision] = seen
            if revision > self.newest_revision:
                self.newest_revision = revision
                self.revisions.pop(revision - 10_000, None)  # keep memory bounded
            return
        if seen.world is not None and first.world is None:
            # A sync reported this revision first: the step's details complete it.
            self.revisions[revision] = dataclasses.replace(
                first, world=seen.world, ring=seen.ring, result=seen.result
            )
        if first.weights != seen.weights:
            self.fail(f"shared state differs at revision {revision}: {seen.reporter} holds "
                      f"weights {seen.weights}, {first.reporter} held {first.weights} "
                      + peer.describe())
        elif seen.world is not None and first.world is not None and (
            (first.world, first.ring, first.result) != (seen.world, seen.ring, seen.result)
        ):
            self.fail(f"all-reduce for revision {revision} differs: {seen.reporter} got world "
                      f"{seen.world}, ring {list(seen.ring or ())}, result {seen.result}; "
                      f"{first.reporter} got world {first.world}, ring {list(first.ring or ())}, "
                      f"result {first.result} " + peer.describe())

    # --- the end --------------------------------------------------------------------

    async def shut_down(self) -> None:
        for peer in self.peers:
            if peer.process.returncode is None:
                peer.process.send_signal(signal.SIGKILL)
        for peer in self.peers:
            await peer.process.wait()
        master = self.master
        if master is None:
            return
        if master.returncode is None:
            master.send_signal(signal.SIGTERM)
            with trio.move_on_after(20):
                await master.wait()
            if master.returncode is None:
                master.kill()
                await master.wait()
                if self.failure is None:
                    self.failure = "the master did not exit within 20 s of SIGTERM"
                return
        if master.returncode != 0 and self.failure is None:
            self.failure = (f"the master exited with code {master.returncode} on SIGTERM; "
                            "last output:\n" + indented(self.master_tail))

    def minute(self, t: float) -> float:
        return (t - self.started) / 60

    def summary(self) -> dict[str, Any]:
        t = self.tally
        return {
            "clean": self.failure is None,
            "failure": self.failure,
            "minutes": round(self.minute(self.finished), 2),
            "seed": self.args.seed,
            "secret": bool(self.args.secret or self.args.identities),
            "identities": self.args.identities,
            "content_digest": bool(self.args.content_digest),
            "kills": t.kills,
            "frozen_first": t.frozen_first,
            "spawns": t.spawns,
            "steps": self.steps,
            "newest_revision": self.newest_revision,
            "all_reduces": t.peer_steps,
            "aborted_retried": t.aborted_retried,
            "other_retries": dict(t.other_retries),
            "syncs": t.syncs,
            "joiner_syncs": t.joiner_syncs,
            "joiner_bytes": t.joiner_bytes,
            "max_stall_s": round(t.max_stall, 3),
            "max_stall_at": t.max_stall_at,
            "stall_bound_s": self.bound,
            "all_reduces_by_world": {str(w): n for w, n in sorted(t.worlds.items())},
        }


def summary_text(s: dict[str, Any]) -> str:
    verdict = "clean" if s["clean"] else "FAILED"
    worlds = ", ".join(f"W={w}: {n}" for w, n in s["all_reduces_by_world"].items()) or "none"
    retries = ", ".join(f"{k} x{n}" for k, n in sorted(s["other_retries"].items())) or "none"
    return (
        f"soak {verdict}: {s['minutes']} min, seed {s['seed']}, "
        f"{'with' if s['secret'] else 'without'} a run secret"
        + (f", {s['identities']} node identities" if s.get("identities") else "")
        + (", content digests" if s.get("content_digest") else "") + "\n"
        f"  {s['kills']} kills ({s['frozen_first']} frozen first), {s['spawns']} spawns\n"
        f"  {s['steps']} steps (revision {s['newest_revision']}), {s['all_reduces']} all-reduces "
        f"over all peers ({worlds}), {s['aborted_retried']} aborted attempts retried\n"
        f"  {s['syncs']} syncs, {s['joiner_syncs']} of them joiners receiving "
        f"{s['joiner_bytes']} bytes; other retries: {retries}\n"
        f"  max stall {s['max_stall_s']:.3f} s ({s['max_stall_at'] or '-'}), "
        f"bound {s['stall_bound_s']:.2f} s"
    )


async def read_first_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


async def read_lines(stream: trio.abc.ReceiveStream, on_line: Callable[[str], object]) -> None:
    """Call ``on_line`` with each whole line of ``stream`` until it ends (a killed
    process's unfinished last line is dropped)."""
    buffer = b""
    while chunk := await stream.receive_some(65536):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            on_line(line.decode(errors="replace"))


async def progress(soak: Soak, every: float) -> None:
    while True:
        await trio.sleep(every)
        t = soak.tally
        print(f"[{soak.minute(time.monotonic()):5.1f} min] revision {soak.newest_revision}, "
              f"{len(soak.alive())} peers, {t.kills} kills, {t.spawns} spawns, "
              f"{t.aborted_retried} aborts retried, max stall {t.max_stall:.2f} s", flush=True)


async def soak_for(args: argparse.Namespace, log: IO[str] | None) -> Soak:
    soak = Soak(args)
    soak.log = log
    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress, soak, args.progress)
        await soak.run()
        nursery.cancel_scope.cancel()
    return soak


def main() -> int:
    args = parse_args()
    if args.log:
        with open(args.log, "w") as log:
            soak = trio.run(soak_for, args, log)
    else:
        soak = trio.run(soak_for, args, None)
    summary = soak.summary()
    if soak.failure is not None:
        print(f"soak: FAILED: {soak.failure}", flush=True)
    print(summary_text(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if soak.failure is None else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    add("--seed", type=int, default=1, help="seeds the driver's choices (default 1)")
    add("--min-peers", type=int, default=2, help="stepping peers a removal must leave (default 2)")
    add("--max-peers", type=int, default=6, help="most peer processes at once (default 6)")
    add("--initial-peers", type=int, default=3, help="peers spawned at the start (default 3)")
    add("--interval", type=float, default=4.0,
        help="mean seconds between spawns/removals (default 4)")
    add("--freeze-fraction", type=float, default=0.25,
        help="share of removals that SIGSTOP the peer first (default 0.25)")
    add("--liveness-timeout", type=float, default=3.0, help="the master's (default 3)")
    add("--heartbeat-interval", type=float, default=0.5, help="the master's (default 0.5)")
    add("--retry-seconds", type=float, default=2.0,
        help="time one retried step may take, on top of the liveness timeout (default 2)")
    add("--join-timeout", type=float, default=60.0,
        help="seconds a spawned peer may take to its first step (default 60)")
    add("--elements", type=int, default=1 << 16, help="float32 elements per all-reduce")
    add("--step-seconds", type=float, default=0.05, help="peers' pause between steps")
    add("--no-optimize", dest="optimize", action="store_false",
        help="skip optimize_topology after admissions")
    add("--secret", action="store_true", help="run with a random run secret")
    add("--identities", type=int, default=0, metavar="N",
        help="N node keys, an allowlist of them at the master, one per peer in turn "
        "(implies --secret)")
    add("--content-digest", action="store_true",
        help="start the master with --content-digest (BLAKE2b shared-state digests)")
    add("--inject", choices=["wrong-sum", "divergence", "hang"],
        help="break the first peer on purpose (the run must fail)")
    add("--log", help="write every report as JSON lines here")
    add("--json", help="write the summary as JSON here")
    add("--progress", type=float, default=30.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    if not 2 <= args.min_peers <= args.initial_peers <= args.max_peers:
        parser.error("need 2 <= --min-peers <= --initial-peers <= --max-peers")
    return args


if __name__ == "__main__":
    sys.exit(main())
