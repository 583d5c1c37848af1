"""Rooms keep their private modules to themselves, and no module imports in a circle.

A *room* is a subpackage of ``pccl_trio`` (``_core``, ``ops``, ``transport``, ``master``,
``peer``, ``topology``, ``testing``). A module whose name starts with ``_`` is private
to its room: another room, or a module at the top of the package, imports what it
needs from the room itself (its ``__init__.py`` re-exports it), never from the private
module. ``_core``'s modules have public names, so any of them may be imported.

Imports made when a module runs form no circle: where two parts need each other, one
is handed the other when they are built (as the communicator builds its parts), and
not imported by it. Imports only for the type checker (``if TYPE_CHECKING:``) are left
out of that rule.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import pccl_trio

PACKAGE = pathlib.Path(pccl_trio.__file__).parent
ROOMS = frozenset(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: pathlib.Path) -> list[str]:
    """``pccl_trio/peer/_p2p.py`` -> ``["pccl_trio", "peer", "_p2p"]`` (a package is
    named by its ``__init__``'s folder)."""
    parts = ["pccl_trio", *path.relative_to(PACKAGE).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported(source: str, name: list[str], *, package: bool) -> list[tuple[int, list[str]]]:
    """Every module that ``source`` (the module ``name``; ``package``: an
    ``__init__.py``) imports, with its line, absolute and split; for ``from M import
    n``, both ``M`` and ``M.n`` (``n`` may be a module)."""
    here = name if package else name[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            found.append((node.lineno, module))
            found += [(node.lineno, [*module, alias.name]) for alias in node.names]
    return found


def room_of(name: list[str]) -> str | None:
    """The room a module of ``pccl_trio`` lies in (None: the top of the package, or
    outside it)."""
    if len(name) >= 2 and name[0] == "pccl_trio" and name[1] in ROOMS:
        return name[1]
    return None


def private_imports(source: str, name: list[str], *, package: bool = False) -> list[str]:
    """The imports of another room's private modules in ``source`` (see ``imported``)."""
    own = room_of(name)
    bad: list[str] = []
    for line, target in imported(source, name, package=package):
        room = room_of(target)
        if room is None or room == own:
            continue
        private = [index for index, part in enumerate(target) if index >= 2 and part.startswith("_")]
        if private:  # named down to the private module
            found = f"line {line}: {'.'.join(target[: private[0] + 1])}"
            if found not in bad:
                bad.append(found)
    return bad


def test_the_rooms_are_found() -> None:
    assert {"_core", "ops", "transport", "master", "peer", "topology", "testing"} <= ROOMS


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from ..master._server import serve_master", ["line 1: pccl_trio.master._server"]),
        ("from ..transport import _exposure", ["line 1: pccl_trio.transport._exposure"]),
        ("import pccl_trio.ops._kernels", ["line 1: pccl_trio.ops._kernels"]),
        ("def f():\n    from ..testing._memory import MemoryHost",
         ["line 2: pccl_trio.testing._memory"]),
        ("from ._p2p import P2PConnections", []),  # its own room
        ("from ..transport import FramedStream", []),
        ("from .._core.messages import Welcome", []),
        ("from .._config import Config", []),  # the top of the package is no room
    ],
)
def test_each_form_of_a_private_import_is_caught(source: str, found: list[str]) -> None:
    assert private_imports(source, ["pccl_trio", "peer", "_probe"]) == found


def test_a_package_imports_relative_to_itself() -> None:
    name = ["pccl_trio", "testing"]
    assert private_imports("from ..peer._seam import PeerSeam", name, package=True) == [
        "line 1: pccl_trio.peer._seam"
    ]
    assert private_imports("from ._memory import MemoryHost", name, package=True) == []


def runtime_imports(path: pathlib.Path) -> set[str]:
    """The modules of ``pccl_trio`` that ``path`` imports when it runs (not those under
    ``if TYPE_CHECKING:``); ``from M import n`` imports ``M.n`` where that is a module,
    ``M`` otherwise."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    checking = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    name = module_name(path)
    here = name if path.name == "__init__.py" else name[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in NAMES else module)
    return {module for module in found if module in NAMES and module != ".".join(name)}


NAMES = {".".join(module_name(path)) for path in MODULES}


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = {".".join(module_name(path)): runtime_imports(path) for path in MODULES}
    done: set[str] = set()

    def circle_from(module: str, trail: list[str]) -> list[str]:
        if module in trail:
            return [*trail[trail.index(module):], module]
        if module in done:
            return []
        for imported_module in sorted(graph[module]):
            circle = circle_from(imported_module, [*trail, module])
            if circle:
                return circle
        done.add(module)
        return []

    for module in sorted(graph):
        assert circle_from(module, []) == []


def test_the_retried_passes_and_the_all_reduces_do_not_import_each_other() -> None:
    """``RetriedReduces`` launches through ``AllReduces``, which knows nothing of it."""
    graph = {".".join(module_name(path)): runtime_imports(path) for path in MODULES}
    assert "pccl_trio.peer._collectives" in graph["pccl_trio.peer._retry"]
    assert "pccl_trio.peer._retry" not in graph["pccl_trio.peer._collectives"]


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_imports_another_rooms_private_module(path: pathlib.Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert private_imports(source, module_name(path), package=path.name == "__init__.py") == []
