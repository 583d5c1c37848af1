"""The frame codec: round trips, arbitrary splits, limits, and every way a stream is bad."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl_trio._core.errors import LocalProtocolError, RemoteProtocolError
from pccl_trio._core.messages import Kick, Message, message_kinds
from pccl_trio._core.wire import (
    DATA_HEADER,
    DataFrame,
    DecoderState,
    FrameDecoder,
    FrameType,
    encode_control,
    encode_data,
    encode_data_header,
)

from .support import DETERMINISTIC, SAMPLES

U64_MAX = (1 << 64) - 1
MAX_CONTROL = 256
MAX_DATA = 4096
#: A data frame's body is its header (after the length prefix) plus the payload.
DATA_BODY_HEADER = DATA_HEADER.size - 4

Frame = Message | DataFrame


def encode(frame: Frame) -> bytes:
    if isinstance(frame, DataFrame):
        return encode_data(tag=frame.tag, seq=frame.seq, offset=frame.offset, payload=frame.payload)
    return encode_control(frame)


def decoder(*, max_control: int = MAX_CONTROL, max_data: int = MAX_DATA) -> FrameDecoder:
    return FrameDecoder(max_control_frame=max_control, max_data_frame=max_data)


def drain(dec: FrameDecoder) -> list[Frame]:
    """Every complete frame the decoder holds; stops at NEED_DATA or CLOSED."""
    frames: list[Frame] = []
    while not isinstance(frame := dec.next_frame(), DecoderState):
        frames.append(frame)
    return frames


def feed(dec: FrameDecoder, chunks: Iterable[bytes]) -> list[Frame]:
    """Feed chunks one at a time (as reads would deliver them), draining after each."""
    frames: list[Frame] = []
    for chunk in chunks:
        dec.receive_data(chunk)
        frames += drain(dec)
    return frames


def control_header(body_length: int, kind: int) -> bytes:
    return struct.pack(">IBH", body_length, FrameType.CONTROL, kind)


# --- round trips ----------------------------------------------------------------------


def test_samples_cover_every_message_kind() -> None:
    assert set(SAMPLES) == set(message_kinds().values())


@pytest.mark.parametrize("kind", sorted(message_kinds()), ids=lambda k: message_kinds()[k].__name__)
def test_every_message_kind_round_trips(kind: int) -> None:
    message = SAMPLES[message_kinds()[kind]]
    frame = encode_control(message)
    (body_length, frame_type, wire_kind) = struct.unpack_from(">IBH", frame)
    assert (body_length, frame_type, wire_kind) == (len(frame) - 4, FrameType.CONTROL, kind)

    dec = decoder()
    dec.receive_data(frame)
    assert dec.next_frame() == message
    assert dec.next_frame() is DecoderState.NEED_DATA
    assert dec.buffered == 0


@pytest.mark.parametrize(
    ("tag", "seq", "offset", "payload"),
    [
        (0, 0, 0, b""),
        (1, 2, 3, b"x"),
        (U64_MAX, U64_MAX, U64_MAX, bytes(range(256)) * 3),
        (7, 1, 1 << 40, b"\x00" * (MAX_DATA - DATA_BODY_HEADER)),  # exactly the limit
    ],
    ids=["empty", "one-byte", "max-header-fields", "at-limit"],
)
def test_data_frame_round_trips(tag: int, seq: int, offset: int, payload: bytes) -> None:
    frame = encode_data(tag=tag, seq=seq, offset=offset, payload=memoryview(payload))
    header = encode_data_header(tag=tag, seq=seq, offset=offset, nbytes=len(payload))
    assert frame == header + payload
    assert len(header) == DATA_HEADER.size

    dec = decoder()
    dec.receive_data(frame)
    assert dec.next_frame() == DataFrame(tag=tag, seq=seq, offset=offset, payload=payload)
    assert dec.next_frame() is DecoderState.NEED_DATA


@pytest.mark.parametrize("nbytes", [-1, 0xFFFFFFFF - DATA_BODY_HEADER + 1])
def test_data_header_refuses_a_payload_that_cannot_fit(nbytes: int) -> None:
    with pytest.raises(LocalProtocolError, match="does not fit"):
        encode_data_header(tag=0, seq=0, offset=0, nbytes=nbytes)


def test_largest_encodable_data_header_fills_the_length_prefix() -> None:
    nbytes = 0xFFFFFFFF - DATA_BODY_HEADER
    header = encode_data_header(tag=0, seq=0, offset=0, nbytes=nbytes)
    assert struct.unpack_from(">I", header) == (0xFFFFFFFF,)


# --- arbitrary splits -----------------------------------------------------------------

data_frames = st.builds(
    DataFrame,
    tag=st.integers(0, U64_MAX),
    seq=st.integers(0, U64_MAX),
    offset=st.integers(0, U64_MAX),
    payload=st.binary(max_size=64),
)
frame_lists = st.lists(st.one_of(st.sampled_from(list(SAMPLES.values())), data_frames), min_size=1,
                       max_size=10)


@DETERMINISTIC
@given(frames=frame_lists, data=st.data())
def test_any_split_of_the_stream_yields_the_same_frames(
    frames: list[Frame], data: st.DataObject
) -> None:
    stream = b"".join(encode(frame) for frame in frames)
    cuts = data.draw(st.sets(st.integers(1, len(stream) - 1)).map(sorted), label="cuts")
    chunks = [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)])]

    dec = decoder()
    assert feed(dec, chunks) == frames
    assert dec.buffered == 0
    dec.receive_data(b"")
    assert dec.next_frame() is DecoderState.CLOSED


def test_one_byte_at_a_time() -> None:
    frames: list[Frame] = [*SAMPLES.values(), DataFrame(tag=1, seq=2, offset=3, payload=b"abc")]
    stream = b"".join(encode(frame) for frame in frames)
    dec = decoder()
    assert feed(dec, (stream[i : i + 1] for i in range(len(stream)))) == frames


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5], ids=lambda cut: f"cut-at-{cut}")
def test_split_inside_the_length_prefix_and_type_byte(cut: int) -> None:
    frame = encode_control(SAMPLES[Kick])
    dec = decoder()
    dec.receive_data(frame[:cut])
    assert dec.next_frame() is DecoderState.NEED_DATA
    assert dec.buffered == cut
    dec.receive_data(frame[cut:])
    assert drain(dec) == [SAMPLES[Kick]]


def test_many_frames_through_a_reused_buffer() -> None:
    # Enough frames, in odd-sized reads, that consumed bytes are compacted away many times.
    frames: list[Frame] = [
        DataFrame(tag=i, seq=i, offset=i, payload=bytes([i % 256]) * (i % 37)) for i in range(300)
    ]
    stream = b"".join(encode(frame) for frame in frames)
    dec = decoder()
    assert feed(dec, (stream[i : i + 97] for i in range(0, len(stream), 97))) == frames


# --- limits ---------------------------------------------------------------------------


def kick_of_body_length(body_length: int) -> Kick:
    """A Kick whose control frame body is exactly ``body_length`` bytes."""
    for n in range(body_length):
        kick = Kick(reason="x" * n)
        if len(encode_control(kick)) - 4 == body_length:
            return kick
    raise AssertionError(f"no Kick encodes to {body_length} bytes")  # pragma: no cover


def test_control_frame_at_the_limit_is_accepted() -> None:
    kick = kick_of_body_length(MAX_CONTROL)
    dec = decoder()
    dec.receive_data(encode_control(kick))
    assert dec.next_frame() == kick


def test_control_frame_over_the_limit_fails_on_its_header() -> None:
    # Over the control limit but under the data limit: the length alone is fine, so the
    # decoder needs the type byte, and fails on it before any of the body arrives.
    dec = decoder()
    dec.receive_data(struct.pack(">I", MAX_CONTROL + 1))
    assert dec.next_frame() is DecoderState.NEED_DATA
    dec.receive_data(bytes([FrameType.CONTROL]))
    with pytest.raises(RemoteProtocolError, match=f"control frame of {MAX_CONTROL + 1} bytes"):
        dec.next_frame()


def test_data_frame_at_the_limit_is_accepted() -> None:
    payload = b"\x01" * (MAX_DATA - DATA_BODY_HEADER)
    dec = decoder()
    dec.receive_data(encode_data(tag=1, seq=1, offset=0, payload=payload))
    assert dec.next_frame() == DataFrame(tag=1, seq=1, offset=0, payload=payload)


def test_data_frame_over_the_data_limit_fails_on_its_header() -> None:
    dec = decoder(max_control=MAX_DATA + 100)  # the length alone passes; the type decides
    dec.receive_data(struct.pack(">IB", MAX_DATA + 1, FrameType.DATA))
    with pytest.raises(RemoteProtocolError, match=f"data frame of {MAX_DATA + 1} bytes"):
        dec.next_frame()


def test_frame_over_both_limits_fails_on_its_length_prefix() -> None:
    dec = decoder()
    dec.receive_data(struct.pack(">I", MAX_DATA + 1))
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        dec.next_frame()


def test_huge_length_prefix_fails_without_waiting_for_the_body() -> None:
    dec = decoder()
    dec.receive_data(b"\xff\xff\xff\xff")
    with pytest.raises(RemoteProtocolError, match="4294967295 bytes exceeds"):
        dec.next_frame()


# --- malformed streams ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        (b"\x00\x00\x00\x00", "empty body"),
        (struct.pack(">IB", 5, 3), "unknown frame type 3"),
        (struct.pack(">IB", 5, 0), "unknown frame type 0"),
        (struct.pack(">IB", 2, FrameType.CONTROL), "control frame of 2 bytes is too short"),
        (
            struct.pack(">IB", DATA_BODY_HEADER - 1, FrameType.DATA),
            f"data frame of {DATA_BODY_HEADER - 1} bytes is too short",
        ),
        (control_header(3 + 1, 999) + msgpack.packb([]), "unknown message kind 999"),
        (control_header(3 + 1, 0xFFFF) + msgpack.packb([]), "unknown message kind 65535"),
        (control_header(3 + 1, Kick.KIND) + msgpack.packb([]), "Kick: expected 1 fields, got 0"),
        (control_header(3 + 1, Kick.KIND) + b"\xc1", "Kick: undecodable payload"),
    ],
    ids=[
        "zero-length",
        "unknown-type-3",
        "unknown-type-0",
        "short-control",
        "short-data",
        "unknown-kind",
        "unknown-kind-max",
        "bad-fields",
        "bad-msgpack",
    ],
)
def test_malformed_frame(stream: bytes, match: str) -> None:
    dec = decoder()
    dec.receive_data(stream)
    with pytest.raises(RemoteProtocolError, match=match):
        dec.next_frame()


def test_data_frame_on_a_link_that_carries_none() -> None:
    dec = decoder(max_data=0)
    # Only the length prefix and the type byte: refused before the body arrives.
    dec.receive_data(encode_data(tag=0, seq=0, offset=0, payload=b"abc")[:5])
    with pytest.raises(RemoteProtocolError, match="carries none"):
        dec.next_frame()


def test_control_frames_still_flow_on_a_link_without_data() -> None:
    dec = decoder(max_data=0)
    dec.receive_data(encode_control(SAMPLES[Kick]))
    assert dec.next_frame() == SAMPLES[Kick]


@pytest.mark.parametrize(("declared", "carried"), [(5, 3), (3, 5), (1, 0)])
def test_data_frame_whose_nbytes_disagrees_with_its_length(declared: int, carried: int) -> None:
    header = DATA_HEADER.pack(DATA_BODY_HEADER + carried, FrameType.DATA, 1, 2, 3, declared)
    dec = decoder()
    dec.receive_data(header + b"\x00" * carried)
    with pytest.raises(
        RemoteProtocolError, match=f"declares {declared} payload bytes but carries {carried}"
    ):
        dec.next_frame()


# --- end of stream --------------------------------------------------------------------


def test_clean_end_of_stream() -> None:
    dec = decoder()
    dec.receive_data(encode_control(SAMPLES[Kick]))
    dec.receive_data(b"")
    # Frames received before the end still come out first.
    assert dec.next_frame() == SAMPLES[Kick]
    assert dec.next_frame() is DecoderState.CLOSED
    assert dec.next_frame() is DecoderState.CLOSED


def test_end_of_stream_on_a_fresh_decoder() -> None:
    dec = decoder()
    dec.receive_data(b"")
    assert dec.next_frame() is DecoderState.CLOSED


@pytest.mark.parametrize("received", [1, 3, 4, 5, 10], ids=lambda n: f"{n}-bytes")
def test_end_of_stream_inside_a_frame(received: int) -> None:
    frame = encode_control(SAMPLES[Kick])
    assert received < len(frame)
    dec = decoder()
    dec.receive_data(frame[:received])
    dec.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match=f"closed inside a frame \\({received} bytes"):
        dec.next_frame()


def test_receive_after_end_of_stream_is_our_bug() -> None:
    dec = decoder()
    dec.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        dec.receive_data(b"x")


# --- poisoning ------------------------------------------------------------------------


def test_decoder_stays_broken_after_an_error() -> None:
    dec = decoder()
    dec.receive_data(struct.pack(">IB", 5, 9))
    with pytest.raises(RemoteProtocolError) as first:
        dec.next_frame()
    # Valid bytes arriving later do not resurrect the stream.
    dec.receive_data(encode_control(SAMPLES[Kick]))
    with pytest.raises(RemoteProtocolError) as again:
        dec.next_frame()
    assert again.value is first.value


def test_decoder_stays_broken_after_a_bad_message() -> None:
    dec = decoder()
    dec.receive_data(control_header(4, 999) + b"\x90" + encode_control(SAMPLES[Kick]))
    for _ in range(2):
        with pytest.raises(RemoteProtocolError, match="unknown message kind 999"):
            dec.next_frame()


# --- garbage in -----------------------------------------------------------------------

known_kinds = st.sampled_from(sorted(message_kinds()))
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64_MAX)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=20,
)
# Plausible frames (a right length, a known kind) with arbitrary msgpack inside, so the
# fuzzing reaches message validation and not only the frame header checks.
plausible_control_frames = st.builds(
    lambda kind, body: control_header(3 + len(body), kind) + body,
    known_kinds | st.integers(0, 0xFFFF),
    st.binary(max_size=40) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
)
plausible_data_frames = st.builds(
    lambda header, payload: header + payload,
    st.builds(DATA_HEADER.pack, st.integers(0, 200), st.just(FrameType.DATA),
              st.integers(0, U64_MAX), st.integers(0, U64_MAX), st.integers(0, U64_MAX),
              st.integers(0, 200)),
    st.binary(max_size=80),
)


@DETERMINISTIC
@given(
    chunks=st.lists(
        st.binary(min_size=1, max_size=40) | plausible_control_frames | plausible_data_frames,
        max_size=8,
    ),
    end=st.booleans(),
)
def test_garbage_raises_only_remote_protocol_error(chunks: list[bytes], end: bool) -> None:
    dec = decoder(max_control=128, max_data=128)
    try:
        feed(dec, chunks)
        if end:
            dec.receive_data(b"")
            drain(dec)
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            dec.next_frame()  # and it stays broken
