"""One peer of the demo run: join, then take steps, updating the topology each step.

Prints JSON lines on stdout (one per event) for ``examples/demo.py`` to narrate.
Stops cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal

import trio

import pccl_trio as pccl


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def run_peer(master: str, group: int, step_seconds: float) -> None:
    async with pccl.Communicator(master, group, p2p_host="127.0.0.1") as comm:
        emit(event="joined", peer=comm.peer_id, group=group,
             world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE))
        step = 0
        while True:
            # Admit peers that asked to join; drop the ones that died. Every peer of
            # the run calls this at the same point of its loop.
            await comm.update_topology()
            step += 1
            emit(
                event="step",
                peer=comm.peer_id,
                step=step,
                world=comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE),
                group_world=comm.get_attribute(pccl.Attribute.PEER_GROUP_WORLD_SIZE),
                ring=list(comm.ring),
            )
            await trio.sleep(step_seconds)  # stands in for the compute of a training step


async def main(master: str, group: int, step_seconds: float) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop)
            try:
                await run_peer(master, group, step_seconds)
            except pccl.PCCLError as exc:
                emit(event="error", kind=type(exc).__name__, message=str(exc))
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("master", help="HOST:PORT of the master")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    args = parser.parse_args()
    trio.run(main, args.master, args.group, args.step_seconds)
