"""What every feature of a communicator builds on, handed over as one record.

The features (membership, all-reduces, shared-state sync, topology optimization) each
need the same four parts below them: the configuration, the lifecycle (status, the one
call at a time, failure), the master session and the p2p connections. The facade
builds them once and gives each feature this record, plus the few other parts that
feature uses.
"""

from __future__ import annotations

import dataclasses

from .._config import Config
from ._lifecycle import Lifecycle
from ._p2p import P2PConnections
from ._session import MasterSession

__all__ = ["PeerContext"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerContext:
    config: Config
    lifecycle: Lifecycle
    session: MasterSession
    p2p: P2PConnections
