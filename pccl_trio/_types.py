"""Public enums and result records of the API."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy

__all__ = [
    "Attribute",
    "DataType",
    "DistributionHint",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceInfo",
    "Shard",
    "ReduceOp",
    "SharedState",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
    "TopologyInfo",
]


class ReduceOp(enum.Enum):
    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class DataType(enum.Enum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    UINT64 = 6
    INT64 = 7
    FLOAT16 = 8
    BFLOAT16 = 9
    FLOAT = 10
    DOUBLE = 11


class QuantizationAlgorithm(enum.Enum):
    NONE = 0
    MIN_MAX = 1
    ZERO_POINT_SCALE = 2


class DistributionHint(enum.Enum):
    NONE = 0
    NORMAL = 1
    UNIFORM = 2


class Attribute(enum.Enum):
    """World-size attributes, as last reported by the master."""

    GLOBAL_WORLD_SIZE = 1
    PEER_GROUP_WORLD_SIZE = 2
    NUM_DISTINCT_PEER_GROUPS = 3
    LARGEST_PEER_GROUP_WORLD_SIZE = 4


class SharedStateSyncStrategy(enum.Enum):
    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QuantizationOptions:
    quantized_datatype: DataType = DataType.UINT8
    algorithm: QuantizationAlgorithm = QuantizationAlgorithm.MIN_MAX


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class TopK:
    """Sparse all-reduce with error feedback (``compression=`` of ``all_reduce`` and
    ``all_reduce_multiple_with_retry``).

    Each peer adds ``residual`` to its input, keeps the ``fraction`` of the entries
    largest in magnitude within each chunk of ``chunk`` elements, sends their indexes
    (16 bits each) and values (``values``: quantized with ``MIN_MAX`` to ``UINT8`` or
    ``UINT16`` per chunk, and with ``UINT8`` to 2 or 4 bits with ``value_bits``; None:
    as they are), and stores what it did not send back into ``residual`` (what each
    code's decoded value left over included). The result is the sum of every peer's sent entries in ascending
    peer-id order (bit-identical everywhere), divided by the world size for ``AVG``.

    Attributes:
        fraction: the share of entries kept, in (0, 1]; ``round(fraction * chunk)``
            of each chunk (at least one).
        residual: the caller's array like the input (for
            ``all_reduce_multiple_with_retry``, a sequence of them, one per tensor),
            updated in place once the all-reduce succeeded; untouched otherwise.
            Required by those calls; ``pccl_trio.torch.DiLoCo`` wants None here (it
            keeps the residual itself).
        values: how kept values travel (None: in the input's dtype).
        chunk: elements per chunk, at most 65536.
        value_bits: 2 or 4: the ``UINT8`` codes of ``values`` take that many bits
            (4 or 16 levels between each chunk's least and greatest kept value),
            packed; None: the code dtype's whole width.
    """

    fraction: float
    _: dataclasses.KW_ONLY
    residual: Any = None
    values: QuantizationOptions | None = None
    chunk: int = 4096
    value_bits: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReduceInfo:
    """Outcome of an all-reduce: the peer-group world size and payload bytes moved.

    ``clamped`` counts the values this peer's quantized encodings clamped to their
    range (ZERO_POINT_SCALE with a NORMAL distribution hint on data with outliers);
    it is 0 otherwise.
    """

    world_size: int
    tx_bytes: int
    rx_bytes: int
    clamped: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """This peer's part of a reduce-scatter's result: elements ``start`` to ``stop``
    (exclusive) of the reduced vector, flattened, in ``data`` (1-D, of the input's
    kind: numpy, CuPy or torch). The parts partition the vector in ascending peer-id
    order, as ``numpy.array_split`` cuts it."""

    start: int
    stop: int
    data: Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SharedStateSyncInfo:
    """Outcome of a shared-state sync: the tensor bytes this peer sent to others and
    received from them."""

    tx_bytes: int
    rx_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """One named tensor of a shared state.

    ``data`` is the buffer itself (numpy, cupy, or any DLPack exporter, C-contiguous):
    a sync that finds it outdated overwrites it in place. With
    ``allow_content_inequality`` the peers' contents are never compared (e.g. per-peer
    random state); a peer joining or behind the group's revision still receives some
    peer's version of it.
    """

    name: str
    data: Any
    _: dataclasses.KW_ONLY
    allow_content_inequality: bool = False


@dataclasses.dataclass(slots=True)
class SharedState:
    """The tensors every peer of a group keeps identical, and their revision.

    ``revision`` is one above the last sync's after a completed step, or the last sync's
    again when the step was aborted after its sync (a repeat); the master removes a
    peer that skips further ahead, and a sync sets it to the group's revision when this
    peer was behind (``docs/shared-state.md``, "The rules").
    """

    tensors: list[TensorInfo]
    revision: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TopologyInfo:
    """What the last ``optimize_topology`` measured and installed for this peer's group.

    Attributes:
        peers: the peer ids ordering the rows and columns of the matrices.
        bandwidth: ``bandwidth[i, j]`` is the rate from ``peers[i]`` to ``peers[j]`` in
            bytes per second; NaN where not measured (and on the diagonal), 0 where the
            link could not be measured (unreachable).
        latency: one-way seconds from ``peers[i]`` to ``peers[j]``; NaN where unknown.
        ring: the installed ring order (a peer sends to the next): the optimization's,
            or a better order of the same peers a later round installed.
        predicted_seconds: the ring's predicted time for an all-reduce of
            ``reference_bytes`` (infinity when some link of it is unknown).
        reference_bytes: the all-reduce size the ring was optimized for.
        optimal: whether the ring is proven the fastest predicted. False when a faster
            ring exists but was within 5% (not worth new connections), when the search
            could not prove it (large groups: the master then keeps searching, and the
            next ``update_topology`` installs a better ring if it finds one), or when
            the ring has a link of unknown speed.
    """

    peers: tuple[int, ...]
    bandwidth: numpy.ndarray
    latency: numpy.ndarray
    ring: tuple[int, ...]
    predicted_seconds: float
    reference_bytes: int
    optimal: bool

    def predict(self, nbytes: int, ring: Sequence[int] | None = None) -> float:
        """Predicted seconds of a ring all-reduce of ``nbytes`` over ``ring`` (the
        installed one by default): ``2 (W - 1)`` steps, each as slow as the ring's
        slowest hop moving ``nbytes / W`` (latency plus bytes over bandwidth)."""
        order = list(self.ring if ring is None else ring)
        if sorted(order) != sorted(self.peers):
            raise ValueError(f"ring {order} is not an order of the peers {list(self.peers)}")
        world = len(order)
        if world < 2:
            return 0.0
        index = {p: i for i, p in enumerate(self.peers)}
        slowest = 0.0
        for a, b in zip(order, [*order[1:], order[0]], strict=True):
            rate = float(self.bandwidth[index[a], index[b]])
            delay = float(self.latency[index[a], index[b]])
            if not (rate > 0 and math.isfinite(delay)):
                return math.inf
            slowest = max(slowest, delay + nbytes / world / rate)
        return 2 * (world - 1) * slowest
