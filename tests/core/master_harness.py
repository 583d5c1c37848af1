"""A thin driver around ``MasterCore`` that plays the shell: it keeps the clock, delivers
events by connection, and records what each connection was sent.

It also checks, on every action, the promises the core makes to any shell: nothing is
sent on a connection after its ``Close``, nothing is closed twice, and each peer gets at
most one ``P2PInfo`` and one ``P2PEstablishResult`` per round (the result after the info;
a result of round 0, a refused vote, says why).
For collectives it checks, per connection: a ``CollectiveCommence`` or a seq-0 verdict
only for a tag the peer initiated and that is not running for it; a ``CollectiveAbort``
only for the attempt running there, at most once, and never after the peer completed it;
at most one ``CollectiveVerdict`` per initiate (seq 0 if it never ran, else the attempt's
seq); and commence seqs that only grow.

For topology optimizations it plays the shell's solver too: ``solves`` holds every
``Solve`` by job, ``cancelled`` the jobs a ``CancelSolve`` stopped, and
``finish_solves`` runs the jobs still pending and delivers their ``SolveFinished``. It
checks that a ``CancelSolve`` names a job that was emitted and is neither answered nor
cancelled yet, that a receiver is never asked for a second link while one is
unanswered, that nobody is asked to measure a link from itself, that the sender of
every link measured was told first whom to expect and how many bytes to serve
(``ExpectBenchmark``, the same budget as the ``MeasureLink``), and that each peer gets
at most one report (``TopologyOptimized``) per optimization.

Every event it delivers, with the time and the actions that came back, is folded into
``trace`` (a SHA-256 over a canonical text of each record, see ``canonical``): two
runs with equal digests saw the core do exactly the same things in the same order.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy

from pccl_trio import topology
from pccl_trio._core.master import (
    Action,
    CancelSolve,
    Close,
    ConnectionBroken,
    ConnectionClosed,
    ConnectionOpened,
    Event,
    MasterCore,
    MessageReceived,
    PeerPhase,
    PeerState,
    PeerView,
    Send,
    Solve,
    SolveFinished,
    Tick,
)
from pccl_trio._core.messages import (
    PROTOCOL_VERSION,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    ExpectBenchmark,
    Heartbeat,
    Kick,
    LeaseReport,
    LeaseState,
    LinkMeasured,
    MeasureLink,
    Message,
    P2PEstablished,
    P2PEstablishResult,
    P2PInfo,
    Register,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
    Welcome,
)

HEARTBEAT_INTERVAL = 1.0
LIVENESS_TIMEOUT = 5.0

#: Descriptor defaults for ``MasterHarness.initiate``: 16 FLOAT values summed, unquantized.
COUNT, FLOAT, SUM = 16, 10, 0

#: Moves the default solver spends on a background search (kept small: tests are quick).
BACKGROUND_ITERATIONS = 2_000

M = TypeVar("M", bound=Message)


class MasterHarness:
    """Drive a ``MasterCore`` by connection id; ``sent[conn]`` is all it was sent."""

    def __init__(
        self,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        liveness_timeout: float = LIVENESS_TIMEOUT,
        round_timeout: float = 30.0,
        solve_seconds: float = 1.0,
        search_seconds: float = 60.0,
        reference_bytes: int = 64 << 20,
        stall_timeout: float = 1800.0,
        stall_warning: float = 60.0,
        content_digest: bool = False,
        lease_span: int = 1 << 20,
    ) -> None:
        self.core = MasterCore(
            lease_span=lease_span,
            heartbeat_interval=heartbeat_interval,
            liveness_timeout=liveness_timeout,
            round_timeout=round_timeout,
            solve_seconds=solve_seconds,
            search_seconds=search_seconds,
            reference_bytes=reference_bytes,
            stall_timeout=stall_timeout,
            stall_warning=stall_warning,
            content_digest=content_digest,
        )
        self.now = 0.0
        self.sent: dict[int, list[Message]] = collections.defaultdict(list)
        self._taken: dict[int, int] = collections.defaultdict(int)  # conn -> len(sent) at take
        self.closed: dict[int, str] = {}  # conn -> reason of its Close
        self.peer_ids: dict[int, int] = {}  # conn -> peer id from its Welcome
        self._infos: set[tuple[int, int]] = set()  # (conn, round)
        self._results: set[tuple[int, int]] = set()
        # Collectives, per connection: tags initiated and not yet given a verdict (value:
        # the running attempt's seq, 0 before it commences), and attempts aborted or
        # completed there.
        self.in_flight: dict[int, dict[int, int]] = collections.defaultdict(dict)
        self._aborted: set[tuple[int, int]] = set()  # (conn, seq)
        self._completed: set[tuple[int, int]] = set()  # (conn, seq)
        self.seqs: list[int] = []  # every commenced seq, in order (once per attempt)
        # Leases: the tags each connection reported a lease on (verdicts for attempts it
        # ran under the lease, or only heard of, may come for them), and the attempt
        # numbers reported (an adopted attempt is commenced with one of them).
        self.reported: dict[int, set[int]] = collections.defaultdict(set)
        self.leased_seqs: set[int] = set()
        # Topology optimization: solver jobs (every Solve, by job), those cancelled and
        # those answered; per connection the MeasureLink not answered yet; and the
        # optimizations each connection got a report for.
        self.solves: dict[int, Solve] = {}
        self.cancelled: set[int] = set()
        self.answered: set[int] = set()
        self.unanswered: dict[int, MeasureLink] = {}
        # Announced measurements: (optimization, sender, receiver) -> bytes.
        self.announced: dict[tuple[int, int, int], int] = {}
        self._reports: set[tuple[int, int]] = set()  # (conn, optimization)
        self.trace = hashlib.sha256()

    # --- events ------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, SolveFinished):
            self.answered.add(event.job)
        actions = self.core.handle(event, self.now)
        self.trace.update(f"{canonical(event)}@{self.now!r}->{canonical(actions)}\n".encode())
        for action in actions:
            match action:
                case Solve(job=job):
                    assert job not in self.solves, f"job {job} emitted twice"
                    self.solves[job] = action
                    continue
                case CancelSolve(job=job):
                    assert job in self.solves, f"cancel of job {job}, never emitted"
                    assert job not in self.cancelled, f"job {job} cancelled twice"
                    assert job not in self.answered, f"cancel of job {job} after its answer"
                    self.cancelled.add(job)
                    continue
            assert action.conn not in self.closed, f"{action} after conn {action.conn} closed"
            match action:
                case Send(conn=conn, message=message):
                    self._record(conn, message)
                case Close(conn=conn, reason=reason):
                    self.closed[conn] = reason
                    self.unanswered.pop(conn, None)
        return actions

    def _record(self, conn: int, message: Message) -> None:
        self.sent[conn].append(message)
        match message:
            case Welcome(peer_id=peer_id):
                assert conn not in self.peer_ids, f"second Welcome on conn {conn}"
                self.peer_ids[conn] = peer_id
            case P2PInfo(round=number):
                assert (conn, number) not in self._infos, f"two P2PInfo for round {number}"
                self._infos.add((conn, number))
            case P2PEstablishResult(round=0, error=error):
                assert error, "a refused establishment vote (round 0) says why"
            case P2PEstablishResult(round=number):
                assert (conn, number) in self._infos, f"result of round {number} before its info"
                assert (conn, number) not in self._results, f"two results for round {number}"
                self._results.add((conn, number))
            case CollectiveCommence(tag=tag, seq=seq):
                tags = self.in_flight[conn]
                assert tags.get(tag) == 0, f"commence of tag {tag} on conn {conn}: {tags}"
                tags[tag] = seq
                if seq in self.leased_seqs:  # an adopted attempt, joined late
                    pass
                elif not self.seqs or seq > self.seqs[-1]:
                    self.seqs.append(seq)
                else:
                    assert seq == self.seqs[-1], f"seq {seq} after {self.seqs[-1]}"
            case CollectiveAbort(tag=tag, seq=seq):
                assert seq and self.in_flight[conn].get(tag) == seq, f"abort of {tag}/{seq}"
                assert (conn, seq) not in self._aborted, f"two aborts of {seq} on conn {conn}"
                assert (conn, seq) not in self._completed, f"abort of {seq} after its complete"
                self._aborted.add((conn, seq))
            case CollectiveVerdict(tag=tag, seq=seq):
                tags = self.in_flight[conn]
                if tags.get(tag) == seq or (tags.get(tag) == 0 and not seq):
                    assert tags.pop(tag) == seq, f"verdict {message} for attempt {seq}"
                else:
                    # About an attempt under a lease this peer reported on: one it ran
                    # and returned from, or one it never started.
                    assert tag in self.reported[conn], f"verdict {message} on conn {conn}: {tags}"
                    assert seq in self.leased_seqs or seq + 1 in self.leased_seqs, message
            case ExpectBenchmark(optimization=number, measurer=measurer, nbytes=nbytes):
                link = (number, self.peer_ids[conn], measurer.peer_id)
                assert link not in self.announced, f"link {link} announced twice"
                self.announced[link] = nbytes
            case MeasureLink(optimization=number, source=source, nbytes=nbytes):
                assert conn not in self.unanswered, f"second MeasureLink on conn {conn}"
                assert source.peer_id != self.peer_ids.get(conn), "a link from itself"
                link = (number, source.peer_id, self.peer_ids[conn])
                assert self.announced.get(link) == nbytes, f"link {link} not announced so"
                self.unanswered[conn] = message
            case TopologyOptimized(optimization=number) if number:
                assert (conn, number) not in self._reports, f"two reports of {number}"
                self._reports.add((conn, number))

    def open(self, conn: int, host: str = "127.0.0.1") -> list[Action]:
        return self.handle(ConnectionOpened(conn=conn, host=host))

    def send(self, conn: int, message: Message) -> list[Action]:
        match message:
            case CollectiveInitiate(tag=tag) if conn not in self.closed:
                # The first initiate of a tag opens it; a duplicate gets the peer kicked.
                self.in_flight[conn].setdefault(tag, 0)
            case CollectiveComplete(seq=seq):
                self._completed.add((conn, seq))
            case LeaseReport(tag=tag, seq=seq, state=state) if conn not in self.closed:
                self.reported[conn].add(tag)
                if seq:
                    self.leased_seqs.add(seq)
                if state == LeaseState.RUNNING or (
                    # A verdict comes for an attempt that complete or failed, unless it
                    # was returned from already (then none is in flight).
                    seq and state != LeaseState.NONE and tag not in self.in_flight[conn]
                ):
                    self.in_flight[conn].setdefault(tag, seq)
                if state in (LeaseState.COMPLETE, LeaseState.FAILED):
                    self._completed.add((conn, seq))
            case LinkMeasured():
                self.unanswered.pop(conn, None)
        return self.handle(MessageReceived(conn=conn, message=message))

    def register(
        self,
        conn: int,
        group: int = 0,
        *,
        host: str = "127.0.0.1",
        advertised_host: str = "",
        port: int | None = None,
        version: int = PROTOCOL_VERSION,
        pool_size: int = 1,
    ) -> list[Action]:
        """Open ``conn`` and register on it (p2p port ``10000 + conn`` unless given)."""
        actions = self.open(conn, host)
        return actions + self.send(
            conn,
            Register(
                protocol_version=version,
                peer_group=group,
                p2p_port=10000 + conn if port is None else port,
                advertised_host=advertised_host,
                pool_size=pool_size,
            ),
        )

    def vote(self, conn: int, accept: bool = True) -> list[Action]:
        return self.send(conn, VoteEstablish(accept_new_peers=accept))

    def report(
        self, conn: int, round: int | None = None, ok: bool = True, failed: Sequence[int] = (),
        pool: int = 0,
    ) -> list[Action]:
        """Report on the round of the last ``P2PInfo`` ``conn`` got (or on ``round``),
        with ``pool`` connections to its successor."""
        number = self.last(conn, P2PInfo).round if round is None else round
        return self.send(
            conn, P2PEstablished(round=number, success=ok, failed_peers=tuple(failed), pool=pool)
        )

    def initiate(
        self,
        conn: int,
        tag: int,
        *,
        count: int = COUNT,
        dtype: int = FLOAT,
        op: int = SUM,
        quantized_dtype: int = 0,
        quantization: int = 0,
        distribution_hint: int = 0,
        slice_bytes: int = 0,
        lease: bool = False,
        kind: int = 0,
        root: int = 0,
    ) -> list[Action]:
        return self.send(
            conn,
            CollectiveInitiate(
                tag=tag, count=count, dtype=dtype, op=op, quantized_dtype=quantized_dtype,
                slice_bytes=slice_bytes, lease=lease,
                quantization=quantization, distribution_hint=distribution_hint, kind=kind,
                root=root,
            ),
        )

    def lease_report(
        self, conn: int, tag: int, lease: int, seq: int = 0, state: LeaseState | None = None,
        *, count: int = COUNT, invalid: str = "",
    ) -> list[Action]:
        """Report on ``conn``'s lease on ``tag`` (numbered from ``lease``): attempt
        ``seq`` (0: none) in ``state`` (default: NONE for none, else RUNNING)."""
        if state is None:
            state = LeaseState.RUNNING if seq else LeaseState.NONE
        return self.send(
            conn,
            LeaseReport(
                tag=tag, lease=lease, seq=seq, state=state, count=count, dtype=FLOAT, op=SUM,
                quantized_dtype=0, quantization=0, distribution_hint=0, slice_bytes=0,
                invalid=invalid,
            ),
        )

    def complete(
        self, conn: int, tag: int, seq: int | None = None, aborted: bool = False,
        invalid: str = "",
    ) -> list[Action]:
        """Complete ``tag`` (by default the attempt ``conn`` was last told to commence)."""
        if seq is None:
            seq = max(m.seq for m in self.received(conn, CollectiveCommence) if m.tag == tag)
        return self.send(
            conn, CollectiveComplete(tag=tag, seq=seq, aborted=aborted, invalid=invalid)
        )

    def pending(self, conn: int, wait: float = 0.0) -> list[Action]:
        return self.send(conn, VotePeersPending(wait=wait))

    def optimize(self, conn: int) -> list[Action]:
        return self.send(conn, VoteOptimizeTopology())

    def measure(
        self, conn: int, bandwidth: float = 1e9, latency: float = 1e-4, error: str = ""
    ) -> list[Action]:
        """Answer the last ``MeasureLink`` ``conn`` got: the link's rate (bytes per
        second) and latency (seconds), or ``error``."""
        asked = self.last(conn, MeasureLink)
        return self.send(
            conn,
            LinkMeasured(
                optimization=asked.optimization,
                sender=asked.source.peer_id,
                bandwidth=0.0 if error else bandwidth,
                latency=0.0 if error else latency,
                error=error,
            ),
        )

    def pending_solves(self, background: bool | None = None) -> list[Solve]:
        """Jobs emitted and neither answered nor cancelled (only first searches, or
        only background ones, if ``background`` says so), by job."""
        return [
            job for number, job in sorted(self.solves.items())
            if number not in self.answered and number not in self.cancelled
            and (background is None or job.background is background)
        ]

    def answer(
        self, job: int, order: Sequence[int] = (), optimal: bool = False, error: str = ""
    ) -> list[Action]:
        """Deliver ``SolveFinished`` for ``job`` as given."""
        return self.handle(
            SolveFinished(job=job, order=tuple(order), optimal=optimal, error=error)
        )

    def finish_solves(
        self,
        solver: Callable[[Solve], SolveFinished] | None = None,
        *,
        background: bool | None = None,
    ) -> list[Action]:
        """Run the jobs pending now (see ``pending_solves``) with ``solver`` (default:
        ``default_solver``), in job order, and deliver each ``SolveFinished``. Jobs the
        deliveries emit (a background search) stay pending for the next call."""
        actions: list[Action] = []
        for job in self.pending_solves(background):
            if job.job in self.cancelled:  # cancelled by an earlier delivery
                continue
            actions += self.handle((solver or default_solver)(job))
        return actions

    def heartbeat(self, conn: int) -> list[Action]:
        return self.send(conn, Heartbeat())

    def close(self, conn: int) -> list[Action]:
        return self.handle(ConnectionClosed(conn=conn))

    def broken(self, conn: int, reason: str = "bad frame") -> list[Action]:
        return self.handle(ConnectionBroken(conn=conn, reason=reason))

    def tick(self, now: float | None = None) -> list[Action]:
        """Let time pass to ``now`` (default: ``next_deadline()``) and deliver a Tick."""
        self.now = self.core.next_deadline() if now is None else now
        return self.handle(Tick())

    # --- observations --------------------------------------------------------------------

    def join(self, conn: int, group: int = 0) -> None:
        """Register ``conn`` as the only peer and complete its one-member round."""
        self.register(conn, group)
        self.report(conn)
        assert self.last(conn, P2PEstablishResult).success

    def received(self, conn: int, cls: type[M]) -> list[M]:
        return [m for m in self.sent[conn] if isinstance(m, cls)]

    def last(self, conn: int, cls: type[M]) -> M:
        messages = self.received(conn, cls)
        assert messages, f"conn {conn} got no {cls.__name__}"
        return messages[-1]

    def take(self, conn: int) -> list[Message]:
        """What ``conn`` was sent since the last ``take``."""
        messages = self.sent[conn][self._taken[conn] :]
        self._taken[conn] = len(self.sent[conn])
        return messages

    def take_all(self) -> None:
        for conn in list(self.sent):
            self.take(conn)

    @property
    def latest_round(self) -> int:
        """The number of the latest round any peer was told of (0: none yet)."""
        return max((number for (_conn, number) in self._infos), default=0)

    @property
    def latest_optimization(self) -> int:
        """The number of the latest optimization any peer got a report of (0: none)."""
        return max((number for (_conn, number) in self._reports), default=0)

    def kick_reason(self, conn: int) -> str | None:
        kicks = self.received(conn, Kick)
        return kicks[-1].reason if kicks else None

    def view(self, conn: int) -> PeerView | None:
        """The core's view of the peer on ``conn`` (None once it is gone)."""
        peer_id = self.peer_ids.get(conn)
        return next((p for p in self.core.peers() if p.peer_id == peer_id), None)

    def where(self, conn: int) -> tuple[PeerPhase, PeerState] | None:
        view = self.view(conn)
        return None if view is None else (view.phase, view.state)


def canonical(value: Any) -> str:
    """A text for ``value`` that depends only on what it holds: records by class name
    and fields, integers (``IntEnum`` members too) by value, other enums by name, arrays
    by dtype, shape and values."""
    match value:
        case bool():
            return repr(value)
        case enum.Enum() if not isinstance(value, int):
            return f"{type(value).__name__}.{value.name}"
        case int():
            return str(int(value))
        case float() | str() | None:
            return repr(value)
        case bytes():
            return f"0x{value.hex()}"
        case numpy.ndarray():
            return f"array({value.dtype},{value.shape},{canonical(value.ravel().tolist())})"
        case list() | tuple() | set() | frozenset():
            items = sorted(map(canonical, value)) if isinstance(value, set | frozenset) else map(
                canonical, value
            )
            return "[" + ",".join(items) + "]"
        case dict():
            return "{" + ",".join(f"{canonical(k)}:{canonical(v)}" for k, v in value.items()) + "}"
        case _ if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = ",".join(
                f"{f.name}={canonical(getattr(value, f.name))}" for f in dataclasses.fields(value)
            )
            return f"{type(value).__name__}({fields})"
    raise TypeError(f"no canonical text for {value!r}")


def default_solver(job: Solve) -> SolveFinished:
    """What the master's shell does, deterministically: the exact optimum (or the
    heuristic's best beyond ``EXACT_LIMIT``) for a first search, a short heuristic run
    from ``job.start`` for a background one."""
    if job.background:
        ring = topology.solve_heuristic(
            job.cost, iterations=BACKGROUND_ITERATIONS, seed=0, start=job.start
        )
    else:
        ring = topology.solve(job.cost, seed=0, start=job.start)
    return SolveFinished(job=job.job, order=ring.order, optimal=ring.optimal)


def only(actions: Sequence[Action], conn: int) -> list[Action]:
    """The actions on connection ``conn`` (solver actions have none)."""
    return [a for a in actions if isinstance(a, Send | Close) and a.conn == conn]


def solver_actions(actions: Sequence[Action]) -> list[Solve | CancelSolve]:
    return [a for a in actions if isinstance(a, Solve | CancelSolve)]


def was_kicked(actions: Sequence[Action], conn: int) -> bool:
    """``actions`` kick ``conn``: a Kick, then a Close, and nothing else for it."""
    mine = only(actions, conn)
    return (
        len(mine) == 2
        and isinstance(mine[0], Send)
        and isinstance(mine[0].message, Kick)
        and isinstance(mine[1], Close)
    )
