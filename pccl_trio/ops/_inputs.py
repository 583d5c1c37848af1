"""An in-place all-reduce's saved input: what an attempt that does not succeed puts
back.

Theory of operation
-------------------
An in-place all-reduce writes results into the caller's buffer while the attempt may
still fail, and a failed attempt must leave the caller's input bit for bit. So the
input of every slice is copied aside just before its first write (``keep``): the
reduce-scatter's combined slices, and the all-gather's copy of this peer's own chunk,
the only slices written at all. The copies sit at the same offsets of one buffer of the
staging's pool, taken at the first write (fresh memory would cost a page fault per
page on first touch, slower than the copy itself), and ``restore`` copies back exactly
the slices kept. The attempt calls it only once no writer runs any more.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ._staging import Staging

__all__ = ["InputBackup"]


class InputBackup:
    """The kept input of one attempt's buffer (``result_bytes``, a uint8 view).

    Args:
        staging: whose pool lends the backup buffer, and where copies run.
        lock: the attempt's lock, which guards the list of kept slices.
    """

    def __init__(self, staging: Staging, result_bytes: Any, *, lock: threading.Lock) -> None:
        self._staging = staging
        self._result = result_bytes
        self._lock = lock
        self._buffer: Any = None
        self._kept: list[tuple[int, int]] = []
        self.restore_seconds = 0.0  # spent putting the input back

    def keep(self, start: int, stop: int) -> None:
        """Copy aside the input of bytes ``[start, stop)``, about to be first written
        (any thread; slices never overlap)."""
        with self._lock:
            if self._buffer is None:
                self._buffer = self._staging.pool.take(len(self._result))
            self._kept.append((start, stop))
        self._buffer[start:stop] = self._result[start:stop]

    def restore(self) -> None:
        """Put back every slice kept (once no writer runs)."""
        started = time.perf_counter()
        with self._staging.working():
            for start, stop in self._kept:
                self._result[start:stop] = self._buffer[start:stop]
        if self._kept:
            self.restore_seconds += time.perf_counter() - started
        self._kept.clear()

    def release(self) -> None:
        """Return the backup buffer to the pool; the attempt is over."""
        if self._buffer is not None:
            self._staging.pool.give(self._buffer)
            self._buffer = None
