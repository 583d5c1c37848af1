"""Electing a run's master among its peers: the rules every candidate applies alike
(sans-IO).

Theory of operation
-------------------
A peer started with ``Communicator(discover=RUN, host_master=True)`` is a *candidate*:
it may host the run's master in its own process. Each candidate reserves the port its
master would listen on (bound, not listening: a dial there is refused at once until
it hosts) and advertises itself for the run's lifetime (``role=candidate``, its port,
its *rank key*: a keyed hash of its node identity's public key under the run secret,
or a random key drawn at start for a peer without one). All candidates see the same
advertisements, so they order the candidates the same way (``in_order``: by rank key,
then instance name), and the rules below need no messages between them.

**Who hosts, and when.** Wanting a master, a candidate dials the run's advertised
masters and then the reserved ports of the candidates ranked before it; the first that
answers as a master is joined. If none answers, the candidate at position ``p``
(``position``: the candidates ranked before it, not counting one known to be gone)
hosts once it has waited ``p`` election timeouts (``hosting_at``): the first candidate
hosts at once, the second only if the first has not been reachable as a master for a
whole timeout, and so on. A dead candidate's advertisement may outlive it (mDNS caches
keep records for their TTL): it costs the candidates behind it one timeout, never the
election. The same rule elects again when a member loses the master its candidate
hosted: the survivors reorder, leaving out the lost host, and the first of them hosts;
the others find it at its reserved port and come back to it through the recovery path
(``_core.recovery``) as the members they were.

**Split brain.** Candidates that cannot see each other (a partition, advertisements
not propagated yet) may host two masters for one run. A hosting candidate therefore
looks at the run's masters every few election timeouts; if one comes before its own in
``_core.discovery.master_order`` (a master started by hand, else the lower rank key)
and proves it is a master of this run (it completes the run-secret handshake, and
proves one of ``Config.master_identities`` where the peers have them: an advertisement
alone is anyone's to copy or forge), it steps down (``outranking``): its master stops
and withdraws its advertisement, and its members find the remaining master as they
would after any master loss. There a member comes back if the run can take it (its
group still recovering, its id unheld); otherwise it is refused with the reason and
must join anew, taking the surviving run's shared state: of two halves of a run, the
half that stays keeps its state.

Masters hosted by candidates hand out peer ids from a random base (``first_peer_id``),
so the ids of two masters elected apart do not collide when their members meet again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence

from .discovery import MasterAdvert, master_order
from .messages import PROTOCOL_VERSION

__all__ = [
    "RANK_BYTES",
    "first_peer_id",
    "hosting_at",
    "in_order",
    "outranking",
    "position",
    "random_rank",
    "rank_of",
    "targets",
]

#: Bytes of a rank key (an HMAC-SHA256).
RANK_BYTES = 32
_RANK_CONTEXT = b"pccl-trio rank "
#: Peer ids of an elected master start at a random multiple of this, below 2**47
#: (numbers of a run stay below 2**48).
_ID_SPACING = 1 << 24
_ID_BASES = 1 << 23


def rank_of(identity: bytes | None, secret: bytes | None, run: str) -> str:
    """The rank key of a candidate of ``run`` proving node identity ``identity``: the
    HMAC-SHA256 of its public key under the run secret (the same for every candidate
    of the run, yet no LAN observer learns the key from it), in hex; a random one for
    a candidate without an identity (``random_rank``)."""
    if not identity:
        return random_rank()
    message = _RANK_CONTEXT + run.encode() + b"\0" + identity
    return hmac.new(secret or b"", message, hashlib.sha256).hexdigest()


def random_rank() -> str:
    """A rank key drawn at random, for a candidate without a node identity."""
    return secrets.token_hex(RANK_BYTES)


def first_peer_id() -> int:
    """Where an elected master starts numbering peers: a random one of 2**23 - 1
    multiples of 2**24 (two masters elected apart pick the same with odds of about one
    in eight million)."""
    return (1 + secrets.randbelow(_ID_BASES - 1)) * _ID_SPACING


def in_order(
    adverts: Iterable[MasterAdvert], run: str, tag: str, protocol: int = PROTOCOL_VERSION
) -> list[MasterAdvert]:
    """The candidates of ``run`` for a peer with tag ``tag``, in election order."""
    found = {
        advert.instance: advert for advert in adverts
        if advert.role == "candidate" and advert.mismatch(run, tag, protocol) is None
    }
    return sorted(found.values(), key=lambda advert: (advert.rank, advert.instance))


def position(candidates: Sequence[MasterAdvert], own: str, gone: Iterable[str] = ()) -> int:
    """How many candidates come before the one with instance name ``own``, leaving out
    those in ``gone`` (instance names)."""
    left_out = set(gone)
    ahead = 0
    for advert in candidates:
        if advert.instance == own:
            return ahead
        if advert.instance not in left_out:
            ahead += 1
    return ahead


def hosting_at(since: float, place: int, timeout: float) -> float:
    """When the candidate at ``place`` hosts if no master answered from ``since`` on."""
    return since + place * timeout


def outranking(own: MasterAdvert, masters: Iterable[MasterAdvert]) -> MasterAdvert | None:
    """The master of the run that stays instead of ``own`` (the first ahead of it in
    ``master_order``), or None if ``own`` stays."""
    ahead = [m for m in masters if m.instance != own.instance and master_order(m) < master_order(own)]
    return min(ahead, key=master_order, default=None)


def targets(
    masters: Sequence[MasterAdvert], candidates: Sequence[MasterAdvert], *, limit: int
) -> list[tuple[str, int]]:
    """The ``(host, port)`` addresses to dial for a master, best first: the advertised
    masters' (in ``master_order``, each in its addresses' order), then the candidates'
    reserved ports (in election order), at most ``limit``, each once."""
    found: list[tuple[str, int]] = []
    for advert in [*sorted(masters, key=master_order), *candidates]:
        found += [(host, advert.port) for host in advert.addresses]
    return list(dict.fromkeys(found))[:limit]
