"""What tests may observe and replace inside a communicator, named in one place.

Fault-injection tests need to see a communicator's insides (its p2p listener, its
connections, an all-reduce attempt mid-flight, whether the running call has voted, when
the master link is lost), to replace some of its steps (measuring a link, fetching
shared state from a distributor, sending a vote or any message to the master, serving
shared state), to fix a candidate's rank in an election, to stop its serving of shared
state at once, to switch the master link's keepalive thread off, and to announce a link
measurement as a master would. ``PeerSeam`` is that surface: a test asks
``pccl_trio.testing.PeerSeam(comm)`` for it instead of reaching into private
attributes, so the communicator's parts can change without its tests.

A step a test may read and replace is a ``_Step``: an attribute of one of the
communicator's parts, named once here; reading it gives the part's own (a bound
method, or a value), and assigning it replaces it for that communicator only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from .._core.channel import Purpose
from .._core.messages import ExpectBenchmark, Message, PeerEndpoint, SharedStateRequest
from .._core.ring import neighbours
from ..transport import Connection, FramedStream
from ._attempt import RingAttempt
from ._bandwidth import LinkMeasurement
from ._shared_state import Fetcher

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["PeerSeam"]

T = TypeVar("T")

MeasureLink = Callable[[PeerEndpoint, int], Coroutine[Any, Any, LinkMeasurement]]
Vote = Callable[[Message], Coroutine[Any, Any, int]]
ServeSharedState = Callable[[FramedStream, SharedStateRequest], Coroutine[Any, Any, None]]
FetchFrom = Callable[[PeerEndpoint, Fetcher], Awaitable[None]]
SendToMaster = Callable[..., Coroutine[Any, Any, int]]
RunPart = Callable[[RingAttempt], Coroutine[Any, Any, bool]]
M = TypeVar("M", bound=Message)


class _Step(Generic[T]):
    """A step of a communicator that tests may read and replace: attribute ``name`` of
    its part ``part`` (see the module docstring)."""

    def __init__(self, part: str, name: str, doc: str) -> None:
        self._part = part
        self._name = name
        self.__doc__ = doc

    def _owner(self, seam: PeerSeam) -> Any:
        part = getattr(seam._comm, self._part)
        if part is None:
            raise AttributeError(f"this communicator has no {self._part.strip('_')}")
        return part

    @overload
    def __get__(self, seam: None, kind: type[PeerSeam]) -> _Step[T]: ...

    @overload
    def __get__(self, seam: PeerSeam, kind: type[PeerSeam]) -> T: ...

    def __get__(self, seam: PeerSeam | None, kind: type[PeerSeam]) -> T | _Step[T]:
        if seam is None:
            return self
        step: T = getattr(self._owner(seam), self._name)
        return step

    def __set__(self, seam: PeerSeam, replacement: T) -> None:
        setattr(self._owner(seam), self._name, replacement)


class PeerSeam:
    """The test seam of one communicator (see the module docstring)."""

    def __init__(self, communicator: Communicator) -> None:
        self._comm = communicator

    @property
    def p2p_address(self) -> tuple[str, int]:
        """Where the p2p listener listens (after ``connect``)."""
        address = self._comm._p2p.address
        assert address is not None, "the communicator is not listening yet"
        return address

    @property
    def endpoint(self) -> PeerEndpoint:
        """How other peers reach this one (after ``connect``)."""
        peer_id = self._comm.peer_id
        assert peer_id is not None, "the communicator is not registered yet"
        host, port = self.p2p_address
        return PeerEndpoint(
            peer_id=peer_id, host=host, port=port, pool_size=self._comm._p2p.registered_pool_size,
            identity=self.identity,
        )

    @property
    def identity(self) -> bytes:
        """The node identity this communicator proves in its handshakes (empty: none)."""
        return self._comm._p2p.identity

    async def connect(self, endpoint: PeerEndpoint, purpose: Purpose) -> FramedStream:
        """A p2p connection to ``endpoint`` for ``purpose``, opened as the communicator
        opens its own (the caller closes it)."""
        return await self._comm._p2p.connect(endpoint, purpose)

    @property
    def voted(self) -> bool:
        """Whether the membership call running now has sent its vote."""
        return self._comm._life.voted

    def connections(self) -> list[Connection]:
        """Every pooled ring connection, to the successor and from the predecessor."""
        return self._comm._p2p.pools.connections()

    def sending_connections(self) -> list[Connection]:
        """The open connections to the ring's successor."""
        around = neighbours(self._comm.ring, self._comm.peer_id or 0)
        return [] if around is None else self._comm._p2p.pools.successor_connections(around[1])

    def leased(self, tag: int) -> bool:
        """Whether this peer holds a standing lease on ``tag``: its next all-reduce of
        the tag with the same descriptor skips the master."""
        return self._comm._all_reduces.leased(tag)

    def attempt(self, tag: int) -> RingAttempt | None:
        """The attempt of the all-reduce with ``tag`` in flight, if any."""
        return self._comm._receiver.by_tag.get(tag)

    def reducing(self, tag: int) -> bool:
        """Whether an all-reduce with ``tag`` is still in flight here (its task has not
        ended; after a cancelled ``all_reduce`` it may go on in the background)."""
        return tag in self._comm._all_reduces.calls.tags

    measure_link: _Step[MeasureLink] = _Step("_optimizer", "measure_link", """How the
        communicator measures the link from a peer to itself, within a number of bytes;
        assign a replacement (which may call the original) to inject faults.""")

    fetch_from: _Step[FetchFrom] = _Step("_sync", "fetch_from", """How the communicator
        fetches shared-state pieces from one distributor (it records a failure in the
        ``Fetcher`` rather than raising); assign a replacement (which may call the
        original) to hold or fail fetches.""")

    def expect_benchmark(self, measurer: PeerEndpoint, nbytes: int) -> None:
        """Let ``measurer`` measure the link from this peer once, within ``nbytes``, as
        the master's ``ExpectBenchmark`` would."""
        self._comm._optimizer.expect_benchmark(
            ExpectBenchmark(optimization=0, measurer=measurer, nbytes=nbytes)
        )

    def stop_serving(self) -> None:
        """Stop serving shared state now, from the trio thread, without waiting: as a
        distributor that dies at this moment would (new requests are refused, the
        connections being served are cut)."""
        self._comm._sync.cut_serving()

    keepalive: _Step[bool] = _Step("_session", "keepalive", """Whether the master link
        gets a keepalive thread, which heartbeats while the event loop is blocked
        (``transport.keep_alive``); set False before ``connect`` to show what it
        prevents.""")

    def after_reading(self, kind: type[M], hook: Callable[[M], None]) -> None:
        """Call ``hook`` with every ``kind`` message from the master right after the
        communicator applied it as it was read (its route, if it has one)."""
        session = self._comm._session
        own = session.route_of(kind)

        def apply(message: M) -> bool | None:
            taken = own(message) if own is not None else None
            hook(message)
            return taken

        session.route(kind, apply)

    def on_master_lost(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` whenever the master link is lost (the absence begins), after
        the session dropped what no call may take any more."""
        self._comm._session.on_away(hook)

    vote: _Step[Vote] = _Step("_session", "vote", """How the communicator sends a vote to
        the master; assign a replacement (which must call the original and return what
        it returns) to observe votes.""")

    send_to_master: _Step[SendToMaster] = _Step("_session", "send", """How the
        communicator sends any message to the master (votes too, through it), with the
        keyword arguments of ``MasterSession.send``; assign a replacement (which must
        call the original and return what it returns) to act on what it reports.""")

    run_part: _Step[RunPart] = _Step("_all_reduces", "_run_ring", """How the communicator
        runs its part of a commenced all-reduce attempt and reports it to the master;
        assign a replacement (which must call the original and return what it
        returns) to hold a part before it starts.""")

    election_rank: _Step[str] = _Step("_elector", "rank", """The rank key this
        candidate stands with in elections of the run's master (``host_master=True``);
        assign one before ``connect`` to fix the order of an election.""")

    @property
    def serve_shared_state(self) -> ServeSharedState:
        """How the communicator answers a peer that fetches shared state from it (the
        handler of p2p connections opening with ``SharedStateRequest``); assign a
        replacement to make it a faulty distributor."""
        return self._comm._serve_shared_state

    @serve_shared_state.setter
    def serve_shared_state(self, replacement: ServeSharedState) -> None:
        self._comm._serve_shared_state = replacement
        self._comm._p2p.handle(SharedStateRequest, replacement)
