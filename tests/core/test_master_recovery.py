"""A master learning the run from members that lost their master (``_core.recovery``).

Each test builds a fresh master (a ``MasterHarness``) and lets members of a run that
another master ran register again as who they were (``Register.rejoin``), as peers do
after their master died.
"""

from __future__ import annotations

from pccl_trio._core.master import ConnectionOpened, PeerPhase, PeerState
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    CollectiveCommence,
    CollectiveVerdict,
    Outcome,
    P2PEstablishResult,
    P2PInfo,
    Register,
    SharedStateEntry,
    SharedStatePlan,
    SharedStateVote,
    Welcome,
)

from .master_harness import LIVENESS_TIMEOUT, MasterHarness
from .scenarios import RING, come_back


def after_window(master: MasterHarness, *conns: int) -> None:
    """Let the recovery window pass, ``conns`` heard from meanwhile (not silent)."""
    master.now += LIVENESS_TIMEOUT - 1
    for conn in conns:
        master.heartbeat(conn)
    master.tick(master.now + 1)


def welcomed_as(master: MasterHarness, conn: int) -> int | None:
    welcomes = master.received(conn, Welcome)
    return welcomes[-1].peer_id if welcomes else None


def test_members_come_back_with_their_ids_ring_and_numbers() -> None:
    """All three members of the ring come back: each keeps its id, the ring is
    installed with no round, and numbers continue above what they saw."""
    master = MasterHarness()
    for conn, peer_id in zip((1, 2, 3), RING, strict=True):
        come_back(master, conn, peer_id, next_revision=13, high_water=40)
    assert [welcomed_as(master, c) for c in (1, 2, 3)] == list(RING)
    assert all(master.where(c) == (PeerPhase.ACCEPTED, PeerState.IDLE) for c in (1, 2, 3))
    assert master.core.ring(0) == list(RING)
    assert not any(master.received(c, P2PInfo) for c in (1, 2, 3))  # no round
    for conn in (1, 2, 3):
        master.initiate(conn, tag=5)
    commences = [master.last(c, CollectiveCommence) for c in (1, 2, 3)]
    assert {m.seq for m in commences} == {41} and commences[0].ring == RING
    # A newcomer gets an id above every member's.
    master.register(4)
    assert welcomed_as(master, 4) == 10


def test_the_group_expects_the_revision_its_members_report() -> None:
    master = MasterHarness()
    for conn, peer_id in zip((1, 2, 3), RING, strict=True):
        come_back(master, conn, peer_id, next_revision=13, high_water=40)
    entry = SharedStateEntry(key="w", hash=1, dtype=10, count=4, allow_content_inequality=False)
    master.send(1, SharedStateVote(revision=14, strategy=0, entries=(entry,)))
    assert "skips ahead of revision 13" in (master.kick_reason(1) or "")
    for conn in (2, 3):
        master.send(conn, SharedStateVote(revision=13, strategy=0, entries=(entry,)))
    plans = [master.last(c, SharedStatePlan) for c in (2, 3)]
    assert all(p.revision == 13 and p.sync > 40 for p in plans), plans


def test_no_consensus_is_decided_until_the_ring_is_back() -> None:
    """Two of three members are back and start an all-reduce: it waits (deciding now
    would leave out the third), and commences once the third is back."""
    master = MasterHarness()
    come_back(master, 1, 4)
    come_back(master, 2, 7)
    master.initiate(1, tag=0)
    master.initiate(2, tag=0)
    assert not master.received(1, CollectiveCommence)
    come_back(master, 3, 9)
    master.initiate(3, tag=0)
    assert master.last(1, CollectiveCommence).ring == RING


def test_members_missing_after_the_window_are_gone_and_cannot_come_back() -> None:
    master = MasterHarness()
    come_back(master, 1, 4)
    come_back(master, 2, 7)
    master.initiate(1, tag=0)
    master.initiate(2, tag=0)
    after_window(master, 1, 2)  # the recovery window ends without 9
    # The ring lost a member: the all-reduce is aborted, the survivors re-establish.
    assert master.last(1, CollectiveVerdict).outcome == Outcome.ABORTED
    master.vote(1)
    master.vote(2)
    assert master.last(1, P2PInfo).ring == (4, 7)
    master.report(1)
    master.report(2)
    assert master.last(1, P2PEstablishResult).success
    # Peer 9 turns up late: the run went on without it.
    come_back(master, 3, 9)
    assert "was removed from the run" in (master.kick_reason(3) or "")


def test_a_peer_reported_gone_by_its_successor_is_not_waited_for() -> None:
    """Peer 9 died with the master (it hosted it): its successor 4 saw its connections
    break and says so; once 7 is back too, nobody is left to wait for."""
    master = MasterHarness()
    come_back(master, 1, 4, predecessor_gone=True)
    master.initiate(1, tag=0)
    assert not master.received(1, CollectiveVerdict)  # 7 is still on its way
    come_back(master, 2, 7)
    master.initiate(2, tag=0)
    # No window to wait out: the ring lost 9, the all-reduce is aborted at once.
    assert master.last(1, CollectiveVerdict).outcome == Outcome.ABORTED
    master.vote(1)
    master.vote(2)
    assert master.last(1, P2PInfo).ring == (4, 7)
    come_back(master, 3, 9)  # it was not dead after all: too late
    assert "was removed from the run" in (master.kick_reason(3) or "")


def test_a_late_member_of_a_ring_that_settled_without_it_is_refused() -> None:
    master = MasterHarness()
    come_back(master, 1, 4, ring=(4, 7))
    come_back(master, 2, 7, ring=(4, 7))
    assert master.core.ring(0) == [4, 7]
    come_back(master, 3, 9, ring=(4, 7, 9))  # its ring is not the one the others had
    assert "the run went on without peer 9" in (master.kick_reason(3) or "")


def test_ids_in_use_or_removed_cannot_be_claimed() -> None:
    master = MasterHarness()
    come_back(master, 1, 4, ring=(4,))
    assert master.core.ring(0) == [4]
    come_back(master, 2, 4, ring=(4,))  # a second claim of a live member's id
    assert "peer id 4 is in the run already" in (master.kick_reason(2) or "")
    master.register(3)  # a newcomer: id 5
    assert welcomed_as(master, 3) == 5
    master.close(3)
    come_back(master, 4, 5, ring=(5,))  # the id of a peer this master removed
    assert "peer 5 was removed from the run" in (master.kick_reason(4) or "")


def test_a_member_takes_its_id_back_from_a_newcomer() -> None:
    """A newcomer registered with a fresh master before the member whose id it got came
    back: the newcomer is kicked with the reason, the member keeps its id, and the next
    newcomer gets an id above the run's."""
    master = MasterHarness()
    master.register(1)
    assert welcomed_as(master, 1) == 1
    come_back(master, 2, 1, ring=(1, 2))
    assert "peer id 1 belongs to a member of the run that came back" in (master.kick_reason(1) or "")
    assert welcomed_as(master, 2) == 1
    come_back(master, 3, 2, ring=(1, 2))
    assert master.core.ring(0) == [1, 2]
    master.register(4)
    assert welcomed_as(master, 4) == 3


def test_contradicting_reports_leave_the_ring_stale() -> None:
    master = MasterHarness()
    come_back(master, 1, 4, ring=(4, 7, 9))
    come_back(master, 2, 7, ring=(4, 9, 7))
    come_back(master, 3, 9, ring=(4, 7, 9))
    after_window(master, 1, 2, 3)
    for conn in (1, 2, 3):
        master.initiate(conn, tag=1)
    assert all(master.last(c, CollectiveVerdict).outcome == Outcome.ABORTED for c in (1, 2, 3))


def test_a_member_that_leaves_while_coming_back_is_not_waited_for_forever() -> None:
    master = MasterHarness()
    come_back(master, 1, 4)
    come_back(master, 2, 7)
    master.close(2)
    after_window(master, 1)
    master.vote(1)
    assert master.last(1, P2PInfo).ring == (4,)


def come_back_proving(
    master: MasterHarness, conn: int, peer_id: int, identity: bytes,
    named: dict[int, bytes], ring: tuple[int, ...] = RING,
) -> None:
    """Like ``come_back``, proving ``identity`` in the handshake and naming the
    identities ``named`` gives for the ring neighbours."""
    at = ring.index(peer_id)
    before, after = ring[at - 1], ring[(at + 1) % len(ring)]
    master.handle(ConnectionOpened(conn=conn, host="127.0.0.1", identity=identity))
    master.send(conn, Register(
        protocol_version=PROTOCOL_VERSION, peer_group=0, p2p_port=10000 + conn,
        rejoin=peer_id, predecessor=before, successor=after,
        predecessor_identity=named.get(before, b""), successor_identity=named.get(after, b""),
    ))


KEYS = {4: b"\x04" * 32, 7: b"\x07" * 32, 9: b"\x09" * 32}
MALLORY = b"\x66" * 32


def test_an_id_its_neighbours_name_another_identity_for_cannot_be_claimed() -> None:
    master = MasterHarness()
    come_back_proving(master, 1, 4, KEYS[4], KEYS)
    come_back_proving(master, 2, 7, MALLORY, KEYS)  # claims peer 7 with another key
    assert "name node identity 07070707" in (master.kick_reason(2) or "")
    come_back_proving(master, 3, 7, KEYS[7], KEYS)
    come_back_proving(master, 4, 9, KEYS[9], KEYS)
    assert master.core.ring(0) == list(RING)


def test_an_impostor_that_came_back_first_is_kicked_when_a_neighbour_names_the_owner() -> None:
    master = MasterHarness()
    come_back_proving(master, 1, 7, MALLORY, {})  # first back: nobody named peer 7 yet
    assert welcomed_as(master, 1) == 7
    come_back_proving(master, 2, 4, KEYS[4], KEYS)  # peer 7's predecessor names its key
    assert "names node identity 07070707" in (master.kick_reason(1) or "")
    come_back_proving(master, 3, 7, KEYS[7], KEYS)  # the owner now takes its id back
    come_back_proving(master, 4, 9, KEYS[9], KEYS)
    assert welcomed_as(master, 3) == 7
    assert master.core.ring(0) == list(RING)
