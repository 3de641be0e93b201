"""The ``mtdao`` command line: ``mtdao train``, ``mtdao compare``, ``mtdao toy rosenbrock``, ...

Each subcommand lives next to the code it drives and registers itself through an ``add_parser``
function; this module only collects them and turns expected errors into one clear line.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys
import traceback

# Modules that each define add_parser(subparsers); listed in the order `mtdao --help` shows them.
COMMAND_MODULES = (
    "mtdao.train.command",
    "mtdao.train.lighthouse",
    "mtdao.train.plot_command",
    "mtdao.experiments.commands",
)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from mtdao import __version__

    parser = OneLineErrorParser(
        prog="mtdao",
        description="Multi-timescale distributed adaptive optimizers with local updates.",
    )
    parser.add_argument("--version", action="version", version=f"mtdao {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineErrorParser
    )
    subparsers.required = True
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue  # an optional command family that is not part of this install
        module.add_parser(subparsers)
    return parser


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input or environment: reported in one line, exit code 2."""
    from mtdao.data.errors import DataError
    from mtdao.sync.engine import NonFiniteError
    from mtdao.train.checkpoint import CheckpointError
    from mtdao.train.distributed import CollectiveError
    from mtdao.train.durable import WriteError
    from mtdao.train.memory import OutOfMemory

    # ConnectionError: a lighthouse or peer that cannot be reached (fault-tolerant runs)
    return (
        ValueError,
        DataError,
        CheckpointError,
        NonFiniteError,
        FileNotFoundError,
        WriteError,
        CollectiveError,
        ConnectionError,
        OutOfMemory,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("mtdao: interrupted", file=sys.stderr)
        return 130
    except expected_errors() as error:
        print(f"mtdao {args.command}: error: {error}", file=sys.stderr)
        return 2
    return int(result or 0)


def entry_point() -> int:
    """The ``mtdao`` program: :func:`main`; a native crash (a SIGSEGV or SIGABRT in a
    communication backend) prints the Python stack of every thread before the process dies. A
    process that joins process groups (under torchrun, a fault-tolerant replica) ends without
    interpreter teardown (see :func:`mtdao.train.distributed.end_worker_process`)."""
    faulthandler.enable()
    from mtdao.train.distributed import end_worker_process, joins_process_groups

    if not joins_process_groups(sys.argv[1:]):
        return main()
    try:
        exit_code = main()
    except Exception:  # printed as Python would, then the same clean end
        traceback.print_exc()
        exit_code = 1
    end_worker_process(exit_code)


if __name__ == "__main__":
    sys.exit(entry_point())
