"""What every feature of a communicator builds on, handed over as one record.

The features (membership, all-reduces, shared-state sync, topology optimization) each
need the same parts below them: the configuration, the lifecycle (status, the one
call at a time, failure), the master session, the p2p connections, and the metrics
they report what their calls did to. The facade
builds them once and gives each feature this record, plus the few other parts that
feature uses.
"""

from __future__ import annotations

import dataclasses

from .._config import Config
from ._lifecycle import Lifecycle
from ._metrics import NO_METRICS, NoMetrics
from ._p2p import P2PConnections
from ._session import MasterSession

__all__ = ["PeerContext"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerContext:
    config: Config
    lifecycle: Lifecycle
    session: MasterSession
    p2p: P2PConnections
    metrics: NoMetrics = NO_METRICS
