"""A run outlives its master: peers get a restarted master, or a standby, back.

On the in-memory network (virtual time) and over loopback TCP. Three peers train: every
step all-reduces (retried when aborted) and syncs the shared state, whose revision
each step advances. The master is killed mid-run (its task cancelled: every
connection closes at once, as when its process dies); peers must not fail: a new
master comes up at the same address ``RESTART_DELAY`` later, or a standby that was up
all along takes over. Afterwards the revisions go on without a gap, no sync moves a byte (the
peers never diverged) and the weights end bit-identical.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio._core.identity import public_bytes
from pccl_trio._core.messages import (
    Message,
    PeerEndpoint,
    SharedStateVote,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
)
from pccl_trio._identity import load_identity
from pccl_trio.peer._seam import Vote
from pccl_trio.testing import PeerSeam

from .conftest import (
    FINE,
    Masters,
    Progress,
    check_run,
    form_run,
    run_all,
    started,
    train,
)

#: Seconds without a master before it is restarted. A killed master's connections close
#: at once, so the peers are without it from the start, and try to get it back (every
#: heartbeat interval) meanwhile.
RESTART_DELAY = 0.5


#: Its runs bring their own secrets (or none): the two networks only (``conftest``).
NETWORKS = ("memory", "tcp", "sync")


async def kill_once_stepped(progress: Progress, scope: trio.CancelScope) -> None:
    await progress.stepped.wait()
    scope.cancel()


async def train_through_a_restart(
    masters: Masters, comms: list[pccl.Communicator], scope: trio.CancelScope, port: int
) -> None:
    """``comms`` train while their master is killed mid-run and restarted at ``port``
    ``RESTART_DELAY`` later; the run goes on as if nothing happened and every peer comes back as itself."""
    ids = [c.peer_id for c in comms]
    progress = Progress.of(len(comms))

    async def restart() -> None:
        await kill_once_stepped(progress, scope)
        await trio.sleep(RESTART_DELAY)
        await masters.start("master", port=port)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(restart)
        states = await train(comms, progress)
    check_run(states, progress)
    assert [c.peer_id for c in comms] == ids  # every peer came back as itself
    for comm in comms:
        await comm.aclose()


async def test_a_master_restarted_at_the_same_address_takes_the_run_back(
    masters: Masters, clock: object
) -> None:
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        await train_through_a_restart(masters, comms, scope, port)


async def test_a_standby_master_takes_the_run_over(masters: Masters, clock: object) -> None:
    with trio.fail_after(120):
        first, scope = await masters.start("master")
        standby, _ = await masters.start("standby")
        address = f"{first},{standby}"
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        progress = Progress.of(3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_once_stepped, progress, scope)
            states = await train(comms, progress)
        check_run(states, progress)
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize(("grace", "error"), [
    (1.0, "no master took this peer back"),  # nobody restarts the master within the grace
    (0.0, "cannot go on without its master"),  # no grace: the loss ends the communicator
])
async def test_without_a_master_calls_fail_after_the_grace(
    masters: Masters, clock: object, grace: float, error: str
) -> None:
    masters.config = dataclasses.replace(masters.config, master_grace=grace)
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(2)])
        scope.cancel()
        with pytest.raises(pccl.MasterConnectionError, match=error):
            await comms[0].update_topology()
        for comm in comms:
            await comm.aclose()


def kill_when_all_voted(
    comms: list[pccl.Communicator], kind: type[Message], scope: trio.CancelScope,
    killed: trio.Event,
) -> None:
    """Kill the master (``scope``) as the last peer of ``comms`` is about to send it a
    ``kind`` vote: every peer is in the call, and the master cannot have decided it."""
    voted = [0]
    for comm in comms:
        seam = PeerSeam(comm)
        original = seam.vote

        async def vote(message: Message, original: Vote = original) -> int:
            if isinstance(message, kind) and not killed.is_set():
                voted[0] += 1
                if voted[0] == len(comms):
                    scope.cancel()
                    killed.set()
                    await trio.lowlevel.checkpoint()  # let the master die first
            return await original(message)

        seam.vote = vote


async def restart_when(killed: trio.Event, masters: Masters, port: int) -> None:
    await killed.wait()
    await trio.sleep(RESTART_DELAY)
    await masters.start("master", port=port)


async def synced_run(
    masters: Masters, elements: int
) -> tuple[trio.CancelScope, int, list[pccl.Communicator], list[pccl.SharedState]]:
    """Three peers with a master, their shared state synced once and its revision
    advanced: the master's kill scope, its port, the communicators and their states."""
    address, scope = await masters.start("master")
    port = int(address.rsplit(":", 1)[1])
    comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
    states = [
        pccl.SharedState([pccl.TensorInfo("w", np.arange(elements, dtype=np.float32))])
        for _ in comms
    ]
    await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
    for state in states:
        state.revision += 1
    return scope, port, comms, states


def diverged_states() -> tuple[list[np.ndarray], list[pccl.SharedState]]:
    """Three peers' weights and shared states (revision 0): the first two alike
    (``arange``), the third diverged (zeros), so it fetches in a sync."""
    weights = [np.arange(20_000, dtype=np.float32) for _ in range(2)]
    weights.append(np.zeros(20_000, dtype=np.float32))
    return weights, [pccl.SharedState([pccl.TensorInfo("w", w)]) for w in weights]


def watched(comm: pccl.Communicator) -> tuple[PeerSeam, trio.Event]:
    """``comm``'s seam, and an event set once it lost the master."""
    seam, lost = PeerSeam(comm), trio.Event()
    seam.on_master_lost(lost.set)
    return seam, lost


async def all_reduce_then_close(comms: list[pccl.Communicator]) -> None:
    """One all-reduce, exact on every peer (the run goes on), then close every peer."""
    values = [np.full(1000, i + 1.0, np.float32) for i in range(len(comms))]
    await run_all(comms, lambda i, c: c.all_reduce(values[i]))
    expected = np.full(1000, sum(range(1, len(comms) + 1)), np.float32).tobytes()
    assert all(v.tobytes() == expected for v in values)
    for comm in comms:
        await comm.aclose()


@pytest.mark.async_only
@pytest.mark.parametrize("call", ["update_topology", "sync_shared_state", "optimize_topology"])
async def test_a_membership_call_the_master_died_in_completes_once_it_is_back(
    masters: Masters, clock: object, call: str
) -> None:
    """The master dies once every peer voted (a round, a sync, an optimization); the
    call is made again with the new master and completes everywhere, as if nothing
    had happened: the sync moves no byte and advances the revision by one."""
    with trio.fail_after(120):
        scope, port, comms, states = await synced_run(masters, 10_000)
        killed = trio.Event()
        kind = {"update_topology": VoteEstablish, "sync_shared_state": SharedStateVote,
                "optimize_topology": VoteOptimizeTopology}[call]
        kill_when_all_voted(comms, kind, scope, killed)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_when, killed, masters, port)
            if call == "sync_shared_state":
                results = await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
                assert all(isinstance(r, pccl.SharedStateSyncInfo) and r.rx_bytes == 0
                           for r in results), results
                assert all(s.revision == 1 for s in states)
            else:
                results = await run_all(comms, lambda i, c: getattr(c, call)())
                assert results == [None, None, None], results
        assert killed.is_set()
        assert all(c.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 3 for c in comms)
        await all_reduce_then_close(comms)


async def test_an_answer_the_master_sent_before_it_died_still_ends_the_call(
    masters: Masters, clock: object
) -> None:
    """The master answers every peer's ``are_peers_pending`` and dies at once; one peer
    learns of the death before its call took the answer (held here after its vote until
    its master link is lost). It must still return that answer, as the others did:
    asking the next master again would put it a call behind them (the master refuses a
    question while the others wait in ``sync_shared_state``)."""
    with trio.fail_after(120):
        scope, port, comms, states = await synced_run(masters, 1000)
        lost, killed = trio.Event(), trio.Event()
        seam = PeerSeam(comms[0])
        seam.on_master_lost(lost.set)
        original = seam.vote

        async def vote(message: Message) -> int:
            epoch = await original(message)
            if isinstance(message, VotePeersPending):
                await lost.wait()  # the answer came, then the end of the link
            return epoch

        seam.vote = vote

        async def step(i: int, comm: pccl.Communicator) -> bool:
            pending = await comm.are_peers_pending()
            if i == 1 and not killed.is_set():
                killed.set()  # answered, so every peer's answer was written
                scope.cancel()
            await comm.sync_shared_state(states[i])
            return pending

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_when, killed, masters, port)
            results = await run_all(comms, step)
        assert results == [False, False, False], results
        assert lost.is_set()
        assert all(s.revision == 1 for s in states)
        await all_reduce_then_close(comms)


@pytest.mark.async_only
async def test_a_fetch_the_master_died_during_is_not_reported_to_the_next_master(
    masters: Masters, clock: object
) -> None:
    """A peer fetches the shared state (its copy diverged) when the master dies; once
    the fetch ends, its report of it (``SharedStateDone``) belonged to the dead
    master's sync and must not reach the next master, which knows no such sync (it
    would kick the peer for it). The sync is made again once the master is back, and
    completes everywhere."""
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        weights, states = diverged_states()
        killed = trio.Event()
        seam, lost = watched(comms[2])
        fetch_from = seam.fetch_from

        async def fetch_once_the_master_is_gone(
            endpoint: PeerEndpoint, fetcher: Any
        ) -> None:
            if not killed.is_set():
                killed.set()
                scope.cancel()
                await lost.wait()
            await fetch_from(endpoint, fetcher)

        seam.fetch_from = fetch_once_the_master_is_gone
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_when, killed, masters, port)
            results = await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
        assert all(isinstance(r, pccl.SharedStateSyncInfo) for r in results), results
        assert killed.is_set() and lost.is_set()
        assert all(w.tobytes() == np.arange(20_000, dtype=np.float32).tobytes() for w in weights)
        assert all(s.revision == 0 for s in states)
        await all_reduce_then_close(comms)


async def test_a_sync_that_never_completes_leaves_the_fetched_bytes_as_they_were(
    masters: Masters, clock: object
) -> None:
    """The diverged peer's fetch succeeds, then the master that planned the sync dies
    before the peer reports it, and none comes back: the sync never completes. The
    peer's call fails (after the grace) with its shared state as it was, bytes and
    revision, not with the bytes of a sync it never completed."""
    masters.config = dataclasses.replace(masters.config, master_grace=1.0)
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        weights, states = diverged_states()
        fetched = trio.Event()
        seam, lost = watched(comms[2])
        fetch_from = seam.fetch_from

        running = [0]

        async def kill_the_master_once_fetched(endpoint: PeerEndpoint, fetcher: Any) -> None:
            running[0] += 1
            await fetch_from(endpoint, fetcher)
            running[0] -= 1
            if not running[0] and not fetcher.pieces and not fetched.is_set():
                assert not fetcher.failures, fetcher.failures
                fetched.set()
                assert weights[2].any()  # the popular bytes, for now
                scope.cancel()
                await lost.wait()

        seam.fetch_from = kill_the_master_once_fetched
        results = await run_all(comms, lambda i, c: c.sync_shared_state(states[i]))
        assert fetched.is_set()
        assert all(isinstance(r, pccl.MasterConnectionError) for r in results), results
        assert not weights[2].any(), "the fetched bytes of a sync that never completed stayed"
        assert all(s.revision == 0 for s in states)
        for comm in comms:
            await comm.aclose()


async def test_an_all_reduce_the_master_died_in_is_aborted_with_its_input_restored(
    masters: Masters, clock: object
) -> None:
    """The master dies while the peers' all-reduce moves its data: each peer gets
    ``CollectiveAborted`` with its input as it was (no verdict can come), and the retry
    completes with the new master."""
    masters.config = dataclasses.replace(masters.config, slice_bytes=FINE.slice_bytes)
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(3)])
        inputs = [np.arange(200_000, dtype=np.float32) * (i + 1) for i in range(3)]
        buffers = [a.copy() for a in inputs]
        results: list[object] = []
        killed = trio.Event()

        async def reduce() -> None:
            results.extend(await run_all(comms, lambda i, c: c.all_reduce(buffers[i], tag=3)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reduce)
            await started(comms[0], 3)
            scope.cancel()
            killed.set()
            nursery.start_soon(restart_when, killed, masters, port)
        assert all(isinstance(r, pccl.CollectiveAborted) for r in results), results
        assert all(b.tobytes() == a.tobytes() for a, b in zip(inputs, buffers, strict=True))
        results = await run_all(comms, lambda i, c: c.all_reduce(buffers[i], tag=3))
        assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
        assert all(b.tobytes() == sum(inputs).tobytes() for b in buffers)
        for comm in comms:
            await comm.aclose()


@pytest.mark.async_only
async def test_a_joiner_not_admitted_yet_fails_and_the_members_go_on(masters: Masters, clock: object) -> None:
    """A peer still in ``connect()`` has no place to come back to: its ``connect``
    fails with the reason; the members' ``update_topology`` completes without it."""
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [masters.communicator(f"p{i}", address) for i in range(2)])
        joiner = masters.communicator("joiner", address)
        killed = trio.Event()
        kill_when_all_voted(comms, VoteEstablish, scope, killed)
        outcome: list[object] = []

        async def join() -> None:
            try:
                await joiner.connect()
            except pccl.MasterConnectionError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(join)
            while not all(await run_all(comms, lambda i, c: c.are_peers_pending())):
                pass
            nursery.start_soon(restart_when, killed, masters, port)
            results = await run_all(comms, lambda i, c: c.update_topology())
        assert results == [None, None], results
        assert len(outcome) == 1 and "not admitted yet" in str(outcome[0]), outcome
        assert comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 2
        for comm in comms:
            await comm.aclose()


async def test_members_with_node_identities_come_back_to_a_restarted_master(
    masters: Masters, clock: object, tmp_path: Path
) -> None:
    """With a run secret and a node key per peer (and an allowlist at the master), the
    members come back under their ids, proving their keys, and the run goes on."""
    keys = [tmp_path / f"p{i}.key" for i in range(3)]
    allowed = frozenset(public_bytes(load_identity(k)) for k in keys)
    masters.config = dataclasses.replace(
        masters.config, run_secret=b"a run secret of 32 bytes, or so!", allowed_identities=allowed
    )
    with trio.fail_after(120):
        address, scope = await masters.start("master")
        port = int(address.rsplit(":", 1)[1])
        comms = await form_run([], [
            masters.communicator(f"p{i}", address, identity=keys[i]) for i in range(3)
        ])
        await train_through_a_restart(masters, comms, scope, port)
