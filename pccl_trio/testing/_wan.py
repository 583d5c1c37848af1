"""A WAN on one machine: hosts in network namespaces, joined by a user-space delay
line, each host's upload shaped by a token bucket.

Theory of operation
-------------------
This kernel may have no ``netem``, and a TCP proxy would hide TCP's own dynamics, so
latency is added below TCP: every host is a network namespace whose one interface is a
TUN device (``w{i}`` in the host's namespace), and one process (``_delay_line``) holds
all the devices' descriptors. A packet a host sends leaves through its TUN device into
the delay line, which writes it into the destination's device once the path's one-way
delay passed. Slow start, windows, loss recovery and pacing are the hosts' kernels'
own, end to end.

Each path has its own delay, so two continents are a matter of a matrix
(``two_continents``), plus optional jitter and loss; with ``reorder``, jittered packets may
overtake each other. A host's upload is shaped by a token bucket (``tbf``) on its
device, as an access link would be; the queue it keeps is ``queue_seconds`` at that
rate.

The delay line forwards one packet per read and write, so its ceiling is in packets
per second: the devices use a large MTU (65000 by default, which TCP uses as its
segment size) so that 1 Gbit/s and more is a few thousand packets a second.
``ceiling`` measures what plain TCP gets over the emulator, with many streams at once:
the figure every benchmark compares itself to, measured in the same sitting.

Hosts get ``10.78.{net}.{i + 1}`` (``net`` from the prefix, so that two emulators on
one machine do not collide). ``run`` and ``start`` run a command inside a host's
namespace. Everything is removed on exit, also after an error. Needs root, ``ip`` and
``tc`` (iproute2), and ``/dev/net/tun``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from . import _delay_line
from ._delay_line import PathPlan

__all__ = ["Wan", "WanPlan", "rate_bits", "two_continents", "wan_available"]


def wan_available() -> bool:
    """Whether this machine can run the emulator: root, iproute2, and TUN devices."""
    return (
        os.geteuid() == 0 and os.path.exists("/dev/net/tun")
        and shutil.which("ip") is not None and shutil.which("tc") is not None
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanPlan:
    """What the emulated WAN looks like.

    Attributes:
        hosts: how many hosts.
        delay: one-way seconds between any two hosts (``delays`` overrides pairs).
        delays: ``(a, b)`` -> one-way seconds from host ``a`` to host ``b``; a pair
            given one way only is the same both ways.
        jitter: up to this many seconds more per packet, uniformly.
        loss: probability that a packet is dropped, on every path.
        reorder: let jittered packets overtake each other (else each path keeps its
            order).
        rate: each host's upload rate, as ``tc`` spells it (``"1gbit"``); None: not
            shaped.
        queue_seconds: the token bucket's queue, in seconds at ``rate``.
        mtu: the devices' MTU (at most 65535).
        seed: for loss and jitter.
        sysctls: kernel settings of every host's namespace (``{"net.ipv4.tcp_slow_start
            _after_idle": "0"}``), for experiments; by default each host has the
            machine's.
    """

    hosts: int
    delay: float = 0.05
    delays: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    jitter: float = 0.0
    loss: float = 0.0
    reorder: bool = False
    rate: str | None = "1gbit"
    queue_seconds: float = 0.02
    mtu: int = 65000
    seed: int = 0
    sysctls: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 2 <= self.hosts <= 250:
            raise ValueError(f"a WAN of 2 to 250 hosts, not {self.hosts}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"an MTU of 576 to 65535 bytes, not {self.mtu}")
        if self.delay < 0 or self.jitter < 0 or not 0 <= self.loss < 1:
            raise ValueError("delays and jitter are >= 0, loss in [0, 1)")
        for (a, b), seconds in self.delays.items():
            if not (0 <= a < self.hosts and 0 <= b < self.hosts and a != b and seconds >= 0):
                raise ValueError(f"delay of ({a}, {b}): hosts of the WAN and seconds >= 0")

    def one_way(self, a: int, b: int) -> float:
        """The one-way delay from host ``a`` to host ``b``."""
        if (a, b) in self.delays:
            return self.delays[(a, b)]
        return self.delays.get((b, a), self.delay)

    def paths(self) -> list[list[PathPlan]]:
        return [
            [PathPlan(delay=self.one_way(a, b), jitter=self.jitter, loss=self.loss)
             for b in range(self.hosts)]
            for a in range(self.hosts)
        ]


def two_continents(sizes: Sequence[int], *, inside: float, across: float) -> dict[tuple[int, int], float]:
    """The ``delays`` of hosts on continents of ``sizes`` hosts each (in host order):
    ``inside`` one way within a continent, ``across`` between two."""
    continent = [index for index, size in enumerate(sizes) for _ in range(size)]
    return {
        (a, b): inside if continent[a] == continent[b] else across
        for a in range(len(continent)) for b in range(len(continent)) if a != b
    }


class Wan:
    """The emulated WAN of ``plan`` (see the module docstring); a context manager."""

    def __init__(self, plan: WanPlan, *, prefix: str | None = None) -> None:
        self.plan = plan
        self.prefix = prefix or f"pw{os.getpid() % 100000}"
        self._net = zlib.crc32(self.prefix.encode()) % 200 + 20
        self.namespaces = [f"{self.prefix}-h{i}" for i in range(plan.hosts)]
        self._devices = [f"{self.prefix}t{i}"[:15] for i in range(plan.hosts)]
        self._line: subprocess.Popen[bytes] | None = None

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address."""
        return f"10.78.{self._net}.{host + 1}"

    def __enter__(self) -> Wan:
        self.close()
        try:
            for name in self.namespaces:
                _sh("ip", "netns", "add", name)
                self._in(name, "ip", "link", "set", "lo", "up")
            self._start_line()
            for host, name in enumerate(self.namespaces):
                self._attach(host, name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_line(self) -> None:
        config = {
            "devices": self._devices,
            "addresses": [self.address(host) for host in range(self.plan.hosts)],
            "paths": [[dataclasses.asdict(path) for path in row] for row in self.plan.paths()],
            "reorder": self.plan.reorder,
            "seed": self.plan.seed,
        }
        # Run by its path: it needs nothing of the package, which would take longer
        # to import than the delay line to start.
        self._line = subprocess.Popen(
            [sys.executable, _delay_line.__file__, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        assert self._line.stdout is not None
        ready = self._line.stdout.readline()
        if not ready.startswith(b'{"ready"'):
            raise RuntimeError(f"the delay line did not start: {ready!r}")

    def _attach(self, host: int, name: str) -> None:
        """Move host ``host``'s device into its namespace and set it up."""
        device = self._devices[host]
        _sh("ip", "link", "set", device, "netns", name)
        self._in(name, "ip", "link", "set", device, "name", "w0")
        self._in(name, "ip", "link", "set", "w0", "mtu", str(self.plan.mtu), "up")
        self._in(name, "ip", "addr", "add", f"{self.address(host)}/24", "dev", "w0")
        for key, value in self.plan.sysctls.items():
            self._in(name, "sysctl", "-q", "-w", f"{key}={value}")
        if self.plan.rate is not None:
            rate = rate_bits(self.plan.rate)
            burst = max(2 * self.plan.mtu, int(rate / 8 * 0.001))
            limit = max(4 * self.plan.mtu, int(rate / 8 * self.plan.queue_seconds))
            self._in(name, "tc", "qdisc", "replace", "dev", "w0", "root", "tbf", "rate",
                     self.plan.rate, "burst", str(burst), "limit", str(limit))

    def close(self) -> None:
        """Stop the delay line and remove the namespaces (quietly, whatever exists)."""
        if self._line is not None:
            line, self._line = self._line, None
            if line.stdin is not None:
                line.stdin.close()  # its signal to stop
            try:
                line.wait(timeout=5)
            except subprocess.TimeoutExpired:
                line.kill()
                line.wait()
            if line.stdout is not None:
                line.stdout.close()
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)

    # --- running things on the hosts ---------------------------------------------------

    def command(self, host: int, *argv: str) -> list[str]:
        """``argv`` as run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def start(self, host: int, *argv: str, **popen: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on host ``host``."""
        return subprocess.Popen(self.command(host, *argv), **popen)

    def start_master(self, host: int, *flags: str) -> tuple[subprocess.Popen[str], str]:
        """Start ``pccl-trio master`` on host ``host`` (its address, port 48148,
        ``--insecure``: the WAN is not loopback; errors only in its log; ``flags``
        besides); the process and the address it listens on, once it does."""
        master = subprocess.Popen(
            self.command(host, sys.executable, "-m", "pccl_trio.master", "--listen",
                         f"{self.address(host)}:48148", "--insecure", "--log-level", "ERROR",
                         *flags),
            stdout=subprocess.PIPE, text=True,
        )
        assert master.stdout is not None
        return master, master.stdout.readline().split()[-1]

    def run(self, host: int, *argv: str, **run: Any) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` on host ``host`` to its end."""
        return subprocess.run(self.command(host, *argv), **run)

    def ceiling(self, pairs: Sequence[tuple[int, int]], *, streams: int = 16,
                seconds: float = 6.0, warmup: float = 3.0) -> list[float]:
        """What plain TCP carries over the WAN: every ``(sender, receiver)`` of
        ``pairs`` at once, ``streams`` connections each, for ``seconds``; the bytes per
        second each receiver took in after ``warmup`` (slow start over), in order."""
        from . import _blast

        return _blast.measure(self, pairs, streams=streams, seconds=seconds, warmup=warmup)

    def _in(self, namespace: str, *argv: str) -> None:
        _sh("ip", "netns", "exec", namespace, *argv)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def rate_bits(rate: str) -> float:
    """``tc``'s rate spelling (``1gbit``, ``100mbit``, ``500kbit``) in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"a rate such as 1gbit or 100mbit, not {rate!r}")
