"""Failover: how long the peers of a run go without a step when their master dies.

Usage: python benchmarks/failover.py [--repeats 3] [--restart-delay 2] [--json PATH]
                                     [--cases restart,standby,elect,takeover]
                                     [--peer-logs DIR]

Theory of operation
-------------------
Each repeat runs two cases, each with a fresh run of three peer processes
(``soak_peer.py``, next to this file: every step syncs the shared state and
all-reduces, and reports it as a JSON line with ``time.monotonic()``, one clock for
every process on this machine):

* ``restart``: one master (``python -m pccl_trio.master``) on a fixed port; it is
  SIGKILLed and a new master is started on the same port ``--restart-delay`` seconds
  later, as a supervisor would.
* ``standby``: the peers are given two addresses, the master's and a standby's, which
  runs all along; the master is SIGKILLed and nothing is restarted.
* ``elect`` (root and network namespaces, python-zeroconf): no master is started. The
  three peers run in namespaces of their own on one bridge (``wan.Topology``, links
  not shaped), given only the run's name and secret (``--discover RUN
  --host-master``): they elect one of themselves to host the master. The peer process
  hosting it is SIGKILLed, master and all; the two survivors elect again and go on.
* ``takeover`` (as ``elect``): the peers elect a master as above; then a master is
  started by hand for the run (``pccl-trio master --advertise RUN``, in a namespace of
  its own). Two masters of one run: the elected one steps down (a master started by
  hand comes first), and every peer goes over to the new one, its process alive. The
  figure is the time from the new master listening to each peer's first step with it.

The master is killed once every peer completed ``--steps-before`` steps, so mid-step
for some of them. For each peer the *recovery* is the time from the kill to the end of
its first step that needed a master after it: the step after its first sync that ended
after the kill (a step already past its sync may still end without a master). The run
must go on as if nothing happened, else the repeat fails (exit 1): no peer exits,
every peer steps ``--steps-after`` more times, the revisions go on without a gap, no
sync after a peer's first moves a byte (nobody diverged), every all-reduce result is
exact (the peers check it, ``wrong``) and the weights are bit-identical at every
revision. Printed: the medians over peers and repeats, and for ``restart`` the same
from the moment the new master listened (what the peers add to the supervisor's
restart).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from soak import read_first_line, read_lines

PEER_PROGRAM = Path(__file__).with_name("soak_peer.py")
PEERS = 3
RUN = "failover-elect"
SECRET = os.urandom(16).hex()
_RUNS = itertools.count(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Run:
    """One run: masters and peers as processes, the peers' reports as they come."""

    def __init__(self, nursery: trio.Nursery, args: argparse.Namespace, case: str) -> None:
        self.nursery = nursery
        self.case = case
        self.number = next(_RUNS)  # names its peers' logs (``--peer-logs``)
        self.args = args
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.masters: dict[int, trio.Process] = {}
        self.peers: list[trio.Process] = []
        self.reports: list[list[dict[str, Any]]] = [[] for _ in range(PEERS)]
        self.changed = trio.Event()
        self.failure: str | None = None
        self.killed: int | None = None  # the peer killed with the master (``elect``)

    async def master(self, port: int) -> None:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "pccl_trio.master", "--listen", f"127.0.0.1:{port}",
             "--log-level", "ERROR"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env,
        )
        assert process.stdout is not None
        line = await read_first_line(process.stdout)
        if not line.startswith("pccl-trio master listening on"):
            raise SystemExit(f"failover: a master did not start: {line!r}")
        self.masters[port] = process

    async def peer(self, index: int, address: str, namespace: str | None = None) -> None:
        argv = [sys.executable, str(PEER_PROGRAM), address, "--elements", "65536",
                "--step-seconds", str(self.args.step_seconds), "--no-optimize"]
        env = self.env
        stderr: Any = subprocess.DEVNULL
        if self.args.peer_logs:
            # The peer's log (its master's too, when it hosts one), for a failure's story.
            argv += ["--log-level", "INFO"]
            name = f"{self.number:02d}-{self.case}-peer{index}.log"
            stderr = open(Path(self.args.peer_logs) / name, "w")  # noqa: ASYNC230, SIM115
        if namespace is not None:
            argv = ["ip", "netns", "exec", namespace, *argv, "--discover", RUN, "--host-master"]
            env = dict(env, PCCL_TRIO_RUN_SECRET=SECRET)
        try:
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, stderr=stderr, env=env,
            )
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()  # the child holds its own copy
        self.peers.append(process)
        self.nursery.start_soon(self.follow, index, process)

    async def follow(self, index: int, process: trio.Process) -> None:
        assert process.stdout is not None
        await read_lines(process.stdout, lambda line: self.on_report(index, line))
        code = await process.wait()
        if self.failure is None and not (code == -signal.SIGKILL and index == self.killed):
            self.failure = f"peer {index} exited with {code}"
        self.changed.set()

    def on_report(self, index: int, line: str) -> None:
        report = json.loads(line)
        self.reports[index].append(report)
        if report["event"] == "error":
            self.failure = f"peer {index} failed: {report}\n{self.story()}"
        self.changed.set()
        self.changed = trio.Event()

    def story(self, last: int = 8) -> str:
        """Each peer's last ``last`` reports, one per line: what led to a failure."""
        lines = []
        for index, reports in enumerate(self.reports):
            lines += [f"  peer {index}: {json.dumps(r)}" for r in reports[-last:]]
        return "the peers' last reports:\n" + "\n".join(lines)

    def steps(self, index: int, after: float = float("-inf")) -> list[dict[str, Any]]:
        return [r for r in self.reports[index] if r["event"] == "step" and r["t"] > after]

    def recovered(self, index: int, killed_at: float) -> float:
        """When peer ``index`` completed its first step that needed a master after the
        kill: the step after its first sync that ended after the kill (a sync cannot
        end without a master; a step already past its sync may end without one)."""
        synced = next(r["t"] for r in self.reports[index]
                      if r["event"] == "sync" and r["t"] > killed_at)
        return float(self.steps(index, synced)[0]["t"])

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self.failure is not None:
                raise SystemExit(f"failover: {self.failure}")
            with trio.move_on_after(self.args.timeout / 4) as quiet:
                await self.changed.wait()
            if quiet.cancelled_caught:
                raise SystemExit(f"failover: the peers stopped reporting; {self.story()}")

    def stop(self) -> None:
        for process in [*self.peers, *self.masters.values()]:
            if process.returncode is None:
                process.kill()


async def one_case(case: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """For every peer, in one run of ``case``: the seconds from the kill to its next
    step, and from the moment a master listened again (the restart, or the kill for a
    standby or an elected master) to that step."""
    if case in ("elect", "takeover"):
        return await elect_case(args, takeover=case == "takeover")
    ports = [free_port(), free_port()]
    with trio.fail_after(args.timeout):
        async with trio.open_nursery() as nursery:
            run = Run(nursery, args, case)
            try:
                await run.master(ports[0])
                if case == "standby":
                    await run.master(ports[1])
                address = ",".join(
                    f"127.0.0.1:{p}" for p in (ports if case == "standby" else ports[:1])
                )
                for index in range(PEERS):
                    await run.peer(index, address)
                await run.until(lambda: all(
                    len(run.steps(i)) >= args.steps_before for i in range(PEERS)
                ))
                killed_at = time.monotonic()  # the clock of the peers' reports
                run.masters.pop(ports[0]).kill()
                back_at = killed_at
                if case == "restart":
                    await trio.sleep(args.restart_delay)
                    await run.master(ports[0])
                    back_at = time.monotonic()
                await run.until(lambda: all(
                    len(run.steps(i, killed_at)) >= args.steps_after for i in range(PEERS)
                ))
                check(run)
                nexts = [run.recovered(i, killed_at) for i in range(PEERS)]
                return [t - killed_at for t in nexts], [t - back_at for t in nexts]
            finally:
                run.stop()
                nursery.cancel_scope.cancel()


async def elect_case(
    args: argparse.Namespace, *, takeover: bool
) -> tuple[list[float], list[float]]:
    """``one_case`` for ``elect`` and ``takeover`` (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import wan

    with wan.Topology(PEERS, None, f"pccl-f{os.getpid()}") as topology, trio.fail_after(args.timeout):
        async with trio.open_nursery() as nursery:
            run = Run(nursery, args, "takeover" if takeover else "elect")
            try:
                for index in range(PEERS):
                    await run.peer(index, "-", topology.peers[index])
                await run.until(lambda: all(
                    len(run.steps(i)) >= args.steps_before for i in range(PEERS)
                ))
                hosts = [i for i in range(PEERS) if run.steps(i)[-1]["hosting"]]
                if len(hosts) != 1:
                    raise SystemExit(f"failover: the peers hosting a master are {hosts}, not one")
                if takeover:
                    return await take_over(run, topology, args)
                run.killed = hosts[0]
                killed_at = time.monotonic()
                run.peers[run.killed].kill()
                survivors = [i for i in range(PEERS) if i != run.killed]
                await run.until(lambda: all(
                    len(run.steps(i, killed_at)) >= args.steps_after for i in survivors
                ))
                check(run)
                again = [i for i in survivors if run.steps(i)[-1]["hosting"]]
                if len(again) != 1:
                    raise SystemExit(f"failover: after the kill, {again} host a master, not one")
                nexts = [run.recovered(i, killed_at) - killed_at for i in survivors]
                return nexts, nexts
            finally:
                run.stop()
                nursery.cancel_scope.cancel()


async def take_over(run: Run, topology: Any, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Start a master by hand beside the elected one; every peer must go over to it."""
    process = await trio.lowlevel.open_process(
        ["ip", "netns", "exec", topology.master, sys.executable, "-m", "pccl_trio.master",
         "--listen", "0.0.0.0:0", "--advertise", RUN, "--log-level", "ERROR"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=dict(run.env, PCCL_TRIO_RUN_SECRET=SECRET),
    )
    run.masters[0] = process
    assert process.stdout is not None
    line = await read_first_line(process.stdout)
    if not line.startswith("pccl-trio master listening on"):
        raise SystemExit(f"failover: the master started by hand did not start: {line!r}")
    listening_at = time.monotonic()
    port = line.rsplit(":", 1)[1]

    def with_new_master(i: int) -> list[dict[str, Any]]:
        return [r for r in run.steps(i, listening_at) if r["master"].endswith(f":{port}")]

    await run.until(lambda: all(len(with_new_master(i)) >= args.steps_after for i in range(PEERS)))
    check(run)
    if any(r["hosting"] for i in range(PEERS) for r in with_new_master(i)):
        raise SystemExit("failover: a peer still hosts a master beside the one started by hand")
    nexts = [with_new_master(i)[0]["t"] - listening_at for i in range(PEERS)]
    return nexts, nexts


def check(run: Run) -> None:
    """The run went on as if the master had never died (see the module docstring)."""
    weights: dict[int, str] = {}
    for index, reports in enumerate(run.reports):
        steps = [r for r in reports if r["event"] == "step"]
        revisions = [r["rev"] for r in steps]
        if revisions != list(range(revisions[0], revisions[0] + len(revisions))):
            raise SystemExit(f"failover: peer {index} skipped a revision: {revisions}")
        for report in steps:
            if report["wrong"] is not None:
                raise SystemExit(f"failover: peer {index} got a wrong sum: {report}")
            if weights.setdefault(report["rev"], report["weights"]) != report["weights"]:
                raise SystemExit(f"failover: the weights diverged at revision {report['rev']}")
        moved = [r["rx"] for r in reports if r["event"] == "sync" and not r["first"]]
        if any(moved):
            raise SystemExit(f"failover: peer {index} received bytes in a sync: {moved}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, tuple[list[float], list[float]]] = {case: ([], []) for case in args.cases}
    for repeat in range(args.repeats):
        for case, (from_kill, from_back) in results.items():
            since_kill, since_back = await one_case(case, args)
            from_kill.extend(since_kill)
            from_back.extend(since_back)
            since = "the new master listening" if case == "takeover" else "the kill"
            print(f"repeat {repeat + 1} {case:8s} from {since} to each peer's next step: "
                  + ", ".join(f"{r:.3f} s" for r in since_kill), flush=True)
    summary: dict[str, Any] = {"repeats": args.repeats, "restart_delay": args.restart_delay}
    for case, (from_kill, from_back) in results.items():
        summary[case] = {
            "median_s": statistics.median(from_kill), "max_s": max(from_kill),
            "median_after_listening_s": statistics.median(from_back), "samples": from_kill,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--restart-delay", type=float, default=2.0)
    parser.add_argument("--steps-before", type=int, default=20)
    parser.add_argument("--steps-after", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--peer-logs", metavar="DIR",
                        help="write each peer process's log (INFO) into DIR")
    parser.add_argument("--cases", default="restart,standby",
                        type=lambda text: [case for case in text.split(",") if case],
                        help="comma-separated, of restart, standby, elect and takeover")
    args = parser.parse_args(argv)
    unknown = set(args.cases) - {"restart", "standby", "elect", "takeover"}
    if unknown or not args.cases:
        parser.error(f"--cases: unknown {sorted(unknown)}" if unknown else "--cases: none given")
    summary = trio.run(main_async, args)
    if "restart" in summary:
        restart = summary["restart"]
        print(f"restart: median {restart['median_s']:.3f} s from the kill to each peer's next "
              f"step ({restart['median_after_listening_s']:.3f} s after the new master "
              f"listened), max {restart['max_s']:.3f} s")
    for case in ("standby", "elect", "takeover"):
        if case in summary:
            print(f"{case}: median {summary[case]['median_s']:.3f} s, max "
                  f"{summary[case]['max_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
