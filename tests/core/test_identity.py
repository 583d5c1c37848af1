"""Identity keys: proofs bound to one connection, and the key file on disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pccl_trio._core.channel import ClientHandshake, Purpose, ServerHandshake
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


def test_a_proof_holds_only_for_its_key_and_connection(tmp_path: Path) -> None:
    key = load_identity(tmp_path / "a.key")
    other = load_identity(tmp_path / "b.key")
    binding, _ = bindings()
    proof = prove(key, binding)
    verify(public_bytes(key), binding, proof)
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(other), binding, proof)  # claimed by someone else
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(key), bindings()[0], proof)  # replayed on another connection
    with pytest.raises(RemoteProtocolError):
        verify(public_bytes(key), binding, proof[:-1] + bytes([proof[-1] ^ 1]))
    with pytest.raises(RemoteProtocolError):
        verify(b"short", binding, proof)


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
