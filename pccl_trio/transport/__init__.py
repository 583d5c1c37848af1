"""Networks: where connections come from.

Everything above this package gets its streams from a ``Network`` (``listen`` and
``connect``), so the same master and communicator run over real TCP
(``TcpNetwork``) and over the in-memory network of ``pccl_trio.testing``.
"""

from ._blocking import SocketLink as SocketLink
from ._blocking import run_in_thread as run_in_thread
from ._framed import FramedStream as FramedStream
from ._network import Network as Network
from ._network import TcpNetwork as TcpNetwork
from ._network import format_address as format_address
from ._network import listener_address as listener_address
from ._network import parse_address as parse_address
from ._network import remote_host as remote_host
