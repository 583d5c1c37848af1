"""Discovery in one process: what ``Communicator(discover=...)``, ``list_masters``,
``serve_master_tcp(advertise=...)`` and ``pccl-trio master --advertise`` refuse, the
error when nothing advertises the run (a real mDNS browse on this host's interfaces,
with a run name no one uses), a cancelled browse, and reading resolved records that a
hostile advertiser sent. Masters found across hosts: ``tests/process/test_discovery_namespaces.py``.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

import pccl_trio as pccl
from pccl_trio import _cli
from pccl_trio._core.discovery import MalformedAdvert, auth_tag, build_txt
from pccl_trio._core.messages import PROTOCOL_VERSION
from pccl_trio.transport import _discovery
from pccl_trio.transport._discovery import advert_of, browse, check_advertise

pytest.importorskip("zeroconf")

TIMEOUT = 20
SECRET = "d" * 32


def unique_run() -> str:
    return f"nobody-uses-{secrets.token_hex(6)}"


def zeroconf_threads() -> list[str]:
    """Threads of zeroconf still alive: its event loop and its browsers."""
    return [
        thread.name for thread in threading.enumerate()
        if ("zeroconf" in thread.name or "_run_loop" in thread.name)
        and not thread.name.startswith("pytest_timeout")  # the guard's timer, named after the test
    ]


# --- what is refused ------------------------------------------------------------------------


class NoDirectory:
    """A network that advertises nothing (``connect``/``listen`` only)."""

    async def connect(self, host: str, port: int) -> Any:
        raise OSError("unused")

    async def listen(self, host: str, port: int) -> Any:
        raise OSError("unused")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: pccl.Communicator("127.0.0.1:1", discover="r"), "not both"),
        (lambda: pccl.Communicator(), "got neither"),
        (lambda: pccl.Communicator(discover="", config=pccl.Config(run_secret=SECRET)),
         "discover: a run name must not be empty"),
        (lambda: pccl.Communicator(discover="x" * 64, config=pccl.Config(run_secret=SECRET)),
         "at most 63 fit in a DNS label"),
        (lambda: pccl.Communicator(discover="r", config=pccl.Config(run_secret=SECRET),
                                   network=NoDirectory()),
         "NoDirectory has no directory: give the master's address"),
        (lambda: pccl.Communicator("127.0.0.1:1", host_master=True), "give discover='RUN'"),
        (lambda: pccl.Communicator(discover="r"), "peer without a run secret does not reach"),
        (lambda: pccl.Communicator(discover="r", host_master=True, p2p_host="127.0.0.1",
                                   config=pccl.Config(run_secret=SECRET)),
         r"p2p_host='127.0.0.1': a master elected here would listen on loopback"),
    ],
)
def test_the_communicator_refuses_discovery_that_cannot_work(
    make: Callable[[], Any], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PCCL_TRIO_RUN_SECRET", raising=False)
    with pytest.raises(pccl.InvalidArgument, match=says):
        make()


def test_without_zeroconf_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from pccl_trio.peer import _election

    monkeypatch.setattr(_election, "discovery_available", lambda: False)
    with pytest.raises(pccl.InvalidArgument, match=r"pip install 'pccl_trio\[discovery\]'"):
        pccl.Communicator(discover="r", config=pccl.Config(run_secret=SECRET))
    monkeypatch.setattr(_discovery, "discovery_available", lambda: False)
    with pytest.raises(ValueError, match=r"pccl_trio\[discovery\]"):
        check_advertise("r", "0.0.0.0", secured=True, insecure=False)
    monkeypatch.setitem(sys.modules, "zeroconf", None)  # import zeroconf now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'pccl_trio\[discovery\]'"):
        _discovery._zeroconf()


async def test_list_masters_refuses_what_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(TIMEOUT):
        with pytest.raises(pccl.InvalidArgument, match="list_masters: a run name must not be empty"):
            await pccl.list_masters("")
        monkeypatch.setattr(_discovery, "discovery_available", lambda: False)
        with pytest.raises(pccl.InvalidUsage, match=r"pccl_trio\[discovery\]"):
            await pccl.list_masters("r")


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "10"])
def test_the_discovery_timeout_is_checked(timeout: object) -> None:
    with pytest.raises(ValueError, match="Config.discovery_timeout must be a positive number"):
        pccl.Config(discovery_timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--advertise", "r"], "cannot advertise run 'r' without a run secret"),
        (["--advertise", "r", "--listen", "127.0.0.1:0", "--insecure"], "other hosts cannot reach loopback"),
        (["--advertise", "", "--insecure"], "cannot advertise: a run name must not be empty"),
        (["--advertise", "é" * 32, "--insecure"], "64 bytes of UTF-8; at most 63"),
    ],
)
def test_the_master_cli_refuses_advertisements_that_cannot_work(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PCCL_TRIO_RUN_SECRET", raising=False)
    with pytest.raises(SystemExit) as exited:
        _cli.master_main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_the_master_cli_passes_the_run_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    runs: list[str | None] = []

    async def run_master(
        host: str, port: int, config: pccl.Config, advertise: str | None, metrics: object = None
    ) -> None:
        runs.append(advertise)

    monkeypatch.setattr(_cli, "_run_master", run_master)
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    assert _cli.master_main(["--advertise", "run a", "--secret-file", str(secret)]) == 0
    assert _cli.master_main(["--secret-file", str(secret)]) == 0
    assert runs == ["run a", None]


async def test_serve_master_tcp_refuses_to_advertise_a_master_without_a_secret() -> None:
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ValueError, match="without a run secret"):
            await pccl.serve_master_tcp(0, advertise="r")
        with pytest.raises(ValueError, match="cannot reach loopback"):
            await pccl.serve_master_tcp(
                0, "127.0.0.1", config=pccl.Config(run_secret=SECRET), advertise="r"
            )


# --- browsing ---------------------------------------------------------------------------------


async def test_a_run_no_one_advertises_fails_with_what_was_looked_for() -> None:
    run = unique_run()
    comm = pccl.Communicator(
        discover=run, config=pccl.Config(run_secret=SECRET, discovery_timeout=0.3)
    )
    assert comm.master_address == "" and f"run {run!r}, not found yet" in repr(comm)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(pccl.MasterConnectionError) as raised:
            await comm.connect()
    message = str(raised.value)
    assert f"no master advertises run {run!r} on this network within 0.3 s" in message
    assert f"protocol {PROTOCOL_VERSION} and this peer's run secret" in message
    assert "seen: " in message and "--advertise" in message
    with pytest.raises(pccl.InvalidUsage):
        await comm.connect()  # a failed connect closed it
    assert zeroconf_threads() == []


async def test_a_cancelled_browse_returns_and_closes_zeroconf() -> None:
    with trio.fail_after(TIMEOUT):
        with trio.move_on_after(0.2) as scope:
            await browse(3600)
        assert scope.cancelled_caught
    assert zeroconf_threads() == []


# --- reading what was resolved ------------------------------------------------------------------


class Resolved:
    """Stands in for zeroconf's resolved ``ServiceInfo``."""

    def __init__(self, text: bytes | None, port: int | None, addresses: list[str]) -> None:
        self.text, self.port, self._addresses = text, port, addresses

    def get_name(self) -> str:
        return "r-0a"

    def parsed_addresses(self) -> list[str]:
        return self._addresses


def test_a_resolved_record_is_read_with_its_addresses_in_order() -> None:
    import ipaddress

    text = build_txt("r", tag=auth_tag(SECRET.encode(), "r"))
    found = advert_of(
        Resolved(text, 4, ["10.1.0.5", "fe80::1", "127.0.0.1", "192.168.7.3"]),
        [ipaddress.ip_network("192.168.7.0/24")],
    )
    assert found.addresses == ("192.168.7.3", "10.1.0.5")
    assert (found.instance, found.run, found.port) == ("r-0a", "r", 4)


@pytest.mark.parametrize(
    ("text", "port", "addresses", "says"),
    [
        (None, 4, ["10.0.0.1"], "no run="),
        (b"\xff" * 10, 4, ["10.0.0.1"], "runs past"),
        (build_txt("r"), None, ["10.0.0.1"], "not a TCP port"),
        (build_txt("r"), 4, ["127.0.0.1", "fe80::2"], "no address but loopback or link-local"),
    ],
)
def test_hostile_records_are_refused(
    text: bytes | None, port: int | None, addresses: list[str], says: str
) -> None:
    with pytest.raises(MalformedAdvert, match=says):
        advert_of(Resolved(text, port, addresses))
