"""Which master a peer links to, and getting one back when it is lost: ``Reconnector``.

Theory of operation
-------------------
The session's master has one or more addresses, given or discovered, in the order to
try them; ``reach`` dials them in turn and returns the first link that answers and
completes the run-secret handshake (if the run has a secret), remembering which
address it was. ``probe`` tells whether a master of this run answers somewhere (the
handshake only: nothing is registered). ``retarget`` replaces the addresses.

**Losing the master.** If the master sends nothing for the liveness timeout, closes
the link or breaks the protocol, the session reports the loss here (``lost``). A peer
that is not a member yet fails (it has no place in the run to come back to), and so
does a member with ``Config.master_grace`` 0. Otherwise the session is *away* for at
most the grace, and the link is dropped: a new epoch begins, and whatever belonged to
the old link (its reader, a call's step) is stale. The inbox keeps only what the lost
master decided and sent (``Inbox.keep_decided``), and the calls waiting for the
master wake: a call whose outcome is among those takes it and ends with it, the others
get ``MasterLost`` (the session's). ``until_back`` waits until the master is back; the
session's sends do so, and so does every call started meanwhile.

Meanwhile ``_get_back`` dials the master's addresses in turn, the lost one first,
every heartbeat interval, and registers again *as the member it was* (``_rejoin``): its
id, its ring neighbours and the revision its group expects next (``standing``), and the
highest round, attempt, sync or optimization number the master sent it (``note``: the
master numbers everything above it; ``_core.recovery`` says how a master judges such a
return). A ``Welcome`` for the same id ends the absence: the session installs the new
link (with a new reader), what is left of the lost master's messages is dropped, and
the calls go on. A ``Kick`` (say, the master had removed this peer) ends the
communicator with the reason, and so does the grace running out. Hooks given to
``on_away`` run as an absence begins (a peer that found its master by name looks for
the run's masters again, or elects one: ``_election``), and may ``retarget`` meanwhile:
each round of dialing uses the addresses as they were when it began. Hooks given to
``on_back`` run when a master took this member back, before any call goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Awaitable, Callable, Sequence

import trio

from .._config import Config
from .._core.channel import HandshakeFailed, Purpose
from .._core.errors import RemoteProtocolError
from .._core.identity import fingerprint
from .._core.messages import (
    M2C,
    Heartbeat,
    Kick,
    Message,
    Register,
    StatusReply,
    Welcome,
    body_limits,
    message_kinds,
)
from .._core.wire import Admission
from .._errors import Kicked, MasterConnectionError
from ..transport import Credential, FramedStream, Network, format_address, secure_client
from ._inbox import Inbox
from ._lifecycle import Lifecycle
from ._metrics import NO_METRICS, NoMetrics

__all__ = ["Reconnector", "Standing", "no_standing"]

log = logging.getLogger("pccl_trio.peer")

#: Fields of master messages that carry a number the master hands out in order (the
#: last of a lease's block included).
_NUMBERED = ("round", "seq", "sync", "optimization", "lease_last")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """What a member tells a master it comes back to, besides its id."""

    predecessor: int = 0  # its ring neighbours (0: none)
    successor: int = 0
    next_revision: int = 0  # the shared-state revision its group expects next (0: unknown)
    predecessor_identity: bytes = b""  # the node identities the master named for them
    successor_identity: bytes = b""
    predecessor_gone: bool = False  # its connections from the predecessor broke


async def no_standing() -> Standing:
    """A member that tells nothing of itself."""
    await trio.lowlevel.checkpoint()
    return Standing()


class Session(typing.Protocol):
    """What reconnection reads and does of the master session."""

    peer_id: int | None
    member: bool  # admitted by a round: only a member gets its master back
    heartbeat_interval: float
    registration: Register | None  # how this peer registered first

    def install(self, link: FramedStream) -> None:
        """Make ``link`` the master link, read by a reader of its own."""

    def welcomed(self, welcome: Welcome) -> None:
        """The master welcomed this peer on the link installed."""

    def drop(self) -> None:
        """The link in use is lost: begin a new epoch and close it."""


class Reconnector:
    """Which master the session links to, and getting one back (see the module
    docstring).

    Args:
        addresses: ``(host, port)`` of the master and of its standbys, in the order
            to try them.
        standing: what this member tells a master it comes back to.
    """

    def __init__(
        self, *, config: Config, network: Network, lifecycle: Lifecycle, session: Session,
        inbox: Inbox, addresses: Sequence[tuple[str, int]], credential: Credential | None,
        standing: Callable[[], Awaitable[Standing]] = no_standing,
        metrics: NoMetrics = NO_METRICS,
    ) -> None:
        if not addresses:
            raise ValueError("a master session needs at least one address")
        self._config = config
        self._network = network
        self._life = lifecycle
        self._session = session
        self._inbox = inbox
        self._credential = credential
        self._standing = standing
        self._metrics = metrics
        self._addresses = list(addresses)
        self._at = 0  # the address in use
        self._away = False
        self._high_water = 0  # the highest number the master handed this peer
        self._back_lot = trio.lowlevel.ParkingLot()
        self._away_hooks: list[Callable[[], None]] = []
        self._back_hooks: list[Callable[[], None]] = []
        lifecycle.on_failure(self._back_lot.unpark_all)

    # --- which master ----------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The master's address in use (or last tried)."""
        return format_address(*self._addresses[self._at])

    def retarget(self, addresses: Sequence[tuple[str, int]]) -> None:
        """Use ``addresses`` instead of those given (``(host, port)``: discovered
        masters, best first)."""
        if not addresses:
            raise ValueError("a master session needs at least one address")
        self._addresses, self._at = list(addresses), 0

    async def reach(self, *, probing: bool = False) -> FramedStream:
        """A link to the first address that answers, its handshake done. ``probing``:
        addresses that do not answer are expected (an election looking for its
        master), and not worth a warning.

        Raises:
            MasterConnectionError: no master can be reached.
        """
        failures: list[MasterConnectionError] = []
        for index in range(len(self._addresses)):
            try:
                link = await self._dial(self._addresses[index])
            except MasterConnectionError as exc:
                failures.append(exc)
                if len(failures) < len(self._addresses):
                    log.log(
                        logging.DEBUG if probing else logging.WARNING,
                        "%s; trying the next master address", exc,
                    )
                continue
            self._at = index
            return link
        if len(failures) == 1:
            raise failures[0]
        raise MasterConnectionError(
            f"none of {len(failures)} master addresses worked: "
            + "; ".join(str(failure) for failure in failures)
        ) from failures[-1]

    async def probe(self, addresses: Sequence[tuple[str, int]]) -> bool:
        """Whether a master of this run answers at one of ``addresses``: it completes
        the run-secret handshake (and proves one of ``Config.master_identities``, if
        given). Nothing is registered; the connection is closed at once."""
        for address in addresses:
            try:
                link = await self._dial(address)
            except MasterConnectionError:
                continue
            await link.aclose()
            return True
        return False

    async def _dial(self, address: tuple[str, int]) -> FramedStream:
        """A new link to ``address``, its handshake done.

        Raises:
            MasterConnectionError: nobody answers there, or not with this run's secret.
        """
        host, port = address
        where = format_address(host, port)
        try:
            with trio.fail_after(self._config.connect_timeout):
                stream = await self._network.connect(host, port)
        except (OSError, trio.TooSlowError) as exc:
            raise MasterConnectionError(
                f"could not reach the master at {where} ({exc or 'timed out'}); "
                "check that `pccl-trio master` runs there and the address is right"
            ) from exc
        channel = None
        if self._credential is not None:
            try:
                channel = await secure_client(stream, self._credential, Purpose.MASTER)
            except (HandshakeFailed, trio.TooSlowError, trio.BrokenResourceError,
                    trio.ClosedResourceError) as exc:
                await trio.aclose_forcefully(stream)
                raise MasterConnectionError(
                    f"the master at {where} did not complete the run-secret "
                    f"handshake ({exc or 'timed out'}): it runs with another secret or "
                    "with none"
                ) from exc
            except BaseException:  # cancelled mid-handshake: leave no socket open
                await trio.aclose_forcefully(stream)
                raise
            expected = self._config.master_identities
            if expected is not None and channel.peer_identity not in expected:
                await trio.aclose_forcefully(stream)
                raise MasterConnectionError(
                    f"the master at {where} proved node identity "
                    f"{fingerprint(channel.peer_identity)}, which is not one of "
                    "Config.master_identities: not this run's master"
                )
        limit = self._config.max_control_frame
        # What a master may send: Welcome or Kick first, then its kinds and heartbeats.
        from_master = [
            c for c in message_kinds().values() if c.DIRECTION == M2C and c is not StatusReply
        ]
        return FramedStream(
            stream, max_control_frame=limit,
            admission=Admission(
                first=body_limits([Welcome, Kick], limit),
                then=body_limits([*from_master, Heartbeat], limit),
            ),
            channel=channel,
        )

    # --- away and back ---------------------------------------------------------------------

    @property
    def away(self) -> bool:
        """Whether the master is lost and not back yet."""
        return self._away

    def on_away(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called (it must not block) each time the master is lost and
        the session sets out to get it back."""
        self._away_hooks.append(hook)

    def on_back(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called (it must not block) each time a master took this member
        back after it was lost, before any call goes on."""
        self._back_hooks.append(hook)

    async def until_back(self) -> None:
        """Return once the master link is up (at once if it is).

        Raises:
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        while True:
            self._life.raise_if_failed()
            if not self._away:
                return
            await self._back_lot.park()

    def note(self, message: Message) -> None:
        """The master sent ``message``: remember the highest number it handed out."""
        for name in _NUMBERED:
            self._high_water = max(self._high_water, getattr(message, name, 0))

    def lost(self, error: MasterConnectionError) -> None:
        """The link in use is lost: get the master back, or fail (see the module
        docstring)."""
        if self._life.over or self._life.loop_ended:
            # The run is over anyway, this peer leaves it, or the trio.run it lives in
            # ended and closed its link (a blocking communicator's loop stopped under a
            # call): nothing can reconnect, and the background nursery is gone.
            return
        grace = self._config.master_grace
        if not (self._session.member and grace > 0):
            self._life.fail(MasterConnectionError(
                f"{error}; a run cannot go on without its master"
                + ("" if self._session.member else " (this peer was not admitted yet: connect again)")
            ))
            return
        self._away = True
        # The lost master's: no new master will follow up on them, but what it decided
        # stands for the calls waiting for it.
        self._inbox.keep_decided()
        self._inbox.wake()
        self._session.drop()
        log.warning(
            "peer %s: %s; getting the master back (for up to %gs)",
            self._session.peer_id, error, grace,
        )
        self._life.spawn(self._get_back, error)
        for hook in self._away_hooks:
            hook()

    async def _get_back(self, error: MasterConnectionError) -> None:
        """Dial the addresses in turn until a master takes this member back, or the
        grace runs out."""
        grace = self._config.master_grace
        lost_at = trio.current_time()
        deadline = lost_at + grace
        tried: list[str] = []
        # The calls ``lost`` woke run first (they were scheduled before this task, and
        # this checkpoint puts it after them): one that takes what the lost master
        # decided (a round's ring, a sync's revision) changes the standing reported below.
        await trio.lowlevel.checkpoint()
        while self._life.failure is None:
            # A fresh list may come meanwhile (``retarget``): this round tries this one.
            addresses, start = list(self._addresses), self._at
            for step in range(len(addresses)):
                index = (start + step) % len(addresses)
                if trio.current_time() >= deadline:
                    break
                outcome = await self._rejoin(addresses[index], deadline)
                if outcome is None:
                    tried.append(format_address(*addresses[index]))
                    continue
                if isinstance(outcome, Kick):
                    self._life.fail(Kicked(outcome.reason))
                    return
                if addresses[index] not in self._addresses:
                    self._addresses.insert(0, addresses[index])
                self._at = self._addresses.index(addresses[index])
                self._session.welcomed(outcome)
                # What the lost master decided and nobody took is nobody's now (only a
                # call that voted before the loss waits for it, and those took theirs).
                self._inbox.clear()
                self._away = False
                for hook in self._back_hooks:
                    hook()
                self._back_lot.unpark_all()
                self._metrics.reconnected()
                log.warning(
                    "peer %s: back with the master at %s after %.2fs",
                    self._session.peer_id, self.address, trio.current_time() - lost_at,
                )
                return
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            await trio.sleep(min(self._session.heartbeat_interval, remaining))
        where = ", ".join(dict.fromkeys(tried)) or self.address
        self._life.fail(MasterConnectionError(
            f"{error}; no master took this peer back within Config.master_grace ({grace:g}s) "
            f"at {where}: restart the run's master (or give the peers a standby "
            "address) and connect again"
        ))

    async def _rejoin(self, address: tuple[str, int], deadline: float) -> Welcome | Kick | None:
        """Register at ``address`` as the member this peer is; the master's answer
        (the link installed on a ``Welcome``), or None if none came."""
        registration = self._session.registration
        assert registration is not None and self._session.peer_id is not None
        standing = await self._standing()
        register = dataclasses.replace(
            registration, rejoin=self._session.peer_id, predecessor=standing.predecessor,
            successor=standing.successor, next_revision=standing.next_revision,
            high_water=self._high_water, predecessor_identity=standing.predecessor_identity,
            successor_identity=standing.successor_identity,
            predecessor_gone=standing.predecessor_gone,
        )
        link: FramedStream | None = None
        try:
            with trio.fail_at(min(deadline, trio.current_time() + self._config.connect_timeout)):
                link = await self._dial(address)
                await link.send_message(register)
                reply = await link.receive_message()
        except (MasterConnectionError, RemoteProtocolError, trio.TooSlowError,
                trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("peer %s: no master back at %s yet (%s)", self._session.peer_id,
                     format_address(*address), exc or "timed out")
            if link is not None:
                await link.aclose()
            return None
        except BaseException:  # cancelled (the communicator closes): leave no socket open
            if link is not None:
                with trio.CancelScope(shield=True):
                    await link.aclose()
            raise
        if isinstance(reply, Kick):
            await link.aclose()
            return reply
        if not isinstance(reply, Welcome) or reply.peer_id != self._session.peer_id:
            await link.aclose()
            self._life.fail(MasterConnectionError(
                f"the master at {format_address(*address)} answered this "
                f"peer's return as peer {self._session.peer_id} with {reply!r}"
            ))
            return None
        self._session.install(link)
        return reply
