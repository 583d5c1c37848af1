"""The peer side of a run: ``Communicator``, and ``PeerSeam``, the test seam that
``pccl_trio.testing`` re-exports."""

from ._communicator import Communicator as Communicator
from ._communicator import CommunicatorStatistics as CommunicatorStatistics
from ._results import AsyncGatherHandle as AsyncGatherHandle
from ._results import AsyncReduceHandle as AsyncReduceHandle
from ._results import AsyncShardHandle as AsyncShardHandle
from ._seam import PeerSeam as PeerSeam
from ._shared_state import state_digest as state_digest
