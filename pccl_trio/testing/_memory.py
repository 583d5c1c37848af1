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
"""

from __future__ import annotations

import itertools

import trio

__all__ = ["MemoryHost", "MemoryListener", "MemoryNetwork", "MemoryStream"]


class _Pipe:
    """One direction of a connection."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False  # the writer closed (or died): reader sees b"" after the data
        self.reader_gone = False  # the reader closed: writes fail like after an RST
        self.lot = trio.lowlevel.ParkingLot()


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
            self._outgoing.buffer += data
            self._outgoing.lot.unpark_all()
        finally:
            self._send_conflict = False

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
                if pipe.buffer:
                    size = len(pipe.buffer) if max_bytes is None else min(max_bytes, len(pipe.buffer))
                    chunk = bytes(pipe.buffer[:size])
                    del pipe.buffer[:size]
                    return chunk
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
        """Whether the other side closed or died (an end of stream is waiting)."""
        return self._incoming.eof or self._outgoing.reader_gone

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_fin()
        self._incoming.reader_gone = True
        self._incoming.lot.unpark_all()  # wake our own blocked receive
        self.network._forget(self)

    def _die(self) -> None:
        """The local process died: the other end sees end of stream."""
        self._broken = True
        self._send_fin()
        self._incoming.reader_gone = True
        self._incoming.lot.unpark_all()

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

    def __repr__(self) -> str:
        return f"<MemoryHost {self.name}>"


class MemoryNetwork:
    """A deterministic in-memory network of named hosts (see the module docstring)."""

    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], MemoryListener] = {}
        self._streams: set[MemoryStream] = set()
        self._dead: set[str] = set()
        self._partitioned: set[str] = set()
        self._heal_lot = trio.lowlevel.ParkingLot()
        self._lost_fins: list[tuple[MemoryStream, _Pipe]] = []
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


