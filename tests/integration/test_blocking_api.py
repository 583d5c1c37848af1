"""``pccl_trio.sync.Communicator`` as a synchronous program uses it: which threads may
call it, calls from several threads at once, ``close()`` from another thread ending a
blocked call, ``KeyboardInterrupt`` cancelling one, and its life from construction to
close. The integration scenarios run against it as the ``sync`` network kind
(``blocking.BlockingPeer``); these are what only a synchronous caller can do.

These tests are plain functions: the program's threads are the callers, a master runs
on a thread of its own over loopback TCP.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio

import pccl_trio as pccl
import pccl_trio.sync
from pccl_trio.testing import PeerSeam

from .conftest import TCP_CONFIG

#: Long enough for a loaded machine; a test that reaches it has hung.
PATIENCE = 60.0


@pytest.fixture
def master() -> Iterator[str]:
    """A master on 127.0.0.1, in a trio run on a thread of its own: its address."""
    ready: list[Any] = []
    started = threading.Event()

    async def serve() -> None:
        stop = trio.Event()
        ready.append((trio.lowlevel.current_trio_token(), stop))
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(
                lambda task_status: pccl.serve_master_tcp(
                    0, "127.0.0.1", config=TCP_CONFIG, task_status=task_status
                )
            )
            ready.append(f"{host}:{port}")
            started.set()
            await stop.wait()
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert started.wait(PATIENCE)
    yield ready[1]
    token, stop = ready[0]
    token.run_sync_soon(stop.set)
    thread.join(PATIENCE)


def peer(master: str) -> pccl_trio.sync.Communicator:
    return pccl_trio.sync.Communicator(master, config=TCP_CONFIG, p2p_host="127.0.0.1")


def in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call on a thread of its own, at once: their results or exceptions."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
        assert not thread.is_alive(), "a call never returned"
    return results


def run_of(master: str, world: int) -> list[pccl_trio.sync.Communicator]:
    """``world`` connected peers of one run, each from a thread of its own."""
    comms = [peer(master) for _ in range(world)]

    def join(comm: pccl_trio.sync.Communicator) -> None:
        comm.connect()
        while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
            comm.update_topology()

    errors = in_threads(*(lambda c=c: join(c) for c in comms))
    assert errors == [None] * world, errors
    return comms


def close_all(comms: list[pccl_trio.sync.Communicator]) -> None:
    assert in_threads(*(c.close for c in comms)) == [None] * len(comms)


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pccl_trio communicator")]


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a look at a communicator's state) until it holds."""
    done = threading.Event()
    for _ in range(int(PATIENCE * 1000)):
        if condition():
            return
        done.wait(0.001)
    raise AssertionError("the condition never held")


def test_its_life_from_construction_to_close(master: str) -> None:
    before = len(loop_threads())
    comm = peer(master)
    with pytest.raises(pccl.InvalidUsage, match=r"new; call connect\(\) first"):
        comm.update_topology()
    with pytest.raises(pccl.InvalidArgument):
        pccl_trio.sync.Communicator("no-port-here")
    assert comm.peer_id is None and len(loop_threads()) == before  # no loop before connect
    with comm:
        assert comm.peer_id is not None and comm.ring == (comm.peer_id,)
        assert len(loop_threads()) == before + 1
        with pytest.raises(pccl.InvalidUsage, match="connect"):
            comm.connect()
        data = np.arange(10, dtype=np.float32)
        with pytest.raises(pccl.TooFewPeers, match="at least 2 peers"):  # the async error
            comm.all_reduce(data)
    assert len(loop_threads()) == before  # close() ended the loop's thread
    comm.close()  # idempotent
    with pytest.raises(pccl.InvalidUsage, match="closed; create a new Communicator"):
        comm.all_reduce(data)
    with pytest.raises(pccl.InvalidUsage, match="closed"):
        comm.connect()


def test_a_failed_connect_raises_the_async_error_and_ends_the_loop() -> None:
    before = len(loop_threads())
    comm = pccl_trio.sync.Communicator("127.0.0.1:1", config=TCP_CONFIG, p2p_host="127.0.0.1")
    with pytest.raises(pccl.MasterConnectionError, match="could not reach the master"):
        comm.connect()
    assert len(loop_threads()) == before
    with pytest.raises(pccl.InvalidUsage):
        comm.connect()


def test_a_blocking_call_inside_a_trio_run_is_refused_saying_what_to_use(master: str) -> None:
    with peer(master) as comm:
        async def trio_program() -> int | None:
            with pytest.raises(pccl.InvalidUsage, match="inside a Trio run.*async"):
                comm.are_peers_pending()
            return comm.peer_id  # a read is not a blocking call

        assert trio.run(trio_program) == comm.peer_id
        # From a worker thread of that run, as the refusal says, it works.
        async def through_a_thread() -> None:
            assert not await trio.to_thread.run_sync(comm.are_peers_pending)

        trio.run(through_a_thread)


def test_a_call_on_the_loops_own_thread_is_refused(master: str) -> None:
    with peer(master) as comm:
        with pytest.raises(pccl.InvalidUsage, match="own event loop thread"):
            comm._loop.call_sync(comm.are_peers_pending, what="a callback")
        assert not comm.are_peers_pending()  # the communicator is unharmed


def test_calls_from_several_threads_run_concurrently(master: str) -> None:
    comms = run_of(master, 2)
    count = 100_000
    data = {(i, tag): np.full(count, float(i + 1 + 10 * tag), np.float32)
            for i in range(2) for tag in (1, 2)}
    # Each peer all-reduces two tags at once, from two threads of its own.
    results = in_threads(*(
        lambda i=i, tag=tag: comms[i].all_reduce(data[i, tag], tag=tag)
        for i in range(2) for tag in (1, 2)
    ))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    for tag in (1, 2):
        want = float(1 + 10 * tag) + float(2 + 10 * tag)
        assert all(bool((data[i, tag] == want).all()) for i in range(2))
    close_all(comms)


def test_close_from_another_thread_ends_a_blocked_call(master: str) -> None:
    comms = run_of(master, 2)
    blocked, other = comms
    data = np.arange(50_000, dtype=np.float32)
    original = data.copy()
    outcome: list[Any] = []
    # The other peer never calls: the all-reduce waits for it in the master.
    caller = threading.Thread(target=lambda: outcome.append(in_threads(
        lambda: blocked.all_reduce(data, tag=3))[0]))
    caller.start()
    wait_until(lambda: PeerSeam(blocked._comm).attempt(3) is not None)
    blocked.close()
    caller.join(PATIENCE)
    assert not caller.is_alive()
    (error,) = outcome
    assert isinstance(error, pccl.PCCLError), error
    assert data.tobytes() == original.tobytes()  # never written
    other.update_topology()  # the run goes on without it
    assert other.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
    other.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT reaches the main thread only")
def test_keyboard_interrupt_cancels_the_blocked_call_before_it_goes_on(master: str) -> None:
    comms = run_of(master, 2)
    interrupted, other = comms
    data = np.arange(50_000, dtype=np.float32)
    original = data.copy()
    main = threading.main_thread().ident
    assert main is not None
    # Python's own handler, whatever the suite inherited (a shell starts a command it
    # runs in the background with SIGINT ignored, and Python then leaves it so).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    helper_failed: list[BaseException] = []

    def interrupt_once_voted() -> None:
        try:
            wait_until(lambda: PeerSeam(interrupted._comm).attempt(4) is not None)
        except BaseException as exc:  # reported below; the main thread is let go anyway
            helper_failed.append(exc)
        signal.pthread_kill(main, signal.SIGINT)

    helper = threading.Thread(target=interrupt_once_voted)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted.all_reduce(data, tag=4)  # the other peer has not called
    finally:
        signal.signal(signal.SIGINT, previous)
    helper.join(PATIENCE)
    assert helper_failed == []
    # Cancelled before the commence: nothing was written, and nothing writes now.
    assert data.tobytes() == original.tobytes()
    # The call winds down (it voted; the other's call then aborts or runs with it);
    # a retry of both is exact.
    buffers = [data, np.ones(50_000, np.float32)]

    def reduce_until_done(i: int) -> pccl.ReduceInfo:
        inputs = buffers[i].copy()
        while True:
            try:
                return comms[i].all_reduce(buffers[i], tag=4)
            except pccl.CollectiveAborted:
                assert buffers[i].tobytes() == inputs.tobytes()  # restored

    results = in_threads(lambda: reduce_until_done(0), lambda: reduce_until_done(1))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    assert bool((buffers[0] == original + 1).all()) and buffers[1].tobytes() == buffers[0].tobytes()
    close_all(comms)


def test_an_async_handle_waits_and_says_when_it_is_done(master: str) -> None:
    comms = run_of(master, 2)
    data = [np.full(1000, float(i + 1), np.float32) for i in range(2)]
    handles = [c.all_reduce_async(d, tag=5) for c, d in zip(comms, data, strict=True)]
    assert all(h.tag == 5 for h in handles)
    infos = [h.wait() for h in handles]
    assert all(h.done() for h in handles)
    assert all(i.world_size == 2 for i in infos) and all(bool((d == 3).all()) for d in data)
    assert handles[0].wait() is infos[0] or handles[0].wait() == infos[0]  # awaitable again
    close_all(comms)


def test_peers_made_inside_a_trio_run_serve_its_worker_threads(master: str) -> None:
    """Made under ``trio.run`` (to be called from its worker threads), communicators
    run their data path in their own loops and outlive that run. (Their parts' wake-ups
    belong to the run that waits on them, not to the one that made them:
    ``test_signal`` tests that; ``test_both_data_path_drivers[trio_tasks-sync]``
    failed every time while they did not.)"""
    config = dataclasses.replace(TCP_CONFIG, threaded_data_path=False, slice_bytes=4096)
    world = 3
    data = [[np.arange(20_000 + tag, dtype=np.float64) * (i + 1) for tag in range(4)]
            for i in range(world)]

    async def program() -> list[pccl_trio.sync.Communicator]:
        comms = [pccl_trio.sync.Communicator(master, 0, 2, config=config, p2p_host="127.0.0.1")
                 for _ in range(world)]

        def join(comm: pccl_trio.sync.Communicator) -> None:
            comm.connect()
            while comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) < world:
                comm.update_topology()

        def reduce(i: int) -> None:
            handles = [comms[i].all_reduce_async(data[i][tag], tag=tag) for tag in range(4)]
            for handle in handles:
                handle.wait()

        async with trio.open_nursery() as nursery:
            for comm in comms:
                nursery.start_soon(trio.to_thread.run_sync, join, comm)
        async with trio.open_nursery() as nursery:
            for i in range(world):
                nursery.start_soon(trio.to_thread.run_sync, reduce, i)
        return comms

    comms = trio.run(program)
    for tag in range(4):
        want = np.arange(20_000 + tag, dtype=np.float64) * 6
        assert all(data[i][tag].tobytes() == want.tobytes() for i in range(world))
    # The run that made them has ended; they go on.
    results = in_threads(*(lambda i=i: comms[i].all_reduce(data[i][0], tag=9) for i in range(world)))
    assert all(isinstance(r, pccl.ReduceInfo) for r in results), results
    close_all(comms)
