"""Blocking calls for synchronous trainers: ``pccl_trio.sync.Communicator`` has every
call of ``pccl_trio.Communicator``, with the same arguments, results and errors, run on
an event loop of its own::

    import pccl_trio as pccl
    import pccl_trio.sync

    with pccl_trio.sync.Communicator("10.0.0.1:48148") as comm:
        comm.optimize_topology()
        while training:
            if comm.are_peers_pending():
                comm.update_topology()
                comm.optimize_topology()
            comm.sync_shared_state(state)
            comm.all_reduce(gradients, op=pccl.ReduceOp.AVG)
"""

from ._communicator import Communicator as Communicator
from ._communicator import Handle as Handle
