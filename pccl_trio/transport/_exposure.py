"""Which interfaces a run without a run secret may use.

Theory of operation
-------------------
Without a run secret nothing on a connection is authenticated, so anyone who can reach
a port can join the run, vote, and read or write its tensors. Such a run therefore
stays on loopback unless it was started ``insecure`` on purpose: a wildcard listen
address (``0.0.0.0``, ``::``, empty) is narrowed to ``127.0.0.1``, an explicit
non-loopback one is refused, and so is connecting to a master on another host. Either
way the choice is logged once, where the master or peer starts. With a secret every
interface is fine: the handshake keeps strangers out.
"""

from __future__ import annotations

import ipaddress
import logging

__all__ = ["ADVICE", "LOOPBACK", "is_loopback", "listen_host", "check_remote_host"]

log = logging.getLogger("pccl_trio")

LOOPBACK = "127.0.0.1"
_WILDCARDS = ("", "0.0.0.0", "::")
ADVICE = (
    "set a run secret (PCCL_TRIO_RUN_SECRET, `--secret-file`, or Config(run_secret=...)), "
    "or accept an unauthenticated run with `--insecure` / Config(insecure=True)"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost: it may resolve anywhere


def listen_host(host: str, *, secured: bool, insecure: bool, who: str) -> str:
    """The interface ``who`` (e.g. "the master") may listen on, asked for ``host``.

    Raises:
        ValueError: an explicit non-loopback interface without a secret or ``insecure``.
    """
    if secured:
        return host
    if insecure:
        if not is_loopback(host):
            log.warning(
                "%s runs without a run secret on %s: anyone who can reach it can join the "
                "run and read or change its tensors", who, host or "every interface",
            )
        return host
    if host in _WILDCARDS:
        log.warning(
            "%s has no run secret, so it listens on loopback (%s) only; to accept other "
            "hosts, %s", who, LOOPBACK, ADVICE,
        )
        return LOOPBACK
    if is_loopback(host):
        return host
    raise ValueError(f"{who} will not listen on {host} without a run secret: {ADVICE}")


def check_remote_host(host: str, *, secured: bool, insecure: bool, what: str) -> None:
    """Refuse to reach ``what`` at ``host`` off this machine without a secret.

    Raises:
        ValueError: ``host`` is not loopback, and neither a secret nor ``insecure``.
    """
    if secured or insecure or is_loopback(host):
        return
    raise ValueError(f"{what} at {host} is not on this machine and there is no run secret: {ADVICE}")
