"""Networks: where connections come from.

Everything above this package gets its streams from a ``Network`` (``listen`` and
``connect``), so the same master and communicator run over real TCP
(``TcpNetwork``) and over the in-memory network of ``pccl_trio.testing``; finding a
master by name and hosting one need a ``DiscoveringNetwork``. Other packages import
from here, never from the private modules.
"""

from ._accept import Arrived as Arrived
from ._accept import serve_accepted as serve_accepted
from ._blocking import SocketLink as SocketLink
from ._discovery import MISSING_ZEROCONF as MISSING_ZEROCONF
from ._discovery import SETTLE_SECONDS as SETTLE_SECONDS
from ._discovery import Directory as Directory
from ._discovery import Seen as Seen
from ._discovery import advertise_master as advertise_master
from ._discovery import check_advertise as check_advertise
from ._discovery import discovery_available as discovery_available
from ._discovery import find_masters as find_masters
from ._discovery import list_masters as list_masters
from ._exposure import ADVICE as ADVICE
from ._exposure import check_remote_host as check_remote_host
from ._exposure import is_loopback as is_loopback
from ._exposure import listen_host as listen_host
from ._framed import Connection as Connection
from ._framed import FramedStream as FramedStream
from ._keepalive import keep_alive as keep_alive
from ._network import SOCKET_BUFFER_BYTES as SOCKET_BUFFER_BYTES
from ._network import DiscoveringNetwork as DiscoveringNetwork
from ._network import InMemoryStream as InMemoryStream
from ._network import Network as Network
from ._network import Reservation as Reservation
from ._network import TcpNetwork as TcpNetwork
from ._network import check_congestion_control as check_congestion_control
from ._network import comes_from as comes_from
from ._network import format_address as format_address
from ._network import kernel_congestion_control as kernel_congestion_control
from ._network import kernel_round_trip as kernel_round_trip
from ._network import listener_address as listener_address
from ._network import parse_address as parse_address
from ._network import reaches_other_machines as reaches_other_machines
from ._network import remote_host as remote_host
from ._secure import Credential as Credential
from ._secure import secure_client as secure_client
from ._secure import secure_server as secure_server
from ._signal import Signal as Signal
from ._threads import hash_threads as hash_threads
from ._threads import run_in_thread as run_in_thread
from ._threads import run_off_loop as run_off_loop
from ._threads import threads_allowed as threads_allowed
