"""Authenticated connections: the run-secret handshake and the per-frame protection
that follows it (sans-IO).

Theory of operation
-------------------
Every peer and the master of a run share one *run secret*. Each TCP connection opens
with a handshake of three fixed-size messages, exchanged before any frame is parsed:

* ``HELLO`` (client -> server, ``HELLO_SIZE`` bytes): the magic ``PCTS``, the
  handshake version, the connection's *purpose* (master link, ring pool, shared
  state, benchmark), the client's flags, and a fresh 32-byte client nonce.
* ``REPLY`` (server -> client, ``REPLY_SIZE`` bytes): a fresh 32-byte server nonce,
  the server's flags, and the server's proof, an HMAC-SHA256 over the transcript
  (``HELLO``, the server nonce and flags) under the handshake's authentication key.
* ``FINISH`` (client -> server, ``FINISH_SIZE`` bytes): the client's proof over the
  same transcript, under the same key but another label.

The keys come from HKDF-SHA256 over the run secret, salted with both nonces and bound
to the purpose: an authentication key, one AES-256-GCM key per direction and two
identity masks, new for every connection. Each side checks the other's proof before it sends anything more, so
the handshake is mutual: a peer learns that it talks to the run's master, and a
listener that its client holds the secret. A failed proof closes the connection
without a word (no error text that could serve as an oracle).

A side with a node identity (``identity``: an Ed25519 key) says so in its flags
(``FLAG_IDENTITY``) and appends an *identity block* of ``IDENTITY_BLOCK_SIZE`` bytes to
its proof: its 32-byte public key, masked (XOR) with its direction's identity mask so
that only holders of the secret learn which node answered, then its signature over the
connection's *binding* (a value derived from the transcript that only the two ends
know) and its role. The server's block follows ``REPLY``, the client's ``FINISH``, so
identities cost no round trip. Each side checks the other's signature before it sends
anything more, and the channel records the proven key (``Channel.peer_identity``,
empty if the other side has none); whether it is the key expected of that peer is for
the caller to judge, once it knows whom the other side claims to be.

Afterwards a ``Channel`` protects every frame. Each direction counts its frames from
zero; the count is the AES-GCM nonce, so a replayed, dropped or reordered frame fails
its tag. A control frame's fields are encrypted and tagged, with its 7-byte header
(length, type, kind) as associated data, so the header is still judged before the
body is read (``wire.Admission``) and cannot be altered. A data frame keeps its header
and payload readable (the payload is written straight into tensor memory, zero-copy)
and carries a 16-byte GMAC tag over both after the payload; with ``encrypt_data`` the
payload is encrypted too, at the price of one copy per frame. The flags carry each
side's wish (``FLAG_ENCRYPT_DATA``): a connection encrypts its data if either side asks,
so both ends always agree.
"""

from __future__ import annotations

import enum
import hmac
import os
import struct
import typing

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

if typing.TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import identity as identities
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "FINISH_SIZE",
    "HELLO_SIZE",
    "IDENTITY_BLOCK_SIZE",
    "MAGIC",
    "MIN_SECRET_BYTES",
    "REPLY_SIZE",
    "TAG_SIZE",
    "Channel",
    "ClientHandshake",
    "HandshakeFailed",
    "Purpose",
    "ServerHandshake",
    "check_secret",
]

MAGIC = b"PCTS"
HANDSHAKE_VERSION = 1
NONCE_SIZE = 32
PROOF_SIZE = 32
#: Bytes of the GCM tag on every protected frame.
TAG_SIZE = 16
#: Shortest run secret accepted: the handshake's proofs can be attacked offline by
#: guessing the secret, so it must not be guessable.
MIN_SECRET_BYTES = 16

#: Flag bit: this side wants data payloads encrypted.
FLAG_ENCRYPT_DATA = 1
#: Flag bit: this side proves a node identity (an identity block follows its proof).
FLAG_IDENTITY = 2
#: Bytes of an identity block: the masked public key, then the signature.
IDENTITY_BLOCK_SIZE = identities.IDENTITY_SIZE + identities.PROOF_SIZE

_HELLO = struct.Struct(f">4sBBH{NONCE_SIZE}s")
_FLAGS = struct.Struct(">H")
HELLO_SIZE = _HELLO.size
REPLY_SIZE = NONCE_SIZE + _FLAGS.size + PROOF_SIZE
FINISH_SIZE = PROOF_SIZE
_COUNTER = struct.Struct(">4xQ")  # the 96-bit GCM nonce: 32 zero bits, a 64-bit count


class Purpose(enum.IntEnum):
    """What a connection is for; part of its keys, so a connection opened for one
    purpose cannot be replayed as another."""

    MASTER = 1
    RING = 2
    SHARED_STATE = 3
    BENCHMARK = 4


class HandshakeFailed(RemoteProtocolError):
    """The other side does not hold the run secret, or did not speak the handshake."""


def check_secret(secret: bytes) -> bytes:
    """``secret`` if it can serve as a run secret.

    Raises:
        ValueError: too short to resist guessing.
    """
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"a run secret must be at least {MIN_SECRET_BYTES} bytes (32 random bytes, "
            "e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return secret


class _Keys(typing.NamedTuple):
    auth: bytes
    client_to_server: bytes
    server_to_client: bytes
    client_mask: bytes  # masks the client's public key in its identity block
    server_mask: bytes


def _keys(secret: bytes, hello: bytes, server_nonce: bytes, purpose: int) -> _Keys:
    client_nonce = hello[-NONCE_SIZE:]
    material = HKDF(
        algorithm=hashes.SHA256(),
        length=160,
        salt=client_nonce + server_nonce,
        info=b"pccl-trio handshake %d purpose %d" % (HANDSHAKE_VERSION, purpose),
    ).derive(secret)
    return _Keys(*(material[i : i + 32] for i in range(0, 160, 32)))


def _mask(data: bytes, mask: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, mask, strict=True))


def _identity_block(key: Ed25519PrivateKey, mask: bytes, binding: bytes, role: bytes) -> bytes:
    return _mask(identities.public_bytes(key), mask) + identities.prove(key, binding, role)


def _proven_identity(block: bytes, mask: bytes, binding: bytes, role: bytes) -> bytes:
    """The public key an identity block proves on this connection.

    Raises:
        HandshakeFailed: the signature does not hold (not made by that key, for this
            connection and role).
    """
    public = _mask(block[: identities.IDENTITY_SIZE], mask)
    try:
        identities.verify(public, binding, role, block[identities.IDENTITY_SIZE :])
    except RemoteProtocolError as exc:
        raise HandshakeFailed(f"the other side's node identity: {exc}") from None
    return public


def identity_bytes(flags: int) -> int:
    """Bytes of identity block that follow a proof sent with ``flags``."""
    return IDENTITY_BLOCK_SIZE if flags & FLAG_IDENTITY else 0


def _proof(key: bytes, label: bytes, hello: bytes, server_part: bytes) -> bytes:
    """The proof over the transcript: ``hello``, then the server's nonce and flags."""
    return hmac.new(key, label + hello + server_part, "sha256").digest()


class ClientHandshake:
    """The connecting side: ``hello()``, then ``finish(reply)``; then ``channel``.

    The reply is ``REPLY_SIZE`` bytes and an identity block if its flags say so
    (``reply_extra``).
    """

    def __init__(
        self, secret: bytes, purpose: Purpose, *, encrypt_data: bool = False,
        identity: Ed25519PrivateKey | None = None,
    ) -> None:
        self._secret = check_secret(secret)
        self._purpose = purpose
        self._encrypt_data = encrypt_data
        self._identity = identity
        flags = (FLAG_ENCRYPT_DATA if encrypt_data else 0) | (FLAG_IDENTITY if identity else 0)
        self._hello = _HELLO.pack(MAGIC, HANDSHAKE_VERSION, purpose, flags, os.urandom(NONCE_SIZE))
        self.channel: Channel | None = None

    def hello(self) -> bytes:
        return self._hello

    @staticmethod
    def reply_extra(reply: bytes) -> int:
        """Bytes that follow the ``REPLY_SIZE`` bytes of ``reply`` (its identity block;
        judged from the flags before they are proven: a lie only fails the proof)."""
        (flags,) = _FLAGS.unpack_from(reply, NONCE_SIZE)
        return identity_bytes(flags)

    def finish(self, reply: bytes) -> bytes:
        """Check the server's proof (and identity) in ``reply``; the ``FINISH`` message
        to send (with this side's identity block, if it has an identity).

        Raises:
            HandshakeFailed: the server does not hold the run secret, or its identity
                block does not hold.
        """
        if len(reply) < REPLY_SIZE or len(reply) != REPLY_SIZE + self.reply_extra(reply):
            raise LocalProtocolError(f"a handshake reply of {len(reply)} bytes")
        server_part = bytes(reply[: NONCE_SIZE + _FLAGS.size])
        proof = bytes(reply[len(server_part) : REPLY_SIZE])
        keys = _keys(self._secret, self._hello, server_part[:NONCE_SIZE], self._purpose)
        if not hmac.compare_digest(proof, _proof(keys.auth, b"server", self._hello, server_part)):
            raise HandshakeFailed("the other side does not hold this run's secret")
        (server_flags,) = _FLAGS.unpack_from(server_part, NONCE_SIZE)
        binding = _proof(keys.auth, b"binding", self._hello, server_part)
        peer_identity = b""
        if server_flags & FLAG_IDENTITY:
            peer_identity = _proven_identity(
                bytes(reply[REPLY_SIZE:]), keys.server_mask, binding, b"server"
            )
        encrypt = self._encrypt_data or bool(server_flags & FLAG_ENCRYPT_DATA)
        self.channel = Channel(
            send_key=keys.client_to_server, receive_key=keys.server_to_client,
            encrypt_data=encrypt, binding=binding, peer_identity=peer_identity,
        )
        finish = _proof(keys.auth, b"client", self._hello, server_part)
        if self._identity is not None:
            finish += _identity_block(self._identity, keys.client_mask, binding, b"client")
        return finish


class ServerHandshake:
    """The accepting side: ``reply(hello)``, then ``finish(finish)`` (``finish_size``
    bytes); then ``channel``. ``opening(head)`` may judge the hello's first
    ``len(MAGIC)`` bytes before the rest arrives.

    Args:
        purposes: the purposes this listener serves (a master serves only
            ``MASTER``); a hello for another is refused.
        identity: this node's identity key, proven to every client (None: none).
    """

    def __init__(
        self, secret: bytes, purposes: frozenset[Purpose], *, encrypt_data: bool = False,
        identity: Ed25519PrivateKey | None = None,
    ) -> None:
        self._secret = check_secret(secret)
        self._purposes = purposes
        self._encrypt_data = encrypt_data
        self._identity = identity
        self._hello = b""
        self._server_part = b""
        self._keys: _Keys | None = None
        self._client_flags = 0
        self.purpose: Purpose | None = None
        self.channel: Channel | None = None

    @property
    def finish_size(self) -> int:
        """Bytes of the client's ``FINISH`` (known once its hello is read)."""
        return FINISH_SIZE + identity_bytes(self._client_flags)

    def opening(self, head: bytes) -> None:
        """Judge the first ``len(MAGIC)`` bytes of a client's ``HELLO``: a stranger that
        speaks plain frames is refused at once, instead of once the handshake's time is
        up, holding its connection meanwhile (it still learns only that it closed).

        Raises:
            HandshakeFailed: not the start of a hello of this protocol.
        """
        if len(head) != len(MAGIC):
            raise LocalProtocolError(f"a hello opens with {len(MAGIC)} bytes, got {len(head)}")
        if head != MAGIC:
            raise HandshakeFailed("not a pccl_trio handshake of this version")

    def reply(self, hello: bytes) -> bytes:
        """The ``REPLY`` to a client's ``HELLO`` (with this side's identity block).

        Raises:
            HandshakeFailed: not a hello of this protocol, or for a purpose not served.
        """
        if len(hello) != HELLO_SIZE:
            raise LocalProtocolError(f"a handshake hello is {HELLO_SIZE} bytes, got {len(hello)}")
        magic, version, purpose, flags, _nonce = _HELLO.unpack(hello)
        if magic != MAGIC or version != HANDSHAKE_VERSION:
            raise HandshakeFailed("not a pccl_trio handshake of this version")
        if purpose not in self._purposes:
            raise HandshakeFailed(f"purpose {purpose} is not served here")
        self.purpose = Purpose(purpose)
        self._hello = bytes(hello)
        self._client_flags = flags
        self._encrypt_data = self._encrypt_data or bool(flags & FLAG_ENCRYPT_DATA)
        nonce = os.urandom(NONCE_SIZE)
        own_flags = (FLAG_ENCRYPT_DATA if self._encrypt_data else 0) | (
            FLAG_IDENTITY if self._identity else 0
        )
        self._server_part = nonce + _FLAGS.pack(own_flags)
        keys = self._keys = _keys(self._secret, self._hello, nonce, purpose)
        reply = self._server_part + _proof(keys.auth, b"server", self._hello, self._server_part)
        if self._identity is not None:
            reply += _identity_block(self._identity, keys.server_mask, self._binding(), b"server")
        return reply

    def _binding(self) -> bytes:
        assert self._keys is not None
        return _proof(self._keys.auth, b"binding", self._hello, self._server_part)

    def finish(self, finish: bytes) -> None:
        """Check the client's proof (and identity); ``channel`` is ready afterwards.

        Raises:
            HandshakeFailed: the client does not hold the run secret, or its identity
                block does not hold.
        """
        keys = self._keys
        if keys is None:
            raise LocalProtocolError("finish before reply")
        if len(finish) != self.finish_size:
            raise LocalProtocolError(f"a handshake finish is {self.finish_size} bytes, got {len(finish)}")
        expected = _proof(keys.auth, b"client", self._hello, self._server_part)
        if not hmac.compare_digest(bytes(finish[:FINISH_SIZE]), expected):
            raise HandshakeFailed("the other side does not hold this run's secret")
        binding = self._binding()
        peer_identity = b""
        if self._client_flags & FLAG_IDENTITY:
            peer_identity = _proven_identity(
                bytes(finish[FINISH_SIZE:]), keys.client_mask, binding, b"client"
            )
        self.channel = Channel(
            send_key=keys.server_to_client, receive_key=keys.client_to_server,
            encrypt_data=self._encrypt_data, binding=binding, peer_identity=peer_identity,
        )


class Channel:
    """The protection of one connection's frames after its handshake.

    Not thread-safe on its own: each direction is used by one sender and one receiver
    at a time (the connection's send lock and its single reader), in frame order.
    """

    def __init__(
        self, *, send_key: bytes, receive_key: bytes, encrypt_data: bool, binding: bytes = b"",
        peer_identity: bytes = b"",
    ) -> None:
        #: A value both ends of this connection, and nobody else, know: what a node
        #: signs to prove its identity on this connection (``identity``).
        self.binding = binding
        #: The public identity key the other side proved in the handshake (empty: it
        #: has none).
        self.peer_identity = peer_identity
        self._send_key = send_key
        self._receive_key = receive_key
        self._send_aead = AESGCM(send_key)
        self._receive_aead = AESGCM(receive_key)
        self._sent = 0
        self._received = 0
        self.encrypt_data = encrypt_data

    def _next_send(self) -> bytes:
        nonce = _COUNTER.pack(self._sent)
        self._sent += 1
        return nonce

    def _next_receive(self) -> bytes:
        nonce = _COUNTER.pack(self._received)
        self._received += 1
        return nonce

    # --- control frames ---------------------------------------------------------------

    def seal_control(self, header: bytes, fields: bytes) -> bytes:
        """``fields`` encrypted and tagged (``TAG_SIZE`` bytes longer), bound to the
        frame's ``header`` (its length prefix already counting the tag)."""
        return self._send_aead.encrypt(self._next_send(), fields, header)

    def open_control(self, header: bytes, sealed: bytes | bytearray | memoryview) -> bytes:
        """The fields of a sealed control frame.

        Raises:
            RemoteProtocolError: the frame was forged, altered, replayed or reordered.
        """
        try:
            return self._receive_aead.decrypt(self._next_receive(), bytes(sealed), header)
        except InvalidTag:
            raise RemoteProtocolError("a control frame failed its authentication") from None

    # --- data frames ------------------------------------------------------------------

    def seal_data(self, header: bytes, *, encrypt: bool | None = None) -> DataSeal:
        """Start protecting the data frame with ``header`` (its payload follows in
        parts, in order; see ``DataSeal``), encrypted if ``encrypt`` (default: as the
        connection agreed)."""
        encrypt = self.encrypt_data if encrypt is None else encrypt
        return DataSeal(self._send_key, self._next_send(), header, encrypt=encrypt)

    def open_data(self, header: bytes, *, decrypt: bool | None = None) -> DataOpening:
        """Start checking the received data frame with ``header`` (its payload follows
        in parts as they arrive; see ``DataOpening``), decrypting it if ``decrypt``
        (default: as the connection agreed)."""
        decrypt = self.encrypt_data if decrypt is None else decrypt
        return DataOpening(self._receive_key, self._next_receive(), header, decrypt=decrypt)

    def tag_data(self, header: bytes, payload: memoryview) -> bytes:
        """The tag that follows a data frame's payload (``encrypt_data`` off)."""
        seal = self.seal_data(header, encrypt=False)
        seal.authenticate(payload)
        return seal.finish()

    def check_data(
        self, header: bytes, payload: memoryview, tag: bytes | bytearray | memoryview
    ) -> None:
        """Raise ``RemoteProtocolError`` unless ``tag`` is the data frame's tag."""
        opening = self.open_data(header, decrypt=False)
        opening.update(payload)
        opening.finish(tag)

    def encrypt_data_into(self, header: bytes, payload: memoryview, out: memoryview) -> bytes:
        """Encrypt ``payload`` into ``out`` (as long); the tag (``encrypt_data`` on)."""
        seal = self.seal_data(header, encrypt=True)
        seal.encrypt_into(payload, out)
        return seal.finish()

    def decrypt_data_into(
        self, header: bytes, ciphertext: memoryview, out: memoryview,
        tag: bytes | bytearray | memoryview,
    ) -> None:
        """Decrypt ``ciphertext`` into ``out``; raise ``RemoteProtocolError`` if the
        tag fails (``out`` then holds garbage the caller must discard)."""
        opening = self.open_data(header, decrypt=True)
        opening.decrypt_into(ciphertext, out)
        opening.finish(tag)

    # --- a data frame as the transport sends and receives it ------------------------------

    def protect_data(self, header: bytes, payload: memoryview) -> list[memoryview]:
        """What to send for a data frame: ``[header, payload, tag]``, the payload
        encrypted into a new buffer with ``encrypt_data`` (else sent from where it is)."""
        if not self.encrypt_data:
            return [memoryview(header), payload, memoryview(self.tag_data(header, payload))]
        ciphertext = memoryview(bytearray(len(payload)))
        tag = self.encrypt_data_into(header, payload, ciphertext)
        return [memoryview(header), ciphertext, memoryview(tag)]

    def accept_data(
        self, header: bytes, payload: memoryview, tag: bytes | bytearray | memoryview
    ) -> None:
        """Check a received data frame's ``payload`` (decrypted in place with
        ``encrypt_data``).

        Raises:
            RemoteProtocolError: forged, altered, replayed or reordered; ``payload``
                then holds bytes that must not be used.
        """
        opening = self.open_data(header)
        opening.update(payload)
        opening.finish(tag)


class DataSeal:
    """The protection of one data frame being sent, fed its payload in order, in parts
    of any size: ``authenticate`` each part after it is sent (tags only), or
    ``encrypt_into`` each part before it is sent (``encrypt``); then ``finish`` gives the
    tag that follows the payload. Fed in parts or whole, the tag is the same."""

    def __init__(self, key: bytes, nonce: bytes, header: bytes, *, encrypt: bool) -> None:
        self.header = header
        self.encrypt = encrypt
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._gcm.authenticate_additional_data(header)

    def authenticate(self, part: memoryview) -> None:
        if self.encrypt:
            raise LocalProtocolError("an encrypting seal encrypts its payload")
        self._gcm.authenticate_additional_data(part)

    def encrypt_into(self, part: memoryview, out: memoryview) -> None:
        """Encrypt ``part`` into ``out`` (as long: GCM is a stream mode)."""
        if not self.encrypt:
            raise LocalProtocolError("a tagging seal sends its payload as it is")
        self._gcm.update_into(part, out)

    def finish(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag


class DataOpening:
    """The check of one received data frame, fed its payload in order, in parts of any
    size, as it arrives (decrypted in place with ``decrypt``); ``finish(tag)`` raises
    unless the frame is authentic. Until it returns, the payload must not be used."""

    def __init__(self, key: bytes, nonce: bytes, header: bytes, *, decrypt: bool) -> None:
        self.decrypt = decrypt
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).decryptor()
        self._gcm.authenticate_additional_data(header)

    def update(self, part: memoryview) -> None:
        """Take the next part of the payload (decrypted in place with ``decrypt``)."""
        if self.decrypt:
            self._gcm.update_into(part, part)
        else:
            self._gcm.authenticate_additional_data(part)

    def decrypt_into(self, part: memoryview, out: memoryview) -> None:
        """Decrypt the next part of the payload into ``out`` (as long)."""
        if not self.decrypt:
            raise LocalProtocolError("a tag-only frame is not decrypted")
        self._gcm.update_into(part, out)

    def finish(self, tag: bytes | bytearray | memoryview) -> None:
        """Raises:
            RemoteProtocolError: the frame was forged, altered, replayed or reordered.
        """
        try:
            self._gcm.finalize_with_tag(bytes(tag))
        except (InvalidTag, ValueError):
            raise RemoteProtocolError("a data frame failed its authentication") from None
