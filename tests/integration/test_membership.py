"""Peers joining, forming groups, leaving, dying and going silent; over both networks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import trio
import trio.lowlevel
import trio.testing

import pccl_trio as pccl
from pccl_trio._core.messages import Kick
from pccl_trio.testing import PeerSeam

from .conftest import WITH_BLOCKING, Cluster, all_do, first_reply, form_run

NETWORKS = WITH_BLOCKING

A = pccl.Attribute


def attributes(comm: pccl.Communicator) -> tuple[int, int, int, int]:
    return (
        comm.get_attribute(A.GLOBAL_WORLD_SIZE),
        comm.get_attribute(A.PEER_GROUP_WORLD_SIZE),
        comm.get_attribute(A.NUM_DISTINCT_PEER_GROUPS),
        comm.get_attribute(A.LARGEST_PEER_GROUP_WORLD_SIZE),
    )


async def test_first_peer_forms_a_run_alone(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(30):
        async with cluster.communicator("p0") as comm:
            assert attributes(comm) == (1, 1, 1, 1)
            assert comm.ring == (comm.peer_id,)
            assert await comm.are_peers_pending() is False
            await comm.update_topology()
            assert attributes(comm) == (1, 1, 1, 1)


async def test_groups_and_world_sizes(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = [cluster.communicator(f"p{i}", 0, pool_size=2) for i in range(3)]
        comms.append(cluster.communicator("p3", 1, pool_size=2))
        members = await form_run([], comms)
        assert len(members) == 4
        for comm in comms[:3]:
            assert attributes(comm) == (4, 3, 2, 3)
            assert sorted(comm.ring) == sorted(c.peer_id for c in comms[:3])
        assert attributes(comms[3]) == (4, 1, 2, 3)
        assert comms[3].ring == (comms[3].peer_id,)
        # Each group-0 peer holds a full pool to its successor and from its predecessor.
        for comm in comms[:3]:
            stats = comm.statistics()
            ring = stats.ring
            index = ring.index(comm.peer_id)
            assert stats.tx_connections == {ring[(index + 1) % 3]: 2}
        for comm in comms[:3]:
            ring = comm.ring
            predecessor = ring[ring.index(comm.peer_id) - 1]
            # The last HelloAck was sent before the round ended, so all are stored.
            assert comm.statistics().rx_connections == {predecessor: 2}
        assert comms[3].statistics().tx_connections == {}
        for comm in comms:
            await comm.aclose()


async def test_dead_peer_leaves_the_run(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(60):
        comms = [cluster.communicator(f"p{i}", 0) for i in range(3)]
        comms.append(cluster.communicator("p3", 1))
        await form_run([], comms)
        victim = comms[1]
        await cluster.kill("p1", victim)
        survivors = [c for c in comms if c is not victim]
        await all_do(survivors, "update_topology")
        for comm in survivors[:2]:
            assert attributes(comm) == (3, 2, 2, 2)
            assert victim.peer_id not in comm.ring
            stats = comm.statistics()
            assert victim.peer_id not in stats.tx_connections
            assert victim.peer_id not in stats.rx_connections
        assert attributes(survivors[2]) == (3, 1, 2, 2)
        for comm in survivors:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])  # TCP: tests/process (SIGSTOP)
async def test_silent_peer_is_removed_within_the_liveness_timeout(
    cluster: Cluster, clock: object
) -> None:
    # The partitioned peer waits for its master for the grace, then fails.
    cluster.config = dataclasses.replace(cluster.config, master_grace=5.0)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        silent = comms[2]
        cluster.partition("p2")
        start = trio.current_time()
        await all_do(comms[:2], "update_topology")
        elapsed = trio.current_time() - start
        for comm in comms[:2]:
            assert attributes(comm) == (2, 2, 1, 2)
        # Virtual time: removal happens at the liveness deadline, not TCP keepalive's.
        assert elapsed <= cluster.config.liveness_timeout + cluster.config.heartbeat_interval
        with pytest.raises(pccl.MasterConnectionError, match="liveness timeout"):
            await silent.update_topology()
        for comm in comms:
            await comm.aclose()


async def test_late_joiner_is_admitted_by_update_topology(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        late = cluster.communicator("late")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(late.connect)
            # The joiner is registered once the members see it pending.
            while not all(await all_do(comms, "are_peers_pending")):
                pass
            await all_do(comms, "update_topology")
        assert attributes(late) == (3, 3, 1, 3)
        assert sorted(late.ring) == sorted(c.peer_id for c in [*comms, late])
        assert all(await all_do([*comms, late], "are_peers_pending")) is False
        for comm in [*comms, late]:
            await comm.aclose()


async def test_master_survives_garbage_and_serves_new_peers(
    cluster: Cluster, clock: object
) -> None:
    cluster.plain_frames()
    host, port = cluster.master_address.rsplit(":", 1)
    bad_inputs = [
        b"\x00\x00\x00\x05\x07garbage-bytes-follow",  # unknown frame type
        b"\xff\xff\xff\xff\x01",  # oversized length prefix
        b"\x00\x00\x00\x10\x01\x00",  # truncated frame, then EOF
        b"\x00\x00\x00\x04\x01\x00\x03\xc3",  # VoteEstablish before Register
    ]
    with trio.fail_after(60):
        first = cluster.communicator("p0")
        await first.connect()
        for index, payload in enumerate(bad_inputs):
            stream = await cluster.network(f"evil{index}").connect(host, int(port))
            await stream.send_all(payload)
            if index == 2:
                await stream.aclose()  # EOF inside a frame
                continue
            # The master answers with a Kick (or just closes) and hangs up on us.
            received = b""
            while chunk := await stream.receive_some(1 << 16):
                received += chunk
            await stream.aclose()
            kick = first_reply(received)
            assert isinstance(kick, Kick) and "malformed input" in kick.reason, kick
        late = cluster.communicator("p1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(late.connect)
            while not await first.are_peers_pending():
                pass
            await first.update_topology()
        assert attributes(first) == (2, 2, 1, 2)
        await first.aclose()
        await late.aclose()


async def test_illegal_vote_kicks_only_the_offender(cluster: Cluster, clock: object) -> None:
    cluster.plain_frames()
    from pccl_trio._core.messages import PROTOCOL_VERSION, P2PEstablished, Register, Welcome
    from pccl_trio.transport import FramedStream

    host, port = cluster.master_address.rsplit(":", 1)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        # A raw client registers properly, then reports on a round it is not part of.
        raw = FramedStream(
            await cluster.network("rogue").connect(host, int(port)), max_control_frame=1 << 20
        )
        await raw.send_message(Register(protocol_version=PROTOCOL_VERSION, peer_group=0,
                                        p2p_port=9))
        assert isinstance(await raw.receive_message(), Welcome)
        await raw.send_message(P2PEstablished(round=99, success=True))
        kick = await raw.receive_message()
        assert type(kick).__name__ == "Kick"
        assert "P2PEstablished" in kick.reason  # type: ignore[attr-defined]
        await raw.aclose()
        await all_do(comms, "update_topology")
        assert attributes(comms[0]) == (2, 2, 1, 2)
        for comm in comms:
            await comm.aclose()


async def test_unreachable_peer_is_kicked_and_the_rest_go_on(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        # This peer advertises an address nobody can reach: rounds fail, the master
        # learns which links are dead, and gives up on the peer once no ring avoids
        # them; update_topology rides that out and succeeds without it.
        nowhere = "127.0.0.9" if cluster.memory is None else "nowhere"
        lost = cluster.communicator("lost", advertised_host=nowhere)
        async with trio.open_nursery() as nursery:

            async def join_and_expect_kick() -> None:
                with pytest.raises(pccl.Kicked, match="no ring can include"):
                    await lost.connect()

            nursery.start_soon(join_and_expect_kick)
            while not all(await all_do(comms, "are_peers_pending")):
                pass
            await all_do(comms, "update_topology")
        assert attributes(comms[0]) == (2, 2, 1, 2)
        assert lost.peer_id not in comms[0].ring
        for comm in comms:
            await comm.aclose()


async def test_master_loss_fails_every_call_after_the_grace(cluster: Cluster, clock: object) -> None:
    """No master takes the peers back (``test_master_recovery`` has those that do):
    once ``Config.master_grace`` is over, every call fails and says why."""
    cluster.config = dataclasses.replace(cluster.config, master_grace=1.0)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        cluster.master_scope.cancel()
        for comm in comms:
            with pytest.raises(pccl.MasterConnectionError, match="no master took this peer back"):
                await comm.update_topology()
            with pytest.raises(pccl.MasterConnectionError):
                comm.get_attribute(A.GLOBAL_WORLD_SIZE)
            with pytest.raises(pccl.MasterConnectionError):
                await comm.are_peers_pending()
            await comm.aclose()


async def test_master_unreachable(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(30):
        comm = pccl.Communicator(
            "127.0.0.1:1" if cluster.memory is None else "nohost:1",
            network=cluster.network("p0"),
            config=cluster.config,
            p2p_host="127.0.0.1" if cluster.memory is None else "0.0.0.0",
        )
        with pytest.raises(pccl.MasterConnectionError, match="could not reach the master"):
            await comm.connect()
        with pytest.raises(pccl.InvalidUsage):
            await comm.connect()


async def test_usage_errors(cluster: Cluster, clock: object) -> None:
    comm = cluster.communicator("p0")
    with pytest.raises(pccl.InvalidUsage, match="connect"):
        await comm.update_topology()
    with pytest.raises(pccl.InvalidUsage):
        comm.get_attribute(A.GLOBAL_WORLD_SIZE)
    with pytest.raises(pccl.InvalidArgument):
        pccl.Communicator("no-port-here")
    with pytest.raises(pccl.InvalidArgument):
        pccl.Communicator("127.0.0.1:1", peer_group=-1)
    with pytest.raises(pccl.InvalidArgument):
        pccl.Communicator("127.0.0.1:1", p2p_connection_pool_size=-3)
    with trio.fail_after(30):
        await comm.connect()
        with pytest.raises(pccl.InvalidArgument):
            comm.get_attribute("GLOBAL_WORLD_SIZE")  # type: ignore[arg-type]
        with pytest.raises(pccl.InvalidUsage, match="connect"):
            await comm.connect()
        await comm.aclose()
        await comm.aclose()  # idempotent
        with pytest.raises(pccl.InvalidUsage, match="closed; create a new Communicator"):
            await comm.update_topology()


@pytest.mark.async_only
async def test_interrupted_vote_leaves_the_run_instead_of_stalling_it(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        quitter = comms[2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(all_do, comms[:2], "update_topology")
            with trio.CancelScope() as scope:
                # Cancelled while waiting for the round it voted for.
                async def cancel_once_voted() -> None:
                    while not PeerSeam(quitter).voted:
                        await trio.lowlevel.checkpoint()
                    scope.cancel()

                nursery.start_soon(cancel_once_voted)
                await quitter.update_topology()
        assert scope.cancelled_caught
        for comm in comms[:2]:
            assert attributes(comm) == (2, 2, 1, 2)
        with pytest.raises(pccl.InvalidUsage, match="interrupted"):
            await quitter.are_peers_pending()
        for comm in comms:
            await comm.aclose()


async def test_joiner_that_never_connects_gives_up_and_frees_the_run(
    cluster: Cluster, clock: object
) -> None:
    import dataclasses

    cluster.config = dataclasses.replace(cluster.config, establish_attempts=1)
    with trio.fail_after(60):
        member = cluster.communicator("p0")
        await member.connect()
        nowhere = "127.0.0.9" if cluster.memory is None else "nowhere"
        joiner = cluster.communicator("lost", advertised_host=nowhere)
        async with trio.open_nursery() as nursery:

            async def join() -> None:
                with pytest.raises(pccl.UpdateTopologyFailed, match="left again"):
                    await joiner.connect()

            nursery.start_soon(join)
            while not await member.are_peers_pending():
                pass
            with pytest.raises(pccl.UpdateTopologyFailed):
                await member.update_topology()
        # The joiner gave up and left: the member's next votes complete.
        assert await member.are_peers_pending() is False
        await member.update_topology()
        assert attributes(member) == (1, 1, 1, 1)
        await member.aclose()


async def test_call_cancelled_before_it_votes_keeps_the_peer(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        with trio.CancelScope() as scope:
            scope.cancel()
            await comms[0].are_peers_pending()
        assert await all_do(comms, "are_peers_pending") == [False, False]
        for comm in comms:
            await comm.aclose()


async def test_p2p_port_refuses_peers_the_master_did_not_name(
    cluster: Cluster, clock: object
) -> None:
    from pccl_trio._core.messages import PROTOCOL_VERSION, P2PHello
    from pccl_trio.transport import FramedStream

    # The stranger is dropped once the peer waited connect_timeout for the master to
    # name it: over TCP, two seconds of real time instead of five (the liveness
    # timeout is two seconds there too).
    cluster.config = dataclasses.replace(cluster.config, connect_timeout=2.0)
    with trio.fail_after(60):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        target = comms[0]
        host = "127.0.0.1" if cluster.memory is None else "p0"
        port = PeerSeam(target).p2p_address[1]
        stranger = FramedStream(await cluster.network("stranger").connect(host, port),
                                max_control_frame=1 << 20)
        await stranger.send_message(P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=1000,
                                             slot=0))
        with pytest.raises(trio.BrokenResourceError):
            await stranger.receive_message()  # dropped after the handshake timeout
        assert 1000 not in target.statistics().rx_connections
        await stranger.aclose()
        await all_do(comms, "update_topology")
        for comm in comms:
            await comm.aclose()


@pytest.mark.parametrize("network_kind", ["tcp"])
async def test_flood_of_legal_frames_costs_nobody_else(cluster: Cluster, clock: object) -> None:
    """Real time: heartbeats queued behind a flood must not look like silence."""
    from pccl_trio._core.messages import PROTOCOL_VERSION, Heartbeat, Register
    from pccl_trio._core.wire import encode_control

    host, port = cluster.master_address.rsplit(":", 1)
    with trio.fail_after(60):
        honest = cluster.communicator("p0")
        await honest.connect()
        rogue = await cluster.network("rogue").connect(host, int(port))
        await rogue.send_all(encode_control(
            Register(protocol_version=PROTOCOL_VERSION, peer_group=0, p2p_port=9)))
        blob = encode_control(Heartbeat()) * 20_000
        end = trio.current_time() + 2 * cluster.config.liveness_timeout
        async with trio.open_nursery() as nursery:

            async def flood() -> None:
                while trio.current_time() < end:
                    await rogue.send_all(blob)

            nursery.start_soon(flood)
            while trio.current_time() < end:
                await honest.are_peers_pending()  # the rogue counts as pending
        await rogue.aclose()
        assert attributes(honest) == (1, 1, 1, 1)
        await honest.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])
async def test_p2p_info_right_behind_welcome_is_honoured(cluster: Cluster, clock: object) -> None:
    """A scripted master sends Welcome and the round's P2PInfo in one write; the
    joiner's p2p listener must accept the predecessor that P2PInfo names at once."""
    from pccl_trio._core.messages import (
        PROTOCOL_VERSION,
        P2PHello,
        P2PHelloAck,
        P2PInfo,
        PeerEndpoint,
        Register,
        Welcome,
        WorldSizes,
    )
    from pccl_trio._core.wire import encode_control
    from pccl_trio.transport import FramedStream

    assert cluster.memory is not None
    net = cluster.memory
    listener = await net.host("fake").listen("fake", 1)
    world = WorldSizes(global_world_size=2, peer_group_world_size=2,
                       num_distinct_peer_groups=1, largest_peer_group_world_size=2)
    with trio.fail_after(60):
        joiner = pccl.Communicator("fake:1", network=net.host("joiner"), config=cluster.config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(joiner.connect)
            master = FramedStream(await listener.accept(), max_control_frame=1 << 20)
            register = await master.receive_message()
            assert isinstance(register, Register)
            await master.send_bytes(
                encode_control(Welcome(peer_id=2, heartbeat_interval=0.5, liveness_timeout=3.0))
                + encode_control(P2PInfo(
                    round=1, ring=(7, 2),
                    neighbours=(PeerEndpoint(peer_id=7, host="pred", port=9),), world=world,
                ))
            )
            # The predecessor (id 7) connects right away and must be acknowledged.
            link = FramedStream(
                await net.host("pred").connect("joiner", register.p2p_port),
                max_control_frame=1 << 20,
            )
            start = trio.current_time()
            await link.send_message(P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=7, slot=0))
            assert isinstance(await link.receive_message(), P2PHelloAck)
            assert trio.current_time() - start < cluster.config.connect_timeout
            nursery.cancel_scope.cancel()
        await joiner.aclose()


async def test_a_lone_peer_waits_for_company_in_one_question(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(60):
        async with cluster.communicator("alone") as alone:
            answer: list[bool] = []
            late = cluster.communicator("late")
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    answer.append(await alone.are_peers_pending(wait=math.inf))
                    await alone.update_topology()

                nursery.start_soon(ask)
                await late.connect()  # returns once the lone peer's update admitted it
            assert answer == [True]
            assert attributes(late) == attributes(alone) == (2, 2, 1, 2)
            await late.aclose()


@pytest.mark.parametrize("network_kind", ["memory"])  # virtual time
async def test_a_wait_for_company_runs_out(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(600):
        async with cluster.communicator("alone") as alone:
            start = trio.current_time()
            assert await alone.are_peers_pending(wait=300) is False
            assert 300 <= trio.current_time() - start < 301
            assert await alone.are_peers_pending() is False  # 0: answered at once
            assert trio.current_time() - start < 301


@pytest.mark.parametrize("network_kind", ["memory"])  # virtual time
async def test_a_peer_waiting_for_company_learns_that_its_master_is_gone(
    cluster: Cluster, clock: object
) -> None:
    cluster.config = dataclasses.replace(cluster.config, master_grace=5.0)
    with trio.fail_after(600):
        async with cluster.communicator("alone") as alone:
            async with trio.open_nursery() as nursery:

                async def stop_master() -> None:
                    await trio.sleep(100)  # long after the question
                    cluster.master_scope.cancel()

                nursery.start_soon(stop_master)
                with pytest.raises(pccl.MasterConnectionError):
                    await alone.are_peers_pending(wait=math.inf)
            # Within the liveness timeout and the grace, not at the end of the wait.
            assert trio.current_time() < 100 + 5.0 + 2 * cluster.config.liveness_timeout


@pytest.mark.parametrize("network_kind", ["memory"])  # partitions need the memory network
async def test_a_peer_waiting_for_company_learns_that_it_was_kicked(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(600):
        async with cluster.communicator("alone") as alone:
            async with trio.open_nursery() as nursery:

                async def cut_off() -> None:
                    await trio.sleep(100)
                    cluster.partition("alone")  # the master removes it meanwhile
                    await trio.sleep(5 * cluster.config.liveness_timeout)
                    cluster.memory.heal("alone")  # type: ignore[union-attr]

                nursery.start_soon(cut_off)
                with pytest.raises(pccl.Kicked):
                    await alone.are_peers_pending(wait=math.inf)


@pytest.mark.parametrize("network_kind", ["memory"])
@pytest.mark.parametrize("wait", [-1, math.nan, "1", True, None])
async def test_a_wait_that_is_no_duration_is_refused(
    cluster: Cluster, clock: object, wait: object
) -> None:
    async with cluster.communicator("alone") as alone:
        with pytest.raises(pccl.InvalidArgument, match="wait must be a number of seconds"):
            await alone.are_peers_pending(wait=wait)  # type: ignore[arg-type]
