"""A peer process for the process-tier tests: joins, then loops update_topology.

Prints one JSON line to stdout whenever its view of the run changes, so the test can
wait on real events instead of sleeping. Exits 0 on SIGTERM after closing cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import trio

import pccl_trio as pccl


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


#: As long as the liveness timeout of the tests' masters (``conftest.LIVENESS_TIMEOUT``): a
#: peer SIGSTOPped in a round and then kicked waits for its ring connection to time out
#: before its call raises, and the default would make that five seconds.
CONNECT_TIMEOUT = 2.0


async def main(master: str, group: int, pause: float) -> None:
    comm = pccl.Communicator(
        master, group, p2p_host="127.0.0.1", config=pccl.Config(connect_timeout=CONNECT_TIMEOUT)
    )
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            try:
                await comm.connect()
                emit(event="connected", peer=comm.peer_id)
                last = None
                while True:
                    view = [comm.get_attribute(a) for a in pccl.Attribute]
                    if view != last:
                        emit(event="world", peer=comm.peer_id, attributes=view,
                             ring=list(comm.ring))
                        last = view
                    await comm.update_topology()
                    await trio.sleep(pause)  # a stand-in for a training step
            except pccl.PCCLError as exc:
                emit(event="error", kind=type(exc).__name__, message=str(exc))
                sys.exit(3)
            finally:
                await comm.aclose()


if __name__ == "__main__":
    # To stderr, which the tests keep and print when they fail.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.05)
    args = parser.parse_args()
    trio.run(main, args.master, args.group, args.pause)
