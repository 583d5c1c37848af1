"""A wrapper's communicator, owned: connect, run each boundary, join again after a kick.

Theory of operation
-------------------
A wrapper (``DiLoCo``, ``DataParallel``) writes its boundaries as coroutines against
the async ``pccl_trio.Communicator`` and hands them to an owner, which runs them
where its communicator lives: ``BlockingOwner`` in a ``pccl_trio.sync.Communicator``'s
event loop (``call_in_loop``), the trainer's thread blocking meanwhile; ``AsyncOwner``
in the trainer's own trio task.

``join`` connects a communicator that is new and runs the rounds' ``join``, this
peer's first boundary. A boundary that raises ``Rejoin`` (this peer was kicked after
it stepped: the run went on without it) makes the owner close the communicator, make
a new one with the same arguments (``replacement()``), connect it, tell the rounds
(``rejoining``: a newcomer from here on) and run their ``join`` instead: the peer
comes back as a newcomer, whose first sync takes the run's state. ``communicator`` is
always the one in use.

``BlockingWrapper`` and ``AsyncWrapper`` are what every wrapper class has whatever its
rounds: the communicator it owns (checked to be of its kind), the run's shared state,
``join``, ``hold``, ``close`` and the context manager; a wrapper adds its ``step``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from .._errors import InvalidArgument, InvalidUsage
from .._types import SharedState
from ..peer import Communicator as AsyncCommunicator
from ..sync import Communicator as BlockingCommunicator
from ._admission import check_peers

__all__ = [
    "AsyncOwner", "AsyncWrapper", "BlockingOwner", "BlockingWrapper", "Boundary", "Rejoin",
    "Rounds",
]

_T = TypeVar("_T")

#: A bound coroutine method of the rounds: what runs with the communicator.
Boundary = Callable[[AsyncCommunicator], Awaitable[None]]


class Rejoin(Exception):
    """This peer was kicked after it stepped: join again as a newcomer."""


class Rounds(Protocol):
    """What an owner needs of a wrapper's rounds."""

    @property
    def shared(self) -> SharedState: ...

    async def join(self, comm: AsyncCommunicator) -> None: ...

    def rejoining(self) -> None: ...

    async def hold(self, comm: AsyncCommunicator, peers: int) -> None: ...


class BlockingOwner:
    """Runs the rounds over a ``pccl_trio.sync.Communicator`` (see the module docstring)."""

    def __init__(self, communicator: BlockingCommunicator, rounds: Rounds, wrapper: str) -> None:
        self.communicator = communicator
        self.joined = False
        self._rounds = rounds
        self._wrapper = wrapper

    def join(self) -> None:
        if self.joined:
            raise InvalidUsage(f"join(): this {self._wrapper} joined the run already")
        if self.communicator.peer_id is None:
            self.communicator.connect()
        self.joined = True
        self.run(self._rounds.join)

    def run(self, boundary: Boundary) -> None:
        """Run ``boundary`` in the communicator's loop, joining again after ``Rejoin``."""
        while True:
            try:
                self.communicator.call_in_loop(boundary)
                return
            except Rejoin:
                self.communicator.close()
                self.communicator = self.communicator.replacement()
                self.communicator.connect()
                self._rounds.rejoining()
                boundary = self._rounds.join

    def call(self, afn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``await afn(comm, *args)`` in the communicator's loop (no rejoin)."""
        return self.communicator.call_in_loop(afn, *args)

    def close(self) -> None:
        self.communicator.close()


class AsyncOwner:
    """Runs the rounds over a ``pccl_trio.Communicator`` in the trainer's trio task."""

    def __init__(self, communicator: AsyncCommunicator, rounds: Rounds, wrapper: str) -> None:
        self.communicator = communicator
        self.joined = False
        self._rounds = rounds
        self._wrapper = wrapper

    async def join(self) -> None:
        if self.joined:
            raise InvalidUsage(f"join(): this {self._wrapper} joined the run already")
        if self.communicator.peer_id is None:
            await self.communicator.connect()
        self.joined = True
        await self.run(self._rounds.join)

    async def run(self, boundary: Boundary) -> None:
        """Run ``boundary``, joining again after ``Rejoin``."""
        while True:
            try:
                await boundary(self.communicator)
                return
            except Rejoin:
                await self.communicator.aclose()
                self.communicator = self.communicator.replacement()
                await self.communicator.connect()
                self._rounds.rejoining()
                boundary = self._rounds.join

    async def aclose(self) -> None:
        await self.communicator.aclose()


_R = TypeVar("_R", bound=Rounds)


class BlockingWrapper(Generic[_R]):
    """A wrapper over a ``pccl_trio.sync.Communicator`` (see the module docstring):
    ``make_rounds`` builds its rounds once the communicator passed the check."""

    def __init__(self, communicator: BlockingCommunicator, make_rounds: Callable[[], _R], *,
                 name: str, twin: str) -> None:
        if not isinstance(communicator, BlockingCommunicator):
            raise InvalidArgument(
                f"communicator must be a pccl_trio.sync.Communicator ({twin} takes a "
                f"pccl_trio.Communicator), not {type(communicator).__name__}"
            )
        self._rounds = make_rounds()
        self._owner = BlockingOwner(communicator, self._rounds, name)

    @property
    def communicator(self) -> BlockingCommunicator:
        """The communicator in use (a new one after this peer joined again)."""
        return self._owner.communicator

    @property
    def shared_state(self) -> SharedState:
        """The run's shared state (the class docstring names its tensors), whose
        revision is the run's count of steps: ``pccl_trio.state_digest`` of it is the
        same on every peer after each boundary (log it to check that the weights
        agree). Read it between steps; the wrapper writes it at boundaries."""
        return self._rounds.shared

    def join(self) -> None:
        """Connect (when the communicator is new) and make this peer's first boundary:
        the model then holds the run's parameters."""
        self._owner.join()

    def hold(self, peers: int) -> None:
        """Wait until the run has ``peers`` peers, admitting those that ask, as
        ``min_peers`` does before the first step (blocks). Every peer must call it at
        the same step, between two steps (a demo's joiner, a run that should not go on
        shorthanded). With DiLoCo's ``overlap`` it first waits for the outer step on its
        way, so a joiner admitted here receives the state that has it.

        Raises:
            InvalidArgument: ``peers`` is not a positive int.
        """
        check_peers(peers, "peers")
        if not self._owner.joined:
            self.join()
        self._owner.run(partial(self._rounds.hold, peers=peers))

    def close(self) -> None:
        """Leave the run."""
        self._owner.close()

    def __enter__(self) -> Self:
        self.join()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncWrapper(Generic[_R]):
    """``BlockingWrapper`` for a trainer in trio, over a ``pccl_trio.Communicator``."""

    def __init__(self, communicator: AsyncCommunicator, make_rounds: Callable[[], _R], *,
                 name: str, twin: str) -> None:
        if not isinstance(communicator, AsyncCommunicator):
            raise InvalidArgument(
                f"communicator must be a pccl_trio.Communicator ({twin} takes a "
                f"pccl_trio.sync.Communicator), not {type(communicator).__name__}"
            )
        self._rounds = make_rounds()
        self._owner = AsyncOwner(communicator, self._rounds, name)

    @property
    def communicator(self) -> AsyncCommunicator:
        """As ``BlockingWrapper.communicator``."""
        return self._owner.communicator

    @property
    def shared_state(self) -> SharedState:
        """As ``BlockingWrapper.shared_state``."""
        return self._rounds.shared

    async def join(self) -> None:
        """As ``BlockingWrapper.join``."""
        await self._owner.join()

    async def hold(self, peers: int) -> None:
        """As ``BlockingWrapper.hold``."""
        check_peers(peers, "peers")
        if not self._owner.joined:
            await self.join()
        await self._owner.run(partial(self._rounds.hold, peers=peers))

    async def aclose(self) -> None:
        """As ``BlockingWrapper.close``."""
        await self._owner.aclose()

    async def __aenter__(self) -> Self:
        await self.join()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
