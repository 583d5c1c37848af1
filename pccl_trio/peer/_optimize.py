"""Topology optimization at one peer: measuring links on request, installing the ring.

Theory of operation
-------------------
``optimize`` votes ``VoteOptimizeTopology``. The master then asks this peer, one link at a
time, to measure the link *from* another peer to itself (``MeasureLink``); the peer
measures it over a benchmark connection (``_bandwidth.measure_link``, a protocol run on
a fresh p2p connection) and reports the rate, or the failure, in ``LinkMeasured``: a
link that cannot be measured is the master's information, not this peer's error. The
master's report (``TopologyOptimized``) carries what it knows of the group's links and
the ring it chose; an establishment round that admits nobody installs that ring.

The other end of a measurement: the master tells the measured peer first whom to expect
(``ExpectBenchmark``, applied by the master session's reader as it arrives). This peer
serves a benchmark connection (``serve_benchmark``, the p2p handler of
``BenchmarkRequest``) only from a peer so announced, from the host the master knows it
at, once per announcement and within the announced bytes; a request that arrives before
its announcement waits for it while an optimization runs here.

When other peers only re-establish their ring after an aborted all-reduce, the master
answers ``rejoin``: this peer takes part in that round, then votes again. ``topology``
follows later rounds that install another order of the same peers (a better ring the
master's background search found).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from .._core.bandwidth import link_matrices
from .._core.channel import Purpose
from .._core.messages import (
    BenchmarkRequest,
    ExpectBenchmark,
    LinkMeasured,
    MeasureLink,
    PeerEndpoint,
    TopologyOptimized,
    VoteEstablish,
    VoteOptimizeTopology,
)
from .._core.wire import max_payload
from .._errors import InvalidUsage, TopologyOptimizationFailed, UpdateTopologyFailed
from .._types import TopologyInfo
from ..transport import FramedStream
from . import _bandwidth as measurement
from ._bandwidth import LinkMeasurement
from ._context import PeerContext
from ._lifecycle import Call
from ._membership import Membership
from ._p2p import LINK_ERRORS, claim_refusal

__all__ = ["TopologyOptimizer"]

log = logging.getLogger("pccl_trio.peer")


def _topology_info(message: TopologyOptimized) -> TopologyInfo:
    """The master's report as the public record (matrices of NaN if it left them out)."""
    bandwidth, latency = link_matrices(
        len(message.peers), message.bandwidth, message.latency, message.unreachable
    )
    return TopologyInfo(
        peers=message.peers,
        bandwidth=bandwidth,
        latency=latency,
        ring=message.ring,
        predicted_seconds=(
            message.predicted_seconds if message.predicted_seconds >= 0 else math.inf
        ),
        reference_bytes=message.reference_bytes,
        optimal=message.optimal,
    )


class TopologyOptimizer:
    """This peer's part in topology optimizations (see the module docstring)."""

    def __init__(self, context: PeerContext, *, membership: Membership) -> None:
        self._config = context.config
        self._life = context.lifecycle
        self._session = context.session
        self._p2p = context.p2p
        self._membership = membership
        self.topology: TopologyInfo | None = None
        #: How a link is measured (replaceable: the test seam injects faults here).
        self.measure_link: Callable[[PeerEndpoint, int], Coroutine[Any, Any, LinkMeasurement]] = (
            self._measure_link
        )
        # The measurements of this peer's links the master announced, by measuring peer,
        # while an optimization runs here.
        self._optimizing = False
        self._announced: dict[int, ExpectBenchmark] = {}
        self._announced_lot = trio.lowlevel.ParkingLot()
        membership.follow(self._follow_ring)

    async def optimize(self) -> None:
        """``Communicator.optimize_topology`` once the communicator is idle."""
        membership = self._membership
        await membership.ensure_ring()  # see Membership.update_topology
        if membership.world is not None and membership.world.global_world_size < 2:
            return
        with self._life.operation(Call.OPTIMIZE_TOPOLOGY):
            self._optimizing = True
            try:
                message = await self._measure_links()
            finally:
                self._optimizing = False
                self._announced.clear()
                self._announced_lot.unpark_all()
            if message.error:
                raise InvalidUsage(message.error)
            self.topology = _topology_info(message)
            # The master starts the first round itself, right after its report.
            if await membership.establish_rounds(accept_new_peers=False, voted=True):
                return
            raise TopologyOptimizationFailed(
                f"the optimized ring could not be established in "
                f"{self._config.establish_attempts} rounds (peers kept failing or leaving); "
                "call optimize_topology() again"
            )

    async def _measure_links(self) -> TopologyOptimized:
        """Vote, then measure the links the master asks for until its report arrives
        (voting again after a round others needed); the report."""
        membership = self._membership
        while True:
            epoch = await self._session.vote(VoteOptimizeTopology())
            while not isinstance(
                message := await self._session.wait_for(
                    (MeasureLink, ExpectBenchmark, TopologyOptimized)
                ),
                TopologyOptimized,
            ):
                # An announcement was applied as it arrived (``expect_benchmark``).
                if isinstance(message, MeasureLink):
                    await self._session.send(await self._report_link(message), epoch=epoch)
            if not message.rejoin:
                return message
            # Peers of another group re-establish their ring after an aborted
            # all-reduce (as their own optimize_topology does first): take part in
            # that round, then vote again.
            await self._session.vote(VoteEstablish(accept_new_peers=False))
            try:
                rejoined = await membership.establish_round()
            except UpdateTopologyFailed as exc:
                raise TopologyOptimizationFailed(str(exc)) from exc
            if not rejoined:
                membership.stale = True
                raise TopologyOptimizationFailed(
                    "a re-establishment round other peers needed failed; call "
                    "optimize_topology() again"
                )

    async def _report_link(self, request: MeasureLink) -> LinkMeasured:
        """Measure the link the master asked for; a failure is reported, not raised."""
        source = request.source
        # Connecting, the measurement's own budget, and one liveness timeout of silence
        # from a sender that stalls: the report then names the link, well within the
        # master's step deadline (Config.round_timeout).
        bound = (
            self._config.connect_timeout + measurement.BUDGET_SECONDS
            + self._session.liveness_timeout
        )
        try:
            with trio.fail_after(bound):
                result = await self.measure_link(source, request.nbytes)
        except LINK_ERRORS as exc:
            log.warning(
                "peer %s: cannot measure the link from peer %d: %s",
                self._session.peer_id, source.peer_id, exc or type(exc).__name__,
            )
            return LinkMeasured(
                optimization=request.optimization,
                sender=source.peer_id,
                error=f"{type(exc).__name__}: {exc}"[:1000],
            )
        return LinkMeasured(
            optimization=request.optimization,
            sender=source.peer_id,
            bandwidth=result.bandwidth,
            latency=result.latency,
        )

    async def _measure_link(self, endpoint: PeerEndpoint, nbytes: int) -> LinkMeasurement:
        """Measure the link from ``endpoint`` to this peer, moving at most ``nbytes``
        (see ``_bandwidth``).

        Raises:
            OSError, trio.TooSlowError, trio.BrokenResourceError, RemoteProtocolError:
                the peer could not be reached or the measurement broke off.
        """
        assert self._session.peer_id is not None
        return await self._p2p.run_protocol(
            await self._p2p.connect(endpoint, Purpose.BENCHMARK),
            measurement.measure_link(
                peer_id=self._session.peer_id,
                frame_bytes=max_payload(self._config.max_data_frame),
                budget_bytes=nbytes,
            ),
        )

    # --- the measured end ------------------------------------------------------------------

    def expect_benchmark(self, message: ExpectBenchmark) -> None:
        """Serve the measurement the master announced (a route of the master session:
        applied as the announcement arrives, before the measuring peer can be told)."""
        self._announced[message.measurer.peer_id] = message
        self._announced_lot.unpark_all()

    async def serve_benchmark(self, framed: FramedStream, request: BenchmarkRequest) -> None:
        """Answer a peer measuring the link from us, if the master announced it (the p2p
        handler of ``BenchmarkRequest``); otherwise close the connection unanswered."""
        announced = await self._take_announcement(framed, request)
        if announced is not None:
            await self._p2p.run_protocol(
                framed, measurement.serve_benchmark(request, budget=announced.nbytes)
            )

    async def _take_announcement(
        self, framed: FramedStream, request: BenchmarkRequest
    ) -> ExpectBenchmark | None:
        """The announcement of the measurement ``request`` opens, taken (one connection
        per announcement); None, and a warning, if there is none for it."""
        # The announcement may reach us a moment after the measuring peer was told.
        with trio.move_on_after(self._config.connect_timeout):
            while self._optimizing and request.peer_id not in self._announced:
                await self._announced_lot.park()
        announced = self._announced.get(request.peer_id)
        if announced is None:
            refusal = "the master announced no measurement by it"
        else:
            refusal = await claim_refusal(framed, announced.measurer)
            if not refusal and self._announced.get(request.peer_id) is not announced:
                # Taken by another connection, or the optimization ended, meanwhile.
                refusal = "its announced measurement is no longer open"
        if not refusal:
            assert announced is not None
            del self._announced[request.peer_id]
            return announced
        log.warning(
            "peer %s: refusing a benchmark connection claiming to be peer %d: %s",
            self._session.peer_id, request.peer_id, refusal,
        )
        return None

    def _follow_ring(self, ring: tuple[int, ...]) -> None:
        """Keep ``topology`` about the installed ring: a round may install another order
        of the same peers (a better ring the master's background search found)."""
        info = self.topology
        if info is None or ring == info.ring or sorted(ring) != sorted(info.peers):
            return
        self.topology = dataclasses.replace(
            info,
            ring=ring,
            predicted_seconds=info.predict(info.reference_bytes, ring),
            optimal=False,
        )
