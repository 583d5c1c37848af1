"""One side of a link measurement between two network namespaces: ``server HOST`` answers
one benchmark connection on port 9911; ``client HOST`` measures the link from the server
to itself and prints the result as one JSON line. Uses the library's own protocol and
blocking-socket driver, without a master."""

from __future__ import annotations

import json
import sys

import trio

from pccl_trio._core.bandwidth import MEASUREMENT_BYTES
from pccl_trio._core.messages import BenchmarkRequest
from pccl_trio.peer import _bandwidth as bandwidth
from pccl_trio.peer._protocol import run_protocol
from pccl_trio.transport import FramedStream, SocketLink, TcpNetwork

PORT = 9911
LIMITS = {"max_control_frame": 1 << 20, "max_data_frame": (64 << 20) + 64}


async def server(host: str) -> None:
    listener = await TcpNetwork().listen(host, PORT)
    print("ready", flush=True)
    framed = FramedStream(await listener.accept(), **LIMITS)
    request = await framed.receive_message_exact()
    assert isinstance(request, BenchmarkRequest)
    link = SocketLink.detach(framed, max_data_frame=LIMITS["max_data_frame"])
    assert link is not None
    try:
        await run_protocol(
            bandwidth.serve_benchmark(request, budget=MEASUREMENT_BYTES), link, idle_timeout=10.0
        )
    except trio.BrokenResourceError:
        pass  # the client is done
    finally:
        link.cut()


async def client(host: str) -> None:
    framed = FramedStream(await TcpNetwork().connect(host, PORT), **LIMITS)
    link = SocketLink.detach(framed, max_data_frame=LIMITS["max_data_frame"])
    assert link is not None
    try:
        result = await run_protocol(
            bandwidth.measure_link(peer_id=1, frame_bytes=64 << 20, budget_bytes=MEASUREMENT_BYTES),
            link, idle_timeout=10.0,
        )
    finally:
        link.cut()
    print(json.dumps({"bandwidth": result.bandwidth, "latency": result.latency,
                      "nbytes": result.nbytes, "seconds": result.seconds}), flush=True)


if __name__ == "__main__":
    role, address = sys.argv[1], sys.argv[2]
    trio.run(server if role == "server" else client, address)
