"""The peer side: ``Communicator``, its master link and its p2p connection pools.

Theory of operation
-------------------
``connect()`` starts a background nursery (as a trio system task, so the
communicator outlives the call that connected it) holding three kinds of tasks:

* one *reader* on the master link, the only task that ever receives from it. Every
  message goes into an inbox that callers wait on by kind (PCCL's predicate-matched
  queue); heartbeats only prove the master alive. If the master sends nothing for the
  liveness timeout, closes the link, or kicks us, the communicator *fails*: every
  waiting and later call raises ``MasterConnectionError`` or ``Kicked``.
* one *heartbeat* sender, so the master can tell a quiet peer from a dead one.
* the *p2p listener*, which accepts connections from ring neighbours. Each connection
  opens with ``P2PHello(peer_id, slot)`` naming the sender and its pool slot, and is
  stored as receive connection ``slot`` from that peer once acknowledged.

Membership calls follow the master's protocol: ``update_topology`` votes to
(re-)establish, then, when the master starts a round (``P2PInfo``), opens a pool of
connections to the next peer of the ring, closes connections to peers that are no
longer neighbours, reports, and waits for the round's verdict, which is the same for
every participant. A failed round is voted again, up to ``Config.establish_attempts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import trio

from .._config import Config
from .._core.errors import RemoteProtocolError
from .._core.messages import (
    PROTOCOL_VERSION,
    REJECTED,
    SUCCESS,
    BenchmarkRequest,
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveInitiate,
    CollectiveVerdict,
    Heartbeat,
    Kick,
    LinkMeasured,
    MeasureLink,
    Message,
    P2PEstablished,
    P2PEstablishResult,
    P2PHello,
    P2PHelloAck,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    Register,
    SharedStateComplete,
    SharedStateDone,
    SharedStatePlan,
    SharedStateRequest,
    SharedStateVote,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
    VotePeersPending,
    Welcome,
    WorldSizes,
)
from .._core.wire import encode_control
from .._errors import (
    CollectiveAborted,
    InvalidArgument,
    InvalidUsage,
    Kicked,
    MasterConnectionError,
    PCCLError,
    SharedStateSyncFailed,
    TooFewPeers,
    TopologyOptimizationFailed,
    UpdateTopologyFailed,
)
from .._types import (
    Attribute,
    DataType,
    DistributionHint,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
    TopologyInfo,
)
from ..ops import Codec, as_array, check_quantization, from_numpy_dtype
from ..transport import (
    FramedStream,
    Network,
    SocketLink,
    TcpNetwork,
    format_address,
    listener_address,
    parse_address,
    run_in_thread,
)
from . import _bandwidth as bandwidth
from . import _shared_state as sharing
from ._allreduce import AllReduceAttempt, AsyncReduceHandle, BufferPool, LocalFailure

__all__ = ["Communicator", "CommunicatorStatistics"]

log = logging.getLogger("pccl_trio.peer")

_W = TypeVar("_W")
_M = TypeVar("_M", bound=Message)
U32_MAX = (1 << 32) - 1


def _topology_info(message: TopologyOptimized) -> TopologyInfo:
    """The master's report as the public record (matrices of NaN if it left them out)."""
    n = len(message.peers)
    bandwidth = np.full((n, n), np.nan)
    latency = np.full((n, n), np.nan)
    if message.bandwidth:
        bandwidth = np.array(message.bandwidth, dtype=np.float64).reshape(n, n)
        latency = np.array(message.latency, dtype=np.float64).reshape(n, n)
        latency[bandwidth == 0] = np.nan
        bandwidth[bandwidth == 0] = np.nan
        bandwidth.flat[list(message.unreachable)] = 0.0
        np.fill_diagonal(bandwidth, np.nan)
        np.fill_diagonal(latency, np.nan)
    return TopologyInfo(
        peers=message.peers,
        bandwidth=bandwidth,
        latency=latency,
        ring=message.ring,
        predicted_seconds=(
            message.predicted_seconds if message.predicted_seconds >= 0 else math.inf
        ),
        reference_bytes=message.reference_bytes,
        optimal=message.optimal,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CommunicatorStatistics:
    """A snapshot of a communicator's membership view and open p2p connections.

    Attributes:
        peer_id: the master-assigned id (None before registration).
        ring: the peer group's ring order from the last successful update.
        tx_connections: open connections to each peer we send to, by peer id.
        rx_connections: open connections from each peer we receive from, by peer id.
    """

    peer_id: int | None
    ring: tuple[int, ...]
    tx_connections: dict[int, int]
    rx_connections: dict[int, int]


class _Rejected(InvalidArgument):
    """The master rejected a collective for every peer of its group (the peers disagree
    on its arguments, or a peer's data cannot be reduced): retrying would fail alike."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _RetryOutcome:
    """What ``all_reduce_multiple_with_retry`` gathered over its passes."""

    tx: int = 0
    rx: int = 0
    clamped: int = 0
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)


class _Status(enum.Enum):
    NEW = enum.auto()
    CONNECTING = enum.auto()
    CONNECTED = enum.auto()
    FAILED = enum.auto()  # kicked, or the master is gone
    CLOSED = enum.auto()


@dataclasses.dataclass(kw_only=True, slots=True)
class _Pool:
    """The connections to (tx) or from (rx) one neighbour, by slot."""

    peer_id: int
    slots: dict[int, FramedStream | SocketLink] = dataclasses.field(default_factory=dict)

    def healthy(self, size: int) -> bool:
        """All ``size`` connections open at both ends (we never read a tx connection,
        so a remote close shows only as an end of stream waiting there)."""
        return len(self.slots) == size and not any(
            s.closed or s.closed_by_peer() for s in self.slots.values()
        )

    async def aclose(self) -> None:
        streams = list(self.slots.values())
        self.slots.clear()
        for stream in streams:
            await stream.aclose()


class Communicator:
    """A peer of a pccl_trio run.

    Creating one does no IO; ``await comm.connect()`` (or ``async with``) joins the run.

    Args:
        master_address: ``"host:port"`` of the master.
        peer_group: peers all-reduce and sync within their group; votes about
            membership span all groups.
        p2p_connection_pool_size: TCP connections per ring neighbour; 0 picks
            ``Config.p2p_connection_pool_size``.
        config: timers and limits (the master's liveness timers replace these once
            registered).
        network: where connections come from; real TCP by default.
        p2p_host: interface for the p2p listener.
        p2p_port: port for the p2p listener (0: any free port).
        advertised_host: the address other peers should use to reach this one; by
            default the address the master sees.
    """

    def __init__(
        self,
        master_address: str,
        peer_group: int = 0,
        p2p_connection_pool_size: int = 0,
        *,
        config: Config | None = None,
        network: Network | None = None,
        p2p_host: str = "0.0.0.0",
        p2p_port: int = 0,
        advertised_host: str | None = None,
    ) -> None:
        try:
            self._master_host, self._master_port = parse_address(master_address)
        except ValueError as exc:
            raise InvalidArgument(f"master_address: {exc}") from None
        if not (isinstance(peer_group, int) and not isinstance(peer_group, bool)
                and 0 <= peer_group <= U32_MAX):
            raise InvalidArgument(f"peer_group must be an integer in [0, 2**32-1], got {peer_group!r}")
        if not (isinstance(p2p_connection_pool_size, int)
                and not isinstance(p2p_connection_pool_size, bool)
                and 0 <= p2p_connection_pool_size <= 1024):
            raise InvalidArgument(
                "p2p_connection_pool_size must be an integer in [0, 1024] (0: default), "
                f"got {p2p_connection_pool_size!r}"
            )
        if not (isinstance(p2p_port, int) and 0 <= p2p_port <= 65535):
            raise InvalidArgument(f"p2p_port must be 0-65535, got {p2p_port!r}")
        self._config = config or Config()
        self._network: Network = network if network is not None else TcpNetwork()
        self._peer_group = peer_group
        self._pool_size = p2p_connection_pool_size or self._config.p2p_connection_pool_size
        self._p2p_host = p2p_host
        self._p2p_port = p2p_port
        self._advertised_host = advertised_host or ""
        self._heartbeat_interval = self._config.heartbeat_interval
        self._liveness_timeout = self._config.liveness_timeout

        self._status = _Status.NEW
        self._failure: PCCLError | None = None
        self._busy: str | None = None
        self._voted = False  # the running membership call has sent a vote
        self._peer_id: int | None = None
        self._world: WorldSizes | None = None
        self._ring: tuple[int, ...] = ()
        self._topology: TopologyInfo | None = None
        self._link: FramedStream | None = None
        self._inbox: list[Message] = []
        self._inbox_lot = trio.lowlevel.ParkingLot()
        self._tx: dict[int, _Pool] = {}
        self._rx: dict[int, _Pool] = {}
        self._p2p_listener: trio.abc.Listener[Any] | None = None
        # Collectives: tags reserved at launch; attempts by tag and by master number.
        self._tags_in_flight: set[int] = set()
        self._attempts_by_tag: dict[int, AllReduceAttempt] = {}
        self._attempts_by_seq: dict[int, AllReduceAttempt] = {}
        self._last_commenced = 0
        self._commence_lot = trio.lowlevel.ParkingLot()  # readers that are trio tasks
        self._commenced = threading.Condition()  # readers that are threads
        # The ring must be re-established (a collective was aborted) before the next
        # collective; ``_ensure_ring`` does it once no collective is in flight.
        self._ring_stale = False
        self._ring_lot = trio.lowlevel.ParkingLot()
        self._buffers = BufferPool()
        # Peers allowed to open p2p connections to us: predecessors named by the master.
        self._expected_senders: set[int] = set()
        self._p2p_lot = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._background_done = trio.Event()
        # Shared state: what this peer offers during a sync, and the connections
        # serving it (cut when the sync ends).
        self._serving: sharing.Serving | None = None
        self._serving_lot = trio.lowlevel.ParkingLot()
        self._serving_links: set[FramedStream | SocketLink] = set()

    # --- public API ----------------------------------------------------------------

    @property
    def peer_id(self) -> int | None:
        """The id the master gave this peer (None before ``connect``)."""
        return self._peer_id

    @property
    def ring(self) -> tuple[int, ...]:
        """This peer group's ring order, as of the last successful topology update."""
        return self._ring

    @property
    def topology(self) -> TopologyInfo | None:
        """What the last ``optimize_topology`` measured and installed for this peer's
        group (None before the first)."""
        return self._topology

    def statistics(self) -> CommunicatorStatistics:
        """What this peer currently knows and holds open."""
        def count(pools: dict[int, _Pool]) -> dict[int, int]:
            return {
                peer: sum(not s.closed for s in pool.slots.values())
                for peer, pool in pools.items()
                if pool.slots
            }

        return CommunicatorStatistics(
            peer_id=self._peer_id,
            ring=self._ring,
            tx_connections=count(self._tx),
            rx_connections=count(self._rx),
        )

    @property
    def master_address(self) -> str:
        return format_address(self._master_host, self._master_port)

    async def connect(self) -> None:
        """Register with the master and return once the run accepted this peer.

        Blocks until the existing peers call ``update_topology`` (immediately if this
        is the first peer).

        Raises:
            MasterConnectionError: the master can't be reached or went away.
            Kicked: the master refused this peer (the reason says why).
            InvalidUsage: already connected or closed.
        """
        if self._status is not _Status.NEW:
            raise InvalidUsage(
                f"connect() on a communicator that is {self._status.name.lower()}; "
                "create a new Communicator to join again"
            )
        self._status = _Status.CONNECTING
        try:
            with self._operation("connect"):
                await self._start_background()
                await self._open_master_link()
                self._voted = True  # registering is the joiner's vote
                for _attempt in range(self._config.establish_attempts):
                    if await self._establish_round():
                        break
                    await self._vote(VoteEstablish(accept_new_peers=True))
                else:
                    raise UpdateTopologyFailed(
                        f"joined the run, but its ring failed {self._config.establish_attempts} "
                        "times in a row; this peer left again: check that the other peers can "
                        "reach its p2p port, then connect a new Communicator"
                    )
            self._status = _Status.CONNECTED
        except BaseException:
            await self._shutdown()
            raise

    async def update_topology(self) -> None:
        """Collective vote: admit pending peers and rebuild the ring.

        Every accepted peer must call it; it returns when all did and the new ring is
        connected.

        Raises:
            UpdateTopologyFailed: establishing the ring failed repeatedly; calling
                again is safe.
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        self._check_idle("update_topology")
        # Bring a ring left stale by an abort up to date first, as every survivor does
        # before its next collective call (some did it already, at the end of the abort):
        # the peers then vote in the same rounds, whatever the timing.
        await self._ensure_ring()
        with self._operation("update_topology"):
            if await self._establish_rounds(accept_new_peers=True):
                return
            raise UpdateTopologyFailed(
                f"the ring could not be established in {self._config.establish_attempts} "
                "rounds (peers kept failing or leaving); call update_topology() again"
            )

    async def optimize_topology(self) -> None:
        """Collective: measure the links not measured yet, then install the fastest ring.

        Every accepted peer, in every peer group, must call it. The master asks each peer
        to measure some links from other peers to itself (a fraction of a second each;
        links that share no peer are measured at once), then orders each group's ring
        so that its slowest hop is as fast as possible, and installs it with an
        establishment round that admits no new peers; the next all-reduce uses it.
        Measurements are kept for later calls, which measure only links new peers
        brought. ``topology`` then shows the links and the ring. When the ring found
        first is not provably optimal (large groups), the master keeps searching, and
        the next ``update_topology`` installs a better ring if the group's members are
        unchanged. Alone in the run, it returns at once.

        Raises:
            TopologyOptimizationFailed: the new ring could not be established; calling
                again is safe.
            InvalidUsage: all-reduces are in flight, or other peers made another call
                meanwhile (the message says which).
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        self._check_idle("optimize_topology")
        await self._ensure_ring()  # see update_topology
        if self._world is not None and self._world.global_world_size < 2:
            return
        with self._operation("optimize_topology"):
            while True:
                await self._vote(VoteOptimizeTopology())
                while not isinstance(
                    message := await self._wait_for((MeasureLink, TopologyOptimized)),
                    TopologyOptimized,
                ):
                    assert isinstance(message, MeasureLink)
                    await self._send(await self._report_link(message))
                if not message.rejoin:
                    break
                # Peers of another group re-establish their ring after an aborted
                # all-reduce (as their own optimize_topology does first): take part in
                # that round, then vote again.
                await self._vote(VoteEstablish(accept_new_peers=False))
                if not await self._establish_round():
                    self._ring_stale = True
                    raise TopologyOptimizationFailed(
                        "a re-establishment round other peers needed failed; call "
                        "optimize_topology() again"
                    )
            if message.error:
                raise InvalidUsage(message.error)
            self._topology = _topology_info(message)
            # The master starts the first round itself, right after its report.
            if await self._establish_rounds(accept_new_peers=False, voted=True):
                return
            raise TopologyOptimizationFailed(
                f"the optimized ring could not be established in "
                f"{self._config.establish_attempts} rounds (peers kept failing or leaving); "
                "call optimize_topology() again"
            )

    async def _report_link(self, request: MeasureLink) -> LinkMeasured:
        """Measure the link the master asked for; a failure is reported, not raised."""
        source = request.source
        # Connecting, the measurement's own budget, and one liveness timeout of silence
        # from a sender that stalls: the report then names the link, well within the
        # master's step deadline (Config.round_timeout).
        bound = self._config.connect_timeout + bandwidth.BUDGET_SECONDS + self._liveness_timeout
        try:
            with trio.fail_after(bound):
                result = await self._measure_link(source)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError, RemoteProtocolError) as exc:
            log.warning(
                "peer %s: cannot measure the link from peer %d: %s",
                self._peer_id, source.peer_id, exc or type(exc).__name__,
            )
            return LinkMeasured(
                optimization=request.optimization,
                sender=source.peer_id,
                error=f"{type(exc).__name__}: {exc}"[:1000],
            )
        return LinkMeasured(
            optimization=request.optimization,
            sender=source.peer_id,
            bandwidth=result.bandwidth,
            latency=result.latency,
        )

    async def sync_shared_state(
        self,
        state: Any,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
    ) -> SharedStateSyncInfo:
        """Collective vote: make this peer's shared state the group's popular one.

        Every peer of the group calls it with the same tensors (names, dtypes, sizes, in
        the same order) and a revision one above its last sync's. The master elects
        the popular content; a peer whose tensors differ (or whose revision is behind,
        like a joiner) fetches exactly the differing tensors from the peers that hold
        it, straight into its buffers, verifies them, and adopts the group's revision.

        Returns:
            the tensor bytes this peer sent and received.

        Raises:
            SharedStateSyncFailed: the state could not be fetched (every peer holding
                it failed, or what arrived did not verify), or the master refused the
                vote; the state and its revision are unchanged, and syncing again is
                safe.
            Kicked: the master removed this peer (its tensors do not match the group's,
                its revision skipped ahead, or its strategy is not allowed here).
            InvalidArgument: the state is malformed.
            InvalidUsage: all-reduces are in flight, or another membership call runs.
        """
        self._check_connected()
        if not isinstance(strategy, SharedStateSyncStrategy):
            raise InvalidArgument(
                f"strategy must be a pccl_trio.SharedStateSyncStrategy, got {strategy!r}"
            )
        self._check_idle("sync_shared_state")
        tensors = sharing.prepare_state(state)
        await self._ensure_ring()  # see update_topology
        with self._operation("sync_shared_state"):
            threads = self._hash_threads()
            hashes = await self._cpu(lambda: [t.content_hash(threads) for t in tensors])
            vote = SharedStateVote(
                revision=state.revision,
                strategy=strategy.value,
                entries=tuple(t.entry(h) for t, h in zip(tensors, hashes, strict=True)),
            )
            if len(encode_control(vote)) > self._config.max_control_frame:
                raise InvalidArgument(
                    f"the shared state's {len(tensors)} tensors do not fit in one vote of "
                    f"Config.max_control_frame={self._config.max_control_frame} bytes; "
                    "use fewer (concatenated) tensors or shorter names"
                )
            serving = sharing.Serving(tensors)
            self._serving = serving
            try:
                await self._vote(vote)
                plan = await self._wait_for(SharedStatePlan)
                if plan.error:
                    raise SharedStateSyncFailed(
                        f"the master refused the sync: {plan.error}; the shared state and "
                        "its revision are unchanged"
                    )
                serving.sync = plan.sync
                serving.distributor = not plan.fetches
                self._serving_lot.unpark_all()
                received, failure = 0, ""
                if plan.fetches:
                    received, failure = await self._fetch_shared_state(plan, tensors)
                await self._send(
                    SharedStateDone(sync=plan.sync, success=not failure, reason=failure[:1000])
                )
                await self._wait_for(SharedStateComplete, lambda m: m.sync == plan.sync)
            finally:
                serving.active = False
                self._serving = None
                self._serving_lot.unpark_all()
                for link in list(self._serving_links):
                    link.close_now()
                # Handlers count what they sent when their send returns: wait for them
                # (cut above, they end at once) so tx_bytes is complete.
                with trio.move_on_after(self._liveness_timeout) as cleanup:
                    cleanup.shield = True
                    while serving.handlers:
                        await self._serving_lot.park()
            if failure:
                raise SharedStateSyncFailed(
                    f"could not fetch the shared state of revision {plan.revision}: "
                    f"{failure}; the state and its revision ({state.revision}) are unchanged"
                )
            state.revision = plan.revision
            return SharedStateSyncInfo(tx_bytes=serving.tx_bytes, rx_bytes=received)

    async def _fetch_shared_state(
        self, plan: SharedStatePlan, tensors: Sequence[sharing.Tensor]
    ) -> tuple[int, str]:
        """Fetch the plan's tensors from its distributors (see ``_shared_state``).

        Returns:
            the bytes received, and why the fetch failed (empty: it did not); after a
            failure every fetched tensor holds its old bytes again.
        """
        by_key = {t.key: t for t in tensors}
        targets = [by_key[f.key] for f in plan.fetches]
        expected = {f.key: f.hash for f in plan.fetches if f.verify}
        assert self._peer_id is not None
        fetcher = sharing.Fetcher(
            by_key, [t.key for t in targets], sync=plan.sync, peer_id=self._peer_id,
            frame_bytes=self._config.max_data_frame - 64,
            whole=[f.key for f in plan.fetches if not f.verify],
        )
        backup = await self._cpu(lambda: sharing.Backup(targets))
        try:
            failure = await self._transfer(plan, fetcher, targets, expected)
        except BaseException:
            # Cancelled, or the run ended under us: the old bytes go back all the same.
            with trio.CancelScope(shield=True):
                await self._cpu(backup.restore)
            raise
        if failure:
            await self._cpu(backup.restore)
            log.warning("peer %s: shared-state fetch failed: %s", self._peer_id, failure)
        return fetcher.received, failure

    async def _transfer(
        self,
        plan: SharedStatePlan,
        fetcher: sharing.Fetcher,
        targets: Sequence[sharing.Tensor],
        expected: dict[str, int],
    ) -> str:
        """Fetch every piece and verify the tensors; why it failed (empty: it did not)."""
        # A distributor that fails gives its piece back; the others may have finished
        # meanwhile, so the survivors go round again until nothing is left.
        alive = list(plan.distributors)
        while fetcher.pieces and alive:
            self._raise_if_failed()
            async with trio.open_nursery() as nursery:
                for endpoint in alive:
                    nursery.start_soon(self._fetch_from, endpoint, fetcher)
            alive = [e for e in alive if e.peer_id not in fetcher.failed_peers]
        if fetcher.pieces:
            return (
                "every peer holding it failed ("
                + ("; ".join(fetcher.failures) or "none is left") + ")"
            )
        threads = self._hash_threads()
        wrong = await self._cpu(lambda: sharing.mismatched(targets, expected, threads))
        if wrong:
            return (
                f"tensors {wrong} arrived but do not hash to the popular state's values "
                "(a distributor changed them during the sync?)"
            )
        return ""

    async def _fetch_from(self, endpoint: PeerEndpoint, fetcher: sharing.Fetcher) -> None:
        """One distributor's worker: fetch pieces from it until none is left or it fails."""
        try:
            framed = await self._connect_p2p(endpoint)
            await self._run_protocol(framed, sharing.request_pieces(fetcher))
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                RemoteProtocolError, sharing.DistributorRefused) as exc:
            fetcher.failed(endpoint.peer_id, str(exc) or type(exc).__name__)
            log.info("peer %s: fetching shared state from peer %d failed: %s",
                     self._peer_id, endpoint.peer_id, exc)

    async def _serve_shared_state(
        self, framed: FramedStream, request: SharedStateRequest
    ) -> None:
        """Answer a peer fetching shared state from us, on its connection."""
        # Its plan may have reached it before ours reached us: wait for ours.
        with trio.move_on_after(self._liveness_timeout):
            while self._serving is not None and self._serving.sync is None:
                await self._serving_lot.park()
        serving = self._serving or sharing.Serving(())  # none: every request is refused
        serving.handlers += 1
        try:
            await self._run_protocol(
                framed, sharing.serve_requests(serving, request), track=self._serving_links
            )
        finally:
            serving.handlers -= 1
            self._serving_lot.unpark_all()

    def _idle_timeout(self) -> float:
        """How long a shared-state connection may make no progress: a distributor waits
        up to the liveness timeout for its own plan before it answers, so twice that."""
        return 2 * self._liveness_timeout

    def _threads_allowed(self) -> bool:
        """Whether CPU work may leave the trio thread: on real networks (real time),
        not on the in-memory network under virtual time."""
        return isinstance(self._network, TcpNetwork)

    def _hash_threads(self) -> int:
        """Threads per hash: the machine's cores on real networks, one under virtual time."""
        return min(8, os.cpu_count() or 1) if self._threads_allowed() else 1

    async def _connect_p2p(self, endpoint: PeerEndpoint) -> FramedStream:
        """A new connection to ``endpoint``'s p2p listener (the caller sends the first
        frame and closes it)."""
        with trio.fail_after(self._config.connect_timeout):
            stream = await self._network.connect(endpoint.host, endpoint.port)
        return FramedStream(
            stream,
            max_control_frame=self._config.max_control_frame,
            max_data_frame=self._config.max_data_frame,
        )

    async def _run_protocol(
        self,
        framed: FramedStream,
        protocol: sharing.Protocol[_W],
        *,
        track: set[FramedStream | SocketLink] | None = None,
    ) -> _W:
        """Run a p2p protocol on ``framed``: in a worker thread over its socket on TCP,
        in this task otherwise; the connection is closed afterwards. While it runs, the
        connection is in ``track`` (if given), so that it can be cut from elsewhere."""
        link = self._to_link(framed)
        connection: FramedStream | SocketLink = framed if link is None else link
        if track is not None:
            track.add(connection)
        try:
            if link is None:
                return await sharing.drive(protocol, framed, idle_timeout=self._idle_timeout())
            return await run_in_thread(
                partial(sharing.drive_blocking, protocol, link, idle_timeout=self._idle_timeout()),
                interrupt=link.cut,
            )
        finally:
            if track is not None:
                track.discard(connection)
            if link is not None:
                link.cut()
            await framed.aclose()

    async def _measure_link(self, endpoint: PeerEndpoint) -> bandwidth.LinkMeasurement:
        """Measure the link from ``endpoint`` to this peer (see ``_bandwidth``).

        Raises:
            OSError, trio.TooSlowError, trio.BrokenResourceError, RemoteProtocolError:
                the peer could not be reached or the measurement broke off.
        """
        assert self._peer_id is not None
        return await self._run_protocol(
            await self._connect_p2p(endpoint),
            bandwidth.measure_link(
                peer_id=self._peer_id, frame_bytes=self._config.max_data_frame - 64
            ),
        )

    async def _cpu(self, work: Callable[[], _W]) -> _W:
        """Run CPU-bound array work (hashing, copies): in a worker thread on real
        networks, so heartbeats keep flowing; inline under virtual time, where threads
        would let timers fire early."""
        if self._threads_allowed():
            return await trio.to_thread.run_sync(work)
        return work()

    async def are_peers_pending(self) -> bool:
        """Collective vote: whether peers wait to be admitted by ``update_topology``."""
        self._check_connected()
        await self._ensure_ring()  # see update_topology
        with self._operation("are_peers_pending"):
            await self._vote(VotePeersPending())
            result = await self._wait_for(PeersPendingResult)
            if result.error:
                raise InvalidUsage(result.error)
            return result.pending

    # --- all-reduce ------------------------------------------------------------------

    async def all_reduce(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
    ) -> ReduceInfo:
        """Reduce ``send`` across the peer group; the result lands in ``recv``, or in
        ``send`` itself when ``recv`` is None.

        Every peer of the group must call it with the same ``tag``, count, dtype and
        op. On success every peer holds bit-identical results.

        Raises:
            CollectiveAborted: a peer failed or left; an in-place ``send`` is restored
                and a retry (after which the ring excludes departed peers) is safe.
            InvalidArgument: bad buffers, or the peers disagree on the arguments.
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        handle = self.all_reduce_async(
            send, recv, op=op, tag=tag, quantization=quantization,
            distribution_hint=distribution_hint,
        )
        try:
            return await handle.wait()
        except trio.Cancelled:
            # The other peers count on our part: stop it as a failure, which aborts the
            # collective for everyone and restores our input, and wait (a bounded
            # while) so the caller's buffer is settled when we return.
            attempt = self._attempts_by_tag.get(tag)
            if attempt is not None:
                attempt.fail("the caller cancelled the all-reduce")
            with trio.move_on_after(self._liveness_timeout) as cleanup:
                cleanup.shield = True
                await handle._done.wait()
            raise

    def all_reduce_async(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
    ) -> AsyncReduceHandle:
        """Start an all-reduce in the communicator's own tasks; see ``all_reduce``.

        Arguments are checked before this returns (``InvalidArgument`` /
        ``InvalidUsage``); everything else is raised by ``await handle.wait()``.
        """
        self._check_connected()
        if self._busy in ("update_topology", "sync_shared_state", "optimize_topology"):
            raise InvalidUsage(f"all_reduce() while {self._busy}() runs on this communicator")
        xp, send_array, result = self._check_reduce_arguments(
            send, recv, op, tag, quantization, distribution_hint
        )
        if quantization is not None and quantization.algorithm is QuantizationAlgorithm.NONE:
            quantization = None
        if tag in self._tags_in_flight:
            raise InvalidUsage(
                f"tag {tag} is already in flight; give concurrent all-reduces distinct tags"
            )
        self._tags_in_flight.add(tag)
        handle = AsyncReduceHandle(tag)
        assert self._nursery is not None
        self._nursery.start_soon(
            self._run_all_reduce, handle, xp, send_array, result, op,
            quantization, distribution_hint,
        )
        return handle

    async def all_reduce_multiple_with_retry(
        self,
        tensors: Sequence[Any],
        *,
        op: ReduceOp = ReduceOp.SUM,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        max_in_flight: int = 16,
    ) -> ReduceInfo:
        """All-reduce every tensor in place (tag = its index), retrying after dropouts.

        At most ``max_in_flight`` run at once, launched in index order on every peer.
        When a peer drops, every all-reduce in flight is aborted together (inputs
        restored); the unfinished ones run again with the survivors, so each tensor
        ends as the reduction over the old world or over the new one, identical on
        every survivor. A tensor the run rejects (the peers disagree on it, or a peer's
        data cannot be quantized) is not retried; the others still complete, on every
        peer alike, before the rejection is raised.

        Returns:
            the payload bytes of the successful attempts, the values clamped by
            quantization, and the final world size.

        Raises:
            InvalidArgument: the run rejected some tensors (named in the message; each
                of them was restored to its input), or an argument is malformed.
            TooFewPeers: the peer group shrank to a single peer.
        """
        if not (isinstance(max_in_flight, int) and max_in_flight >= 1):
            raise InvalidArgument(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        for index, tensor in enumerate(tensors):
            self._check_reduce_arguments(tensor, None, op, index, quantization, distribution_hint)
        outcome = _RetryOutcome()
        pending = list(range(len(tensors)))
        while pending:
            if len(self._ring) < 2:
                raise TooFewPeers(
                    f"the peer group has {len(self._ring)} peer; {len(pending)} of "
                    f"{len(tensors)} all-reduces could not complete"
                )
            pending = await self._reduce_pass(
                tensors, pending, op, quantization, distribution_hint, max_in_flight, outcome
            )
            if pending:
                log.info("peer %s: retrying %d all-reduces", self._peer_id, len(pending))
        if outcome.rejected:
            indices = sorted(outcome.rejected)
            first = outcome.rejected[indices[0]]
            raise InvalidArgument(
                f"{len(indices)} of {len(tensors)} all-reduces were rejected for every peer "
                f"(tensors {indices}; they were restored to their inputs, the others "
                f"completed); tensor {indices[0]}: {first}"
            )
        return ReduceInfo(
            world_size=len(self._ring), tx_bytes=outcome.tx, rx_bytes=outcome.rx,
            clamped=outcome.clamped,
        )

    async def _reduce_pass(
        self,
        tensors: Sequence[Any],
        pending: list[int],
        op: ReduceOp,
        quantization: QuantizationOptions | None,
        hint: DistributionHint,
        max_in_flight: int,
        outcome: _RetryOutcome,
    ) -> list[int]:
        """One pass of ``all_reduce_multiple_with_retry`` over ``pending``: the aborted
        indices, to retry. Successes and rejections are recorded in ``outcome``.

        Every peer sees the same verdict for every index, so every peer launches the
        same indices in the same order, and retries the same ones.
        """
        failed: list[int] = []
        fatal: list[PCCLError] = []
        slots = trio.Semaphore(max_in_flight)
        handles: dict[int, AsyncReduceHandle] = {}

        async def one(index: int) -> None:
            try:
                info = await handles[index].wait()
            except CollectiveAborted:
                failed.append(index)
            except _Rejected as exc:  # the same verdict on every peer: not retried
                outcome.rejected[index] = str(exc)
            except PCCLError as exc:  # the run is over for us: stop launching
                fatal.append(exc)
            else:
                outcome.tx += info.tx_bytes
                outcome.rx += info.rx_bytes
                outcome.clamped += info.clamped
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            for index in pending:
                await slots.acquire()  # launch in index order, the same on every peer
                if fatal:
                    break
                try:
                    handles[index] = self.all_reduce_async(
                        tensors[index], op=op, tag=index, quantization=quantization,
                        distribution_hint=hint,
                    )
                except PCCLError as exc:
                    fatal.append(exc)
                    break
                nursery.start_soon(one, index)
        if fatal:
            raise fatal[0]
        return sorted(failed)

    def _check_reduce_arguments(
        self,
        send: Any,
        recv: Any,
        op: ReduceOp,
        tag: int,
        quantization: QuantizationOptions | None,
        distribution_hint: DistributionHint,
    ) -> tuple[Any, Any, Any]:
        if not isinstance(op, ReduceOp):
            raise InvalidArgument(f"op must be a pccl_trio.ReduceOp, got {op!r}")
        if not (isinstance(tag, int) and not isinstance(tag, bool) and 0 <= tag < 1 << 64):
            raise InvalidArgument(f"tag must be an integer in [0, 2**64), got {tag!r}")
        if not isinstance(distribution_hint, DistributionHint):
            raise InvalidArgument(
                f"distribution_hint must be a pccl_trio.DistributionHint, got {distribution_hint!r}"
            )
        if quantization is not None:
            if not isinstance(quantization, QuantizationOptions):
                raise InvalidArgument(
                    f"quantization must be QuantizationOptions or None, got {quantization!r}"
                )
            if not isinstance(quantization.algorithm, QuantizationAlgorithm):
                raise InvalidArgument(
                    "quantization.algorithm must be a pccl_trio.QuantizationAlgorithm, got "
                    f"{quantization.algorithm!r}"
                )
            if not isinstance(quantization.quantized_datatype, DataType):
                raise InvalidArgument(
                    "quantization.quantized_datatype must be a pccl_trio.DataType, got "
                    f"{quantization.quantized_datatype!r}"
                )
        xp, send_array = as_array(send, name="send")
        if quantization is not None and quantization.algorithm is not QuantizationAlgorithm.NONE:
            check_quantization(
                quantization.algorithm, quantization.quantized_datatype, send_array.dtype, op
            )
        if recv is None or recv is send:
            return xp, send_array, send_array
        recv_xp, recv_array = as_array(recv, name="recv")
        if recv_xp is not xp:
            raise InvalidArgument("send and recv must live on the same device")
        if recv_array.dtype != send_array.dtype or recv_array.size != send_array.size:
            raise InvalidArgument(
                f"recv ({recv_array.size} x {recv_array.dtype}) must match send "
                f"({send_array.size} x {send_array.dtype}) in count and dtype"
            )
        if np.shares_memory(send_array, recv_array):
            if send_array.ctypes.data == recv_array.ctypes.data:
                return xp, send_array, send_array  # the same memory: in place
            raise InvalidArgument("send and recv overlap without being the same buffer")
        return xp, send_array, recv_array

    async def _run_all_reduce(
        self,
        handle: AsyncReduceHandle,
        xp: Any,
        send: Any,
        result: Any,
        op: ReduceOp,
        quantization: QuantizationOptions | None,
        hint: DistributionHint,
    ) -> None:
        """The task behind a handle; every outcome ends up in the handle."""
        try:
            info = await self._all_reduce_attempt(
                handle.tag, xp, send, result, op, quantization, hint
            )
        except PCCLError as exc:
            handle._finish(None, exc)
        except Exception as exc:  # a bug: report it to the caller, keep the peer alive
            log.exception("all-reduce with tag %d failed unexpectedly", handle.tag)
            handle._finish(None, exc)
        else:
            handle._finish(info, None)
        finally:
            # Cancelled (alone, or grouped by the nurseries it crossed): the
            # communicator is closing under it.
            if not handle.done:
                handle._finish(
                    None, InvalidUsage("the communicator was closed during the all-reduce")
                )
            self._tags_in_flight.discard(handle.tag)

    async def _all_reduce_attempt(
        self,
        tag: int,
        xp: Any,
        send: Any,
        result: Any,
        op: ReduceOp,
        quantization: QuantizationOptions | None,
        hint: DistributionHint,
    ) -> ReduceInfo:
        await self._ensure_ring()
        ring = self._ring
        if len(ring) < 2:
            raise TooFewPeers(
                "all_reduce() needs at least 2 peers in the peer group; it has 1"
            )
        assert self._peer_id is not None
        rank = ring.index(self._peer_id)
        codec = None
        if quantization is not None:
            codec = Codec(xp, result.dtype, quantization.algorithm,
                          quantization.quantized_datatype, hint)
        attempt = AllReduceAttempt(
            xp=xp, send=send, result=result, op=op, tag=tag, world=len(ring), rank=rank,
            slice_bytes=self._config.slice_bytes, buffers=self._buffers, codec=codec,
        )
        attempt.ring = ring
        attempt.predecessor = ring[rank - 1]
        self._attempts_by_tag[tag] = attempt
        verdict: CollectiveVerdict | None = None
        local_ok = False
        try:
            await self._send(
                CollectiveInitiate(
                    tag=tag,
                    count=int(result.size),
                    dtype=from_numpy_dtype(result.dtype).value,
                    op=op.value,
                    quantized_dtype=(
                        quantization.quantized_datatype if quantization is not None
                        else from_numpy_dtype(result.dtype)
                    ).value,
                    quantization=(
                        quantization.algorithm if quantization is not None
                        else QuantizationAlgorithm.NONE
                    ).value,
                    distribution_hint=hint.value if quantization is not None else 0,
                )
            )
            reply: CollectiveCommence | CollectiveVerdict = await self._wait_for(
                (CollectiveCommence, CollectiveVerdict),
                lambda m: m.tag == tag and (isinstance(m, CollectiveCommence) or m.seq == 0),
            )
            if isinstance(reply, CollectiveVerdict):
                verdict = reply
            else:
                local_ok = await self._run_ring(attempt)
                await self._send(
                    CollectiveComplete(
                        tag=tag, seq=attempt.seq, aborted=not local_ok,
                        invalid=attempt.invalid or "",
                    )
                )
                verdict = await self._wait_for(
                    CollectiveVerdict, lambda m: m.tag == tag and m.seq == attempt.seq
                )
        except BaseException as exc:
            self._end_attempt(attempt)
            await attempt.settle()
            attempt.restore()
            attempt.release()
            if verdict is None and isinstance(exc, Exception) and not isinstance(exc, PCCLError):
                # A bug after this peer voted (the protocol's own errors leave the
                # master informed).
                self._abandon(attempt, exc)
            raise
        self._end_attempt(attempt)
        assert verdict is not None
        try:
            if verdict.outcome == SUCCESS and local_ok:
                return ReduceInfo(
                    world_size=len(ring), tx_bytes=attempt.tx_bytes, rx_bytes=attempt.rx_bytes,
                    clamped=attempt.clamped,
                )
            await attempt.settle()
            if verdict.outcome == REJECTED and not verdict.seq:
                attempt.restore()  # nothing was written, but keep the rule simple
                raise _Rejected(verdict.reason)
            reason = verdict.reason or attempt.failure or "a peer failed"
            self._ring_stale = True
            last = not self._attempts_by_tag
            ring_error: PCCLError | None = None
            async with trio.open_nursery() as nursery:
                if last and attempt.uses_threads:
                    # Restore (a copy of up to the whole buffer) in a worker thread
                    # while the ring is re-established below.
                    nursery.start_soon(
                        partial(run_in_thread, attempt.restore, interrupt=lambda: None)
                    )
                else:
                    attempt.restore()
                if last:
                    # The last collective of the failed set re-establishes the ring
                    # now, so a retry runs at once on the surviving peers.
                    try:
                        await self._ensure_ring()
                    except UpdateTopologyFailed:
                        pass
                    except PCCLError as exc:  # raised below, not grouped by the nursery
                        ring_error = exc
            if ring_error is not None:
                raise ring_error
            if verdict.outcome == REJECTED:
                # A peer's data could not be reduced: retrying would fail alike.
                raise _Rejected(
                    f"the all-reduce with tag {tag} failed for every peer: {reason}; the "
                    "input was restored"
                )
            raise CollectiveAborted(
                f"the all-reduce with tag {tag} was aborted for every peer: {reason}; the "
                "input was restored and retrying is safe"
            )
        finally:
            attempt.release()

    def _abandon(self, attempt: AllReduceAttempt, error: Exception) -> None:
        """This peer voted for a collective and then failed unexpectedly (a bug). The
        others count on its part, and after the abort on its vote to re-establish the
        ring; it can promise neither, so it leaves the run, and the master tells them."""
        self._fail(
            InvalidUsage(
                f"internal error during the all-reduce with tag {attempt.tag} ({error!r}); "
                "this peer left the run so the others do not wait for it: create a new "
                "Communicator to join again"
            )
        )

    def _end_attempt(self, attempt: AllReduceAttempt) -> None:
        """The attempt is over: no more writes, no more frames routed to it."""
        attempt.stop()
        del self._attempts_by_tag[attempt.tag]
        self._attempts_by_seq.pop(attempt.seq, None)
        self._inbox = [
            m for m in self._inbox
            if not (isinstance(m, CollectiveAbort) and m.seq == attempt.seq)
        ]
        self._ring_lot.unpark_all()

    async def _run_ring(self, attempt: AllReduceAttempt) -> bool:
        """This peer's part of a commenced attempt; True if it completed locally."""
        successor = attempt.ring[(attempt.schedule.rank + 1) % len(attempt.ring)]
        pool = self._tx.get(successor)
        connections = [s for _, s in sorted(pool.slots.items())] if pool else []
        connections = [c for c in connections if not c.closed]
        if not connections:
            attempt.fail(f"no open connection to the next peer ({successor})")
        master_error: PCCLError | None = None
        ok = False
        async with trio.open_nursery() as nursery:

            async def watch_for_abort() -> None:
                nonlocal master_error
                try:
                    await self._wait_for(
                        CollectiveAbort, lambda m: m.tag == attempt.tag and m.seq == attempt.seq
                    )
                except PCCLError as exc:
                    master_error = exc
                attempt.stop()  # aborted: no more writes, whatever is in flight
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_for_abort)
            try:
                await attempt.send_all(connections)
                ok = True
            except LocalFailure as exc:
                log.info("peer %s: tag %d failed locally: %s", self._peer_id, attempt.tag, exc)
            nursery.cancel_scope.cancel()
        if master_error is not None:
            raise master_error
        return ok and attempt.live

    async def _ensure_ring(self) -> None:
        """Re-establish the ring (without admitting peers) if an abort left it stale.

        Runs once no collective is in flight on this peer: every survivor of an
        aborted collective does the same, so the vote completes.
        """
        while self._ring_stale:
            self._raise_if_failed()
            if self._attempts_by_tag or self._busy is not None:
                await self._ring_lot.park()
                continue
            with self._operation("re-establishing the ring"):
                if await self._establish_rounds(accept_new_peers=False):
                    return
            raise UpdateTopologyFailed(
                "the ring could not be re-established after an aborted collective; "
                "call update_topology()"
            )

    async def _establish_rounds(self, *, accept_new_peers: bool, voted: bool = False) -> bool:
        """Vote and take part in establishment rounds until one succeeds, at most
        ``Config.establish_attempts`` of them (``voted``: the first needs no vote).

        On failure the ring stays stale: the master holds this peer as CONNECT_FAILED,
        where only a topology vote is allowed, so every other collective call
        re-establishes first.
        """
        for attempt in range(self._config.establish_attempts):
            if attempt or not voted:
                await self._vote(VoteEstablish(accept_new_peers=accept_new_peers))
            if await self._establish_round():
                self._ring_stale = False
                return True
        self._ring_stale = True
        return False

    def get_attribute(self, attribute: Attribute) -> int:
        """A world-size attribute, as of the last successful topology update."""
        if not isinstance(attribute, Attribute):
            raise InvalidArgument(f"expected a pccl_trio.Attribute, got {attribute!r}")
        self._raise_if_failed()
        if self._world is None or self._status is not _Status.CONNECTED:
            raise InvalidUsage("get_attribute() needs a connected communicator; call connect()")
        world = self._world
        return {
            Attribute.GLOBAL_WORLD_SIZE: world.global_world_size,
            Attribute.PEER_GROUP_WORLD_SIZE: world.peer_group_world_size,
            Attribute.NUM_DISTINCT_PEER_GROUPS: world.num_distinct_peer_groups,
            Attribute.LARGEST_PEER_GROUP_WORLD_SIZE: world.largest_peer_group_world_size,
        }[attribute]

    async def aclose(self) -> None:
        """Leave the run: close every connection. Safe to call more than once."""
        if self._status is _Status.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        await self._shutdown()

    async def __aenter__(self) -> Communicator:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"<Communicator peer={self._peer_id} group={self._peer_group} "
            f"{self._status.name.lower()} master={self.master_address}>"
        )

    # --- state checks --------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._status is _Status.CLOSED:
            raise InvalidUsage("the communicator is closed")

    def _check_connected(self) -> None:
        self._raise_if_failed()
        if self._status is not _Status.CONNECTED:
            raise InvalidUsage(
                f"the communicator is {self._status.name.lower()}; call connect() first"
            )

    def _check_idle(self, name: str) -> None:
        """Connected, with no all-reduce in flight (``name`` is the call asking)."""
        self._check_connected()
        if self._tags_in_flight:
            raise InvalidUsage(
                f"{name}() while all-reduces are in flight (tags "
                f"{sorted(self._tags_in_flight)}); await them first"
            )

    @contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        """Run one membership call; at most one runs at a time.

        The master counts on every peer that voted to see its vote through. If the call
        is interrupted (cancelled, or an unexpected error) after it voted, this peer
        can no longer follow the protocol, so it leaves the run at once: the others
        are told by the master instead of waiting for a peer that will never answer.
        """
        if self._busy is not None:
            raise InvalidUsage(
                f"{name}() while {self._busy}() is running on this communicator; "
                "membership calls must not overlap"
            )
        self._busy = name
        self._voted = False
        try:
            yield
        except BaseException as exc:
            if self._voted and not isinstance(exc, PCCLError):
                self._fail(
                    InvalidUsage(
                        f"{name}() was interrupted ({type(exc).__name__}) after voting; "
                        "this peer left the run so the others do not wait for it: "
                        "create a new Communicator to join again"
                    )
                )
            raise
        finally:
            self._busy = None
            self._voted = False
            self._ring_lot.unpark_all()

    def _fail(self, error: PCCLError) -> None:
        """The run is over for this peer: wake every waiter with ``error``."""
        if self._failure is None and self._status is not _Status.CLOSED:
            log.warning("peer %s: %s", self._peer_id, error)
            self._failure = error
            self._status = _Status.FAILED
        self._inbox_lot.unpark_all()
        self._wake_readers()
        self._ring_lot.unpark_all()
        if self._nursery is not None:
            self._nursery.start_soon(self._close_connections)

    # --- background tasks ----------------------------------------------------------

    async def _start_background(self) -> None:
        started = trio.Event()

        async def run() -> None:
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    started.set()
                    await trio.sleep_forever()
            except Exception as exc:  # pragma: no cover - every task handles its own errors
                log.exception("communicator background tasks crashed")
                self._fail(MasterConnectionError(f"internal error in the communicator: {exc!r}"))
            finally:
                self._nursery = None
                self._background_done.set()

        trio.lowlevel.spawn_system_task(run, name=f"pccl_trio communicator {id(self):#x}")
        await started.wait()

    async def _open_master_link(self) -> None:
        assert self._nursery is not None
        try:
            self._p2p_listener = await self._network.listen(self._p2p_host, self._p2p_port)
        except OSError as exc:
            raise InvalidArgument(
                f"cannot listen for p2p connections on {self._p2p_host}:{self._p2p_port}: {exc}"
            ) from exc
        p2p_port = listener_address(self._p2p_listener)[1]
        self._nursery.start_soon(self._accept_p2p, self._p2p_listener)
        try:
            with trio.fail_after(self._config.connect_timeout):
                stream = await self._network.connect(self._master_host, self._master_port)
        except (OSError, trio.TooSlowError) as exc:
            raise MasterConnectionError(
                f"could not reach the master at {self.master_address} ({exc or 'timed out'}); "
                "check that `pccl-trio master` runs there and the address is right"
            ) from exc
        self._link = FramedStream(stream, max_control_frame=self._config.max_control_frame)
        self._nursery.start_soon(self._read_master)
        await self._send(
            Register(
                protocol_version=PROTOCOL_VERSION,
                peer_group=self._peer_group,
                p2p_port=p2p_port,
                advertised_host=self._advertised_host,
            )
        )
        welcome = await self._wait_for(Welcome)
        self._peer_id = welcome.peer_id
        self._heartbeat_interval = welcome.heartbeat_interval
        self._liveness_timeout = welcome.liveness_timeout
        self._nursery.start_soon(self._send_heartbeats)
        log.info("peer %d registered with the master at %s", self._peer_id, self.master_address)

    async def _read_master(self) -> None:
        link = self._link
        assert link is not None
        try:
            while True:
                with trio.move_on_after(self._liveness_timeout) as silence:
                    message = await link.receive_message()
                if silence.cancelled_caught:
                    # After a pause (a stopped process, a long blocking step) the
                    # deadline passes before queued bytes are read: look once more.
                    with trio.move_on_after(min(0.1, self._heartbeat_interval)) as grace:
                        message = await link.receive_message()
                if silence.cancelled_caught and grace.cancelled_caught:
                    raise MasterConnectionError(
                        f"the master at {self.master_address} sent nothing for "
                        f"{self._liveness_timeout}s (liveness timeout): it or the network "
                        "is down; restart the run's master and reconnect"
                    )
                if isinstance(message, Kick):
                    raise Kicked(message.reason)
                if isinstance(message, Heartbeat):
                    continue
                # Some messages change what the data path accepts: apply them here, in
                # order, before any later message or p2p frame can depend on them.
                if isinstance(message, CollectiveCommence):
                    self._on_commence(message)
                elif isinstance(message, P2PInfo):
                    self._expect_sender(message.ring)
                elif isinstance(message, Welcome):
                    self._peer_id = message.peer_id
                self._inbox.append(message)
                self._inbox_lot.unpark_all()
        except PCCLError as exc:
            self._fail(exc)
        except RemoteProtocolError as exc:
            self._fail(MasterConnectionError(f"the master sent malformed data ({exc})"))
        except trio.BrokenResourceError as exc:
            self._fail(
                MasterConnectionError(
                    f"lost the connection to the master at {self.master_address} ({exc}); "
                    "a run cannot go on without its master"
                )
            )
        except trio.ClosedResourceError:
            pass  # we closed the link ourselves, and whoever did recorded why

    def _expect_sender(self, ring: tuple[int, ...]) -> None:
        """Accept p2p connections from our predecessor in ``ring`` from now on."""
        if self._peer_id in ring and len(ring) > 1:
            self._expected_senders.add(ring[ring.index(self._peer_id) - 1])
            self._p2p_lot.unpark_all()

    def _on_commence(self, message: CollectiveCommence) -> None:
        """Make the attempt reachable by its number before any of its data is read."""
        attempt = self._attempts_by_tag.get(message.tag)
        if attempt is not None and attempt.seq == 0:
            attempt.seq = message.seq
            self._attempts_by_seq[message.seq] = attempt
            if message.ring != attempt.ring:
                attempt.fail(
                    f"the master's ring {list(message.ring)} differs from this peer's "
                    f"{list(attempt.ring)}"
                )
        with self._commenced:
            self._last_commenced = max(self._last_commenced, message.seq)
            self._commenced.notify_all()
        self._commence_lot.unpark_all()

    async def _send_heartbeats(self) -> None:
        while True:
            await trio.sleep(self._heartbeat_interval)
            try:
                await self._send(Heartbeat())
            except PCCLError:
                return

    async def _send(self, message: Message) -> None:
        self._raise_if_failed()
        link = self._link
        assert link is not None
        try:
            await link.send_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(
                MasterConnectionError(
                    f"lost the connection to the master at {self.master_address} ({exc})"
                )
            )
            self._raise_if_failed()
        except BaseException:
            if link.closed:  # interrupted mid-frame: the link had to go
                self._fail(
                    MasterConnectionError(
                        f"a call was interrupted while sending {type(message).__name__} to the "
                        "master; the half-sent message ended this peer's link"
                    )
                )
            raise

    async def _vote(self, message: Message) -> None:
        """Send a vote; from then on the running call must see it through."""
        await self._send(message)
        self._voted = True

    async def _wait_for(
        self, kind: type[_M] | tuple[type[_M], ...], match: Callable[[_M], bool] | None = None
    ) -> _M:
        """Take the first message of ``kind`` (and matching ``match``) from the inbox."""
        while True:
            for index, message in enumerate(self._inbox):
                if isinstance(message, kind) and (match is None or match(message)):
                    del self._inbox[index]
                    return message
            self._raise_if_failed()
            await self._inbox_lot.park()

    # --- p2p connections -----------------------------------------------------------

    async def _accept_p2p(self, listener: trio.abc.Listener[Any]) -> None:
        assert self._nursery is not None
        while True:
            try:
                stream = await listener.accept()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except OSError as exc:  # pragma: no cover - e.g. too many open files
                log.warning("p2p accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            self._nursery.start_soon(self._serve_p2p, stream)

    async def _serve_p2p(self, stream: trio.abc.Stream) -> None:
        framed = FramedStream(
            stream,
            max_control_frame=self._config.max_control_frame,
            max_data_frame=self._config.max_data_frame,
        )
        try:
            with trio.fail_after(self._config.connect_timeout):
                hello = await framed.receive_message_exact()
            if not isinstance(hello, P2PHello | SharedStateRequest | BenchmarkRequest):
                raise RemoteProtocolError(f"expected P2PHello, got {type(hello).__name__}")
            if hello.protocol_version != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    f"peer {hello.peer_id} speaks protocol {hello.protocol_version}, "
                    f"this peer {PROTOCOL_VERSION}"
                )
            if isinstance(hello, BenchmarkRequest):
                await self._run_protocol(framed, bandwidth.serve_benchmark(hello))
                return
            if isinstance(hello, SharedStateRequest):
                await self._serve_shared_state(framed, hello)
                return
            with trio.fail_after(self._config.connect_timeout):
                if hello.slot >= 1024:
                    raise RemoteProtocolError(f"pool slot {hello.slot} out of range")
                # Only a predecessor the master named may connect; its round's info may
                # reach us a moment after it reached the connecting peer.
                while hello.peer_id not in self._expected_senders:
                    await self._p2p_lot.park()
                pool = self._rx.setdefault(hello.peer_id, _Pool(peer_id=hello.peer_id))
                old = pool.slots.get(hello.slot)
                pool.slots[hello.slot] = framed
                if old is not None:
                    await old.aclose()
                await framed.send_message(P2PHelloAck())
            link = self._to_link(framed)
            if link is None:
                await self._read_data(framed, hello.peer_id)
                return
            if pool.slots.get(hello.slot) is framed:
                pool.slots[hello.slot] = link
            try:
                await run_in_thread(
                    partial(self._read_data_thread, link, hello.peer_id), interrupt=link.cut
                )
            finally:
                link.cut()
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            log.warning("dropping a p2p connection: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # a bug here must cost one connection, not the peer
            log.exception("peer %s: p2p connection handler failed", self._peer_id)
            for attempt in list(self._attempts_by_seq.values()):
                attempt.fail("internal error while receiving (see the log)")
        finally:
            await framed.aclose()

    def _to_link(self, framed: FramedStream) -> SocketLink | None:
        """The thread-driven form of a p2p connection whose handshake is done, or None
        to keep it in trio tasks (no socket of its own, or threads turned off)."""
        if not self._config.threaded_data_path:
            return None
        return SocketLink.detach(
            framed, max_data_frame=self._config.max_data_frame,
            max_control_frame=self._config.max_control_frame,
        )

    def _link_lost(self, sender: int, exc: BaseException) -> None:
        """Every attempt receiving from ``sender`` lost frames with its connection."""
        for attempt in list(self._attempts_by_seq.values()):
            if attempt.predecessor == sender and attempt.live:
                attempt.fail(f"the link from peer {sender} broke ({exc})")

    @staticmethod
    def _deliver(
        attempt: AllReduceAttempt | None,
        sender: int,
        reader: FramedStream | SocketLink,
        staging: Any,
        header: tuple[int, int, int, int],
    ) -> Generator[memoryview, None, None]:
        """Where one data frame's payload goes, for either kind of reader.

        Yields the one buffer the reader must fill with the payload, then hands the
        slice to its attempt: straight into the result for all-gather data, through
        ``staging`` otherwise, and nowhere for a stale attempt (``None``). Closing the
        generator before it finishes means the payload did not arrive.

        Raises:
            RemoteProtocolError: the frame does not fit its attempt (which fails).
        """
        tag, _seq, offset, nbytes = header
        if attempt is None:
            yield staging[:nbytes].data  # read and drop
            return
        try:
            segment, index = attempt.claim(tag, offset, nbytes)
        except RemoteProtocolError as exc:
            attempt.fail(f"peer {sender} sent a bad data frame ({exc})")
            raise
        view = attempt.direct_target(segment, index, reader)
        if view is not None:
            received = False
            try:
                yield view
                received = True
            finally:
                attempt.on_direct_slice(segment, index, reader, received)
            return
        payload = staging[:nbytes]
        yield payload.data
        attempt.on_slice(segment, index, payload)

    async def _read_data(self, framed: FramedStream, sender: int) -> None:
        """Receive data frames from ``sender`` and hand each slice to its attempt (a
        trio task: streams without a socket of their own)."""
        staging = np.empty(0, dtype=np.uint8)
        try:
            while True:
                header = await framed.receive_data_header()
                if header[3] > staging.size:
                    staging = np.empty(header[3], dtype=np.uint8)
                attempt = await self._attempt_for(header[1])
                with contextlib.closing(self._deliver(attempt, sender, framed, staging, header)) as plan:
                    for view in plan:
                        await framed.receive_into(view)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError) as exc:
            self._link_lost(sender, exc)
            raise

    def _read_data_thread(self, link: SocketLink, sender: int) -> None:
        """``_read_data`` for a ``SocketLink``, in a worker thread."""
        staging = np.empty(0, dtype=np.uint8)
        try:
            while True:
                header = link.receive_data_header()
                if header[3] > staging.size:
                    staging = np.empty(header[3], dtype=np.uint8)
                attempt = self._attempt_for_thread(header[1])
                with contextlib.closing(self._deliver(attempt, sender, link, staging, header)) as plan:
                    for view in plan:
                        link.receive_into(view)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError) as exc:
            self._link_lost(sender, exc)
            raise

    async def _attempt_for(self, seq: int) -> AllReduceAttempt | None:
        """The attempt a data frame belongs to; None for a finished or aborted one.

        A frame may arrive before the master's commence for its attempt reached this
        peer; it waits for it (attempt numbers grow, so anything at or below the last
        commence seen and not running is stale).
        """
        while seq > self._last_commenced:
            if self._failure is not None or self._status is _Status.CLOSED:
                raise trio.ClosedResourceError("the communicator is shutting down")
            await self._commence_lot.park()
        return self._attempts_by_seq.get(seq)

    def _attempt_for_thread(self, seq: int) -> AllReduceAttempt | None:
        """``_attempt_for`` from a reader thread."""
        with self._commenced:
            while seq > self._last_commenced:
                if self._failure is not None or self._status is _Status.CLOSED:
                    raise trio.ClosedResourceError("the communicator is shutting down")
                self._commenced.wait(timeout=1.0)
        return self._attempts_by_seq.get(seq)

    async def _open_pool(self, endpoint: PeerEndpoint) -> bool:
        """Open ``pool_size`` connections to ``endpoint``; False if any failed."""
        assert self._peer_id is not None
        pool = _Pool(peer_id=endpoint.peer_id)
        ok = True

        async def open_slot(slot: int) -> None:
            nonlocal ok
            stream: trio.abc.Stream | None = None
            try:
                with trio.fail_after(self._config.connect_timeout):
                    stream = await self._network.connect(endpoint.host, endpoint.port)
                    framed = FramedStream(
                        stream,
                        max_control_frame=self._config.max_control_frame,
                        max_data_frame=self._config.max_data_frame,
                    )
                    await framed.send_message(
                        P2PHello(protocol_version=PROTOCOL_VERSION, peer_id=self._peer_id or 0,
                                 slot=slot)
                    )
                    ack = await framed.receive_message()
                    if not isinstance(ack, P2PHelloAck):
                        raise RemoteProtocolError(f"expected P2PHelloAck, got {ack!r}")
                pool.slots[slot] = self._to_link(framed) or framed
            except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                    trio.ClosedResourceError, RemoteProtocolError) as exc:
                log.warning(
                    "peer %s: cannot connect to peer %d at %s (slot %d): %s",
                    self._peer_id, endpoint.peer_id,
                    format_address(endpoint.host, endpoint.port), slot, exc or "timed out",
                )
                ok = False
                if stream is not None:
                    await trio.aclose_forcefully(stream)

        async with trio.open_nursery() as nursery:
            for slot in range(self._pool_size):
                nursery.start_soon(open_slot, slot)
        if not ok:
            await pool.aclose()
            return False
        old = self._tx.pop(endpoint.peer_id, None)
        if old is not None:
            await old.aclose()
        self._tx[endpoint.peer_id] = pool
        return True

    async def _establish_round(self) -> bool:
        """Take part in the next establishment round; True if it succeeded."""
        info = await self._wait_for(P2PInfo)
        assert self._peer_id is not None
        ring = info.ring
        if self._peer_id not in ring:
            raise MasterConnectionError(
                f"the master's ring {list(ring)} does not include this peer ({self._peer_id})"
            )
        index = ring.index(self._peer_id)
        successor = ring[(index + 1) % len(ring)] if len(ring) > 1 else None
        predecessor = ring[index - 1] if len(ring) > 1 else None
        endpoints = {e.peer_id: e for e in info.neighbours}
        failed: list[int] = []
        if successor is not None:
            pool = self._tx.get(successor)
            if pool is None or not pool.healthy(self._pool_size):
                endpoint = endpoints.get(successor)
                if endpoint is None or not await self._open_pool(endpoint):
                    failed.append(successor)
        for peer_id in [p for p in self._tx if p != successor]:
            await self._tx.pop(peer_id).aclose()
        for peer_id in [p for p in self._rx if p != predecessor]:
            await self._rx.pop(peer_id).aclose()
        await self._send(
            P2PEstablished(round=info.round, success=not failed, failed_peers=tuple(failed))
        )
        result = await self._wait_for(P2PEstablishResult, lambda r: r.round == info.round)
        if result.success:
            self._ring = result.ring
            self._world = result.world
            self._follow_ring(result.ring)
            self._expected_senders = {predecessor} if predecessor is not None else set()
            log.info(
                "peer %d: round %d done, ring %s, world %d",
                self._peer_id, result.round, list(result.ring), result.world.global_world_size,
            )
        return result.success

    def _follow_ring(self, ring: tuple[int, ...]) -> None:
        """Keep ``topology`` about the installed ring: a round may install another order
        of the same peers (a better ring the master's background search found)."""
        info = self._topology
        if info is None or ring == info.ring or sorted(ring) != sorted(info.peers):
            return
        self._topology = dataclasses.replace(
            info,
            ring=ring,
            predicted_seconds=info.predict(info.reference_bytes, ring),
            optimal=False,
        )

    # --- shutdown ------------------------------------------------------------------

    async def _close_connections(self) -> None:
        with trio.CancelScope(shield=True):
            if self._link is not None:
                await self._link.aclose()
            if self._p2p_listener is not None:
                await trio.aclose_forcefully(self._p2p_listener)
            for pools in (self._tx, self._rx):
                doomed = list(pools.values())
                pools.clear()
                for pool in doomed:
                    await pool.aclose()

    def _wake_readers(self) -> None:
        """Readers waiting for a commence must look at the communicator's state."""
        self._commence_lot.unpark_all()
        with self._commenced:
            self._commenced.notify_all()

    async def _shutdown(self) -> None:
        self._status = _Status.CLOSED
        self._inbox_lot.unpark_all()
        self._wake_readers()
        await self._close_connections()
        nursery = self._nursery
        if nursery is not None:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await self._background_done.wait()

