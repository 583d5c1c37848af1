"""What the master reports of the run: run events (one log record each, with fields),
their counts, and the read-only snapshot an observer gets with ``StatusRequest``."""

from __future__ import annotations

import json
import logging

import pytest

from pccl_trio._core.master import Send
from pccl_trio._core.messages import (
    CollectiveKind,
    CollectiveVerdict,
    Outcome,
    StatusReply,
    StatusRequest,
)
from pccl_trio._core.report import KickCause, RunEvent, RunKind
from pccl_trio._logging import JsonFormatter
from pccl_trio._status import render

from .master_harness import LIVENESS_TIMEOUT, MasterHarness
from .scenarios import accepted, started


def counts(h: MasterHarness) -> dict[tuple[str, str], int]:
    return {(c.event, c.label): c.count for c in h.core.status().counts}


def test_each_run_event_is_reported_once_with_its_fields() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    seq = started(h, 7, 1, 2, 3)
    for conn in (1, 2, 3):
        h.complete(conn, 7, seq)
    reports: list[RunEvent] = []
    h.close(3)  # peer 3 leaves: a collective running then would abort
    reports += h.core.take_reports()
    assert [r.kind for r in reports] == [RunKind.LEFT]
    assert dict(reports[0].fields) == {"peer": 3, "group": 0, "reason": "connection closed"}
    assert counts(h)[("completed", "success")] == 1
    assert counts(h)[("joined", "")] == 3
    assert counts(h)[("left", "")] == 1
    assert counts(h)[("round", "succeeded")] >= 1


def test_an_abort_and_a_kick_are_counted_with_their_reason_and_cause() -> None:
    h = MasterHarness()
    accepted(h, 1, 2, 3)
    seq = started(h, 7, 1, 2, 3)
    h.complete(1, 7, seq)
    # Peers 2 and 3 go silent; 1 keeps its heartbeats: the master kicks 2 and 3.
    h.now = LIVENESS_TIMEOUT / 2
    h.heartbeat(1)
    h.now = LIVENESS_TIMEOUT + 0.5
    h.heartbeat(1)
    actions = h.tick()
    reports = h.core.take_reports()
    kicks = [r for r in reports if r.kind is RunKind.KICKED]
    assert [(r.fields["peer"], r.fields["cause"]) for r in kicks] == [
        (2, KickCause.LIVENESS), (3, KickCause.LIVENESS)
    ]
    assert any(r.kind is RunKind.ABORTED and r.fields["tag"] == 7 for r in reports)
    verdicts = [a.message for a in actions if isinstance(a, Send)
                and isinstance(a.message, CollectiveVerdict)]
    assert [v.outcome for v in verdicts] == [Outcome.ABORTED]
    status = h.core.status()
    assert counts(h)[("kicked", "liveness")] == 2
    assert counts(h)[("completed", "aborted")] == 1
    assert [(k.peer_id, k.cause) for k in status.kicks] == [(2, "liveness"), (3, "liveness")]
    assert "no message for" in status.kicks[0].reason
    assert status.peers_total == 1


def test_an_observer_gets_the_run_and_changes_nothing() -> None:
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 5)  # a vote waiting for peer 2
    h.now = 12.0
    h.heartbeat(1)
    h.heartbeat(2)
    before = [h.view(c) for c in (1, 2)]
    h.open(9)
    h.send(9, StatusRequest())
    reply = h.last(9, StatusReply)
    assert 9 in h.closed and 9 not in h.peer_ids  # answered, closed, never a member
    assert [h.view(c) for c in (1, 2)] == before
    assert [(p.peer_id, p.group, p.phase, p.port) for p in reply.peers] == [
        (1, 0, "accepted", 10001), (2, 0, "accepted", 10002)
    ]
    assert reply.peers_total == 2
    [group] = reply.groups
    assert (group.group, group.world, sorted(group.ring), group.stale) == (0, 2, [1, 2], False)
    assert group.predicted_seconds < 0  # no link measured yet
    [waiting] = reply.waiting
    assert waiting.missing == (2,) and waiting.seconds == pytest.approx(12.0)
    # The vote goes on as if nobody had looked.
    h.initiate(2, 5)
    assert h.received(2, CollectiveVerdict) == []
    status = h.core.status()
    assert status.waiting == ()
    # Running: peer 1 completed, peer 2 not yet.
    h.now = 13.5
    h.complete(1, 5)
    [running] = h.core.status().collectives
    assert (running.tag, running.incomplete, running.seconds) == (5, (2,), pytest.approx(1.5))


def test_a_collective_waiting_or_running_is_named_by_its_call() -> None:
    """A broadcast shows as one in "waiting" and "collectives running", not as an
    all-reduce."""
    h = MasterHarness()
    accepted(h, 1, 2)
    h.initiate(1, 6, kind=CollectiveKind.BROADCAST, root=2)
    [waiting] = h.core.status().waiting
    assert waiting.call == "broadcast(tag=6)"
    h.initiate(2, 6, kind=CollectiveKind.BROADCAST, root=2)
    h.complete(1, 6)
    [running] = h.core.status().collectives
    assert (running.call, running.tag, running.incomplete) == ("broadcast", 6, (2,))
    screen = render(h.core.status(), "master:1")
    assert "collectives running:\n  broadcast tag 6 (attempt" in screen, screen


def test_a_status_reply_round_trips_the_wire() -> None:
    from pccl_trio._core.records import decode_message, encode_message

    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.close(2)
    reply = h.core.status()
    assert decode_message(StatusReply.KIND, encode_message(reply)) == reply


def test_run_events_are_one_json_line_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pccl_trio.master.run")
    h = MasterHarness()
    accepted(h, 1, 2)
    h.close(2)
    records = [r for r in caplog.records if hasattr(r, "run_event")]
    kinds = [r.run_event.kind for r in records]  # type: ignore[attr-defined]
    assert kinds.count(RunKind.JOINED) == 2 and kinds[-1] is RunKind.LEFT
    line = json.loads(JsonFormatter().format(records[-1]))
    assert line["event"] == "left" and line["peer"] == 2 and line["level"] == "INFO"
    assert line["message"] == "peer 2 left: connection closed"
    rings = [json.loads(JsonFormatter().format(r)) for r in records
             if r.run_event.kind is RunKind.RING]  # type: ignore[attr-defined]
    assert [(r["ring"], r["previous"]) for r in rings] == [([1], []), ([1, 2], [1])]


def test_the_links_table_keeps_its_columns_apart() -> None:
    from pccl_trio._core.bandwidth import BandwidthStore
    from pccl_trio._core.links import _format_links

    store = BandwidthStore()
    store.record(1, 22, 1.25e9, 1e-4)  # 10000.0 Mbit/s: as wide as the old columns
    store.record(22, 1, 3.0e5, 1e-4)
    store.mark_unreachable(1, 333)
    table = _format_links([1, 22, 333], store).splitlines()
    rows = [line.split() for line in table]
    assert rows[0] == ["1", "22", "333"]
    assert rows[1] == ["1", "10000.0", "x"]
    assert rows[2] == ["22", "2.4", "-"]
    assert rows[3] == ["333", "-", "-"]
    # Right-aligned in columns of equal width, two spaces at least between entries.
    assert len({len(line) for line in table}) == 1
    assert "  10000.0" in table[1]


def test_metric_labels_never_carry_a_tag() -> None:
    from pccl_trio.master._metrics import MasterCollector

    h = MasterHarness(stall_warning=5.0)
    accepted(h, 1, 2)
    h.initiate(1, 41)
    h.now = 6.0
    h.tick()  # a stall warning for all_reduce(tag=41)
    families = {f.name: f for f in MasterCollector(h.core.status).collect()}
    labels = [s.labels for name in ("pccl_master_votes_waiting", "pccl_master_stall_warnings")
              for s in families[name].samples]
    assert labels and all(label == {"call": "all_reduce"} for label in labels), labels


def test_a_reply_always_fits_an_observers_frame() -> None:
    """Thousands of peers with the longest host names: the reply is cut to the budget,
    says so, and still counts every peer."""
    from pccl_trio._core.records import encode_message
    from pccl_trio._core.status import STATUS_BUDGET, PeerStatus, PeerTally, fit

    host = "\u4e16" * 253  # three bytes each in UTF-8
    peers = tuple(
        PeerStatus(peer_id=i + 1, group=0, host=host, port=1, phase="accepted", state="idle",
                   silent_seconds=0.0, identity="")
        for i in range(3000)
    )
    reply = StatusReply(
        uptime_seconds=1.0, reference_bytes=1, peers_total=3000,
        tallies=(PeerTally(group=0, phase="accepted", count=3000),), peers=peers, groups=(),
        waiting=(), collectives=(), kicks=(), counts=(),
    )
    assert len(encode_message(reply)) > STATUS_BUDGET
    cut = fit(reply)
    assert len(encode_message(cut)) <= STATUS_BUDGET
    assert cut.truncated and 0 < len(cut.peers) < 3000
    assert cut.tallies == reply.tallies and cut.peers_total == 3000
    assert fit(cut) == cut  # what fits is left alone


def test_the_peers_gauge_counts_every_peer_and_the_clock_moves_between_events() -> None:
    from pccl_trio.master._metrics import MasterCollector

    h = MasterHarness()
    accepted(h, 1, 2, 3)
    h.now = 10.0
    h.heartbeat(1)
    later = h.core.status(now=25.0)
    assert later.uptime_seconds == pytest.approx(25.0)
    assert [p.silent_seconds for p in later.peers][0] == pytest.approx(15.0)
    families = {f.name: f for f in MasterCollector(h.core.status).collect()}
    [sample] = families["pccl_master_peers"].samples
    assert (sample.labels, sample.value) == ({"group": "0", "phase": "accepted"}, 3)


def test_the_screen_does_not_pass_control_characters_through() -> None:
    from pccl_trio._core.status import PeerStatus
    from pccl_trio._status import render

    reply = StatusReply(
        uptime_seconds=1.0, reference_bytes=1, peers_total=1, tallies=(),
        peers=(PeerStatus(peer_id=1, group=0, host="evil\x1b[2J\x07", port=1, phase="accepted",
                          state="idle", silent_seconds=0.0, identity=""),),
        groups=(), waiting=(), collectives=(), kicks=(), counts=(),
    )
    screen = render(reply, "m:1")
    assert "\x1b" not in screen and "\x07" not in screen and "evil?[2J?" in screen


def test_the_screen_says_what_leased_work_is_and_what_predicted_means() -> None:
    from pccl_trio._core.status import GroupStatus, RunCount
    from pccl_trio._status import render

    reply = StatusReply(
        uptime_seconds=1.0, reference_bytes=64 << 20, peers_total=0, tallies=(), peers=(),
        groups=(GroupStatus(group=0, world=2, ring=(1, 2), predicted_seconds=0.5, stale=False,
                            revision=0, has_revision=False),),
        waiting=(), collectives=(), kicks=(),
        counts=(RunCount(event="completed", label="success", count=2),
                RunCount(event="leased", label="", count=2),
                RunCount(event="lease_ended", label="", count=2, total=38)),
    )
    screen = render(reply, "m:1")
    assert "collectives: 2 succeeded through the master" in screen, screen
    assert "leases: 2 granted, 2 ended, 38 all-reduces succeeded under them" in screen, screen
    assert "predicted: one all-reduce of 64 MiB" in screen, screen


def test_an_observer_without_an_allowed_identity_gets_nothing() -> None:
    from pccl_trio._core.master import (
        Close,
        ConnectionOpened,
        MasterCore,
        MessageReceived,
    )
    from pccl_trio._core.messages import Kick

    core = MasterCore(
        heartbeat_interval=1.0, liveness_timeout=5.0, round_timeout=30.0, solve_seconds=1.0,
        search_seconds=1.0, reference_bytes=1 << 20, stall_timeout=100.0, stall_warning=10.0,
        allowed_identities=frozenset({bytes(32)}),
    )
    core.handle(ConnectionOpened(conn=1, host="10.0.0.9", identity=b""), 0.0)
    actions = core.handle(MessageReceived(conn=1, message=StatusRequest()), 0.0)
    sent = [a.message for a in actions if isinstance(a, Send)]
    assert [type(m) for m in sent] == [Kick] and "identit" in sent[0].reason  # type: ignore[attr-defined]
    assert any(isinstance(a, Close) for a in actions)
    assert core.status().counts == ()  # an observer refused is not a kick of the run


def test_the_json_fields_are_documented_every_one() -> None:
    """``docs/observability.md`` lists every field of the reply, and of each record in
    its lists, exactly."""
    import dataclasses as dc
    import pathlib
    import re

    from pccl_trio._core import status

    text = (pathlib.Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    table = text.split("| field | holds |", 1)[1].split("\n\n", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", table, re.M)}
    assert set(rows) == {f.name for f in dc.fields(StatusReply)}
    records = {"tallies": status.PeerTally, "peers": status.PeerStatus, "groups": status.GroupStatus,
               "waiting": status.WaitStatus, "collectives": status.CollectiveStatus,
               "kicks": status.KickStatus, "counts": status.RunCount}
    for name, kind in records.items():
        listed = re.match(r"`\{([^}]*)\}`", rows[name])
        assert listed is not None, rows[name]
        assert listed.group(1).split(", ") == [f.name for f in dc.fields(kind)], name
