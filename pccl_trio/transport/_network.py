"""The ``Network`` seam and its TCP implementation.

A ``Network`` gives listeners and outgoing connections, which is all a master and a
peer with a master's address need. Finding a master by name and hosting an elected
one need more of it: a ``Directory`` where masters are advertised and found, and ports
reserved for listeners to come (``reserve``). A network that offers both is a
``DiscoveringNetwork`` (``TcpNetwork``, whose directory is the local network's mDNS,
and the in-memory network's hosts, which share a directory of their own); callers ask
``isinstance(network, DiscoveringNetwork)`` before they use them. Whether a network's
connections may reach other machines, so that the rules on exposure without a run
secret (``_exposure``) and mDNS apply, is ``reaches_other_machines``, asked in one
place.

``comes_from`` tells whether a stream's other end is a given host (an address, or a
name that resolves to it): peers serve a p2p connection only from the host the master
knows the claimed peer at.

OSErrors from the operating system are turned into trio's resource errors here and
nowhere else: ``connect`` raises ``OSError`` subclasses only for "could not connect"
(refused, unreachable, timed out by the OS), and established streams raise
``trio.BrokenResourceError`` when the peer or the network broke them and
``trio.ClosedResourceError`` when we closed them ourselves (trio's own taxonomy).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any, Protocol, runtime_checkable

import trio

from ._discovery import MDNS, Directory

__all__ = [
    "DiscoveringNetwork",
    "InMemoryListener",
    "InMemoryStream",
    "Reservation",
    "Network",
    "TcpNetwork",
    "comes_from",
    "format_address",
    "listener_address",
    "parse_address",
    "reaches_other_machines",
    "remote_host",
]

#: Socket buffer size asked for on every TCP connection (the kernel may cap it).
SOCKET_BUFFER_BYTES = 4 << 20


class Network(Protocol):
    """Where a master or a peer gets its listeners and outgoing connections."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """Open a stream to ``host:port``; ``OSError`` if nobody answers."""
        ...

    async def listen(self, host: str, port: int) -> trio.abc.Listener[Any]:
        """Listen on ``host:port`` (port 0: any free port); see ``listener_address``."""
        ...


@runtime_checkable
class DiscoveringNetwork(Network, Protocol):
    """A ``Network`` that also advertises and finds masters and reserves ports: what
    ``Communicator(discover=...)`` needs, and ``host_master=True`` (see the module
    docstring)."""

    @property
    def directory(self) -> Directory:
        """Where masters (and candidates) of runs are advertised and found."""
        ...

    async def reserve(self, host: str, port: int = 0) -> Reservation:
        """A port on ``host`` bound for a listener to come (port 0: any free port):
        until ``Reservation.listen``, a dial there is refused at once."""
        ...


@runtime_checkable
class InMemoryStream(Protocol):
    """What a stream without a socket of its own (``pccl_trio.testing.MemoryStream``)
    offers beyond ``trio.abc.Stream``, so that frames are received without copies and
    connections can be cut and judged synchronously, as with a socket."""

    remote_host: str

    async def receive_into(self, view: memoryview) -> int:
        """Fill a prefix of ``view``, like ``socket.recv_into``; 0 means end of stream."""
        ...

    def close_now(self) -> None:
        """Close synchronously; a blocked receive wakes with ``ClosedResourceError``."""
        ...

    def ended_by_peer(self) -> bool:
        """Whether the other side closed or died."""
        ...


def _tune(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - a kernel that refuses; defaults still work
            pass


class TcpNetwork:
    """Real TCP through trio's socket layer (Nagle off, large buffers)."""

    @property
    def directory(self) -> Directory:
        """Where masters are advertised and found: the local network's mDNS."""
        return MDNS

    async def reserve(self, host: str, port: int = 0) -> Reservation:
        """A port on ``host`` bound for a listener to come: until ``listen``, a dial
        there is refused at once."""
        sock = trio.socket.socket(
            trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET, trio.socket.SOCK_STREAM
        )
        try:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await sock.bind((host or "0.0.0.0", port))
        except BaseException:
            sock.close()
            raise
        return _TcpReservation(sock)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port)
        _tune(stream.socket)
        return stream

    async def listen(self, host: str, port: int) -> trio.abc.Listener[Any]:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        # One address is enough: a peer advertises one p2p endpoint.
        for extra in listeners[1:]:
            await extra.aclose()
        return _TunedListener(listeners[0])


def reaches_other_machines(network: Network) -> bool:
    """Whether ``network``'s connections are real sockets, which may reach other
    machines (``TcpNetwork``): the rules on exposure without a run secret and on mDNS
    apply to it. The in-memory network reaches only its own named hosts."""
    return isinstance(network, TcpNetwork)


class Reservation(Protocol):
    """A port bound for a listener to come (``reserve``)."""

    port: int

    async def listen(self) -> trio.abc.Listener[Any]:
        """Start listening on the reserved port (once)."""

    def close(self) -> None:
        """Give the port back unless listening."""


class _TcpReservation:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._socket: trio.socket.SocketType | None = sock
        self.port = int(sock.getsockname()[1])

    async def listen(self) -> trio.abc.Listener[Any]:
        sock, self._socket = self._socket, None
        if sock is None:
            raise trio.ClosedResourceError("the reservation was used or closed")
        sock.listen(128)
        await trio.lowlevel.checkpoint()
        return _TunedListener(trio.SocketListener(sock))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class _TunedListener(trio.abc.Listener[trio.SocketStream]):
    def __init__(self, inner: trio.SocketListener) -> None:
        self.inner = inner
        self.socket = inner.socket

    async def accept(self) -> trio.SocketStream:
        stream = await self.inner.accept()
        _tune(stream.socket)
        return stream

    async def aclose(self) -> None:
        await self.inner.aclose()


@runtime_checkable
class InMemoryListener(Protocol):
    """A listener without a socket of its own names its address."""

    host: str
    port: int


def listener_address(listener: trio.abc.Listener[Any]) -> tuple[str, int]:
    """The ``(host, port)`` a listener is bound to (the real port when 0 was asked)."""
    if isinstance(listener, _TunedListener | trio.SocketListener):
        host, port = listener.socket.getsockname()[:2]
        return str(host), int(port)
    if isinstance(listener, InMemoryListener):
        return listener.host, listener.port
    raise TypeError(f"cannot tell the address of listener {listener!r}")


#: Where ``struct tcp_info`` (Linux) holds the smoothed round trip, in microseconds.
_TCP_INFO_RTT = struct.Struct("=I")
_TCP_INFO_RTT_OFFSET = 68


def kernel_round_trip(stream: trio.abc.Stream) -> float | None:
    """The kernel's estimate of the round trip of a TCP ``stream``, in seconds (right
    after connecting: the handshake's), or None where it has none (another kind of
    stream, another kernel). Unlike timing the connect, it does not count the time
    this process took to notice the answer."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or not isinstance(stream, trio.SocketStream):
        return None
    try:
        info = stream.socket.getsockopt(socket.IPPROTO_TCP, option, 104)
    except OSError:
        return None
    if len(info) < _TCP_INFO_RTT_OFFSET + _TCP_INFO_RTT.size:
        return None
    (microseconds,) = _TCP_INFO_RTT.unpack_from(info, _TCP_INFO_RTT_OFFSET)
    return float(microseconds) * 1e-6


def remote_host(stream: trio.abc.Stream) -> str:
    """The address of the other end of ``stream``, as this side sees it."""
    if isinstance(stream, trio.SocketStream):
        try:
            return str(stream.socket.getpeername()[0])
        except OSError:
            return "unknown"
    if isinstance(stream, InMemoryStream):
        return stream.remote_host
    return "unknown"


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 address as IPv4), or None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


async def comes_from(stream: trio.abc.Stream, host: str) -> bool:
    """Whether the other end of ``stream`` is ``host``: the same address, or a host
    name that resolves to it (the in-memory network's hosts are names, compared as
    such)."""
    await trio.lowlevel.checkpoint()
    seen = remote_host(stream)
    if seen == host:
        return True
    address = _address(seen)
    if address is None or isinstance(stream, InMemoryStream):
        return False
    named = _address(host)
    if named is not None:
        return named == address
    try:
        infos = await trio.socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:  # the name does not resolve (any more): not this address
        return False
    return any(_address(str(info[4][0])) == address for info in infos)


def parse_address(address: str, *, default_port: int | None = None) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into its parts.

    Raises:
        ValueError: with a message that shows the expected form.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"expected an address like '127.0.0.1:48148', got {address!r}")
    text = address.strip()
    if "://" in text:
        raise ValueError(
            f"expected 'host:port' with no scheme (e.g. '127.0.0.1:48148'), got {address!r}"
        )
    if "/" in text:
        raise ValueError(f"expected 'host:port' with no path (e.g. '127.0.0.1:48148'), got {address!r}")
    host: str
    port_text: str | None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in address {address!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"expected ':port' after ']' in address {address!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" not in text:
        host, port_text = text, None
    else:
        raise ValueError(
            f"expected 'host:port' (IPv6 as '[addr]:port'), got {address!r}"
        )
    if port_text is None:
        if default_port is None:
            raise ValueError(f"address {address!r} has no port; expected 'host:port'")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} in address {address!r} is not 0-65535")
    if not host:
        raise ValueError(f"address {address!r} has no host")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """The inverse of ``parse_address``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
