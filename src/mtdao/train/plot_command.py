"""``mtdao plot RUN_DIR [--reference OTHER_RUN]``: redraw a run's ``loss.png``, optionally with
another run (e.g. DDP's on the same budget) beside it.

Training draws ``loss.png`` on its own at the end of a run; this command is for comparing two runs,
or for drawing a run that is still going (from its metrics so far).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="redraw a run's loss.png, optionally beside a reference run",
        description="Write RUN_DIR/loss.png: loss against tokens with the sync rounds marked and "
        "the bytes sent per worker; with --reference, another run directory is drawn beside it.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run directory")
    parser.add_argument(
        "--reference",
        type=Path,
        metavar="OTHER_RUN",
        help="another run directory drawn beside it (e.g. the DDP run of the same budget)",
    )
    parser.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from mtdao.train.plots import plot_run

    path = plot_run(args.run_dir, reference=args.reference)
    print(path)
    return 0
