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

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

import trio

from .._config import Config
from .._core.errors import RemoteProtocolError
from .._core.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Kick,
    Message,
    P2PEstablished,
    P2PEstablishResult,
    P2PHello,
    P2PHelloAck,
    P2PInfo,
    PeerEndpoint,
    PeersPendingResult,
    Register,
    VoteEstablish,
    VotePeersPending,
    Welcome,
    WorldSizes,
)
from .._errors import (
    InvalidArgument,
    InvalidUsage,
    Kicked,
    MasterConnectionError,
    PCCLError,
    UpdateTopologyFailed,
)
from .._types import Attribute
from ..transport import (
    FramedStream,
    Network,
    TcpNetwork,
    format_address,
    listener_address,
    parse_address,
)

__all__ = ["Communicator", "CommunicatorStatistics"]

log = logging.getLogger("pccl_trio.peer")

_M = TypeVar("_M", bound=Message)
U32_MAX = (1 << 32) - 1


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
    slots: dict[int, FramedStream] = dataclasses.field(default_factory=dict)

    def healthy(self, size: int) -> bool:
        return len(self.slots) == size and not any(s.closed for s in self.slots.values())

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
        self._link: FramedStream | None = None
        self._inbox: list[Message] = []
        self._inbox_lot = trio.lowlevel.ParkingLot()
        self._tx: dict[int, _Pool] = {}
        self._rx: dict[int, _Pool] = {}
        self._p2p_listener: trio.abc.Listener[Any] | None = None
        self._nursery: trio.Nursery | None = None
        self._background_done = trio.Event()

    # --- public API ----------------------------------------------------------------

    @property
    def peer_id(self) -> int | None:
        """The id the master gave this peer (None before ``connect``)."""
        return self._peer_id

    @property
    def ring(self) -> tuple[int, ...]:
        """This peer group's ring order, as of the last successful topology update."""
        return self._ring

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
                while not await self._establish_round():
                    await self._send(VoteEstablish(accept_new_peers=True))
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
        self._check_connected()
        with self._operation("update_topology"):
            for _attempt in range(self._config.establish_attempts):
                self._voted = True
                await self._send(VoteEstablish(accept_new_peers=True))
                if await self._establish_round():
                    return
            raise UpdateTopologyFailed(
                f"the ring could not be established in {self._config.establish_attempts} "
                "rounds (peers kept failing or leaving); call update_topology() again"
            )

    async def are_peers_pending(self) -> bool:
        """Collective vote: whether peers wait to be admitted by ``update_topology``."""
        self._check_connected()
        with self._operation("are_peers_pending"):
            self._voted = True
            await self._send(VotePeersPending())
            result = await self._wait_for(PeersPendingResult)
            return result.pending

    def get_attribute(self, attribute: Attribute) -> int:
        """A world-size attribute, as of the last successful topology update."""
        if not isinstance(attribute, Attribute):
            raise InvalidArgument(f"expected a pccl_trio.Attribute, got {attribute!r}")
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

    def _fail(self, error: PCCLError) -> None:
        """The run is over for this peer: wake every waiter with ``error``."""
        if self._failure is None and self._status is not _Status.CLOSED:
            log.warning("peer %s: %s", self._peer_id, error)
            self._failure = error
            self._status = _Status.FAILED
        self._inbox_lot.unpark_all()
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
            except Exception:  # pragma: no cover - every task handles its own errors
                log.exception("communicator background tasks crashed")
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
                    raise MasterConnectionError(
                        f"the master at {self.master_address} sent nothing for "
                        f"{self._liveness_timeout}s (liveness timeout): it or the network "
                        "is down; restart the run's master and reconnect"
                    )
                if isinstance(message, Kick):
                    raise Kicked(message.reason)
                if isinstance(message, Heartbeat):
                    continue
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

    async def _send_heartbeats(self) -> None:
        while True:
            await trio.sleep(self._heartbeat_interval)
            try:
                await self._send(Heartbeat())
            except PCCLError:
                return

    async def _send(self, message: Message) -> None:
        self._raise_if_failed()
        assert self._link is not None
        try:
            await self._link.send_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(
                MasterConnectionError(
                    f"lost the connection to the master at {self.master_address} ({exc})"
                )
            )
            self._raise_if_failed()

    async def _wait_for(self, kind: type[_M], match: Callable[[_M], bool] | None = None) -> _M:
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
                hello = await framed.receive_message()
                if not isinstance(hello, P2PHello):
                    raise RemoteProtocolError(f"expected P2PHello, got {type(hello).__name__}")
                if hello.protocol_version != PROTOCOL_VERSION:
                    raise RemoteProtocolError(
                        f"peer {hello.peer_id} speaks protocol {hello.protocol_version}, "
                        f"this peer {PROTOCOL_VERSION}"
                    )
                if hello.slot >= 1024:
                    raise RemoteProtocolError(f"pool slot {hello.slot} out of range")
                pool = self._rx.setdefault(hello.peer_id, _Pool(peer_id=hello.peer_id))
                old = pool.slots.get(hello.slot)
                pool.slots[hello.slot] = framed
                if old is not None:
                    await old.aclose()
                await framed.send_message(P2PHelloAck())
            # The data path reads here; until a collective claims the connection the
            # only legal thing to arrive is the end of the stream.
            frame = await framed.receive()
            raise RemoteProtocolError(f"unexpected {type(frame).__name__} on an idle p2p link")
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            log.warning("dropping a p2p connection: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await framed.aclose()

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
                pool.slots[slot] = framed
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
            log.info(
                "peer %d: round %d done, ring %s, world %d",
                self._peer_id, result.round, list(result.ring), result.world.global_world_size,
            )
        return result.success

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

    async def _shutdown(self) -> None:
        self._status = _Status.CLOSED
        self._inbox_lot.unpark_all()
        await self._close_connections()
        nursery = self._nursery
        if nursery is not None:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await self._background_done.wait()

