"""mDNS/DNS-SD: advertising a master, and finding the masters of a run.

Theory of operation
-------------------
python-zeroconf does the multicast DNS. It is an optional dependency (the
``discovery`` extra), imported only when a master advertises or a peer browses; a
missing one is reported with the ``pip install`` line that brings it.

zeroconf runs its own asyncio loop in a thread of its own, and its synchronous API
(``Zeroconf``, ``register_service``, ``ServiceBrowser``, ``ServiceInfo.request``)
blocks the calling thread. So no zeroconf call is ever made from the trio thread:

* ``advertise_master`` registers the master's service instance from a worker thread
  (probing and announcing take about 1.7 s), yields while the master serves, and on
  the way out (cancellation included, shielded) sends the goodbye records and closes
  its ``Zeroconf``, again in a worker thread.
* ``browse`` runs one blocking browse in a worker thread (``run_in_thread``): a
  ``ServiceBrowser`` whose callbacks, called on zeroconf's threads, only queue the
  instance names they hear of; the worker takes them from the queue, resolves each
  (SRV, TXT and address records; usually already cached, as responders send them
  with the answer) and reads it with ``_core.discovery.read_advert``. An
  advertisement that cannot be read (a hostile or broken advertiser) is logged at
  debug level and ignored; so is one beyond ``MAX_ADVERTS``. The browse ends at its
  deadline, or ``SETTLE_SECONDS`` after the first advertisement a caller is waiting
  for (responders answer a query within about 120 ms, so the settle window sees every
  master that answered with it), or when the trio side is cancelled (``stop`` is set,
  and the worker returns within ``RESOLVE_SECONDS``). Its ``Zeroconf`` is closed on
  every path, in the worker.

``find_masters`` is what ``Communicator(discover=RUN)`` calls: the masters whose run,
protocol and run-secret tag match, the one to join first (``_core.discovery.choose``:
``_core.discovery.master_order``) first, with a warning naming them when several match, and
``MasterConnectionError`` saying what was seen when none does. The peer tries them
in that order: the tag tells runs apart but proves nothing (anyone who sees an
advertisement can copy it), so a copy that cannot complete the run-secret handshake
costs one failed connection, not the join. ``list_masters`` returns every suitable
master of a run, for callers that care about more than one (two masters of one run
are a split brain).

A ``Directory`` is where advertisements live: ``MDNS`` (the above) for real networks,
the in-memory network's own for tests (``pccl_trio.testing``); a network names its
directory (``network.directory``), and everything that advertises or browses takes
it from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import ipaddress
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

import trio

from .._config import Config
from .._core.discovery import (
    SERVICE_TYPE,
    MalformedAdvert,
    MasterAdvert,
    auth_tag,
    build_txt,
    check_run_name,
    choose,
    describe_seen,
    instance_name,
    order_addresses,
    read_advert,
)
from .._core.messages import PROTOCOL_VERSION
from .._errors import InvalidArgument, InvalidUsage, MasterConnectionError
from ._exposure import ADVICE, is_loopback
from ._threads import run_in_thread

__all__ = [
    "MDNS",
    "MISSING_ZEROCONF",
    "Directory",
    "MdnsDirectory",
    "advertise_master",
    "browse",
    "check_advertise",
    "discovery_available",
    "find_masters",
    "list_masters",
]

log = logging.getLogger("pccl_trio.discovery")

MISSING_ZEROCONF = (
    "finding masters on the network needs python-zeroconf, which is not installed: "
    "pip install 'pccl_trio[discovery]'"
)
#: After the first suitable master, keep listening this long for others (seconds).
SETTLE_SECONDS = 0.5
#: Longest wait for one instance's records (seconds); also bounds how long a
#: cancelled browse takes to return.
RESOLVE_SECONDS = 0.5
#: How often the browse checks its deadline and ``stop`` while nothing arrives.
_POLL_SECONDS = 0.05
#: Instances remembered at most; more are ignored (a flood from a hostile advertiser).
MAX_ADVERTS = 256
#: Times an instance is resolved before it is given up.
_RESOLVE_TRIES = 3
#: TTL of every record we advertise (seconds): a master that dies without its goodbye
#: stays in other hosts' caches this long (mDNS would keep its PTR 75 minutes).
RECORD_TTL = 120
_WILDCARDS_V4 = ("0.0.0.0",)
_WILDCARDS_ANY = ("", "::")


def discovery_available() -> bool:
    """Whether python-zeroconf can be imported."""
    return importlib.util.find_spec("zeroconf") is not None


def _zeroconf() -> ModuleType:
    try:
        import zeroconf
    except ImportError:
        raise ModuleNotFoundError(MISSING_ZEROCONF) from None
    return zeroconf


# --- advertising ----------------------------------------------------------------------


def check_advertise(run: str, host: str, *, secured: bool, insecure: bool) -> str:
    """``run`` if a master listening on ``host`` may advertise it.

    Raises:
        ValueError: a bad run name; no run secret and not ``insecure`` (such a master
            stays on loopback, out of reach of the peers an advertisement is for); a
            loopback ``host``.
    """
    try:
        check_run_name(run)
    except ValueError as exc:
        raise ValueError(f"cannot advertise: {exc}") from None
    if not (secured or insecure):
        raise ValueError(
            f"cannot advertise run {run!r} without a run secret: the master then listens on "
            f"loopback only, where no other host can reach it; {ADVICE}"
        )
    if is_loopback(host):
        raise ValueError(
            f"cannot advertise run {run!r} for a master listening on {host}: other hosts "
            "cannot reach loopback; listen on 0.0.0.0 or on an interface's address"
        )
    if not discovery_available():
        raise ValueError(MISSING_ZEROCONF)
    return run


def interface_addresses(host: str) -> list[str]:
    """The addresses a master listening on ``host`` is reached at: ``host`` itself, or
    for a wildcard this host's non-loopback addresses (IPv4 for ``0.0.0.0``; IPv6 too,
    link-local left out, for ``::`` and "")."""
    if host not in _WILDCARDS_V4 + _WILDCARDS_ANY:
        return [host]
    import ifaddr

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                text = ip.ip
            elif host in _WILDCARDS_ANY:
                text = ip.ip[0]
            else:
                continue
            address = ipaddress.ip_address(text)
            if address.is_loopback or (address.version == 6 and address.is_link_local):
                continue
            found.append(text)
    return list(dict.fromkeys(found))


def _local_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """This host's subnets."""
    import ifaddr

    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            with contextlib.suppress(ValueError):
                networks.append(ipaddress.ip_network(f"{text}/{ip.network_prefix}", strict=False))
    return networks


@dataclasses.dataclass
class _Registration:
    zeroconf: Any
    info: Any


def _register(advert: MasterAdvert, text: bytes, host: str) -> _Registration:
    """Register ``advert`` (blocking: probes, then announces)."""
    zc_module = _zeroconf()
    every, version = zc_module.InterfaceChoice.All, zc_module.IPVersion
    if host in _WILDCARDS_V4:
        zc = zc_module.Zeroconf(interfaces=every, ip_version=version.V4Only)
    elif host in _WILDCARDS_ANY:
        zc = zc_module.Zeroconf(interfaces=every, ip_version=version.All)
    else:
        zc = zc_module.Zeroconf(interfaces=[host])
    try:
        name = f"{advert.instance}.{SERVICE_TYPE}"
        info = zc_module.ServiceInfo(
            SERVICE_TYPE, name, port=advert.port, properties=text,
            parsed_addresses=list(advert.addresses), server=name, host_ttl=RECORD_TTL,
            other_ttl=RECORD_TTL,
        )
        zc.register_service(info)
    except BaseException:
        zc.close()
        raise
    return _Registration(zc, info)


def _unregister(registration: _Registration) -> None:
    """Send the goodbye records and close (blocking, about 0.3 s)."""
    try:
        registration.zeroconf.unregister_service(registration.info)
    finally:
        registration.zeroconf.close()


@contextlib.asynccontextmanager
async def advertise_master(
    run: str, host: str, port: int, *, secret: bytes | None, insecure: bool = False,
    directory: Directory | None = None, role: str = "master", rank: str = "",
) -> AsyncIterator[MasterAdvert]:
    """Advertise the master listening on ``host:port`` as a master of ``run`` (or, with
    ``role="candidate"``, a peer that may host one there) while the block runs; yields
    what it advertises. On leaving the block (cancelled too), the advertisement is
    withdrawn: other hosts' caches drop it at once.

    Raises:
        ValueError: ``check_advertise`` refuses, or a wildcard ``host`` on a host with
            no other address than loopback.
        OSError: zeroconf could not open its sockets.
    """
    directory = directory or MDNS
    if directory is MDNS:
        check_advertise(run, host, secured=secret is not None, insecure=insecure)
    addresses = await directory.addresses(host)
    if not addresses:
        raise ValueError(
            f"cannot advertise run {run!r}: this host has no address but loopback to advertise"
        )
    advert = MasterAdvert(
        instance=instance_name(run, secrets.token_hex(4)), run=run, protocol=PROTOCOL_VERSION,
        auth=auth_tag(secret, run), port=port, addresses=addresses, role=role, rank=rank,
    )
    async with directory.advertise(advert, host):
        yield advert


class Directory(Protocol):
    """Where masters (and candidates) of runs are advertised and found: the local
    network's mDNS (``MDNS``), or a test network's own."""

    async def addresses(self, host: str) -> tuple[str, ...]:
        """The addresses a listener on ``host`` is reached at from other hosts."""

    def advertise(self, advert: MasterAdvert, host: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Advertise ``advert`` (listening on ``host``) while the block runs."""

    async def browse(
        self, seconds: float, wanted: Callable[[MasterAdvert], bool] | None = None
    ) -> Seen:
        """The advertisements seen within ``seconds`` (see ``browse``)."""

    def watching(self) -> contextlib.AbstractAsyncContextManager[Directory]:
        """This directory, kept browsing while the block runs (cheaper, and surer to
        hear every advertisement, for callers that look again and again)."""


class MdnsDirectory:
    """The local network's mDNS/DNS-SD, through python-zeroconf (see the module
    docstring)."""

    async def addresses(self, host: str) -> tuple[str, ...]:
        return tuple(await trio.to_thread.run_sync(interface_addresses, host))

    @contextlib.asynccontextmanager
    async def advertise(self, advert: MasterAdvert, host: str) -> AsyncIterator[None]:
        text = build_txt(
            advert.run, protocol=advert.protocol, tag=advert.auth, role=advert.role,
            rank=advert.rank,
        )
        registered: list[_Registration] = []
        try:
            # Not abandoned when cancelled: the thread finishes, so what it registered
            # is withdrawn below.
            await trio.to_thread.run_sync(lambda: registered.append(_register(advert, text, host)))
        except BaseException:
            if registered:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_unregister, registered[0])
            raise
        registration = registered[0]
        what = "a candidate of run" if advert.role == "candidate" else "run"
        log.info(
            "advertising %s %r as %s on %s, port %d", what, advert.run, advert.instance,
            ", ".join(advert.addresses), advert.port,
        )
        try:
            yield
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await trio.to_thread.run_sync(_unregister, registration)
                except Exception as exc:  # the master is going away anyway
                    log.warning("withdrawing the advertisement of run %r (%s) failed: %s",
                                advert.run, advert.instance, exc)
                else:
                    log.info("withdrew the advertisement of run %r (%s)", advert.run, advert.instance)

    async def browse(
        self, seconds: float, wanted: Callable[[MasterAdvert], bool] | None = None
    ) -> Seen:
        return await browse(seconds, wanted)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Directory]:
        """A directory whose browses read one browse kept running while the block
        runs (``Watching``)."""
        seen, stop = Seen(), threading.Event()
        work = functools.partial(_browse, math.inf, None, stop, seen)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(run_in_thread, work, interrupt=stop.set))
            try:
                yield Watching(self, seen)
            finally:
                stop.set()  # the thread returns within RESOLVE_SECONDS


class Watching:
    """The local network's directory, browsed all along (``MdnsDirectory.watching``).

    mDNS responders multicast a record at most once a second, and a browse that starts
    just after another host's answer misses it; a browse kept running hears every
    answer and goodbye as it goes, and a look is a read of what it heard (waiting for
    up to ``seconds`` for something ``wanted``, then ``SETTLE_SECONDS`` for more)."""

    def __init__(self, directory: MdnsDirectory, seen: Seen) -> None:
        self._directory = directory
        self._seen = seen

    async def addresses(self, host: str) -> tuple[str, ...]:
        return await self._directory.addresses(host)

    def advertise(self, advert: MasterAdvert, host: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._directory.advertise(advert, host)

    async def browse(
        self, seconds: float, wanted: Callable[[MasterAdvert], bool] | None = None
    ) -> Seen:
        deadline = trio.current_time() + seconds
        while True:
            seen = self._seen.copy()
            if wanted is not None and any(wanted(advert) for advert in seen.adverts.values()):
                deadline = min(deadline, trio.current_time() + SETTLE_SECONDS)
                wanted = None
            if trio.current_time() >= deadline:
                return seen
            await trio.sleep(_POLL_SECONDS)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Directory]:
        yield self


#: The local network's directory.
MDNS = MdnsDirectory()


# --- browsing -------------------------------------------------------------------------


@dataclasses.dataclass
class Seen:
    """What a browse saw: the advertisements read, by instance name, and how many
    could not be read (filled in by the browsing thread, under ``lock``)."""

    adverts: dict[str, MasterAdvert] = dataclasses.field(default_factory=dict)
    unreadable: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def copy(self) -> Seen:
        with self.lock:
            return Seen(adverts=dict(self.adverts), unreadable=self.unreadable)


def _browse(
    seconds: float, wanted: Callable[[MasterAdvert], bool] | None, stop: threading.Event,
    seen: Seen | None = None,
) -> Seen:
    """Browse for ``seconds``, or until ``SETTLE_SECONDS`` after the first advertisement
    ``wanted`` accepts, or until ``stop`` is set (blocking; see the module docstring),
    keeping what it sees in ``seen`` as it goes."""
    zc_module = _zeroconf()
    seen = seen if seen is not None else Seen()
    unreadable: set[str] = set()
    end = time.monotonic() + seconds
    networks = _local_networks()
    names: queue.SimpleQueue[tuple[str, Any, int]] = queue.SimpleQueue()
    state = zc_module.ServiceStateChange

    def on_change(*, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        names.put((name, state_change, 0))

    zc = zc_module.Zeroconf(interfaces=zc_module.InterfaceChoice.All, ip_version=zc_module.IPVersion.V4Only)
    try:
        browser = zc_module.ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        try:
            while not stop.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    name, change, tries = names.get(timeout=min(_POLL_SECONDS, left))
                except queue.Empty:
                    continue
                if change is state.Removed:
                    with seen.lock:
                        seen.adverts.pop(name, None)
                        unreadable.discard(name)
                        seen.unreadable = len(unreadable)
                    continue
                if name not in seen.adverts and len(seen.adverts) + len(unreadable) >= MAX_ADVERTS:
                    log.debug("ignoring the advertisement %r: %d seen already", name, MAX_ADVERTS)
                    continue
                try:
                    info = zc_module.ServiceInfo(SERVICE_TYPE, name)
                    if not info.request(zc, int(min(RESOLVE_SECONDS, left) * 1000)):
                        if tries + 1 < _RESOLVE_TRIES:
                            names.put((name, change, tries + 1))
                        else:
                            log.debug("ignoring the advertisement %r: its records never came", name)
                        continue
                    advert = advert_of(info, networks)
                except Exception as exc:  # hostile input never ends a browse
                    log.debug("ignoring the advertisement %r: %s", name, exc,
                              exc_info=not isinstance(exc, MalformedAdvert))
                    with seen.lock:
                        seen.adverts.pop(name, None)
                        unreadable.add(name)
                        seen.unreadable = len(unreadable)
                    continue
                with seen.lock:
                    unreadable.discard(name)
                    seen.adverts[name] = advert
                    seen.unreadable = len(unreadable)
                if wanted is not None and wanted(advert):
                    end = min(end, time.monotonic() + SETTLE_SECONDS)
        finally:
            browser.cancel()
    finally:
        zc.close()
    return seen


def advert_of(
    info: Any, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()
) -> MasterAdvert:
    """The advertisement in zeroconf's resolved ``ServiceInfo`` ``info``, its addresses
    in the order to try them (``order_addresses``, this host's ``networks`` first).

    Raises:
        MalformedAdvert: it cannot be read, or has no address worth dialing.
    """
    advert = read_advert(
        instance=info.get_name(), text=info.text or b"", port=info.port,
        addresses=info.parsed_addresses(),
    )
    advert = dataclasses.replace(advert, addresses=order_addresses(advert.addresses, networks))
    if not advert.addresses:
        raise MalformedAdvert("it advertises no address but loopback or link-local ones")
    return advert


async def browse(seconds: float, wanted: Callable[[MasterAdvert], bool] | None = None) -> Seen:
    """Every pccl_trio master advertised on this host's networks within ``seconds``
    (less once one ``wanted`` accepts, see the module docstring), without blocking the
    event loop.

    Raises:
        ModuleNotFoundError: python-zeroconf is not installed.
        OSError: zeroconf could not open its sockets.
    """
    stop = threading.Event()
    return await run_in_thread(functools.partial(_browse, seconds, wanted, stop), interrupt=stop.set)


async def find_masters(
    run: str, *, secret: bytes | None, seconds: float, directory: Directory | None = None
) -> tuple[MasterAdvert, ...]:
    """The masters a peer holding ``secret`` may join to take part in ``run``, the one
    to join first (``master_order``) first: a master's advertisement can be copied
    by anyone on the network, so the peer goes on to the next when one fails the
    run-secret handshake.

    Raises:
        MasterConnectionError: no suitable master within ``seconds`` (saying what was
            seen instead), or the network could not be browsed.
    """
    tag = auth_tag(secret, run)
    started = time.monotonic()
    try:
        seen = await (directory or MDNS).browse(
            seconds, lambda advert: advert.role == "master" and advert.mismatch(run, tag) is None
        )
    except OSError as exc:
        raise MasterConnectionError(
            f"cannot look for the master of run {run!r}: mDNS failed ({exc}); give the "
            "master's address instead"
        ) from exc
    choice = choose(seen.adverts.values(), run, tag)
    if choice.chosen is None:
        wanted_secret = "this peer's run secret" if secret else "no run secret"
        raise MasterConnectionError(
            f"no master advertises run {run!r} on this network within {seconds:g} s (looking "
            f"for protocol {PROTOCOL_VERSION} and {wanted_secret}); seen: "
            f"{describe_seen(choice.others, seen.unreadable)}. Start `pccl-trio master "
            "--advertise RUN` with this run name and secret, or give the master's address"
        )
    if len(choice.matching) > 1:
        log.warning(
            "%d masters advertise run %r with this peer's run secret: %s; trying them in this "
            "order. A run should have one master: stop the others (elected masters step down by "
            "themselves)",
            len(choice.matching), run,
            ", ".join(f"{advert.instance} at {advert.address}" for advert in choice.matching),
        )
    log.info(
        "found the master of run %r at %s (%s) in %.2f s", run, choice.chosen.address,
        choice.chosen.instance, time.monotonic() - started,
    )
    return choice.matching


async def list_masters(run: str, *, config: Config | None = None) -> list[MasterAdvert]:
    """Every master advertising ``run`` that a peer with ``config``'s run secret (or
    ``$PCCL_TRIO_RUN_SECRET``) could join, in ``master_order``: what
    ``Communicator(discover=run)`` chooses from. It listens for the whole
    ``config.discovery_timeout``, to find them all; more than one means the run has
    several masters.

    Raises:
        InvalidArgument: ``run`` cannot name a run.
        InvalidUsage: python-zeroconf is not installed (the ``discovery`` extra).
        MasterConnectionError: mDNS could not be used (zeroconf's sockets failed).
    """
    try:
        check_run_name(run)
    except ValueError as exc:
        raise InvalidArgument(f"list_masters: {exc}") from None
    if not discovery_available():
        raise InvalidUsage(MISSING_ZEROCONF)
    config = (config or Config()).with_environment_secret()
    try:
        seen = await browse(config.discovery_timeout)
    except OSError as exc:
        raise MasterConnectionError(f"cannot look for masters of run {run!r}: mDNS failed ({exc})") from exc
    return list(choose(seen.adverts.values(), run, auth_tag(config.secret, run)).matching)
