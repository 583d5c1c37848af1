"""The run-secret handshake and frame protection, sans-IO."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl_trio._core.channel import (
    FINISH_SIZE,
    HELLO_SIZE,
    REPLY_SIZE,
    TAG_SIZE,
    Channel,
    ClientHandshake,
    HandshakeFailed,
    Purpose,
    ServerHandshake,
    check_secret,
)
from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.messages import Heartbeat
from pccl_trio._core.wire import encode_control

SECRET = b"s" * 32
ALL = frozenset(Purpose)


def shake(
    client_secret: bytes = SECRET, server_secret: bytes = SECRET,
    purpose: Purpose = Purpose.RING, served: frozenset[Purpose] = ALL,
) -> tuple[Channel, Channel]:
    client = ClientHandshake(client_secret, purpose)
    server = ServerHandshake(server_secret, served)
    hello = client.hello()
    reply = server.reply(hello)
    finish = client.finish(reply)
    server.finish(finish)
    assert (len(hello), len(reply), len(finish)) == (HELLO_SIZE, REPLY_SIZE, FINISH_SIZE)
    assert client.channel is not None and server.channel is not None
    assert server.purpose == purpose
    return client.channel, server.channel


def test_a_shared_secret_gives_both_sides_matching_channels() -> None:
    client, server = shake()
    header = b"\x00\x00\x00\x20\x01\x00\x07"
    for fields in (b"first", b"", b"third" * 100):
        sealed = client.seal_control(header, fields)
        assert len(sealed) == len(fields) + TAG_SIZE
        assert not fields or fields not in sealed  # encrypted
        assert server.open_control(header, sealed) == fields
    back = server.seal_control(header, b"reply")
    assert client.open_control(header, back) == b"reply"


def test_the_server_refuses_a_client_without_the_secret() -> None:
    client = ClientHandshake(b"w" * 32, Purpose.MASTER)
    server = ServerHandshake(SECRET, ALL)
    reply = server.reply(client.hello())
    with pytest.raises(HandshakeFailed):
        client.finish(reply)  # the client sees first that the server is not its run's
    with pytest.raises(HandshakeFailed):
        server.finish(os.urandom(FINISH_SIZE))  # and a guessed proof fails at the server


def test_the_server_refuses_a_forged_or_replayed_finish() -> None:
    client = ClientHandshake(SECRET, Purpose.MASTER)
    server = ServerHandshake(SECRET, ALL)
    finish = client.finish(server.reply(client.hello()))
    # The same hello and finish replayed to a new server: its fresh nonce changes keys.
    replayed = ServerHandshake(SECRET, ALL)
    replayed.reply(client.hello())
    with pytest.raises(HandshakeFailed):
        replayed.finish(finish)
    server.finish(finish)


def test_a_hello_for_another_purpose_or_protocol_is_refused() -> None:
    server = ServerHandshake(SECRET, frozenset({Purpose.MASTER}))
    with pytest.raises(HandshakeFailed, match="purpose 2 is not served"):
        server.reply(ClientHandshake(SECRET, Purpose.RING).hello())
    with pytest.raises(HandshakeFailed, match="not a pccl_trio handshake"):
        server.reply(b"GET / HTTP/1.1\r\n".ljust(HELLO_SIZE, b"x"))


def test_a_hello_is_judged_by_its_first_four_bytes() -> None:
    """A stranger's plain frame (a length prefix) is refused before the rest of a
    hello's worth of bytes arrives; a real hello's opening passes."""
    server = ServerHandshake(SECRET, frozenset({Purpose.MASTER}))
    hello = ClientHandshake(SECRET, Purpose.MASTER).hello()
    server.opening(hello[:4])
    for stranger in (encode_control(Heartbeat())[:4], b"GET ", hello[1:5]):
        with pytest.raises(HandshakeFailed, match="not a pccl_trio handshake"):
            server.opening(stranger)


def test_keys_differ_per_connection_and_per_purpose() -> None:
    a_client, _ = shake(purpose=Purpose.RING)
    b_client, b_server = shake(purpose=Purpose.RING)
    header = b"h" * 7
    with pytest.raises(RemoteProtocolError):
        b_server.open_control(header, a_client.seal_control(header, b"x"))
    c_client, c_server = shake(purpose=Purpose.SHARED_STATE)
    with pytest.raises(RemoteProtocolError):
        c_server.open_control(header, b_client.seal_control(header, b"x"))


def test_replayed_reordered_or_altered_control_frames_fail() -> None:
    client, server = shake()
    header = b"\x00\x00\x00\x20\x01\x00\x07"
    _first, second = client.seal_control(header, b"one"), client.seal_control(header, b"two")
    with pytest.raises(RemoteProtocolError, match="failed its authentication"):
        server.open_control(header, second)  # out of order

    client, server = shake()
    sealed = client.seal_control(header, b"one")
    with pytest.raises(RemoteProtocolError):
        server.open_control(b"\x00\x00\x00\x20\x01\x00\x08", sealed)  # another kind

    client, server = shake()
    sealed = bytearray(client.seal_control(header, b"one"))
    sealed[0] ^= 1
    with pytest.raises(RemoteProtocolError):
        server.open_control(header, sealed)


@settings(max_examples=50, deadline=None)
@given(payload=st.binary(max_size=4096), flip=st.integers(min_value=0))
def test_a_data_frame_verifies_and_any_flipped_bit_fails(payload: bytes, flip: int) -> None:
    client, server = shake()
    header = os.urandom(33)
    tag = client.tag_data(header, memoryview(payload))
    server.check_data(header, memoryview(payload), tag)
    framed = bytearray(header + payload)
    bit = flip % (8 * len(framed))
    framed[bit // 8] ^= 1 << (bit % 8)
    client2, server2 = shake()
    tag2 = client2.tag_data(header, memoryview(payload))
    with pytest.raises(RemoteProtocolError, match="data frame failed"):
        server2.check_data(bytes(framed[:33]), memoryview(framed)[33:], tag2)


def split(view: memoryview, cuts: list[int]) -> list[memoryview]:
    """``view`` cut at ``cuts`` (positions taken modulo its length, sorted)."""
    points = sorted({c % (len(view) + 1) for c in cuts} | {0, len(view)})
    return [view[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=50, deadline=None)
@given(
    payload=st.binary(max_size=4096), encrypt=st.booleans(),
    send_cuts=st.lists(st.integers(min_value=0), max_size=5),
    receive_cuts=st.lists(st.integers(min_value=0), max_size=5),
    flip=st.none() | st.integers(min_value=0),
)
def test_a_data_frame_fed_in_parts_is_the_frame_fed_whole(
    payload: bytes, encrypt: bool, send_cuts: list[int], receive_cuts: list[int],
    flip: int | None,
) -> None:
    """A sender that tags (or encrypts) its payload part by part, and a receiver that
    checks (or decrypts) it part by part at other boundaries, agree with the one-piece
    protection: the same bytes and tag on the wire, the payload back, and any flipped
    bit fails the frame."""
    header = os.urandom(33)
    keys = {"send_key": b"k" * 32, "receive_key": b"r" * 32, "encrypt_data": encrypt}
    whole = Channel(**keys).protect_data(header, memoryview(payload))  # type: ignore[arg-type]
    client = Channel(**keys)  # type: ignore[arg-type]
    server = Channel(send_key=b"r" * 32, receive_key=b"k" * 32, encrypt_data=encrypt)
    seal = client.seal_data(header)
    wire = bytearray(len(payload))
    for part, out in zip(split(memoryview(payload), send_cuts),
                         split(memoryview(wire), send_cuts), strict=True):
        if encrypt:
            seal.encrypt_into(part, out)
        else:
            seal.authenticate(part)
            out[:] = part
    tag = seal.finish()
    assert bytes(wire) == bytes(whole[1]) and tag == bytes(whole[2])
    if flip is not None and payload:
        bit = flip % (8 * len(payload))
        wire[bit // 8] ^= 1 << (bit % 8)
    opening = server.open_data(header)
    for part in split(memoryview(wire), receive_cuts):
        opening.update(part)
    if flip is not None and payload:
        with pytest.raises(RemoteProtocolError, match="data frame failed"):
            opening.finish(tag)
    else:
        opening.finish(tag)
        assert bytes(wire) == payload


def test_data_tags_cover_tensor_memory_without_a_copy() -> None:
    client, server = shake()
    tensor = np.arange(1 << 16, dtype=np.float32)
    view = memoryview(tensor).cast("B")[4096:8192]
    header = b"\x01" * 33
    tag = client.tag_data(header, view)
    server.check_data(header, view, tag)


def test_encrypted_data_round_trips_and_hides_the_payload() -> None:
    client, server = shake()
    payload = np.arange(1000, dtype=np.float64).tobytes()
    header = b"\x02" * 33
    wire = bytearray(len(payload))
    tag = client.encrypt_data_into(header, memoryview(payload), memoryview(wire))
    assert bytes(wire) != payload
    out = bytearray(len(payload))
    server.decrypt_data_into(header, memoryview(wire), memoryview(out), tag)
    assert bytes(out) == payload
    wire[10] ^= 0xFF
    client2, server2 = shake()
    tag = client2.encrypt_data_into(header, memoryview(payload), memoryview(bytearray(len(payload))))
    with pytest.raises(RemoteProtocolError):
        server2.decrypt_data_into(header, memoryview(wire), memoryview(out), tag)


def test_control_and_data_frames_share_one_count_per_direction() -> None:
    client, server = shake()
    header = b"\x00" * 7
    payload = memoryview(b"data")
    sealed = client.seal_control(header, b"control")
    tag = client.tag_data(header, payload)
    server.open_control(header, sealed)
    server.check_data(header, payload, tag)
    with pytest.raises(RemoteProtocolError):  # the same tag again: count 2 now
        server.check_data(header, payload, tag)


def test_short_secrets_are_refused_with_advice() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        check_secret(b"hunter2")
    with pytest.raises(ValueError):
        ClientHandshake(b"short", Purpose.MASTER)
    assert check_secret(b"x" * 16) == b"x" * 16


@pytest.mark.parametrize(
    "client_wants, server_wants", [(False, False), (True, False), (False, True), (True, True)]
)
def test_data_is_encrypted_if_either_side_asks(client_wants: bool, server_wants: bool) -> None:
    client = ClientHandshake(SECRET, Purpose.RING, encrypt_data=client_wants)
    server = ServerHandshake(SECRET, ALL, encrypt_data=server_wants)
    server.finish(client.finish(server.reply(client.hello())))
    assert client.channel is not None and server.channel is not None
    assert client.channel.encrypt_data == server.channel.encrypt_data == (client_wants or server_wants)
    header = b"h" * 33
    payload = np.arange(1000, dtype=np.float32)
    sent = client.channel.protect_data(header, memoryview(payload).cast("B"))
    assert (bytes(sent[1]) != payload.tobytes()) == (client_wants or server_wants)
    received = bytearray(sent[1])
    server.channel.accept_data(header, memoryview(received), sent[2])
    assert bytes(received) == payload.tobytes()


def test_a_forged_server_flag_fails_the_servers_proof() -> None:
    """The flags are part of the proven transcript: flipping one (to force or drop
    encryption) is detected by the client."""
    client = ClientHandshake(SECRET, Purpose.RING)
    server = ServerHandshake(SECRET, ALL)
    reply = bytearray(server.reply(client.hello()))
    reply[33] ^= 1  # the server's flag bit
    with pytest.raises(HandshakeFailed):
        client.finish(bytes(reply))
