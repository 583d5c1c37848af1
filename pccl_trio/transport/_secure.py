"""The run-secret handshake on a trio stream: the IO around ``_core.channel``.

Theory of operation
-------------------
With a run secret, every connection starts with the three fixed-size handshake
messages of ``_core.channel`` before any frame: the connecting side calls
``secure_client``, the accepting side ``secure_server``, each within the credential's
deadline. Messages are read with exact lengths, so no byte of the first frame is taken
early; nothing is parsed but the fixed-size handshake, whose first four bytes (the
magic) are judged as they arrive, so a stranger's plain frame is refused at once. Both return the connection's
``Channel``, which the caller hands to the ``FramedStream`` it builds on the stream.

A side that fails (wrong secret, a stranger's bytes, too slow) gets an exception and
the caller closes the connection without sending any text: a stranger learns nothing
but that the connection closed.

A credential may hold the node's identity key (``Config.identity``): both sides then
prove their keys within the same messages, and ``Channel.peer_identity`` holds the
other side's; the caller decides whether it is the one it expected.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import trio

from .._core.channel import (
    HELLO_SIZE,
    MAGIC,
    REPLY_SIZE,
    Channel,
    ClientHandshake,
    Purpose,
    ServerHandshake,
    check_secret,
)
from .._identity import load_identity

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from .._config import Config

__all__ = ["Credential", "secure_client", "secure_server"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Credential:
    """What a side needs to open protected connections.

    Attributes:
        secret: the run secret (at least ``channel.MIN_SECRET_BYTES`` bytes).
        encrypt_data: encrypt data-frame payloads too (else they carry a tag only).
        timeout: seconds the whole handshake may take.
        identity: this node's identity key, proven in every handshake (None: none).
    """

    secret: bytes = dataclasses.field(repr=False)
    encrypt_data: bool = False
    timeout: float = 5.0
    identity: Ed25519PrivateKey | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_secret(self.secret)

    @classmethod
    def of(cls, config: Config) -> Credential | None:
        """The credential ``config`` names (None: it has no run secret); handshakes
        get ``connect_timeout``, and the identity key is read from ``config.identity``.

        Raises:
            IdentityError: the identity key file cannot be used.
            ValueError: an identity or allowlist without a run secret.
        """
        secret = config.secret
        if secret is None:
            if (config.identity is not None or config.allowed_identities is not None
                    or config.master_identities is not None):
                raise ValueError(
                    "node identities need a run secret (Config.run_secret or "
                    "$PCCL_TRIO_RUN_SECRET): a handshake without one has nothing to sign"
                )
            return None
        return cls(
            secret=secret, encrypt_data=config.data_protection == "encrypt",
            timeout=config.connect_timeout,
            identity=None if config.identity is None else load_identity(config.identity),
        )


async def _receive_exactly(stream: trio.abc.Stream, size: int) -> bytes:
    """Exactly ``size`` bytes from ``stream`` (never more).

    Raises:
        trio.BrokenResourceError: the stream ended first.
    """
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise trio.BrokenResourceError("connection closed during the handshake")
        data += chunk
    return bytes(data)


async def secure_client(stream: trio.abc.Stream, credential: Credential, purpose: Purpose) -> Channel:
    """Run the connecting side of the handshake on ``stream``.

    Raises:
        channel.HandshakeFailed: the other side does not hold the run secret.
        trio.TooSlowError: it did not answer within the credential's timeout.
        trio.BrokenResourceError: the connection broke or was closed (a server that
            refuses the secret closes without a word).
    """
    handshake = ClientHandshake(
        credential.secret, purpose, encrypt_data=credential.encrypt_data,
        identity=credential.identity,
    )
    with trio.fail_after(credential.timeout):
        await stream.send_all(handshake.hello())
        reply = await _receive_exactly(stream, REPLY_SIZE)
        extra = handshake.reply_extra(reply)
        if extra:
            reply += await _receive_exactly(stream, extra)
        await stream.send_all(handshake.finish(reply))
    assert handshake.channel is not None
    return handshake.channel


async def secure_server(
    stream: trio.abc.Stream, credential: Credential, purposes: frozenset[Purpose]
) -> tuple[Purpose, Channel]:
    """Run the accepting side of the handshake on ``stream``: the purpose the client
    named (one of ``purposes``) and the connection's channel.

    Raises:
        channel.HandshakeFailed: not a client of this run, or for another purpose.
        trio.TooSlowError: the client did not finish within the credential's timeout.
        trio.BrokenResourceError: the connection broke.
    """
    handshake = ServerHandshake(
        credential.secret, purposes, encrypt_data=credential.encrypt_data,
        identity=credential.identity,
    )
    with trio.fail_after(credential.timeout):
        head = await _receive_exactly(stream, len(MAGIC))
        handshake.opening(head)
        reply = handshake.reply(head + await _receive_exactly(stream, HELLO_SIZE - len(MAGIC)))
        await stream.send_all(reply)
        handshake.finish(await _receive_exactly(stream, handshake.finish_size))
    assert handshake.purpose is not None and handshake.channel is not None
    return handshake.purpose, handshake.channel
