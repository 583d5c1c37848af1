"""The master CLI and the run secret: where a master without one listens, how a secret
is given, and that peers in other processes need it to join."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import pccl_trio as pccl

from .conftest import SECRET, environment


def refused(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pccl_trio.master", *argv], capture_output=True, text=True,
        check=False, timeout=60, env=environment(),
    )


class Master:
    """A master CLI process, up once it printed where it listens."""

    def __init__(self, *argv: str, secret: str | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pccl_trio.master", *argv, "--log-level", "INFO"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=environment(secret),
        )
        assert self.process.stdout is not None
        self.line = self.process.stdout.readline().strip()
        assert self.line.startswith("pccl-trio master listening on "), self.line
        self.address = self.line.rsplit(" ", 1)[1]

    @property
    def port(self) -> str:
        return self.address.rsplit(":", 1)[1]

    def stop(self) -> str:
        """Stop it; what it logged."""
        self.process.terminate()
        _out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, err
        return err


def test_without_a_secret_the_master_listens_on_loopback_only() -> None:
    master = Master("--listen", "0.0.0.0:0")
    assert master.address.startswith("127.0.0.1:")
    assert "loopback" in master.stop()
    explicit = refused("--listen", "192.0.2.1:0")
    assert explicit.returncode == 2
    assert "will not listen on 192.0.2.1 without a run secret" in explicit.stderr
    assert "--insecure" in explicit.stderr


def test_insecure_listens_where_asked() -> None:
    master = Master("--listen", "0.0.0.0:0", "--insecure")
    assert master.address.startswith("0.0.0.0:")
    master.stop()


def test_bad_secret_files_are_clear_errors(tmp_path: Path) -> None:
    missing = refused("--secret-file", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "cannot read the run secret" in missing.stderr
    short = tmp_path / "short"
    short.write_text("tiny\n")
    too_short = refused("--secret-file", str(short))
    assert too_short.returncode == 2 and "at least 16 bytes" in too_short.stderr


@pytest.mark.parametrize("given", ["file", "environment"])
async def test_with_a_secret_only_peers_holding_it_join(tmp_path: Path, given: str) -> None:
    if given == "file":
        path = tmp_path / "secret"
        path.write_text(SECRET + "\n")
        master = Master("--listen", "0.0.0.0:0", "--secret-file", str(path))
    else:
        master = Master("--listen", "0.0.0.0:0", secret=SECRET)
    assert master.address.startswith("0.0.0.0:")  # a secret lets it listen everywhere
    address = f"127.0.0.1:{master.port}"
    try:
        with trio.fail_after(60):
            stranger = pccl.Communicator(address, p2p_host="127.0.0.1")
            with pytest.raises(pccl.MasterConnectionError, match="run secret"):
                await stranger.connect()
            config = pccl.Config(run_secret=SECRET)
            async with pccl.Communicator(address, config=config, p2p_host="127.0.0.1") as comm:
                assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
    finally:
        master.stop()


def test_communicators_without_a_secret_stay_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PCCL_TRIO_RUN_SECRET", raising=False)
    with pytest.raises(pccl.InvalidArgument, match="not on this machine"):
        pccl.Communicator("192.0.2.1:48148")
    with pytest.raises(pccl.InvalidArgument, match="will not listen on 192.0.2.7"):
        pccl.Communicator("127.0.0.1:48148", p2p_host="192.0.2.7")
    pccl.Communicator("192.0.2.1:48148", config=pccl.Config(insecure=True))
    pccl.Communicator("192.0.2.1:48148", config=pccl.Config(run_secret=SECRET))
    monkeypatch.setenv("PCCL_TRIO_RUN_SECRET", SECRET)
    pccl.Communicator("192.0.2.1:48148")  # the environment's secret counts


def identity_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pccl_trio", "identity", *argv], capture_output=True, text=True,
        check=False, timeout=60, env=environment(),
    )


async def test_the_allowlist_file_admits_the_keys_pccl_trio_identity_prints(tmp_path: Path) -> None:
    """``pccl-trio identity PATH`` creates a key once and prints its public half; a
    master given that line in ``--allow-identities`` admits the node, and refuses
    another one with a reason."""
    first = identity_command(str(tmp_path / "node.key"))
    again = identity_command(str(tmp_path / "node.key"))
    assert first.returncode == 0 and len(first.stdout.strip()) == 64, first
    assert again.stdout == first.stdout  # the same key, not a new one
    allowlist = tmp_path / "allowed"
    allowlist.write_text(f"# the run's nodes\n{first.stdout.strip()}  node-a\n\n")
    master = Master("--listen", "127.0.0.1:0", "--allow-identities", str(allowlist), secret=SECRET)
    address = f"127.0.0.1:{master.port}"
    try:
        with trio.fail_after(60):
            config = pccl.Config(run_secret=SECRET, identity=tmp_path / "node.key")
            async with pccl.Communicator(address, config=config, p2p_host="127.0.0.1") as comm:
                assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
            other = pccl.Config(run_secret=SECRET, identity=tmp_path / "other.key")
            stranger = pccl.Communicator(address, config=other, p2p_host="127.0.0.1")
            with pytest.raises(pccl.Kicked, match="is not in this master's allowlist"):
                await stranger.connect()
    finally:
        master.stop()


def test_bad_identity_options_are_clear_errors(tmp_path: Path) -> None:
    allowlist = tmp_path / "allowed"
    allowlist.write_text("0123\n")
    malformed = refused("--allow-identities", str(allowlist), "--secret-file", __file__)
    assert malformed.returncode == 2 and "line 1: '0123' is not a public identity key" in malformed.stderr
    allowlist.write_text("")
    no_secret = refused("--allow-identities", str(allowlist))
    assert no_secret.returncode == 2 and "--allow-identities needs a run secret" in no_secret.stderr
    (tmp_path / "open.key").write_text("")
    os.chmod(tmp_path / "open.key", 0o644)
    unusable = identity_command(str(tmp_path / "open.key"))
    assert unusable.returncode == 1 and "chmod 600" in unusable.stderr


async def test_a_master_proves_its_identity_key(tmp_path: Path) -> None:
    """``--identity PATH``: the master proves the key; a peer that expects it joins."""
    key = identity_command(str(tmp_path / "master.key")).stdout.strip()
    assert refused("--identity", str(tmp_path / "master.key")).returncode == 2  # no secret
    master = Master("--listen", "127.0.0.1:0", "--identity", str(tmp_path / "master.key"),
                    secret=SECRET)
    try:
        with trio.fail_after(60):
            config = pccl.Config(run_secret=SECRET, master_identities=frozenset({bytes.fromhex(key)}))
            address = f"127.0.0.1:{master.port}"
            async with pccl.Communicator(address, config=config, p2p_host="127.0.0.1") as comm:
                assert comm.get_attribute(pccl.Attribute.GLOBAL_WORLD_SIZE) == 1
    finally:
        master.stop()
