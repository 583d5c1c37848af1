"""``Config.congestion_control`` end to end: a run whose peers choose one all-reduces
over loopback TCP, and every ring connection runs it at both ends."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import trio

import pccl_trio as pccl
from pccl_trio.testing import PeerSeam
from pccl_trio.transport import SocketLink, format_address

from .conftest import TCP_CONFIG, form_run, reduce_exactly, run_all

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="TCP_CONGESTION is Linux's")


async def test_every_ring_connection_runs_the_chosen_congestion_control(
    nursery: trio.Nursery,
) -> None:
    address = await nursery.start(pccl.serve_master_tcp, 0, "127.0.0.1")
    # Reno: built into every Linux kernel and allowed to every process. Two
    # connections per neighbour, so that every slot is checked, not only the first.
    config = dataclasses.replace(TCP_CONFIG, congestion_control="reno")
    comms = [
        pccl.Communicator(format_address(*address), 0, 2, config=config, p2p_host="127.0.0.1")
        for _ in range(3)
    ]
    with trio.fail_after(60):
        await form_run([], comms)
        await reduce_exactly(comms)
        for comm in comms:
            links = PeerSeam(comm).connections()
            assert len(links) == 4  # two to the successor, two from the predecessor
            assert all(isinstance(link, SocketLink) for link in links)
            assert {link.congestion_control for link in links  # type: ignore[union-attr]
                    } == {"reno"}
        await run_all(comms, lambda i, c: c.aclose())
