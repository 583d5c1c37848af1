"""The WAN emulator's delay line: a process that carries IPv4 packets between TUN
devices, holding each for its path's one-way delay (see ``_wan``).

Theory of operation
-------------------
Every emulated host has one TUN device (no packet information header: each read is
one IPv4 packet). The delay line opens them all, reports their names on stdout, and
from then on runs one loop: read every packet that arrived, note when it is due at its
destination (the host its destination address names, after the one-way delay of the
path from the host it came from, plus jitter), and write into the destination's TUN
every packet that is due. The kernel of each host's namespace does the rest: TCP's
slow start, windows, pacing and loss recovery are its own, end to end, as over a real
long link.

A packet is dropped with the path's loss probability, and when its destination is no
host of the emulator. Without reordering, the packets of one path keep their order
(a jittered packet is never delivered before the one ahead of it); with it, each is
due at its own time. Packets wait in one heap by due time; the loop sleeps until the
first is due or a device is readable. Timers have the resolution of ``epoll`` (a
millisecond), a small error against the delays a WAN has.

A packet travels as one read and one write, whatever its size, so the delay line's
ceiling is in packets per second: a large MTU (up to 65535 on a TUN device) carries
the same bytes in far fewer packets. The emulator says which MTU it used, and measures
its own ceiling with plain TCP (``Wan.ceiling``).

Run as ``python path/to/_delay_line.py CONFIG_JSON`` (root: it opens
``/dev/net/tun``; it imports nothing of the package); it runs until its stdin closes or
it is killed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from collections.abc import Sequence

__all__ = ["DelayLine", "PathPlan", "main", "open_tun"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
#: A read returns at most one packet; a TUN device's MTU is at most this.
_MAX_PACKET = 65535
#: Packets read from one device before the loop looks at the others again.
_BATCH = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PathPlan:
    """How packets travel from one host to another."""

    delay: float  # one-way seconds
    jitter: float = 0.0  # up to this many seconds more, uniformly
    loss: float = 0.0  # probability a packet is dropped


def open_tun(name: str) -> int:
    """Create (or attach to) the TUN device ``name`` and return its descriptor,
    non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Carries packets between hosts' TUN devices (see the module docstring).

    Args:
        fds: each host's TUN descriptor, by host index.
        addresses: each host's IPv4 address (4 bytes), by host index.
        paths: ``paths[a][b]``, the path from host ``a`` to host ``b``.
        reorder: let a jittered packet overtake the ones ahead of it.
        seed: for loss and jitter.
    """

    def __init__(
        self, fds: Sequence[int], addresses: Sequence[bytes],
        paths: Sequence[Sequence[PathPlan]], *, reorder: bool = False, seed: int = 0,
    ) -> None:
        self._fds = list(fds)
        self._host_of = {address: index for index, address in enumerate(addresses)}
        self._paths = paths
        self._reorder = reorder
        self._random = random.Random(seed)
        self._due: list[tuple[float, int, int, bytes]] = []  # (when, order, host, packet)
        self._order = 0
        # Without reordering: when the last packet of each path is due.
        self._last = [[0.0] * len(fds) for _ in fds]
        self._by_fd = {fd: index for index, fd in enumerate(self._fds)}
        self.carried = 0
        self.dropped = 0

    def run(self, stop_fd: int | None = None) -> None:
        """Carry packets until ``stop_fd`` is readable (its other end closed)."""
        poller = select.epoll()
        for fd in self._fds:
            poller.register(fd, select.EPOLLIN)
        if stop_fd is not None:
            poller.register(stop_fd, select.EPOLLIN)
        while True:
            now = time.monotonic()
            self._deliver(now)
            timeout = max(0.0, self._due[0][0] - now) if self._due else -1.0
            for fd, _events in poller.poll(timeout):
                if fd == stop_fd:
                    return
                self._receive(fd, time.monotonic())

    def _receive(self, fd: int, now: float) -> None:
        source = self._by_fd[fd]
        for _ in range(_BATCH):
            try:
                packet = os.read(fd, _MAX_PACKET)
            except BlockingIOError:
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                continue  # not IPv4 (the emulator's hosts speak nothing else)
            destination = self._host_of.get(packet[16:20])
            if destination is None or destination == source:
                self.dropped += 1
                continue
            path = self._paths[source][destination]
            if path.loss and self._random.random() < path.loss:
                self.dropped += 1
                continue
            due = now + path.delay + (self._random.uniform(0.0, path.jitter) if path.jitter else 0.0)
            if not self._reorder:
                due = max(due, self._last[source][destination])
                self._last[source][destination] = due
            self._order += 1
            heapq.heappush(self._due, (due, self._order, destination, packet))

    def _deliver(self, now: float) -> None:
        due = self._due
        while due and due[0][0] <= now:
            _when, _order, destination, packet = heapq.heappop(due)
            try:
                os.write(self._fds[destination], packet)
                self.carried += 1
            except OSError:
                self.dropped += 1  # the device is gone or full: a lost packet


def main(argv: Sequence[str] | None = None) -> int:
    """Open the devices the JSON config names, print their names, carry packets until
    stdin closes."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    fds = [open_tun(name) for name in config["devices"]]
    addresses = [bytes(int(part) for part in text.split(".")) for text in config["addresses"]]
    paths = [[PathPlan(**plan) for plan in row] for row in config["paths"]]
    line = DelayLine(fds, addresses, paths, reorder=config.get("reorder", False),
                     seed=config.get("seed", 0))
    print(json.dumps({"ready": config["devices"]}), flush=True)
    line.run(stop_fd=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
