"""The core stays sans-IO: no module under ``pccl_trio/_core`` imports IO, clocks or threads."""

from __future__ import annotations

import ast
import pathlib

import pytest

import pccl_trio._core

CORE = pathlib.Path(pccl_trio._core.__file__).parent
FORBIDDEN = frozenset({"trio", "socket", "time", "threading", "asyncio", "select"})


def forbidden_imports(source: str) -> list[str]:
    """Every import in ``source`` that reaches IO, a clock or a thread, or leaves the core.

    Relative imports may only name siblings (``from .x import y``): anything further up
    is the IO shell. Absolute imports of ``pccl_trio`` must stay inside ``pccl_trio._core``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                found.append("." * node.level + (node.module or ""))
                continue
            modules = [] if node.level == 1 else [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top in FORBIDDEN or (top == "pccl_trio" and not module.startswith("pccl_trio._core")):
                found.append(module)
    return found


CORE_MODULES = sorted(CORE.rglob("*.py"))


def test_core_modules_are_found() -> None:
    names = {path.name for path in CORE_MODULES}
    assert {"__init__.py", "errors.py", "master.py", "messages.py", "ring.py", "wire.py"} <= names


@pytest.mark.parametrize("path", CORE_MODULES, ids=lambda path: str(path.relative_to(CORE)))
def test_core_module_is_sans_io(path: pathlib.Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import trio", ["trio"]),
        ("import trio.lowlevel", ["trio.lowlevel"]),
        ("import socket as s", ["socket"]),
        ("from time import monotonic", ["time"]),
        ("import os, threading", ["threading"]),
        ("from asyncio import sleep", ["asyncio"]),
        ("import select", ["select"]),
        ("def f():\n    import time\n", ["time"]),
        ("from .. import peer", [".."]),
        ("from ..transport import x", ["..transport"]),
        ("from pccl_trio.transport import x", ["pccl_trio.transport"]),
        ("import pccl_trio", ["pccl_trio"]),
        ("from .wire import FrameDecoder", []),
        ("from pccl_trio._core import wire", []),
        ("import math, dataclasses, msgpack", []),
        ("import timeit, selectors_x", []),
    ],
)
def test_the_check_itself(source: str, found: list[str]) -> None:
    assert forbidden_imports(source) == found
