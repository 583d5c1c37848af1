"""``pccl_trio.sync.Communicator``: every call of ``pccl_trio.Communicator``, blocking.

Theory of operation
-------------------
Most training loops are synchronous. This communicator gives them the whole async
API as blocking calls with the same arguments, results and errors, by driving the
async ``Communicator`` on an event loop of its own (``LoopThread``): ``connect()``
starts that loop's thread and connects in it, every call then runs there as a task
while the calling thread waits, and ``close()`` leaves the run and ends the thread.
Nothing is re-implemented here: each method hands its arguments to the async
communicator's method of the same name, so every check, verdict and error is that
method's. A ``with`` block connects and closes.

Threads. Any thread but the loop's may call, and several may call at once: their calls
run concurrently, with the async API's rules (distinct tags for concurrent
collectives; one membership call at a time, the others refused). ``close()`` from
another thread while calls block ends them: each raises what the async call raises
when its communicator closes under it. A call made inside a Trio run, or on the
loop's thread, is refused (``InvalidUsage``), since it would block that loop.
``KeyboardInterrupt`` in a blocked main thread cancels the call first, by trio's rules
for a cancelled call (``LoopThread``), then goes on.

The ``*_async`` calls start the collective in the loop and return a ``Handle`` at
once: ``wait()`` blocks for its result, ``done()`` says whether it ended.

Buffers passed to a call belong to the call until it returns (or its handle's ``wait``
returns): the loop's thread writes into them meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from .._config import Config
from .._errors import InvalidUsage
from .._types import (
    Attribute,
    DistributionHint,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    Shard,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
    TopK,
    TopologyInfo,
)
from ..peer import AsyncGatherHandle, AsyncReduceHandle, AsyncShardHandle, CommunicatorStatistics
from ..peer import Communicator as AsyncCommunicator
from ..transport import Network
from ._loop import LoopThread

__all__ = ["Communicator", "Handle"]

_T = TypeVar("_T")


class Handle(Generic[_T]):
    """A collective started by one of ``Communicator``'s ``*_async`` calls, running in
    the communicator's loop."""

    def __init__(
        self, loop: LoopThread,
        running: AsyncReduceHandle | AsyncShardHandle | AsyncGatherHandle, what: str,
    ) -> None:
        self._loop = loop
        self._running = running
        self._what = what
        self.tag = running.tag

    def done(self) -> bool:
        """Whether the collective ended (``wait`` then returns or raises at once)."""
        running = self._running
        if not self._loop.running:
            return running.done
        return self._loop.call_sync(lambda: running.done, what=f"{self._what}.done()")

    def wait(self) -> _T:
        """Block until the collective ends: its result, or its error raised (as the
        async handle's ``wait``)."""
        return self._loop.call(  # type: ignore[return-value]
            self._running.wait, what=f"{self._what}.wait()"
        )

    def __repr__(self) -> str:
        return f"<pccl_trio.sync.Handle {self._running!r}>"


class Communicator:
    """A peer of a run, with blocking calls (see the module docstring). The
    constructor's arguments are ``pccl_trio.Communicator``'s, checked alike.

    Raises:
        InvalidArgument: an argument is wrong (as ``pccl_trio.Communicator``).
    """

    def __init__(
        self,
        master_address: str | None = None,
        peer_group: int = 0,
        p2p_connection_pool_size: int = 0,
        *,
        config: Config | None = None,
        network: Network | None = None,
        p2p_host: str = "0.0.0.0",
        p2p_port: int = 0,
        advertised_host: str | None = None,
        discover: str | None = None,
        host_master: bool = False,
    ) -> None:
        self._comm = AsyncCommunicator(
            master_address, peer_group, p2p_connection_pool_size, config=config,
            network=network, p2p_host=p2p_host, p2p_port=p2p_port,
            advertised_host=advertised_host, discover=discover, host_master=host_master,
        )
        self._setup_loop()

    def _setup_loop(self) -> None:
        self._loop = LoopThread(f"pccl_trio communicator {id(self):#x}")
        self._started = False  # connect() was called: the loop is started only once
        self._starting = threading.Lock()

    # --- state, read where the communicator lives ---------------------------------------

    def _read(self, fn: Any, what: str) -> Any:
        """``fn()`` on the loop's thread while the loop runs; before ``connect`` and
        after ``close`` nothing else touches the communicator, so here."""
        if self._loop.running and not self._loop.on_loop_thread():
            return self._loop.call_sync(fn, what=what)
        return fn()

    @property
    def peer_id(self) -> int | None:
        """As ``pccl_trio.Communicator.peer_id``."""
        return self._read(lambda: self._comm.peer_id, "peer_id")  # type: ignore[no-any-return]

    @property
    def peer_group(self) -> int:
        """As ``pccl_trio.Communicator.peer_group``."""
        return self._comm.peer_group

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """As ``pccl_trio.Communicator.metrics_address``."""
        return self._read(  # type: ignore[no-any-return]
            lambda: self._comm.metrics_address, "metrics_address"
        )

    @property
    def ring(self) -> tuple[int, ...]:
        """As ``pccl_trio.Communicator.ring``."""
        return self._read(lambda: self._comm.ring, "ring")  # type: ignore[no-any-return]

    @property
    def topology(self) -> TopologyInfo | None:
        """As ``pccl_trio.Communicator.topology``."""
        return self._read(lambda: self._comm.topology, "topology")  # type: ignore[no-any-return]

    @property
    def master_address(self) -> str:
        """As ``pccl_trio.Communicator.master_address``."""
        return self._read(  # type: ignore[no-any-return]
            lambda: self._comm.master_address, "master_address"
        )

    @property
    def hosting_master(self) -> bool:
        """As ``pccl_trio.Communicator.hosting_master``."""
        return self._read(  # type: ignore[no-any-return]
            lambda: self._comm.hosting_master, "hosting_master"
        )

    def statistics(self) -> CommunicatorStatistics:
        """As ``pccl_trio.Communicator.statistics``."""
        return self._read(self._comm.statistics, "statistics()")  # type: ignore[no-any-return]

    def get_attribute(self, attribute: Attribute) -> int:
        """As ``pccl_trio.Communicator.get_attribute``."""
        return self._read(  # type: ignore[no-any-return]
            lambda: self._comm.get_attribute(attribute), "get_attribute()"
        )

    # --- lifecycle ----------------------------------------------------------------------

    def connect(self) -> None:
        """Start this communicator's event loop and connect in it (as
        ``pccl_trio.Communicator.connect``); the loop ends again if connecting fails."""
        with self._starting:
            starts = not self._started
            self._started = True
            if starts:
                self._loop.start()
        if not starts:
            if self._loop.running:  # the async communicator refuses: it is connected
                self._loop.call(self._comm.connect, what="connect()")
            raise InvalidUsage(
                "connect() on a communicator that is closed; create a new Communicator to "
                "join again"
            )
        try:
            self._loop.call(self._comm.connect, what="connect()")
        except BaseException:
            self._loop.stop()
            raise

    def close(self) -> None:
        """Leave the run (as ``pccl_trio.Communicator.aclose``) and end the event loop;
        calls blocked in other threads end with the error the async call raises when
        its communicator closes. Safe to call more than once."""
        if not self._loop.running:
            self._loop.stop()
            return
        try:
            self._loop.call(self._comm.aclose, what="close()")
        finally:
            self._loop.stop()

    def replacement(self) -> Communicator:
        """A new blocking communicator made with this one's arguments (not connected),
        as ``pccl_trio.Communicator.replacement``."""
        replaced = object.__new__(Communicator)
        replaced._comm = self._comm.replacement()
        replaced._setup_loop()
        return replaced

    def call_in_loop(self, afn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """Block while ``await afn(comm, *args)`` runs in this communicator's event
        loop, where ``comm`` is the ``pccl_trio.Communicator`` it drives; its value, or
        its exception raised here. The way to run code written for the async API over
        a blocking communicator (``pccl_trio.torch``'s wrappers do): ``afn`` may make
        any async call on ``comm`` and start tasks that outlive it (an
        ``all_reduce_async`` whose handle a later ``call_in_loop`` waits on).

        Raises:
            InvalidUsage: called inside a Trio run or on the loop's thread, or the
                communicator is not connected.
        """
        name = getattr(afn, "__qualname__", "a function")
        return self._loop.call(afn, self._comm, *args, what=f"call_in_loop({name})")

    def __enter__(self) -> Communicator:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pccl_trio.sync.Communicator {self._read(self._comm.__repr__, 'repr()')}>"

    # --- membership ---------------------------------------------------------------------

    def update_topology(self) -> None:
        """As ``pccl_trio.Communicator.update_topology``, blocking."""
        self._loop.call(self._comm.update_topology, what="update_topology()")

    def wait_for_peers(self, n: int, *, timeout: float) -> None:
        """As ``pccl_trio.Communicator.wait_for_peers``, blocking."""
        self._loop.call(
            lambda: self._comm.wait_for_peers(n, timeout=timeout), what="wait_for_peers()"
        )

    def optimize_topology(self) -> None:
        """As ``pccl_trio.Communicator.optimize_topology``, blocking."""
        self._loop.call(self._comm.optimize_topology, what="optimize_topology()")

    def sync_shared_state(
        self,
        state: Any,
        strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
    ) -> SharedStateSyncInfo:
        """As ``pccl_trio.Communicator.sync_shared_state``, blocking."""
        return self._loop.call(
            self._comm.sync_shared_state, state, strategy, what="sync_shared_state()"
        )

    def are_peers_pending(self, *, wait: float = 0.0) -> bool:
        """As ``pccl_trio.Communicator.are_peers_pending``, blocking."""
        return self._loop.call(
            lambda: self._comm.are_peers_pending(wait=wait), what="are_peers_pending()"
        )

    # --- collectives ----------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        compression: TopK | None = None,
    ) -> ReduceInfo:
        """As ``pccl_trio.Communicator.all_reduce``, blocking."""
        return self._loop.call(
            lambda: self._comm.all_reduce(
                tensor, recv, op=op, tag=tag, quantization=quantization,
                distribution_hint=distribution_hint, compression=compression,
            ),
            what="all_reduce()",
        )

    def all_reduce_async(
        self,
        tensor: Any,
        recv: Any = None,
        *,
        op: ReduceOp = ReduceOp.SUM,
        tag: int = 0,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        compression: TopK | None = None,
    ) -> Handle[ReduceInfo]:
        """As ``pccl_trio.Communicator.all_reduce_async``: the all-reduce runs in the
        loop; the handle's ``wait()`` blocks for its ``ReduceInfo``."""
        running = self._loop.call_sync(
            lambda: self._comm.all_reduce_async(
                tensor, recv, op=op, tag=tag, quantization=quantization,
                distribution_hint=distribution_hint, compression=compression,
            ),
            what="all_reduce_async()",
        )
        return Handle(self._loop, running, "all_reduce_async()")

    def barrier(self, *, tag: int = 0) -> None:
        """As ``pccl_trio.Communicator.barrier``, blocking."""
        self._loop.call(lambda: self._comm.barrier(tag=tag), what="barrier()")

    def barrier_async(self, *, tag: int = 0) -> Handle[ReduceInfo]:
        """As ``pccl_trio.Communicator.barrier_async`` (see ``all_reduce_async``)."""
        running = self._loop.call_sync(
            lambda: self._comm.barrier_async(tag=tag), what="barrier_async()"
        )
        return Handle(self._loop, running, "barrier_async()")

    def broadcast(self, tensor: Any, *, root: int, tag: int = 0) -> ReduceInfo:
        """As ``pccl_trio.Communicator.broadcast``, blocking."""
        return self._loop.call(
            lambda: self._comm.broadcast(tensor, root=root, tag=tag), what="broadcast()"
        )

    def broadcast_async(self, tensor: Any, *, root: int, tag: int = 0) -> Handle[ReduceInfo]:
        """As ``pccl_trio.Communicator.broadcast_async`` (see ``all_reduce_async``)."""
        running = self._loop.call_sync(
            lambda: self._comm.broadcast_async(tensor, root=root, tag=tag),
            what="broadcast_async()",
        )
        return Handle(self._loop, running, "broadcast_async()")

    def reduce_scatter(self, send: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0) -> Shard:
        """As ``pccl_trio.Communicator.reduce_scatter``, blocking."""
        return self._loop.call(
            lambda: self._comm.reduce_scatter(send, op=op, tag=tag), what="reduce_scatter()"
        )

    def reduce_scatter_async(
        self, send: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0
    ) -> Handle[Shard]:
        """As ``pccl_trio.Communicator.reduce_scatter_async``: ``wait()`` returns the
        ``Shard``."""
        running = self._loop.call_sync(
            lambda: self._comm.reduce_scatter_async(send, op=op, tag=tag),
            what="reduce_scatter_async()",
        )
        return Handle(self._loop, running, "reduce_scatter_async()")

    def all_gather(self, send: Any, *, tag: int = 0) -> dict[int, Any]:
        """As ``pccl_trio.Communicator.all_gather``, blocking."""
        return self._loop.call(
            lambda: self._comm.all_gather(send, tag=tag), what="all_gather()"
        )

    def all_gather_async(self, send: Any, *, tag: int = 0) -> Handle[dict[int, Any]]:
        """As ``pccl_trio.Communicator.all_gather_async``: ``wait()`` returns every
        peer's part by peer id."""
        running = self._loop.call_sync(
            lambda: self._comm.all_gather_async(send, tag=tag), what="all_gather_async()"
        )
        return Handle(self._loop, running, "all_gather_async()")

    def all_reduce_multiple_with_retry(
        self,
        tensors: Sequence[Any],
        *,
        op: ReduceOp = ReduceOp.SUM,
        quantization: QuantizationOptions | None = None,
        distribution_hint: DistributionHint = DistributionHint.NONE,
        max_in_flight: int = 16,
        compression: TopK | None = None,
    ) -> ReduceInfo:
        """As ``pccl_trio.Communicator.all_reduce_multiple_with_retry``, blocking."""
        return self._loop.call(
            lambda: self._comm.all_reduce_multiple_with_retry(
                tensors, op=op, quantization=quantization, distribution_hint=distribution_hint,
                max_in_flight=max_in_flight, compression=compression,
            ),
            what="all_reduce_multiple_with_retry()",
        )
