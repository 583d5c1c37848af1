"""One peer of the soak (``benchmarks/soak.py``): trains a stand-in model forever with
the public API and reports every step, so the driver can check the run from outside.

Theory of operation
-------------------
The shared state is ``weights`` (float32) and ``steps`` (int64, one value), starting at
zeros on every peer. A step is, at the same point on every peer:

1. *Membership*: a joiner's first step, or one where ``are_peers_pending()`` says
   peers wait, runs ``update_topology()`` (not for the joiner, whom the others'
   update just admitted) and then ``optimize_topology()``. Failures that the API calls
   retryable are retried in place.
2. *Sync*: ``sync_shared_state``. A joiner receives the run's weights and revision
   here; for a peer that has synced before it must move nothing (``rx_bytes == 0``),
   which the driver checks.
3. *All-reduce*: every peer contributes ``contribution(peer_id, revision)``, integers
   below 1009 as float32, different per peer, revision and element. Their sum over
   the ring (at most six peers) is exact in float32 whatever the order of additions,
   so the peer recomputes it from ``comm.ring`` (the ring of the attempt that
   succeeded) and compares every element. ``CollectiveAborted`` restores the input:
   the step starts over at its sync, at the same revision (the README's loop), and
   the all-reduce runs again on the survivors.
4. *Update*: ``weights = 0.75 * weights + result / 1024`` in float32 (rounding on
   purpose: only identical inputs and operations give identical bits), ``steps += 1``,
   ``revision += 1``.

Reports are JSON lines on stdout, each with ``t`` (``time.monotonic()``, the same
clock as the driver's on one machine): ``joined``; ``sync`` (revision, bytes, weights
digest after the sync); ``step`` (new revision, world size, ring, digests of the
all-reduce result and of the weights, aborted attempts of this step, and ``wrong``:
the first element whose sum was not the expected one, or null); ``retry`` (a
retryable failure: which call, the message); ``error`` (anything else, after which
the peer exits 3).

``--inject KIND --inject-at N`` breaks this peer on purpose after its N-th step, to show
that the driver's checks catch each kind of fault: ``wrong-sum`` reports a result one
too high, ``divergence`` flips the lowest bit of one weight, ``hang`` stops calling
collectives while staying connected (the others then wait for it forever).

With ``--discover RUN`` instead of MASTER (``-``), the peer finds the run's master by
name (mDNS; the run secret comes from ``$PCCL_TRIO_RUN_SECRET``), and with
``--host-master`` it is a candidate to host it (``host_master=True``); every ``step``
report says whether this peer's process hosts the master (``hosting``), and where
the master it uses is (``master``).

Usage: soak_peer.py MASTER [--elements N] [--step-seconds S] [--no-optimize] [--log-level L]
                           [--inject wrong-sum|divergence|hang --inject-at N]
       soak_peer.py - --discover RUN [--host-master] [...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
import trio

import pccl_trio as pccl

T = TypeVar("T")


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()[:16]


def contribution(peer_id: int, revision: int, elements: int) -> np.ndarray:
    """This peer's all-reduce input at a revision: integers in [0, 1009)."""
    index = np.arange(elements, dtype=np.int64)
    return ((index * 31 + peer_id * 7919 + revision * 104729) % 1009).astype(np.float32)


def first_wrong(result: np.ndarray, ring: tuple[int, ...], revision: int) -> dict[str, object] | None:
    """The first element of ``result`` that is not the sum of the ring's contributions."""
    expected = sum(contribution(p, revision, result.size) for p in ring)
    assert isinstance(expected, np.ndarray)
    bad = np.flatnonzero(result != expected)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return {"index": i, "got": float(result[i]), "expected": float(expected[i]),
            "wrong_elements": int(bad.size)}


async def retrying(call: Callable[[], Awaitable[T]], name: str,
                   retryable: tuple[type[pccl.PCCLError], ...]) -> T:
    """``call()`` until it does not raise one of ``retryable`` (reported as ``retry``)."""
    while True:
        try:
            return await call()
        except retryable as exc:
            emit("retry", call=name, kind=type(exc).__name__, message=str(exc)[:300])


async def train(master: str, elements: int, step_seconds: float, optimize: bool,
                inject: str | None, inject_at: int, identity: str | None = None,
                discover: str | None = None, host_master: bool = False) -> None:
    weights = np.zeros(elements, dtype=np.float32)
    steps = np.zeros(1, dtype=np.int64)
    state = pccl.SharedState([pccl.TensorInfo("weights", weights), pccl.TensorInfo("steps", steps)])
    # The master's timers replace these once registered; they only bound the joining.
    config = pccl.Config(liveness_timeout=3.0, heartbeat_interval=0.25, identity=identity)
    if discover is None:
        comm = pccl.Communicator(master, 0, config=config, p2p_host="127.0.0.1")
    else:
        comm = pccl.Communicator(discover=discover, host_master=host_master, config=config)
    async with comm:
        me = comm.peer_id
        assert me is not None
        emit("joined", peer=me)
        just_joined = True
        synced_before = False
        resync = False  # an all-reduce aborted: the step starts over at its sync
        aborts = 0
        while True:
            if not resync:
                if just_joined or await comm.are_peers_pending():
                    if not just_joined:
                        await retrying(comm.update_topology, "update_topology",
                                       (pccl.UpdateTopologyFailed,))
                    if optimize:
                        await retrying(comm.optimize_topology, "optimize_topology",
                                       (pccl.TopologyOptimizationFailed,))
                just_joined = False
                if comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < 2:
                    await trio.sleep(step_seconds)  # alone: wait for company
                    continue
            resync = False
            synced = await retrying(lambda: comm.sync_shared_state(state), "sync_shared_state",
                                    (pccl.SharedStateSyncFailed,))
            emit("sync", peer=me, rev=state.revision, rx=synced.rx_bytes, tx=synced.tx_bytes,
                 first=not synced_before, weights=digest(weights))
            synced_before = True

            revision = state.revision
            data = contribution(me, revision, elements)
            try:
                info = await comm.all_reduce(data)
            except pccl.CollectiveAborted as exc:
                # Aborted for every peer (one died, or one's sync failed and it syncs
                # again): every peer starts the step over at its sync, at this revision.
                aborts += 1
                emit("retry", call="all_reduce", kind="CollectiveAborted", message=str(exc)[:300])
                resync = True
                continue
            injecting = inject is not None and int(steps[0]) == inject_at
            if injecting and inject == "wrong-sum":
                data[0] += 1
            ring = comm.ring
            wrong = first_wrong(data, ring, revision)
            if info.world_size != len(ring):
                wrong = {"world_size": info.world_size, "ring": list(ring)}
            weights *= np.float32(0.75)
            weights += data * np.float32(1 / 1024)
            steps += 1
            state.revision += 1
            if injecting and inject == "divergence":
                weights.view(np.uint32)[0] ^= 1
            emit("step", peer=me, rev=state.revision, world=info.world_size, ring=list(ring),
                 result=digest(data), weights=digest(weights), aborts=aborts, wrong=wrong,
                 hosting=comm.hosting_master, master=comm.master_address)
            aborts = 0
            if injecting and inject == "hang":
                await trio.sleep_forever()
            await trio.sleep(step_seconds)  # stands in for computing gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("master", help="HOST:PORT of the master ('-' with --discover)")
    parser.add_argument("--elements", type=int, default=1 << 16)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--no-optimize", dest="optimize", action="store_false")
    parser.add_argument("--inject", choices=["wrong-sum", "divergence", "hang"])
    parser.add_argument("--inject-at", type=int, default=20)
    parser.add_argument("--identity", metavar="PATH", help="this node's identity key file")
    parser.add_argument("--discover", metavar="RUN", help="find the master of RUN by name")
    parser.add_argument("--host-master", action="store_true",
                        help="with --discover: a candidate to host the master")
    parser.add_argument("--log-level", default="WARNING",
                        help="what the library logs to stderr (e.g. INFO)")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        trio.run(train, args.master, args.elements, args.step_seconds, args.optimize,
                 args.inject, args.inject_at, args.identity, args.discover, args.host_master)
    except pccl.PCCLError as exc:
        emit("error", kind=type(exc).__name__, message=str(exc)[:1000])
        sys.exit(3)


if __name__ == "__main__":
    main()
