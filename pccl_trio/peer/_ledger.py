"""The bookkeeping at the bottom of one attempt of a ring collective.

Theory of operation
-------------------
An attempt's parts run in several threads at once: the readers of the connections
from the ring's predecessor write what arrives (``_inbound``), senders on the
connections to the successor send what is ready (``_outbound``), and the trio thread
starts, stops and waits for the attempt. What more than one of them reads is here, in
one ``Ledger``, guarded by its one ``lock``:

* whether the attempt is *live* (``stop`` ends it: no write starts after it), and
  why this peer's part *failed* (``fail``; ``invalid`` too when this peer's data
  cannot be reduced, which fails the collective as an invalid argument);
* the receive progress, per received segment of the schedule: which slices are
  written (``done``) and how many are not yet (``remaining``);
* the send flags, per send segment: which slices a sender took on (``sent``, each
  set once, under the lock, so that every slice is sent exactly once) and how many
  have not left yet (``unsent``);
* the connections carrying this attempt's bytes right now (``using``: a reader
  receiving straight into the result, a sender mid-frame): ``stop`` cuts them under
  the lock, so none of them can begin another collective's frame before the cut;
* what moved: payload bytes sent and received, values a codec clamped.

The part is *complete* once every slice arrived and every slice left: this peer holds
the whole result. ``signal`` (``transport.Signal``) wakes whoever waits for a change,
trio tasks and worker threads alike. A worker thread wakes the trio thread only when
it has something to do there (the part failed or completed, the last writer left a
stopped attempt), so a ring hop in threads does not also cost the event loop.

Under a lease, the members tell each other of their completion (``_agreement``), and
over TCP the thread that completes the part tells it: then the trio thread is not
woken at completion (``teller`` hands that thread the agreement instead).
"""

from __future__ import annotations

import collections
import typing
from collections.abc import Sequence

from ..transport import Signal

__all__ = ["Cuttable", "Ledger", "LocalFailure", "Telling"]


class LocalFailure(Exception):
    """This peer's part of an attempt failed (a link broke, a frame was bad)."""


class Cuttable(typing.Protocol):
    """A connection that ``stop`` can cut from any thread."""

    def close_now(self) -> None: ...


class Telling(typing.Protocol):
    """A lease's agreement, as far as the ledger is concerned (``_agreement``)."""

    @property
    def quiet(self) -> bool: ...

    def tell(self) -> None: ...


class Ledger:
    """The state an attempt's parts share (see the module docstring).

    Made in the trio thread.

    Args:
        tag: the user's tag.
        recv_slices: slices per received segment; send_slices: per send segment.
    """

    def __init__(self, *, tag: int, recv_slices: Sequence[int], send_slices: Sequence[int]) -> None:
        self.tag = tag
        self.seq = 0  # the attempt's number: the master's, once it commences
        self.signal = Signal()
        self.lock = self.signal.lock
        self.live = True
        self.failure: str | None = None
        self.invalid: str | None = None
        self.reset(recv_slices=recv_slices, send_slices=send_slices)
        self.using: collections.Counter[Cuttable] = collections.Counter()
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.clamped = 0
        # Under a lease: whom the completing thread tells (``teller``).
        self.telling: Telling | None = None

    def reset(self, *, recv_slices: Sequence[int], send_slices: Sequence[int]) -> None:
        """The progress of a schedule of these slices, none received or sent yet (made
        with the ledger, or again before any slice moved: ``RingAttempt.reschedule``)."""
        with self.lock:
            self.done = [bytearray(n) for n in recv_slices]
            self.remaining = sum(recv_slices)
            self.sent = [bytearray(n) for n in send_slices]
            self.unsent = sum(send_slices)

    @property
    def complete(self) -> bool:
        """Every slice received and sent: this peer holds the whole result, whatever
        happened since (under the lock)."""
        return not self.remaining and not self.unsent

    @property
    def running(self) -> bool:
        """Live, and this peer's part has not failed."""
        return self.live and self.failure is None

    def wake(self, *, trio_too: bool) -> None:
        """Wake the waiting threads, and the trio thread if ``trio_too`` (or when called
        from it); with the lock held."""
        self.signal.notify(trio_too=trio_too)

    def teller(self) -> Telling | None:
        """Once the part is complete (with the lock held): the agreement that the
        calling thread tells (``tell``, after releasing the lock) instead of waking the
        trio thread; None: wake the trio thread."""
        telling = self.telling
        return telling if telling is not None and telling.quiet else None

    def received(self, segment: int, index: int, nbytes: int) -> None:
        """Slice ``index`` of received segment ``segment`` is written, ``nbytes`` of it
        on the wire (with the lock held)."""
        self.done[segment][index] = 1
        self.rx_bytes += nbytes
        self.remaining -= 1

    def left(self, nbytes: int) -> None:
        """A slice of ``nbytes`` on the wire left this peer (any thread; not under the
        lock)."""
        with self.lock:
            self.tx_bytes += nbytes
            self.unsent -= 1
            complete = self.complete
            telling = self.teller() if complete else None
            if complete and telling is None:
                self.wake(trio_too=True)
        if telling is not None:
            telling.tell()

    def use(self, connection: Cuttable) -> None:
        """``connection`` carries this attempt's bytes from now on: ``stop`` cuts it
        (with the lock held, after checking that the attempt is ``live``)."""
        self.using[connection] += 1

    def unuse(self, connection: Cuttable) -> None:
        """``connection`` no longer carries this attempt's bytes (with the lock held)."""
        count = self.using[connection] - 1
        if count:
            self.using[connection] = count
        else:
            del self.using[connection]

    def count_clamped(self, clamped: int) -> None:
        """A codec clamped ``clamped`` more values (any thread; not under the lock)."""
        if clamped:
            with self.lock:
                self.clamped += clamped

    def fail(self, reason: str) -> None:
        """Mark this peer's part failed (e.g. an incoming link broke); any thread."""
        with self.lock:
            if self.failure is None:
                self.failure = reason
            self.wake(trio_too=True)

    def reject(self, reason: str) -> None:
        """This peer's data cannot be reduced: the collective fails for everyone as an
        invalid argument (any thread)."""
        with self.lock:
            if not self.live:
                return  # over already: what was read may have been a restore's
            if self.invalid is None:
                self.invalid = reason
        self.fail(reason)

    def stop(self) -> None:
        """No more writes: the attempt is over (aborted or finished). Connections
        carrying its bytes right now are cut."""
        with self.lock:
            self.live = False
            # Under the lock: a connection leaving ``using`` now could otherwise start
            # a frame of another collective before the cut reaches it.
            for connection in self.using:
                connection.close_now()
            self.wake(trio_too=True)

    async def wait_changed(self) -> None:
        """Wait until something may have changed (a slice, notice, failure, stop,
        verdict)."""
        await self.signal.wait()

    async def arrived(self, segment: int, index: int) -> bool:
        """Wait until slice ``index`` of received segment ``segment`` is written
        (True), or the part stopped running first (False)."""
        done = self.done[segment]
        await self.signal.wait_until(lambda: bool(done[index]) or not self.running)
        return bool(done[index]) and self.running

    def arrived_blocking(self, segment: int, index: int) -> bool:
        """``arrived`` from a worker thread."""
        done = self.done[segment]
        with self.lock:
            self.signal.wait_until_blocking(lambda: bool(done[index]) or not self.running)
            return bool(done[index]) and self.running
