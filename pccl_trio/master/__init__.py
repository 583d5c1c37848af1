"""The master: a trio server around the sans-IO ``MasterCore``.

Run it with ``python -m pccl_trio.master`` or ``pccl-trio master``.
"""

from ._server import serve_master as serve_master
from ._server import serve_master_tcp as serve_master_tcp
