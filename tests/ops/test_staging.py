"""The staging layer on ``StrictDevice``: pinned host buffers, copies on streams, and
overlap of the next slice's device-to-host copy with the current slice's send."""

from __future__ import annotations

import numpy as np
import pytest

from pccl_trio.ops import BufferPool, DeviceStaging, HostStaging
from pccl_trio.testing import StrictDevice


def test_host_staging_moves_nothing() -> None:
    staging = HostStaging()
    data = np.arange(8, dtype=np.uint8)
    sender = staging.sender(8)
    view = sender.host(data)
    assert view.obj is data  # the buffer itself is sent
    assert staging.to_device(data) is data


def test_a_prefetched_slice_is_copied_once_and_in_flight_while_the_previous_is_sent() -> None:
    device = StrictDevice()
    staging = DeviceStaging(device)
    first = device.asarray(np.arange(16, dtype=np.uint8))
    second = device.asarray(np.arange(16, 32, dtype=np.uint8))
    sender = staging.sender(16)
    before = device.to_host_bytes
    sent = sender.host(first, key="a")
    assert bytes(sent) == bytes(range(16))
    sender.prefetch("b", second)
    # Queued on the sender's stream, not done: the first slice's buffer is untouched
    # while it is being sent, and the second copy overlaps that send.
    assert bytes(sent) == bytes(range(16))
    assert sender._stream.pending == 1  # type: ignore[attr-defined]
    assert bytes(sender.host(second, key="b")) == bytes(range(16, 32))
    assert device.to_host_bytes - before == 32  # each slice crossed once
    assert device.pageable_async_copies == 0
    sender.close()


def test_a_prefetch_that_is_not_what_is_sent_next_is_discarded() -> None:
    device = StrictDevice()
    staging = DeviceStaging(device)
    sender = staging.sender(8)
    one, two = (device.asarray(np.full(8, v, dtype=np.uint8)) for v in (1, 2))
    sender.prefetch("one", one)
    assert bytes(sender.host(two, key="two")) == bytes([2] * 8)
    assert bytes(sender.host(one)) == bytes([1] * 8)
    sender.close()
    assert sender._stream.pending == 0  # type: ignore[attr-defined]


def test_received_bytes_reach_kernels_on_the_readers_stream() -> None:
    device = StrictDevice()
    staging = DeviceStaging(device)
    target = device.zeros(4, dtype=np.float32)
    payload = staging.host_empty(16)
    payload.view(np.float32)[:] = [1, 2, 3, 4]
    with staging.working():
        incoming = staging.to_device(payload)
        target += incoming.view(np.float32)
    assert device.asnumpy(target).tolist() == [1, 2, 3, 4]
    assert device.pageable_async_copies == 0


def test_the_double_shows_a_kernel_that_does_not_wait_for_its_copy() -> None:
    """What ``working()`` guards against: outside the reader's stream, the kernel runs
    before the copy it needs, and computes on stale memory."""
    device = StrictDevice()
    staging = DeviceStaging(device)
    target = device.zeros(4, dtype=np.float32)
    payload = staging.host_empty(16)
    payload.view(np.float32)[:] = [1, 2, 3, 4]
    incoming = staging.to_device(payload)
    target += incoming.view(np.float32)  # on the default stream: the copy has not run
    staging._stream().synchronize()
    assert device.asnumpy(target).tolist() != [1, 2, 3, 4]


def test_device_pools_reuse_device_memory() -> None:
    device = StrictDevice()
    pool = BufferPool(lambda n: device.empty(n, dtype=np.uint8))
    first = pool.take(100)
    pool.give(first)
    again = pool.take(50)
    assert again.data.ptr == first.data.ptr
    with pytest.raises(TypeError):
        np.asarray(again)  # device memory, not host
