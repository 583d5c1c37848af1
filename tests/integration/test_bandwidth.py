"""Link measurement between two peers (the building block of topology optimization)."""

from __future__ import annotations

import math

import pytest
import trio

import pccl_trio as pccl
from pccl_trio._core.bandwidth import MEASUREMENT_BYTES
from pccl_trio._core.messages import PeerEndpoint
from pccl_trio.testing import PeerSeam

from .conftest import Cluster, form_run


def endpoint_of(comm: pccl.Communicator) -> PeerEndpoint:
    return PeerSeam(comm).endpoint


async def test_a_peer_measures_the_link_from_another(cluster: Cluster, clock: object) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(2)])
        for measurer, measured in ((0, 1), (1, 0)):
            PeerSeam(comms[measured]).expect_benchmark(endpoint_of(comms[measurer]), MEASUREMENT_BYTES)
            result = await PeerSeam(comms[measurer]).measure_link(
                endpoint_of(comms[measured]), MEASUREMENT_BYTES
            )
            assert math.isfinite(result.bandwidth) and result.bandwidth > 0, result
            assert result.latency >= 0 and result.nbytes >= (256 << 10) + 3
            assert result.seconds >= 0
        # Measuring leaves the run untouched: an all-reduce still works.
        import numpy as np

        arrays = [np.full(8, i, dtype=np.float32) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for i, comm in enumerate(comms):
                nursery.start_soon(comm.all_reduce, arrays[i])
        assert all((a == 1).all() for a in arrays)
        for comm in comms:
            await comm.aclose()


async def test_a_measured_peer_dying_fails_only_the_measurement(
    cluster: Cluster, clock: object
) -> None:
    with trio.fail_after(120):
        comms = await form_run([], [cluster.communicator(f"p{i}") for i in range(3)])
        target = endpoint_of(comms[2])
        await cluster.kill("p2", comms[2])
        with pytest.raises((OSError, trio.TooSlowError, trio.BrokenResourceError)):
            await PeerSeam(comms[0]).measure_link(target, MEASUREMENT_BYTES)
        for comm in comms[:2]:
            await comm.aclose()
