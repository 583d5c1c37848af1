"""Command line: ``pccl-trio master ...`` (and ``python -m pccl_trio.master ...``),
``pccl-trio identity PATH`` and ``pccl-trio bench ...``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import trio

from ._bench import parse_size
from ._config import SECRET_ENVIRONMENT, Config, read_run_secret
from ._core.messages import PROTOCOL_VERSION
from ._identity import IdentityError, load_allowlist, load_identity, public_hex
from ._logging import FORMATS, configure
from .master import serve_master
from .transport import (
    TcpNetwork,
    advertise_master,
    check_advertise,
    format_address,
    listen_host,
    listener_address,
    parse_address,
)

__all__ = ["main", "master_main"]

DEFAULT_LISTEN = "0.0.0.0:48148"


def _master_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run the master of a pccl_trio run."
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_LISTEN}; port 0 picks a free port)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["TRACE", "DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"],
        type=str.upper,
        help="log verbosity on stderr (default INFO)",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks a free "
        "port); needs pip install 'pccl_trio[observability]'. They are not authenticated: "
        "bind them where only your scraper reaches",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text lines, or one JSON object per line with each run event's kind and "
        "fields (for log collectors); default text",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the run secret shared with every peer (default: "
        f"${SECRET_ENVIRONMENT}); with one, every connection is authenticated",
    )
    parser.add_argument(
        "--identity",
        metavar="PATH",
        help="this master's node key file (created on first use): every handshake proves "
        "it, and peers with Config(master_identities=...) check it; needs a run secret",
    )
    parser.add_argument(
        "--allow-identities",
        metavar="FILE",
        help="admit only peers proving one of the node identities listed in FILE (one "
        "public key per line, as `pccl-trio identity` prints it); needs a run secret",
    )
    parser.add_argument(
        "--content-digest",
        action="store_true",
        help="have peers vote a BLAKE2b-256 digest of their shared state beside the "
        "simplehash, and compare content by both: a forged simplehash collision no longer "
        "passes a sync; costs one BLAKE2b pass per compared tensor per sync (~1 GB/s per "
        "core)",
    )
    parser.add_argument(
        "--advertise",
        metavar="RUN",
        help="announce this master on the local network over mDNS/DNS-SD as the master of "
        "the run named RUN (at most 63 bytes), so that peers find it with "
        "Communicator(discover=RUN); needs a run secret (or --insecure) and "
        "pip install 'pccl_trio[discovery]'",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="without a run secret, listen on other interfaces than loopback anyway "
        "(anyone who reaches the port can join the run)",
    )
    defaults = Config()
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=defaults.heartbeat_interval,
        metavar="SECONDS",
        help=f"heartbeat period on quiet links (default {defaults.heartbeat_interval})",
    )
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        default=defaults.liveness_timeout,
        metavar="SECONDS",
        help="a peer silent this long is removed from the run "
        f"(default {defaults.liveness_timeout})",
    )
    parser.add_argument(
        "--topology-solve-seconds",
        type=float,
        default=defaults.topology_solve_seconds,
        metavar="SECONDS",
        help="time for optimize_topology's first ring search "
        f"(default {defaults.topology_solve_seconds})",
    )
    parser.add_argument(
        "--topology-search-seconds",
        type=float,
        default=defaults.topology_search_seconds,
        metavar="SECONDS",
        help="time for the background search after a ring not provably optimal; 0: none "
        f"(default {defaults.topology_search_seconds})",
    )
    parser.add_argument(
        "--topology-reference-size",
        type=parse_size,
        default=defaults.topology_reference_bytes,
        metavar="BYTES",
        help="all-reduce size rings are optimized for, K/M/G suffixes allowed "
        f"(default {defaults.topology_reference_bytes >> 20}M)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=defaults.stall_timeout,
        metavar="SECONDS",
        help="a collective call some peers have not joined this long is failed for the "
        "peers waiting in it, naming the others; inf: wait forever "
        f"(default {defaults.stall_timeout:g})",
    )
    parser.add_argument(
        "--stall-warning",
        type=float,
        default=defaults.stall_warning,
        metavar="SECONDS",
        help="log who a call waits for after this long, then after 2x, 4x, ... "
        f"(default {defaults.stall_warning:g})",
    )
    return parser


class _AdvertiseFailed(Exception):
    """The master could not be advertised (the message says why)."""


async def _run_master(
    host: str, port: int, config: Config, advertise: str | None,
    metrics: tuple[str, int] | None = None,
) -> None:
    # Bind before anything else so "address in use" surfaces as a plain OSError.
    listener = await TcpNetwork().listen(host, port)
    bound_host, bound_port = listener_address(listener)

    def metrics_started(address: tuple[str, int]) -> None:
        print(f"pccl-trio master metrics on http://{format_address(*address)}/metrics", flush=True)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                serve_master, [listener], config=config, metrics=metrics,
                metrics_started=metrics_started,
            ))
            print(f"pccl-trio master listening on {format_address(bound_host, bound_port)}",
                  flush=True)
            failure = await _advertise_until_signal(advertise, host, bound_port, config, signals)
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise _AdvertiseFailed(failure)


async def _advertise_until_signal(
    advertise: str | None, host: str, port: int, config: Config, signals: AsyncIterator[int]
) -> str | None:
    """Advertise the master (if asked) until SIGINT or SIGTERM, then withdraw the
    advertisement; what went wrong if it could not be made, without waiting."""
    async with contextlib.AsyncExitStack() as stack:
        if advertise is not None:
            try:
                advert = await stack.enter_async_context(advertise_master(
                    advertise, host, port, secret=config.secret, insecure=config.insecure,
                ))
            except ValueError as exc:
                return str(exc)
            except OSError as exc:
                return f"cannot advertise run {advertise!r}: {exc}"
            print(f"pccl-trio master advertising run {advertise!r} as {advert.instance}", flush=True)
        async for signum in signals:
            logging.getLogger("pccl_trio.master").info(
                "received %s, closing every connection", signal.Signals(signum).name
            )
            break
    return None


def master_main(argv: Sequence[str] | None = None, prog: str = "pccl-trio master") -> int:
    parser = _master_parser(prog)
    args = parser.parse_args(argv)
    try:
        host, port = parse_address(args.listen)
        metrics = None if args.metrics is None else parse_address(args.metrics)
        config = Config(
            heartbeat_interval=args.heartbeat_interval,
            liveness_timeout=args.liveness_timeout,
            topology_solve_seconds=args.topology_solve_seconds,
            topology_search_seconds=args.topology_search_seconds,
            topology_reference_bytes=args.topology_reference_size,
            run_secret=read_run_secret(args.secret_file),
            insecure=args.insecure,
            content_digest=args.content_digest,
            stall_timeout=args.stall_timeout,
            stall_warning=args.stall_warning,
            allowed_identities=(
                None if args.allow_identities is None else load_allowlist(args.allow_identities)
            ),
            identity=args.identity,
        )
        if config.identity is not None:
            load_identity(config.identity)  # a clear error now, not from the event loop
    except ValueError as exc:
        parser.error(str(exc))
    if config.identity is not None and config.secret is None:
        parser.error(
            f"--identity needs a run secret (--secret-file or ${SECRET_ENVIRONMENT}): "
            "identities are proven in the run-secret handshake"
        )
    if config.allowed_identities is not None and config.secret is None:
        parser.error(
            f"--allow-identities needs a run secret (--secret-file or ${SECRET_ENVIRONMENT}): "
            "identities are proven in the run-secret handshake"
        )
    if args.advertise is not None:
        try:
            check_advertise(
                args.advertise, host, secured=config.secret is not None, insecure=config.insecure
            )
        except ValueError as exc:
            parser.error(str(exc))
    level = {"TRACE": "DEBUG", "WARN": "WARNING"}.get(args.log_level, args.log_level)
    configure(level, args.log_format)
    try:
        host = listen_host(
            host, secured=config.secret is not None, insecure=config.insecure, who="the master"
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        trio.run(_run_master, host, port, config, args.advertise, metrics)
    except _AdvertiseFailed as exc:
        print(f"pccl-trio master: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pccl-trio master: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    return 0


def identity_main(argv: Sequence[str] | None = None, prog: str = "pccl-trio identity") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print this node's public identity key (creating the key file, mode "
        "0600, on first use): the line to add to a master's --allow-identities file.",
    )
    parser.add_argument("path", metavar="PATH", help="the key file (Config(identity=PATH))")
    args = parser.parse_args(argv)
    try:
        key = load_identity(args.path)
    except (IdentityError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(public_hex(key))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ._bench import bench_main
    from ._status import status_main

    commands = {"master": master_main, "identity": identity_main, "bench": bench_main,
                "status": status_main}
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"pccl-trio {__version__} (protocol {PROTOCOL_VERSION})")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: pccl-trio {master,status,identity,bench} [options]\n"
              "       pccl-trio --version\n\n"
              "commands:\n  master   run the master of a run (see pccl-trio master --help)\n"
              "  status   show a running master's view of its run (see pccl-trio status --help)\n"
              "  identity print this node's public identity key, creating the key file\n"
              "  bench    all-reduce benchmark with local peers (see pccl-trio bench --help)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:], prog=f"pccl-trio {argv[0]}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
