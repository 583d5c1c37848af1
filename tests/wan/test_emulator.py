"""The WAN emulator itself: its plan, and on a machine that can run it (root, iproute2,
TUN), that packets really take the path's delay, that loss drops packets, and that
nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pccl_trio.testing import Wan, WanPlan, two_continents, wan_available

needs_wan = pytest.mark.skipif(not wan_available(), reason="needs root, iproute2 and /dev/net/tun")

#: Connects to a listener and prints the kernel's round-trip estimate of the connection.
KERNEL_ROUND_TRIP = """
import sys, trio
from pccl_trio.transport import TcpNetwork, kernel_round_trip
async def main():
    stream = await TcpNetwork().connect(sys.argv[1], 5002)
    print(kernel_round_trip(stream))
trio.run(main)
"""

#: Listens on port 5002 until killed.
LISTEN = """
import socket, time
listener = socket.create_server(("0.0.0.0", 5002))
print("ready", flush=True)
time.sleep(60)
"""

#: Connects to a closed port (a SYN and its RST: one round trip) and prints the seconds.
ROUND_TRIP = """
import socket, sys, time
start = time.monotonic()
try:
    socket.create_connection((sys.argv[1], 9), timeout=5)
except ConnectionRefusedError:
    print(time.monotonic() - start)
"""


def round_trip(wan: Wan, a: int, b: int) -> float:
    done = wan.run(a, sys.executable, "-c", ROUND_TRIP, wan.address(b), capture_output=True,
                   text=True, check=True)
    return float(done.stdout)


def test_a_plan_checks_itself_and_gives_each_path_its_delay() -> None:
    plan = WanPlan(hosts=4, delay=0.05, delays={(0, 1): 0.01, (2, 3): 0.2, (3, 2): 0.3})
    assert plan.one_way(0, 1) == plan.one_way(1, 0) == 0.01  # one way given: both ways
    assert (plan.one_way(2, 3), plan.one_way(3, 2)) == (0.2, 0.3)
    assert plan.one_way(0, 3) == 0.05
    assert plan.paths()[3][2].delay == 0.3
    for bad in ({"hosts": 1}, {"hosts": 2, "mtu": 70000}, {"hosts": 2, "loss": 1.0},
                {"hosts": 2, "delays": {(0, 0): 0.1}}, {"hosts": 2, "delays": {(0, 2): 0.1}}):
        with pytest.raises(ValueError):
            WanPlan(**bad)  # type: ignore[arg-type]


def test_two_continents_are_near_inside_and_far_across() -> None:
    delays = two_continents([2, 3], inside=0.005, across=0.075)
    assert delays[(0, 1)] == delays[(2, 4)] == 0.005
    assert delays[(1, 2)] == delays[(4, 0)] == 0.075
    assert len(delays) == 5 * 4


@needs_wan
def test_packets_take_the_path_delay_each_way() -> None:
    delays = {(0, 1): 0.030, (1, 2): 0.080}
    prefix = f"pwa{os.getpid() % 100000}"
    with Wan(WanPlan(hosts=3, delay=0.005, delays=delays, rate=None), prefix=prefix) as wan:
        # A delay line holds a packet at least its delay: a round trip never beats it.
        assert round_trip(wan, 0, 1) >= 2 * 0.030
        assert round_trip(wan, 2, 1) >= 2 * 0.080
        assert round_trip(wan, 0, 2) >= 2 * 0.005
        # The kernel's estimate of a connection's round trip, as pools are sized by.
        listener = wan.start(1, sys.executable, "-c", LISTEN, stdout=subprocess.PIPE)
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"ready"
        estimate = wan.run(0, sys.executable, "-c", KERNEL_ROUND_TRIP, wan.address(1),
                           capture_output=True, text=True, check=True)
        listener.kill()
        listener.wait()
        listener.stdout.close()
        assert float(estimate.stdout) >= 2 * 0.030
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{prefix}-" not in listed  # removed on exit


@needs_wan
def test_plain_tcp_crosses_a_lossy_jittered_path_intact() -> None:
    plan = WanPlan(hosts=2, delay=0.01, jitter=0.004, loss=0.01, reorder=True, rate="200mbit")
    with Wan(plan, prefix=f"pwb{os.getpid() % 100000}") as wan:
        server = wan.start(1, sys.executable, "-c", ECHO_HASH, stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        sent = wan.run(0, sys.executable, "-c", SEND_HASH, wan.address(1), capture_output=True,
                       text=True, check=True)
        received, _ = server.communicate(timeout=60)
    assert received.decode().strip() == sent.stdout.strip()  # TCP recovered every loss


#: Receives one connection's bytes and prints their SHA-256.
ECHO_HASH = """
import hashlib, socket
listener = socket.create_server(("0.0.0.0", 5001))
print("ready", flush=True)
connection, _ = listener.accept()
digest = hashlib.sha256()
while chunk := connection.recv(1 << 16):
    digest.update(chunk)
print(digest.hexdigest())
"""

#: Sends 8 MiB of seeded random bytes to port 5001 and prints their SHA-256.
SEND_HASH = """
import hashlib, random, socket, sys
payload = random.Random(7).randbytes(8 << 20)
with socket.create_connection((sys.argv[1], 5001)) as connection:
    connection.sendall(payload)
print(hashlib.sha256(payload).hexdigest())
"""
