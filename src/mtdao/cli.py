"""The ``mtdao`` command line: ``mtdao train``, ``mtdao compare``, ``mtdao toy rosenbrock``, ...

Each subcommand lives next to the code it drives and registers itself through an ``add_parser``
function; this module only collects them and turns expected errors into one clear line.
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import importlib
import os
import re
import signal
import sys
import traceback

from mtdao.flags import as_flags

# Each command: the module whose add_parser(subparsers) defines it, and the one line `mtdao --help`
# shows (tests/test_cli_help.py checks it against the module's own). Only the module of the
# command being run is imported, so `mtdao --help` and `mtdao --version` start without torch.
COMMANDS = {
    "train": (
        "mtdao.train.command",
        "pre-train a language model with any method (simulated or torchrun workers)",
    ),
    "lighthouse": (
        "mtdao.train.fault_tolerance.lighthouse",
        "start the lighthouse of a fault-tolerant run (mtdao train --fault-tolerant)",
    ),
    "plot": (
        "mtdao.train.plot_command",
        "redraw a run's loss.png, optionally beside a reference run",
    ),
    "toy": ("mtdao.experiments.rosenbrock.run", "toy problems (mtdao toy rosenbrock)"),
    "compare": (
        "mtdao.experiments.compare.run",
        "run every method on the same budget and seeds; write report.md and plots",
    ),
    "slow-link": (
        "mtdao.experiments.slow_link.run",
        "DDP vs MT-DAO with real gloo workers across an emulated slow link (root)",
    ),
    "frontier": (
        "mtdao.experiments.frontier.run",
        "final loss against traffic for every method, codec and K; Pareto frontiers",
    ),
    "wan-drill": (
        "mtdao.experiments.wan_drill.run",
        "fault-tolerant replicas across emulated WAN sites that fail, checked (root)",
    ),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block, no traceback), from the
    (sub)command that was given it, with the closest flags that command has."""

    def error(self, message: str):  # type: ignore[override]
        message += self._closest_choice(message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    @staticmethod
    def _closest_choice(message: str) -> str:
        """'; did you mean X?' for argparse's "invalid choice: 'W' (choose from ...)" where a
        choice resembles W (a command or a flag's value)."""
        given = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if given is None:
            return ""
        choices = re.findall(r"'([^']*)'", given.group(2))
        close = difflib.get_close_matches(given.group(1), choices, n=2, cutoff=0.6)
        return f"; did you mean {' or '.join(close)}?" if close else ""

    def parse_known_args(self, args=None, namespace=None):
        # argparse leaves a subcommand's unknown words to the top parser, which names only
        # `mtdao`: each parser refuses its own here instead
        namespace, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._suggestions(unknown)}")
        return namespace, unknown

    def _suggestions(self, unknown: list[str]) -> str:
        """'; did you mean ...' for each unknown flag that resembles one of this command's."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        mistyped = [word.split("=", 1)[0] for word in unknown if word.startswith("-")]
        hints = {}
        for flag in mistyped:
            close = difflib.get_close_matches(flag, flags, n=2, cutoff=0.8)
            if close:
                hints[flag] = f"did you mean {' or '.join(close)}?"
        if len(mistyped) == 1:
            return "".join(f"; {hint}" for hint in hints.values())
        return "".join(f"; {flag}: {hint}" for flag, hint in hints.items())


def command_of(argv: list[str]) -> str | None:
    """The command named on the command line (its first word that is not an option)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mtdao`` parser: every command in full, or only ``command`` in full (the others, or
    all of them for ``""``, as their one help line: enough for ``mtdao --help``)."""
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
    for name, (module_name, summary) in COMMANDS.items():
        if command is not None and name != command:
            subparsers.add_parser(name, help=summary, add_help=False)
            continue
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
    from mtdao.sync.communicator import FinalRoundNotCommitted
    from mtdao.sync.engine import NonFiniteError
    from mtdao.train.checkpoint.store import CheckpointError
    from mtdao.train.distributed import CollectiveError
    from mtdao.train.durable import WriteError
    from mtdao.train.memory import OutOfMemory

    # ConnectionError: a lighthouse or peer that cannot be reached (fault-tolerant runs)
    return (
        ValueError,
        DataError,
        CheckpointError,
        NonFiniteError,
        FinalRoundNotCommitted,
        FileNotFoundError,
        WriteError,
        CollectiveError,
        ConnectionError,
        OutOfMemory,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(argv) or "")  # "": no command, so none is built in full
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        # a command may say how to continue (set_defaults(on_interrupt=...): (args, argv) -> text)
        on_interrupt = getattr(args, "on_interrupt", None)
        message = on_interrupt(args, argv) if on_interrupt else f"mtdao {args.command}: interrupted"
        if message:
            print(message, file=sys.stderr, flush=True)
        return 130
    except expected_errors() as error:
        print(f"mtdao {args.command}: error: {as_flags(str(error))}", file=sys.stderr)
        return 2
    return int(result or 0)


def entry_point() -> int:
    """The ``mtdao`` program: :func:`main`; a native crash (a SIGSEGV or SIGABRT in a
    communication backend) prints the Python stack of every thread before the process dies. A
    process that joins process groups (under torchrun, a fault-tolerant replica) ends without
    interpreter teardown (see :func:`mtdao.train.distributed.end_worker_process`)."""
    faulthandler.enable()
    # Ctrl-C and SIGTERM stop every command: a mask inherited from the parent (a supervisor, a
    # shell) must not hold them back, or the process would never see them
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    # torchrun sets WORLD_SIZE: checked here without importing torch, for a fast --help
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "--fault-tolerant" not in sys.argv[1:]:
        return main()
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
