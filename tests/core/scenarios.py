"""Setups and drivers the core tests share, on a ``MasterHarness``: peers made members
by a successful round, a subject peer put in each reachable (phase, state), collectives
started by a whole group, shared-state votes, plans and fetchers, members coming back
to a new master as who they were, and a topology optimization driven step by step.
Peer ``n`` is registered on connection ``n`` throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pccl_trio._core.master import Action, PeerPhase, PeerState, Send
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    CollectiveCommence,
    Heartbeat,
    MeasureLink,
    Message,
    P2PEstablishResult,
    PeerEndpoint,
    Register,
    SharedStateDone,
    SharedStateEntry,
    SharedStateFetch,
    SharedStateFetcher,
    SharedStatePlan,
    SharedStateVote,
    SyncStrategy,
    TensorSpan,
)
from pccl_trio._core.ring import ring_edges
from pccl_trio._core.shared_state import (
    Ballot,
)

from .master_harness import MasterHarness

#: Short names for where ``h.where`` finds a peer: its phase, and its state.
REG, ACC = PeerPhase.REGISTERED, PeerPhase.ACCEPTED
IDLE, VOTED, CONN, WAIT, FAIL = (
    PeerState.IDLE, PeerState.VOTE_ESTABLISH, PeerState.CONNECTING, PeerState.WAITING,
    PeerState.CONNECT_FAILED,
)
SVOTED, SYNCING, SDONE = PeerState.VOTE_SYNC, PeerState.SYNCING, PeerState.SYNC_DONE
OVOTED, OPTIMIZING = PeerState.VOTE_OPTIMIZE, PeerState.OPTIMIZING


# --- members ---------------------------------------------------------------------------


def run_with(h: MasterHarness, groups: dict[int, int]) -> None:
    """Make the peers on ``groups``' conns (conn -> peer group, in order; peer id ==
    conn) the only peers, accepted by one successful round and each IDLE; then forget
    what they were sent (``take_all``)."""
    conns = list(groups)
    h.join(conns[0], groups[conns[0]])
    for conn in conns[1:]:
        h.register(conn, groups[conn])
    if len(conns) > 1:
        h.vote(conns[0])
        for conn in conns:
            h.report(conn)
    assert h.peer_ids == {c: c for c in conns}
    for conn in conns:
        assert h.last(conn, P2PEstablishResult).success and h.where(conn) == (ACC, IDLE)
    h.take_all()


def accepted(h: MasterHarness, *conns: int) -> None:
    """``run_with`` for ``conns``, all in group 0."""
    run_with(h, dict.fromkeys(conns, 0))


def endpoint(conn: int, host: str = "127.0.0.1") -> PeerEndpoint:
    """Where the peer on ``conn`` (id ``conn``) serves."""
    return PeerEndpoint(peer_id=conn, host=host, port=10000 + conn)


def got(h: MasterHarness, conn: int) -> list[Message]:
    """What ``conn`` was sent since the last look, heartbeats aside."""
    return [m for m in h.take(conn) if not isinstance(m, Heartbeat)]


# --- collectives -----------------------------------------------------------------------


def group_of(h: MasterHarness, conn: int) -> int:
    view = h.view(conn)
    assert view is not None
    return view.peer_group


def started(h: MasterHarness, tag: int, *conns: int) -> int:
    """Every one of ``conns`` (the whole group) initiates ``tag`` alike; it commences
    once the last did, on the group's ring. Returns its seq."""
    h.take_all()
    for conn in conns[:-1]:
        h.initiate(conn, tag)
        assert all(got(h, c) == [] for c in conns)
    h.initiate(conns[-1], tag)
    seq = h.last(conns[0], CollectiveCommence).seq
    ring = tuple(h.core.ring(group_of(h, conns[0])))
    assert sorted(ring) == sorted(conns)
    for conn in conns:
        assert got(h, conn) == [CollectiveCommence(tag=tag, seq=seq, ring=ring)]
    return seq


# --- shared state ----------------------------------------------------------------------


def sync_vote(content: int = 7) -> SharedStateVote:
    entry = SharedStateEntry(key="w", hash=content, dtype=10, count=4, allow_content_inequality=False)
    return SharedStateVote(revision=0, strategy=0, entries=(entry,))


def sync_done(h: MasterHarness, conn: int) -> SharedStateDone:
    plans = [m for m in h.sent[conn] if isinstance(m, SharedStatePlan)]
    return SharedStateDone(sync=plans[-1].sync if plans else 1, success=True)


# --- a subject peer in each reachable (phase, state) -----------------------------------
#
# Each setup puts a subject peer in one reachable (phase, state), next to one other
# peer, and returns (subject conn, other conn).

Setup = Callable[[MasterHarness], tuple[int, int]]


def registered_waiting(h: MasterHarness) -> tuple[int, int]:
    h.join(1)
    h.register(2)
    return 2, 1


def registered_mid_round(h: MasterHarness) -> tuple[int, int]:
    h.register(1)  # its one-member round is running
    h.register(2)
    return 2, 1


def joiner_connecting(h: MasterHarness) -> tuple[int, int]:
    h.join(1)
    h.register(2)
    h.vote(1)
    return 2, 1


def joiner_waiting(h: MasterHarness) -> tuple[int, int]:
    joiner_connecting(h)
    h.report(2)
    return 2, 1


def joiner_failed(h: MasterHarness) -> tuple[int, int]:
    joiner_connecting(h)
    h.report(2, ok=False)
    return 2, 1


def accepted_idle(h: MasterHarness) -> tuple[int, int]:
    joiner_connecting(h)
    h.report(1)
    h.report(2)
    return 1, 2


def accepted_voted(h: MasterHarness) -> tuple[int, int]:
    accepted_idle(h)
    h.vote(1)
    return 1, 2


def accepted_connecting(h: MasterHarness) -> tuple[int, int]:
    accepted_voted(h)
    h.vote(2)
    return 1, 2


def accepted_waiting(h: MasterHarness) -> tuple[int, int]:
    accepted_connecting(h)
    h.report(1)
    return 1, 2


def accepted_failed_mid_round(h: MasterHarness) -> tuple[int, int]:
    accepted_connecting(h)
    h.report(1, ok=False)
    return 1, 2


def accepted_failed_after_round(h: MasterHarness) -> tuple[int, int]:
    accepted_failed_mid_round(h)
    h.report(2)
    return 1, 2


def accepted_sync_voted(h: MasterHarness) -> tuple[int, int]:
    accepted_idle(h)
    h.send(1, sync_vote())
    return 1, 2


def accepted_syncing(h: MasterHarness) -> tuple[int, int]:
    # Other content than the subject's: one of them fetches, so the sync runs until
    # both report (a sync in which nobody fetches is over with its plan).
    accepted_sync_voted(h)
    h.send(2, sync_vote(content=8))
    return 1, 2


def accepted_sync_done(h: MasterHarness) -> tuple[int, int]:
    accepted_syncing(h)
    h.send(1, sync_done(h, 1))
    return 1, 2


def accepted_optimize_voted(h: MasterHarness) -> tuple[int, int]:
    accepted_idle(h)
    h.optimize(1)
    return 1, 2


def accepted_optimizing(h: MasterHarness) -> tuple[int, int]:
    # Both voted: the optimization runs. Its first step measures the link 1 -> 2 (at
    # peer 2), so the subject has nothing to measure yet.
    accepted_optimize_voted(h)
    h.optimize(2)
    assert h.core.optimization_in_progress
    assert 1 not in h.unanswered and 2 in h.unanswered
    return 1, 2


# --- a topology optimization -----------------------------------------------------------
#
# The harness plays the shell: the drivers answer each ``MeasureLink`` with the rate a
# ``Rate`` gives the link (sender, receiver), and the tests run the solver jobs.

REFERENCE = 64 << 20
FAST, MEDIUM, SLOW = 50e6, 20e6, 5e6
LATENCY = 1e-4

Rate = Callable[[int, int], float]
Link = tuple[int, int]


def ring_rate(ring: Sequence[int], fast: float = FAST, slow: float = SLOW) -> Rate:
    """``fast`` on the links of ``ring``, ``slow`` elsewhere."""
    edges = set(ring_edges(ring))
    return lambda a, b: fast if (a, b) in edges else slow


def optimize_all(h: MasterHarness, conns: Iterable[int]) -> list[Action]:
    """Every conn votes; the actions of the last vote (which starts the optimization)."""
    actions: list[Action] = []
    for conn in conns:
        actions = h.optimize(conn)
    return actions


def asked(actions: Iterable[Action]) -> list[tuple[int, MeasureLink]]:
    return [
        (a.conn, a.message) for a in actions
        if isinstance(a, Send) and isinstance(a.message, MeasureLink)
    ]


def measure_all(
    h: MasterHarness, rate: Rate | None = None, fail: Iterable[Link] = ()
) -> list[list[Link]]:
    """Answer the measurements step by step (``fail``: links answered with an error);
    return each step's links. Checks that no peer takes part twice in a step, and that
    the next step starts only with the last report of the current one."""
    failing = set(fail)
    rate = rate or ring_rate(())
    steps: list[list[Link]] = []
    while h.unanswered:
        step = {conn: (m.source.peer_id, h.peer_ids[conn]) for conn, m in h.unanswered.items()}
        links = sorted(step.values())
        ends = [p for link in links for p in link]
        assert len(ends) == len(set(ends)), f"a peer twice in step {links}"
        assert len({m.optimization for m in h.unanswered.values()}) == 1
        steps.append(links)
        order = sorted(step)
        for index, conn in enumerate(order):
            link = step[conn]
            if link in failing:
                actions = h.measure(conn, error="connection refused")
            else:
                actions = h.measure(conn, bandwidth=rate(*link), latency=LATENCY)
            if index < len(order) - 1:
                assert asked(actions) == [], "a step started before the last one was reported"
    return steps


def finish_round(h: MasterHarness, conns: Iterable[int]) -> P2PEstablishResult:
    """Every conn reports on the round running, which must succeed; the verdict of the
    first conn."""
    conns = list(conns)
    for conn in conns:
        h.report(conn)
    assert not h.core.round_in_progress
    results = [h.last(conn, P2PEstablishResult) for conn in conns]
    assert all(r.success and r.round == results[0].round for r in results), results
    return results[0]


# --- shared-state votes, plans and fetchers -----------------------------------------

E, R, S = SyncStrategy.ENFORCE_POPULAR, SyncStrategy.RECEIVE_ONLY, SyncStrategy.SEND_ONLY
FLOAT, DOUBLE = 10, 11


def entry(
    key: str, hash: int, *, dtype: int = FLOAT, count: int = 4, aci: bool = False
) -> SharedStateEntry:
    return SharedStateEntry(
        key=key, hash=hash, dtype=dtype, count=count, allow_content_inequality=aci
    )


def fetch(popular: SharedStateEntry) -> SharedStateFetch:
    """What a peer fetches to get ``popular`` (content-unequal keys are not verified)."""
    return SharedStateFetch(
        key=popular.key, hash=popular.hash, verify=not popular.allow_content_inequality
    )


def fetcher(conn: int, *spans: tuple[int, int], host: str = "127.0.0.1") -> SharedStateFetcher:
    """Peer ``conn`` fetching the tensors of ``spans`` (first position, count), as a
    distributor's plan names it."""
    return SharedStateFetcher(
        peer_id=conn, host=host, identity=b"",
        tensors=tuple(TensorSpan(first=first, count=count) for first, count in spans),
    )



def ballot(revision: int, *entries: SharedStateEntry, strategy: int = E) -> Ballot:
    return Ballot(revision=revision, strategy=strategy, entries=entries)



OPT = entry("opt", 0, aci=True)



def vote(
    h: MasterHarness, conn: int, revision: int, *entries: SharedStateEntry, strategy: int = E
) -> list[Action]:
    return h.send(conn, SharedStateVote(revision=revision, strategy=strategy, entries=entries))



def done(h: MasterHarness, conn: int, number: int, success: bool = True) -> list[Action]:
    reason = "" if success else "distributor went away"
    return h.send(conn, SharedStateDone(sync=number, success=success, reason=reason))



def plan_of(h: MasterHarness, conn: int) -> SharedStatePlan:
    """``conn`` was sent exactly one message since the last look: a plan."""
    messages = got(h, conn)
    assert len(messages) == 1 and isinstance(messages[0], SharedStatePlan), messages
    return messages[0]


# --- members coming back to a new master ----------------------------------------------

RING = (4, 7, 9)  # the ring the old master had installed



def come_back(
    master: MasterHarness, conn: int, peer_id: int, ring: tuple[int, ...] = RING, *,
    group: int = 0, next_revision: int = 0, high_water: int = 0, predecessor_gone: bool = False,
) -> None:
    """Peer ``peer_id`` of ``ring`` registers on ``conn`` as the member it was."""
    at = ring.index(peer_id)
    master.open(conn)
    master.send(conn, Register(
        protocol_version=PROTOCOL_VERSION, peer_group=group, p2p_port=10000 + conn,
        rejoin=peer_id,
        predecessor=ring[at - 1] if len(ring) > 1 else 0,
        successor=ring[(at + 1) % len(ring)] if len(ring) > 1 else 0,
        next_revision=next_revision, high_water=high_water, predecessor_gone=predecessor_gone,
    ))
