"""``python -m pccl_trio.master``: run a master."""

import sys

from .._cli import master_main

sys.exit(master_main(prog="python -m pccl_trio.master"))
