"""``python -m pccl_trio COMMAND ...``: the ``pccl-trio`` command line."""

import sys

from ._cli import main

sys.exit(main())
