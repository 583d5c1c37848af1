"""p2p protocols written once, driven by trio tasks or by a worker thread.

Theory of operation
-------------------
Every protocol a peer speaks on a p2p connection (serving and fetching shared state,
measuring a link, and the all-reduce data path in both directions) is a generator of
*operations*: it yields the IO it needs (:class:`Send`, :class:`SendData`,
:class:`ReceiveMessage`, :class:`ReceiveHeader` and then :class:`ReceivePayload` for a
data frame, whose authentication the connection checks before answering), reads the
clock as an operation (:class:`ReadClock`), and blocks on program state rather than
its connection with :class:`Wait`. A driver answers each operation:

* :func:`drive` in a trio task, on a ``FramedStream`` (streams without a socket of
  their own, e.g. the in-memory network, or TCP with the threaded data path off);
* :func:`drive_blocking` in a worker thread, on a ``SocketLink`` (TCP), where every
  direction of every connection makes progress while the trio thread does other work.

:func:`run_protocol` picks the driver from the connection's form. An operation that
fails raises its error *inside* the protocol, at the ``yield``, so a protocol can
handle the failures it understands (a broken send fails an all-reduce attempt rather
than the task); what it does not handle ends the driver with that error. When the
driver stops for any reason, the generator is closed, so its ``finally`` blocks run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from typing import Any, TypeVar

import trio

from .._core.messages import Message
from ..transport import Connection, FramedStream, SocketLink, run_in_thread

__all__ = [
    "Operation",
    "Protocol",
    "ReadClock",
    "ReceiveHeader",
    "ReceivePayload",
    "ReceiveMessage",
    "Send",
    "SendData",
    "Wait",
    "drive",
    "drive_blocking",
    "run_protocol",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    message: Message


@dataclasses.dataclass(frozen=True, slots=True)
class SendData:
    tag: int
    seq: int
    offset: int
    payload: memoryview


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveMessage:
    """Answered with the next control message (nothing past it is read)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveHeader:
    """Answered with the next data frame's ``(tag, seq, offset, nbytes)``.

    ``beside_sender``: another thread sends on the connection meanwhile, and frames
    come seldom (the notices a ring's successor sends back): a worker thread waits for
    the frame until the socket is readable rather than in ``recv``
    (``SocketLink.receive_data_header``).
    """

    beside_sender: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivePayload:
    """Answered once the payload of the data frame whose header was just received is
    in ``view`` (exactly as long) and passed its authentication."""

    view: memoryview


@dataclasses.dataclass(frozen=True, slots=True)
class ReadClock:
    """Answered with the driver's clock, in seconds: trio's (virtual under a mock clock)
    in trio tasks, the monotonic performance counter in a worker thread."""


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """Block on program state the way the driver can: answered with what ``in_trio()``
    returns in a trio task, or ``in_thread()`` in a worker thread. No idle timeout
    applies (it is not IO)."""

    in_trio: Callable[[], Awaitable[Any]]
    in_thread: Callable[[], Any]


Operation = Send | SendData | ReceiveMessage | ReceiveHeader | ReceivePayload | ReadClock | Wait
Protocol = Generator[Operation, Any, T]


async def run_protocol(
    protocol: Protocol[T],
    connection: Connection,
    *,
    idle_timeout: float | None = None,
    interrupt: Callable[[], None] | None = None,
) -> T:
    """Run ``protocol`` on ``connection`` with the driver its form needs.

    Args:
        idle_timeout: bound on one IO operation that makes no progress (None: none).
        interrupt: how to make a worker thread return when the calling task is
            cancelled (default: cut the connection).
    """
    if isinstance(connection, SocketLink):
        return await run_in_thread(
            partial(drive_blocking, protocol, connection, idle_timeout=idle_timeout),
            interrupt=interrupt or connection.cut,
        )
    return await drive(protocol, connection, idle_timeout=idle_timeout)


async def drive(protocol: Protocol[T], framed: FramedStream, *, idle_timeout: float | None) -> T:
    """Run ``protocol`` on a trio stream.

    Raises:
        trio.TooSlowError: one IO operation made no progress for ``idle_timeout``
            seconds (the other side went silent without closing the connection), unless
            the protocol handled it.
    """
    answer: Any = None
    error: Exception | None = None
    try:
        while True:
            try:
                operation = protocol.send(answer) if error is None else protocol.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            answer, error = None, None
            try:
                match operation:
                    case ReadClock():
                        answer = trio.current_time()
                    case Wait(in_trio=in_trio):
                        answer = await in_trio()
                    case _ if idle_timeout is None:
                        answer = await _perform(operation, framed)
                    case _:
                        with trio.fail_after(idle_timeout):
                            answer = await _perform(operation, framed)
            except Exception as exc:  # the protocol decides; Cancelled is not caught
                error = exc
    finally:
        protocol.close()


async def _perform(operation: Operation, framed: FramedStream) -> Any:
    match operation:
        case Send(message=message):
            await framed.send_message(message)
        case SendData(tag=tag, seq=seq, offset=offset, payload=payload):
            await framed.send_data(tag=tag, seq=seq, offset=offset, payload=payload)
        case ReceiveMessage():
            return await framed.receive_message_exact()
        case ReceiveHeader():
            return await framed.receive_data_header()
        case ReceivePayload(view=view):
            await framed.receive_payload(view)
    return None


def drive_blocking(protocol: Protocol[T], link: SocketLink, *, idle_timeout: float | None) -> T:
    """Run ``protocol`` on a blocking socket (in a worker thread).

    Raises:
        trio.BrokenResourceError: among others, when the socket made no progress for
            ``idle_timeout`` seconds (the other side went silent), unless the protocol
            handled it.
    """
    if idle_timeout is not None:
        link.set_idle_timeout(idle_timeout)
    answer: Any = None
    error: Exception | None = None
    try:
        while True:
            try:
                operation = protocol.send(answer) if error is None else protocol.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            answer, error = None, None
            try:
                match operation:
                    case Send(message=message):
                        link.send_message(message)
                    case SendData(tag=tag, seq=seq, offset=offset, payload=payload):
                        link.send_data(tag=tag, seq=seq, offset=offset, payload=payload)
                    case ReceiveMessage():
                        answer = link.receive_message()
                    case ReceiveHeader(beside_sender=beside_sender):
                        answer = link.receive_data_header(wait_readable=beside_sender)
                    case ReceivePayload(view=view):
                        link.receive_payload(view)
                    case ReadClock():
                        answer = time.perf_counter()
                    case Wait(in_thread=in_thread):
                        answer = in_thread()
            except Exception as exc:  # the protocol decides
                error = exc
    finally:
        protocol.close()
