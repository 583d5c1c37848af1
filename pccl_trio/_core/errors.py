"""Protocol errors raised inside the sans-IO core (h11's split).

``RemoteProtocolError``: the other side broke the protocol; the shell drops that
connection (and the master kicks that peer with the message as its reason).
``LocalProtocolError``: this process broke its own protocol, i.e. a bug here.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ProtocolError(Exception):
    """Base of both protocol errors."""


class RemoteProtocolError(ProtocolError):
    """The remote side sent something the protocol does not allow."""


class LocalProtocolError(ProtocolError):
    """We were about to do something the protocol does not allow (a bug)."""
