"""The shared-state election: who holds the popular state, who must fetch what, who is out.

Theory of operation
-------------------
When every member of a peer group has voted its shared state (revision, strategy, and
one entry per tensor: key, content hash and digest, dtype, element count, whether
content may differ), :func:`elect` decides the sync, as a pure function of the votes and
the revision the group expects next (None before its first sync). A tensor's *content*
is its simplehash and its digest together: in a run that requires digests
(``Welcome.content_digest``) two entries with the same simplehash but different digests
hold different content; elsewhere every digest is empty and the simplehash alone
decides.

1. **Revision.** A vote above the expected revision (the last sync's plus one) was
   refused when it arrived (the master kicks it: it skips ahead). The sync's *target*
   revision is the expected one if a voter holds it; otherwise (every member repeats
   the last sync's revision after a step aborted past its sync, or the expected one's
   holders all left, or the group's first sync) it is the highest revision voted,
   which also lets a run resume from a checkpoint. Voters at the target are *current*,
   the others *outdated* (joiners, a peer whose last sync failed): they are dragged
   along to the target.
2. **Strategies.** ENFORCE_POPULAR cannot be mixed with the others: if the group mixes
   them, the peers that did not ENFORCE_POPULAR are kicked. RECEIVE_ONLY peers offer no
   candidate; if nobody offers one, every voter is kicked.
3. **Popularity.** Identical entry lists (content included: hashes and digests) are
   counted together. Lists voted by a current peer beat lists voted only by outdated
   peers, whatever their numbers; among equals the most votes wins, and a tie goes to the
   list of the lowest peer id (deterministic, where PCCL leaves it to hash-map order).
4. **Mismatch.** A voter whose entry list differs from the winner's in anything but the
   content (a key, its dtype, its element count, ``allow_content_inequality``, the number
   of entries) is kicked, with a reason naming the first key that differs. Content that
   differs (the hash, or the digest) makes that key *dirty* for the voter: it fetches it,
   told the popular hash and digest to verify what arrives against. An outdated voter
   also gets every ``allow_content_inequality`` key (joiners obtain some version of
   those), which are never compared otherwise.
5. **Send-only peers** must already hold the popular state: one that would have to fetch
   anything, or is outdated, is kicked.
6. **Distributors** are the remaining voters that offer a candidate and need no key. The
   others fetch their dirty keys from them (they may need none: an outdated peer whose
   content already matches only adopts the target revision). A distributor holds the
   popular entry list itself, so it can tell a fetcher's keys by their positions in it
   (``tensor_spans``: runs of positions, one for a joiner that fetches everything).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from .messages import DTYPE_NAMES, SharedStateEntry, SharedStateFetch, SyncStrategy, TensorSpan

__all__ = [
    "Ballot", "Election", "SyncStrategy", "elect", "tensor_spans",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ballot:
    """One peer's shared-state vote."""

    revision: int
    strategy: int  # a SyncStrategy value, as the vote carried it
    entries: tuple[SharedStateEntry, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Election:
    """What :func:`elect` decided.

    Attributes:
        kicks: peer id -> why it must leave the run.
        revision: the revision every remaining voter holds after the sync.
        fetches: peer id -> the keys it must fetch, for every remaining voter (empty for
            distributors and for voters that only adopt the revision).
        distributors: the peers that hold the popular state and may send it, by id.
        keys: the popular state's keys, in the order every remaining voter holds them.
    """

    kicks: Mapping[int, str]
    revision: int
    fetches: Mapping[int, tuple[SharedStateFetch, ...]]
    distributors: tuple[int, ...]
    keys: tuple[str, ...] = ()


def elect(ballots: Mapping[int, Ballot], expected: int | None) -> Election:
    """Decide a sync from every group member's ballot (see the module docstring)."""
    kicks: dict[int, str] = {}
    voters = dict(sorted(ballots.items()))
    revision = _target_revision(voters, expected)

    strategies = {b.strategy for b in voters.values()}
    if SyncStrategy.ENFORCE_POPULAR in strategies and len(strategies) > 1:
        for peer_id, ballot in voters.items():
            if ballot.strategy != SyncStrategy.ENFORCE_POPULAR:
                kicks[peer_id] = (
                    f"shared-state strategy {SyncStrategy(ballot.strategy).name} cannot be "
                    "mixed with ENFORCE_POPULAR in one peer group; every peer of the group "
                    "must use ENFORCE_POPULAR, or each SEND_ONLY or RECEIVE_ONLY"
                )
        voters = {p: b for p, b in voters.items() if p not in kicks}

    candidates = {p: b for p, b in voters.items() if b.strategy != SyncStrategy.RECEIVE_ONLY}
    if not candidates:
        for peer_id in voters:
            kicks[peer_id] = (
                "every peer of the group synchronized its shared state RECEIVE_ONLY, so "
                "nobody may send it; at least one peer must use ENFORCE_POPULAR or SEND_ONLY"
            )
        return Election(kicks=kicks, revision=revision, fetches={}, distributors=())

    winner = _most_popular(candidates, revision)
    fetches: dict[int, tuple[SharedStateFetch, ...]] = {}
    for peer_id, ballot in voters.items():
        outdated = ballot.revision != revision
        mismatch = _mismatch(ballot.entries, winner)
        if mismatch:
            kicks[peer_id] = mismatch
            continue
        dirty = tuple(
            SharedStateFetch(key=popular.key, hash=popular.hash,
                             verify=not popular.allow_content_inequality,
                             digest=popular.digest)
            for mine, popular in zip(ballot.entries, winner, strict=True)
            if (popular.allow_content_inequality and outdated)
            or (not popular.allow_content_inequality
                and (mine.hash, mine.digest) != (popular.hash, popular.digest))
        )
        if ballot.strategy == SyncStrategy.SEND_ONLY and (dirty or outdated):
            kicks[peer_id] = (
                "a SEND_ONLY peer must hold the popular shared state, but this peer "
                + (f"is at revision {ballot.revision}, not {revision}" if outdated else
                   f"differs in key {dirty[0].key!r}")
            )
            continue
        fetches[peer_id] = dirty
    distributors = tuple(
        peer_id for peer_id, dirty in fetches.items()
        if not dirty and voters[peer_id].strategy != SyncStrategy.RECEIVE_ONLY
    )
    return Election(
        kicks=kicks, revision=revision, fetches=fetches, distributors=distributors,
        keys=tuple(entry.key for entry in winner),
    )


def tensor_spans(positions: Iterable[int]) -> tuple[TensorSpan, ...]:
    """Ascending ``positions`` (no repeats) as runs of consecutive positions."""
    runs: list[list[int]] = []  # [first, count]
    for position in positions:
        if runs and position == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([position, 1])
    return tuple(TensorSpan(first=first, count=count) for first, count in runs)


def _target_revision(voters: Mapping[int, Ballot], expected: int | None) -> int:
    revisions = [b.revision for b in voters.values()]
    if expected is not None and expected in revisions:
        return expected
    return max(revisions)


def _most_popular(
    candidates: Mapping[int, Ballot], revision: int
) -> tuple[SharedStateEntry, ...]:
    """The entry list current peers vote most for (see the module docstring)."""
    tally: dict[tuple[SharedStateEntry, ...], list[int]] = {}
    for peer_id, ballot in candidates.items():
        tally.setdefault(ballot.entries, []).append(peer_id)

    def rank(entries: tuple[SharedStateEntry, ...]) -> tuple[int, int, int]:
        peers = tally[entries]
        current = any(candidates[p].revision == revision for p in peers)
        return (1 if current else -2, len(peers), -min(peers))

    return max(tally, key=rank)


def _mismatch(
    mine: Sequence[SharedStateEntry], popular: Sequence[SharedStateEntry]
) -> str:
    """Why ``mine`` cannot be synchronized to ``popular`` (empty: it can)."""
    for index, (a, b) in enumerate(zip(mine, popular, strict=False)):
        where = f"shared-state tensor {index} "
        if a.key != b.key:
            return (
                f"{where}is {a.key!r} here but {b.key!r} in the popular state: every peer "
                "must share the same tensors, in the same order"
            )
        if (a.dtype, a.count) != (b.dtype, b.count):
            return (
                f"{where}{a.key!r} is {a.count} x {DTYPE_NAMES[a.dtype]} here but "
                f"{b.count} x {DTYPE_NAMES[b.dtype]} in the popular state"
            )
        if a.allow_content_inequality != b.allow_content_inequality:
            return (
                f"{where}{a.key!r} has allow_content_inequality="
                f"{a.allow_content_inequality} here but {b.allow_content_inequality} in the "
                "popular state"
            )
    if len(mine) != len(popular):
        extra = mine[len(popular)] if len(mine) > len(popular) else popular[len(mine)]
        return (
            f"this peer shares {len(mine)} tensors, the popular state {len(popular)} "
            f"(first difference: key {extra.key!r})"
        )
    return ""
