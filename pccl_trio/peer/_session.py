"""The master link of a peer: registration, the one reader, heartbeats; and the parts
it holds, the inbox and the reconnector.

Theory of operation
-------------------
``open`` connects to the master (the first of its addresses that answers,
``Reconnector.reach``), starts the *reader* (the only task that ever receives from the
link), registers, and returns once the master's ``Welcome`` named this peer and
imposed its liveness timers and whether its shared-state votes carry content digests
(``content_digest``); then the *heartbeat* task starts.

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
message goes into the *inbox* (``_inbox``), where calls take the first message of the
kind they wait for (``wait_for``); ``discard`` drops messages nobody will take any
more. Heartbeats only prove the master alive. A ``Kick`` ends the communicator
(``Lifecycle.fail``) with the master's reason.

**Losing the master** is the reconnector's (``_reconnect``): the reader, or a send,
that finds the link lost reports it there, and a member whose grace allows it is
*away* until a master takes it back. Each link is an *epoch*: a reader of an older
link reports nothing, a call waiting for a message from an older link's master gets
``MasterLost`` (unless what it waits for is an outcome that master decided, which the
inbox keeps), and a step's follow-ups (``send`` with the ``epoch`` of its vote) are
never sent to another master: they raise ``MasterLost`` instead. ``MasterLost`` is
what an all-reduce turns into ``CollectiveAborted`` with its input restored, and a
membership call into a retry once the master is back (its vote died with the master).
``send`` waits until the master is back; so does every call started meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from .._config import SECRET_ENVIRONMENT, Config
from .._core.errors import RemoteProtocolError
from .._core.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Kick,
    Message,
    Register,
    Welcome,
)
from .._errors import Kicked, MasterConnectionError, PCCLError
from ..transport import Credential, FramedStream, Network, keep_alive
from ._inbox import Inbox
from ._lifecycle import Lifecycle
from ._metrics import NO_METRICS, NoMetrics
from ._reconnect import Reconnector, Standing, no_standing

__all__ = ["MasterLost", "MasterSession"]

log = logging.getLogger("pccl_trio.peer")

_M = TypeVar("_M", bound=Message)


class MasterLost(MasterConnectionError):
    """The master was lost while a call needed it; the session is getting it back
    (``Config.master_grace``), and the call may be made again once it is."""


class MasterSession:
    """A peer's link to its master (see the module docstring).

    Args:
        addresses: ``(host, port)`` of the master and of its standbys, in the order
            to try them.
        standing: what this member tells a master it comes back to.
    """

    def __init__(
        self, *, config: Config, network: Network, lifecycle: Lifecycle,
        addresses: Sequence[tuple[str, int]], credential: Credential | None,
        metrics: NoMetrics = NO_METRICS,
        standing: Callable[[], Awaitable[Standing]] = no_standing,
    ) -> None:
        self._config = config
        self._life = lifecycle
        self.peer_id: int | None = None
        self.heartbeat_interval = config.heartbeat_interval
        self.liveness_timeout = config.liveness_timeout
        #: Whether the run requires content digests in shared-state votes (the master
        #: says so in ``Welcome``).
        self.content_digest = False
        #: Whether this peer is a member of the run (admitted by a round): only a member
        #: gets its master back.
        self.member = False
        #: Whether each welcomed TCP link gets a keepalive thread (off only in tests that
        #: show what it prevents: ``PeerSeam.keepalive``).
        self.keepalive = True
        #: How this peer registered (``open``); it registers again so, as who it was.
        self.registration: Register | None = None
        self._link: FramedStream | None = None
        self._epoch = 0  # links lost so far: a reader or call of an older link is stale
        self._routes: dict[type[Message], Callable[[Any], bool | None]] = {}
        self._inbox = Inbox()
        lifecycle.on_failure(self._inbox.wake)
        self._reconnector = Reconnector(
            config=config, network=network, lifecycle=lifecycle, session=self,
            inbox=self._inbox, addresses=addresses, credential=credential,
            standing=standing, metrics=metrics,
        )

    # --- the reconnector's, for the rest of the peer ------------------------------------

    @property
    def address(self) -> str:
        """The master's address in use (``Reconnector.address``)."""
        return self._reconnector.address

    @property
    def away(self) -> bool:
        """Whether the master is lost and not back yet (``Reconnector.away``)."""
        return self._reconnector.away

    def retarget(self, addresses: Sequence[tuple[str, int]]) -> None:
        """Use ``addresses`` instead of those given (``Reconnector.retarget``)."""
        self._reconnector.retarget(addresses)

    async def probe(self, addresses: Sequence[tuple[str, int]]) -> bool:
        """Whether a master of this run answers at one of ``addresses``
        (``Reconnector.probe``)."""
        return await self._reconnector.probe(addresses)

    def on_away(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called as each absence begins (``Reconnector.on_away``)."""
        self._reconnector.on_away(hook)

    def on_back(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called as each absence ends (``Reconnector.on_back``)."""
        self._reconnector.on_back(hook)

    async def until_back(self) -> None:
        """Return once the master link is up (``Reconnector.until_back``)."""
        await self._reconnector.until_back()

    def route(self, kind: type[_M], apply: Callable[[_M], bool | None]) -> None:
        """Have the reader call ``apply`` on every ``kind`` message as it arrives, before
        queueing it (``apply`` must not block); a message ``apply`` returns True for is
        taken by it, not queued."""
        self._routes[kind] = apply

    def route_of(self, kind: type[_M]) -> Callable[[_M], bool | None] | None:
        """The route applied to every ``kind`` message as it arrives (None: none)."""
        return self._routes.get(kind)

    # --- the link --------------------------------------------------------------------------

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
        self.registration = Register(
            protocol_version=PROTOCOL_VERSION, peer_group=peer_group, p2p_port=p2p_port,
            advertised_host=advertised_host, pool_size=pool_size,
        )
        link = await self._reconnector.reach(probing=probing)
        self.install(link)
        await self.send(self.registration)
        welcome = await self.wait_for(Welcome)
        self.welcomed(welcome)
        self._life.spawn(self._send_heartbeats)
        log.info("peer %d registered with the master at %s", self.peer_id, self.address)

    def install(self, link: FramedStream) -> None:
        """Make ``link`` the master link, read by a reader of its own."""
        self._link = link
        self._life.spawn(self._read, link, self._epoch)

    def welcomed(self, welcome: Welcome) -> None:
        """The master welcomed this peer on the link installed: adopt its timers, and
        keep the link alive while a trainer blocks the event loop."""
        self.peer_id = welcome.peer_id
        self.heartbeat_interval = welcome.heartbeat_interval
        self.liveness_timeout = welcome.liveness_timeout
        self.content_digest = welcome.content_digest
        if self.keepalive and self._link is not None:
            keep_alive(self._link, Heartbeat(), self.heartbeat_interval)

    def drop(self) -> None:
        """The link in use is lost: a new epoch begins, and the link is closed (in a
        task of its own)."""
        self._epoch += 1
        link, self._link = self._link, None
        if link is not None:
            self._life.spawn(link.aclose)

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()

    def _lost(self, error: MasterConnectionError, epoch: int) -> None:
        """The link of ``epoch`` is lost (``Reconnector.lost``; nothing if a newer
        link is in use)."""
        if epoch == self._epoch:
            self._reconnector.lost(error)

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
        if epoch is not None and (self.away or self._epoch != epoch):
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
                an outcome the lost master sent before, ``_inbox.decided``, is still
                taken).
            MasterConnectionError, Kicked: the run is over for this peer.
        """
        epoch = self._epoch

        def check() -> None:
            self._life.raise_if_failed()
            if self.away or self._epoch != epoch:
                raise MasterLost(
                    f"lost the master at {self.address} while waiting for "
                    f"{getattr(kind, '__name__', 'a reply')}"
                )

        return await self._inbox.wait_for(kind, match, check=check)

    def discard(self, unwanted: Callable[[Message], bool]) -> None:
        """Drop the queued messages nobody will wait for any more."""
        self._inbox.discard(unwanted)

    def _link_failed(self, failure: str) -> str:
        """``failure`` (what happened to the link), led by its likely cause when the
        master never welcomed this peer and this peer has no run secret: a master
        with one closes such connections at their first bytes."""
        if self.peer_id is not None or self._config.secret is not None:
            return failure
        return (
            f"the master at {self.address} never welcomed this peer, which has no run "
            "secret: a master with a run secret closes connections from peers without "
            f"it at once. Give this peer the run's secret ({SECRET_ENVIRONMENT}, "
            "--secret-file PATH, or Config(run_secret=...)), or check that "
            f"{self.address} is a pccl_trio master ({failure})"
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
                    raise MasterConnectionError(self._link_failed(
                        f"the master at {self.address} sent nothing for "
                        f"{self.liveness_timeout}s (liveness timeout): it or the network "
                        "is down"
                    ))
                if isinstance(message, Kick):
                    raise Kicked(message.reason)
                if isinstance(message, Heartbeat):
                    continue
                self._reconnector.note(message)
                # Some messages change what the data path accepts: apply them here, in
                # order, before any later message or p2p frame can depend on them.
                if isinstance(message, Welcome):
                    self.peer_id = message.peer_id  # the routes below may need it
                apply = self._routes.get(type(message))
                if apply is not None and apply(message):
                    continue
                self._inbox.put(message)
        except Kicked as exc:
            self._life.fail(exc)
        except MasterConnectionError as exc:
            self._lost(exc, epoch)
        except RemoteProtocolError as exc:
            self._lost(MasterConnectionError(f"the master sent malformed data ({exc})"), epoch)
        except trio.BrokenResourceError as exc:
            self._lost(
                MasterConnectionError(self._link_failed(
                    f"lost the connection to the master at {self.address} ({exc})"
                )),
                epoch,
            )
        except trio.ClosedResourceError:
            pass  # we closed the link ourselves, and whoever did recorded why
