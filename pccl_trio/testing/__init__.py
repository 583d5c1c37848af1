"""Public test helpers: an in-memory network with failure hooks, the test seam of a
communicator (``PeerSeam``), a strict stand-in for cupy (``StrictDevice``), and a WAN
emulator of network namespaces joined by a delay line (``Wan``, root only).

Not imported by ``import pccl_trio``; import it explicitly::

    from pccl_trio.testing import MemoryNetwork
"""

from ..peer import PeerSeam as PeerSeam
from ._device import DeviceArray as DeviceArray
from ._device import DeviceEvent as DeviceEvent
from ._device import DeviceStream as DeviceStream
from ._device import StrictDevice as StrictDevice
from ._directory import MemoryDirectory as MemoryDirectory
from ._memory import MemoryHost as MemoryHost
from ._memory import MemoryListener as MemoryListener
from ._memory import MemoryNetwork as MemoryNetwork
from ._memory import MemoryStream as MemoryStream
from ._wan import Wan as Wan
from ._wan import WanPlan as WanPlan
from ._wan import rate_bits as rate_bits
from ._wan import two_continents as two_continents
from ._wan import wan_available as wan_available
