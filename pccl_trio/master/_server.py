"""The trio shell around ``MasterCore``.

One task per connection reads frames and turns them into core events; one task
feeds those events (and the passing of time) to the core, in order, and carries out
the actions it returns. A frame for a connection is written at once when the socket
takes it and nothing is queued before it (``FramedStream.write_nowait``: a reply
leaves without a task switch); otherwise it waits in the queue of the connection's
writer task, so a slow or stuck peer can never block the master's event loop or other
peers.

With a run secret, a connection first completes the handshake (``transport.secure_server``)
within ``connect_timeout``, or is closed without a word; only then does the core hear of
it, and every frame after it is authenticated by the connection's channel.

No input may end or freeze the master. A connection's first frame must be a small
``Register`` and later ones peer-to-master kinds within their size limits, judged from
the frame header before the body is read (``wire.Admission``); bodies large enough to
take a while to validate are decoded in a worker thread, one at a time, so the event
loop keeps serving heartbeats; at most ``MAX_NEW_CONNECTIONS`` connections may wait
for their first frame at once (``transport.serve_accepted``, which also rides out a
listener that runs out of file descriptors). If handling one connection's event
raises all the same (a bug), that connection is dropped and the error logged; the
master goes on.

``serve_master_tcp(advertise=RUN)`` also announces the master over mDNS/DNS-SD while it
serves (``transport.advertise_master``), so that peers can find it by the run's name.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import trio

from .. import topology
from .._config import Config
from .._core.channel import Channel, HandshakeFailed, Purpose
from .._core.errors import RemoteProtocolError
from .._core.master import (
    Action,
    CancelSolve,
    Close,
    ConnectionBroken,
    ConnectionClosed,
    ConnectionOpened,
    Event,
    MasterCore,
    MessageReceived,
    Send,
    Solve,
    SolveFinished,
    Tick,
)
from .._core.messages import (
    C2M,
    Heartbeat,
    Register,
    StatusRequest,
    body_limits,
    bounded,
    message_kinds,
)
from .._core.wire import Admission, encode_control
from ..transport import (
    Arrived,
    Credential,
    FramedStream,
    TcpNetwork,
    advertise_master,
    check_advertise,
    format_address,
    listen_host,
    listener_address,
    remote_host,
    secure_server,
    serve_accepted,
    threads_allowed,
)
from ._metrics import serve_metrics

__all__ = ["serve_master", "serve_master_tcp"]

log = logging.getLogger("pccl_trio.master")

#: Events waiting for the core at most; readers block beyond it.
EVENT_BACKLOG = 64
#: Connections that have not sent their first frame yet, at most; more are closed at
#: once (each costs a task and a buffer until the liveness timeout drops it).
MAX_NEW_CONNECTIONS = 128
#: How a client fails the run-secret handshake.
HANDSHAKE_ERRORS = (
    HandshakeFailed, RemoteProtocolError, trio.TooSlowError, trio.BrokenResourceError,
    trio.ClosedResourceError,
)
#: Control bodies at least this large are decoded in a worker thread where threads are
#: allowed: validating a large vote takes long enough to delay other peers' heartbeats.
THREAD_DECODE_BYTES = 64 * 1024


#: Most events the core handles in a row before it looks at its deadlines again.
_BATCH = 64


class _Connection:
    def __init__(
        self, conn_id: int, stream: trio.abc.Stream, config: Config, admission: Admission,
        channel: Channel | None, arrived: Arrived,
    ) -> None:
        self.conn_id = conn_id
        self.framed = FramedStream(
            stream, max_control_frame=config.max_control_frame, admission=admission,
            decode=False, channel=channel,
        )
        self.arrived = arrived  # to call once a frame was received (``serve_accepted``)
        self.outgoing_send, self.outgoing_receive = trio.open_memory_channel[
            bytes | memoryview
        ](math.inf)
        self.queued = 0  # frames handed to the writer and not yet written by it
        self.closing = False
        self.scope = trio.CancelScope()
        self.flush_timeout = config.liveness_timeout

    def send(self, frame: bytes) -> None:
        """Send one sealed frame after those before it: written at once if the writer
        has nothing in hand and the socket takes it (no task switch on the way out),
        else (or what is left of it) queued for the writer."""
        if self.closing:
            return  # nothing follows the close
        rest = self.framed.write_nowait(frame) if not self.queued else memoryview(frame)
        if rest:
            self.outgoing_send.send_nowait(rest)
            self.queued += 1

    def close_after_flush(self) -> None:
        self.closing = True
        self.outgoing_send.close()


class _MasterServer:
    def __init__(self, config: Config, *, first_peer_id: int = 1) -> None:
        self.config = config
        self.credential = Credential.of(config)
        self.core = MasterCore(
            heartbeat_interval=config.heartbeat_interval,
            liveness_timeout=config.liveness_timeout,
            round_timeout=config.round_timeout,
            solve_seconds=config.topology_solve_seconds,
            search_seconds=config.topology_search_seconds,
            reference_bytes=config.topology_reference_bytes,
            stall_timeout=config.stall_timeout,
            stall_warning=config.stall_warning,
            allowed_identities=config.allowed_identities,
            content_digest=config.content_digest,
            first_peer_id=first_peer_id,
        )
        # Bounded: a connection whose frames arrive faster than the core handles them
        # waits (and, through TCP, so does its sender), instead of burying the
        # other peers' heartbeats under a backlog.
        self.events_send, self.events_receive = trio.open_memory_channel[Event](EVENT_BACKLOG)
        self.connections: dict[int, _Connection] = {}
        self.ids = itertools.count(1)
        self.solves: dict[int, threading.Event] = {}  # running solver jobs' stop switches
        self.nursery: trio.Nursery | None = None
        # Ring searches run in worker threads where threads are allowed; inline under a
        # virtual clock, which would race past a thread (budgets then count moves:
        # reproducible). Decided once the run is known (``serve_master``).
        self.threads = True
        self.ready: list[Event] = []  # results of inline searches, for the core
        self.decoding = trio.CapacityLimiter(1)  # large bodies, one at a time
        # What a connection may send: a small Register (or an observer's StatusRequest)
        # first, then peer kinds.
        limit = config.max_control_frame
        self.first_kinds = body_limits([Register, StatusRequest], limit)
        self.peer_kinds = body_limits(
            [c for c in message_kinds().values() if c.DIRECTION == C2M], limit
        )

    async def accept_loop(self, listener: trio.abc.Listener[Any], nursery: trio.Nursery) -> None:
        async with listener:
            await serve_accepted(
                listener, self.serve_connection, max_fresh=MAX_NEW_CONNECTIONS,
                nursery=nursery, log=log,
            )
            log.warning("listener %r closed; no longer accepting on it", listener)

    async def serve_connection(self, stream: trio.abc.Stream, arrived: Arrived) -> None:
        channel: Channel | None = None
        host = remote_host(stream)  # before anything can close it
        try:
            if self.credential is not None:
                _purpose, channel = await secure_server(
                    stream, self.credential, frozenset({Purpose.MASTER})
                )
        except BaseException as exc:
            arrived()
            await trio.aclose_forcefully(stream)
            if isinstance(exc, HANDSHAKE_ERRORS):  # closed without a word
                log.info("closing a connection from %s: no run-secret handshake: %s",
                         host, str(exc) or "it did not complete in time")
                return
            raise
        conn = _Connection(
            next(self.ids), stream, self.config,
            Admission(first=self.first_kinds, then=self.peer_kinds), channel, arrived,
        )
        self.connections[conn.conn_id] = conn
        try:
            await self.events_send.send(ConnectionOpened(
                conn=conn.conn_id, host=host,
                identity=b"" if channel is None else channel.peer_identity,
            ))
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.write_loop, conn)
                    await self.read_loop(conn)
                    await trio.sleep_forever()  # until the writer finishes the close
        finally:
            arrived()
            self.connections.pop(conn.conn_id, None)
            await conn.framed.aclose()

    async def read_loop(self, conn: _Connection) -> None:
        try:
            while True:
                frame = await conn.framed.receive_undecoded()
                conn.arrived()
                if self.threads and len(frame.fields) >= THREAD_DECODE_BYTES:
                    # The frame arrived, which proves the sender alive while it waits
                    # for a decoder (never the first frame: that is a small Register).
                    await self.events_send.send(
                        MessageReceived(conn=conn.conn_id, message=Heartbeat())
                    )
                    message = await trio.to_thread.run_sync(frame.decode, limiter=self.decoding)
                else:
                    message = frame.decode()
                await self.events_send.send(MessageReceived(conn=conn.conn_id, message=message))
        except RemoteProtocolError as exc:
            await self.events_send.send(
                ConnectionBroken(conn=conn.conn_id, reason=bounded(str(exc)))
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.events_send.send(ConnectionClosed(conn=conn.conn_id))

    async def write_loop(self, conn: _Connection) -> None:
        """Send queued frames until the core closes the queue, then end the connection."""
        try:
            async for frame in conn.outgoing_receive:
                await conn.framed.send_bytes(frame)
                conn.queued -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.events_send.send(ConnectionClosed(conn=conn.conn_id))
            async for _frame in conn.outgoing_receive:
                pass  # discard until the core's Close ends the queue
        conn.scope.cancel()

    def execute(self, actions: Sequence[Action]) -> None:
        for action in actions:
            match action:
                case Solve() if not self.threads:
                    # At once, before any later event (reproducible under virtual time).
                    self.ready.append(_search_event(action, threading.Event(), timed=False))
                    continue
                case Solve():
                    stop = threading.Event()
                    self.solves[action.job] = stop
                    assert self.nursery is not None
                    self.nursery.start_soon(self.solve, action, stop)
                    continue
                case CancelSolve(job=job):
                    stopping = self.solves.pop(job, None)
                    if stopping is not None:
                        stopping.set()
                    continue
            conn = self.connections.get(action.conn)
            if conn is None:
                continue
            match action:
                case Send(message=message):
                    try:
                        # Sealed here, in order: the order they are written.
                        conn.send(encode_control(message, conn.framed.channel))
                    except trio.ClosedResourceError:
                        pass
                case Close(reason=reason):
                    log.debug("closing connection %d: %s", action.conn, reason)
                    conn.close_after_flush()
                    # A silent peer may never drain its socket: bound the flush.
                    conn.scope.deadline = min(
                        conn.scope.deadline, trio.current_time() + conn.flush_timeout
                    )

    async def solve(self, job: Solve, stop: threading.Event) -> None:
        """Run one ring search in a worker thread, then hand its result to the core
        (unless cancelled: it stops at its next poll of ``stop``, and the thread is
        abandoned at once)."""
        try:
            result = await trio.to_thread.run_sync(
                _search_event, job, stop, abandon_on_cancel=True
            )
        finally:
            stop.set()
        if self.solves.pop(job.job, None) is not None:
            await self.events_send.send(result)

    def feed(self, event: Event) -> None:
        """Hand ``event`` to the core, carry out its actions, then do the same for the
        results of searches that ran inline meanwhile."""
        self.execute(self.handle(event))
        while self.ready:
            self.execute(self.handle(self.ready.pop(0)))

    def handle(self, event: Event) -> Sequence[Action]:
        """The core's actions for ``event``; if the core fails on it (a bug), the
        event's connection is dropped instead and the master goes on."""
        try:
            return self.core.handle(event, trio.current_time())
        except Exception:
            conn_id: int | None = getattr(event, "conn", None)
            log.exception(
                "the master failed to handle %s; %s", type(event).__name__,
                "ignoring it" if conn_id is None else f"dropping connection {conn_id}",
            )
        if conn_id is None:
            return []
        if not isinstance(event, ConnectionBroken):
            # Kick it the normal way, so every part forgets it.
            broken = ConnectionBroken(
                conn=conn_id, reason="the master could not handle its message"
            )
            try:
                return self.core.handle(broken, trio.current_time())
            except Exception:
                log.exception("the master failed to drop connection %d", conn_id)
        # Cut it: its reader reports it closed, and the core removes it on that.
        return [Close(conn=conn_id, reason="internal error")]

    async def run_core(self) -> NoReturn:
        self.feed(Tick())  # the core's clock starts now (its uptime)
        deadline = self.core.next_deadline()
        while True:
            event: Event
            with trio.move_on_at(deadline):
                event = await self.events_receive.receive()
                self.feed(event)
                # The events that came meanwhile (the votes of one collective arrive
                # together), without a scope and a deadline each; a bounded batch, so
                # deadlines are still checked under a flood.
                for _ in range(_BATCH):
                    try:
                        event = self.events_receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self.feed(event)
            # Deadlines are checked even when events never stop coming.
            deadline = self.core.next_deadline()
            if trio.current_time() >= deadline:
                await self.drain_arrivals()
                self.feed(Tick())
                deadline = self.core.next_deadline()

    async def drain_arrivals(self) -> None:
        """Handle what already reached our sockets before judging anyone silent.

        If this process itself stalled (descheduled, swapped), every deadline passes
        at once while the peers' heartbeats sit unread in the kernel: give the
        readers a short grace to deliver them, or healthy peers would be kicked.
        """
        with trio.move_on_after(min(0.05, self.config.heartbeat_interval / 2)):
            while True:
                event = await self.events_receive.receive()
                self.feed(event)


async def serve_master(
    listeners: Sequence[trio.abc.Listener[Any]],
    *,
    config: Config | None = None,
    first_peer_id: int = 1,
    metrics: tuple[str, int] | None = None,
    metrics_started: Callable[[tuple[str, int]], None] | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Run a master on ``listeners`` until cancelled.

    Args:
        listeners: any trio listeners yielding byte streams (TCP or in-memory).
        config: timers and limits; the master's liveness timers are imposed on peers.
        first_peer_id: the id of the first peer to register (masters elected among
            peers start at a random one, so that two never give out the same ids).
        metrics: serve Prometheus metrics over HTTP on this ``(host, port)`` (needs
            the ``observability`` extra; port 0: any free port).
        metrics_started: called with the metrics' bound address once they are served.
        task_status: started with the listeners' ``(host, port)`` addresses.
    """
    server = _MasterServer(config or Config(), first_peer_id=first_peer_id)
    async with contextlib.AsyncExitStack() as stack:
        if metrics is not None:
            bound = await stack.enter_async_context(serve_metrics(
                *metrics, lambda: server.core.status(trio.current_time())
            ))
            log.info("serving metrics on http://%s/metrics", format_address(*bound))
            if metrics_started is not None:
                metrics_started(bound)
        nursery = await stack.enter_async_context(trio.open_nursery())
        server.nursery = nursery
        server.threads = threads_allowed()
        for listener in listeners:
            nursery.start_soon(server.accept_loop, listener, nursery)
        task_status.started([listener_address(listener) for listener in listeners])
        await server.run_core()
    raise AssertionError("unreachable")  # pragma: no cover


#: Moves of the heuristic counted as one second of budget where the search is not
#: timed (inline, under virtual time), so that its result is reproducible.
MOVES_PER_SECOND = 100_000


def _search(job: Solve, stop: threading.Event, *, timed: bool = True) -> topology.Ring:
    """The best ring for ``job`` within its budget: ``job.seconds`` of wall time, or
    (not ``timed``) as many moves as that many seconds are counted for."""
    deadline = time.monotonic() + job.seconds

    def should_stop() -> bool:
        return stop.is_set() or (timed and time.monotonic() >= deadline)

    moves = 1 << 60 if timed else max(1, int(job.seconds * MOVES_PER_SECOND))
    started = time.monotonic()
    solver = topology.solve_heuristic if job.background else topology.solve
    ring = solver(
        job.cost, iterations=moves, seed=job.job, start=job.start, should_stop=should_stop
    )
    log.debug(
        "ring search %d (peer group %d, %d peers%s): %.3f s, optimal: %s",
        job.job, job.group, len(job.peers), ", background" if job.background else "",
        time.monotonic() - started, ring.optimal,
    )
    return ring


def _search_event(job: Solve, stop: threading.Event, *, timed: bool = True) -> SolveFinished:
    """``_search``'s outcome as the core's event; a failure is reported, not raised (a
    solver bug must cost this search, not the master)."""
    try:
        ring = _search(job, stop, timed=timed)
    except Exception as exc:
        log.exception("ring search %d for peer group %d failed", job.job, job.group)
        return SolveFinished(job=job.job, error=f"{type(exc).__name__}: {exc}")
    return SolveFinished(job=job.job, order=ring.order, optimal=ring.optimal)


async def serve_master_tcp(
    port: int = 48148,
    host: str = "0.0.0.0",
    *,
    config: Config | None = None,
    advertise: str | None = None,
    metrics: tuple[str, int] | None = None,
    metrics_started: Callable[[tuple[str, int]], None] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Run a master on TCP ``host:port`` until cancelled; started with the bound address.
    ``metrics``, ``metrics_started``: as for ``serve_master``.

    Without a run secret in ``config`` (and not ``insecure``), a wildcard ``host``
    listens on loopback only.

    With ``advertise``, the master is also announced over mDNS as a master of the run
    of that name (``Communicator(discover=...)`` finds it) from before it is started
    until it ends; that needs the ``discovery`` extra, a run secret (or ``insecure``)
    and a ``host`` other than loopback.

    Raises:
        ValueError: an explicit non-loopback ``host`` without a run secret, or an
            advertisement that cannot be made (the message says why).
    """
    config = config or Config()
    secured = config.secret is not None
    if advertise is not None:
        check_advertise(advertise, host, secured=secured, insecure=config.insecure)
    host = listen_host(host, secured=secured, insecure=config.insecure, who="the master")
    listener = await TcpNetwork().listen(host, port)
    address = listener_address(listener)
    async with contextlib.AsyncExitStack() as stack:
        if advertise is not None:
            try:
                await stack.enter_async_context(advertise_master(
                    advertise, host, address[1], secret=config.secret, insecure=config.insecure
                ))
            except BaseException:
                await trio.aclose_forcefully(listener)
                raise
        await serve_master(
            [listener], config=config, metrics=metrics, metrics_started=metrics_started,
            task_status=_StartedWith(task_status, address),
        )


class _StartedWith:
    """Reports ``value`` as started, whatever the wrapped server reports."""

    def __init__(self, task_status: trio.TaskStatus[Any], value: object) -> None:
        self._task_status = task_status
        self._value = value

    def started(self, _value: object = None) -> None:
        self._task_status.started(self._value)
