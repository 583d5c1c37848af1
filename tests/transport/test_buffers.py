"""Which socket buffers a TCP connection pins (``transport._network.pinned_buffers``):
those the kernel grants in full; a buffer the kernel would cap below
``SOCKET_BUFFER_BYTES`` is left to its autotuning."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pccl_trio.transport import SOCKET_BUFFER_BYTES, _network


@pytest.fixture
def limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, Path]]:
    """Files standing for ``net.core.wmem_max`` and ``rmem_max``, read afresh."""
    files = {option: tmp_path / f"{option}" for option in _network._BUFFER_LIMITS}
    monkeypatch.setattr(_network, "_BUFFER_LIMITS", {o: str(f) for o, f in files.items()})
    _network.pinned_buffers.cache_clear()
    yield files
    _network.pinned_buffers.cache_clear()


def _buffer(option: int) -> int:
    with socket.socket() as sock:
        _network._tune(sock, None)
        return int(sock.getsockopt(socket.SOL_SOCKET, option))


@pytest.mark.parametrize(("send_max", "receive_max", "pinned"), [
    (SOCKET_BUFFER_BYTES, SOCKET_BUFFER_BYTES, (socket.SO_SNDBUF, socket.SO_RCVBUF)),
    (212992, 212992, ()),  # a stock kernel's caps: both left to autotuning
    (SOCKET_BUFFER_BYTES, 212992, (socket.SO_SNDBUF,)),
    (64 << 20, 1 << 20, (socket.SO_SNDBUF,)),
])
def test_a_buffer_is_pinned_only_where_the_kernel_grants_it(
    limits: dict[int, Path], send_max: int, receive_max: int, pinned: tuple[int, ...]
) -> None:
    limits[socket.SO_SNDBUF].write_text(f"{send_max}\n")
    limits[socket.SO_RCVBUF].write_text(f"{receive_max}\n")
    assert _network.pinned_buffers() == pinned


def test_without_the_caps_to_read_both_are_pinned(limits: dict[int, Path]) -> None:
    assert _network.pinned_buffers() == (socket.SO_SNDBUF, socket.SO_RCVBUF)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's buffer accounting")
def test_a_buffer_left_to_the_kernel_keeps_its_default(limits: dict[int, Path]) -> None:
    limits[socket.SO_SNDBUF].write_text(f"{SOCKET_BUFFER_BYTES}\n")
    limits[socket.SO_RCVBUF].write_text("212992\n")
    # Pinned: the kernel doubles what was asked for. Left alone: the default, far less.
    assert _buffer(socket.SO_SNDBUF) >= SOCKET_BUFFER_BYTES
    assert _buffer(socket.SO_RCVBUF) < SOCKET_BUFFER_BYTES
