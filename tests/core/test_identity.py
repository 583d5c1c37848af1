"""Identity keys: proofs bound to one connection and role, proven within the run-secret
handshake, and the key file on disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pccl_trio._core.channel import (
    FINISH_SIZE,
    IDENTITY_BLOCK_SIZE,
    REPLY_SIZE,
    ClientHandshake,
    HandshakeFailed,
    Purpose,
    ServerHandshake,
)
from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.identity import prove, public_bytes, verify
from pccl_trio._identity import IdentityError, load_identity

SECRET = b"s" * 32


def bindings() -> tuple[bytes, bytes]:
    client = ClientHandshake(SECRET, Purpose.RING)
    server = ServerHandshake(SECRET, frozenset(Purpose))
    server.finish(client.finish(server.reply(client.hello())))
    assert client.channel is not None and server.channel is not None
    return client.channel.binding, server.channel.binding


def test_both_ends_share_a_binding_new_for_every_connection() -> None:
    first, first_server = bindings()
    second, _ = bindings()
    assert first == first_server and len(first) == 32
    assert first != second


def test_a_proof_holds_only_for_its_key_connection_and_role(tmp_path: Path) -> None:
    key = load_identity(tmp_path / "a.key")
    other = load_identity(tmp_path / "b.key")
    binding, _ = bindings()
    proof = prove(key, binding, b"client")
    verify(public_bytes(key), binding, b"client", proof)
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(other), binding, b"client", proof)  # claimed by someone else
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(key), bindings()[0], b"client", proof)  # another connection
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(key), binding, b"server", proof)  # reflected to its maker
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(key), binding, b"client", proof[:-1] + bytes([proof[-1] ^ 1]))
    with pytest.raises(RemoteProtocolError):
        verify(b"short", binding, b"client", proof)


def handshake(
    client_key: Ed25519PrivateKey | None, server_key: Ed25519PrivateKey | None
) -> tuple[ClientHandshake, ServerHandshake, bytes, bytes]:
    """A completed handshake, and the reply and finish that crossed."""
    client = ClientHandshake(SECRET, Purpose.RING, identity=client_key)
    server = ServerHandshake(SECRET, frozenset(Purpose), identity=server_key)
    reply = server.reply(client.hello())
    assert len(reply) == REPLY_SIZE + client.reply_extra(reply)
    finish = client.finish(reply)
    assert len(finish) == server.finish_size
    server.finish(finish)
    return client, server, reply, finish


@pytest.mark.parametrize("client_has", [False, True])
@pytest.mark.parametrize("server_has", [False, True])
def test_each_side_learns_the_key_the_other_proved(client_has: bool, server_has: bool) -> None:
    client_key = Ed25519PrivateKey.generate() if client_has else None
    server_key = Ed25519PrivateKey.generate() if server_has else None
    client, server, reply, finish = handshake(client_key, server_key)
    assert client.channel is not None and server.channel is not None
    assert server.channel.peer_identity == (public_bytes(client_key) if client_key else b"")
    assert client.channel.peer_identity == (public_bytes(server_key) if server_key else b"")
    assert len(reply) == REPLY_SIZE + (IDENTITY_BLOCK_SIZE if server_has else 0)
    assert len(finish) == FINISH_SIZE + (IDENTITY_BLOCK_SIZE if client_has else 0)
    # The keys travel masked: a stranger watching learns no node's public key.
    for key in (client_key, server_key):
        if key is not None:
            assert public_bytes(key) not in reply + finish


def test_an_altered_or_reflected_identity_block_fails_the_handshake() -> None:
    key = Ed25519PrivateKey.generate()
    # Any flipped bit of the client's block (masked key or signature).
    for position in (FINISH_SIZE, FINISH_SIZE + 40, FINISH_SIZE + IDENTITY_BLOCK_SIZE - 1):
        client = ClientHandshake(SECRET, Purpose.RING, identity=key)
        server = ServerHandshake(SECRET, frozenset(Purpose))
        finish = bytearray(client.finish(server.reply(client.hello())))
        finish[position] ^= 1
        with pytest.raises(HandshakeFailed, match="identity"):
            server.finish(bytes(finish))
    # A client that claims the identity a server just proved to it, by echoing the
    # server's block as its own (it has the secret, not the server's key).
    server_key = Ed25519PrivateKey.generate()
    server = ServerHandshake(SECRET, frozenset(Purpose), identity=server_key)
    liar = ClientHandshake(SECRET, Purpose.RING, identity=Ed25519PrivateKey.generate())
    reply = server.reply(liar.hello())
    finish = liar.finish(reply)
    with pytest.raises(HandshakeFailed, match="identity"):
        server.finish(finish[:FINISH_SIZE] + reply[REPLY_SIZE:])
    # And the server's block altered on its way to the client.
    client = ClientHandshake(SECRET, Purpose.RING)
    server = ServerHandshake(SECRET, frozenset(Purpose), identity=server_key)
    reply = bytearray(server.reply(client.hello()))
    reply[-1] ^= 1
    with pytest.raises(HandshakeFailed, match="identity"):
        client.finish(bytes(reply))


def test_a_block_replayed_from_another_connection_fails() -> None:
    key = Ed25519PrivateKey.generate()
    _, _, _, recorded = handshake(key, None)
    client = ClientHandshake(SECRET, Purpose.RING, identity=Ed25519PrivateKey.generate())
    server = ServerHandshake(SECRET, frozenset(Purpose))
    finish = client.finish(server.reply(client.hello()))
    with pytest.raises(HandshakeFailed, match="identity"):
        server.finish(finish[:FINISH_SIZE] + recorded[FINISH_SIZE:])


def test_the_key_file_is_created_private_once_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    key = load_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert public_bytes(load_identity(path)) == public_bytes(key)
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temporary left


def test_unusable_key_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    load_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_identity(path)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    os.chmod(garbage, 0o600)
    with pytest.raises(IdentityError, match="not a PEM private key"):
        load_identity(garbage)
