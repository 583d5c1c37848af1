"""``pccl-trio status HOST:PORT``: ask a master how its run is going, and show it.

Theory of operation
-------------------
``fetch_status`` connects to the master as an observer: the run-secret handshake when
the run has a secret (the observer's credential is built from a ``Config``, as a
peer's is), then one ``StatusRequest``; the master answers with one ``StatusReply``
and closes. The observer is never a member: it changes nothing in the run.

``render`` turns a reply into text: the run's counters, every peer group with its
ring and predicted all-reduce time, the peers with their state and how long the master
has not heard from them, the votes waiting and who they wait for, and the last kicks.
``--json`` prints the reply as one JSON object instead (the field names of
``_core.status``); ``--watch`` asks again every ``--interval`` seconds and redraws a
live view (``rich``, from the ``observability`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import trio

from ._bench import format_size
from ._config import SECRET_ENVIRONMENT, Config, read_run_secret
from ._core.channel import HandshakeFailed, Purpose
from ._core.errors import RemoteProtocolError
from ._core.messages import Kick, StatusReply, StatusRequest, body_limits
from ._core.status import RunCount
from ._core.wire import Admission
from ._errors import MasterConnectionError
from ._identity import IdentityError
from .transport import Credential, FramedStream, TcpNetwork, format_address, parse_address, secure_client

__all__ = ["fetch_status", "render", "status_main"]


async def fetch_status(host: str, port: int, config: Config | None = None) -> StatusReply:
    """The run as the master at ``host:port`` sees it.

    Raises:
        MasterConnectionError: nobody answers there, the handshake failed (another
            secret, or none), or the master refused or did not answer.
    """
    config = config or Config()
    where = format_address(host, port)
    credential = Credential.of(config)
    try:
        with trio.fail_after(config.connect_timeout):
            stream = await TcpNetwork().connect(host, port)
    except (OSError, trio.TooSlowError) as exc:
        raise MasterConnectionError(f"could not reach a master at {where} ({exc or 'timed out'})") from exc
    async with stream:
        channel = None
        if credential is not None:
            try:
                channel = await secure_client(stream, credential, Purpose.MASTER)
            except (HandshakeFailed, trio.TooSlowError, trio.BrokenResourceError,
                    trio.ClosedResourceError) as exc:
                raise MasterConnectionError(
                    f"the master at {where} did not complete the run-secret handshake "
                    f"({exc or 'timed out'}): it runs with another secret or with none"
                ) from exc
        limit = config.max_control_frame
        framed = FramedStream(
            stream, max_control_frame=limit,
            admission=Admission(body_limits([StatusReply, Kick], limit)), channel=channel,
        )
        try:
            with trio.fail_after(config.connect_timeout):
                await framed.send_message(StatusRequest())
                reply = await framed.receive_message()
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            what = (
                f"no answer within {config.connect_timeout:g}s"
                if isinstance(exc, trio.TooSlowError) else str(exc) or "the connection was closed"
            )
            hint = "" if credential is not None else (
                "; a master that has a run secret closes connections that do not start "
                f"with it: give it with --secret-file PATH or ${SECRET_ENVIRONMENT}"
            )
            raise MasterConnectionError(
                f"the master at {where} did not answer a status request ({what}){hint}"
            ) from exc
        except RemoteProtocolError as exc:
            raise MasterConnectionError(f"the master at {where} sent a bad status reply ({exc})") from exc
    if isinstance(reply, Kick):
        raise MasterConnectionError(f"the master at {where} refused: {reply.reason}")
    if not isinstance(reply, StatusReply):
        raise MasterConnectionError(f"the master at {where} answered {type(reply).__name__}")
    return reply


def as_json(reply: StatusReply) -> dict[str, Any]:
    """The reply as plain JSON-ready data (its field names)."""
    return dataclasses.asdict(reply)


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _count(counts: Sequence[RunCount], event: str, label: str | None = None) -> int:
    return sum(c.count for c in counts if c.event == event and (label is None or c.label == label))


def _total(counts: Sequence[RunCount], event: str) -> int:
    return sum(c.total for c in counts if c.event == event)


def render(reply: StatusReply, address: str) -> str:
    """A screen of text about the run (see the module docstring), without control
    characters but its line breaks (hosts and reasons come from peers: they must not
    drive the terminal)."""
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in _render(reply, address))


def _render(reply: StatusReply, address: str) -> str:
    c = reply.counts
    lines = [
        f"pccl_trio run at {address}: up {_duration(reply.uptime_seconds)}, "
        f"{reply.peers_total} peers in {len(reply.groups)} groups",
        f"collectives: {_count(c, 'completed', 'success')} succeeded through the master, "
        f"{_count(c, 'aborted')} attempts aborted, {_count(c, 'completed', 'aborted')} "
        f"ended aborted, {_count(c, 'completed', 'rejected')} rejected, "
        f"{_count(c, 'completed', 'blocked')} blocked",
        f"leases: {_count(c, 'leased')} granted, {_count(c, 'lease_ended')} ended, "
        f"{_total(c, 'lease_ended')} all-reduces succeeded under them (a lease lets a "
        "group repeat a tag's all-reduce without the master; counted when it ends)",
        f"peers: {_count(c, 'joined')} joined, {_count(c, 'returned')} came back, "
        f"{_count(c, 'left')} left ({_count(c, 'kicked')} kicked); syncs: "
        f"{_count(c, 'synced')} ({_count(c, 'sync_failed')} failed fetches); "
        f"optimizations: {_count(c, 'optimizing')}",
        "",
        f"{'group':>5}  {'world':>5}  {'ring':<30} {'predicted':>10}  {'revision':>8}  state",
    ]
    for g in reply.groups:
        ring = " ".join(map(str, g.ring))
        predicted = (
            f"{_duration(g.predicted_seconds)}" if g.predicted_seconds >= 0 else "unmeasured"
        )
        lines.append(
            f"{g.group:>5}  {g.world:>5}  {ring[:30]:<30} {predicted:>10}  "
            f"{g.revision if g.has_revision else '-':>8}  "
            f"{'ring must be re-established' if g.stale else 'ready'}"
        )
    if any(g.predicted_seconds >= 0 for g in reply.groups):
        lines.append(
            f"(predicted: one all-reduce of {format_size(reply.reference_bytes)} on the ring, from "
            "its measured links)"
        )
    lines += ["", f"{'peer':>6}  {'group':>5}  {'address':<22} {'phase':<11} {'state':<16} silent"]
    for p in reply.peers:
        lines.append(
            f"{p.peer_id:>6}  {p.group:>5}  {format_address(p.host, p.port):<22} "
            f"{p.phase:<11} {p.state:<16} {_duration(p.silent_seconds)}"
        )
    if reply.peers_total > len(reply.peers):
        lines.append(f"... and {reply.peers_total - len(reply.peers)} more peers")
    if reply.truncated:
        lines.append("(the master cut some lists to fit its reply)")
    if reply.waiting:
        lines += ["", "waiting:"]
        lines += [
            f"  {w.call} of {w.where}, {_duration(w.seconds)}, for peers "
            f"{', '.join(map(str, w.missing)) or 'none'}"
            for w in reply.waiting
        ]
    if reply.collectives:
        lines += ["", "collectives running:"]
        lines += [
            f"  {c.call} tag {c.tag} (attempt {c.seq}) of peer group {c.group}, "
            f"{_duration(c.seconds)}, "
            f"not completed by peers {', '.join(map(str, c.incomplete)) or 'none'}"
            for c in reply.collectives
        ]
    if reply.kicks:
        lines += ["", "last kicks:"]
        lines += [
            f"  {_duration(k.seconds_ago)} ago: "
            f"{f'peer {k.peer_id}' if k.peer_id else 'a connection'} ({k.cause}): {k.reason}"
            for k in reply.kicks
        ]
    return "\n".join(lines)


async def _watch(host: str, port: int, config: Config, interval: float) -> None:
    address = format_address(host, port)

    async def view() -> str:
        try:
            return render(await fetch_status(host, port, config), address)
        except MasterConnectionError as exc:
            return f"{address}: {exc}"

    if not sys.stdout.isatty():
        # Redirected: a redrawn screen would show only at the end; print each view.
        while True:
            print(f"{await view()}\n", flush=True)
            await trio.sleep(interval)
    try:
        from rich.live import Live
        from rich.text import Text
    except ImportError as exc:
        raise MasterConnectionError(
            "--watch needs rich: pip install 'pccl_trio[observability]'"
        ) from exc
    with Live(Text("asking the master..."), auto_refresh=False) as live:
        while True:
            live.update(Text(await view()), refresh=True)
            await trio.sleep(interval)


def status_main(argv: Sequence[str] | None = None, prog: str = "pccl-trio status") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show a running master's view of its run: peers, groups and rings, "
        "waiting votes, last kicks, counters. Changes nothing in the run.",
    )
    parser.add_argument("address", metavar="HOST:PORT", help="the master's address")
    parser.add_argument(
        "--secret-file", metavar="PATH",
        help=f"file holding the run secret (default: ${SECRET_ENVIRONMENT})",
    )
    parser.add_argument("--identity", metavar="PATH",
                        help="node key file to prove, for masters that admit listed identities")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    try:
        host, port = parse_address(args.address)
        config = Config(run_secret=read_run_secret(args.secret_file), identity=args.identity)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if args.watch:
            trio.run(_watch, host, port, config, args.interval)
            return 0
        reply = trio.run(fetch_status, host, port, config)
    except (MasterConnectionError, IdentityError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # --watch into a reader that stopped reading (| head)
        # What is left in stdout's buffer cannot be written either: point it at
        # /dev/null so that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.json:
        print(json.dumps(as_json(reply)))
    else:
        print(render(reply, format_address(host, port)))
    return 0
