"""Torch wrappers that own the training loop's collective work.

``DiLoCo`` (over a ``pccl_trio.sync.Communicator``) and ``AsyncDiLoCo`` (over a
``pccl_trio.Communicator``, for trainers in trio) take a model and its inner optimizer;
the trainer calls ``step()`` after each inner ``optimizer.step()``, and every
``sync_every`` steps the peers take an outer step together, with every fault of a run
that can go on handled inside::

    import pccl_trio.sync
    import pccl_trio.torch

    comm = pccl_trio.sync.Communicator("10.0.0.1:48148")
    with pccl_trio.torch.DiLoCo(model, optimizer, communicator=comm, sync_every=50) as diloco:
        while diloco.outer_steps < 100:
            loss = loss_fn(model(*next(batches)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            diloco.step()

``DataParallel`` (and ``AsyncDataParallel``) averages the gradients of every step
instead: the trainer calls ``dp.step()`` after each ``loss.backward()``, in place of
``optimizer.step()``; the gradients travel in buckets while backward makes them.

Needs torch (``pip install torch``); importing ``pccl_trio`` alone does not.
"""

from ._data_parallel import AsyncDataParallel as AsyncDataParallel
from ._data_parallel import DataParallel as DataParallel
from ._diloco import AsyncDiLoCo as AsyncDiLoCo
from ._diloco import DiLoCo as DiLoCo
