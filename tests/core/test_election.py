"""The election's rules (sans-IO): the candidates' order, who hosts when, which master
stays in a split brain, the addresses dialed, the ids an elected master hands out, and
the candidacy's TXT fields."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from pccl_trio._core.discovery import (
    MalformedAdvert,
    MasterAdvert,
    auth_tag,
    build_txt,
    choose,
    read_advert,
)
from pccl_trio._core.election import (
    first_peer_id,
    hosting_at,
    in_order,
    outranking,
    position,
    rank_of,
    targets,
)
from pccl_trio._core.messages import PROTOCOL_VERSION

SECRET = b"s" * 32
TAG = auth_tag(SECRET, "run")


def ad(instance: str, *, role: str = "candidate", rank: str = "", host: str = "10.0.0.1",
       port: int = 1, tag: str = TAG, run: str = "run") -> MasterAdvert:
    return MasterAdvert(
        instance=instance, run=run, protocol=PROTOCOL_VERSION, auth=tag, port=port,
        addresses=(host,), role=role, rank=rank,
    )


def test_candidates_are_ordered_by_rank_key_then_instance_whatever_the_order_seen() -> None:
    seen = [ad("c", rank="02"), ad("a", rank="03"), ad("b", rank="02"), ad("m", role="master"),
            ad("x", rank="00", tag=auth_tag(b"o" * 32, "run")), ad("y", rank="00", run="other")]
    order = [advert.instance for advert in in_order(seen, "run", TAG)]
    assert order == ["b", "c", "a"]  # masters, other secrets and other runs left out
    assert [a.instance for a in in_order(reversed(seen), "run", TAG)] == order


def test_the_first_candidate_hosts_at_once_and_each_next_one_timeout_later() -> None:
    line = in_order([ad("a", rank="01"), ad("b", rank="02"), ad("c", rank="03")], "run", TAG)
    assert [position(line, name) for name in "abc"] == [0, 1, 2]
    assert [hosting_at(10.0, position(line, name), 2.0) for name in "abc"] == [10.0, 12.0, 14.0]
    # The lost master's host is left out: the next in line hosts at once.
    assert [position(line, name, gone=["a"]) for name in "bc"] == [0, 1]


def test_a_master_started_by_hand_outranks_elected_ones_and_ranks_decide_among_those() -> None:
    by_hand = ad("zz", role="master")
    low, high = ad("m1", role="master", rank="01"), ad("m2", role="master", rank="02")
    assert outranking(high, [low, high]) == low
    assert outranking(low, [low, high]) is None
    assert outranking(low, [low, high, by_hand]) == by_hand
    assert outranking(by_hand, [low, high, by_hand]) is None
    # Peers joining choose the same master that stays.
    assert choose([high, ad("c", rank="00"), low], "run", TAG).chosen == low


def test_the_addresses_dialed_are_masters_first_then_candidates_in_line() -> None:
    masters = [ad("m2", role="master", rank="02", host="10.0.0.2", port=7),
               ad("m1", role="master", rank="01", host="10.0.0.1", port=7)]
    line = [ad("a", host="10.0.0.3", port=5), ad("b", host="10.0.0.4", port=5),
            ad("dup", host="10.0.0.1", port=7)]
    assert targets(masters, line, limit=8) == [
        ("10.0.0.1", 7), ("10.0.0.2", 7), ("10.0.0.3", 5), ("10.0.0.4", 5),
    ]
    assert len(targets(masters, line, limit=2)) == 2


def test_elected_masters_number_peers_from_random_bases_below_the_run_limit() -> None:
    bases = {first_peer_id() for _ in range(200)}
    assert len(bases) > 190
    assert all(0 < base < 1 << 47 and base % (1 << 24) == 0 for base in bases)


def test_a_rank_key_is_the_identity_keyed_by_the_secret_or_random() -> None:
    key = b"\x01" * 32
    rank = rank_of(key, SECRET, "run")
    assert rank == hmac.new(SECRET, b"pccl-trio rank run\0" + key, hashlib.sha256).hexdigest()
    assert rank == rank_of(key, SECRET, "run")  # every candidate computes the same
    assert key.hex() not in rank  # and an observer does not learn the key
    assert rank != rank_of(key, b"o" * 32, "run") != rank_of(key, SECRET, "other")
    assert rank_of(None, SECRET, "run") != rank_of(None, SECRET, "run")
    assert len(rank_of(None, SECRET, "run")) == 64


def test_a_candidacy_reads_back_and_a_bad_role_or_rank_is_refused() -> None:
    data = build_txt("run", tag=TAG, role="candidate", rank="0a1b")
    found = read_advert(instance="run-1", text=data, port=9, addresses=["10.0.0.9"])
    assert (found.role, found.rank) == ("candidate", "0a1b")
    plain = read_advert(instance="run-2", text=build_txt("run", tag=TAG), port=9, addresses=["h"])
    assert (plain.role, plain.rank) == ("master", "")
    base = build_txt("run", tag=TAG)
    for extra, says in [(b"role=king", "role="), (b"rank=XYZ", "rank="), (b"rank=" + b"0" * 65, "rank=")]:
        with pytest.raises(MalformedAdvert, match=says):
            read_advert(instance="i", text=base + bytes([len(extra)]) + extra, port=9,
                        addresses=["h"])
