"""A peer's p2p connections: the listener, the ring's connection pools, and connecting.

Theory of operation
-------------------
Every connection a peer accepts opens with one control frame that says what it is
for, and the listener hands it to the handler registered for that frame's kind
(``handle``): ``SharedStateRequest`` for a peer fetching shared state,
``BenchmarkRequest`` for a peer measuring the link. A ``P2PHello`` opens a ring
neighbour's data connection: the listener admits it into its pool first (``_admit``,
below) and hands the ring's handler (``handle_ring``) the admitted connection, in the
form that receives its data.
Each first frame carries the protocol version, checked here once for all of them.
With a run secret, the run-secret handshake comes before the first frame, within
``connect_timeout``, and names the connection's purpose, which must match the first
frame's kind; a connection that fails it is closed without a word.

The ring's connections are *pools*: ``pool_size`` connections to the next peer of the
ring (tx), and as many from the previous one (rx), each named by its slot. With
``pool_size`` 0 each pool is sized to its path: one TCP connection carries at most
its send buffer in flight, so a long fat path needs several to be filled. The pool's
first connection's TCP handshake gives its round trip (the kernel's own measure of it,
``kernel_round_trip``, blind to this process's delays in noticing), and ``pool_for``
turns that into a count: enough connections that their buffers hold what
``POOL_TARGET_RATE`` keeps in flight over that round trip, at most ``POOL_MOST``. On a
LAN or loopback that is one; over 100 ms it is 8. The peer registers ``POOL_MOST`` as
its pool size then, so that its successor admits every slot it may open. A data
connection is admitted (``_admit``) only from a predecessor the master named (a round's
``P2PInfo``, which may reach this peer a moment after it reached the connecting one),
from the host the master knows it at, into a slot below the pool size it registered
with, and replaces an older connection in the same slot. The pools themselves, and what
the data path asks of them, are ``_pools.RingPools`` (``pools``). Data goes one way on
a pool, but the first connection of each also carries what the receiver sends back
(the completion notices of leased attempts, ``_agreement``): the receiver sends on its
rx slot 0 (over a long enough path, ``_pools.NOTICES_BACK_FROM``, whose round trip
``_admit`` takes from the kernel), and the sender runs the ring's backward reader on its tx slot 0 from the
pool's opening until it closes (``handle_ring``). After a round, ``rewire``
keeps a healthy pool to the successor or opens a new one, and closes the pools of
peers that are no longer neighbours: which pools change is decided first, then the IO
is done.

Whoever claims to be a peer must show what the master knows of it (``claim_refusal``):
the host, and, where the master named a node identity for it, that identity proven in
the connection's handshake. This holds on both sides: a listener checks the peer a
first frame names (ring sender, shared-state fetcher, measuring peer), and ``connect``
checks that the listener it reached proved the identity the master named for it. An
identity thus cannot be claimed by another holder of the run secret.

Once its handshake is over, a TCP connection is handed to a worker thread as a
``SocketLink`` (``to_link``) where the threaded data path is on and threads are
allowed; otherwise it stays a ``FramedStream`` driven by trio tasks. ``connect`` and
``run_protocol`` are the client side of the one-shot protocols (shared state, link
measurement): a fresh connection, the protocol run by the right driver, closed after.
"""

from __future__ import annotations

import functools
import logging
import math
import typing
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import trio

from .._config import Config
from .._core.channel import Channel, HandshakeFailed, Purpose
from .._core.errors import RemoteProtocolError
from .._core.identity import fingerprint, public_bytes
from .._core.messages import (
    MAX_POOL_SIZE,
    PROTOCOL_VERSION,
    BenchmarkRequest,
    Message,
    P2PHello,
    P2PHelloAck,
    P2PInfo,
    PeerEndpoint,
    SharedStateRequest,
    body_limits,
)
from .._core.ring import neighbours
from .._core.wire import Admission
from ..transport import (
    SOCKET_BUFFER_BYTES,
    Arrived,
    Connection,
    Credential,
    FramedStream,
    Network,
    SocketLink,
    comes_from,
    format_address,
    kernel_round_trip,
    listener_address,
    remote_host,
    secure_client,
    secure_server,
    serve_accepted,
    threads_allowed,
)
from ._lifecycle import Lifecycle
from ._pools import Pool, RingPools
from ._protocol import Protocol, run_protocol
from ._session import MasterSession

__all__ = ["LINK_ERRORS", "POOL_MOST", "POOL_TARGET_RATE", "P2PConnections", "claim_refusal", "pool_for"]

#: The most connections a pool sized to its path opens.
POOL_MOST = 16
#: The rate, in bytes per second, a pool sized to its path is meant to carry.
POOL_TARGET_RATE = 2.5e9 / 8


def pool_for(round_trip: float, *, window: int = SOCKET_BUFFER_BYTES) -> int:
    """The connections of a pool sized to a path of ``round_trip`` seconds, each of
    which keeps at most ``window`` bytes in flight (see the module docstring)."""
    if not round_trip > 0:
        return 1
    needed = POOL_TARGET_RATE * round_trip / window
    return POOL_MOST if needed >= POOL_MOST else max(1, math.ceil(needed))

log = logging.getLogger("pccl_trio.peer")

_W = TypeVar("_W")
_M = TypeVar("_M", bound=Message)

#: What a p2p connection raises when the other peer or the network fails it.
LINK_ERRORS = (
    OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
    RemoteProtocolError,
)

#: The first frames a p2p connection may open with.
FirstFrame = P2PHello | SharedStateRequest | BenchmarkRequest
#: The handshake purpose each first frame needs.
PURPOSES: dict[type[Message], Purpose] = {
    P2PHello: Purpose.RING,
    SharedStateRequest: Purpose.SHARED_STATE,
    BenchmarkRequest: Purpose.BENCHMARK,
}

#: Accepted connections that have not sent their first frame yet, at most; more are
#: closed at once (each holds a task and a buffer until ``connect_timeout``).
MAX_NEW_CONNECTIONS = 64


class Claimed(typing.Protocol):
    """What the master says of a peer: the host its connections come from and the node
    identity it proved (empty: none)."""

    @property
    def host(self) -> str: ...

    @property
    def identity(self) -> bytes: ...


async def claim_refusal(framed: FramedStream, claimed: Claimed) -> str:
    """Why the connection ``framed`` is not the peer the master described as ``claimed``
    (empty: nothing against it): its node identity is not proven, or it comes from
    another host."""
    if claimed.identity:
        proven = b"" if framed.channel is None else framed.channel.peer_identity
        if proven != claimed.identity:
            return (
                f"the master named node identity {fingerprint(claimed.identity)} for it and "
                f"the connection proved {fingerprint(proven)}"
            )
    if not await comes_from(framed.stream, claimed.host):
        return (
            f"the connection comes from {remote_host(framed.stream)} and the master knows "
            f"it at {claimed.host}"
        )
    return ""


class P2PConnections:
    """See the module docstring."""

    def __init__(
        self,
        *,
        config: Config,
        network: Network,
        lifecycle: Lifecycle,
        session: MasterSession,
        pool_size: int,
        credential: Credential | None,
    ) -> None:
        self._config = config
        self._network = network
        self._life = lifecycle
        self._session = session
        #: Connections per ring neighbour; 0: each pool sized to its path.
        self.pool_size = pool_size
        # The last TCP handshake's time to each peer: one round trip.
        self._round_trips: dict[int, float] = {}
        self._listener: trio.abc.Listener[Any] | None = None
        self._handlers: dict[type[Message], Callable[[FramedStream, Any], Awaitable[None]]] = {}
        self._read_back: Callable[[Connection, int], Awaitable[None]] | None = None
        #: The ring's pools (``_pools``): what the data path sends and receives on.
        self.pools = RingPools()
        # Peers allowed to open data connections to us: predecessors named by the master.
        self._expected_senders: dict[int, PeerEndpoint] = {}
        self._expected_lot = trio.lowlevel.ParkingLot()
        self._credential = credential
        self._first_frames = body_limits(
            typing.get_args(FirstFrame), config.max_control_frame
        )

    # --- accepting -----------------------------------------------------------------------

    def handle(self, kind: type[_M], handler: Callable[[FramedStream, _M], Awaitable[None]]) -> None:
        """Serve accepted connections whose first frame is a ``kind`` with ``handler``
        (which owns the connection until it returns; it is closed afterwards). Ring
        connections are admitted before their handler: ``handle_ring``."""
        if kind is P2PHello:
            raise TypeError("a ring connection is admitted before it is handled: use handle_ring")
        self._handlers[kind] = handler

    def handle_ring(
        self,
        handler: Callable[[Connection, P2PHello], Awaitable[None]],
        *,
        back: Callable[[Connection, int], Awaitable[None]] | None = None,
    ) -> None:
        """Serve ring neighbours' data connections (first frame ``P2PHello``) with
        ``handler``, once each is admitted into its pool and acknowledged (``_admit``);
        it gets the connection in the form that receives its data, and owns it until it
        returns (it is closed afterwards). ``back`` reads what the successor sends back
        on the first connection of every pool opened to it (``back(connection,
        successor)``, until the connection closes; it must not close it)."""

        async def admitted(framed: FramedStream, hello: P2PHello) -> None:
            await handler(await self._admit(framed, hello), hello)

        self._handlers[P2PHello] = admitted
        self._read_back = back

    async def listen(self, host: str, port: int) -> int:
        """Start accepting p2p connections; the port listened on.

        Raises:
            OSError: the address cannot be listened on.
        """
        self._listener = await self._network.listen(host, port)
        assert self._life.nursery is not None
        self._life.spawn(functools.partial(
            serve_accepted, self._listener, self._serve, max_fresh=MAX_NEW_CONNECTIONS,
            nursery=self._life.nursery, log=log, what="p2p connection",
            name=lambda: f"peer {self._session.peer_id}: ",
        ))
        return listener_address(self._listener)[1]

    @property
    def identity(self) -> bytes:
        """The node identity this peer proves in its handshakes (empty: none)."""
        key = None if self._credential is None else self._credential.identity
        return b"" if key is None else public_bytes(key)

    @property
    def address(self) -> tuple[str, int] | None:
        """The listener's ``(host, port)`` (None before ``listen``)."""
        return None if self._listener is None else listener_address(self._listener)

    async def _serve(self, stream: trio.abc.Stream, arrived: Arrived) -> None:
        framed: FramedStream | None = None
        try:
            try:
                with trio.fail_after(self._config.connect_timeout):
                    purpose, framed = await self._accept_handshake(stream)
                    first = await framed.receive_message_exact(Admission(self._first_frames))
            finally:
                arrived()
            handler = self._handlers.get(type(first))
            if handler is None or not isinstance(first, FirstFrame):
                raise RemoteProtocolError(f"expected P2PHello, got {type(first).__name__}")
            if purpose is not None and PURPOSES[type(first)] is not purpose:
                raise RemoteProtocolError(
                    f"{type(first).__name__} on a connection opened for {purpose.name}"
                )
            if first.protocol_version != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    f"peer {first.peer_id} speaks protocol {first.protocol_version}, "
                    f"this peer {PROTOCOL_VERSION}"
                )
            await handler(framed, first)
        except HandshakeFailed as exc:
            log.info("closing a p2p connection from %s: %s", remote_host(stream), exc)
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            log.warning("dropping a p2p connection: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # a bug here must cost one connection, not the peer
            log.exception("peer %s: p2p connection handler failed", self._session.peer_id)
        finally:
            if framed is not None:
                await framed.aclose()
            else:
                await trio.aclose_forcefully(stream)

    async def _accept_handshake(self, stream: trio.abc.Stream) -> tuple[Purpose | None, FramedStream]:
        """The purpose the client named (None without a run secret) and the stream."""
        if self._credential is None:
            return None, self.framed(stream)
        purpose, channel = await secure_server(stream, self._credential, frozenset(PURPOSES.values()))
        return purpose, self.framed(stream, channel)

    async def _admit(self, framed: FramedStream, hello: P2PHello) -> Connection:
        """Admit a ring neighbour's data connection into its rx pool and acknowledge it;
        the connection in the form that receives its data.

        Raises:
            RemoteProtocolError: a slot at or above the sender's pool size, a connection
                from another host than the sender's, or bytes before the handshake
                finished.
            trio.TooSlowError: the master never named the sender our predecessor.
        """
        with trio.fail_after(self._config.connect_timeout):
            if hello.slot >= MAX_POOL_SIZE:
                raise RemoteProtocolError(f"pool slot {hello.slot} out of range")
            # Only a predecessor the master named may connect; its round's info may
            # reach us a moment after it reached the connecting peer.
            while (sender := self._expected_senders.get(hello.peer_id)) is None:
                await self._expected_lot.park()
            # A slot beyond the sender's pool would be a connection beside its real
            # ones, whose frames the data path would take as the predecessor's.
            if hello.slot >= sender.pool_size:
                raise RemoteProtocolError(
                    f"P2PHello from peer {hello.peer_id} for slot {hello.slot}, but its pool "
                    f"has {sender.pool_size} connection(s)"
                )
            refusal = await claim_refusal(framed, sender)
            if refusal:
                raise RemoteProtocolError(
                    f"P2PHello claiming to be peer {hello.peer_id}, but {refusal}"
                )
            pool = self.pools.rx_pool(hello.peer_id)
            old = pool.slots.get(hello.slot)
            pool.slots[hello.slot] = framed
            if hello.slot == 0:
                pool.round_trip = kernel_round_trip(framed.stream)
            if old is not None:
                await old.aclose()
            await framed.send_message(P2PHelloAck())
        link = self.to_link(framed)
        if link is None:
            return framed
        if pool.slots.get(hello.slot) is framed:
            pool.slots[hello.slot] = link
        return link

    def expect_sender(self, info: P2PInfo) -> None:
        """Accept data connections from our predecessor in a round's ring from now on
        (a route of the master session: applied as the info arrives)."""
        around = neighbours(info.ring, self._session.peer_id or 0)
        if around is None:
            return
        for endpoint in info.neighbours:
            if endpoint.peer_id == around[0]:
                self._expected_senders[endpoint.peer_id] = endpoint
                self._expected_lot.unpark_all()

    # --- the ring's pools ----------------------------------------------------------------

    async def rewire(
        self, successor: int | None, predecessor: int | None, endpoints: Mapping[int, PeerEndpoint]
    ) -> list[int]:
        """After a round: a healthy pool to ``successor`` (opened if need be), no pools
        to or from peers that are no longer neighbours; the peers that could not be
        reached."""
        reopen = successor is not None and not self.pools.healthy_to(successor)
        failed: list[int] = []
        if reopen:
            assert successor is not None
            endpoint = endpoints.get(successor)
            if endpoint is None or not await self._open_pool(endpoint):
                failed.append(successor)
        for pool in self.pools.stale(successor, predecessor):
            await pool.aclose()
        return failed

    def expect_only(self, predecessor: int | None) -> None:
        """After a successful round: only the round's predecessor may connect."""
        self._expected_senders = {
            p: e for p, e in self._expected_senders.items() if p == predecessor
        }

    @property
    def registered_pool_size(self) -> int:
        """The pool size this peer registers: its successor admits slots below it."""
        return self.pool_size or POOL_MOST

    async def _open_pool(self, endpoint: PeerEndpoint) -> bool:
        """Open a pool to ``endpoint`` (``pool_size`` connections, or as many as its
        path needs: ``pool_for``); False if any failed."""
        pool = Pool(peer_id=endpoint.peer_id)
        ok = True

        async def open_slot(slot: int) -> None:
            nonlocal ok
            framed: FramedStream | None = None
            try:
                with trio.fail_after(self._config.connect_timeout):
                    framed = await self.connect(endpoint, Purpose.RING)
                    await framed.send_message(
                        P2PHello(protocol_version=PROTOCOL_VERSION,
                                 peer_id=self._session.peer_id or 0, slot=slot)
                    )
                    ack = await framed.receive_message()
                    if not isinstance(ack, P2PHelloAck):
                        raise RemoteProtocolError(f"expected P2PHelloAck, got {ack!r}")
                pool.slots[slot] = self.to_link(framed) or framed
            except LINK_ERRORS as exc:
                log.warning(
                    "peer %s: cannot connect to peer %d at %s (slot %d): %s",
                    self._session.peer_id, endpoint.peer_id,
                    format_address(endpoint.host, endpoint.port), slot, exc or "timed out",
                )
                ok = False
                if framed is not None:
                    await framed.aclose()

        pool.size = self.pool_size
        first = 0
        if not pool.size:
            await open_slot(0)  # its handshake times the path's round trip
            pool.size = pool_for(self._round_trips.get(endpoint.peer_id, 0.0))
            first = 1
            if pool.size > 1:
                first_link = pool.slots.get(0)
                log.info(
                    "peer %s: %d connections to peer %d (round trip %.1f ms, congestion "
                    "control %s)", self._session.peer_id, pool.size, endpoint.peer_id,
                    self._round_trips[endpoint.peer_id] * 1e3,
                    first_link.congestion_control if isinstance(first_link, SocketLink)
                    else "of the system",
                )
        if ok:
            async with trio.open_nursery() as nursery:
                for slot in range(first, pool.size):
                    nursery.start_soon(open_slot, slot)
        if not ok:
            await pool.aclose()
            return False
        old = self.pools.install(pool)
        if old is not None:
            await old.aclose()
        if self._read_back is not None:
            pool.read.add(0)
            self._life.spawn(pool.read_back, self._read_back, pool.slots[0])
        return True

    # --- one-shot protocols ----------------------------------------------------------------

    def framed(self, stream: trio.abc.Stream, channel: Channel | None = None) -> FramedStream:
        """A p2p stream that speaks frames, with this peer's frame limits."""
        return FramedStream(
            stream,
            max_control_frame=self._config.max_control_frame,
            max_data_frame=self._config.max_data_frame,
            channel=channel,
        )

    async def refuses(self, peer_id: int, seconds: float) -> bool:
        """Whether the p2p listener of ring predecessor ``peer_id`` (where the master
        last named it) refuses connections: its process is gone. One that does not
        answer within ``seconds`` (a partition, a machine gone) is not taken as gone."""
        endpoint = self._expected_senders.get(peer_id)
        if endpoint is None:
            return False
        with trio.move_on_after(seconds):
            try:
                stream = await self._network.connect(endpoint.host, endpoint.port)
            except OSError:
                return True
            await trio.aclose_forcefully(stream)
        return False

    async def connect(self, endpoint: PeerEndpoint, purpose: Purpose) -> FramedStream:
        """A new connection to ``endpoint``'s p2p listener, for ``purpose`` (the caller
        sends the first frame and closes it).

        Raises:
            OSError: nobody answers there.
            trio.TooSlowError: connecting (or the handshake) took ``connect_timeout``.
            HandshakeFailed: the other side does not hold this run's secret.
            RemoteProtocolError: it did not prove the identity the master named.
        """
        with trio.fail_after(self._config.connect_timeout):
            started = trio.current_time()
            stream = await self._network.connect(endpoint.host, endpoint.port)
            measured = kernel_round_trip(stream)  # else the connect's time (a memory network's)
            self._round_trips[endpoint.peer_id] = (
                trio.current_time() - started if measured is None else measured
            )
            if self._credential is None:
                return self.framed(stream)
            try:
                channel = await secure_client(stream, self._credential, purpose)
                if endpoint.identity and channel.peer_identity != endpoint.identity:
                    raise RemoteProtocolError(
                        f"peer {endpoint.peer_id} at "
                        f"{format_address(endpoint.host, endpoint.port)} proved node identity "
                        f"{fingerprint(channel.peer_identity)}, but the master named "
                        f"{fingerprint(endpoint.identity)}"
                    )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        return self.framed(stream, channel)

    def to_link(self, framed: FramedStream) -> SocketLink | None:
        """The thread-driven form of a connection whose handshake is done, or None to
        keep it in trio tasks (no socket of its own, threads turned off or not allowed)."""
        if not (self._config.threaded_data_path and threads_allowed()):
            return None
        return SocketLink.detach(
            framed, max_data_frame=self._config.max_data_frame,
            max_control_frame=self._config.max_control_frame,
        )

    @property
    def idle_timeout(self) -> float:
        """How long a one-shot protocol may make no progress: a distributor waits up to
        the liveness timeout for its own plan before it answers, so twice that."""
        return 2 * self._session.liveness_timeout

    async def run_protocol(
        self,
        framed: FramedStream,
        protocol: Protocol[_W],
        *,
        track: set[Connection] | None = None,
    ) -> _W:
        """Run a one-shot protocol on ``framed`` (in a worker thread over its socket
        where ``to_link`` allows, in this task otherwise); the connection is closed
        afterwards. While it runs, the connection is in ``track`` (if given), so that
        it can be cut from elsewhere."""
        link = self.to_link(framed)
        connection: Connection = framed if link is None else link
        if track is not None:
            track.add(connection)
        try:
            return await run_protocol(protocol, connection, idle_timeout=self.idle_timeout)
        finally:
            if track is not None:
                track.discard(connection)
            if link is not None:
                link.cut()
            await framed.aclose()

    # --- the end -----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop accepting and close every pool (shielded: it runs while failing)."""
        with trio.CancelScope(shield=True):
            if self._listener is not None:
                await trio.aclose_forcefully(self._listener)
            await self.pools.aclose()
