"""A trio stream that speaks frames: the shell around ``_core.wire``."""

from __future__ import annotations

import trio

from .._core.errors import RemoteProtocolError
from .._core.messages import Message
from .._core.wire import DataFrame, DecoderState, FrameDecoder, encode_control

__all__ = ["FramedStream"]

RECEIVE_SIZE = 1 << 16


class FramedStream:
    """Send and receive whole frames over a ``trio.abc.Stream``.

    Sends are serialized by a lock so frames never interleave. A send that fails or is
    cancelled may have written part of a frame, so the stream is closed at once: the
    connection is never reused with a torn frame in it.
    """

    def __init__(
        self, stream: trio.abc.Stream, *, max_control_frame: int, max_data_frame: int = 0
    ) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(
            max_control_frame=max_control_frame, max_data_frame=max_data_frame
        )
        self._send_lock = trio.StrictFIFOLock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_message(self, message: Message) -> None:
        await self.send_bytes(encode_control(message))

    async def send_bytes(self, frame: bytes | bytearray | memoryview) -> None:
        """Send one or more complete encoded frames."""
        async with self._send_lock:
            if self._closed:
                raise trio.ClosedResourceError("framed stream was closed")
            try:
                await self.stream.send_all(frame)
            except BaseException:
                await self.aclose()
                raise

    async def receive(self) -> Message | DataFrame:
        """The next frame.

        Raises:
            trio.BrokenResourceError: the other side closed the connection or broke it.
            RemoteProtocolError: the other side sent bytes that are not valid frames.
        """
        while True:
            frame = self._decoder.next_frame()
            if frame is DecoderState.CLOSED:
                raise trio.BrokenResourceError("connection closed by the other side")
            if frame is not DecoderState.NEED_DATA:
                assert not isinstance(frame, DecoderState)
                return frame
            data = await self.stream.receive_some(RECEIVE_SIZE)
            self._decoder.receive_data(data)

    async def receive_message(self) -> Message:
        """The next frame, which must be a control message."""
        frame = await self.receive()
        if isinstance(frame, DataFrame):
            raise RemoteProtocolError("data frame where a control message was expected")
        return frame

    async def aclose(self) -> None:
        self._closed = True
        await trio.aclose_forcefully(self.stream)
