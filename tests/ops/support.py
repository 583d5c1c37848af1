"""Shared helpers of the ops tests."""

from __future__ import annotations

import re

import numpy
import pytest

NUMPY_RELEASE = tuple(int(part) for part in re.findall(r"\d+", numpy.__version__)[:3])

# numpy/numpy#28599: before 2.2.5 numpy imported every DLPack array read-only, so as_array refuses
# DLPack exporters there (with advice to upgrade numpy).
needs_writable_dlpack = pytest.mark.skipif(
    NUMPY_RELEASE < (2, 2, 5), reason="numpy < 2.2.5 imports DLPack arrays read-only"
)
