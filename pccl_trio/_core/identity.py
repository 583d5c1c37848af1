"""Peer identities: proving, on one connection, that a peer holds its node key (sans-IO).

Theory of operation
-------------------
A node may have a persistent Ed25519 key (its *identity*; the public half is 32 bytes).
A connection protected by the run secret has a *binding* (``Channel.binding``), a value
only its two ends know, new for every connection. A peer proves its identity on a
connection by signing the binding with its key (``prove``); the other end checks the
signature against the public key it states (``verify``); the handshake carries both
(``channel``), and the caller compares the key with the one it expects for that peer.
The signed message names the signer's role (client or server), so a proof cannot be
reflected back to its maker, nor replayed on another connection (other binding), nor
made without the key. Identities need a run secret: without one there is no binding
to sign.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .errors import RemoteProtocolError

__all__ = ["IDENTITY_SIZE", "PROOF_SIZE", "fingerprint", "prove", "public_bytes", "verify"]

#: Bytes of a public identity key.
IDENTITY_SIZE = 32
#: Bytes of a proof (an Ed25519 signature).
PROOF_SIZE = 64
_CONTEXT = b"pccl-trio identity proof 1\x00"


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    """The 32-byte public identity of ``key``."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def fingerprint(identity: bytes) -> str:
    """A short, printable name for a public identity, for messages and logs."""
    return identity[:8].hex() if identity else "none"


def prove(key: Ed25519PrivateKey, binding: bytes, role: bytes) -> bytes:
    """The proof that the holder of ``key`` is the ``role`` end (``b"client"`` or
    ``b"server"``) of the connection with ``binding``."""
    return key.sign(_CONTEXT + role + b"\x00" + binding)


def verify(identity: bytes, binding: bytes, role: bytes, proof: bytes) -> None:
    """Check that ``proof`` was made by the holder of ``identity`` as the ``role`` end
    of the connection with ``binding``.

    Raises:
        RemoteProtocolError: it was not (or the key or proof is malformed).
    """
    if len(identity) != IDENTITY_SIZE or len(proof) != PROOF_SIZE or not binding:
        raise RemoteProtocolError("a malformed identity proof")
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(
            proof, _CONTEXT + role + b"\x00" + binding
        )
    except (InvalidSignature, ValueError):
        raise RemoteProtocolError("the identity proof does not hold for this connection") from None
