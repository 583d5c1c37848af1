"""Code blocks of the docs that tests run as written: each follows a marker comment."""

from __future__ import annotations

import pathlib

#: The repository's root, where README.md and docs/ are.
ROOT = pathlib.Path(__file__).resolve().parents[2]


def python_block_after(path: pathlib.Path, marker: str) -> str:
    """The ```python block right after ``marker`` in ``path``, which must mark
    exactly one."""
    text = path.read_text(encoding="utf-8")
    assert text.count(marker) == 1, f"{path.name} must hold {marker!r} exactly once"
    after = text.split(marker, 1)[1]
    opening = "\n```python\n"
    assert after.startswith(opening), "the marker must be followed by a ```python block"
    return after[len(opening):].split("\n```\n", 1)[0]
