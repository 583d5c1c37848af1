"""The master's transition table, alone and as peers' messages drive it."""

from __future__ import annotations

import itertools

import pytest

from pccl_trio._core.errors import LocalProtocolError, RemoteProtocolError
from pccl_trio._core.master import (
    REMOTE_EVENTS,
    TRANSITIONS,
    PeerEvent,
    PeerPhase,
    PeerState,
    transition,
)
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    LinkMeasured,
    MeasureLink,
    Message,
    P2PEstablished,
    Register,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
)

from .master_harness import MasterHarness, only, was_kicked
from .scenarios import (
    ACC,
    CONN,
    FAIL,
    IDLE,
    OPTIMIZING,
    OVOTED,
    REG,
    SDONE,
    SVOTED,
    SYNCING,
    VOTED,
    WAIT,
    Setup,
    accepted_connecting,
    accepted_failed_after_round,
    accepted_failed_mid_round,
    accepted_idle,
    accepted_optimize_voted,
    accepted_optimizing,
    accepted_sync_done,
    accepted_sync_voted,
    accepted_syncing,
    accepted_voted,
    accepted_waiting,
    joiner_connecting,
    joiner_failed,
    joiner_waiting,
    registered_mid_round,
    registered_waiting,
    sync_done,
    sync_vote,
)

# --- the table alone ------------------------------------------------------------------

PAIRS = list(itertools.product(PeerState, PeerEvent))


@pytest.mark.parametrize(("state", "event"), PAIRS, ids=[f"{s.name}-{e.name}" for s, e in PAIRS])
def test_transition(state: PeerState, event: PeerEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert transition(state, event) is TRANSITIONS[(state, event)]
    elif event in REMOTE_EVENTS:
        with pytest.raises(RemoteProtocolError, match=f"not allowed in state {state.name}"):
            transition(state, event)
    else:
        with pytest.raises(LocalProtocolError, match=f"not allowed in state {state.name}"):
            transition(state, event)


def test_remote_events_are_the_ones_peers_cause() -> None:
    assert REMOTE_EVENTS == {
        PeerEvent.VOTE_ESTABLISH, PeerEvent.REPORT_CONNECTED, PeerEvent.REPORT_FAILED,
        PeerEvent.VOTE_SYNC, PeerEvent.REPORT_SYNCED, PeerEvent.VOTE_OPTIMIZE,
    }


def test_every_state_is_reachable_from_idle_and_leads_back() -> None:
    def reachable(start: PeerState, edges: dict[PeerState, set[PeerState]]) -> set[PeerState]:
        seen, todo = {start}, [start]
        while todo:
            for after in edges.get(todo.pop(), set()) - seen:
                seen.add(after)
                todo.append(after)
        return seen

    forward: dict[PeerState, set[PeerState]] = {}
    backward: dict[PeerState, set[PeerState]] = {}
    for (before, _event), after in TRANSITIONS.items():
        forward.setdefault(before, set()).add(after)
        backward.setdefault(after, set()).add(before)
    assert reachable(PeerState.IDLE, forward) == set(PeerState)
    assert reachable(PeerState.IDLE, backward) == set(PeerState)


# --- the table as messages drive it ---------------------------------------------------
#
# Each setup (see ``scenarios``) puts a subject peer in one reachable (phase, state),
# next to one other peer. Then each peer-to-master message is sent by the subject: it
# is kicked exactly when the table (or the phase) forbids it.

KICK = None
MESSAGES = ("register", "heartbeat", "vote", "report_ok", "report_failed", "report_stale",
            "pending", "sync_vote", "sync_done", "optimize", "link_measured")
K2 = (KICK, KICK)  # sync_vote and sync_done where neither is allowed
# optimize and link_measured where neither is allowed (a link is measured only when the
# master asked this peer for it, which no setup but accepted_optimizing could have done)
KO = (KICK, KICK)

#: setup -> (where the subject starts, its fate after each message in MESSAGES)
TABLE: dict[Setup, tuple[tuple[PeerPhase, PeerState], tuple[tuple[PeerPhase, PeerState] | None, ...]]] = {  # noqa: E501
    registered_waiting: ((REG, IDLE), (KICK, (REG, IDLE), KICK, KICK, KICK, KICK, KICK, *K2, *KO)),
    registered_mid_round: ((REG, IDLE), (KICK, (REG, IDLE), KICK, KICK, KICK, KICK, KICK, *K2,
                                         *KO)),
    joiner_connecting: ((REG, CONN), (KICK, (REG, CONN), KICK, (REG, WAIT), (REG, FAIL), KICK,
                                      KICK, *K2, *KO)),
    joiner_waiting: ((REG, WAIT), (KICK, (REG, WAIT), KICK, KICK, KICK, KICK, KICK, *K2, *KO)),
    joiner_failed: ((REG, FAIL), (KICK, (REG, FAIL), KICK, KICK, KICK, KICK, KICK, *K2, *KO)),
    accepted_idle: ((ACC, IDLE), (KICK, (ACC, IDLE), (ACC, VOTED), KICK, KICK, KICK,
                                  (ACC, IDLE), (ACC, SVOTED), KICK, (ACC, OVOTED), KICK)),
    accepted_voted: ((ACC, VOTED), (KICK, (ACC, VOTED), KICK, KICK, KICK, KICK, KICK, *K2, *KO)),
    accepted_connecting: ((ACC, CONN), (KICK, (ACC, CONN), KICK, (ACC, WAIT), (ACC, FAIL), KICK,
                                        KICK, *K2, *KO)),
    accepted_waiting: ((ACC, WAIT), (KICK, (ACC, WAIT), KICK, KICK, KICK, KICK, KICK, *K2, *KO)),
    # Voting again before the round's verdict would stall the round: kicked.
    accepted_failed_mid_round: ((ACC, FAIL), (KICK, (ACC, FAIL), KICK, KICK, KICK, KICK,
                                              (ACC, FAIL), *K2, *KO)),
    # After a failed round a peer must re-establish the ring before optimizing it.
    accepted_failed_after_round: ((ACC, FAIL), (KICK, (ACC, FAIL), (ACC, VOTED), KICK, KICK, KICK,
                                                (ACC, FAIL), *K2, *KO)),
    accepted_sync_voted: ((ACC, SVOTED), (KICK, (ACC, SVOTED), KICK, KICK, KICK, KICK, KICK,
                                          *K2, *KO)),
    accepted_syncing: ((ACC, SYNCING), (KICK, (ACC, SYNCING), KICK, KICK, KICK, KICK, KICK, KICK,
                                        (ACC, SDONE), *KO)),
    accepted_sync_done: ((ACC, SDONE), (KICK, (ACC, SDONE), KICK, KICK, KICK, KICK, KICK, *K2,
                                        *KO)),
    # Blocked in the vote: no other call, no second vote, nothing to measure.
    accepted_optimize_voted: ((ACC, OVOTED), (KICK, (ACC, OVOTED), KICK, KICK, KICK, KICK, KICK,
                                              *K2, *KO)),
    # Optimizing: only the measurements it is asked for (none yet, see the setup).
    accepted_optimizing: ((ACC, OPTIMIZING), (KICK, (ACC, OPTIMIZING), KICK, KICK, KICK, KICK,
                                              KICK, *K2, *KO)),
}

CASES = [
    (setup, name, start, fate)
    for setup, (start, fates) in TABLE.items()
    for name, fate in zip(MESSAGES, fates, strict=True)
]


def message(name: str, h: MasterHarness, subject: int) -> Message:
    current = h.latest_round
    match name:
        case "register":
            return Register(protocol_version=PROTOCOL_VERSION, peer_group=0, p2p_port=9)
        case "heartbeat":
            return Heartbeat()
        case "vote":
            return VoteEstablish(accept_new_peers=True)
        case "report_ok":
            return P2PEstablished(round=current, success=True)
        case "report_failed":
            return P2PEstablished(round=current, success=False)
        case "report_stale":
            return P2PEstablished(round=current + 1, success=True)
        case "pending":
            return VotePeersPending()
        case "sync_vote":
            return sync_vote()
        case "sync_done":
            return sync_done(h, subject)
        case "optimize":
            return VoteOptimizeTopology()
        case "link_measured":
            # The link the subject was last asked for, else one from the other peer in
            # the first optimization.
            asked = h.received(subject, MeasureLink)
            if asked:
                optimization, sender = asked[-1].optimization, asked[-1].source.peer_id
            else:
                optimization = 1
                sender = next(p for c, p in h.peer_ids.items() if c != subject)
            return LinkMeasured(
                optimization=optimization, sender=sender, bandwidth=1e9, latency=1e-4
            )
    raise AssertionError(name)  # pragma: no cover


def test_table_covers_every_reachable_combination() -> None:
    starts = {start for start, _fates in TABLE.values()}
    # A REGISTERED peer never votes, syncs or optimizes, so it is never VOTE_ESTABLISH,
    # in a sync or in an optimization; every other pair occurs.
    never = {(REG, state) for state in (VOTED, SVOTED, SYNCING, SDONE, OVOTED, OPTIMIZING)}
    assert starts == set(itertools.product(PeerPhase, PeerState)) - never


@pytest.mark.parametrize(
    ("setup", "name", "start", "fate"),
    CASES,
    ids=[f"{setup.__name__}-{name}" for setup, name, _start, _fate in CASES],
)
def test_message_in_state(
    setup: Setup,
    name: str,
    start: tuple[PeerPhase, PeerState],
    fate: tuple[PeerPhase, PeerState] | None,
) -> None:
    h = MasterHarness()
    subject, other = setup(h)
    assert h.where(subject) == start
    other_before = h.view(other)
    round_before = h.core.round_in_progress

    actions = h.send(subject, message(name, h, subject))

    if fate is KICK:
        assert was_kicked(actions, subject)
        assert h.view(subject) is None
        assert h.kick_reason(subject) is not None
    else:
        assert only(actions, subject) == []
        assert h.where(subject) == fate
        assert h.core.round_in_progress == round_before
    # The other peer is untouched either way: nothing sent to it, its state unchanged.
    assert only(actions, other) == []
    assert h.view(other) == other_before
