"""Registers the experiment subcommands with the ``mtdao`` command line.

Each experiment module defines ``add_parser(subparsers)``; a module that is missing from this
install is skipped, the rest still register.
"""

from __future__ import annotations

import importlib

EXPERIMENT_MODULES = (
    "mtdao.experiments.rosenbrock",  # mtdao toy rosenbrock
    "mtdao.experiments.compare",  # mtdao compare
    "mtdao.experiments.ablation",  # mtdao ablation
    "mtdao.experiments.slow_link",  # mtdao slow-link
    "mtdao.experiments.sync_options",  # mtdao sync-options
    "mtdao.experiments.frontier",  # mtdao frontier
)


def add_parser(subparsers) -> None:
    for name in EXPERIMENT_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        module.add_parser(subparsers)
