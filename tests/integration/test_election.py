"""Peers elect their run's master among themselves (``host_master=True``).

On the in-memory network (virtual time, its own directory in place of mDNS): three
candidates with no master elect the first in rank order, which hosts the master in its
own process; the run trains; the host dies (its process killed: connections broken,
its advertisements left behind, as in mDNS caches) and the survivors elect again,
come back to the new master as the members they were, and finish with no revision
gap, no byte moved by a sync and identical weights. Two masters elected apart (a
split directory) are resolved to one when the candidates see each other again, and
forged advertisements (a candidacy or a master ranked first that cannot answer as the
run's master) never win.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio._core.discovery import MasterAdvert
from pccl_trio._core.messages import PROTOCOL_VERSION
from pccl_trio.peer._election import WATCH_TIMEOUTS
from pccl_trio.testing import MemoryNetwork, PeerSeam

from .conftest import Progress, all_do, check_run, train

RUN = "home"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def candidate(memory: MemoryNetwork, host: str, rank: str) -> pccl.Communicator:
    comm = pccl.Communicator(discover=RUN, host_master=True, network=memory.host(host))
    PeerSeam(comm).election_rank = rank  # the order of the election, fixed for the test
    return comm


def rank(n: int) -> str:
    return f"{n:064x}"


def hosts(comms: list[pccl.Communicator]) -> list[int]:
    return [i for i, comm in enumerate(comms) if comm.hosting_master]


async def elect_run(
    joiners: list[pccl.Communicator], members: list[pccl.Communicator] | None = None
) -> None:
    """Connect ``joiners`` at once while the run's ``members`` (none: the first joiner
    to get in) admit them as they come."""
    send, receive = trio.open_memory_channel[pccl.Communicator](len(joiners))

    async def join(comm: pccl.Communicator) -> None:
        await comm.connect()
        send.send_nowait(comm)

    async with trio.open_nursery() as nursery:
        for comm in joiners:
            nursery.start_soon(join, comm)
        total = len(members or []) + len(joiners)
        members = list(members or []) or [await receive.receive()]
        while members[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < total:
            if not any(await all_do(members, "are_peers_pending")):
                await trio.sleep(0.5)  # candidates still electing (virtual time)
            before = len(members)
            await all_do(members, "update_topology")
            world = members[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
            for _ in range(world - before):
                members.append(await receive.receive())


async def test_candidates_elect_the_first_in_rank_order(clock: object) -> None:
    memory = MemoryNetwork()
    with trio.fail_after(60):
        comms = [candidate(memory, f"p{i}", rank(r)) for i, r in enumerate([3, 1, 2])]
        await elect_run(comms)
        assert hosts(comms) == [1]  # the lowest rank key
        assert all(c.master_address == comms[1].master_address for c in comms)
        assert comms[1].master_address.startswith("p1:")
        world = comms[0].get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE)
        assert world == 3
        for comm in comms:
            await comm.aclose()
        assert not memory.directory.visible("p0")  # every advertisement withdrawn


async def test_a_candidate_joins_a_master_that_already_runs(clock: object) -> None:
    memory = MemoryNetwork()
    with trio.fail_after(60):
        first = candidate(memory, "p0", rank(9))
        await first.connect()
        assert first._elector is not None and first._elector.hosting
        late = candidate(memory, "p1", rank(1))  # ranked first, but a master runs
        await elect_run([late], [first])
        assert hosts([first, late]) == [0]
        assert late.master_address == first.master_address
        for comm in (first, late):
            await comm.aclose()


async def test_survivors_elect_again_when_the_host_dies(clock: object) -> None:
    memory = MemoryNetwork()
    with trio.fail_after(120):
        comms = [candidate(memory, f"p{i}", rank(i + 1)) for i in range(4)]
        await elect_run(comms)
        assert hosts(comms) == [0]
        host, survivors = comms[0], comms[1:]
        ids = [c.peer_id for c in survivors]
        progress = Progress.of(len(survivors))

        killed_at: list[float] = []

        async def kill_host() -> None:
            await progress.stepped.wait()
            killed_at.append(trio.current_time())
            memory.kill("p0")  # the process dies: no goodbye, adverts left behind
            await host.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_host)
            states = await train(comms, progress, doomed=0)
        check_run(states, progress)
        # The host's peer, gone with it, is not waited for: p0's successor found its
        # listener refusing connections and said so when it came back.
        gaps = [progress.next_step(i, killed_at[0]) - killed_at[0] for i in range(3)]
        assert max(gaps) < pccl.Config().liveness_timeout, gaps
        assert hosts(survivors) == [0]  # p1, first of the survivors, hosts now
        assert [c.peer_id for c in survivors] == ids
        assert all(c.master_address.startswith("p1:") for c in survivors)
        for comm in survivors:
            await comm.aclose()


async def test_two_masters_elected_apart_become_one(clock: object) -> None:
    memory = MemoryNetwork()
    with trio.fail_after(120):
        memory.directory.split({"p0"}, {"p1", "p2"})
        alone = candidate(memory, "p0", rank(1))
        pair = [candidate(memory, "p1", rank(2)), candidate(memory, "p2", rank(3))]
        await alone.connect()
        await elect_run(pair)
        assert hosts([alone, *pair]) == [0, 1]  # a split brain: two masters of one run
        memory.directory.unsplit()
        # p1's master sees p0's, which comes first, and steps down; its members come
        # back to p0's master, which refuses them: its run went on without them.
        for comm in pair:
            with pytest.raises(pccl.Kicked, match="went on without|not a member|refused"):
                while True:
                    await comm.update_topology()
                    await trio.sleep(1)
        assert hosts([alone, *pair]) == [0]
        # They join anew, as newcomers of the one run left.
        again = [candidate(memory, "p1", rank(2)), candidate(memory, "p2", rank(3))]
        await elect_run(again, [alone])
        assert hosts([alone, *again]) == [0]
        for comm in (alone, *pair, *again):
            await comm.aclose()


def forged(instance: str, *, role: str) -> MasterAdvert:
    """An advertisement ranked before everyone, for an address where nobody answers."""
    return MasterAdvert(
        instance=instance, run=RUN, protocol=PROTOCOL_VERSION, auth="", port=1,
        addresses=("nowhere",), role=role, rank=rank(0),
    )


async def test_forged_advertisements_delay_an_election_but_never_win_it(clock: object) -> None:
    memory = MemoryNetwork()
    with trio.fail_after(120):
        # A candidacy ranked first that never answers: the real candidates wait for it
        # one election timeout, then elect among themselves.
        memory.directory._add("evil", forged("home-evil1", role="candidate"))
        comms = [candidate(memory, f"p{i}", rank(i + 1)) for i in range(2)]
        await elect_run(comms)
        assert hosts(comms) == [0]
        # A master ranked first that cannot prove itself: the elected one stays.
        memory.directory._add("evil", forged("home-evil2", role="master"))
        for _ in range(4):  # past several looks for masters that outrank this one
            await trio.sleep(WATCH_TIMEOUTS * pccl.Config().election_timeout)
            await all_do(comms, "update_topology")
        assert hosts(comms) == [0]
        data = [np.full(8, i + 1, np.float32) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for comm, array in zip(comms, data, strict=True):
                nursery.start_soon(comm.all_reduce, array)
        assert all((array == 3).all() for array in data)
        for comm in comms:
            await comm.aclose()
