"""The peer side of a run: ``Communicator``."""

from ._allreduce import AsyncReduceHandle as AsyncReduceHandle
from ._communicator import Communicator as Communicator
from ._communicator import CommunicatorStatistics as CommunicatorStatistics
