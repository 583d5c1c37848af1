"""``Communicator``: a peer of a run, as one object with a small public surface.

Theory of operation
-------------------
The communicator is a facade over parts that each do one job; its public methods check
their arguments and delegate:

* ``Lifecycle`` (``_lifecycle``): status, failure, the background nursery, and the one
  membership call running at a time;
* ``MasterSession`` (``_session``): the master link, its single reader with the
  synchronous routes below, heartbeats; it holds the inbox (``_inbox``) and the
  reconnector (``_reconnect``), which gets a lost master back;
* ``P2PConnections`` (``_p2p``): the p2p listener, the first-frame handlers below, the
  ring's connection pools, connecting to other peers;
* ``DataReceiver`` (``_receiver``): the all-reduce attempts in flight and the readers
  of the ring's data connections;
* ``Membership`` (``_membership``): joining, establishment rounds, the ring and world;
* ``AllReduces`` (``_collectives``): all-reduce calls, attempts and verdicts;
* ``SharedStateSync`` (``_sync``) and ``TopologyOptimizer`` (``_optimize``).

The four features take the parts below them as one ``PeerContext`` (``_context``).
Parts depend only on parts listed before them; the two places where a lower part
must reach a higher one are wired here, as registrations: the master session's
routes (a ``CollectiveCommence`` makes its attempt reachable, a ``P2PInfo`` admits the
round's predecessor, an ``ExpectBenchmark`` announces a link measurement, all applied
as they are read) and the p2p listener's handlers (by the first frame of an accepted
connection).

With ``discover=RUN`` instead of the master's address, ``connect()`` first browses the
local network over mDNS for masters advertising the run (``transport.find_masters``,
within ``Config.discovery_timeout``) and then goes on as if the address of the first
had been given, trying the next address (at most ``_election.MAX_TARGETS``) when one
cannot be reached or fails the run-secret handshake. With ``host_master=True`` as
well, the peer is a candidate to host the run's master: ``Elector`` (``_election``)
stands, elects and hosts it in this communicator's nursery. Either way a ``Finder``
keeps browsing for the run's masters while the communicator lives, so that a member
that loses its master finds the one started or elected meanwhile.

A member that loses its master does not fail: the session gets a master back
(``_reconnect``, ``Config.master_grace``), an all-reduce in flight becomes
``CollectiveAborted`` with its input restored, and a membership call the lost master
never answered is made again once it is back (``_through_master_loss``).

``connect()`` starts the background nursery (as a trio system task, so the
communicator outlives the call that connected it), listens for p2p connections,
registers with the master and takes part in the rounds that admit this peer.
``aclose()`` (or a failure) closes every connection and stops every task.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import trio

from .._config import Config
from .._core.election import targets
from .._core.identity import public_bytes
from .._core.messages import (
    BenchmarkRequest,
    CollectiveCommence,
    ExpectBenchmark,
    P2PInfo,
    SharedStateRequest,
)
from .._core.ring import neighbours
from .._errors import InvalidArgument, InvalidUsage, MasterConnectionError, TooFewPeers
from .._types import (
    Attribute,
    DistributionHint,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    Shard,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
    TopK,
    TopologyInfo,
)
from ..transport import (
    Credential,
    DiscoveringNetwork,
    FramedStream,
    Network,
    TcpNetwork,
    check_remote_host,
    find_masters,
    listen_host,
    reaches_other_machines,
)
from ._arguments import check_arguments
from ._collectives import AllReduces, gathered, shard
from ._context import PeerContext
from ._election import MAX_TARGETS, Elector, Finder, check_discover
from ._fusion import Fusion
from ._lifecycle import Call, Lifecycle, Status
from ._membership import Membership
from ._metrics import peer_metrics
from ._optimize import TopologyOptimizer
from ._p2p import P2PConnections
from ._receiver import DataReceiver
from ._reconnect import Standing
from ._requests import (
    barrier_request,
    check_all_gather_arguments,
    check_all_reduce_call,
    check_broadcast_arguments,
    check_reduce_options,
    check_reduce_scatter_arguments,
    check_topk_multiple_arguments,
)
from ._results import AsyncGatherHandle, AsyncReduceHandle, AsyncShardHandle
from ._retry import RetriedReduces
from ._session import MasterLost, MasterSession
from ._sync import SharedStateSync

__all__ = ["Communicator", "CommunicatorStatistics"]


log = logging.getLogger("pccl_trio.peer")

_T = TypeVar("_T")


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


class Communicator:
    """A peer of a pccl_trio run.

    Creating one does no IO; ``await comm.connect()`` (or ``async with``) joins the run.

    Args:
        master_address: ``"host:port"`` of the master, or several, comma-separated
            (``"h1:48148,h2:48148"``): the first that answers is used, and a member that
            loses its master tries them in turn (``Config.master_grace``); None with
            ``discover``.
        peer_group: peers all-reduce and sync within their group; votes about
            membership span all groups.
        p2p_connection_pool_size: TCP connections per ring neighbour; 0 picks
            ``Config.p2p_connection_pool_size``.
        config: timers, limits and the run secret (the master's liveness timers
            replace these once registered); without a ``run_secret``,
            ``$PCCL_TRIO_RUN_SECRET`` is used if set.
        network: where connections come from; real TCP by default. Over TCP, a run
            without a secret stays on loopback unless ``config.insecure``: the master
            must be on this machine, and a wildcard ``p2p_host`` listens on
            127.0.0.1.
        p2p_host: interface for the p2p listener.
        p2p_port: port for the p2p listener (0: any free port).
        advertised_host: the address other peers should use to reach this one; by
            default the address the master sees.
        discover: instead of ``master_address``, the name of the run whose master
            ``connect()`` looks for on the local network (mDNS/DNS-SD, for
            ``Config.discovery_timeout``): one started ``--advertise RUN`` whose
            protocol version and run secret match this peer's. Needs the
            ``discovery`` extra (python-zeroconf), TCP, and a run secret (or
            ``config.insecure``). A member that loses its master looks again: a master
            elected or started meanwhile is found.
        host_master: with ``discover``, this peer is a candidate to host the run's
            master in its own process: if no master answers, the candidates elect one
            of themselves (the lowest rank key, derived from the node identity, else
            random), which serves the master in its communicator's nursery and
            advertises it; when it dies, the survivors elect again and carry on
            through master recovery (``Config.election_timeout``, ``_core.election``).
    """

    def __init__(
        self,
        master_address: str | None = None,
        peer_group: int = 0,
        p2p_connection_pool_size: int = 0,
        *,
        config: Config | None = None,
        network: Network | None = None,
        p2p_host: str = "0.0.0.0",
        p2p_port: int = 0,
        advertised_host: str | None = None,
        discover: str | None = None,
        host_master: bool = False,
    ) -> None:
        addresses = check_arguments(
            master_address, discover=discover, host_master=host_master, peer_group=peer_group,
            pool_size=p2p_connection_pool_size, p2p_port=p2p_port,
        )
        # What replacement() makes another communicator of: the arguments as given.
        self._arguments = partial(
            type(self), master_address, peer_group, p2p_connection_pool_size, config=config,
            network=network, p2p_host=p2p_host, p2p_port=p2p_port,
            advertised_host=advertised_host, discover=discover, host_master=host_master,
        )
        config = (config or Config()).with_environment_secret()
        if network is None:
            try:
                network = TcpNetwork(congestion_control=config.congestion_control)
            except ValueError as exc:
                raise InvalidArgument(f"Config.congestion_control: {exc}") from None
        # The run's name, and the network that finds its masters.
        discovery: tuple[str, DiscoveringNetwork] | None = None
        if discover is not None:
            discovery = discover, check_discover(
                discover, config, network, candidate_host=p2p_host if host_master else None
            )
        if reaches_other_machines(network):
            # Without a run secret a run stays on this machine unless told otherwise.
            secured, insecure = config.secret is not None, config.insecure
            try:
                if discover is None:
                    for master_host, _port in addresses:
                        check_remote_host(
                            master_host, secured=secured, insecure=insecure, what="the master"
                        )
                p2p_host = listen_host(p2p_host, secured=secured, insecure=insecure, who="this peer")
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        try:
            credential = Credential.of(config)
        except ValueError as exc:  # an identity without a secret, an unusable key file
            raise InvalidArgument(str(exc)) from None
        metrics, self._metrics_endpoint = peer_metrics(config.metrics)
        self._peer_group = peer_group
        self._p2p_host = p2p_host
        self._p2p_port = p2p_port
        self._advertised_host = advertised_host or ""
        self._discover = discover
        self._discovered = False
        self._config = config
        self._background_done = trio.Event()

        life = self._life = Lifecycle()
        self._master_address = str(master_address)
        session = self._session = MasterSession(
            config=config, network=network, lifecycle=life, addresses=addresses,
            credential=credential, metrics=metrics, standing=self._standing,
        )
        p2p = self._p2p = P2PConnections(
            config=config, network=network, lifecycle=life, session=session,
            credential=credential,
            pool_size=p2p_connection_pool_size or config.p2p_connection_pool_size,
        )
        receiver = self._receiver = DataReceiver(lifecycle=life, p2p=p2p)
        context = PeerContext(
            config=config, lifecycle=life, session=session, p2p=p2p, metrics=metrics
        )
        membership = self._membership = Membership(context, receiver=receiver)
        self._all_reduces = AllReduces(context, receiver=receiver, membership=membership)
        retried = RetriedReduces(self._all_reduces, membership=membership, metrics=metrics)
        self._fusion = Fusion(retried, bucket_bytes=config.bucket_bytes)
        self._sync = SharedStateSync(context, membership=membership)
        self._optimizer = TopologyOptimizer(context, membership=membership)

        session.route(CollectiveCommence, receiver.on_commence)
        session.route(P2PInfo, p2p.expect_sender)
        session.route(ExpectBenchmark, self._optimizer.expect_benchmark)
        p2p.handle_ring(receiver.serve, back=receiver.serve_back)
        # Replaceable through PeerSeam (a faulty distributor).
        self._serve_shared_state: Callable[
            [FramedStream, SharedStateRequest], Coroutine[Any, Any, None]
        ] = self._sync.serve
        p2p.handle(SharedStateRequest, self._serve_shared_state)
        p2p.handle(BenchmarkRequest, self._optimizer.serve_benchmark)
        life.close_with(self._close_connections)
        life.describe_with(
            lambda: f"peer {session.peer_id}" if session.peer_id is not None
            else f"a peer joining the run at {session.address or 'a master not found yet'}"
        )
        self._finder: Finder | None = None
        self._elector: Elector | None = None
        if discovery is not None:
            run, discovering = discovery
            finder = self._finder = Finder(
                run=run, config=config, directory=discovering.directory,
                lifecycle=life, session=session,
            )
            if host_master:
                elector = self._elector = Elector(
                    finder=finder, config=config, network=discovering, lifecycle=life,
                    session=session, host=p2p_host,
                    identity=public_bytes(credential.identity)
                    if credential is not None and credential.identity is not None else None,
                )
                session.on_away(elector.master_lost)
            else:
                session.on_away(finder.master_lost)

    # --- public API ----------------------------------------------------------------

    @property
    def peer_id(self) -> int | None:
        """The id the master gave this peer (None before ``connect``)."""
        return self._session.peer_id

    @property
    def peer_group(self) -> int:
        """The peer group this communicator joins."""
        return self._peer_group

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where this peer serves its metrics (``Config.metrics="HOST:PORT"``, once
        connected); None otherwise."""
        return self._metrics_endpoint.address

    @property
    def ring(self) -> tuple[int, ...]:
        """This peer group's ring order, as of the last successful topology update."""
        return self._membership.ring

    @property
    def topology(self) -> TopologyInfo | None:
        """What the last ``optimize_topology`` measured and installed for this peer's
        group (None before the first)."""
        return self._optimizer.topology

    @property
    def master_address(self) -> str:
        """The master's ``"host:port"`` (or several), as given or, with ``discover``,
        as found by ``connect()`` ("" before)."""
        if self._discover is not None:
            return self._session.address if self._discovered else ""
        return self._master_address

    @property
    def hosting_master(self) -> bool:
        """Whether this peer's process hosts the run's master now (``host_master``)."""
        return self._elector is not None and self._elector.hosting

    def statistics(self) -> CommunicatorStatistics:
        """What this peer currently knows and holds open."""
        tx, rx = self._p2p.pools.counts()
        return CommunicatorStatistics(
            peer_id=self.peer_id, ring=self.ring, tx_connections=tx, rx_connections=rx
        )

    def get_attribute(self, attribute: Attribute) -> int:
        """A world-size attribute, as of the last successful topology update."""
        if not isinstance(attribute, Attribute):
            raise InvalidArgument(f"expected a pccl_trio.Attribute, got {attribute!r}")
        self._life.raise_if_failed()
        world = self._membership.world
        if world is None or self._life.status is not Status.CONNECTED:
            raise InvalidUsage("get_attribute() needs a connected communicator; call connect()")
        return {
            Attribute.GLOBAL_WORLD_SIZE: world.global_world_size,
            Attribute.PEER_GROUP_WORLD_SIZE: world.peer_group_world_size,
            Attribute.NUM_DISTINCT_PEER_GROUPS: world.num_distinct_peer_groups,
            Attribute.LARGEST_PEER_GROUP_WORLD_SIZE: world.largest_peer_group_world_size,
        }[attribute]

    async def connect(self) -> None:
        """Register with the master and return once the run accepted this peer.

        Blocks until the existing peers call ``update_topology`` (immediately if this
        is the first peer).

        Raises:
            MasterConnectionError: the master can't be reached or went away.
            Kicked: the master refused this peer (the reason says why).
            InvalidUsage: already connected or closed.
        """
        life = self._life
        life.check_loop("connect()")
        if life.status is not Status.NEW:
            raise InvalidUsage(
                f"connect() on a communicator that is {life.status.name.lower()}; "
                "create a new Communicator to join again"
            )
        life.status = Status.CONNECTING
        try:
            with life.operation(Call.CONNECT):
                self._metrics_endpoint.start()
                await self._start_background()
                if self._finder is not None:
                    assert life.nursery is not None
                    await life.nursery.start(self._finder.watch)
                if self._finder is not None and self._elector is None:
                    masters = await find_masters(
                        self._finder.run, secret=self._config.secret,
                        seconds=self._config.discovery_timeout, directory=self._finder.directory,
                    )
                    self._session.retarget(targets(masters, [], limit=MAX_TARGETS))
                    self._discovered = True
                try:
                    port = await self._p2p.listen(self._p2p_host, self._p2p_port)
                except OSError as exc:
                    raise InvalidArgument(
                        f"cannot listen for p2p connections on {self._p2p_host}:{self._p2p_port}: {exc}"
                    ) from exc
                if self._elector is not None:
                    await self._elector.stand()
                    await self._elector.elect(functools.partial(self._open_session, port))
                    self._discovered = True
                else:
                    await self._open_session(port)
                await self._membership.join()
            life.status = Status.CONNECTED
            self._session.member = True  # from now on, losing the master is survivable
        except BaseException:
            await self._shutdown()
            raise

    async def _open_session(
        self, p2p_port: int, targets: Sequence[tuple[str, int]] | None = None
    ) -> bool:
        """Register with the master; given ``targets`` (an election probing for its
        master), there, and whether one answered instead of raising."""
        if targets is not None:
            self._session.retarget(targets)
        try:
            await self._session.open(
                peer_group=self._peer_group, p2p_port=p2p_port,
                advertised_host=self._advertised_host, pool_size=self._p2p.registered_pool_size,
                probing=targets is not None,
            )
        except MasterConnectionError:
            if targets is None:
                raise
            self._life.raise_if_failed()
            return False
        return True

    async def update_topology(self) -> None:
        """Collective vote: admit pending peers and rebuild the ring.

        Every accepted peer must call it; it returns when all did and the new ring is
        connected.

        Raises:
            UpdateTopologyFailed: establishing the ring failed repeatedly; calling
                again is safe.
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        self._life.check_loop("update_topology()")
        await self._all_reduces.calls.wound_down()
        self._all_reduces.check_idle("update_topology")
        await self._through_master_loss(self._membership.update_topology)

    # ``timeout`` is part of the collective (every peer gives up alike, at the shortest
    # one), which a caller's ``trio.fail_after`` around the call could not be.
    async def wait_for_peers(self, n: int, *, timeout: float) -> None:  # noqa: ASYNC109
        """Collective: return once the run has admitted at least ``n`` peers (this one
        included), admitting those that wait to join as they come.

        Every accepted peer must call it, as the recommended loop calls
        ``are_peers_pending`` and ``update_topology``, which it does: while the run is
        smaller than ``n`` it waits with ``are_peers_pending`` for a joiner (at no cost
        while nobody comes) and admits it with ``update_topology``. Every peer sees the
        same world size after each update, so all return together; a peer admitted
        meanwhile calls it too.

        Raises:
            TooFewPeers: the run was still smaller than ``n`` after ``timeout`` seconds
                (``math.inf`` allowed); raised on every peer alike, when the shortest
                of the peers' waits runs out.
            InvalidArgument: ``n`` is not an integer >= 1, or ``timeout`` not a number
                of seconds >= 0.
            InvalidUsage, UpdateTopologyFailed, MasterConnectionError, Kicked: as for
                ``are_peers_pending`` and ``update_topology``.
        """
        self._life.check_loop("wait_for_peers()")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be a number of peers >= 1, got {n!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise InvalidArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        deadline = trio.current_time() + timeout
        while (world := self.get_attribute(Attribute.GLOBAL_WORLD_SIZE)) < n:
            # False only once the shortest wait among the peers ran out: every peer
            # gets the same answer, and all give up together.
            if not await self.are_peers_pending(wait=max(0.0, deadline - trio.current_time())):
                raise TooFewPeers(
                    f"the run has {world} peer(s) after waiting {timeout:g} s for {n}: "
                    "start more peers (they join by connecting to the master), or wait "
                    "longer"
                )
            await self.update_topology()

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
        self._life.check_loop("optimize_topology()")
        await self._all_reduces.calls.wound_down()
        self._all_reduces.check_idle("optimize_topology")
        await self._through_master_loss(self._optimizer.optimize)

    async def sync_shared_state(
        self,
        state: Any,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
    ) -> SharedStateSyncInfo:
        """Collective vote: make this peer's shared state the group's popular one.

        Every peer of the group calls it with the same tensors (names, dtypes, sizes, in
        the same order) and a revision one above its last sync's (or the same one again
        when the step after that sync was aborted). The master elects
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
        self._life.check_loop("sync_shared_state()")
        self._life.check_connected()
        if not isinstance(strategy, SharedStateSyncStrategy):
            raise InvalidArgument(
                f"strategy must be a pccl_trio.SharedStateSyncStrategy, got {strategy!r}"
            )
        await self._all_reduces.calls.wound_down()
        self._all_reduces.check_idle("sync_shared_state")
        return await self._through_master_loss(lambda: self._sync.sync(state, strategy))

    async def are_peers_pending(self, *, wait: float = 0.0) -> bool:
        """Collective vote: whether peers wait to be admitted by ``update_topology``.

        ``wait`` (seconds, ``math.inf`` allowed): while nobody waits, the master holds the
        answer until a peer asks to join (True) or the shortest ``wait`` of the voters
        runs out (False). A peer alone in the run waits for company this way at no cost
        (one question, no round trips meanwhile), still told of a kick or a lost master.

        Raises:
            InvalidUsage: the master refused the vote (another peer waits in
                ``update_topology``, ``optimize_topology`` or, in this peer group,
                ``sync_shared_state``, or a member did not ask within the stall
                timeout), another membership call runs, or the communicator is not
                connected.
            InvalidArgument: ``wait`` is not a number >= 0.
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        self._life.check_loop("are_peers_pending()")
        self._life.check_connected()
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0:
            raise InvalidArgument(f"wait must be a number of seconds >= 0, got {wait!r}")
        deadline = trio.current_time() + wait
        return await self._through_master_loss(
            lambda: self._membership.are_peers_pending(deadline)
        )

    async def _through_master_loss(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """Run a membership call; if the master is lost meanwhile, run it again once it
        is back (the vote died with the lost master; the state it changes is restored
        or re-voted, see each call)."""
        while True:
            try:
                return await call()
            except MasterLost as exc:
                log.info("peer %s: %s; calling again once the master is back",
                         self._session.peer_id, exc)
                await self._session.until_back()

    async def _standing(self) -> Standing:
        """What this member tells a master it comes back to."""
        around = neighbours(self._membership.ring, self._session.peer_id or 0)
        predecessor, successor = around if around is not None else (0, 0)
        named = self._membership.neighbour_identities
        _tx, rx = self._p2p.pools.counts()
        # Its connections from the predecessor broke (which an aborted all-reduce does
        # too) and its listener refuses connections: that process is gone. A
        # successor's death would only show once something is sent: not reported.
        gone = predecessor != 0 and rx.get(predecessor) == 0 and await self._p2p.refuses(
            predecessor, min(1.0, self._config.connect_timeout)
        )
        return Standing(
            predecessor=predecessor, successor=successor,
            next_revision=self._sync.next_revision,
            predecessor_identity=named.get(predecessor, b""),
            successor_identity=named.get(successor, b""),
            predecessor_gone=gone,
        )

    async def all_reduce(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        compression: TopK | None = None,
    ) -> ReduceInfo:
        """Reduce ``send`` across the peer group; the result lands in ``recv``, or in
        ``send`` itself when ``recv`` is None.

        Every peer of the group must call it with the same ``tag``, count, dtype and
        op. On success every peer holds bit-identical results.

        ``compression=pccl.TopK(fraction, residual=...)`` sends only the largest
        entries of ``send + residual`` (and keeps the rest in ``residual``, updated in
        place once every peer succeeded): the result is the sum of every peer's sent
        entries, in ascending peer-id order (``TopK``; op SUM or AVG; not with
        ``quantization``, which ``TopK.values`` replaces).

        Raises:
            CollectiveAborted: a peer failed or left, or waits in
                ``sync_shared_state`` (then sync before retrying); an in-place ``send``
                is restored and a retry (after which the ring excludes departed peers)
                is safe.
            InvalidArgument: bad buffers, or the peers disagree on the arguments.
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        self._life.check_loop("all_reduce()")
        self._all_reduces.check_launch()
        request = check_all_reduce_call(send, recv, op, tag, quantization, distribution_hint, compression)
        return await self._all_reduces.all_reduce(request)

    def all_reduce_async(
        self,
        send: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        compression: TopK | None = None,
    ) -> AsyncReduceHandle:
        """Start an all-reduce in the communicator's own tasks; see ``all_reduce``.

        Arguments are checked before this returns (``InvalidArgument`` /
        ``InvalidUsage``); everything else is raised by ``await handle.wait()``.
        """
        self._life.check_loop("all_reduce_async()")
        self._all_reduces.check_launch()
        request = check_all_reduce_call(send, recv, op, tag, quantization, distribution_hint, compression)
        return self._all_reduces.launch(request)

    async def barrier(self, *, tag: int = 0) -> None:
        """Return once every peer of the group called ``barrier`` with this ``tag``.

        A collective of no data, with all-reduce's guarantees: every peer gets the same
        verdict, so all return or all raise. The tag is shared with all-reduces: a
        barrier facing an all-reduce of the same tag is refused for every peer. Under a
        lease (repeated barriers on one ring) it costs the ring's completion notices
        only: ``floor(W/2)`` hops, no master round trip.

        Raises:
            CollectiveAborted: a peer failed or left before every peer arrived (or
                waits in ``sync_shared_state``); retrying is safe.
            InvalidArgument: a bad tag, or a peer made another call of this tag.
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        self._life.check_loop("barrier()")
        self._all_reduces.check_launch()
        await self._all_reduces.all_reduce(barrier_request(tag))

    def barrier_async(self, *, tag: int = 0) -> AsyncReduceHandle:
        """Enter a barrier in the communicator's own tasks; see ``barrier``. ``await
        handle.wait()`` returns once every peer arrived (a ``ReduceInfo`` of no bytes)
        or raises what ``barrier`` would.
        """
        self._life.check_loop("barrier_async()")
        self._all_reduces.check_launch()
        return self._all_reduces.launch(barrier_request(tag))

    async def broadcast(self, tensor: Any, *, root: int, tag: int = 0) -> ReduceInfo:
        """Give every peer of the group the bytes of ``root``'s ``tensor`` (``root`` a
        peer id), in place: each peer's ``tensor`` (the same dtype and size
        everywhere) ends holding them, the root's stays as it was.

        The buffer goes down the ring from the root, slice by slice, each peer storing
        and passing on each slice at once: a large tensor costs about one transfer.

        Raises:
            CollectiveAborted: a peer failed or left before every peer held the bytes
                (the root included), or waits in ``sync_shared_state``; every
                ``tensor`` holds its input again, and retrying is safe.
            InvalidArgument: bad buffers, a ``root`` that is no peer of the group, or
                the peers disagree (another root, dtype or size, or another call of
                this tag).
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        self._life.check_loop("broadcast()")
        self._all_reduces.check_launch()
        request = check_broadcast_arguments(tensor, root=root, tag=tag)
        return await self._all_reduces.all_reduce(request)

    def broadcast_async(self, tensor: Any, *, root: int, tag: int = 0) -> AsyncReduceHandle:
        """Start a broadcast in the communicator's own tasks; see ``broadcast``.

        Arguments are checked before this returns (``InvalidArgument`` /
        ``InvalidUsage``); everything else is raised by ``await handle.wait()``.
        """
        self._life.check_loop("broadcast_async()")
        self._all_reduces.check_launch()
        return self._all_reduces.launch(check_broadcast_arguments(tensor, root=root, tag=tag))

    async def reduce_scatter(
        self, send: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> Shard:
        """Reduce ``send`` across the peer group and return this peer's part of the
        result: the parts partition the flattened vector in ascending peer-id order, as
        ``numpy.array_split`` cuts it (``Shard.start``, ``stop``), and each holds the
        same bits as that range of an all-reduce of the same vector on the same ring.

        Every peer must call it with the same ``tag``, count, dtype and op. ``send`` is
        only read: the reduction runs in a buffer of its own, and the shard's ``data``
        is a new 1-D array of ``send``'s kind (numpy, CuPy, torch). Each peer sends and
        receives ``(W-1)/W`` of the vector, half an all-reduce.

        Raises:
            CollectiveAborted: a peer failed or left, or waits in ``sync_shared_state``
                (then sync before retrying); retrying is safe.
            InvalidArgument: bad buffers, or the peers disagree on the arguments (or
                made another call of this tag).
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        self._life.check_loop("reduce_scatter()")
        self._all_reduces.check_launch()
        request = check_reduce_scatter_arguments(
            send, op=op, tag=tag, recycled=self._all_reduces.recycled
        )
        return await self._all_reduces.collect(request, partial(shard, request, send))

    def reduce_scatter_async(
        self, send: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> AsyncShardHandle:
        """Start a reduce-scatter in the communicator's own tasks; see
        ``reduce_scatter``. ``await handle.wait()`` returns the ``Shard``.

        Arguments are checked before this returns (``InvalidArgument`` /
        ``InvalidUsage``); everything else is raised by ``await handle.wait()``.
        """
        self._life.check_loop("reduce_scatter_async()")
        self._all_reduces.check_launch()
        request = check_reduce_scatter_arguments(
            send, op=op, tag=tag, recycled=self._all_reduces.recycled
        )
        return self._all_reduces.launch_collect(
            request, partial(shard, request, send), AsyncShardHandle
        )

    async def all_gather(self, send: Any, *, tag: int = 0) -> dict[int, Any]:
        """Every peer's ``send``, by peer id in ascending order: the same dict on every
        peer of the group, this peer's own part included.

        The peers may send different sizes (of the same dtype); each part is a 1-D array
        of ``send``'s kind (numpy, CuPy, torch), a view of one new buffer that holds
        them all in that order. ``send`` is only read. Every part goes around the ring
        once, each peer storing and passing it on slice by slice: each peer receives
        what the others sent, and sends that less what its predecessor sent.

        Raises:
            CollectiveAborted: a peer failed or left before every peer held every part,
                or waits in ``sync_shared_state``; retrying is safe.
            InvalidArgument: bad buffers, or the peers disagree (another dtype, or
                another call of this tag).
            InvalidUsage: the tag is already in flight, or a topology update runs.
            TooFewPeers: the peer group has a single peer.
        """
        self._life.check_loop("all_gather()")
        self._all_reduces.check_launch()
        request = check_all_gather_arguments(send, tag=tag)
        return await self._all_reduces.collect(request, partial(gathered, request, send))

    def all_gather_async(self, send: Any, *, tag: int = 0) -> AsyncGatherHandle:
        """Start an all-gather in the communicator's own tasks; see ``all_gather``.
        ``await handle.wait()`` returns the parts by peer id.

        Arguments are checked before this returns (``InvalidArgument`` /
        ``InvalidUsage``); everything else is raised by ``await handle.wait()``.
        """
        self._life.check_loop("all_gather_async()")
        self._all_reduces.check_launch()
        request = check_all_gather_arguments(send, tag=tag)
        return self._all_reduces.launch_collect(
            request, partial(gathered, request, send), AsyncGatherHandle
        )

    async def all_reduce_multiple_with_retry(
        self,
        tensors: Sequence[Any],
        *,
        op: ReduceOp = ReduceOp.SUM,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        max_in_flight: int = 16,
        compression: TopK | None = None,
    ) -> ReduceInfo:
        """All-reduce every tensor in place, fused into buckets, retrying after dropouts.

        ``compression=pccl.TopK(fraction, residual=[...])``: each tensor a Top-k
        all-reduce of its own (see ``all_reduce``; never fused), with the residual of
        the same index; each residual is updated once its tensor succeeded.

        Tensors smaller than ``Config.bucket_bytes`` are fused by dtype, in order, into
        buckets of up to that size (not when quantized); the others go alone, zero-copy.
        Each bucket is one all-reduce, its tag the bucket's index (with no fusion: the
        tensor's index); every peer must pass the same list, of tensors that share no
        memory (one listed twice, or overlapping views, would be read by one bucket
        while another writes it). At most ``max_in_flight`` buckets run at once,
        launched in order on every peer. When a peer drops,
        every all-reduce in flight is aborted together (inputs restored); the
        unfinished ones run again with the survivors, so each tensor ends as the
        reduction over the old world or over the new one, identical on every survivor.
        A bucket's results reach its tensors only once it succeeded. A bucket the run
        rejects (the peers disagree on it, or a peer's data cannot be quantized) is not
        retried; the others still complete, on every peer alike, before the rejection
        is raised.

        Returns:
            the payload bytes of the successful attempts, the values clamped by
            quantization, and the final world size.

        Raises:
            InvalidArgument: the run rejected some tensors (named in the message; each
                of them was restored to its input), or an argument is malformed.
            TooFewPeers: the peer group shrank to a single peer.
            CollectiveAborted: a peer of the group waits in ``sync_shared_state``
                (each tensor holds its input or, if it completed, its result).
        """
        self._life.check_loop("all_reduce_multiple_with_retry()")
        if not (isinstance(max_in_flight, int) and max_in_flight >= 1):
            raise InvalidArgument(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        if compression is not None:
            requests = check_topk_multiple_arguments(tensors, op, quantization, compression)
            for request in requests:  # chosen before the first pass, reused by retries
                assert request.topk is not None
                await request.topk.select()
            return await self._fusion.reduce(requests, max_in_flight)
        options = check_reduce_options(op=op, quantization=quantization, hint=distribution_hint)
        requests = [
            options.request(tensor, None, tag=index, name=f"tensors[{index}]")
            for index, tensor in enumerate(tensors)
        ]
        return await self._fusion.reduce(requests, max_in_flight)

    async def aclose(self) -> None:
        """Leave the run: close every connection. Safe to call more than once, and after
        the trio.run that connected it ended (which closed them)."""
        if self._life.status is Status.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        if self._life.loop_ended:
            self._life.status = Status.CLOSED  # its connections ended with that run
            await trio.lowlevel.checkpoint()
            return
        self._life.check_loop("aclose()")
        if self._life.status is Status.CONNECTED:
            await self._all_reduces.leave()
        await self._shutdown()

    def replacement(self) -> Communicator:
        """A new communicator made with this one's arguments (not connected): how a peer
        that was kicked, or whose communicator closed, joins the run again as a
        newcomer. This one is left as it is."""
        return self._arguments()

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
        master = self.master_address or f"(run {self._discover!r}, not found yet)"
        return (
            f"<Communicator peer={self.peer_id} group={self._peer_group} "
            f"{self._life.status.name.lower()} master={master}>"
        )

    # --- lifecycle -------------------------------------------------------------------

    async def _start_background(self) -> None:
        started = trio.Event()
        self._life.loop = trio.lowlevel.current_trio_token()

        async def run() -> None:
            crashed = False
            try:
                async with trio.open_nursery() as nursery:
                    self._life.nursery = nursery
                    started.set()
                    await trio.sleep_forever()
            except Exception as exc:  # pragma: no cover - every task handles its own errors
                crashed = True
                log.exception("communicator background tasks crashed")
                self._life.nursery = None  # closed: failing must not start tasks in it
                self._life.fail(MasterConnectionError(f"internal error in the communicator: {exc!r}"))
            finally:
                self._life.nursery = None
                # Not closed and not crashed: cancelled from outside, by the end of the
                # program's trio.run. Close the sockets rather than leak them (this peer
                # may still wait for its master), and say so to any later call.
                self._life.loop_ended = not crashed and self._life.status is not Status.CLOSED
                await self._close_connections()
                self._background_done.set()

        trio.lowlevel.spawn_system_task(run, name=f"pccl_trio communicator {id(self):#x}")
        await started.wait()

    async def _close_connections(self) -> None:
        with trio.CancelScope(shield=True):
            await self._session.aclose()
            await self._p2p.aclose()
            await self._metrics_endpoint.aclose()

    async def _shutdown(self) -> None:
        self._life.status = Status.CLOSED
        self._life.wake_all()
        await self._close_connections()
        nursery = self._life.nursery
        if nursery is not None:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await self._background_done.wait()
