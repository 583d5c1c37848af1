"""The peer side of a run: ``Communicator``."""

from ._communicator import Communicator as Communicator
from ._communicator import CommunicatorStatistics as CommunicatorStatistics
from ._results import AsyncReduceHandle as AsyncReduceHandle
