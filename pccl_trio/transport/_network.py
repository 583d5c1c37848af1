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

Every TCP socket gets Nagle turned off, large buffers where the kernel grants them
(``pinned_buffers``: otherwise its own autotuning does better) and, if the network was
made with one, the congestion control named (Linux's ``TCP_CONGESTION``,
checked once when the network is made, so that a name the kernel does not offer or
allow fails there with its reason, not at every connection).

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

import errno
import functools
import ipaddress
import socket
import struct
import sys
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


#: Where Linux caps what ``SO_SNDBUF`` and ``SO_RCVBUF`` may ask for.
_BUFFER_LIMITS = {
    socket.SO_SNDBUF: "/proc/sys/net/core/wmem_max",
    socket.SO_RCVBUF: "/proc/sys/net/core/rmem_max",
}


@functools.cache
def pinned_buffers() -> tuple[int, ...]:
    """The socket buffers (``SO_SNDBUF``, ``SO_RCVBUF``) every connection pins at
    ``SOCKET_BUFFER_BYTES``: those the kernel grants in full.

    Linux caps a pinned buffer at ``net.core.wmem_max`` / ``rmem_max`` and turns its
    autotuning off. Where the cap is at least ``SOCKET_BUFFER_BYTES``, pinning gives
    a connection twice that (the kernel doubles it for its bookkeeping), more than
    the send side's autotuning reaches by default (``net.ipv4.tcp_wmem``'s 4 MiB): on
    the WAN emulator one pinned connection carried 398 Mbit/s at 100 ms against 193
    autotuned. Where the cap is lower (212992 bytes on a stock kernel), a pinned
    buffer would hold a long link's window to a tenth of what autotuning reaches, so
    that buffer is left to the kernel. Elsewhere than Linux, both are pinned.
    """
    pinned = []
    for option, path in _BUFFER_LIMITS.items():
        try:
            with open(path) as file:
                limit: int | None = int(file.read())
        except (OSError, ValueError):
            limit = None  # no such cap to read: ask, as on any system
        if limit is None or limit >= SOCKET_BUFFER_BYTES:
            pinned.append(option)
    return tuple(pinned)


def _tune(sock: trio.socket.SocketType | socket.socket, congestion_control: bytes | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in pinned_buffers():
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - a kernel that refuses; defaults still work
            pass
    if congestion_control is not None:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, congestion_control)


#: Linux's socket option naming a connection's congestion control (13 in
#: ``linux/tcp.h``; the ``socket`` module names it from Python 3.6 on Linux only).
_TCP_CONGESTION: int = getattr(socket, "TCP_CONGESTION", 13)
#: Where Linux lists the congestion controls a process may choose without privileges.
_ALLOWED_CONGESTION = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
_AVAILABLE_CONGESTION = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def check_congestion_control(name: str) -> bytes:
    """``name`` as the bytes ``TCP_CONGESTION`` takes, once a socket took it.

    Raises:
        ValueError: this system has no such option, does not offer ``name`` or does not
            let this process choose it; the message says which and what it offers.
    """
    if not isinstance(name, str) or not name.isascii() or not 0 < len(name) < 16:
        raise ValueError(f"a congestion control is a name of 1 to 15 letters, got {name!r}")
    if not sys.platform.startswith("linux"):
        raise ValueError(
            f"choosing a congestion control ({name!r}) needs Linux's TCP_CONGESTION; this is "
            f"{sys.platform}: leave it unset to use the system's"
        )
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name.encode())
    except OSError as exc:
        available, allowed = _read_list(_AVAILABLE_CONGESTION), _read_list(_ALLOWED_CONGESTION)
        if exc.errno == errno.ENOENT or name not in available.split():
            raise ValueError(
                f"this kernel offers no congestion control {name!r} (it offers: {available}); "
                f"load its module (modprobe tcp_{name}) or choose one of those"
            ) from None
        raise ValueError(
            f"this process may not choose congestion control {name!r} (allowed without "
            f"CAP_NET_ADMIN: {allowed}; net.ipv4.tcp_allowed_congestion_control lists them): "
            f"{exc.strerror}"
        ) from None
    finally:
        probe.close()
    return name.encode()


def _read_list(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip() or "none"
    except OSError:
        return "unknown"


class TcpNetwork:
    """Real TCP through trio's socket layer (Nagle off, large buffers).

    Args:
        congestion_control: the congestion control of every connection it makes or
            accepts (``"cubic"``, ``"bbr"``, ...; Linux only); None: the system's
            default (``net.ipv4.tcp_congestion_control``).

    Raises:
        ValueError: the congestion control can't be used here (the message says why).
    """

    def __init__(self, *, congestion_control: str | None = None) -> None:
        self._congestion = (
            None if congestion_control is None else check_congestion_control(congestion_control)
        )

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
            if self._congestion is not None:  # for the connections it will accept
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, self._congestion)
            await sock.bind((host or "0.0.0.0", port))
        except BaseException:
            sock.close()
            raise
        return _TcpReservation(sock, self._congestion)

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        if self._congestion is not None:
            return await self._connect_chosen(host, port)
        stream = await trio.open_tcp_stream(host, port)
        _tune(stream.socket, None)
        return stream

    async def _connect_chosen(self, host: str, port: int) -> trio.SocketStream:
        """``connect`` with the congestion control set before the handshake: the
        kernel starts a connection's congestion control as it is created, and the one
        it replaces can leave its mark (BBR turns pacing on, which stays on under
        CUBIC). The addresses ``host`` resolves to are tried in turn."""
        failure: OSError | None = None
        for family, kind, proto, _name, address in await trio.socket.getaddrinfo(
            host, port, type=trio.socket.SOCK_STREAM
        ):
            sock = trio.socket.socket(family, kind, proto)
            try:
                _tune(sock, self._congestion)
                await sock.connect(address)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            return trio.SocketStream(sock)
        raise failure or OSError(f"no address for {host!r}")

    async def listen(self, host: str, port: int) -> trio.abc.Listener[Any]:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        # One address is enough: a peer advertises one p2p endpoint.
        for extra in listeners[1:]:
            await extra.aclose()
        if self._congestion is not None:
            # Accepted connections inherit it from their listener (from the SYN on).
            listeners[0].socket.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, self._congestion)
        return _TunedListener(listeners[0], self._congestion)


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
    def __init__(self, sock: trio.socket.SocketType, congestion_control: bytes | None) -> None:
        self._socket: trio.socket.SocketType | None = sock
        self._congestion = congestion_control
        self.port = int(sock.getsockname()[1])

    async def listen(self) -> trio.abc.Listener[Any]:
        sock, self._socket = self._socket, None
        if sock is None:
            raise trio.ClosedResourceError("the reservation was used or closed")
        sock.listen(128)
        await trio.lowlevel.checkpoint()
        return _TunedListener(trio.SocketListener(sock), self._congestion)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class _TunedListener(trio.abc.Listener[trio.SocketStream]):
    def __init__(self, inner: trio.SocketListener, congestion_control: bytes | None) -> None:
        self.inner = inner
        self.socket = inner.socket
        self._congestion = congestion_control

    async def accept(self) -> trio.SocketStream:
        stream = await self.inner.accept()
        _tune(stream.socket, self._congestion)
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


def kernel_congestion_control(sock: socket.socket | trio.socket.SocketType) -> str | None:
    """The congestion control the kernel runs on TCP socket ``sock``, or None where
    it does not say (another kernel, a socket already closed)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16)
    except OSError:
        return None
    name = raw.split(b"\0", 1)[0].decode(errors="replace")
    return name or None


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
