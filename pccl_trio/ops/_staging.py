"""Where a collective's bytes wait between the user's buffers and the sockets.

Theory of operation
-------------------
Sockets read and write host memory. A numpy buffer *is* host memory, so the ring's
data path sends straight from it and reduces straight from what it received
(``HostStaging``, which moves nothing). A GPU buffer (a cupy array) is not, so every
outgoing slice is copied device-to-host into a pinned host buffer before it is sent,
and every received slice host-to-device before the device reduces it
(``DeviceStaging``). The ring algorithm (``_attempt``) is the same for both; it asks
its staging for the bytes to send (``Sender.host``), for a received payload on the
buffers' side (``to_device``), and does its kernels inside ``working()``.

Streams. The caller's own queued work on its buffers is waited for when it hands them
over (``wait_current_stream``). Every thread that reduces (a connection's reader) works on a stream of its
own: the host-to-device copy, the backup of what will be overwritten and the
reduction kernels are queued on it in that order, and ``working()`` ends by
synchronizing it, so a slice is marked received only once its result is in device
memory, where another thread's stream may read it. Every sender has a stream and two
pinned buffers: while slice k is being written to the socket from one buffer, the
device-to-host copy of the sender's next slice (if it is ready) runs on the stream
into the other (``Sender.prefetch``), so PCIe and the network work at once. A received
slice's host-to-device copy and reduction run while the network keeps delivering the
next slice into the socket's buffer; the reader reads it when they are done.

Quantized, the codec encodes on the device and only the codes are copied to the host
(see ``_blocks``); the copies here move whatever bytes they are handed, and add
their size to ``ops.CROSSINGS``, which is how a benchmark sees what crossed PCIe.

Several GPUs. A staging belongs to one GPU (``staging_for(xp, gpu)``, ``gpu_of``): its
streams, scratch and backups are made on that GPU, and everything it runs, in whatever
thread, runs with that GPU current (``working``, ``current``), since the readers and
senders are threads that start on the first GPU and a process usually drives another.

Pooled memory. ``BufferPool`` keeps freed buffers of one array module for reuse (a
backup of an in-place input lives in the buffers' own memory, so restoring one on a
GPU never crosses PCIe); pinned host memory is pooled the same way, since pinning
pages is slow.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._crossings import CROSSINGS

log = logging.getLogger("pccl_trio.peer")

#: The slice size GPU buffers want: below it, each slice's fixed cost (the reader's
#: copy, kernels and stream synchronization) slows them down (``docs/gpu.md``).
GPU_SLICE_BYTES = 4 << 20

__all__ = [
    "BufferPool", "DeviceStaging", "HostStaging", "Lander", "Sender", "Staging", "gpu_of",
    "staging_for",
]


#: Host buffers need no stream and no wait (a reusable context manager).
_NOTHING = contextlib.nullcontext()


class BufferPool:
    """Reusable uint8 buffers of one kind of memory (their pages stay mapped).

    Thread-safe: readers of different attempts may take backups at once.

    Args:
        allocate: makes a uint8 buffer of a given size (default: host memory).
    """

    def __init__(self, allocate: Callable[[int], Any] | None = None) -> None:
        self._allocate = allocate or (lambda nbytes: np.empty(nbytes, dtype=np.uint8))
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Any:
        """A uint8 array of at least ``nbytes`` (a view of exactly ``nbytes``)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.size >= nbytes]
            buffer = (
                self._free.pop(min(fitting, key=lambda i: self._free[i].size)) if fitting else None
            )
        if buffer is None:
            buffer = self._allocate(nbytes)
        return buffer[:nbytes]

    def give(self, view: Any) -> None:
        base = view.base if view.base is not None else view
        with self._lock:
            self._free.append(base)
            # Keep a bounded amount: the largest few.
            self._free.sort(key=lambda b: b.size, reverse=True)
            del self._free[4:]


class Sender:
    """One sender's outgoing bytes (host buffers: the bytes themselves)."""

    def host(self, data: Any, key: object = None) -> memoryview:
        """The bytes of ``data`` (a uint8 array of the buffers' module) in host memory,
        valid until the next call; ``key`` names them, as ``prefetch`` did."""
        return memoryview(data)

    def prefetch(self, key: object, data: Any) -> None:
        """``data``, named ``key``, is what the next ``host`` call will be given:
        start its copy."""

    def working(self) -> contextlib.AbstractContextManager[None]:
        """Kernels that produce what ``host`` will copy run inside this."""
        return _NOTHING

    def close(self) -> None:
        """Done sending; no copy is in flight after this."""


class Lander:
    """Where a receiver's payloads land before they reach a buffer of the buffers'
    module (host buffers: in the buffer itself)."""

    def room(self, target: Any) -> memoryview:
        """Where to receive the bytes for ``target`` (uint8, the buffers' memory)."""
        return memoryview(target)

    def landed(self, target: Any, room: memoryview) -> None:
        """``room`` holds ``target``'s bytes: move them there."""

    def close(self) -> None:
        """No copy into a buffer is in flight after this."""


class HostStaging:
    """Host buffers: nothing is copied (see the module docstring)."""

    xp: Any = np

    def __init__(self) -> None:
        self.pool = BufferPool()
        self.host_pool = self.pool  # host memory for bytes kept to be sent

    def sender(self, slice_bytes: int) -> Sender:
        return Sender()

    def lander(self, frame_bytes: int) -> Lander:
        return Lander()

    def check_slices(self, slice_bytes: int, nbytes: int) -> None:
        """Advise, once, on a slice size that does not suit these buffers (an
        all-reduce of ``nbytes`` cut into ``slice_bytes``). Nothing for host buffers."""

    def host_empty(self, nbytes: int) -> Any:
        """A host uint8 buffer to receive into (pinned for a device)."""
        return np.empty(nbytes, dtype=np.uint8)

    def wait_current_stream(self) -> None:
        """Wait for the work queued on this thread's current stream: the caller's, on
        its buffers, when it hands them over; a backup's copies before fetched bytes
        land over what they copy. Nothing to wait for on the host."""

    def current(self) -> contextlib.AbstractContextManager[Any]:
        """Make the buffers' GPU current in this thread (nothing on the host)."""
        return _NOTHING

    def to_device(self, payload: Any) -> Any:
        """A received payload (host uint8) where the buffers live."""
        return payload

    def working(self) -> contextlib.AbstractContextManager[None]:
        """Kernels on the buffers run inside this; they are complete when it ends."""
        return _NOTHING


Staging = HostStaging
"""The interface: ``HostStaging``'s, which ``DeviceStaging`` overrides."""


class _DeviceSender(Sender):
    """Double-buffered device-to-host copies on a stream of the sender's own."""

    def __init__(self, staging: DeviceStaging, slice_bytes: int) -> None:
        self._staging = staging
        with staging.current():
            self._stream = staging.xp.cuda.Stream(non_blocking=True)
        self._pinned = [staging.pinned.take(slice_bytes), staging.pinned.take(slice_bytes)]
        self._current = 0  # the buffer last handed out (being sent)
        self._ahead: object = None  # the key of what is being copied into the other one

    def _start(self, data: Any, buffer: Any) -> Any:
        out = buffer[: data.size]
        self._staging.xp.asnumpy(data, stream=self._stream, out=out, blocking=False)
        CROSSINGS.to_host(data.nbytes)
        return out

    def host(self, data: Any, key: object = None) -> memoryview:
        other = 1 - self._current
        if key is None or self._ahead != key:
            self._stream.synchronize()  # a stale prefetch must not land in the buffer
            self._start(data, self._pinned[other])
        self._ahead = None
        self._stream.synchronize()
        self._current = other
        return memoryview(self._pinned[other][: data.size])

    def prefetch(self, key: object, data: Any) -> None:
        if self._ahead is None:
            self._start(data, self._pinned[1 - self._current])
            self._ahead = key

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        with self._staging.current(), self._stream:
            yield

    def working(self) -> contextlib.AbstractContextManager[None]:
        return self._working()

    def close(self) -> None:
        self._stream.synchronize()
        for buffer in self._pinned:
            self._staging.pinned.give(buffer)
        self._pinned = []


class _DeviceLander(Lander):
    """Two pinned buffers: a frame is received into one while the host-to-device copy
    of the previous one, from the other, runs on the lander's stream."""

    def __init__(self, staging: DeviceStaging, frame_bytes: int) -> None:
        self._staging = staging
        with staging.current():
            self._stream = staging.xp.cuda.Stream(non_blocking=True)
        self._pinned = [staging.pinned.take(frame_bytes), staging.pinned.take(frame_bytes)]
        self._copies: list[Any] = [None, None]  # per buffer: the event of its last copy
        self._next = 0

    def room(self, target: Any) -> memoryview:
        copy = self._copies[self._next]
        if copy is not None:
            copy.synchronize()  # the buffer's previous frame is on the device
            self._copies[self._next] = None
        return memoryview(self._pinned[self._next][: target.size])

    def landed(self, target: Any, room: memoryview) -> None:
        target.set(self._pinned[self._next][: target.size], stream=self._stream)
        CROSSINGS.to_device(target.nbytes)
        self._copies[self._next] = self._stream.record()
        self._next = 1 - self._next

    def close(self) -> None:
        self._stream.synchronize()
        for buffer in self._pinned:
            self._staging.pinned.give(buffer)
        self._pinned = []


class DeviceStaging(HostStaging):
    """GPU buffers: pinned host buffers, copies and kernels on streams (see the
    module docstring).

    Args:
        xp: the buffers' array module (cupy, or a stand-in with its API).
        gpu: the buffers' GPU.
    """

    def __init__(self, xp: Any, gpu: int = 0) -> None:
        self.xp = xp
        self._gpu = xp.cuda.Device(gpu)

        def allocate(nbytes: int) -> Any:
            with self._gpu:
                return xp.empty(nbytes, dtype=xp.uint8)

        self.pool = BufferPool(allocate)
        self.pinned = BufferPool(self.host_empty)
        self.host_pool = self.pinned
        self._local = threading.local()
        self._advised = False

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._gpu:
                stream = self._local.stream = self.xp.cuda.Stream(non_blocking=True)
        return stream

    def sender(self, slice_bytes: int) -> Sender:
        return _DeviceSender(self, slice_bytes)

    def lander(self, frame_bytes: int) -> Lander:
        return _DeviceLander(self, frame_bytes)

    def host_empty(self, nbytes: int) -> Any:
        return np.frombuffer(self.xp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)

    def check_slices(self, slice_bytes: int, nbytes: int) -> None:
        if slice_bytes < GPU_SLICE_BYTES < nbytes and not self._advised:
            self._advised = True
            log.warning(
                "all-reducing GPU buffers in slices of %d bytes (Config.slice_bytes): GPU "
                "buffers run much faster in slices of %d MiB; set "
                "Config(slice_bytes=%d << 20) on every peer of the run (docs/gpu.md)",
                slice_bytes, GPU_SLICE_BYTES >> 20, GPU_SLICE_BYTES >> 20,
            )

    def wait_current_stream(self) -> None:
        # The staging streams do not wait for the caller's stream (non-blocking ones
        # do not even wait for the default stream): wait for it here, so no copy reads
        # a buffer that a kernel the caller queued is still writing. (A torch tensor
        # imported through DLPack made cupy's current stream wait for torch's.)
        with self._gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def current(self) -> contextlib.AbstractContextManager[Any]:
        return self._gpu  # type: ignore[no-any-return]

    def _scratch(self, nbytes: int) -> Any:
        """Room for ``nbytes`` on the device, this thread's own, reused by its next
        call."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or buffer.size < nbytes:
            with self._gpu:
                buffer = self._local.scratch = self.xp.empty(max(nbytes, 1), dtype=self.xp.uint8)
        return buffer[:nbytes]

    def to_device(self, payload: Any) -> Any:
        """Queue the copy of ``payload`` on this thread's stream; use the result only
        inside ``working()``, which orders the kernels after the copy."""
        data = self._scratch(payload.size)
        data.set(payload, stream=self._stream())
        CROSSINGS.to_device(payload.nbytes)
        return data

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        stream = self._stream()
        with self._gpu:
            try:
                with stream:
                    yield
            finally:
                stream.synchronize()

    def working(self) -> contextlib.AbstractContextManager[None]:
        return self._working()


_HOST_STAGING = HostStaging()
_DEVICE_STAGINGS: weakref.WeakKeyDictionary[Any, dict[int, DeviceStaging]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def gpu_of(xp: Any, array: Any) -> int:
    """The GPU ``array`` lives on (0 for host memory)."""
    return 0 if xp is np else int(array.device.id)


def staging_for(xp: Any, gpu: int = 0) -> HostStaging:
    """The staging of array module ``xp``'s buffers on GPU ``gpu`` (one each, so their
    pooled and pinned memory is reused by every collective and sync)."""
    if xp is np:
        return _HOST_STAGING
    with _LOCK:
        stagings = _DEVICE_STAGINGS.setdefault(xp, {})
        staging = stagings.get(gpu)
        if staging is None:
            staging = stagings[gpu] = DeviceStaging(xp, gpu)
        return staging
