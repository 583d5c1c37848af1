"""A peer's Prometheus metrics (``Config(metrics=...)``): what its calls did and cost.

Theory of operation
-------------------
``PeerMetrics`` holds ``prometheus_client`` counters and histograms in one registry and
is told, by the parts that know, what each call ended with: an all-reduce's outcome,
duration and bytes (``AllReduces``; a Top-k all-reduce is one, counted with its wire
bytes), the same of a broadcast, all-gather or reduce-scatter in families of their own
with the call as a label, a barrier's outcome and duration, the time spent restoring an
aborted in-place input, the retries of ``all_reduce_multiple_with_retry``, a shared-state sync's
outcome and bytes (``SharedStateSync``), and each time the master link was got back
(``Reconnector``). An update is a few counter increments per call, nothing per
slice or per message.

``Config.metrics`` says where they go:

- ``None`` (the default): nowhere; ``NO_METRICS`` takes every update and does nothing,
  and ``prometheus-client`` is not imported.
- a ``CollectorRegistry`` (``prometheus_client.REGISTRY`` for the process's default
  one): the metrics are registered there, for an exporter the program already runs.
- ``"HOST:PORT"``: the communicator serves them itself at ``http://HOST:PORT/metrics``
  from when it connects until it closes (port 0: any free port;
  ``Communicator.metrics_address`` says which).

Communicators of one process that name the same registry share its metrics (they add
up): metric names can be registered once per registry. Label values come from fixed
sets (outcomes, directions, ``COLLECTIVES``); there is no label per peer, tag or tensor.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import trio

from .._errors import InvalidArgument
from ..transport import parse_address

__all__ = [
    "COLLECTIVES", "NO_METRICS", "OUTCOMES", "SYNC_OUTCOMES", "MetricsEndpoint", "NoMetrics",
    "PeerMetrics", "metrics_for", "peer_metrics",
]

#: How an all-reduce ended, as the ``outcome`` label says it.
OUTCOMES = ("success", "aborted", "rejected", "blocked", "failed")
#: The calls counted in the ``pccl_peer_collective*`` families, as their label says
#: them (all-reduces and barriers have families of their own).
COLLECTIVES = ("broadcast", "all_gather", "reduce_scatter")
#: How a shared-state sync ended.
SYNC_OUTCOMES = ("success", "rejected", "failed", "cancelled")
#: Seconds: from a fast loopback all-reduce to a slow transfer over a WAN.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0, 300.0)


class NoMetrics:
    """Metrics switched off: every update is accepted and dropped."""

    def all_reduce(self, outcome: str, seconds: float, sent: int, received: int,
                   restore_seconds: float) -> None:
        pass

    def barrier(self, outcome: str, seconds: float) -> None:
        pass

    def collective(self, called: str, outcome: str, seconds: float, sent: int,
                   received: int) -> None:
        """A broadcast, all-gather or reduce-scatter ended (``called``: in
        ``COLLECTIVES``)."""

    def retries(self, count: int) -> None:
        pass

    def sync(self, outcome: str, seconds: float, sent: int, received: int) -> None:
        pass

    def reconnected(self) -> None:
        pass


NO_METRICS = NoMetrics()


class PeerMetrics(NoMetrics):
    """The metrics of the communicators that register into ``registry``."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self.all_reduces, self.all_reduce_seconds = _by_outcome(
            registry, "pccl_peer_all_reduce", "All-reduces this peer finished",
            "Seconds from an all-reduce's call to its result (one attempt)",
        )
        self.all_reduce_bytes = Counter(
            "pccl_peer_all_reduce_bytes", "Payload bytes of successful all-reduces, by direction.",
            ["direction"], registry=registry,
        )
        self.restore_seconds = Histogram(
            "pccl_peer_restore_seconds",
            "Seconds spent putting back an aborted all-reduce's in-place input.",
            buckets=_BUCKETS, registry=registry,
        )
        self.all_reduce_retries = Counter(
            "pccl_peer_all_reduce_retries",
            "All-reduces all_reduce_multiple_with_retry ran again after an abort.",
            registry=registry,
        )
        self.barriers, self.barrier_seconds = _by_outcome(
            registry, "pccl_peer_barrier", "Barriers this peer finished",
            "Seconds from a barrier's call to its result",
        )
        self.collectives, self.collective_seconds = _by_outcome(
            registry, "pccl_peer_collective", "Broadcasts, all-gathers and reduce-scatters "
            "this peer finished", "Seconds from such a call to its result",
            ("collective", "outcome"),
        )
        self.collective_bytes = Counter(
            "pccl_peer_collective_bytes",
            "Payload bytes of successful broadcasts, all-gathers and reduce-scatters, by "
            "collective and direction.", ["collective", "direction"], registry=registry,
        )
        self.syncs, self.sync_seconds = _by_outcome(
            registry, "pccl_peer_shared_state_sync", "Shared-state syncs this peer finished",
            "Seconds of a shared-state sync",
        )
        self.sync_bytes = Counter(
            "pccl_peer_shared_state_bytes",
            "Shared-state bytes of completed syncs, sent and received, by direction.",
            ["direction"], registry=registry,
        )
        self.reconnects = Counter(
            "pccl_peer_master_reconnects",
            "Times this peer got its master back after losing the link.", registry=registry,
        )
        # Every series exists from the start; an all-reduce's update finds its children
        # here rather than by label.
        self._all_reduce = {
            o: (self.all_reduces.labels(o), self.all_reduce_seconds.labels(o)) for o in OUTCOMES
        }
        self._barrier = {
            o: (self.barriers.labels(o), self.barrier_seconds.labels(o)) for o in OUTCOMES
        }
        self._collective = {
            (c, o): (self.collectives.labels(c, o), self.collective_seconds.labels(c, o))
            for c in COLLECTIVES for o in OUTCOMES
        }
        self._collective_bytes = {
            (c, d): self.collective_bytes.labels(c, d)
            for c in COLLECTIVES for d in ("sent", "received")
        }
        self._sent = self.all_reduce_bytes.labels("sent")
        self._received = self.all_reduce_bytes.labels("received")
        for outcome in SYNC_OUTCOMES:
            self.syncs.labels(outcome)
        for direction in ("sent", "received"):
            self.sync_bytes.labels(direction)

    def all_reduce(self, outcome: str, seconds: float, sent: int, received: int,
                   restore_seconds: float) -> None:
        count, duration = self._all_reduce[outcome]
        count.inc()
        duration.observe(seconds)
        if sent:
            self._sent.inc(sent)
        if received:
            self._received.inc(received)
        if restore_seconds:
            self.restore_seconds.observe(restore_seconds)

    def barrier(self, outcome: str, seconds: float) -> None:
        count, duration = self._barrier[outcome]
        count.inc()
        duration.observe(seconds)

    def collective(self, called: str, outcome: str, seconds: float, sent: int,
                   received: int) -> None:
        count, duration = self._collective[called, outcome]
        count.inc()
        duration.observe(seconds)
        if sent:
            self._collective_bytes[called, "sent"].inc(sent)
        if received:
            self._collective_bytes[called, "received"].inc(received)

    def retries(self, count: int) -> None:
        self.all_reduce_retries.inc(count)

    def sync(self, outcome: str, seconds: float, sent: int, received: int) -> None:
        self.syncs.labels(outcome).inc()
        self.sync_seconds.labels(outcome).observe(seconds)
        self.sync_bytes.labels("sent").inc(sent)
        self.sync_bytes.labels("received").inc(received)

    def reconnected(self) -> None:
        self.reconnects.inc()


def _by_outcome(registry: Any, name: str, finished: str, seconds: str,
                labels: tuple[str, ...] = ("outcome",)) -> tuple[Any, Any]:
    """A counter ``{name}s`` of the calls that finished and a histogram
    ``{name}_seconds`` of how long they took, both by ``labels`` (``finished`` and
    ``seconds`` their help, without the labels')."""
    from prometheus_client import Counter, Histogram

    by = f", by {' and '.join(labels)}."
    return (
        Counter(f"{name}s", f"{finished}{by}", list(labels), registry=registry),
        Histogram(
            f"{name}_seconds", f"{seconds}{by}", list(labels), buckets=_BUCKETS,
            registry=registry,
        ),
    )


_BY_REGISTRY: weakref.WeakKeyDictionary[Any, PeerMetrics] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def metrics_for(registry: Any) -> PeerMetrics:
    """The peer metrics registered in ``registry`` (made on first use)."""
    with _LOCK:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = PeerMetrics(registry)
        return metrics


class MetricsEndpoint:
    """A communicator's own HTTP endpoint of its metrics (``Config.metrics="HOST:PORT"``);
    without a ``registry``, none (it starts and closes nothing)."""

    def __init__(self, host: str = "", port: int = 0, registry: Any = None) -> None:
        self._host, self._port, self._registry = host, port, registry
        self._server: Any = None
        self.address: tuple[str, int] | None = None

    def start(self) -> None:
        """Serve from now on (``address`` is then where).

        Raises:
            OSError: the address cannot be bound.
        """
        if self._registry is None:
            return
        from prometheus_client import start_http_server

        # Its thread is a daemon that ends with the server's loop (``aclose``).
        self._server, _thread = start_http_server(self._port, self._host, self._registry)
        self.address = self._server.server_address[:2]

    async def aclose(self) -> None:
        """Stop serving (the server's loop notices within half a second)."""
        server, self._server = self._server, None
        if server is not None:
            await trio.to_thread.run_sync(server.shutdown)
            server.server_close()


def peer_metrics(setting: Any) -> tuple[NoMetrics, MetricsEndpoint]:
    """The metrics ``Config.metrics`` asks for, and the endpoint that serves them.

    Raises:
        InvalidArgument: metrics are asked for but prometheus-client is not installed.
    """
    if setting is None:
        return NO_METRICS, MetricsEndpoint()
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise InvalidArgument(
            "Config.metrics needs prometheus-client: pip install 'pccl_trio[observability]'"
        ) from None
    if isinstance(setting, str):
        host, port = parse_address(setting)
        registry = CollectorRegistry()
        return PeerMetrics(registry), MetricsEndpoint(host, port, registry)
    return metrics_for(setting), MetricsEndpoint()
