"""One attempt of a ring collective at one peer: its parts, and the surface the rest of
the peer uses.

Theory of operation
-------------------
An attempt runs one ``RingSchedule`` (``_core/ring.py``): what this peer sends to
its successor, what it receives from its predecessor, and what it does with each
slice it receives (combine it, copy it, send it on). The schedule is the collective;
the parts below run any schedule:

* ``Ledger`` (``_ledger``), at the bottom: the one lock, the signal that wakes trio
  tasks and worker threads alike, whether the attempt is live or failed, the receive
  progress, the send flags, the connections to cut on a stop;
* ``Operands`` (``_operands``): where the input is read and the result written;
* ``Inbound`` (``_inbound``): what arrives: claims, the writers in the result
  buffer, combinations and copies;
* ``Outbound`` (``_outbound``): what leaves: the stream's plan, senders, forwarding;
* ``Encoded`` (``_blocks``), quantized only: blocks encoded, decoded and forwarded
  byte for byte, so that every peer ends with the same bits;
* ``InputBackup`` (``_inputs``), in place only: the caller's input of every slice
  overwritten so far, put back if the attempt does not succeed.

Each part takes the ledger and what else it reads; none knows the attempt.

An attempt is made when the user launches the collective, before the peer votes,
so that data frames can be accepted the moment the master commences it (the
neighbour may start sending before this peer has even read the commence): the readers
of the ring's data connections (``_receiver``) hand its frames to ``inbound``. Then
``send_all`` runs this peer's part. It ends in four steps, whatever the outcome:
``stop`` (no write starts any more, and connections carrying its bytes are cut),
``settle`` (the writers already running have finished), ``restore`` (in place, and
not a success: the caller's input is put back) and ``release`` (pooled memory goes
back).

The attempt's tasks run in the communicator's background nursery, not in a nursery
of their own per attempt: a collective must outlive a cancelled caller long enough to
reach its verdict (``_collectives``), and its data moves in worker threads over TCP,
which no cancel scope reaches. What stops the data in flight is ``stop``: it cuts
under the attempt's lock every connection carrying the attempt's bytes, which wakes
the threads blocked on them, and the senders' trio tasks are cancelled by their
caller's scope (``_parts.Part``).

GPU buffers run this same code: the staging (``_staging``) hands senders the host
bytes of a slice (copied from the device into pinned memory, the next one while this
one is sent), lands received payloads on the device, and runs the kernels on the
reader's stream; the backup lives in device memory. Only forwarding and receiving
straight into the result are host-only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio

from .._core.ring import RingSchedule
from .._types import ReduceOp
from ..ops import Codec, InputBackup, Staging
from ..transport import Connection
from ._agreement import Agreement
from ._blocks import Encoded
from ._inbound import Inbound
from ._ledger import Ledger
from ._operands import Operands
from ._outbound import Outbound

__all__ = ["RingAttempt"]


class RingAttempt:
    """One attempt of a ring collective (see the module docstring).

    Args:
        schedule: what this peer sends and receives (its ``rank`` is this peer's
            position in ``ring``).
        staging: how bytes move between the buffers and the sockets (its ``xp`` is
            the buffers' array module).
        send: the caller's input, a flat array, or a fused bucket's ``Gathered``
            members (not in place, unquantized, host memory).
        result: where the result goes (``send`` itself for in place).
        op: the reduction.
        tag: the user's tag.
        ring: the peer group's ring (peer ids).
        codec: how slices are encoded on the wire; None sends the buffer's bytes.
        own_start: an all-gather's: where in ``result`` this peer's part, ``send``, lies.

    An all-gather's attempt is made before the members' sizes are known: with a
    schedule of no data, until the master's commence tells them (``reschedule``).
    """

    def __init__(
        self,
        *,
        schedule: RingSchedule,
        staging: Staging,
        send: Any,
        result: Any,
        op: ReduceOp,
        tag: int,
        ring: tuple[int, ...],
        codec: Codec | None = None,
        own_start: int = 0,
    ) -> None:
        rank = schedule.rank
        self.staging = staging
        self.ring = ring
        self.predecessor, self.successor = ring[rank - 1], ring[(rank + 1) % len(ring)]
        self.ledger = Ledger(tag=tag, recv_slices=schedule.recv_slices, send_slices=schedule.send_slices)
        self._op = op
        self._build(schedule, send, result, codec, own_start)
        # Under a lease: how its members agree on the outcome (``under_lease``).
        self.agreement: Agreement | None = None
        # An all-gather's: makes its schedule from the members' sizes, as the commence
        # arrives; returns why it cannot (then the attempt fails), or None.
        self.sizing: Callable[[tuple[int, ...]], str | None] | None = None

    def _build(
        self, schedule: RingSchedule, send: Any, result: Any, codec: Codec | None, own_start: int
    ) -> None:
        """The parts that follow the schedule and the buffers."""
        self.schedule = schedule
        operands = Operands(
            staging=self.staging, send=send, result=result, op=self._op, own_start=own_start
        )
        assert operands.gathered is None or codec is None
        self._encoded = None if codec is None else Encoded(
            codec=codec, schedule=schedule, operands=operands, ledger=self.ledger,
        )
        self._backup = InputBackup(
            self.staging, operands.result_bytes, lock=self.ledger.lock
        ) if operands.in_place else None
        self.outbound = Outbound(
            ledger=self.ledger, schedule=schedule, operands=operands, encoded=self._encoded,
        )
        self.inbound = Inbound(
            ledger=self.ledger, schedule=schedule, operands=operands, backup=self._backup,
            encoded=self._encoded, forwarder=self.outbound,
        )

    def reschedule(self, schedule: RingSchedule, send: Any, result: Any, own_start: int) -> None:
        """Run ``schedule`` into ``result`` instead: an all-gather's, once the commence
        told the members' sizes (before any of its frames is routed here, and before
        this peer's part runs; a failure or stop so far holds)."""
        assert not self.ledger.tx_bytes and not self.ledger.rx_bytes
        assert self.schedule.rank == schedule.rank and not self.inbound.writers
        self.ledger.reset(recv_slices=schedule.recv_slices, send_slices=schedule.send_slices)
        self._build(schedule, send, result, None, own_start)

    # --- what the ledger knows -------------------------------------------------------

    @property
    def tag(self) -> int:
        return self.ledger.tag

    @property
    def seq(self) -> int:
        """The attempt's number: the master's, once it commences (0 before)."""
        return self.ledger.seq

    @seq.setter
    def seq(self, seq: int) -> None:
        self.ledger.seq = seq

    @property
    def live(self) -> bool:
        """Whether it may still write (not stopped)."""
        return self.ledger.live

    @property
    def failure(self) -> str | None:
        """Why this peer's part failed, if it did."""
        return self.ledger.failure

    @property
    def invalid(self) -> str | None:
        """Why this peer's data cannot be reduced, if it cannot (quantizing NaN or
        inf): the collective then fails as an invalid argument rather than a fault."""
        return self.ledger.invalid

    @property
    def complete(self) -> bool:
        """Every slice received and sent: this peer holds the whole result."""
        return self.ledger.complete

    @property
    def tx_bytes(self) -> int:
        return self.ledger.tx_bytes

    @property
    def rx_bytes(self) -> int:
        return self.ledger.rx_bytes

    @property
    def clamped(self) -> int:
        """Values a codec clamped to its range."""
        return self.ledger.clamped

    @property
    def uses_threads(self) -> bool:
        """Whether the data moved in worker threads (TCP), so restoring may too."""
        return self.outbound.uses_threads

    @property
    def restore_seconds(self) -> float:
        """Time spent putting the input back (``restore``)."""
        return self._backup.restore_seconds if self._backup is not None else 0.0

    # --- its life --------------------------------------------------------------------

    def under_lease(self, seq: int) -> Agreement:
        """Run as attempt ``seq`` of a lease: no commence comes, and its members agree
        on the outcome among themselves (``_agreement``)."""
        self.ledger.seq = seq
        self.agreement = self.ledger.telling = Agreement(world=len(self.ring), ledger=self.ledger)
        return self.agreement

    async def send_all(
        self, connections: Sequence[Connection], back: Connection | None = None
    ) -> None:
        """Run this peer's part: send its stream over ``connections`` and wait until
        every slice of it left and every slice of the incoming stream arrived. A
        leased attempt's notices go on the first of them and on ``back``, the first
        connection from the predecessor (``_agreement``).

        Raises:
            LocalFailure: a link broke or a frame was bad.
        """
        if self.agreement is not None:
            with self.ledger.lock:  # before any slice leaves: none can complete the part yet
                self.agreement.attach(connections[0] if connections else None, back)
        await self.outbound.send_all(connections)

    def fail(self, reason: str) -> None:
        """Mark this peer's part failed (e.g. an incoming link broke); any thread."""
        self.ledger.fail(reason)

    def stop(self) -> None:
        """No more writes: the attempt is over (aborted or finished). Readers
        receiving into the result buffer and senders blocked mid-frame have their
        connections cut; ``settle`` then waits for writers already running."""
        self.ledger.stop()

    async def wait_changed(self) -> None:
        """Wait until something may have changed (a slice, notice, failure, stop,
        verdict)."""
        await self.ledger.wait_changed()

    async def settle(self) -> None:
        """Wait until no reader or reduction writes into the buffers; after ``stop``."""
        assert not self.ledger.live
        with trio.CancelScope(shield=True):
            while self.inbound.writers:
                await self.ledger.signal.wait()

    def restore(self) -> None:
        """Put the caller's input back (in place); call only after ``settle``."""
        assert not self.ledger.live and not self.inbound.writers
        if self._backup is not None:
            self._backup.restore()

    def release(self) -> None:
        """Return pooled memory; the attempt is over."""
        if self._backup is not None:
            self._backup.release()
        if self._encoded is not None:
            self._encoded.release()
