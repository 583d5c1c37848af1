"""Recovery: a master learning the run from members that lost their master (sans-IO).

Theory of operation
-------------------
A member whose master link breaks does not leave the run: it connects again (to the
same address, or the next of several) and registers *as the member it was*. Its
``Register`` names the peer id it had (``rejoin``), its ring neighbours, the shared-state
revision its group expects next and the highest round, attempt, sync or optimization
number it has seen (``high_water``). A master, fresh or not, judges such a claim here:

1. **Who may come back.** An id held by a live peer cannot be claimed, nor one this
   master ever gave out or took back and has since removed: a peer it removed is not
   resurrected (it must join anew). The one exception is a newcomer this master
   registered under that id before the member came back (a fresh master cannot know
   the run's ids until its members return): the newcomer is kicked with the reason and
   the member keeps its id. Once a group's ring is settled (below), an id outside it is
   refused too: the run went on without that peer. Everything else a holder of the run
   secret (and, where the master has one, of a listed identity) may claim.
2. **Numbers.** Ids, rounds, attempts, syncs and optimizations all continue above
   anything a returning member reports, so no number ever means two things to a peer.
3. **Rings.** Each member names its predecessor and successor. A group's ring is the
   cycle those links form; once every peer on the cycle is back, it is installed as
   the group's ring with no round (the p2p connections outlived the master) and the
   group's expected revision is restored (the highest any member reports). A member
   whose connections from its predecessor broke reports that peer gone
   (``predecessor_gone``: it died, typically with the master, in the same process
   when the master was elected among the peers); once every peer of the ring is back
   or reported gone, the group stops waiting for the gone ones, as if the window
   had ended.
4. **Recovering.** From the first member of a group that comes back until its ring is
   complete, or ``window`` seconds later, the group is *recovering*, and the master
   decides no consensus at all (``holding``): a round or vote decided now would leave
   out members still on their way. When the window ends with peers of the ring
   missing, they are taken as gone (their ids can no longer be claimed) and the ring
   is stale, as after any departure: the survivors re-establish it. Contradicting
   reports (two successors for one peer) also leave the ring stale.
5. **Identities.** Each member also names the node identities the old master gave
   for its neighbours. A claim to an id whose node identity its neighbours named
   otherwise is refused, and a member that came back proving another identity than a
   neighbour names for it later is kicked: with node identities, a holder of the run
   secret cannot take a member's place at a fresh master.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from .identity import fingerprint
from .messages import Register
from .peers import Conn, PeerPhase, PeerTable
from .report import KickCause, RunKind
from .rounds import RingBook

__all__ = ["Recovery"]



@dataclasses.dataclass(kw_only=True, slots=True)
class _Group:
    """What the members of one group that came back said of their ring."""

    deadline: float
    back: set[int] = dataclasses.field(default_factory=set)
    successor: dict[int, int] = dataclasses.field(default_factory=dict)
    contradicted: bool = False
    next_revision: int = 0
    gone: set[int] = dataclasses.field(default_factory=set)  # reported dead by a neighbour

    def link(self, before: int, after: int) -> None:
        """``after`` follows ``before`` in the ring, as a member reports."""
        known = self.successor.setdefault(before, after)
        if known != after:
            self.contradicted = True

    def cycle(self, start: int) -> list[int] | None:
        """The ring through ``start`` as far as the reports tell (None: not closed)."""
        ring = [start]
        while (after := self.successor.get(ring[-1])) is not None and after != start:
            if after in ring:
                return None
            ring.append(after)
        return ring if after == start else None


class Recovery:
    """Members coming back to a master (see the module docstring).

    Args:
        table: the registry and outbox.
        book: the rings, which a complete recovery installs and an incomplete one
            leaves stale.
        window: seconds a group may take to come back once its first member did.
        continue_above: raise every number the master hands out above the argument.
        expect_revision: the shared-state revision a group expects next.
    """

    def __init__(
        self,
        table: PeerTable,
        book: RingBook,
        *,
        window: float,
        continue_above: Callable[[int], None],
        expect_revision: Callable[[int, int], None],
    ) -> None:
        self._table = table
        self._book = book
        self._window = window
        self._continue_above = continue_above
        self._expect_revision = expect_revision
        self._groups: dict[int, _Group] = {}  # recovering groups
        # The node identity of each id, as its ring neighbours named it.
        self._identities: dict[int, bytes] = {}

    @property
    def holding(self) -> bool:
        """Whether some group is still coming back (no consensus is decided)."""
        return bool(self._groups)

    def deadline(self) -> float:
        return min((g.deadline for g in self._groups.values()), default=math.inf)

    def on_register(self, conn: Conn, message: Register) -> bool:
        """Judge a member coming back as ``message.rejoin``; whether the recovery of its
        group completed (consensus may be decided again)."""
        table = self._table
        refusal = (
            table.refusal(conn, message) or self._claim_refusal(message)
            or self._identity_refusal(message.rejoin, conn.identity)
        )
        if refusal:
            table.kick(conn, refusal, KickCause.REFUSED)
            return False
        peer_id, group_id = message.rejoin, message.peer_group
        holder = table.peers.get(peer_id)
        if holder is not None:  # a newcomer registered under the id before the member came back
            table.kick_peer(
                holder,
                f"peer id {peer_id} belongs to a member of the run that came back after the "
                "master restarted; connect again to get an id of your own",
                KickCause.IDENTITY,
            )
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Group(deadline=table.now + self._window)
            table.report(
                RunKind.RECOVERY, f"peer group {group_id} is coming back to this master",
                group=group_id, phase="returning",
            )
        group.back.add(peer_id)
        if message.successor:
            group.link(peer_id, message.successor)
        if message.predecessor:
            group.link(message.predecessor, peer_id)
            if message.predecessor_gone:
                group.gone.add(message.predecessor)
        group.next_revision = max(group.next_revision, message.next_revision)
        table.reserve_ids(max(peer_id, message.predecessor, message.successor))
        for neighbour, named in (
            (message.predecessor, message.predecessor_identity),
            (message.successor, message.successor_identity),
        ):
            if neighbour and named:
                self._name(neighbour, named, by=peer_id)
        self._continue_above(message.high_water)
        table.admit(conn, message, peer_id, PeerPhase.ACCEPTED)
        return self._settle(group_id, timed_out=False)

    def _claim_refusal(self, message: Register) -> str:
        peer_id = message.rejoin
        holder = self._table.peers.get(peer_id)
        if holder is not None and holder.phase is PeerPhase.ACCEPTED:
            return f"peer id {peer_id} is in the run already (another connection holds it)"
        if holder is None and peer_id in self._table.known_ids:
            return (
                f"peer {peer_id} was removed from the run; it cannot come back as that peer: "
                "connect a new Communicator to join again"
            )
        ring = self._book.rings.get(message.peer_group)
        if message.peer_group not in self._groups and ring is not None and peer_id not in ring:
            return (
                f"the run went on without peer {peer_id}; connect a new Communicator to "
                "join again"
            )
        return ""

    def _identity_refusal(self, peer_id: int, proven: bytes) -> str:
        named = self._identities.get(peer_id)
        if named and named != proven:
            return (
                f"the ring neighbours of peer {peer_id} name node identity "
                f"{fingerprint(named)} for it; this connection proved {fingerprint(proven)}"
            )
        return ""

    def _name(self, peer_id: int, identity: bytes, *, by: int) -> None:
        """Member ``by`` names ``identity`` for its neighbour ``peer_id``; a member that
        came back as ``peer_id`` proving another identity is an impostor."""
        self._identities.setdefault(peer_id, identity)
        present = self._table.peers.get(peer_id)
        if present is not None and present.identity != identity:
            self._table.kick_peer(
                present,
                f"peer {by}, a ring neighbour of peer {peer_id}, names node identity "
                f"{fingerprint(identity)} for it; this connection proved "
                f"{fingerprint(present.identity)}",
                KickCause.IDENTITY,
            )
            self._table.known_ids.discard(peer_id)  # the id is still its owner's to claim

    def kick_late(self) -> bool:
        """End the recovery of every group whose window passed; whether any ended."""
        late = [g for g, group in self._groups.items() if self._table.now >= group.deadline]
        for group_id in late:
            self._settle(group_id, timed_out=True)
        return bool(late)

    def _settle(self, group_id: int, *, timed_out: bool) -> bool:
        """End the recovery of ``group_id`` if its ring is complete (or ``timed_out``):
        install its ring, or leave it stale; whether it ended."""
        group = self._groups[group_id]
        start = min(group.back)
        if not group.successor:
            ring: list[int] | None = [start] if len(group.back) == 1 else None
        else:
            ring = group.cycle(start)
        complete = ring is not None and set(ring) <= group.back and not group.contradicted
        # Every peer of the ring is back or reported gone: nobody left to wait for.
        named = set(group.successor) | set(group.successor.values())
        abandoned = bool(group.gone - group.back) and named <= group.back | group.gone
        if not (complete or timed_out or abandoned):
            return False
        del self._groups[group_id]
        if group.next_revision:
            self._expect_revision(group_id, group.next_revision)
        present = sorted(p for p in group.back if p in self._table.peers)
        if complete and ring is not None:
            self._book.install(self._table, group_id, ring, "the group came back")
            self._book.stale_groups.discard(group_id)
            self._table.report(
                RunKind.RECOVERY, f"peer group {group_id} is back: ring {ring}",
                group=group_id, phase="back", ring=tuple(ring),
            )
            return True
        missing = sorted((set(group.successor) | set(group.successor.values())) - group.back)
        self._table.known_ids.update(missing)  # gone: they cannot come back
        self._book.install(self._table, group_id, present, "the group came back in part")
        self._book.stale_groups.add(group_id)
        disagree = " (its members' reports disagree)" if group.contradicted else ""
        self._table.report(
            RunKind.RECOVERY,
            f"peer group {group_id} came back without {missing or 'none'}{disagree}; its "
            "ring must be re-established",
            level=logging.WARNING, group=group_id, phase="partial", missing=tuple(missing),
        )
        return True

    def peer_left(self, peer_id: int, group_id: int) -> None:
        """A member left while its group was coming back: it is not waited for."""
        group = self._groups.get(group_id)
        if group is not None:
            group.back.discard(peer_id)
            if not group.back:
                del self._groups[group_id]
