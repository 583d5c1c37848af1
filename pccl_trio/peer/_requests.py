"""An all-reduce call's arguments, checked, and the descriptor its peers vote on.

Theory of operation
-------------------
``check_reduce_arguments`` turns what the caller passed (buffers of any accepted kind,
the op, tag, quantization and hint) into a ``ReduceRequest``: flat zero-copy views of
the buffers, the quantization normalised (an algorithm of NONE is no quantization),
and every mistake refused with an ``InvalidArgument`` that names the argument. A call
of many buffers checks its options once (``check_reduce_options``) and then each
buffer (``ReduceOptions.request``): per buffer, only what differs is looked at. A
request's ``vote`` is the descriptor the master compares across the group; it depends
on the request alone, so peers that passed the same kind of call vote alike.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.messages import CollectiveInitiate, CollectiveKind
from .._errors import InvalidArgument
from .._types import (
    DataType,
    DistributionHint,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceOp,
    TopK,
)
from ..ops import (
    Array,
    ArrayModule,
    Recycled,
    TopKLayout,
    as_array,
    check_quantization,
    from_numpy_dtype,
    gpu_of,
    staging_for,
)
from ._topk import TopKCall

__all__ = [
    "ReduceOptions",
    "ReduceRequest",
    "barrier_request",
    "check_all_gather_arguments",
    "check_all_reduce_call",
    "check_broadcast_arguments",
    "check_reduce_scatter_arguments",
    "check_reduce_arguments",
    "check_reduce_options",
    "check_topk_arguments",
    "check_topk_multiple_arguments",
]


# Not frozen, and made with positional arguments where it is made: a step makes one
# per tensor, hundreds per call, and a frozen dataclass's constructor costs three
# times as much, keywords twice; nothing changes one once made
# (``dataclasses.replace`` makes another).
@dataclasses.dataclass(slots=True)
class ReduceRequest:
    """One all-reduce's checked arguments.

    Attributes:
        xp: the array module of the buffers.
        send: the input, a flat array (or a fused bucket's members, ``_gathered``);
            result: where the result goes (``send`` itself for in place).
        quantization: None when the call is not quantized (``QuantizationAlgorithm.NONE``
            included).
        kind: the call the peers vote on: an all-reduce, or a barrier (``barrier``:
            empty buffers, which the ring passes as a collective of no data).
    """

    tag: int
    xp: ArrayModule
    send: Array
    result: Array
    op: ReduceOp
    quantization: QuantizationOptions | None
    hint: DistributionHint
    kind: CollectiveKind = CollectiveKind.ALL_REDUCE
    root: int = 0  # a broadcast's sender (a peer id)
    topk: TopKCall | None = None  # a Top-k all-reduce's own state (``_topk``)

    def vote(self, slice_bytes: int, *, lease: bool = False) -> CollectiveInitiate:
        """The descriptor every peer of the group must vote alike (``slice_bytes``: this
        peer's ``Config.slice_bytes``; ``lease``: ask for a lease on the tag)."""
        if self.kind == CollectiveKind.ALL_GATHER:
            # Its own part's size (the parts may differ), and never leased: the master
            # tells each attempt's sizes.
            return _vote(
                self.tag, int(self.send.size), self.send.dtype, self.op, None, self.hint,
                slice_bytes, False, self.kind, 0,
            )
        if self.topk is not None:
            # The dense call's, and the compression's: the entries kept, and how.
            layout = self.topk.layout
            return _vote(
                self.tag, layout.count, layout.dtype, self.op, self.topk.values, self.hint,
                slice_bytes, lease, self.kind, 0, layout.k, layout.chunk, layout.bits,
            )
        return _vote(
            self.tag, int(self.result.size), self.result.dtype, self.op, self.quantization,
            self.hint, slice_bytes, lease, self.kind, self.root,
        )


def barrier_request(tag: int) -> ReduceRequest:
    """A barrier on ``tag``: a collective of no data, which every member completes on
    arrival, so that its one verdict says every member arrived (``Communicator.barrier``)."""
    check_tag(tag)
    nothing = np.empty(0, dtype=np.uint8)
    return ReduceRequest(
        tag, np, nothing, nothing, ReduceOp.SUM, None, DistributionHint.NONE,
        CollectiveKind.BARRIER,
    )


@functools.lru_cache(maxsize=1024)
def _vote(
    tag: int, count: int, dtype: np.dtype[Any], op: ReduceOp,
    quantization: QuantizationOptions | None, hint: DistributionHint, slice_bytes: int,
    lease: bool, kind: CollectiveKind, root: int, topk: int = 0, topk_chunk: int = 0,
    topk_bits: int = 0,
) -> CollectiveInitiate:
    """A vote, made once per descriptor (messages are immutable, and a training loop
    votes the same descriptors step after step)."""
    data_type = from_numpy_dtype(dtype)
    return CollectiveInitiate(
        tag=tag,
        count=count,
        dtype=data_type.value,
        op=op.value,
        quantized_dtype=(quantization.quantized_datatype if quantization else data_type).value,
        quantization=(
            quantization.algorithm if quantization else QuantizationAlgorithm.NONE
        ).value,
        distribution_hint=hint.value if quantization else 0,
        slice_bytes=slice_bytes,
        lease=lease,
        kind=kind,
        root=root,
        topk=topk,
        topk_chunk=topk_chunk,
        topk_bits=topk_bits,
    )


def check_reduce_arguments(
    send: Any,
    recv: Any,
    *,
    op: ReduceOp,
    tag: int,
    quantization: QuantizationOptions | None,
    hint: DistributionHint,
    name: str = "send",
) -> ReduceRequest:
    """The arguments of an all-reduce call, checked; ``name``: what the caller called
    ``send``.

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    check_tag(tag)
    options = check_reduce_options(op=op, quantization=quantization, hint=hint)
    return options.request(send, recv, tag=tag, name=name)


def check_reduce_scatter_arguments(
    send: Any, *, op: ReduceOp, tag: int, recycled: Recycled
) -> ReduceRequest:
    """The arguments of a reduce-scatter, checked: the request reduces into a scratch
    buffer like ``send`` (the caller's is only read; the tag's last scratch buffer
    when nobody holds it, ``recycled``), as a collective of its own kind.

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    request = check_reduce_arguments(
        send, None, op=op, tag=tag, quantization=None, hint=DistributionHint.NONE
    )
    scratch = recycled.take(
        ("reduce_scatter", tag), request.xp, request.send, int(request.send.size)
    )
    return dataclasses.replace(request, result=scratch, kind=CollectiveKind.REDUCE_SCATTER)


def check_broadcast_arguments(tensor: Any, *, root: int, tag: int) -> ReduceRequest:
    """The arguments of a broadcast, checked: in place, every member but the root
    writes ``tensor`` (whether ``root`` is a member is asked on the ring it runs on).

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    if isinstance(root, bool) or not isinstance(root, int) or not 0 < root < 1 << 64:
        raise InvalidArgument(f"root must be a peer id (an integer >= 1), got {root!r}")
    request = check_reduce_arguments(
        tensor, None, op=ReduceOp.SUM, tag=tag, quantization=None, hint=DistributionHint.NONE,
        name="tensor",
    )
    return dataclasses.replace(request, kind=CollectiveKind.BROADCAST, root=root)


def check_all_gather_arguments(send: Any, *, tag: int) -> ReduceRequest:
    """The arguments of an all-gather, checked: ``send`` is only read, and the parts
    gather into a buffer made once the commence told their sizes (``result`` is an
    empty stand-in until then, on ``send``'s device).

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    request = check_reduce_arguments(
        send, None, op=ReduceOp.SUM, tag=tag, quantization=None, hint=DistributionHint.NONE
    )
    return dataclasses.replace(
        request, result=request.send[:0].copy(), kind=CollectiveKind.ALL_GATHER
    )


def check_topk_arguments(
    send: Any, recv: Any, *, op: ReduceOp, tag: int, compression: TopK,
    residual: Any = None, name: str = "send",
) -> ReduceRequest:
    """The arguments of a Top-k all-reduce, checked (``residual``: this buffer's, when
    ``compression`` holds one per tensor; by default ``compression.residual``).

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    if not isinstance(compression, TopK):
        raise InvalidArgument(f"compression must be a pccl_trio.TopK or None, got {compression!r}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise InvalidArgument(
            f"Top-k compression sums what every peer sends: op must be SUM or AVG, not {op!r}"
        )
    request = check_reduce_arguments(
        send, recv, op=op, tag=tag, quantization=None, hint=DistributionHint.NONE, name=name
    )
    xp, send_array = request.xp, request.send
    if residual is None and compression.residual is None:
        raise InvalidArgument(
            "compression=TopK(...) needs residual=: an array like the input, zeroed at "
            "the start, that keeps what this peer has not sent yet"
        )
    residual_xp, residual_array = as_array(
        compression.residual if residual is None else residual, name="TopK.residual"
    )
    if residual_xp is not xp:
        raise InvalidArgument(f"TopK.residual must live where {name} does")
    if residual_array.dtype != send_array.dtype or residual_array.size != send_array.size:
        raise InvalidArgument(
            f"TopK.residual ({residual_array.size} x {residual_array.dtype}) must match "
            f"{name} ({send_array.size} x {send_array.dtype}) in count and dtype"
        )
    for other, what in ((send_array, name), (request.result, "recv")):
        if xp.shares_memory(residual_array, other):
            raise InvalidArgument(f"TopK.residual shares memory with {what}")
    layout = TopKLayout.of(
        int(send_array.size), send_array.dtype, fraction=compression.fraction,
        chunk=compression.chunk, values=compression.values, value_bits=compression.value_bits,
    )
    call = TopKCall(
        xp, layout, send=send_array, out=request.result, residual=residual_array, op=op,
        values=compression.values,
    )
    return dataclasses.replace(request, kind=CollectiveKind.TOPK_ALL_REDUCE, topk=call)


def check_all_reduce_call(
    send: Any, recv: Any, op: ReduceOp, tag: int, quantization: QuantizationOptions | None,
    hint: DistributionHint, compression: TopK | None,
) -> ReduceRequest:
    """An all-reduce's arguments, checked: plain, quantized, or Top-k compressed.

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    if compression is None:
        return check_reduce_arguments(
            send, recv, op=op, tag=tag, quantization=quantization, hint=hint
        )
    _no_quantization_beside(quantization, hint)
    return check_topk_arguments(send, recv, op=op, tag=tag, compression=compression)


def check_topk_multiple_arguments(
    tensors: Sequence[Any], op: ReduceOp, quantization: QuantizationOptions | None,
    compression: TopK,
) -> list[ReduceRequest]:
    """``all_reduce_multiple_with_retry``'s Top-k all-reduces, one per tensor, each
    with the residual of its index.

    Raises:
        InvalidArgument: which argument is wrong, and how.
    """
    _no_quantization_beside(quantization, DistributionHint.NONE)
    if not isinstance(compression, TopK):
        raise InvalidArgument(f"compression must be a pccl_trio.TopK or None, got {compression!r}")
    residuals = compression.residual
    if not isinstance(residuals, Sequence) or len(residuals) != len(tensors):
        raise InvalidArgument(
            "all_reduce_multiple_with_retry(compression=TopK(...)) needs one residual per "
            f"tensor: TopK.residual must be a sequence of {len(tensors)} arrays"
        )
    return [
        check_topk_arguments(
            tensor, None, op=op, tag=index, compression=compression,
            residual=residuals[index], name=f"tensors[{index}]",
        )
        for index, tensor in enumerate(tensors)
    ]


def _no_quantization_beside(quantization: QuantizationOptions | None, hint: DistributionHint) -> None:
    """Top-k compression quantizes with ``TopK.values`` alone.

    Raises:
        InvalidArgument: ``quantization`` (or a distribution hint) was passed too.
    """
    if quantization is not None and quantization.algorithm is not QuantizationAlgorithm.NONE:
        raise InvalidArgument(
            "quantization= does not combine with compression=TopK: quantize the kept "
            "values with TopK(values=QuantizationOptions(...))"
        )
    if hint is not DistributionHint.NONE:
        raise InvalidArgument("distribution_hint= does not apply to compression=TopK")



def check_tag(tag: int) -> None:
    """Refuse a tag no collective can have.

    Raises:
        InvalidArgument: ``tag`` is not an integer in [0, 2**64).
    """
    if not (isinstance(tag, int) and not isinstance(tag, bool) and 0 <= tag < 1 << 64):
        raise InvalidArgument(f"tag must be an integer in [0, 2**64), got {tag!r}")


def check_reduce_options(
    *, op: ReduceOp, quantization: QuantizationOptions | None, hint: DistributionHint
) -> ReduceOptions:
    """A call's options, checked once for all its buffers (the quantization normalised:
    an algorithm of NONE is no quantization).

    Raises:
        InvalidArgument: which option is wrong, and how.
    """
    if not isinstance(op, ReduceOp):
        raise InvalidArgument(f"op must be a pccl_trio.ReduceOp, got {op!r}")
    if not isinstance(hint, DistributionHint):
        raise InvalidArgument(
            f"distribution_hint must be a pccl_trio.DistributionHint, got {hint!r}"
        )
    if quantization is not None:
        if not isinstance(quantization, QuantizationOptions):
            raise InvalidArgument(
                f"quantization must be QuantizationOptions or None, got {quantization!r}"
            )
        if not isinstance(quantization.algorithm, QuantizationAlgorithm):
            raise InvalidArgument(
                "quantization.algorithm must be a pccl_trio.QuantizationAlgorithm, got "
                f"{quantization.algorithm!r}"
            )
        if not isinstance(quantization.quantized_datatype, DataType):
            raise InvalidArgument(
                "quantization.quantized_datatype must be a pccl_trio.DataType, got "
                f"{quantization.quantized_datatype!r}"
            )
        if quantization.algorithm is QuantizationAlgorithm.NONE:
            quantization = None
    return ReduceOptions(op=op, quantization=quantization, hint=hint)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReduceOptions:
    """An all-reduce call's checked options, shared by the requests of its buffers."""

    op: ReduceOp
    quantization: QuantizationOptions | None
    hint: DistributionHint

    def request(self, send: Any, recv: Any, *, tag: int, name: str) -> ReduceRequest:
        """The request for one buffer (``recv``: None or ``send`` for in place) under
        these options; ``tag`` must be valid already.

        Raises:
            InvalidArgument: which buffer is wrong, and how.
        """
        xp, send_array = as_array(send, name=name)
        quantization = self.quantization
        if quantization is not None:
            check_quantization(
                quantization.algorithm, quantization.quantized_datatype, send_array.dtype,
                self.op,
            )
        result = send_array
        if recv is not None and recv is not send:
            result = self._recv(xp, send_array, recv)
        if xp is not np:  # after every import: each may have queued a wait (DLPack)
            staging_for(xp, gpu_of(xp, send_array)).wait_current_stream()
        # The fields in order: tag, xp, send, result, op, quantization, hint.
        return ReduceRequest(tag, xp, send_array, result, self.op, quantization, self.hint)

    @staticmethod
    def _recv(xp: ArrayModule, send_array: Array, recv: Any) -> Array:
        recv_xp, recv_array = as_array(recv, name="recv")
        if recv_xp is not xp:
            raise InvalidArgument("send and recv must live on the same device")
        if recv_array.dtype != send_array.dtype or recv_array.size != send_array.size:
            raise InvalidArgument(
                f"recv ({recv_array.size} x {recv_array.dtype}) must match send "
                f"({send_array.size} x {send_array.dtype}) in count and dtype"
            )
        if xp.shares_memory(send_array, recv_array):
            if _address(xp, send_array) == _address(xp, recv_array):
                return send_array  # the same memory: in place
            raise InvalidArgument("send and recv overlap without being the same buffer")
        return recv_array


def _address(xp: ArrayModule, array: Array) -> int:
    """Where ``array``'s first element is (host or device memory)."""
    return int(array.ctypes.data if xp is np else array.data.ptr)
