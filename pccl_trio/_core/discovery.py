"""Finding a run's master on the local network: the advertisement and its rules.

Theory of operation
-------------------
A master started with ``--advertise RUN`` announces itself over mDNS/DNS-SD as one
instance of the service type ``_pccl-trio._tcp.local.``: the instance's SRV record
carries its port, its address records the addresses it listens on, and its TXT record
(RFC 6763, section 6: length-prefixed ``key=value`` strings) says which run it serves:

* ``txtvers=1``: the version of this record's layout;
* ``run=RUN``: the run name, 1 to 63 bytes of UTF-8 (a DNS label's limit);
* ``proto=N``: the master's ``PROTOCOL_VERSION``, in decimal;
* ``auth=TAG``, with a run secret only: the first 8 bytes, as hex, of
  HMAC-SHA256(secret, "pccl-trio discovery " + RUN). A peer holding the same secret
  computes the same tag, so it tells a master of its own run from a same-named run
  with another secret; an observer learns nothing about the secret from it (it could
  test guesses of a weak secret offline, as it could against a handshake it watched);
* ``role=candidate``, for a peer that may host the run's master if elected
  (``_core.election``) rather than a master: its port is the one its master would
  listen on; no ``role`` (or ``role=master``) is a master;
* ``rank=HEX``, for candidates and the masters they host: the candidate's rank key
  (lower-case hex), by which an election orders them.

Every master's instance name is unique (the run name, cut to fit, and random hex), so
two masters of one run are both visible: ``choose`` picks the first in
``master_order`` (a master started by hand before an elected one, elected ones by the
rank of their host, then the lowest instance name), and callers can list them all.

This module is the sans-IO part: building and parsing the TXT record, checking run
names, the tag, whether an advertisement suits a peer, the choice among several, the
order in which to try a master's addresses and the message when nothing suits. The
mDNS traffic (python-zeroconf, in worker threads) is ``transport._discovery``'s.
Everything read from the network is checked here: an advertisement that cannot be
read raises ``MalformedAdvert``, which the browser logs and ignores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Sequence

from .messages import PROTOCOL_VERSION

__all__ = [
    "MAX_RUN_BYTES",
    "ROLES",
    "SERVICE_TYPE",
    "MalformedAdvert",
    "MasterAdvert",
    "Choice",
    "auth_tag",
    "build_txt",
    "check_run_name",
    "choose",
    "describe_seen",
    "instance_name",
    "master_order",
    "order_addresses",
    "parse_txt",
    "read_advert",
]

#: The DNS-SD service type every pccl_trio master advertises.
SERVICE_TYPE = "_pccl-trio._tcp.local."
#: Longest run name, in bytes of UTF-8: one DNS label.
MAX_RUN_BYTES = 63
#: Version of the TXT record's layout (``txtvers``).
TXT_VERSION = 1
#: Bytes of the HMAC kept as the tag (hex: twice as many characters).
TAG_BYTES = 8
_TAG_CONTEXT = b"pccl-trio discovery "
#: Longest TXT key we read (RFC 6763 recommends at most 9 characters).
_MAX_KEY = 64
#: Longest ``proto``, ``auth`` or ``rank`` value we read.
_MAX_FIELD = 64
#: The roles an advertisement may have.
ROLES = ("master", "candidate")
#: Masters named one by one in a message; the rest are counted.
_MAX_DESCRIBED = 8
#: Characters of a run name shown in a message.
_MAX_SHOWN = 80


class MalformedAdvert(ValueError):
    """An advertisement that cannot be read (what is wrong is in the message)."""


def check_run_name(run: object) -> str:
    """``run`` if it can name a run: a non-empty ``str`` of at most 63 bytes of UTF-8
    without control characters.

    Raises:
        ValueError: saying what is wrong with it.
    """
    if not isinstance(run, str):
        raise ValueError(f"a run name must be a string, got {type(run).__name__}")
    if not run:
        raise ValueError("a run name must not be empty; pick one shared by the master and its peers")
    try:
        size = len(run.encode())
    except UnicodeEncodeError:
        raise ValueError(f"the run name {_shown(run)} is not valid Unicode") from None
    if size > MAX_RUN_BYTES:
        raise ValueError(
            f"the run name {_shown(run)} is {size} bytes of UTF-8; at most {MAX_RUN_BYTES} "
            "fit in a DNS label: pick a shorter one"
        )
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in run):
        raise ValueError(f"the run name {_shown(run)} holds control characters; pick a printable one")
    return run


def auth_tag(secret: bytes | None, run: str) -> str:
    """The ``auth`` tag of ``run`` for holders of ``secret`` ("" without one)."""
    if secret is None:
        return ""
    mac = hmac.new(secret, _TAG_CONTEXT + run.encode(), hashlib.sha256).digest()
    return mac[:TAG_BYTES].hex()


def instance_name(run: str, suffix: str) -> str:
    """A DNS-SD instance name for a master of ``run``: the run name (dots and
    backslashes replaced, cut on a character boundary) and ``suffix``, at most one
    DNS label long. The run itself is read from the TXT record, never from here."""
    base = run.replace(".", "-").replace("\\", "-")
    room = MAX_RUN_BYTES - 1 - len(suffix.encode())
    while len(base.encode()) > room:
        base = base[:-1]
    return f"{base}-{suffix}"


def build_txt(
    run: str, *, protocol: int = PROTOCOL_VERSION, tag: str = "", role: str = "master",
    rank: str = "",
) -> bytes:
    """The TXT record's data (RFC 6763 wire form) of a master (or candidate) of ``run``."""
    fields = [f"txtvers={TXT_VERSION}", f"run={run}", f"proto={protocol}"]
    if tag:
        fields.append(f"auth={tag}")
    if role != "master":
        fields.append(f"role={role}")
    if rank:
        fields.append(f"rank={rank}")
    out = bytearray()
    for field in fields:
        data = field.encode()
        assert len(data) <= 255, field
        out += bytes([len(data)]) + data
    return bytes(out)


def parse_txt(data: bytes) -> dict[str, bytes | None]:
    """The attributes of TXT record ``data``, keys lower-cased (RFC 6763, 6.3-6.4).

    A string without ``=`` is a boolean attribute (None), one starting with ``=`` is
    ignored, and only the first of repeated keys counts.

    Raises:
        MalformedAdvert: a length that runs past the end, or a key that is not
            printable ASCII.
    """
    found: dict[str, bytes | None] = {}
    at = 0
    while at < len(data):
        size = data[at]
        end = at + 1 + size
        if end > len(data):
            raise MalformedAdvert(f"a TXT string of {size} bytes runs past the record's {len(data)} bytes")
        string = data[at + 1:end]
        at = end
        key_bytes, equals, value = string.partition(b"=")
        if not key_bytes:
            continue  # empty, or a value without a key: ignored
        if len(key_bytes) > _MAX_KEY or not all(0x20 <= byte <= 0x7E for byte in key_bytes):
            raise MalformedAdvert(f"the TXT key {key_bytes[:_MAX_KEY]!r} is not printable ASCII")
        key = key_bytes.decode("ascii").lower()
        if key not in found:
            found[key] = value if equals else None
    return found


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MasterAdvert:
    """A master found on the network, as it advertises itself.

    Attributes:
        instance: its DNS-SD instance name, unique per master.
        run: the run it serves.
        protocol: its protocol version.
        auth: its tag (``auth_tag``); "" for a master without a run secret.
        port: the port it listens on (a candidate: would listen on).
        addresses: the addresses it listens on, in the order to try them.
        role: "master", or "candidate" for a peer that may host the master.
        rank: a candidate's rank key, or that of the candidate hosting this master
            ("" for a master started by hand).
    """

    instance: str
    run: str
    protocol: int
    auth: str
    port: int
    addresses: tuple[str, ...]
    role: str = "master"
    rank: str = ""

    def mismatch(self, run: str, tag: str, protocol: int = PROTOCOL_VERSION) -> str | None:
        """Why a peer looking for ``run`` with tag ``tag`` (``auth_tag`` of its
        secret) may not join this master, in a few words; None if it may."""
        if self.run != run:
            return f"run {_shown(self.run)}" + (
                f" (protocol {self.protocol})" if self.protocol != protocol else ""
            )
        if self.protocol != protocol:
            return f"run {_shown(run)} with protocol {self.protocol} (this peer speaks {protocol})"
        if self.auth == tag:
            return None
        if not tag:
            return f"run {_shown(run)} with a run secret (this peer has none)"
        if not self.auth:
            return f"run {_shown(run)} without a run secret"
        return f"run {_shown(run)} with another run secret"

    @property
    def address(self) -> str:
        """``host:port`` of its first address."""
        host = self.addresses[0]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def read_advert(*, instance: str, text: bytes, port: int | None, addresses: Iterable[str]) -> MasterAdvert:
    """The advertisement of instance ``instance`` from its TXT record data, SRV port
    and address records (in any order, as resolved; see ``order_addresses``).

    Raises:
        MalformedAdvert: anything missing or out of range (the message says what).
    """
    fields = parse_txt(text)
    run_bytes = fields.get("run")
    if not run_bytes:
        raise MalformedAdvert("the TXT record has no run=")
    try:
        run = run_bytes.decode()
    except UnicodeDecodeError:
        raise MalformedAdvert(f"run={run_bytes[:_MAX_SHOWN]!r} is not UTF-8") from None
    proto = fields.get("proto")
    if proto is None or not (0 < len(proto) <= 9 and proto.isdigit()):
        raise MalformedAdvert(f"proto={proto!r:.{_MAX_SHOWN}} is not a protocol version")
    auth = fields.get("auth") or b""
    if len(auth) > _MAX_FIELD or not all(chr(byte) in "0123456789abcdef" for byte in auth):
        raise MalformedAdvert(f"auth={auth[:_MAX_FIELD]!r} is not a tag in lower-case hex")
    role = (fields.get("role") or b"master").decode("ascii", "replace")
    if role not in ROLES:
        raise MalformedAdvert(f"role={role[:_MAX_FIELD]!r} is not one of {', '.join(ROLES)}")
    rank = fields.get("rank") or b""
    if len(rank) > _MAX_FIELD or not all(chr(byte) in "0123456789abcdef" for byte in rank):
        raise MalformedAdvert(f"rank={rank[:_MAX_FIELD]!r} is not a key in lower-case hex")
    if not (isinstance(port, int) and 0 < port <= 65535):
        raise MalformedAdvert(f"port {port!r} is not a TCP port")
    hosts = tuple(addresses)
    if not hosts:
        raise MalformedAdvert("it advertises no address")
    return MasterAdvert(
        instance=instance, run=run, protocol=int(proto), auth=auth.decode("ascii"), port=port,
        addresses=hosts, role=role, rank=rank.decode("ascii"),
    )


def order_addresses(
    addresses: Iterable[str],
    local_networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> tuple[str, ...]:
    """The addresses of a master worth dialing, best first.

    Addresses in one of ``local_networks`` (this host's subnets) come first, then IPv4
    before IPv6, each group in address order. Loopback, unspecified, multicast and
    IPv6 link-local addresses (unusable without an interface) are left out, and so is
    anything that is not an IP address.
    """
    usable: list[tuple[bool, int, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    for text in dict.fromkeys(addresses):
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if address.is_loopback or address.is_unspecified or address.is_multicast or (
            address.version == 6 and address.is_link_local
        ):
            continue
        near = any(address in network for network in local_networks if network.version == address.version)
        usable.append((not near, address.version, address))
    usable.sort(key=lambda item: (item[0], item[1], int(item[2])))
    return tuple(str(address) for _far, _version, address in usable)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """``choose``'s answer: the master to join (None: none suits), every master that
    suits (by instance name) and the others, with why not."""

    chosen: MasterAdvert | None
    matching: tuple[MasterAdvert, ...]
    others: tuple[tuple[MasterAdvert, str], ...]


def master_order(advert: MasterAdvert) -> tuple[bool, str, str]:
    """Sort key of the masters of one run, the one to join (and the one that stays in
    a split brain, ``_core.election``) first: a master started by hand before elected
    ones, elected ones by their host's rank key, ties by instance name."""
    return (advert.rank != "", advert.rank, advert.instance)


def choose(
    adverts: Iterable[MasterAdvert], run: str, tag: str, protocol: int = PROTOCOL_VERSION
) -> Choice:
    """The master of ``run`` a peer with tag ``tag`` joins: of the masters whose run,
    protocol and tag match, the first in ``master_order``. Candidates are no masters
    and are left out."""
    matching: list[MasterAdvert] = []
    others: list[tuple[MasterAdvert, str]] = []
    masters = (advert for advert in adverts if advert.role == "master")
    for advert in sorted(masters, key=master_order):
        reason = advert.mismatch(run, tag, protocol)
        if reason is None:
            matching.append(advert)
        else:
            others.append((advert, reason))
    return Choice(chosen=matching[0] if matching else None, matching=tuple(matching), others=tuple(others))


def describe_seen(others: Iterable[tuple[MasterAdvert, str]], unreadable: int = 0) -> str:
    """What a browse saw instead of a suitable master, for an error message: each
    distinct reason once (with how many masters gave it), at most a few."""
    counts: dict[str, int] = {}
    for _advert, reason in others:
        counts[reason] = counts.get(reason, 0) + 1
    parts = [
        reason if count == 1 else f"{reason} ({count} masters)"
        for reason, count in list(counts.items())[:_MAX_DESCRIBED]
    ]
    if len(counts) > _MAX_DESCRIBED:
        parts.append(f"{len(counts) - _MAX_DESCRIBED} more")
    if unreadable:
        parts.append(f"{unreadable} advertisement{'s' if unreadable > 1 else ''} that could not be read")
    return ", ".join(parts) if parts else "no pccl_trio master at all"


def _shown(run: str) -> str:
    """``run`` quoted for a message, cut if long."""
    return repr(run if len(run) <= _MAX_SHOWN else run[:_MAX_SHOWN] + "...")
