"""What crosses between host and GPU memory: bytes counted at every bulk copy.

Theory of operation
-------------------
GPU buffers reach the sockets through host memory, so every byte sent from a GPU was
first copied device-to-host, and every byte received is copied host-to-device before
the device reduces it. Those copies cost PCIe bandwidth beside the network's, and the
point of encoding on the device (quantization) is that only the codes make the trip.
To show it on a real GPU, where nothing else counts them, each place that issues a
bulk copy between the two (the staging layer's senders and landers, the codec's codes,
a shared-state tensor read for hashing or sending) adds the copy's size here.

The counters are per process and only grow; a reader takes the difference around
what it measures (``CROSSINGS.snapshot()``). They count what the library asked the
device to copy, which is what crosses the bus. The few scalars read back to encode a
block (its minimum and maximum, a few bytes per slice of a MiB) are not counted.
Host buffers never add anything.
"""

from __future__ import annotations

import threading

__all__ = ["CROSSINGS", "Crossings"]


class Crossings:
    """Running totals of bytes copied between host and device memory."""

    __slots__ = ("_lock", "to_device_bytes", "to_host_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # copies are issued from several threads
        self.to_host_bytes = 0
        self.to_device_bytes = 0

    def to_host(self, nbytes: int) -> None:
        with self._lock:
            self.to_host_bytes += nbytes

    def to_device(self, nbytes: int) -> None:
        with self._lock:
            self.to_device_bytes += nbytes

    def snapshot(self) -> tuple[int, int]:
        """``(to_host_bytes, to_device_bytes)`` so far."""
        with self._lock:
            return self.to_host_bytes, self.to_device_bytes


CROSSINGS = Crossings()
"""The process's counters."""
