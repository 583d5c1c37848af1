"""Dozens of peers in virtual time: joins, deaths and silent partitions at scale."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

import pccl_trio as pccl
from pccl_trio.testing import MemoryNetwork

from .conftest import all_do, form_run

A = pccl.Attribute
CONFIG = pccl.Config()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_many_peers_churn(seed: int, autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(seed)
    network = MemoryNetwork()
    n_peers, n_groups = 36, 4
    with trio.fail_after(600):  # virtual seconds
        async with trio.open_nursery() as nursery:
            listener = await network.host("master").listen("master", 48148)
            await nursery.start(pccl.serve_master, [listener])
            comms = {
                f"p{i}": pccl.Communicator(
                    "master:48148", rng.randrange(n_groups), network=network.host(f"p{i}"),
                    config=CONFIG,
                )
                for i in range(n_peers)
            }
            start = trio.current_time()
            members = await form_run([], list(comms.values()))
            assert len(members) == n_peers
            # No establishment round waited out a connect timeout (a refused hello).
            assert trio.current_time() - start < CONFIG.connect_timeout
            names = sorted(comms)
            killed = rng.sample(names, 5)
            silent = rng.sample([n for n in names if n not in killed], 3)
            for name in killed:
                network.kill(name)
                await comms[name].aclose()
            for name in silent:
                network.partition(name)
            survivors = [comms[n] for n in names if n not in killed and n not in silent]
            start = trio.current_time()
            await all_do(survivors, "update_topology")
            assert trio.current_time() - start <= CONFIG.liveness_timeout + CONFIG.heartbeat_interval

            groups: dict[int, list[pccl.Communicator]] = {}
            for comm in survivors:
                groups.setdefault(comm.peer_group, []).append(comm)
            for group, group_members in groups.items():
                ring = group_members[0].ring
                assert sorted(ring) == sorted(c.peer_id for c in group_members), group
                for comm in group_members:
                    assert comm.ring == ring
                    assert comm.get_attribute(A.GLOBAL_WORLD_SIZE) == len(survivors)
                    assert comm.get_attribute(A.PEER_GROUP_WORLD_SIZE) == len(group_members)
                    assert comm.get_attribute(A.NUM_DISTINCT_PEER_GROUPS) == len(groups)
                    assert comm.get_attribute(A.LARGEST_PEER_GROUP_WORLD_SIZE) == max(
                        len(m) for m in groups.values()
                    )
            # A second wave of joiners is admitted by the survivors.
            joiners = [
                pccl.Communicator("master:48148", rng.randrange(n_groups),
                                  network=network.host(f"j{i}"), config=CONFIG)
                for i in range(4)
            ]
            everyone = await form_run(survivors, joiners)
            assert {c.get_attribute(A.GLOBAL_WORLD_SIZE) for c in everyone} == {len(everyone)}
            for comm in [*comms.values(), *joiners]:
                await comm.aclose()
            nursery.cancel_scope.cancel()
