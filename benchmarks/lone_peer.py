"""What a peer alone in the run costs its master while it waits for company.

Usage: python benchmarks/lone_peer.py [--seconds 3] [--repeats 3]

A master and one peer over loopback TCP, in this process. The peer waits for
``--seconds`` two ways, alternated in one sitting: *polling* (``are_peers_pending()`` in
a loop, as a loop that ``continue``s straight back to it does) and *waiting* (one
``are_peers_pending(wait=seconds)``, which the master holds until a peer asks to join or
the wait runs out). Reports the median number of questions per second the master
received each way (heartbeats are counted apart: both ways send them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import trio

import pccl_trio as pccl
from pccl_trio._core import master as master_core
from pccl_trio._core.events import MessageReceived


def count_messages() -> Counter[str]:
    """Count what the master receives, by message type, from now on."""
    counts: Counter[str] = Counter()
    handle = master_core.MasterCore.handle

    def counting(core: master_core.MasterCore, event: Any, now: float) -> Any:
        if isinstance(event, MessageReceived):
            counts[type(event.message).__name__] += 1
        return handle(core, event, now)

    master_core.MasterCore.handle = counting  # type: ignore[method-assign]
    return counts


async def one(mode: str, seconds: float, counts: Counter[str]) -> tuple[float, int]:
    """Questions per second and heartbeats of one wait of ``seconds``."""
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(pccl.serve_master_tcp, 0, "127.0.0.1")
        async with pccl.Communicator(f"{host}:{port}", p2p_host="127.0.0.1") as comm:
            counts.clear()
            start = time.monotonic()
            if mode == "polling":
                while time.monotonic() - start < seconds:
                    await comm.are_peers_pending()
            else:
                await comm.are_peers_pending(wait=seconds)
            elapsed = time.monotonic() - start
        nursery.cancel_scope.cancel()
    return counts["VotePeersPending"] / elapsed, counts["Heartbeat"]


async def main(seconds: float, repeats: int) -> None:
    counts = count_messages()
    rates: dict[str, list[float]] = {"polling": [], "waiting": []}
    beats: dict[str, list[int]] = {"polling": [], "waiting": []}
    for _ in range(repeats):
        for mode in rates:
            rate, heartbeats = await one(mode, seconds, counts)
            rates[mode].append(rate)
            beats[mode].append(heartbeats)
    for mode in rates:
        print(f"{mode}: median {statistics.median(rates[mode]):.1f} questions/s over "
              f"{seconds:g} s ({repeats} runs); heartbeats {beats[mode]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.seconds, args.repeats)
