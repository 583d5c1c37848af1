"""Choosing the TCP congestion control of a network's connections
(``TcpNetwork(congestion_control=...)``, ``Config.congestion_control``): both ends of
a connection get it, and a name the kernel lacks or does not allow is refused up
front with what it offers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import pccl_trio as pccl
from pccl_trio.transport import TcpNetwork, check_congestion_control, listener_address

LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not LINUX, reason="TCP_CONGESTION is Linux's")
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


def _congestion_of(stream: trio.abc.Stream) -> str:
    assert isinstance(stream, trio.SocketStream)
    raw = stream.socket.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


def _listed(name: str) -> list[str]:
    return Path(f"/proc/sys/net/ipv4/tcp_{name}_congestion_control").read_text().split()


def _system_default() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


@linux_only
@pytest.mark.parametrize("chosen", ["reno", None])
async def test_both_ends_of_a_connection_use_the_chosen_congestion_control(
    chosen: str | None,
) -> None:
    # Reno is built into every Linux kernel and allowed to every process; None keeps
    # the system's default.
    expected = chosen or _system_default()
    network = TcpNetwork(congestion_control=chosen)
    with trio.fail_after(30):
        listener = await network.listen("127.0.0.1", 0)
        client = await network.connect("127.0.0.1", listener_address(listener)[1])
        server = await listener.accept()
        try:
            assert _congestion_of(client) == expected
            assert _congestion_of(server) == expected
        finally:
            for resource in (client, server, listener):
                await resource.aclose()


@linux_only
async def test_a_reserved_listener_uses_it_too() -> None:
    network = TcpNetwork(congestion_control="reno")
    with trio.fail_after(30):
        reservation = await network.reserve("127.0.0.1")
        listener = await reservation.listen()
        client = await TcpNetwork().connect("127.0.0.1", reservation.port)
        server = await listener.accept()
        try:
            assert _congestion_of(server) == "reno"
        finally:
            for resource in (client, server, listener):
                await resource.aclose()


@linux_only
def test_a_congestion_control_the_kernel_lacks_is_refused_with_what_it_offers() -> None:
    with pytest.raises(ValueError, match="offers no congestion control 'nosuch'") as caught:
        check_congestion_control("nosuch")
    for offered in _listed("available"):
        assert offered in str(caught.value)
    with pytest.raises(pccl.InvalidArgument, match="Config.congestion_control: .*'nosuch'"):
        pccl.Communicator("127.0.0.1:1", config=pccl.Config(congestion_control="nosuch"))


@linux_only
@pytest.mark.skipif(not LINUX or os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops CAP_NET_ADMIN from a child process with setpriv")
def test_a_congestion_control_this_process_may_not_choose_is_refused_with_the_allowed() -> None:
    forbidden = [name for name in _listed("available") if name not in _listed("allowed")]
    if not forbidden:
        pytest.skip("every congestion control this kernel offers is allowed to everyone")
    child = (
        "import sys\n"
        "from pccl_trio.transport import check_congestion_control\n"
        "try:\n"
        f"    check_congestion_control({forbidden[0]!r})\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    sys.exit('accepted')\n"
    )
    # Root without CAP_NET_ADMIN in its bounding set: what an unprivileged process gets.
    done = subprocess.run(["setpriv", "--bounding-set=-net_admin", sys.executable, "-c", child],
                          capture_output=True, text=True, timeout=60, check=True)
    assert f"may not choose congestion control {forbidden[0]!r}" in done.stdout
    for allowed in _listed("allowed"):
        assert allowed in done.stdout


@pytest.mark.parametrize("bad", ["", "x" * 16, "cübic", 3, b"cubic"])
def test_a_malformed_congestion_control_is_refused_by_the_config(bad: object) -> None:
    with pytest.raises(pccl.InvalidArgument, match="Config.congestion_control must be"):
        pccl.Config(congestion_control=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a name of 1 to 15 letters"):
        check_congestion_control(bad)  # type: ignore[arg-type]
