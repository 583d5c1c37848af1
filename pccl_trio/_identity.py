"""A node's identity key on disk, created on first use and kept private; a master's
allowlist of public keys.

Theory of operation
-------------------
``load_identity(path)`` returns the node's Ed25519 key from ``path``, creating it the
first time (PEM, PKCS#8, readable by ``openssl pkey``). The file is created with
permissions 0600 and linked into place whole, so two processes starting at once end
with one key; its directory, if made here, gets 0700. Like ssh, a key file others may read is
refused: the key is what lets a master and the other peers tell this node from any
other holder of the run secret.

``load_allowlist(path)`` reads the public keys a master admits: one per line, as the
64 hex digits ``pccl-trio identity`` prints, optionally followed by a name; blank
lines and ``#`` comments are skipped, and a malformed line is refused with its number.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from ._core.identity import IDENTITY_SIZE, public_bytes

__all__ = ["IdentityError", "load_allowlist", "load_identity", "public_hex"]


class IdentityError(ValueError):
    """The identity key file cannot be used (says why)."""


def load_identity(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 key in ``path``, created there (0600) if the file does not exist.

    Raises:
        IdentityError: the file is readable by others, or is not an Ed25519 key.
    """
    file = Path(path).expanduser()
    if not file.exists():
        _create(file)
    mode = file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"the identity key {file} is accessible to other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {file}`"
        )
    try:
        key = load_pem_private_key(file.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{file} is not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{file} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def public_hex(key: Ed25519PrivateKey) -> str:
    """The public half of ``key`` as 64 hex digits (an allowlist line)."""
    return public_bytes(key).hex()


def load_allowlist(path: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public identity keys listed in ``path``.

    Raises:
        IdentityError: the file cannot be read, or a line is not a key.
    """
    file = Path(path).expanduser()
    try:
        lines = file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IdentityError(f"cannot read the allowlist {file}: {exc}") from None
    keys: set[bytes] = set()
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            key = bytes.fromhex(words[0])
        except ValueError:
            key = b""
        if len(key) != IDENTITY_SIZE:
            raise IdentityError(
                f"{file}, line {number}: {words[0][:80]!r} is not a public identity key "
                f"({2 * IDENTITY_SIZE} hex digits, as `pccl-trio identity` prints)"
            )
        keys.add(key)
    return frozenset(keys)


def _create(file: Path) -> None:
    if not file.parent.exists():
        file.parent.mkdir(mode=0o700, parents=True)
    pem = Ed25519PrivateKey.generate().private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
    )
    # Written aside, then linked into place: a reader never sees a partial key, and of
    # two processes starting at once, the second links nothing and uses the first's.
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(pem)
        try:
            os.link(temporary, file)
        except FileExistsError:
            pass
    finally:
        temporary.unlink(missing_ok=True)
