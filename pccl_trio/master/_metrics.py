"""The master's Prometheus metrics, built from its run snapshot when they are scraped.

Theory of operation
-------------------
The master's core counts every run event it reports (``_core.report``) by kind and
label, and knows its peers, groups, rings and waiting votes; ``MasterCore.status``
reads all of that at once. The metrics are a ``prometheus_client`` collector over that
snapshot: a scrape (from the HTTP server's thread) asks the event loop for a fresh
snapshot (``trio.from_thread.run_sync``: the core is only ever touched from its own
thread), and turns it into metric families. Nothing runs per message or per
collective, so the metrics cost the hot path nothing; counters are exactly the core's
counts, and so move by exactly what the log says happened.

Names follow Prometheus conventions (``pccl_master_`` prefix, ``_total`` counters,
base units); label values come from small fixed sets (peer groups, phases, outcomes,
kick causes, call names): no label per peer, tag or connection.

``prometheus-client`` is optional (the ``observability`` extra): it is imported only
when metrics are asked for.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import trio

from .._core.messages import Outcome
from .._core.report import KickCause
from .._core.stalls import call_name
from .._core.status import StatusReply

__all__ = ["COUNTERS", "MasterCollector", "import_prometheus", "serve_metrics"]

#: Counters: (metric name without ``_total``, help, the run event counted, its label's
#: name or "" for none). ``_sum`` counters add the events' totals (bytes) instead.
COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    ("pccl_master_peers_joined", "Peers that registered.", "joined", ""),
    ("pccl_master_peers_returned", "Members that came back after a master restart.", "returned", ""),
    ("pccl_master_peers_left", "Peers removed from the run, kicked or not.", "left", ""),
    ("pccl_master_kicks", "Peers the master removed, by cause.", "kicked", "cause"),
    ("pccl_master_rounds", "Establishment rounds, by outcome.", "round", "outcome"),
    ("pccl_master_ring_changes", "Times a peer group's ring changed.", "ring", ""),
    ("pccl_master_collectives", "Collectives (all-reduces, barriers, broadcasts, all-gathers, "
     "reduce-scatters) that got their verdict, by outcome.", "completed", "outcome"),
    ("pccl_master_collective_aborts", "Collective attempts aborted.", "aborted", ""),
    ("pccl_master_leases", "Leases on a tag granted to a peer group (its next all-reduces "
     "of the tag run without the master).", "leased", ""),
    ("pccl_master_leases_ended", "Leases that ended (a failure, a long wait, a vote outside "
     "the lease, a member leaving).", "lease_ended", ""),
    ("pccl_master_syncs", "Shared-state syncs completed.", "synced", ""),
    ("pccl_master_sync_failures", "Peers that could not fetch the shared state.", "sync_failed", ""),
    ("pccl_master_optimizations", "Topology optimizations started.", "optimizing", ""),
    ("pccl_master_link_measurements", "Links measured for topology optimizations.", "link_measured", ""),
    ("pccl_master_link_failures", "Links that could not be measured.", "link_failed", ""),
    ("pccl_master_stall_warnings", "Warnings about votes waiting for peers, by call.", "stalled", "call"),
    ("pccl_master_votes_refused", "Votes refused after the stall timeout, by call.", "refused", "call"),
)


#: The label values of counters whose labels form a known set.
_KNOWN_LABELS: dict[str, tuple[str, ...]] = {
    "kicked": tuple(cause.value for cause in KickCause),
    "completed": tuple(outcome.name.lower() for outcome in Outcome),
    "round": ("succeeded", "failed"),
    "stalled": (),
    "refused": (),
}


def import_prometheus() -> Any:
    """``prometheus_client``, or an error that says how to get it."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the metric families)
    except ImportError as exc:
        raise RuntimeError(
            "metrics need prometheus-client: pip install 'pccl_trio[observability]'"
        ) from exc
    return prometheus_client


class MasterCollector:
    """A ``prometheus_client`` collector of one master (see the module docstring).

    Args:
        snapshot: returns the master's ``StatusReply``; called from the scraping thread.
    """

    def __init__(self, snapshot: Callable[[], StatusReply | None]) -> None:
        self._snapshot = snapshot
        self._prometheus = import_prometheus()

    def describe(self) -> list[Any]:
        return []  # no snapshot at registration: families are known only when collected

    def collect(self) -> Iterator[Any]:
        status = self._snapshot()
        if status is None:
            return
        core = self._prometheus.core
        yield _gauge(core, "pccl_master_uptime_seconds", "Seconds since the master started.",
                     [], [((), status.uptime_seconds)])
        yield _gauge(core, "pccl_master_peers", "Registered peers, by peer group and phase.",
                     ["group", "phase"],
                     [((str(t.group), t.phase), t.count) for t in status.tallies])
        yield _gauge(core, "pccl_master_peer_groups", "Peer groups with accepted members.",
                     [], [((), len(status.groups))])
        groups = [(str(g.group),) for g in status.groups]
        yield _gauge(core, "pccl_master_world_size", "Accepted members, by peer group.",
                     ["group"], [(k, g.world) for k, g in zip(groups, status.groups, strict=True)])
        yield _gauge(core, "pccl_master_ring_stale",
                     "1 while a peer group's ring must be re-established before a collective runs.",
                     ["group"], [(k, int(g.stale)) for k, g in zip(groups, status.groups, strict=True)])
        yield _gauge(core, "pccl_master_ring_predicted_seconds",
                     "Predicted seconds of an all-reduce of the reference size on the group's "
                     "ring (only where every link of it was measured).",
                     ["group"], [(k, g.predicted_seconds) for k, g in zip(groups, status.groups, strict=True)
                                 if g.predicted_seconds >= 0])
        yield _gauge(core, "pccl_master_shared_state_revision",
                     "The shared-state revision a peer group's next sync expects.",
                     ["group"], [(k, g.revision) for k, g in zip(groups, status.groups, strict=True)
                                 if g.has_revision])
        # By the call's name: a label never carries a tag.
        waiting: collections.Counter[tuple[str]] = collections.Counter(
            (call_name(w.call),) for w in status.waiting
        )
        oldest: dict[tuple[str], float] = {}
        for w in status.waiting:
            key = (call_name(w.call),)
            oldest[key] = max(oldest.get(key, 0.0), w.seconds)
        yield _gauge(core, "pccl_master_votes_waiting", "Votes waiting for members, by call.",
                     ["call"], list(waiting.items()))
        yield _gauge(core, "pccl_master_vote_wait_seconds",
                     "How long the oldest vote of each call has waited for members.",
                     ["call"], list(oldest.items()))
        running: collections.Counter[tuple[str]] = collections.Counter(
            (str(c.group),) for c in status.collectives
        )
        yield _gauge(core, "pccl_master_collectives_running",
                     "All-reduce attempts commenced and not ended, by peer group.",
                     ["group"], [(k, running.get(k, 0)) for k in groups])
        counts: dict[str, list[tuple[tuple[str, ...], float]]] = collections.defaultdict(list)
        planned = leased = 0
        for count in status.counts:
            counts[count.event].append(((count.label,), count.count))
            if count.event == "synced":
                planned += count.total
            elif count.event == "lease_ended":
                leased += count.total
        for name, documentation, event, label in COUNTERS:
            family = core.CounterMetricFamily(name, documentation, labels=[label] if label else [])
            # Every series exists from the start, at 0, where its labels are known.
            seen: dict[tuple[str, ...], float] = dict.fromkeys(
                [(value,) for value in _KNOWN_LABELS.get(event, ("",))], 0.0
            )
            seen.update(counts.get(event, []))
            for labels, value in seen.items():
                family.add_metric(list(labels) if label else [], value)
            yield family
        family = core.CounterMetricFamily(
            "pccl_master_sync_planned_bytes",
            "Bytes the fetchers of completed shared-state syncs were told to fetch.",
        )
        family.add_metric([], planned)
        yield family
        family = core.CounterMetricFamily(
            "pccl_master_leased_collectives",
            "All-reduces that succeeded under leases, counted when their lease ends (until "
            "then only the peers' metrics count them); one the master settled when its "
            "lease ended counts in pccl_master_collectives_total instead.",
        )
        family.add_metric([], leased)
        yield family


def _gauge(core: Any, name: str, documentation: str, labels: list[str],
           samples: list[tuple[tuple[str, ...], float]]) -> Any:
    family = core.GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def _snapshot_from_loop(status: Callable[[], StatusReply], token: trio.lowlevel.TrioToken
                        ) -> Callable[[], StatusReply | None]:
    def snapshot() -> StatusReply | None:
        try:
            return trio.from_thread.run_sync(status, trio_token=token)
        except trio.RunFinishedError:
            return None

    return snapshot


@contextlib.asynccontextmanager
async def serve_metrics(host: str, port: int, status: Callable[[], StatusReply]
                        ) -> Any:
    """Serve the master's metrics over HTTP on ``host:port`` (0: any free port) while
    the context is open; yields the bound ``(host, port)``."""
    prometheus = import_prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(_snapshot_from_loop(status, trio.lowlevel.current_trio_token())))
    server, thread = prometheus.start_http_server(port, addr=host, registry=registry)
    try:
        yield server.server_address[:2]
    finally:
        # Off the event loop: a scrape in progress waits for the loop to answer it.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
            server.server_close()
            await trio.to_thread.run_sync(thread.join)
