"""``RingSchedule``: the all-reduce's streams, and what makes a schedule."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl_trio._core.errors import RemoteProtocolError
from pccl_trio._core.ring import STRIPED_SLICE_FLOOR, RingSchedule, Segment, chunk_bounds, striped_slice


def all_reduce(count: int, itemsize: int, world: int, rank: int, slice_bytes: int) -> RingSchedule:
    return RingSchedule.all_reduce(
        count=count, itemsize=itemsize, world=world, rank=rank, slice_bytes=slice_bytes
    )


shapes = st.tuples(
    st.integers(0, 300), st.sampled_from([1, 2, 4, 8]), st.integers(2, 6), st.integers(1, 64)
)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(shapes)
def test_what_a_peer_sends_is_what_its_successor_receives(shape: tuple[int, int, int, int]) -> None:
    count, itemsize, world, slice_bytes = shape
    for rank in range(world):
        mine = all_reduce(count, itemsize, world, rank, slice_bytes)
        theirs = all_reduce(count, itemsize, world, (rank + 1) % world, slice_bytes)
        assert len(mine.send) == len(theirs.recv) == 2 * (world - 1)
        for sent, received in zip(mine.send, theirs.recv, strict=True):
            assert (sent.chunk, sent.start, sent.nbytes, sent.stream_offset, sent.reduce) == (
                received.chunk, received.start, received.nbytes, received.stream_offset,
                received.reduce,
            )
        assert mine.send_slices == theirs.recv_slices


@settings(max_examples=200, derandomize=True, deadline=None)
@given(shapes)
def test_each_peer_combines_every_other_chunk_once_and_ends_with_every_chunk(
    shape: tuple[int, int, int, int],
) -> None:
    count, itemsize, world, slice_bytes = shape
    for rank in range(world):
        schedule = all_reduce(count, itemsize, world, rank, slice_bytes)
        reduced = [s.chunk for s in schedule.recv if s.reduce]
        gathered = [s.chunk for s in schedule.recv if not s.reduce]
        assert sorted(reduced) == [c for c in range(world) if c != rank]
        assert sorted(gathered) == [c for c in range(world) if c != (rank + 1) % world]
        # The owner's chunk is completed here, once, on the last combination.
        completing = [s for s in schedule.recv if s.completes]
        assert [(s.index, s.chunk) for s in completing] == [(world - 2, (rank + 1) % world)]
        # First written: every combined chunk, and this peer's own chunk once the
        # all-gather brings its final value; nothing else is kept before a write.
        first = sorted((s.chunk, s.reduce) for s in schedule.recv if s.first_write)
        assert first == sorted([(c, True) for c in reduced] + [(rank, False)])


@settings(max_examples=100, derandomize=True, deadline=None)
@given(shapes)
def test_each_send_segment_after_the_first_forwards_the_one_received_before(
    shape: tuple[int, int, int, int],
) -> None:
    count, itemsize, world, slice_bytes = shape
    schedule = all_reduce(count, itemsize, world, 0, slice_bytes)
    assert [s.forwards for s in schedule.send] == [None, *range(len(schedule.send) - 1)]
    assert [s.forwarded_by for s in schedule.recv] == [*range(1, len(schedule.recv)), None][
        :len(schedule.recv)
    ]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(shapes)
def test_every_slice_is_located_from_its_frame_and_nothing_else_is(
    shape: tuple[int, int, int, int],
) -> None:
    count, itemsize, world, slice_bytes = shape
    schedule = all_reduce(count, itemsize, world, world - 1, slice_bytes)
    assert schedule.slice_bytes % itemsize == 0
    covered = 0
    for segment in schedule.recv:
        for index in range(schedule.slice_count(segment)):
            start, stop = schedule.slice_range(segment, index)
            offset = segment.stream_offset + start - segment.start
            assert schedule.locate(offset, stop - start) == (segment, index)
            with pytest.raises(RemoteProtocolError):
                schedule.locate(offset, stop - start + 1)
            if stop - start > itemsize:
                with pytest.raises(RemoteProtocolError):
                    schedule.locate(offset + itemsize, stop - start - itemsize)
            covered += stop - start
    assert covered == sum(s.nbytes for s in schedule.recv)
    with pytest.raises(RemoteProtocolError):
        schedule.locate(covered, 1)


def test_chunks_split_a_buffer_as_evenly_as_elements_allow() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_a_broadcast_is_a_schedule_too() -> None:
    """A schedule other than the all-reduce: rank 1 of a broadcast from rank 0 stores
    what it receives and forwards it, slice for slice."""
    segment = Segment(index=0, chunk=0, start=0, nbytes=64, stream_offset=0, reduce=False)
    middle = RingSchedule(
        world=3, rank=1, itemsize=4, slice_bytes=16,
        send=[dataclasses.replace(segment, forwards=0)],
        recv=[dataclasses.replace(segment, forwarded_by=0)],
    )
    assert middle.send_slices == middle.recv_slices == (4,)
    assert middle.locate(48, 16) == (middle.recv[0], 3)


def test_segments_that_do_not_make_a_schedule_are_refused() -> None:
    segment = Segment(index=0, chunk=0, start=0, nbytes=64, stream_offset=0, reduce=False)

    def schedule(send: list[Segment], recv: list[Segment]) -> RingSchedule:
        return RingSchedule(world=2, rank=0, itemsize=4, slice_bytes=16, send=send, recv=recv)

    with pytest.raises(ValueError, match="forward"):
        schedule([dataclasses.replace(segment, forwards=0)], [segment])
    with pytest.raises(ValueError, match="forwarded"):
        schedule([segment], [dataclasses.replace(segment, forwarded_by=0)])
    with pytest.raises(ValueError, match="forward"):
        schedule([dataclasses.replace(segment, forwards=0, nbytes=32)],
                 [dataclasses.replace(segment, forwarded_by=0)])
    with pytest.raises(ValueError, match="position"):
        schedule([segment, segment], [])
    with pytest.raises(ValueError, match="whole elements"):
        schedule([dataclasses.replace(segment, nbytes=6)], [])
    with pytest.raises(ValueError, match="rank"):
        RingSchedule(world=2, rank=2, itemsize=4, slice_bytes=16, send=[], recv=[])


# --- how finely a step is cut for the ring's pools ---------------------------------------


@pytest.mark.parametrize(("nbytes", "world", "stripes", "expected"), [
    (64 << 20, 4, 1, 4 << 20),  # one connection per link: the configured slice
    (64 << 20, 4, 8, 1 << 20),  # 16 MiB steps over 8 connections: 16 slices
    (64 << 20, 3, 8, 1_398_100),  # ceil(ceil(64 MiB / 3) / 16), down to whole float32s
    (256 << 20, 3, 8, 4 << 20),  # steps long enough: never above the configured slice
    (1 << 20, 3, 8, STRIPED_SLICE_FLOOR),  # never below the floor
    (100, 3, 16, 100),  # a slice as small as the slice size allows is fine too
])
def test_a_step_is_cut_into_two_slices_per_connection_within_bounds(
    nbytes: int, world: int, stripes: int, expected: int
) -> None:
    slice_bytes = min(4 << 20, max(100, nbytes))
    assert striped_slice(slice_bytes, nbytes=nbytes, world=world, itemsize=4,
                         stripes=stripes) == expected


@given(st.integers(1, 1 << 30), st.integers(2, 64), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 1024), st.integers(1, 64 << 20))
def test_a_striped_slice_holds_whole_elements_and_stays_in_bounds(
    nbytes: int, world: int, itemsize: int, stripes: int, slice_bytes: int
) -> None:
    slice_bytes = max(itemsize, slice_bytes - slice_bytes % itemsize)
    cut = striped_slice(slice_bytes, nbytes=nbytes, world=world, itemsize=itemsize, stripes=stripes)
    assert cut % itemsize == 0 and itemsize <= cut <= slice_bytes
    if stripes == 1:
        assert cut == slice_bytes
