"""The ceiling of a byte ring on this machine: W local processes, each sending S bytes
to the next and receiving S bytes from the previous one, in 1 MiB pieces, with no
reduction and no protocol. Two ways: trio tasks on non-blocking sockets (pccl_trio's
data path with ``Config(threaded_data_path=False)`` and on the in-memory network) and
one blocking-socket thread per direction (its TCP data path by default).

Usage: python benchmarks/ring_ceiling.py --world 3 --megabytes 88 [--mode trio|threads]

Prints the median time of 5 rings (after one warm-up), as measured by rank 0. A ring
all-reduce of N bytes moves S = 2(W-1)/W x N per peer, so 64 MiB at W=3 is ~88 MiB.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time

PIECE = 1 << 20
ROUNDS = 6


def connect_ring(rank: int, world: int, base: int) -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", base + rank))
    listener.listen()
    while True:
        try:
            out = socket.create_connection(("127.0.0.1", base + (rank + 1) % world))
            break
        except OSError:
            time.sleep(0.05)
    inp, _ = listener.accept()
    listener.close()
    for s in (out, inp):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return out, inp


def run_threads(out: socket.socket, inp: socket.socket, total: int) -> list[float]:
    import numpy as np

    data = np.ones(total, np.uint8)
    scratch = memoryview(np.empty(PIECE, np.uint8))
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()

        def send() -> None:
            for offset in range(0, total, PIECE):
                out.sendall(memoryview(data[offset : offset + PIECE]))

        sender = threading.Thread(target=send)
        sender.start()
        received = 0
        while received < total:
            received += inp.recv_into(scratch, min(PIECE, total - received))
        sender.join()
        times.append(time.perf_counter() - start)
    return times


def run_trio(out: socket.socket, inp: socket.socket, total: int) -> list[float]:
    import numpy as np
    import trio

    async def main() -> list[float]:
        send_stream = trio.SocketStream(trio.socket.from_stdlib_socket(out))
        receive_socket = trio.socket.from_stdlib_socket(inp)
        data = np.ones(total, np.uint8)
        scratch = np.empty(PIECE, np.uint8)
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()

            async def send() -> None:
                for offset in range(0, total, PIECE):
                    await send_stream.send_all(memoryview(data[offset : offset + PIECE]))

            async def receive() -> None:
                received = 0
                while received < total:
                    received += await receive_socket.recv_into(scratch.data, min(PIECE, total - received))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                nursery.start_soon(receive)
            times.append(time.perf_counter() - start)
        return times

    return trio.run(main)


def worker(argv: list[str]) -> None:
    rank, world, base, megabytes, mode = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    out, inp = connect_ring(rank, world, base)
    times = (run_threads if mode == "threads" else run_trio)(out, inp, megabytes << 20)
    if rank == 0:
        print(statistics.median(times[1:]), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=88)
    parser.add_argument("--mode", choices=["trio", "threads", "both"], default="both")
    parser.add_argument("--base-port", type=int, default=47500)
    args = parser.parse_args()
    modes = ["trio", "threads"] if args.mode == "both" else [args.mode]
    for index, mode in enumerate(modes):
        base = args.base_port + index * 16
        procs = [
            subprocess.Popen([sys.executable, __file__, "worker", str(r), str(args.world), str(base),
                              str(args.megabytes), mode], stdout=subprocess.PIPE, text=True)
            for r in range(args.world)
        ]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        seconds = float(next(o for o in outputs if o.strip()))
        print(f"{mode:>8}: W={args.world}, {args.megabytes} MiB per peer each way: "
              f"{seconds * 1e3:.1f} ms median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
