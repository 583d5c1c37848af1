"""The public surface: names from the API contract, exported from the top package."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil

import pytest

import pccl_trio as pccl

ERRORS = [
    "MasterConnectionError", "UpdateTopologyFailed", "TopologyOptimizationFailed", "TooFewPeers",
    "CollectiveAborted", "InvalidArgument", "InvalidUsage", "SharedStateSyncFailed", "Kicked",
]
ENUMS = {
    "ReduceOp": {"SUM", "AVG", "PROD", "MAX", "MIN"},
    "DataType": {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64",
                 "FLOAT16", "BFLOAT16", "FLOAT", "DOUBLE"},
    "QuantizationAlgorithm": {"NONE", "MIN_MAX", "ZERO_POINT_SCALE"},
    "DistributionHint": {"NONE", "NORMAL", "UNIFORM"},
    "Attribute": {"GLOBAL_WORLD_SIZE", "PEER_GROUP_WORLD_SIZE", "NUM_DISTINCT_PEER_GROUPS",
                  "LARGEST_PEER_GROUP_WORLD_SIZE"},
    "SharedStateSyncStrategy": {"ENFORCE_POPULAR", "RECEIVE_ONLY", "SEND_ONLY"},
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors_derive_from_pccl_error(name: str) -> None:
    error = getattr(pccl, name)
    assert issubclass(error, pccl.PCCLError)


def test_kicked_carries_its_reason() -> None:
    error = pccl.Kicked("illegal vote")
    assert error.reason == "illegal vote" and "illegal vote" in str(error)


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enums(name: str) -> None:
    enum_type = getattr(pccl, name)
    assert issubclass(enum_type, enum.Enum)
    assert {member.name for member in enum_type} == ENUMS[name]


def test_records_are_frozen_and_keyword_constructible() -> None:
    info = pccl.ReduceInfo(world_size=3, tx_bytes=10, rx_bytes=12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.world_size = 4  # type: ignore[misc]
    assert pccl.SharedStateSyncInfo(tx_bytes=1, rx_bytes=2).rx_bytes == 2
    options = pccl.QuantizationOptions()
    assert options.quantized_datatype is pccl.DataType.UINT8
    assert options.algorithm is pccl.QuantizationAlgorithm.MIN_MAX


def test_every_public_name_is_exported_once_from_a_private_module() -> None:
    seen: dict[int, str] = {}
    for name in dir(pccl):
        if name.startswith("_"):
            continue
        value = getattr(pccl, name)
        if isinstance(value, type) or callable(value):
            assert id(value) not in seen, f"{name} and {seen.get(id(value))} are the same object"
            seen[id(value)] = name
            module = getattr(value, "__module__", "")
            assert module.startswith("pccl_trio"), (name, module)


def test_every_module_imports() -> None:
    for module in pkgutil.walk_packages(pccl.__path__, "pccl_trio."):
        if module.name.endswith("__main__"):
            continue
        importlib.import_module(module.name)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="liveness_timeout"):
        pccl.Config(heartbeat_interval=5.0, liveness_timeout=1.0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        pccl.Config(heartbeat_interval=-1.0)
    with pytest.raises(ValueError, match="pool_size"):
        pccl.Config(p2p_connection_pool_size=-1)
    with pytest.raises(ValueError, match="pool_size"):
        pccl.Config(p2p_connection_pool_size=True)
    assert pccl.Config().p2p_connection_pool_size == 0  # sized to each path


def test_bad_configuration_is_an_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every error pccl_trio raises is a PCCLError, bad settings included (still a
    ValueError, as Python's own bad values are); a secret from the environment is
    named as such."""
    with pytest.raises(pccl.InvalidArgument, match="heartbeat_interval"):
        pccl.Config(heartbeat_interval=-1.0)
    with pytest.raises(pccl.InvalidArgument, match="at least 16 bytes"):
        pccl.Config(run_secret="short")  # the check a helper shares with the CLI
    monkeypatch.setenv("PCCL_TRIO_RUN_SECRET", "deadbeef")
    with pytest.raises(pccl.InvalidArgument, match=r"^\$PCCL_TRIO_RUN_SECRET: .*at least 16"):
        pccl.Communicator("127.0.0.1:48148")


@pytest.mark.parametrize(("address", "says"), [
    ("http://127.0.0.1:48148", "no scheme"),
    ("127.0.0.1:48148/run", "no path"),
    ("fe80::1:48148", r"IPv6 as '\[addr\]:port'"),
])
def test_a_malformed_master_address_is_explained(address: str, says: str) -> None:
    with pytest.raises(pccl.InvalidArgument, match=f"expected 'host:port'.*{says}|{says}"):
        pccl.Communicator(address)


def test_the_version_is_the_package_metadata_and_the_cli_prints_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    from pccl_trio._cli import main
    from pccl_trio._core.messages import PROTOCOL_VERSION

    assert pccl.__version__ == version("pccl_trio")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pccl-trio {pccl.__version__} (protocol {PROTOCOL_VERSION})\n"


def test_the_troubleshooting_table_has_a_row_for_every_error_class() -> None:
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "troubleshooting.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)`", text.split("## Errors", 1)[1].split("\n## ", 1)[0], re.M))
    errors = {
        name for name in dir(pccl)
        if isinstance(getattr(pccl, name), type) and issubclass(getattr(pccl, name), pccl.PCCLError)
    }
    assert errors == set(ERRORS) | {"PCCLError"}
    assert rows == errors, rows ^ errors
