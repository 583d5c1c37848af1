"""Advertisements on the in-memory network: its ``Directory``, in place of mDNS.

Theory of operation
-------------------
A ``MemoryNetwork`` keeps one ``MemoryDirectory``; each ``MemoryHost`` sees it through
``host.directory`` (a ``Directory``, as ``transport.MDNS`` is for real networks). An
advertisement is visible to every host from the moment it is made until it is
withdrawn, at once (mDNS takes about two seconds to announce; here time is virtual
anyway). A host that dies (``MemoryNetwork.kill``) sends no goodbye: its
advertisements stay, as they stay in real mDNS caches until their TTL runs out.

``split(*sides)`` makes hosts see only the advertisements of hosts on their own side
(a network whose multicast does not cross a partition); ``unsplit()`` ends it. A
browse returns as soon as an advertisement it wants is visible, after the same settle
window as over mDNS, or at its deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING

import trio

from .._core.discovery import MasterAdvert
from ..transport import SETTLE_SECONDS, Seen

if TYPE_CHECKING:
    from ._memory import MemoryNetwork

__all__ = ["MemoryDirectory"]


class MemoryDirectory:
    """The advertisements of one ``MemoryNetwork`` (see the module docstring)."""

    def __init__(self, network: MemoryNetwork) -> None:
        self._network = network
        self._adverts: dict[str, tuple[str, MasterAdvert]] = {}  # instance -> (host, advert)
        self._sides: list[frozenset[str]] = []
        self._changed = trio.lowlevel.ParkingLot()

    def split(self, *sides: Iterable[str]) -> None:
        """Hosts on different ``sides`` no longer see each other's advertisements
        (hosts on no side see everything)."""
        self._sides = [frozenset(side) for side in sides]
        self._changed.unpark_all()

    def unsplit(self) -> None:
        """Every host sees every advertisement again."""
        self._sides = []
        self._changed.unpark_all()

    def visible(self, viewer: str) -> dict[str, MasterAdvert]:
        """The advertisements host ``viewer`` sees, by instance name."""
        return {
            instance: advert for instance, (host, advert) in self._adverts.items()
            if self._together(viewer, host)
        }

    def _together(self, one: str, other: str) -> bool:
        for side in self._sides:
            if (one in side) != (other in side):
                return False
        return True

    def view(self, host: str) -> HostDirectory:
        return HostDirectory(self, host)

    def _add(self, host: str, advert: MasterAdvert) -> None:
        self._adverts[advert.instance] = (host, advert)
        self._changed.unpark_all()

    def _withdraw(self, host: str, advert: MasterAdvert) -> None:
        if self._network.is_dead(host):
            return  # no goodbye from a dead host
        self._adverts.pop(advert.instance, None)
        self._changed.unpark_all()


class HostDirectory:
    """A ``MemoryDirectory`` as seen from one host: a ``Directory``."""

    def __init__(self, directory: MemoryDirectory, host: str) -> None:
        self._directory = directory
        self._host = host

    async def addresses(self, host: str) -> tuple[str, ...]:
        await trio.lowlevel.checkpoint()
        return (self._host,)

    @contextlib.asynccontextmanager
    async def advertise(self, advert: MasterAdvert, host: str) -> AsyncIterator[None]:
        await trio.lowlevel.checkpoint()
        self._directory._add(self._host, advert)
        try:
            yield
        finally:
            self._directory._withdraw(self._host, advert)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[HostDirectory]:
        yield self  # always up to date

    async def browse(
        self, seconds: float, wanted: Callable[[MasterAdvert], bool] | None = None
    ) -> Seen:
        directory = self._directory
        deadline = trio.current_time() + seconds
        while True:
            seen = directory.visible(self._host)
            if wanted is not None and any(wanted(advert) for advert in seen.values()):
                await trio.sleep_until(min(deadline, trio.current_time() + SETTLE_SECONDS))
                return Seen(adverts=directory.visible(self._host))
            if trio.current_time() >= deadline:
                return Seen(adverts=seen)
            with trio.move_on_at(deadline):
                await directory._changed.park()
