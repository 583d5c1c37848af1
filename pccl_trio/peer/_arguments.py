"""The ``Communicator`` constructor's arguments, checked before anything is built.

Theory of operation
-------------------
A communicator does no IO until ``connect()``, so every argument that can be judged on
its own is judged here, at construction: which of the master's address and ``discover``
was given, the address list parsed, the peer group, pool size and p2p port in range.
Each mistake raises an ``InvalidArgument`` naming the argument and what it accepts.
Checks that need the config or the network (run secret, loopback, discovery) stay with
the parts that own them.
"""

from __future__ import annotations

from .._core.records import U32_MAX
from .._errors import InvalidArgument
from ..transport import parse_address

__all__ = ["check_arguments"]


def check_arguments(
    master_address: str | None,
    *,
    discover: str | None,
    host_master: bool,
    peer_group: int,
    pool_size: int,
    p2p_port: int,
) -> list[tuple[str, int]]:
    """The master's addresses (``[("", 0)]`` with ``discover``), the arguments checked
    (``pool_size``: ``p2p_connection_pool_size``).

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    if host_master and discover is None:
        raise InvalidArgument(
            "host_master=True elects a master among the peers that discover a run by "
            "name: give discover='RUN' (and no master address)"
        )
    if (master_address is None) == (discover is None):
        raise InvalidArgument(
            "give either the master's address (Communicator('host:port')) or the name of "
            "a run whose master to discover (Communicator(discover='RUN')), "
            + ("not both" if discover is not None else "got neither")
        )
    addresses: list[tuple[str, int]] = [("", 0)]
    if master_address is not None:
        try:
            addresses = [
                parse_address(part.strip()) for part in str(master_address).split(",")
            ]
        except ValueError as exc:
            raise InvalidArgument(f"master_address: {exc}") from None
    if not (isinstance(peer_group, int) and not isinstance(peer_group, bool)
            and 0 <= peer_group <= U32_MAX):
        raise InvalidArgument(f"peer_group must be an integer in [0, 2**32-1], got {peer_group!r}")
    if not (isinstance(pool_size, int)
            and not isinstance(pool_size, bool)
            and 0 <= pool_size <= 1024):
        raise InvalidArgument(
            "p2p_connection_pool_size must be an integer in [0, 1024] (0: default), "
            f"got {pool_size!r}"
        )
    if not (isinstance(p2p_port, int) and 0 <= p2p_port <= 65535):
        raise InvalidArgument(f"p2p_port must be 0-65535, got {p2p_port!r}")
    return addresses
