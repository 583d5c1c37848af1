"""Discovery's sans-IO part: run names, the auth tag, the TXT record, reading a hostile
advertisement, which master a peer joins, and what it is told when none suits."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl_trio._core.discovery import (
    MAX_RUN_BYTES,
    MalformedAdvert,
    MasterAdvert,
    auth_tag,
    build_txt,
    check_run_name,
    choose,
    describe_seen,
    instance_name,
    order_addresses,
    parse_txt,
    read_advert,
)
from pccl_trio._core.messages import PROTOCOL_VERSION

from .support import DETERMINISTIC

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32


def txt(*strings: bytes) -> bytes:
    return b"".join(bytes([len(string)]) + string for string in strings)


def advert(
    instance: str = "run-00000000", *, run: str = "run", protocol: int = PROTOCOL_VERSION,
    secret: bytes | None = SECRET, port: int = 48148, addresses: tuple[str, ...] = ("10.0.0.1",),
) -> MasterAdvert:
    return MasterAdvert(
        instance=instance, run=run, protocol=protocol, auth=auth_tag(secret, run), port=port,
        addresses=addresses,
    )


# --- run names, tags, instance names ----------------------------------------------------


@pytest.mark.parametrize("run", ["r", "llama-70b run #3", "é" * 31 + "x", "x" * MAX_RUN_BYTES, "a.b=c"])
def test_run_names_that_are_fine(run: str) -> None:
    assert check_run_name(run) == run


@pytest.mark.parametrize(
    ("run", "says"),
    [
        ("", "must not be empty"),
        ("x" * (MAX_RUN_BYTES + 1), "64 bytes of UTF-8; at most 63"),
        ("é" * 32, "64 bytes of UTF-8"),
        ("tab\there", "control characters"),
        ("bell\x7f", "control characters"),
        ("\ud800", "not valid Unicode"),
        (b"run", "must be a string, got bytes"),
        (None, "must be a string"),
    ],
)
def test_run_names_that_are_refused_say_why(run: object, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        check_run_name(run)


def test_the_auth_tag_is_the_documented_hmac() -> None:
    expected = hmac.new(SECRET, b"pccl-trio discovery run", hashlib.sha256).digest()[:8].hex()
    assert auth_tag(SECRET, "run") == expected
    assert len(expected) == 16
    assert auth_tag(None, "run") == ""
    assert auth_tag(OTHER_SECRET, "run") != expected  # another secret: another tag
    assert auth_tag(SECRET, "run2") != expected  # another run: another tag


@pytest.mark.parametrize("run", ["r", "x" * MAX_RUN_BYTES, "é" * 31, "a.b\\c"])
def test_instance_names_fit_one_dns_label(run: str) -> None:
    name = instance_name(run, "0123abcd")
    assert len(name.encode()) <= MAX_RUN_BYTES
    assert name.endswith("-0123abcd")
    assert "." not in name and "\\" not in name
    assert run.replace(".", "-").replace("\\", "-").startswith(name[: -len("-0123abcd")])


# --- the TXT record -----------------------------------------------------------------------


def test_a_built_record_reads_back() -> None:
    data = build_txt("run 1", protocol=PROTOCOL_VERSION, tag=auth_tag(SECRET, "run 1"))
    assert parse_txt(data) == {
        "txtvers": b"1", "run": b"run 1", "proto": str(PROTOCOL_VERSION).encode(),
        "auth": auth_tag(SECRET, "run 1").encode(),
    }
    found = read_advert(instance="run 1-0a", text=data, port=5, addresses=["10.0.0.2"])
    assert found == MasterAdvert(
        instance="run 1-0a", run="run 1", protocol=PROTOCOL_VERSION, auth=auth_tag(SECRET, "run 1"),
        port=5, addresses=("10.0.0.2",),
    )
    assert found.address == "10.0.0.2:5"


def test_without_a_secret_the_record_has_no_auth() -> None:
    data = build_txt("run")
    assert "auth" not in parse_txt(data)
    assert read_advert(instance="i", text=data, port=1, addresses=["10.0.0.2"]).auth == ""


def test_txt_follows_rfc_6763() -> None:
    data = txt(b"", b"=no key", b"RUN=first", b"run=second", b"flag", b"proto=7", b"empty=")
    assert parse_txt(data) == {"run": b"first", "flag": None, "proto": b"7", "empty": b""}
    assert parse_txt(b"") == {}
    assert parse_txt(b"\x00") == {}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\x09run=x", "runs past"),
        (txt(b"run=x") + b"\x05ab", "runs past"),
        (txt(b"r\x00n=x"), "not printable ASCII"),
        (txt(b"k\xc3\xa9y=x"), "not printable ASCII"),
        (txt(b"k" * 65 + b"=x"), "not printable ASCII"),
    ],
)
def test_broken_txt_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(MalformedAdvert, match=says):
        parse_txt(data)


GOOD = (b"run=r", b"proto=7", b"auth=" + auth_tag(SECRET, "r").encode())


@pytest.mark.parametrize(
    ("strings", "port", "addresses", "says"),
    [
        ((b"proto=7",), 1, ["10.0.0.1"], "no run="),
        ((b"run=", b"proto=7"), 1, ["10.0.0.1"], "no run="),
        ((b"run", b"proto=7"), 1, ["10.0.0.1"], "no run="),
        ((b"run=\xff\xfe", b"proto=7"), 1, ["10.0.0.1"], "not UTF-8"),
        ((b"run=r",), 1, ["10.0.0.1"], "not a protocol version"),
        ((b"run=r", b"proto=seven"), 1, ["10.0.0.1"], "not a protocol version"),
        ((b"run=r", b"proto=-1"), 1, ["10.0.0.1"], "not a protocol version"),
        ((b"run=r", b"proto=" + b"9" * 10), 1, ["10.0.0.1"], "not a protocol version"),
        ((b"run=r", b"proto=\xd9\xa3"), 1, ["10.0.0.1"], "not a protocol version"),
        ((b"run=r", b"proto=7", b"auth=XYZ"), 1, ["10.0.0.1"], "lower-case hex"),
        ((b"run=r", b"proto=7", b"auth=ABCD"), 1, ["10.0.0.1"], "lower-case hex"),
        ((b"run=r", b"proto=7", b"auth=" + b"a" * 65), 1, ["10.0.0.1"], "lower-case hex"),
        (GOOD, 0, ["10.0.0.1"], "not a TCP port"),
        (GOOD, 65536, ["10.0.0.1"], "not a TCP port"),
        (GOOD, None, ["10.0.0.1"], "not a TCP port"),
        (GOOD, 1, [], "no address"),
    ],
)
def test_unreadable_advertisements_say_why(
    strings: tuple[bytes, ...], port: int | None, addresses: list[str], says: str
) -> None:
    with pytest.raises(MalformedAdvert, match=says):
        read_advert(instance="i", text=txt(*strings), port=port, addresses=addresses)


@DETERMINISTIC
@given(
    text=st.one_of(
        st.binary(max_size=300),
        st.lists(st.binary(max_size=40), max_size=8).map(lambda strings: txt(*strings)),
        st.lists(
            st.sampled_from([b"run=r", b"run=", b"proto=7", b"proto=x", b"auth=", b"auth=0f",
                             b"RUN=\xff", b"=", b"txtvers=1"]),
            max_size=6,
        ).map(lambda strings: txt(*strings)),
    ),
    port=st.one_of(st.none(), st.integers(-5, 70000)),
)
def test_no_advertisement_breaks_the_reader(text: bytes, port: int | None) -> None:
    try:
        found = read_advert(instance="i", text=text, port=port, addresses=["10.0.0.1"])
    except MalformedAdvert:
        return
    assert found.run and 0 < found.port <= 65535


# --- choosing a master --------------------------------------------------------------------


def test_a_master_suits_only_with_the_same_run_protocol_and_secret() -> None:
    tag = auth_tag(SECRET, "run")
    assert advert().mismatch("run", tag) is None
    assert advert(run="other").mismatch("run", tag) == "run 'other'"
    assert advert(run="other", protocol=6).mismatch("run", tag) == "run 'other' (protocol 6)"
    assert advert(protocol=6).mismatch("run", tag) == (
        f"run 'run' with protocol 6 (this peer speaks {PROTOCOL_VERSION})"
    )
    assert advert(secret=OTHER_SECRET).mismatch("run", tag) == "run 'run' with another run secret"
    assert advert(secret=None).mismatch("run", tag) == "run 'run' without a run secret"
    assert advert().mismatch("run", "") == "run 'run' with a run secret (this peer has none)"
    assert advert(secret=None).mismatch("run", "") is None  # both without a secret


def test_the_lowest_instance_name_is_chosen_whatever_the_order_seen() -> None:
    matching = [advert(f"run-{suffix}") for suffix in ("c0", "a7", "b3")]
    others = [
        advert("run-00", run="other"), advert("run-01", secret=OTHER_SECRET),
        advert("run-02", protocol=PROTOCOL_VERSION - 1),
    ]
    every = matching + others
    for seed in range(5):
        random.Random(seed).shuffle(every)
        choice = choose(every, "run", auth_tag(SECRET, "run"))
        assert choice.chosen is not None and choice.chosen.instance == "run-a7"
        assert [found.instance for found in choice.matching] == ["run-a7", "run-b3", "run-c0"]
        assert [found.instance for found, _why in choice.others] == ["run-00", "run-01", "run-02"]


def test_nothing_suitable_is_described() -> None:
    tag = auth_tag(SECRET, "x")
    choice = choose(
        [advert("y-1", run="y", protocol=6), advert("x-1", run="x", secret=OTHER_SECRET),
         advert("x-2", run="x", secret=OTHER_SECRET)],
        "x", tag, protocol=PROTOCOL_VERSION,
    )
    assert choice.chosen is None and choice.matching == ()
    assert describe_seen(choice.others) == (
        "run 'x' with another run secret (2 masters), run 'y' (protocol 6)"
    )
    assert describe_seen(choice.others, unreadable=1).endswith(", 1 advertisement that could not be read")
    assert describe_seen([]) == "no pccl_trio master at all"
    assert describe_seen([], unreadable=3) == "3 advertisements that could not be read"


def test_a_flood_of_runs_is_described_briefly() -> None:
    flood = [(advert(f"r{i}", run=f"r{i}" * 30), f"run 'r{i}'") for i in range(100)]
    described = describe_seen(flood)
    assert described.endswith("92 more") and len(described) < 1000
    long_run = advert(run="z" * 63).mismatch("run", "")
    assert long_run is not None and len(long_run) < 100


# --- addresses ------------------------------------------------------------------------------


def test_addresses_on_this_hosts_subnets_come_first_then_ipv4() -> None:
    addresses = [
        "2001:db8::5", "172.17.0.1", "fe80::1", "127.0.0.1", "::1", "192.168.1.20", "0.0.0.0",
        "224.0.0.251", "not an address", "192.168.1.20", "10.0.0.9",
    ]
    local = [ipaddress.ip_network("192.168.1.0/24"), ipaddress.ip_network("2001:db8::/64")]
    assert order_addresses(addresses, local) == (
        "192.168.1.20", "2001:db8::5", "10.0.0.9", "172.17.0.1",
    )
    assert order_addresses(addresses) == ("10.0.0.9", "172.17.0.1", "192.168.1.20", "2001:db8::5")
    assert order_addresses(["127.0.0.1", "fe80::1"]) == ()


def test_an_ipv6_address_is_bracketed() -> None:
    assert advert(addresses=("2001:db8::5",), port=9).address == "[2001:db8::5]:9"
