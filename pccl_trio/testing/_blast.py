"""Plain TCP over the WAN emulator: the ceiling every benchmark compares itself to.

Theory of operation
-------------------
``measure`` starts, for every ``(sender, receiver)`` pair, a *sink* on the receiver's
host and a *source* on the sender's, both processes of this module inside the hosts'
namespaces. The source opens ``streams`` TCP connections to the sink and writes as
fast as the kernel takes the bytes, for ``warmup + seconds``; the sink counts what
arrives and reports the rate of the last ``seconds`` only, once slow start is over,
as one JSON line. Every pair runs at once, so a ring pattern (each host sending to
its successor) loads every upload and every download together, as a ring all-reduce
does. The sockets keep the kernel's defaults (autotuned buffers): what any program
gets.

Run as ``python path/to/_blast.py sink PORT STREAMS SECONDS WARMUP`` or ``...
source HOST PORT STREAMS SECONDS WARMUP`` (it imports nothing of the package).
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._wan import Wan

__all__ = ["measure"]

_PORT = 47999
_CHUNK = 1 << 20


def measure(
    wan: Wan, pairs: Sequence[tuple[int, int]], *, streams: int, seconds: float, warmup: float
) -> list[float]:
    """Bytes per second each pair's receiver took in after the warm-up (see the module
    docstring)."""
    args = [str(streams), str(seconds), str(warmup)]
    sinks = []
    for index, (_sender, receiver) in enumerate(pairs):
        sink = wan.start(receiver, sys.executable, __file__, "sink",
                         str(_PORT + index), *args, stdout=_PIPE)
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != b"listening":
            raise RuntimeError("a sink of the TCP ceiling did not start")
        sinks.append(sink)
    sources = [
        wan.start(sender, sys.executable, __file__, "source", wan.address(receiver),
                  str(_PORT + index), *args)
        for index, (sender, receiver) in enumerate(pairs)
    ]
    rates = []
    for sink in sinks:
        out, _ = sink.communicate(timeout=warmup + seconds + 60)
        rates.append(float(json.loads(out)["rate"]))
        assert sink.stdout is not None
        sink.stdout.close()
    for source in sources:
        source.wait(timeout=30)
    return rates


_PIPE = -1  # subprocess.PIPE, without importing subprocess in the workers


def _sink(port: int, streams: int, seconds: float, warmup: float) -> None:
    listener = socket.create_server(("0.0.0.0", port), backlog=streams)
    print("listening", flush=True)
    selector = selectors.DefaultSelector()
    for _ in range(streams):
        connection, _address = listener.accept()
        connection.setblocking(False)
        selector.register(connection, selectors.EVENT_READ, connection)
    buffer = bytearray(_CHUNK)
    start = time.monotonic()
    counted_from, until = start + warmup, start + warmup + seconds
    counted = 0
    open_streams = streams
    while open_streams and time.monotonic() < until:
        for key, _events in selector.select(timeout=0.1):
            connection = key.data
            try:
                received = connection.recv_into(buffer)
            except BlockingIOError:
                continue
            if not received:
                selector.unregister(connection)
                open_streams -= 1
                continue
            if time.monotonic() >= counted_from:
                counted += received
    print(json.dumps({"rate": counted / seconds}), flush=True)


def _source(host: str, port: int, streams: int, seconds: float, warmup: float) -> None:
    until = time.monotonic() + warmup + seconds + 1.0
    payload = bytes(_CHUNK)

    def send() -> None:
        with socket.create_connection((host, port)) as connection:
            try:
                while time.monotonic() < until:
                    connection.sendall(payload)
            except OSError:
                return  # the sink finished counting and closed

    threads = [threading.Thread(target=send) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: Sequence[str]) -> int:
    role, *rest = argv
    if role == "sink":
        port, streams, seconds, warmup = rest
        _sink(int(port), int(streams), float(seconds), float(warmup))
    else:
        host, port, streams, seconds, warmup = rest
        _source(host, int(port), int(streams), float(seconds), float(warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
