"""An in-memory network for deterministic tests under trio's autojump clock.

Theory of operation
-------------------
A ``MemoryNetwork`` is a set of named hosts. ``network.host(name)`` returns a
``MemoryHost``, which is a ``Network`` (``listen``/``connect``) whose connections
carry ``name`` as their source address. A connection is a pair of ``MemoryStream``
ends joined by two one-way pipes; bytes are buffered without bound and delivered in
order, with a checkpoint on every call, so everything runs in virtual time.

Failure hooks, all per host:

* ``kill(host)``: the host's process died. Its listeners go away, its stream ends
  raise ``BrokenResourceError``, the other ends see end of stream (the kernel's FIN
  or RST), and connecting to it is refused.
* ``partition(host)``: the host silently vanished (cable pulled). Bytes to and from
  it are dropped without any error, and connecting to or from it hangs, exactly the
  case that only liveness timeouts can detect. ``heal(host)`` ends it.

Link shaping, per directed host pair:

* ``shape(source, destination, rate=..., latency=...)`` puts one emulated wire
  between the two hosts in that direction, shared by every connection between them
  (existing or future). The wire carries ``rate`` bytes per second (``None``:
  unlimited) and delays each byte by ``latency`` seconds one way. The other
  direction is independent; ``shape(source, destination)`` with the defaults removes
  the wire again, and unshaped pairs work exactly as described above.
* A ``send_all`` of ``n`` bytes occupies the wire from ``start = max(now, free_at)``
  (after whatever any connection queued before it) to ``done = start + n / rate``;
  the sender is paced by the wire and returns at ``done``. The bytes travel on,
  time-stamped, and become readable at ``done + latency``, in send order per
  connection. A receiver only sees bytes whose arrival time has passed, and end of
  stream only after all bytes in flight have been delivered.
* Bytes already on the wire still arrive if a partition starts or the sender's host
  dies (they left before), while bytes sent during a partition vanish as before.
  Closing or killing either end wakes blocked senders and receivers at once, as
  without shaping: a paced sender then raises like a blocked TCP send would.
"""

from __future__ import annotations

import collections
import itertools
import math

import trio

from ._directory import HostDirectory, MemoryDirectory

__all__ = ["MemoryHost", "MemoryListener", "MemoryNetwork", "MemoryStream"]


class _Link:
    """The emulated wire of one shaped directed host pair (see ``MemoryNetwork.shape``)."""

    def __init__(self, rate: float | None, latency: float) -> None:
        self.rate = rate  # bytes per second; None: unlimited
        self.latency = latency  # seconds, one way
        self.free_at = -math.inf  # when the wire has sent everything queued on it


class _Pipe:
    """One direction of a connection."""

    def __init__(self) -> None:
        self.buffer = bytearray()  # arrived bytes, readable now
        # Bytes on a shaped wire: (arrival time, chunk), arrival times non-decreasing.
        self.in_flight: collections.deque[tuple[float, bytes]] = collections.deque()
        self.eof = False  # the writer closed (or died): reader sees b"" after the data
        self.reader_gone = False  # the reader closed: writes fail like after an RST
        self.lot = trio.lowlevel.ParkingLot()

    def transmit(self, data: bytes, arrival: float) -> None:
        """Put ``data`` on the wire to arrive at ``arrival`` (never before earlier bytes)."""
        if self.in_flight:
            arrival = max(arrival, self.in_flight[-1][0])
        self.in_flight.append((arrival, data))
        self.lot.unpark_all()  # a parked reader learns the new arrival time

    def land(self) -> None:
        """Move the bytes whose arrival time has passed into the readable buffer."""
        now = trio.current_time()
        while self.in_flight and self.in_flight[0][0] <= now:
            self.buffer += self.in_flight.popleft()[1]


class MemoryStream(trio.abc.Stream):
    """One end of an in-memory connection."""

    def __init__(
        self,
        network: MemoryNetwork,
        *,
        local_host: str,
        remote_host: str,
        outgoing: _Pipe,
        incoming: _Pipe,
    ) -> None:
        self.network = network
        self.local_host = local_host
        self.remote_host = remote_host
        self._outgoing = outgoing
        self._incoming = incoming
        self._closed = False
        self._broken = False
        self._send_conflict = False
        self._receive_conflict = False

    def _silenced(self) -> bool:
        return self.network.is_partitioned(self.local_host) or self.network.is_partitioned(
            self.remote_host
        )

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._send_conflict:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._send_conflict = True
        try:
            await trio.lowlevel.checkpoint()
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if self._broken:
                raise trio.BrokenResourceError("connection reset")
            if self._silenced():
                return  # the bytes (and any reset they would provoke) vanish on the wire
            if self._outgoing.reader_gone:
                raise trio.BrokenResourceError("connection reset by peer")
            link = self.network._links.get((self.local_host, self.remote_host))
            if link is None and not self._outgoing.in_flight:
                self._outgoing.buffer += data
                self._outgoing.lot.unpark_all()
            elif data:
                await self._send_on_wire(link, bytes(data))
        finally:
            self._send_conflict = False

    async def _send_on_wire(self, link: _Link | None, data: bytes) -> None:
        """Queue ``data`` on the shaped wire and return once the wire has sent it.

        With ``link`` None (shaping removed while bytes were still in flight) the
        bytes go out at once but still arrive behind those in flight."""
        now = trio.current_time()
        if link is None:
            self._outgoing.transmit(data, now)
            return
        start = max(now, link.free_at)
        done = start if link.rate is None else start + len(data) / link.rate
        link.free_at = done
        self._outgoing.transmit(data, done + link.latency)
        while trio.current_time() < done:  # paced by the wire
            with trio.move_on_at(done):
                await self._outgoing.lot.park()  # or woken early by a close or death
            if self._closed:
                raise trio.ClosedResourceError("stream was closed")
            if self._broken:
                raise trio.BrokenResourceError("connection reset")
            if self._outgoing.reader_gone:
                raise trio.BrokenResourceError("connection reset by peer")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._receive_conflict:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receive_conflict = True
        try:
            await trio.lowlevel.checkpoint()
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("stream was closed")
                if self._broken:
                    raise trio.BrokenResourceError("connection reset")
                pipe = self._incoming
                if pipe.in_flight:
                    pipe.land()
                if pipe.buffer:
                    size = len(pipe.buffer) if max_bytes is None else min(max_bytes, len(pipe.buffer))
                    chunk = bytes(pipe.buffer[:size])
                    del pipe.buffer[:size]
                    return chunk
                if pipe.in_flight:  # wait for the next arrival (or an earlier wake-up)
                    with trio.move_on_at(pipe.in_flight[0][0]):
                        await pipe.lot.park()
                    continue
                if pipe.eof:
                    return b""
                await pipe.lot.park()
        finally:
            self._receive_conflict = False

    async def receive_into(self, view: memoryview) -> int:
        """Like ``socket.recv_into``: fill a prefix of ``view``; 0 means end of stream."""
        data = await self.receive_some(len(view))
        view[: len(data)] = data
        return len(data)

    async def aclose(self) -> None:
        self._close()
        await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """Close synchronously (wakes a blocked receive with ClosedResourceError)."""
        self._close()

    def ended_by_peer(self) -> bool:
        """Whether the other side closed or died (an end of stream is waiting, maybe
        behind bytes still in flight on a shaped wire)."""
        return self._incoming.eof or self._outgoing.reader_gone

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_fin()
        self._incoming.reader_gone = True
        self._incoming.lot.unpark_all()  # wake our own blocked receive
        self._outgoing.lot.unpark_all()  # and our own send paced by a shaped wire
        self.network._forget(self)

    def _die(self) -> None:
        """The local process died: the other end sees end of stream."""
        self._broken = True
        self._send_fin()
        self._incoming.reader_gone = True
        self._incoming.lot.unpark_all()
        self._outgoing.lot.unpark_all()  # a send paced by a shaped wire

    def _send_fin(self) -> None:
        """End of stream for the other side, unless a partition swallows it (then it
        arrives when the partition heals, as TCP would retransmit it)."""
        if self._silenced():
            self.network._lost_fins.append((self, self._outgoing))
            return
        self._outgoing.eof = True
        self._outgoing.lot.unpark_all()


class MemoryListener(trio.abc.Listener[MemoryStream]):
    def __init__(self, network: MemoryNetwork, host: str, port: int) -> None:
        self.network = network
        self.host = host
        self.port = port
        self._send, self._receive = trio.open_memory_channel[MemoryStream](1000)
        self._closed = False

    async def accept(self) -> MemoryStream:
        if self._closed:
            raise trio.ClosedResourceError("listener was closed")
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("listener was closed") from None

    async def aclose(self) -> None:
        self._shut()
        await trio.lowlevel.checkpoint()

    def _shut(self) -> None:
        if not self._closed:
            self._closed = True
            self._send.close()
            self.network._listeners.pop((self.host, self.port), None)


class MemoryHost:
    """A ``Network`` as seen from one named host of a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network = network
        self.name = name

    async def listen(self, host: str, port: int) -> MemoryListener:
        await trio.lowlevel.checkpoint()
        if host not in ("", "0.0.0.0", "::", self.name):
            raise OSError(f"cannot bind {host!r} on memory host {self.name!r}")
        return self.network._bind(self.name, port)

    async def connect(self, host: str, port: int) -> MemoryStream:
        return await self.network._connect(self.name, host, port)

    @property
    def directory(self) -> HostDirectory:
        """Where masters are advertised and found, as seen from this host."""
        return self.network.directory.view(self.name)

    async def reserve(self, host: str, port: int = 0) -> _MemoryReservation:
        """A port on this host for a listener to come; dials there are refused until
        ``listen``."""
        await trio.lowlevel.checkpoint()
        return _MemoryReservation(self.network, self.name, port or next(self.network._ports))

    def __repr__(self) -> str:
        return f"<MemoryHost {self.name}>"


class _MemoryReservation:
    def __init__(self, network: MemoryNetwork, host: str, port: int) -> None:
        self._network, self._host, self.port = network, host, port

    async def listen(self) -> MemoryListener:
        await trio.lowlevel.checkpoint()
        return self._network._bind(self._host, self.port)

    def close(self) -> None:
        pass


class MemoryNetwork:
    """A deterministic in-memory network of named hosts (see the module docstring)."""

    def __init__(self) -> None:
        #: Where hosts advertise masters of runs and find them (``host.directory``).
        self.directory = MemoryDirectory(self)
        self._listeners: dict[tuple[str, int], MemoryListener] = {}
        self._streams: set[MemoryStream] = set()
        self._dead: set[str] = set()
        self._partitioned: set[str] = set()
        self._heal_lot = trio.lowlevel.ParkingLot()
        self._lost_fins: list[tuple[MemoryStream, _Pipe]] = []
        self._links: dict[tuple[str, str], _Link] = {}
        self._ports = itertools.count(40000)

    def host(self, name: str) -> MemoryHost:
        """The network as seen from host ``name`` (a host comes back to life here)."""
        self._dead.discard(name)
        return MemoryHost(self, name)

    def kill(self, name: str) -> None:
        """Host ``name`` died: its listeners vanish and its connections break."""
        self._dead.add(name)
        for (host, _port), listener in list(self._listeners.items()):
            if host == name:
                listener._shut()
        for stream in list(self._streams):
            if stream.local_host == name:
                stream._die()
                self._streams.discard(stream)

    def is_dead(self, name: str) -> bool:
        """Whether host ``name`` was killed (and not brought back by ``host``)."""
        return name in self._dead

    def partition(self, name: str) -> None:
        """Host ``name`` goes silent: traffic to and from it is dropped, no errors."""
        self._partitioned.add(name)

    def heal(self, name: str) -> None:
        """End a partition of host ``name``."""
        self._partitioned.discard(name)
        self._heal_lot.unpark_all()
        lost, self._lost_fins = self._lost_fins, []
        for stream, pipe in lost:
            if stream._silenced():
                self._lost_fins.append((stream, pipe))
            else:
                pipe.eof = True
                pipe.lot.unpark_all()

    def shape(
        self, source: str, destination: str, *, rate: float | None = None, latency: float = 0.0
    ) -> None:
        """Emulate the link from host ``source`` to host ``destination``.

        Every connection between the two hosts sends in this direction over one wire
        of ``rate`` bytes per second (``None``: unlimited) with ``latency`` seconds of
        one-way delay; the reverse direction is not affected. It applies to existing
        and future connections. ``rate=None, latency=0`` removes the shaping (bytes
        already in flight still arrive at their time, and later ones behind them).
        """
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a positive finite number of bytes/s or None, not {rate!r}")
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"latency must be a finite number of seconds >= 0, not {latency!r}")
        key = (source, destination)
        if rate is None and latency == 0:
            self._links.pop(key, None)
            return
        link = self._links.get(key)
        if link is None:
            self._links[key] = _Link(rate, latency)
        else:  # keep what is already queued on the wire
            link.rate, link.latency = rate, latency

    def is_partitioned(self, name: str) -> bool:
        return name in self._partitioned

    def connections(self, host: str | None = None) -> int:
        """How many open stream ends there are (on ``host``, if given)."""
        return sum(1 for s in self._streams if host is None or s.local_host == host)

    # --- internals used by MemoryHost ----------------------------------------------

    def _bind(self, host: str, port: int) -> MemoryListener:
        if host in self._dead:
            raise OSError(f"memory host {host!r} is dead")
        if port == 0:
            port = next(self._ports)
            while (host, port) in self._listeners:
                port = next(self._ports)
        if (host, port) in self._listeners:
            raise OSError(f"address {host}:{port} already in use")
        listener = MemoryListener(self, host, port)
        self._listeners[(host, port)] = listener
        return listener

    async def _connect(self, source: str, host: str, port: int) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        while self.is_partitioned(source) or self.is_partitioned(host):
            await self._heal_lot.park()  # a SYN into the void: hang until healed
        if source in self._dead:
            raise OSError(f"memory host {source!r} is dead")
        listener = self._listeners.get((host, port))
        if listener is None or host in self._dead:
            raise ConnectionRefusedError(f"connection refused by {host}:{port}")
        forward, backward = _Pipe(), _Pipe()
        client = MemoryStream(
            self, local_host=source, remote_host=host, outgoing=forward, incoming=backward
        )
        server = MemoryStream(
            self, local_host=host, remote_host=source, outgoing=backward, incoming=forward
        )
        try:
            listener._send.send_nowait(server)
        except (trio.WouldBlock, trio.ClosedResourceError):
            raise ConnectionRefusedError(f"connection refused by {host}:{port}") from None
        self._streams.update((client, server))
        return client

    def _forget(self, stream: MemoryStream) -> None:
        self._streams.discard(stream)

    def __repr__(self) -> str:
        return f"<MemoryNetwork hosts={sorted({s.local_host for s in self._streams})}>"


