"""``python -m mtdao`` (and ``torchrun -m mtdao``) runs the command line."""

import sys

from mtdao.cli import entry_point

sys.exit(entry_point())
