"""Frame codec: length-prefixed frames that survive any split of bytes across reads.

Theory of operation
-------------------
Every frame is ``[u32 body_length BE][body]``. The body starts with a one-byte frame
type:

* ``CONTROL`` (1): ``[u8 1][u16 kind BE][msgpack fields]``, a control message (see
  ``messages``), at most ``max_control_frame`` bytes of body.
* ``DATA`` (2): ``[u8 2][u64 tag][u64 seq][u64 offset][u32 nbytes][payload]``, tensor
  bytes that are never re-encoded: ``tag`` names the collective, ``seq`` the
  master-assigned sequence number of the attempt (stale frames are dropped by it),
  ``offset`` the byte offset of the payload in the receiver's buffer and ``nbytes``
  its length (which must equal the rest of the body). At most ``max_data_frame``
  bytes of body.

On a connection protected by a run secret (``channel.Channel``), every body ends with a
``TAG_SIZE``-byte authentication tag that its length counts: a control frame's fields
are sealed (encrypted and tagged, bound to its 7-byte prefix), a data frame's payload
is followed by the tag over its header and payload (or, with ``encrypt_data``, the
payload is encrypted too). Admission limits still count the fields alone.

The decoder is sans-IO (as h11's ``Connection``): feed it whatever bytes arrived with
``receive_data`` (``b""`` for end of stream), then call ``next_frame`` until it says
``NEED_DATA``. It keeps state across calls, so a length prefix or header split at any
byte is fine. Violations (zero or oversized lengths, an unknown frame type, a bad
message, end of stream inside a frame) raise ``RemoteProtocolError``; after one, the
decoder is poisoned and the connection must be dropped.

What a reader accepts is decided from a frame's header, before its body is read or
decoded: an ``Admission`` names the control kinds accepted as a connection's first
frame and afterwards, each with its largest body (``messages.body_limits``), so a
stranger's first frame can only be a small one of the expected kind. Readers that take
one frame at a time grow their buffer with the bytes that
arrive, never from a length they have not read yet (``parse_control_length``, then
``parse_control_kind``).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Mapping

from .channel import MAGIC, TAG_SIZE, Channel
from .errors import LocalProtocolError, RemoteProtocolError
from .messages import Message, decode_message, encode_message, message_kinds

__all__ = [
    "CONTROL_HEADER_SIZE",
    "DATA_HEADER",
    "LENGTH_SIZE",
    "Admission",
    "DataFrame",
    "DataFrameReader",
    "DecoderState",
    "FrameDecoder",
    "FrameType",
    "Undecoded",
    "encode_control",
    "encode_data",
    "encode_data_header",
    "max_payload",
    "open_control",
    "parse_control_kind",
    "parse_control_length",
    "parse_data_header",
]


class FrameType(enum.IntEnum):
    CONTROL = 1
    DATA = 2


#: What a plain decoder reads as a frame's length when the other side opens with the
#: run-secret handshake (its magic bytes).
_HANDSHAKE_AS_LENGTH = int.from_bytes(MAGIC, "big")


class DecoderState(enum.Enum):
    NEED_DATA = enum.auto()
    CLOSED = enum.auto()


_LENGTH = struct.Struct(">I")
_CONTROL_HEADER = struct.Struct(">BH")
#: Header of a data frame, including its length prefix.
DATA_HEADER = struct.Struct(">IBQQQI")
_DATA_BODY_HEADER = DATA_HEADER.size - _LENGTH.size


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Undecoded:
    """A control frame whose message the reader decodes itself (``decode``), e.g. in a
    worker thread when validating it may take a while."""

    kind: int
    fields: bytes

    def decode(self) -> Message:
        """The message; raises ``RemoteProtocolError`` as ``decode_message`` does."""
        return decode_message(self.kind, self.fields)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataFrame:
    tag: int
    seq: int
    offset: int
    payload: bytes


def encode_control(message: Message, channel: Channel | None = None) -> bytes:
    """One complete control frame for ``message``, sealed by ``channel`` if given (which
    then counts it as sent: frames must go out in the order they were encoded)."""
    fields = encode_message(message)
    if channel is None:
        return _CONTROL_PREFIX.pack(
            _CONTROL_HEADER.size + len(fields), FrameType.CONTROL, message.KIND
        ) + fields
    header = _CONTROL_PREFIX.pack(
        _CONTROL_HEADER.size + len(fields) + TAG_SIZE, FrameType.CONTROL, message.KIND
    )
    return header + channel.seal_control(header, fields)


def open_control(
    prefix: bytes | bytearray | memoryview, sealed: bytes | bytearray | memoryview,
    channel: Channel,
) -> bytes:
    """The fields of a sealed control frame, from its 7-byte prefix (length, type and
    kind) and the rest of its body.

    Raises:
        RemoteProtocolError: forged, altered, replayed or reordered.
    """
    return channel.open_control(bytes(prefix), sealed)


def encode_data_header(*, tag: int, seq: int, offset: int, nbytes: int, trailer: int = 0) -> bytes:
    """The header of a data frame whose ``nbytes`` payload (and ``trailer`` bytes of
    authentication tag) the caller sends right after.

    Sending header and payload separately keeps tensor bytes zero-copy.
    """
    if nbytes < 0 or nbytes > 0xFFFFFFFF - _DATA_BODY_HEADER - trailer:
        raise LocalProtocolError(f"data payload of {nbytes} bytes does not fit in one frame")
    return DATA_HEADER.pack(
        _DATA_BODY_HEADER + nbytes + trailer, FrameType.DATA, tag, seq, offset, nbytes
    )


def max_payload(max_data_frame: int) -> int:
    """The largest payload a data frame may carry under a ``max_data_frame`` limit
    (whether or not the connection adds an authentication tag)."""
    return max_data_frame - _DATA_BODY_HEADER - TAG_SIZE


def encode_data(*, tag: int, seq: int, offset: int, payload: bytes | memoryview) -> bytes:
    """One complete data frame (a copy; the hot path sends header and payload apart)."""
    header = encode_data_header(tag=tag, seq=seq, offset=offset, nbytes=len(payload))
    return header + bytes(payload)


def parse_data_header(
    header: bytes | bytearray | memoryview, *, max_data_frame: int, trailer: int = 0
) -> tuple[int, int, int, int]:
    """``(tag, seq, offset, nbytes)`` of a data frame from its ``DATA_HEADER.size`` bytes
    (its body followed by ``trailer`` bytes of authentication tag).

    For readers that receive payloads straight into their own buffers.

    Raises:
        RemoteProtocolError: not a data frame, inconsistent lengths, or too large.
    """
    (body_length, frame_type, tag, seq, offset, nbytes) = DATA_HEADER.unpack(header)
    if frame_type != FrameType.DATA:
        raise RemoteProtocolError(f"expected a data frame, got frame type {frame_type}")
    if body_length != _DATA_BODY_HEADER + nbytes + trailer:
        raise RemoteProtocolError(
            f"data frame declares {nbytes} payload bytes in a {body_length}-byte body"
        )
    if body_length > max_data_frame:
        raise RemoteProtocolError(
            f"data frame of {body_length} bytes exceeds the {max_data_frame}-byte limit"
        )
    return tag, seq, offset, nbytes


#: Bytes of the length prefix every frame starts with.
LENGTH_SIZE = _LENGTH.size
#: Bytes of a control frame's header after the length prefix (frame type and kind).
CONTROL_HEADER_SIZE = _CONTROL_HEADER.size
# The start of a control frame: its length prefix, frame type and message kind.
_CONTROL_PREFIX = struct.Struct(">IBH")


class Admission:
    """Which control messages a connection accepts: ``first`` (``{kind: largest body}``)
    for its first control frame, ``then`` for every later one.

    Stateful (it counts the frames it judged): one per connection and direction.
    """

    def __init__(self, then: Mapping[int, int], first: Mapping[int, int] | None = None) -> None:
        self._then = then
        self._first = then if first is None else first
        self._judged = 0

    def check(self, kind: int, body_length: int) -> None:
        """Judge the next control frame from its header.

        Raises:
            RemoteProtocolError: a kind not accepted here (now), or too large for it.
        """
        first = self._judged == 0
        self._judged += 1
        limit = (self._first if first else self._then).get(kind)
        if limit is not None and body_length <= limit:
            return
        known = message_kinds().get(kind)
        name = known.__name__ if known is not None else f"message kind {kind}"
        if limit is None:
            where = "as the first message on this connection" if first else "on this connection"
            raise RemoteProtocolError(f"{name} is not accepted {where}")
        if body_length > limit:
            raise RemoteProtocolError(
                f"{name} of {body_length} bytes exceeds its {limit}-byte limit"
            )


def parse_control_length(prefix: bytes | bytearray | memoryview, *, max_control_frame: int) -> int:
    """The body length of a control frame from its ``LENGTH_SIZE``-byte prefix, for
    readers that take one frame at a time without reading past it.

    Raises:
        RemoteProtocolError: the length is impossible for a control frame.
    """
    body_length: int = _LENGTH.unpack(prefix)[0]
    if not _CONTROL_HEADER.size <= body_length <= max_control_frame:
        raise RemoteProtocolError(
            f"control frame of {body_length} bytes (expected {_CONTROL_HEADER.size} to "
            f"{max_control_frame})"
        )
    return body_length


def parse_control_kind(
    header: bytes | bytearray | memoryview, body_length: int, admission: Admission | None,
    *, trailer: int = 0,
) -> int:
    """The message kind from the ``CONTROL_HEADER_SIZE`` bytes after the length prefix
    (frame type and kind), judged by ``admission`` given the frame's ``body_length``
    (of which ``trailer`` bytes are its authentication tag).

    Raises:
        RemoteProtocolError: not a control frame, or refused by ``admission``.
    """
    (frame_type, kind) = _CONTROL_HEADER.unpack(header)
    if frame_type != FrameType.CONTROL:
        raise RemoteProtocolError(f"expected a control frame, got frame type {frame_type}")
    if body_length < _CONTROL_HEADER.size + trailer:
        raise RemoteProtocolError(f"control frame of {body_length} bytes is too short")
    if admission is not None:
        admission.check(kind, body_length - trailer)
    return kind  # type: ignore[no-any-return]


class DataFrameReader:
    """The data frames of a reader that receives each payload straight into its place
    (``FramedStream``, ``SocketLink``): its header, then its payload, then (with a
    channel) the tag that must hold before the payload is used.

    Args:
        max_data_frame: largest data-frame body accepted, tag not counted.
        channel: the connection's protection (None: plain frames).
    """

    def __init__(self, *, max_data_frame: int, channel: Channel | None) -> None:
        self.channel = channel
        #: Bytes of authentication tag after each payload.
        self.trailer = 0 if channel is None else TAG_SIZE
        self._max = max_data_frame + self.trailer
        self._header = bytearray(DATA_HEADER.size)
        self._payload = 0  # bytes of the frame whose header was read, still to come

    def header_buffer(self) -> memoryview:
        """Where the next frame's header goes.

        Raises:
            RemoteProtocolError: the last frame's payload was not received.
        """
        if self._payload:
            raise RemoteProtocolError("a data frame's payload was not received")
        return memoryview(self._header)

    def parse_header(self) -> tuple[int, int, int, int]:
        """``(tag, seq, offset, nbytes)`` of the header just received."""
        header = parse_data_header(self._header, max_data_frame=self._max, trailer=self.trailer)
        self._payload = header[3]
        return header

    def payload_buffer(self, view: memoryview) -> memoryview:
        """``view`` as bytes, where the payload goes (exactly as long).

        Raises:
            RemoteProtocolError: ``view`` is not as long as the payload.
        """
        if view.itemsize != 1:
            view = view.cast("B")
        if len(view) != self._payload:
            raise RemoteProtocolError(
                f"a {self._payload}-byte payload cannot be received into {len(view)} bytes"
            )
        self._payload = 0
        return view

    def accept(self, payload: memoryview, tag: bytes | bytearray) -> None:
        """Check a received payload against its tag (decrypting it with encryption).

        Raises:
            RemoteProtocolError: it fails (``payload`` must not be used).
        """
        assert self.channel is not None
        self.channel.accept_data(bytes(self._header), payload, tag)


class FrameDecoder:
    """Incremental decoder for one direction of one connection.

    Args:
        max_control_frame: largest control-frame body accepted, in bytes.
        max_data_frame: largest data-frame body accepted, in bytes; 0 refuses data
            frames altogether (the master link carries none).
        admission: which control kinds are accepted, judged once per frame as soon
            as its header is in (None: any kind up to ``max_control_frame``).
        decode: False returns control frames as ``Undecoded``.
        channel: the connection's protection after a run-secret handshake (None: the
            frames are plain). Every frame is checked, in order, as it is returned.
    """

    def __init__(
        self, *, max_control_frame: int, max_data_frame: int = 0,
        admission: Admission | None = None, decode: bool = True,
        channel: Channel | None = None,
    ) -> None:
        self._decode = decode
        self._channel = channel
        self._trailer = 0 if channel is None else TAG_SIZE
        self._max_control = max_control_frame + self._trailer
        self._max_data = max_data_frame and max_data_frame + self._trailer
        self._admission = admission
        self._judged = -1  # the buffer offset of the last frame the admission judged
        self._buffer = bytearray()
        self._start = 0
        self._eof = False
        self._broken: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buffer) - self._start

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; ``b""`` marks the end of the stream."""
        if self._eof:
            raise LocalProtocolError("receive_data after end of stream")
        if not data:
            self._eof = True
            return
        if self._start and self._start * 2 >= len(self._buffer):
            del self._buffer[: self._start]
            if self._judged >= 0:
                self._judged -= self._start
            self._start = 0
        self._buffer += data

    def next_frame(self) -> Message | Undecoded | DataFrame | DecoderState:
        """The next complete frame, ``NEED_DATA``, or ``CLOSED`` after a clean end.

        Raises:
            RemoteProtocolError: the bytes are not a valid frame stream.
        """
        if self._broken is not None:
            raise self._broken
        try:
            return self._next_frame()
        except RemoteProtocolError as exc:
            self._broken = exc
            raise

    def _next_frame(self) -> Message | Undecoded | DataFrame | DecoderState:
        available = len(self._buffer) - self._start
        if available >= _LENGTH.size:
            (body_length,) = _LENGTH.unpack_from(self._buffer, self._start)
            self._check_length(body_length)
            if available >= _LENGTH.size + 1:
                self._check_type(body_length, self._buffer[self._start + _LENGTH.size])
            if (
                self._admission is not None
                and available >= _CONTROL_PREFIX.size
                and self._judged != self._start
                and self._buffer[self._start + _LENGTH.size] == FrameType.CONTROL
            ):
                self._judged = self._start
                (_length, _type, kind) = _CONTROL_PREFIX.unpack_from(self._buffer, self._start)
                self._admission.check(kind, body_length - self._trailer)
            if available >= _LENGTH.size + body_length:
                body_start = self._start + _LENGTH.size
                self._start = body_start + body_length
                self._judged = -1
                frame = memoryview(self._buffer)[body_start - _LENGTH.size : self._start]
                try:
                    return self._decode_body(frame)
                finally:
                    frame.release()
        if self._eof:
            if available:
                raise RemoteProtocolError(
                    f"connection closed inside a frame ({available} bytes of it received)"
                )
            return DecoderState.CLOSED
        return DecoderState.NEED_DATA

    def _check_length(self, body_length: int) -> None:
        if body_length == 0:
            raise RemoteProtocolError("frame with an empty body")
        limit = max(self._max_control, self._max_data)
        if body_length > limit:
            if self._channel is None and body_length == _HANDSHAKE_AS_LENGTH:
                raise RemoteProtocolError(
                    "the other side speaks the run-secret handshake, and this side has no "
                    "run secret: give both sides the same secret, or neither"
                )
            raise RemoteProtocolError(
                f"frame of {body_length} bytes exceeds the {limit}-byte limit"
            )

    def _check_type(self, body_length: int, frame_type: int) -> None:
        if frame_type == FrameType.CONTROL:
            if body_length > self._max_control:
                raise RemoteProtocolError(
                    f"control frame of {body_length} bytes exceeds the "
                    f"{self._max_control}-byte limit"
                )
            if body_length < _CONTROL_HEADER.size + self._trailer:
                raise RemoteProtocolError(f"control frame of {body_length} bytes is too short")
        elif frame_type == FrameType.DATA:
            if self._max_data == 0:
                raise RemoteProtocolError("data frame on a connection that carries none")
            if body_length > self._max_data:
                raise RemoteProtocolError(
                    f"data frame of {body_length} bytes exceeds the {self._max_data}-byte limit"
                )
            if body_length < _DATA_BODY_HEADER + self._trailer:
                raise RemoteProtocolError(f"data frame of {body_length} bytes is too short")
        else:
            raise RemoteProtocolError(f"unknown frame type {frame_type}")

    def _decode_body(self, frame: memoryview) -> Message | Undecoded | DataFrame:
        """The frame in ``frame`` (its length prefix and body), checked by the channel."""
        body = frame[_LENGTH.size :]
        if body[0] == FrameType.CONTROL:
            (_type, kind) = _CONTROL_HEADER.unpack_from(body)
            fields = body[_CONTROL_HEADER.size :]
            if self._channel is None:
                undecoded = Undecoded(kind=kind, fields=bytes(fields))
            else:
                prefix = frame[: _CONTROL_PREFIX.size]
                undecoded = Undecoded(kind=kind, fields=open_control(prefix, fields, self._channel))
            return undecoded.decode() if self._decode else undecoded
        (_type, tag, seq, offset, nbytes) = struct.unpack_from(">BQQQI", body)
        end = len(body) - self._trailer
        if nbytes != end - _DATA_BODY_HEADER:
            raise RemoteProtocolError(
                f"data frame declares {nbytes} payload bytes but carries "
                f"{end - _DATA_BODY_HEADER}"
            )
        payload = body[_DATA_BODY_HEADER:end]
        if self._channel is None:
            return DataFrame(tag=tag, seq=seq, offset=offset, payload=bytes(payload))
        received = bytearray(payload)
        self._channel.accept_data(bytes(frame[: DATA_HEADER.size]), memoryview(received), body[end:])
        return DataFrame(tag=tag, seq=seq, offset=offset, payload=bytes(received))
