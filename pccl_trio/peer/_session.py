"""The master link of a peer: registration, the one reader, the inbox, heartbeats.

Theory of operation
-------------------
``open`` connects to the master (completing the run-secret handshake first, if the
run has a secret; given several addresses, those of discovered masters, the first
that accepts and completes the handshake), starts the *reader* (the only task that ever receives from the
link) and the *heartbeat* sender, registers, and returns once the master's
``Welcome`` named this peer and imposed its liveness timers and whether its
shared-state votes carry content digests (``content_digest``).

The reader applies a few messages at once, in the order they arrive, through the
synchronous *routes* other parts registered (``route``): a ``CollectiveCommence``
makes an all-reduce attempt reachable by its number before any of its data frames
can be read, and a ``P2PInfo`` lets the round's predecessor connect. Then every
message goes into the *inbox*, where calls take the first message of the kind they
wait for (``wait_for``, PCCL's predicate-matched queue); ``discard`` drops messages
nobody will take any more. Heartbeats only prove the master alive. If the master
sends nothing for the liveness timeout, closes the link, breaks the protocol or kicks
this peer, the communicator fails (``Lifecycle.fail``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from .._config import Config
from .._core.channel import Channel, HandshakeFailed, Purpose
from .._core.errors import RemoteProtocolError
from .._core.messages import (
    M2C,
    PROTOCOL_VERSION,
    Heartbeat,
    Kick,
    Message,
    Register,
    Welcome,
    body_limits,
    message_kinds,
)
from .._core.wire import Admission
from .._errors import Kicked, MasterConnectionError, PCCLError
from ..transport import Credential, FramedStream, Network, format_address, secure_client
from ._lifecycle import Lifecycle

__all__ = ["MasterSession"]

log = logging.getLogger("pccl_trio.peer")

_M = TypeVar("_M", bound=Message)


class MasterSession:
    """A peer's link to its master (see the module docstring)."""

    def __init__(
        self, *, config: Config, network: Network, lifecycle: Lifecycle, host: str, port: int,
        credential: Credential | None,
    ) -> None:
        self._config = config
        self._network = network
        self._life = lifecycle
        self._credential = credential
        self.host, self.port = host, port
        self._targets: tuple[tuple[str, int], ...] = ((host, port),)
        self.peer_id: int | None = None
        self.heartbeat_interval = config.heartbeat_interval
        self.liveness_timeout = config.liveness_timeout
        #: Whether the run requires content digests in shared-state votes (the master
        #: says so in ``Welcome``).
        self.content_digest = False
        self._link: FramedStream | None = None
        self._inbox: list[Message] = []
        self._inbox_lot = trio.lowlevel.ParkingLot()
        self._routes: dict[type[Message], Callable[[Any], None]] = {}
        lifecycle.on_failure(self._inbox_lot.unpark_all)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def retarget(self, targets: Sequence[tuple[str, int]]) -> None:
        """Have ``open`` register with the first of ``targets`` (``(host, port)``: the
        addresses of discovered masters, best first) that accepts a connection and,
        with a run secret, proves it holds the secret."""
        self._targets = tuple(targets)
        self.host, self.port = self._targets[0]

    def route(self, kind: type[_M], apply: Callable[[_M], None]) -> None:
        """Have the reader call ``apply`` on every ``kind`` message as it arrives, before
        queueing it (``apply`` must not block)."""
        self._routes[kind] = apply

    async def open(
        self, *, peer_group: int, p2p_port: int, advertised_host: str, pool_size: int
    ) -> None:
        """Connect, register, and wait for the master's ``Welcome``.

        Raises:
            MasterConnectionError: the master cannot be reached or went away.
            Kicked: the master refused this peer.
        """
        failures: list[MasterConnectionError] = []
        for host, port in self._targets:
            self.host, self.port = host, port
            try:
                stream, channel = await self._reach()
            except MasterConnectionError as exc:
                failures.append(exc)
                if len(failures) < len(self._targets):
                    log.warning("%s; trying the next master address", exc)
                continue
            break
        else:
            if len(failures) == 1:
                raise failures[0]
            raise MasterConnectionError(
                f"none of {len(failures)} master addresses worked: "
                + "; ".join(str(failure) for failure in failures)
            ) from failures[-1]
        limit = self._config.max_control_frame
        # What a master may send: Welcome or Kick first, then its kinds and heartbeats.
        from_master = [c for c in message_kinds().values() if c.DIRECTION == M2C]
        self._link = FramedStream(
            stream, max_control_frame=limit,
            admission=Admission(
                first=body_limits([Welcome, Kick], limit),
                then=body_limits([*from_master, Heartbeat], limit),
            ),
            channel=channel,
        )
        self._life.spawn(self._read)
        await self.send(
            Register(
                protocol_version=PROTOCOL_VERSION,
                peer_group=peer_group,
                p2p_port=p2p_port,
                advertised_host=advertised_host,
                pool_size=pool_size,
            )
        )
        welcome = await self.wait_for(Welcome)
        self.peer_id = welcome.peer_id
        self.heartbeat_interval = welcome.heartbeat_interval
        self.liveness_timeout = welcome.liveness_timeout
        self.content_digest = welcome.content_digest
        self._life.spawn(self._send_heartbeats)
        log.info("peer %d registered with the master at %s", self.peer_id, self.address)

    async def _reach(self) -> tuple[trio.abc.Stream, Channel | None]:
        """A connection to the master at ``host:port``, past the run-secret handshake
        if the run has a secret.

        Raises:
            MasterConnectionError: no connection, or a failed handshake.
        """
        try:
            with trio.fail_after(self._config.connect_timeout):
                stream = await self._network.connect(self.host, self.port)
        except (OSError, trio.TooSlowError) as exc:
            raise MasterConnectionError(
                f"could not reach the master at {self.address} ({exc or 'timed out'}); "
                "check that `pccl-trio master` runs there and the address is right"
            ) from exc
        credential = self._credential
        if credential is None:
            return stream, None
        try:
            return stream, await secure_client(stream, credential, Purpose.MASTER)
        except (HandshakeFailed, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError) as exc:
            await trio.aclose_forcefully(stream)
            raise MasterConnectionError(
                f"the master at {self.address} did not complete the run-secret "
                f"handshake ({exc or 'timed out'}): it runs with another secret or "
                "with none"
            ) from exc

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()

    # --- sending -------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Send one message to the master.

        Raises:
            MasterConnectionError: the link is gone (the communicator fails).
        """
        self._life.raise_if_failed()
        link = self._link
        assert link is not None
        try:
            await link.send_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._life.fail(
                MasterConnectionError(f"lost the connection to the master at {self.address} ({exc})")
            )
            self._life.raise_if_failed()
        except BaseException:
            if link.closed:  # interrupted mid-frame: the link had to go
                self._life.fail(
                    MasterConnectionError(
                        f"a call was interrupted while sending {type(message).__name__} to the "
                        "master; the half-sent message ended this peer's link"
                    )
                )
            raise

    async def vote(self, message: Message) -> None:
        """Send a vote; from then on the running call must see it through."""
        await self.send(message)
        self._life.voted = True

    async def _send_heartbeats(self) -> None:
        while True:
            await trio.sleep(self.heartbeat_interval)
            try:
                await self.send(Heartbeat())
            except PCCLError:
                return

    # --- receiving -----------------------------------------------------------------------

    async def wait_for(
        self, kind: type[_M] | tuple[type[_M], ...], match: Callable[[_M], bool] | None = None
    ) -> _M:
        """Take the first message of ``kind`` (and matching ``match``) from the inbox."""
        while True:
            for index, message in enumerate(self._inbox):
                if isinstance(message, kind) and (match is None or match(message)):
                    del self._inbox[index]
                    return message
            self._life.raise_if_failed()
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

    async def _read(self) -> None:
        link = self._link
        assert link is not None
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
                        "is down; restart the run's master and reconnect"
                        + self._welcome_hint()
                    )
                if isinstance(message, Kick):
                    raise Kicked(message.reason)
                if isinstance(message, Heartbeat):
                    continue
                # Some messages change what the data path accepts: apply them here, in
                # order, before any later message or p2p frame can depend on them.
                if isinstance(message, Welcome):
                    self.peer_id = message.peer_id  # the routes below may need it
                apply = self._routes.get(type(message))
                if apply is not None:
                    apply(message)
                self._inbox.append(message)
                self._inbox_lot.unpark_all()
        except PCCLError as exc:
            self._life.fail(exc)
        except RemoteProtocolError as exc:
            self._life.fail(MasterConnectionError(f"the master sent malformed data ({exc})"))
        except trio.BrokenResourceError as exc:
            self._life.fail(
                MasterConnectionError(
                    f"lost the connection to the master at {self.address} ({exc}); "
                    "a run cannot go on without its master" + self._welcome_hint()
                )
            )
        except trio.ClosedResourceError:
            pass  # we closed the link ourselves, and whoever did recorded why
