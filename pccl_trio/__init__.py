"""pccl_trio: fault-tolerant collective communications for training over ordinary networks.

A master tracks who is in the run; peers join and leave at any moment. A trainer
connects, then at the same point of every step admits waiting peers, syncs its shared
state and all-reduces its gradients::

    import pccl_trio as pccl

    async with pccl.Communicator("10.0.0.1:48148") as comm:
        # connect() returned inside the others' update_topology: a joiner's first
        # call is the optimize_topology they make next (the hand-written loop of docs/loop.md).
        await comm.optimize_topology()
        while training:
            if await comm.are_peers_pending():
                await comm.update_topology()
                await comm.optimize_topology()
            await comm.sync_shared_state(state)
            await comm.all_reduce(gradients, op=pccl.ReduceOp.AVG)

The hand-written loop of ``docs/loop.md`` adds what each error means; ``docs/troubleshooting.md`` says what
to do about each.
"""

from ._config import Config as Config
from ._core.discovery import MasterAdvert as MasterAdvert
from ._errors import CollectiveAborted as CollectiveAborted
from ._errors import InvalidArgument as InvalidArgument
from ._errors import InvalidUsage as InvalidUsage
from ._errors import Kicked as Kicked
from ._errors import MasterConnectionError as MasterConnectionError
from ._errors import PCCLError as PCCLError
from ._errors import SharedStateSyncFailed as SharedStateSyncFailed
from ._errors import TooFewPeers as TooFewPeers
from ._errors import TopologyOptimizationFailed as TopologyOptimizationFailed
from ._errors import UpdateTopologyFailed as UpdateTopologyFailed
from ._types import Attribute as Attribute
from ._types import DataType as DataType
from ._types import DistributionHint as DistributionHint
from ._types import QuantizationAlgorithm as QuantizationAlgorithm
from ._types import QuantizationOptions as QuantizationOptions
from ._types import ReduceInfo as ReduceInfo
from ._types import ReduceOp as ReduceOp
from ._types import Shard as Shard
from ._types import SharedState as SharedState
from ._types import SharedStateSyncInfo as SharedStateSyncInfo
from ._types import SharedStateSyncStrategy as SharedStateSyncStrategy
from ._types import TensorInfo as TensorInfo
from ._types import TopK as TopK
from ._types import TopologyInfo as TopologyInfo
from .master import serve_master as serve_master
from .master import serve_master_tcp as serve_master_tcp
from .peer import AsyncGatherHandle as AsyncGatherHandle
from .peer import AsyncReduceHandle as AsyncReduceHandle
from .peer import AsyncShardHandle as AsyncShardHandle
from .peer import Communicator as Communicator
from .peer import CommunicatorStatistics as CommunicatorStatistics
from .peer import state_digest as state_digest
from .transport import Network as Network
from .transport import TcpNetwork as TcpNetwork
from .transport import list_masters as list_masters

__version__ = "0.1.0"
