"""``python -m mtdao`` (and ``torchrun -m mtdao``) runs the command line."""

import sys

from mtdao.cli import main

sys.exit(main())
