"""Finding the run's master by name, and electing one among the peers.

Theory of operation
-------------------
The rules are ``_core.election``'s; this module carries them out with the network's
``Directory`` (mDNS over TCP, the in-memory network's own in tests), the master
session and the communicator's nursery.

``Finder`` serves every ``Communicator(discover=RUN)``: ``targets`` browses the
directory and returns the addresses to dial for the run's master (its advertised
masters, then the ports candidates reserved), and once the member has lost its master,
``refresh`` points the session at a fresh list, so that a master elected or started
elsewhere in the meantime is found.

``Elector`` is a candidate's part (``host_master=True``):

* ``stand`` reserves the port its master would listen on and advertises the candidacy
  (role, rank key, port) for as long as the communicator lives.
* ``elect`` is ``connect``'s: it looks for the other candidates for an election
  timeout, then dials the run's masters and the candidates ranked before it until one
  answers (``join``), and hosts the master itself when its turn has come
  (``_core.election.hosting_at``).
* ``master_lost`` is the session's hook: a member whose master is lost refreshes the
  list; if another master of the run answers (one started by hand, or the one an
  elected master stepped down for), the session goes over to it and nothing is
  elected. Otherwise it leaves the lost master's host out of the order, and hosts
  when its turn comes unless the session got a master back first. A master hosted here learns the run
  from the members coming back (``_core.recovery``), this peer's own session included
  (it dials its own reserved port like any other).
* Hosting runs ``serve_master`` on the reserved port in the communicator's nursery,
  numbering peers from a random base, and advertises it as a master of the run with
  this candidate's rank; every ``WATCH_TIMEOUTS`` election timeouts it looks at the
  run's masters, and steps down (the master stops, its advertisement is withdrawn) when
  one outranks it and proves to be a master of the run (``MasterSession.probe``): one
  master per run, whatever the candidates saw when they elected.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from .._config import Config
from .._core.discovery import MasterAdvert, auth_tag, check_run_name, choose
from .._core.election import first_peer_id, hosting_at, in_order, outranking, position, rank_of, targets
from .._errors import InvalidArgument, PCCLError
from ..master import serve_master
from ..transport import (
    ADVICE,
    MISSING_ZEROCONF,
    Directory,
    DiscoveringNetwork,
    Network,
    Reservation,
    advertise_master,
    discovery_available,
    format_address,
    is_loopback,
    reaches_other_machines,
)
from ._lifecycle import Lifecycle
from ._session import MasterSession

__all__ = ["MAX_TARGETS", "Elector", "Finder", "check_discover"]

log = logging.getLogger("pccl_trio.election")

#: Addresses tried at most when dialing for the run's master: each may cost
#: ``Config.connect_timeout``.
MAX_TARGETS = 8
#: How long a browse made while the run is going listens (seconds): masters and
#: candidates answer within about 120 ms, then the browse settles.
LOOK_SECONDS = 1.0
#: A hosting candidate looks for masters that outrank its own every this many
#: election timeouts.
WATCH_TIMEOUTS = 3


def check_discover(
    run: str, config: Config, network: Network, *, candidate_host: str | None = None
) -> DiscoveringNetwork:
    """Refuse ``discover=run`` where it cannot work; ``candidate_host``: the host a
    candidate (``host_master=True``) would host the master on. The network, as one
    that finds masters (and reserves the port a candidate's master would take)."""
    try:
        check_run_name(run)
    except ValueError as exc:
        raise InvalidArgument(f"discover: {exc}") from None
    if not isinstance(network, DiscoveringNetwork):
        raise InvalidArgument(
            "discover= finds masters where a network advertises them (mDNS on real "
            f"networks); {type(network).__name__} has no directory: give the master's address"
        )
    if not reaches_other_machines(network):
        return network
    if config.secret is None and not config.insecure:
        raise InvalidArgument(
            f"discover={run!r} looks for a master on other hosts, which a peer without a "
            f"run secret does not reach: {ADVICE}"
        )
    if candidate_host is not None and is_loopback(candidate_host):
        raise InvalidArgument(
            f"host_master=True with p2p_host={candidate_host!r}: a master elected here would "
            "listen on loopback, which the other peers of the run cannot reach; use "
            "p2p_host='0.0.0.0' (the default) or an interface's address"
        )
    if not discovery_available():
        raise InvalidArgument(f"discover={run!r}: {MISSING_ZEROCONF}")
    return network


Join = Callable[[Sequence[tuple[str, int]]], Awaitable[bool]]


class Finder:
    """The addresses of a run's master, from the network's directory (see the module
    docstring)."""

    def __init__(
        self, *, run: str, config: Config, directory: Directory, lifecycle: Lifecycle,
        session: MasterSession,
    ) -> None:
        self.run = run
        self.tag = auth_tag(config.secret, run)
        self.directory = directory
        self._life = lifecycle
        self._session = session
        self.own: MasterAdvert | None = None  # this peer's candidacy, if it stands

    async def look(self, seconds: float) -> tuple[list[MasterAdvert], list[MasterAdvert]]:
        """The run's masters (in ``master_order``) and candidates (in election order)
        seen within ``seconds`` (less once a master is seen)."""
        seen = await self.directory.browse(
            seconds, lambda a: a.role == "master" and a.mismatch(self.run, self.tag) is None
        )
        adverts = list(seen.adverts.values())
        masters = list(choose(adverts, self.run, self.tag).matching)
        candidates = in_order([*adverts, *([self.own] if self.own else [])], self.run, self.tag)
        log.debug(
            "run %r: masters %s; candidates %s", self.run,
            [f"{m.instance} at {m.address}" for m in masters] or "none",
            [f"{c.instance} at {c.address}" for c in candidates],
        )
        return masters, candidates

    async def refresh(self) -> None:
        """Point the lost master's session at the run's masters and candidates as they
        are seen now (kept as they were if nothing is seen)."""
        try:
            masters, candidates = await self.look(LOOK_SECONDS)
        except OSError as exc:
            log.warning("cannot look for the master of run %r: %s", self.run, exc)
            return
        found = targets(masters, candidates, limit=MAX_TARGETS)
        if found and self._session.away:
            self._session.retarget(found)

    def master_lost(self) -> None:
        self._life.spawn(self.refresh)

    async def watch(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Keep browsing the directory for as long as the communicator lives (looks
        then read what it heard: ``Directory.watching``)."""
        async with self.directory.watching() as live:
            self.directory = live
            task_status.started()
            await trio.sleep_forever()


class Elector:
    """A candidate to host the run's master (see the module docstring).

    Args:
        host: the interface its master would listen on (the p2p listener's).
        identity: its node identity's public key, from which its rank key is derived
            (``_core.election.rank_of``; None: a random rank key).
    """

    def __init__(
        self, *, finder: Finder, config: Config, network: DiscoveringNetwork, lifecycle: Lifecycle,
        session: MasterSession, host: str, identity: bytes | None,
    ) -> None:
        self._finder = finder
        self._config = config
        self._network = network
        self._life = lifecycle
        self._session = session
        self._host = host
        self.rank = rank_of(identity, config.secret, finder.run)
        self._reservation: Reservation | None = None
        self._port = 0
        self.hosting = False

    @property
    def _timeout(self) -> float:
        return self._config.election_timeout

    async def stand(self) -> None:
        """Reserve the master's port and advertise the candidacy (until the end)."""
        self._reservation = await self._network.reserve(self._host, 0)
        self._port = self._reservation.port
        nursery = self._life.nursery
        assert nursery is not None
        await nursery.start(self._advertise_candidacy)

    async def _advertise_candidacy(self, *, task_status: trio.TaskStatus[None]) -> None:
        async with advertise_master(
            self._finder.run, self._host, self._port, secret=self._config.secret,
            insecure=self._config.insecure, directory=self._finder.directory,
            role="candidate", rank=self.rank,
        ) as advert:
            self._finder.own = advert
            task_status.started()
            await trio.sleep_forever()

    async def elect(self, join: Join) -> None:
        """Join the run's master, hosting it when this candidate's turn comes."""
        own = self._finder.own
        assert own is not None
        masters, candidates = await self._finder.look(self._timeout)
        since = trio.current_time()
        while True:
            place = position(candidates, own.instance)
            found = targets(masters, candidates[:place], limit=MAX_TARGETS)
            if found and await join(found):
                return
            if trio.current_time() >= hosting_at(since, place, self._timeout):
                await self._start_hosting()
                if await join(targets(masters, candidates, limit=MAX_TARGETS)):
                    return
            await trio.sleep(self._config.heartbeat_interval)
            masters, candidates = await self._finder.look(LOOK_SECONDS)

    def master_lost(self) -> None:
        self._life.spawn(self._elect_again, self._session.address)

    async def _elect_again(self, lost: str) -> None:
        """Host the master once this candidate's turn comes, unless the session gets a
        master back first."""
        since = trio.current_time()
        own = self._finder.own
        assert own is not None
        try:
            masters, candidates = await self._finder.look(LOOK_SECONDS)
        except OSError as exc:
            log.warning("cannot look for the master of run %r: %s", self._finder.run, exc)
            masters, candidates = [], [own]
        gone = [c.instance for c in candidates if lost in _addresses(c) and c.instance != own.instance]
        place = position(candidates, own.instance, gone)
        if self._session.away:
            self._session.retarget(targets(masters, candidates, limit=MAX_TARGETS))
        others = [m for m in masters if lost not in _addresses(m)]
        if others and await self._session.probe(targets(others, [], limit=MAX_TARGETS)):
            log.info(
                "run %r lost its master at %s, and has another: going over to it",
                self._finder.run, lost,
            )
            return  # the session gets back to it; nothing to elect
        log.info(
            "run %r lost its master at %s: this candidate is #%d in line to host it",
            self._finder.run, lost, place,
        )
        with trio.move_on_at(hosting_at(since, place, self._timeout)):
            try:
                await self._session.until_back()
            except PCCLError:
                pass  # the run is over for this peer: nothing to host
            return
        if self._session.away and not self.hosting and self._life.failure is None:
            await self._start_hosting()

    # --- hosting -------------------------------------------------------------------------

    async def _start_hosting(self) -> None:
        if self.hosting:
            return
        reservation = self._reservation
        if reservation is None:
            reservation = await self._network.reserve(self._host, self._port)
        self._reservation = None
        listener = await reservation.listen()
        nursery = self._life.nursery
        assert nursery is not None
        self.hosting = True
        await nursery.start(self._host_master, listener)

    async def _host_master(
        self, listener: trio.abc.Listener[trio.abc.Stream], *, task_status: trio.TaskStatus[None]
    ) -> None:
        run = self._finder.run
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(
                    serve_master, [listener], config=self._config, first_peer_id=first_peer_id(),
                ))
                log.warning("elected to host the master of run %r on port %d", run, self._port)
                task_status.started()
                async with advertise_master(
                    run, self._host, self._port, secret=self._config.secret,
                    insecure=self._config.insecure, directory=self._finder.directory,
                    rank=self.rank,
                ) as advert:
                    winner = await self._outranked(advert)
                    log.warning(
                        "run %r has another master at %s (%s) that comes first: this one steps "
                        "down, and its members go over to it", run, winner.address, winner.instance,
                    )
                nursery.cancel_scope.cancel()
        finally:
            self.hosting = False

    async def _outranked(self, own: MasterAdvert) -> MasterAdvert:
        """Return the first master seen that outranks ``own``."""
        while True:
            await trio.sleep(WATCH_TIMEOUTS * self._timeout)
            try:
                masters, _ = await self._finder.look(LOOK_SECONDS)
            except OSError as exc:
                log.warning("cannot look for other masters of run %r: %s", self._finder.run, exc)
                continue
            winner = outranking(own, masters)
            if winner is not None and await self._session.probe(
                targets([winner], [], limit=MAX_TARGETS)
            ):
                return winner
            if winner is not None:
                log.warning(
                    "run %r: the master advertised as %s (%s) would come first, but it does not "
                    "prove to be one of this run: ignored", self._finder.run, winner.instance,
                    winner.address,
                )


def _addresses(advert: MasterAdvert) -> list[str]:
    return [format_address(host, advert.port) for host in advert.addresses]
