"""A node's identity key on disk: created on first use, kept private.

Theory of operation
-------------------
``load_identity(path)`` returns the node's Ed25519 key from ``path``, creating it the
first time (PEM, PKCS#8, readable by ``openssl pkey``). The file is created with
permissions 0600 and linked into place whole, so two processes starting at once end
with one key; its directory, if made here, gets 0700. Like ssh, a key file others may read is
refused: the key is what lets a master and the other peers tell this node from any
other holder of the run secret.
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

__all__ = ["IdentityError", "load_identity"]


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
