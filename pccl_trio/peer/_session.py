"""The master link of a peer: registration, the one reader, the inbox, heartbeats, and
getting the master back when it is lost.

Theory of operation
-------------------
``open`` connects to the master (the first of its addresses, given or discovered, that
answers and completes the run-secret handshake, if the run has a secret), starts the
*reader* (the only task that ever receives from the link), registers, and returns once
the master's ``Welcome`` named this peer and imposed its liveness timers and whether
its shared-state votes carry content digests (``content_digest``); then the
*heartbeat* task starts.

**Liveness while the trainer computes.** A trainer may block the event loop for
minutes between calls, and the heartbeat task with it. So every link the master
welcomes gets a *keepalive* too (``transport.keep_alive``, on TCP in real time): a
thread that writes a ``Heartbeat`` whenever nothing was written on the link for a
heartbeat interval, sealed with the link's channel under the wire lock it shares with
the trio side's sends. It ends with its link (a lost master's link is closed, and the
link that replaces it gets its own), so the master still removes a peer that is dead,
stopped or cut off, but not one that is only busy. On the reading side, a reader whose
deadline passed while the loop was blocked looks once more at what is queued before
it judges the master silent. A live peer that never calls again is for the master's
stall handling (``Config.stall_timeout``).

The reader applies a few messages at once, in the order they arrive, through the
synchronous *routes* other parts registered (``route``): a ``CollectiveCommence``
makes an all-reduce attempt reachable by its number before any of its data frames
can be read, and a ``P2PInfo`` lets the round's predecessor connect. Then every
message goes into the *inbox*, where calls take the first message of the kind they
wait for (``wait_for``, PCCL's predicate-matched queue); ``discard`` drops messages
nobody will take any more. Heartbeats only prove the master alive. A ``Kick`` ends the
communicator (``Lifecycle.fail``) with the master's reason.

**Losing the master.** If the master sends nothing for the liveness timeout, closes
the link or breaks the protocol, a peer that is not a member yet fails (it has no
place in the run to come back to), and so does a member with ``Config.master_grace``
0. Otherwise the session is *away* for at most the grace. It wakes the calls waiting
for the master. A call whose outcome the lost master had decided and sent (a vote's
result or refusal, an attempt's verdict: ``_decided``) takes it from the inbox and ends
with it, since the master sent it to every peer concerned at once and the others may
have taken theirs already; the rest of the lost master's messages are dropped, and so
is whatever is left of them once a master takes the peer back. A step's follow-ups
(``send`` with the ``epoch`` of its vote) are never sent to another master: they raise
``MasterLost`` instead. The other calls get
``MasterLost``, which an all-reduce turns into ``CollectiveAborted`` with its input
restored and a membership call into a retry once the master is back (its vote died
with the master). ``send`` waits until the master is back; so does every call started
meanwhile. The session dials the master's addresses in turn, the lost one first, every
heartbeat interval, and registers again *as the member it was*: its id, its ring
neighbours and the revision its group expects next (``standing``), and the highest
round, attempt, sync or optimization number the master sent it (the master numbers
everything above it; ``_core.recovery`` says how a master judges such a return). A
``Welcome`` for the same id ends the absence: a new reader runs on the new link and
the calls go on. A ``Kick`` (say, the master had removed this peer) ends the
communicator with the reason, and so does the grace running out. Hooks given to
``on_away`` run as an absence begins (a peer that found its master by name looks for
the run's masters again, or elects one: ``_election``), and may ``retarget`` the
session meanwhile: each round of dialing uses the addresses as they were when it
began. ``probe`` tells whether a master of this run answers somewhere (the handshake
only: nothing is registered).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from .._config import Config
from .._core.channel import HandshakeFailed, Purpose
from .._core.errors import RemoteProtocolError
from .._core.identity import fingerprint
from .._core.messages import (
    M2C,
    PROTOCOL_VERSION,
    CollectiveVerdict,
    Heartbeat,
    Kick,
    Message,
    P2PEstablishResult,
    PeersPendingResult,
    Register,
    SharedStateComplete,
    SharedStatePlan,
    StatusReply,
    TopologyOptimized,
    Welcome,
    body_limits,
    message_kinds,
)
from .._core.wire import Admission
from .._errors import Kicked, MasterConnectionError, PCCLError
from ..transport import (
    Credential,
    FramedStream,
    Network,
    format_address,
    keep_alive,
    secure_client,
)
from ._lifecycle import Lifecycle, Status
from ._metrics import NO_METRICS, NoMetrics

__all__ = ["MasterLost", "MasterSession", "Standing"]

log = logging.getLogger("pccl_trio.peer")

_M = TypeVar("_M", bound=Message)

#: Fields of master messages that carry a number the master hands out in order (the
#: last of a lease's block included).
_NUMBERED = ("round", "seq", "sync", "optimization", "lease_last")

#: How a vote or an attempt ended, as the master decided it: the same message went to
#: every peer concerned at once. One that reached this peer before its master was lost
#: is still taken by the call waiting for it, as the peers that took theirs in time
#: did; dropping it would end this peer's call otherwise than theirs.
_DECIDED = (PeersPendingResult, P2PEstablishResult, SharedStateComplete, CollectiveVerdict)


def _decided(message: Message) -> bool:
    """Whether ``message`` ends a call as the master decided it (``_DECIDED``, or the
    refusal of a sync or an optimization vote: their plans, when not refused, start
    work that only the lost master could have finished)."""
    if isinstance(message, _DECIDED):
        return True
    if isinstance(message, SharedStatePlan | TopologyOptimized):
        return bool(message.error)
    return False


class MasterLost(MasterConnectionError):
    """The master was lost while a call needed it; the session is getting it back
    (``Config.master_grace``), and the call may be made again once it is."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """What a member tells a master it comes back to, besides its id."""

    predecessor: int = 0  # its ring neighbours (0: none)
    successor: int = 0
    next_revision: int = 0  # the shared-state revision its group expects next (0: unknown)
    predecessor_identity: bytes = b""  # the node identities the master named for them
    successor_identity: bytes = b""
    predecessor_gone: bool = False  # its connections from the predecessor broke


async def _no_standing() -> Standing:
    await trio.lowlevel.checkpoint()
    return Standing()


class MasterSession:
    """A peer's link to its master (see the module docstring).

    Args:
        addresses: ``(host, port)`` of the master and of its standbys, in the order
            to try them.
    """

    def __init__(
        self, *, config: Config, network: Network, lifecycle: Lifecycle,
        addresses: Sequence[tuple[str, int]], credential: Credential | None,
        metrics: NoMetrics = NO_METRICS,
    ) -> None:
        if not addresses:
            raise ValueError("a master session needs at least one address")
        self._config = config
        self._network = network
        self._life = lifecycle
        self._credential = credential
        self._metrics = metrics
        self._addresses = list(addresses)
        self._at = 0  # the address in use
        self.peer_id: int | None = None
        self.heartbeat_interval = config.heartbeat_interval
        self.liveness_timeout = config.liveness_timeout
        #: Whether the run requires content digests in shared-state votes (the master
        #: says so in ``Welcome``).
        self.content_digest = False
        #: Whether this peer is a member of the run (admitted by a round): only a member
        #: gets its master back.
        self.member = False
        #: What this member would tell a master it comes back to (set by the communicator).
        self.standing: Callable[[], Awaitable[Standing]] = _no_standing
        #: Whether each welcomed TCP link gets a keepalive thread (off only in tests that
        #: show what it prevents: ``PeerSeam.keepalive``).
        self.keepalive = True
        self._link: FramedStream | None = None
        self._epoch = 0  # links lost so far: a reader or call of an older link is stale
        self._away = False
        self._registration: Register | None = None
        self._high_water = 0  # the highest number the master handed this peer
        self._inbox: list[Message] = []
        self._inbox_lot = trio.lowlevel.ParkingLot()
        self._back_lot = trio.lowlevel.ParkingLot()
        self._routes: dict[type[Message], Callable[[Any], bool | None]] = {}
        self._away_hooks: list[Callable[[], None]] = []
        self._back_hooks: list[Callable[[], None]] = []
        lifecycle.on_failure(self._inbox_lot.unpark_all)
        lifecycle.on_failure(self._back_lot.unpark_all)

    @property
    def address(self) -> str:
        """The master's address in use (or last tried)."""
        return format_address(*self._addresses[self._at])

    @property
    def away(self) -> bool:
        """Whether the master is lost and not back yet."""
        return self._away

    def retarget(self, addresses: Sequence[tuple[str, int]]) -> None:
        """Use ``addresses`` instead of those given (``(host, port)``: discovered
        masters, best first)."""
        if not addresses:
            raise ValueError("a master session needs at least one address")
        self._addresses, self._at = list(addresses), 0

    def on_away(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called (it must not block) each time the master is lost and
        the session sets out to get it back."""
        self._away_hooks.append(hook)

    def on_back(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called (it must not block) each time a master took this member
        back after it was lost, before any call goes on."""
        self._back_hooks.append(hook)

    def route(self, kind: type[_M], apply: Callable[[_M], bool | None]) -> None:
        """Have the reader call ``apply`` on every ``kind`` message as it arrives, before
        queueing it (``apply`` must not block); a message ``apply`` returns True for is
        taken by it, not queued."""
        self._routes[kind] = apply

    # --- connecting ----------------------------------------------------------------------

    async def open(
        self, *, peer_group: int, p2p_port: int, advertised_host: str, pool_size: int,
        probing: bool = False,
    ) -> None:
        """Connect to the first address that answers, register, and wait for the
        master's ``Welcome``. ``probing``: addresses that do not answer are expected
        (an election looking for its master), and not worth a warning.

        Raises:
            MasterConnectionError: no master can be reached, or it went away.
            Kicked: the master refused this peer.
        """
        self._registration = Register(
            protocol_version=PROTOCOL_VERSION, peer_group=peer_group, p2p_port=p2p_port,
            advertised_host=advertised_host, pool_size=pool_size,
        )
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
            break
        else:
            if len(failures) == 1:
                raise failures[0]
            raise MasterConnectionError(
                f"none of {len(failures)} master addresses worked: "
                + "; ".join(str(failure) for failure in failures)
            ) from failures[-1]
        self._install(link)
        await self.send(self._registration)
        welcome = await self.wait_for(Welcome)
        self._welcomed(welcome)
        self._life.spawn(self._send_heartbeats)
        log.info("peer %d registered with the master at %s", self.peer_id, self.address)

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

    def _install(self, link: FramedStream) -> None:
        """Make ``link`` the master link, read by a reader of its own."""
        self._link = link
        self._life.spawn(self._read, link, self._epoch)

    def _welcomed(self, welcome: Welcome) -> None:
        """The master welcomed this peer on the link installed: adopt its timers, and
        keep the link alive while a trainer blocks the event loop."""
        self.peer_id = welcome.peer_id
        self.heartbeat_interval = welcome.heartbeat_interval
        self.liveness_timeout = welcome.liveness_timeout
        self.content_digest = welcome.content_digest
        if self.keepalive and self._link is not None:
            keep_alive(self._link, Heartbeat(), self.heartbeat_interval)

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()

    # --- sending -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Which master link this is: it changes each time the link is lost."""
        return self._epoch

    async def send(self, message: Message, *, epoch: int | None = None) -> int:
        """Send one message to the master (once it is back, if it is lost); the
        ``epoch`` of the link it went out on.

        ``epoch``: the message follows up a step of the master of that link (a round's
        ``P2PEstablished``, a sync's ``SharedStateDone``, a ``LinkMeasured``): if that
        master was lost, the step died with it, and the message is not sent to another
        (which would take it for a protocol error).

        Raises:
            MasterLost: the link broke while sending, or (``epoch``) before; the master
                is being got back.
            MasterConnectionError: the master is gone for good (the communicator fails).
        """
        if epoch is not None and (self._away or self._epoch != epoch):
            self._life.raise_if_failed()
            raise MasterLost(
                f"lost the master at {self.address} before sending {type(message).__name__}; "
                "the step it belonged to ended with that master"
            )
        await self.until_back()
        link, link_epoch = self._link, self._epoch
        assert link is not None
        try:
            await link.send_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._lost(
                MasterConnectionError(f"lost the connection to the master at {self.address} ({exc})"),
                link_epoch,
            )
            self._life.raise_if_failed()
            raise MasterLost(f"lost the master at {self.address} while sending ({exc})") from exc
        except BaseException:
            if link.closed:  # interrupted mid-frame: the link had to go
                self._life.fail(
                    MasterConnectionError(
                        f"a call was interrupted while sending {type(message).__name__} to the "
                        "master; the half-sent message ended this peer's link"
                    )
                )
            raise
        return link_epoch

    async def vote(self, message: Message) -> int:
        """Send a vote; from then on the running call must see it through. The
        ``epoch`` of the link it went out on (for the step's follow-ups, ``send``)."""
        epoch = await self.send(message)
        self._life.voted = True
        return epoch

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

    async def _send_heartbeats(self) -> None:
        while True:
            await trio.sleep(self.heartbeat_interval)
            try:
                await self.send(Heartbeat())
            except MasterLost:
                continue
            except PCCLError:
                return

    # --- receiving -----------------------------------------------------------------------

    async def wait_for(
        self, kind: type[_M] | tuple[type[_M], ...], match: Callable[[_M], bool] | None = None
    ) -> _M:
        """Take the first message of ``kind`` (and matching ``match``) from the inbox.

        Raises:
            MasterLost: the master was lost before such a message came (or is lost now;
                an outcome the lost master sent before, ``_decided``, is still taken).
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        epoch = self._epoch
        while True:
            for index, message in enumerate(self._inbox):
                if isinstance(message, kind) and (match is None or match(message)):
                    del self._inbox[index]
                    return message
            self._life.raise_if_failed()
            if self._away or self._epoch != epoch:
                raise MasterLost(
                    f"lost the master at {self.address} while waiting for "
                    f"{getattr(kind, '__name__', 'a reply')}"
                )
            await self._inbox_lot.park()

    def discard(self, unwanted: Callable[[Message], bool]) -> None:
        """Drop the queued messages nobody will wait for any more."""
        self._inbox = [m for m in self._inbox if not unwanted(m)]

    def _welcome_hint(self) -> str:
        """Why a master may never welcome a peer that sent no handshake."""
        if self.peer_id is not None or self._config.secret is not None:
            return ""
        return (
            " (it never welcomed this peer: if the run has a run secret, give this peer "
            "the same one, e.g. through PCCL_TRIO_RUN_SECRET)"
        )

    async def _read(self, link: FramedStream, epoch: int) -> None:
        try:
            while True:
                with trio.move_on_after(self.liveness_timeout) as silence:
                    message = await link.receive_message()
                if silence.cancelled_caught:
                    # After a pause (a stopped process, a long blocking step) the
                    # deadline passes before queued bytes are read: look once more.
                    with trio.move_on_after(min(0.1, self.heartbeat_interval)) as grace:
                        message = await link.receive_message()
                if silence.cancelled_caught and grace.cancelled_caught:
                    raise MasterConnectionError(
                        f"the master at {self.address} sent nothing for "
                        f"{self.liveness_timeout}s (liveness timeout): it or the network "
                        "is down" + self._welcome_hint()
                    )
                if isinstance(message, Kick):
                    raise Kicked(message.reason)
                if isinstance(message, Heartbeat):
                    continue
                for name in _NUMBERED:
                    self._high_water = max(self._high_water, getattr(message, name, 0))
                # Some messages change what the data path accepts: apply them here, in
                # order, before any later message or p2p frame can depend on them.
                if isinstance(message, Welcome):
                    self.peer_id = message.peer_id  # the routes below may need it
                apply = self._routes.get(type(message))
                if apply is not None and apply(message):
                    continue
                self._inbox.append(message)
                self._inbox_lot.unpark_all()
        except Kicked as exc:
            self._life.fail(exc)
        except MasterConnectionError as exc:
            self._lost(exc, epoch)
        except RemoteProtocolError as exc:
            self._lost(MasterConnectionError(f"the master sent malformed data ({exc})"), epoch)
        except trio.BrokenResourceError as exc:
            self._lost(
                MasterConnectionError(
                    f"lost the connection to the master at {self.address} ({exc})"
                    + self._welcome_hint()
                ),
                epoch,
            )
        except trio.ClosedResourceError:
            pass  # we closed the link ourselves, and whoever did recorded why

    # --- getting the master back ----------------------------------------------------------

    def _lost(self, error: MasterConnectionError, epoch: int) -> None:
        """The link of ``epoch`` is lost: get the master back, or fail (see the module
        docstring)."""
        if epoch != self._epoch or self._life.failure is not None or self._life.status is Status.CLOSED:
            return  # an older link, or the run is over anyway (or this peer leaves it)
        grace = self._config.master_grace
        if not (self.member and grace > 0):
            self._life.fail(MasterConnectionError(
                f"{error}; a run cannot go on without its master"
                + ("" if self.member else " (this peer was not admitted yet: connect again)")
            ))
            return
        self._epoch += 1
        self._away = True
        # The lost master's: no new master will follow up on them, but what it decided
        # stands (``_decided``) for the calls waiting for it.
        self._inbox = [m for m in self._inbox if _decided(m)]
        self._inbox_lot.unpark_all()
        link, self._link = self._link, None
        if link is not None:
            self._life.spawn(link.aclose)
        log.warning(
            "peer %s: %s; getting the master back (for up to %gs)", self.peer_id, error, grace
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
        # The calls ``_lost`` woke run first (they were scheduled before this task, and
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
                self._welcomed(outcome)
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
                    self.peer_id, self.address, trio.current_time() - lost_at,
                )
                return
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                break
            await trio.sleep(min(self.heartbeat_interval, remaining))
        where = ", ".join(dict.fromkeys(tried)) or self.address
        self._life.fail(MasterConnectionError(
            f"{error}; no master took this peer back within Config.master_grace ({grace:g}s) "
            f"at {where}: restart the run's master (or give the peers a standby "
            "address) and connect again"
        ))

    async def _rejoin(self, address: tuple[str, int], deadline: float) -> Welcome | Kick | None:
        """Register at ``address`` as the member this peer is; the master's answer
        (the link installed on a ``Welcome``), or None if none came."""
        assert self._registration is not None and self.peer_id is not None
        standing = await self.standing()
        register = dataclasses.replace(
            self._registration, rejoin=self.peer_id, predecessor=standing.predecessor,
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
            log.info("peer %s: no master back at %s yet (%s)", self.peer_id,
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
        if not isinstance(reply, Welcome) or reply.peer_id != self.peer_id:
            await link.aclose()
            self._life.fail(MasterConnectionError(
                f"the master at {format_address(*address)} answered this "
                f"peer's return as peer {self.peer_id} with {reply!r}"
            ))
            return None
        self._install(link)
        return reply
