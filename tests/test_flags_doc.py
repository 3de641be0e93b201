"""docs/flags.md lists every flag of every command with its help, as ``--help`` shows it.

The page is generated from the parsers; after changing a flag, rewrite it with
``MTDAO_WRITE_FLAGS_DOC=1 python -m pytest tests/test_flags_doc.py``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mtdao.cli import build_parser

PAGE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
HEADER = """# Every flag

[README](../README.md) · [training](training.md) · [experiments](experiments.md)

Generated from the command-line parsers (tests/test_flags_doc.py checks that it is current); the
same text as `mtdao COMMAND --help`, which also lists the methods and the defaults per optimizer.
"""


def commands(parser: argparse.ArgumentParser, prog: str = "mtdao"):
    """(name, parser) of every command that takes flags, in `mtdao --help` order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    yield from commands(sub, f"{prog} {name}")
                else:
                    yield f"{prog} {name}", sub


def flag_cell(action: argparse.Action) -> str:
    flag = ", ".join(f"`{option}`" for option in action.option_strings)
    if action.nargs == 0:
        return flag
    if action.choices:
        return f"{flag} `{{{','.join(map(str, action.choices))}}}`"
    metavar = action.metavar or action.dest.upper()
    return f"{flag} `{metavar}{' ...' if action.nargs in ('+', '*') else ''}`"


def render() -> str:
    lines = [HEADER]
    for prog, parser in commands(build_parser()):
        formatter = parser._get_formatter()
        lines += [f"## {prog}", "", parser.description or "", "", "| flag | what it does |"]
        lines.append("|---|---|")
        for action in parser._actions:
            if not action.option_strings or action.dest == "help" or action.help is None:
                continue
            text = " ".join(formatter._expand_help(action).split()).replace("|", "\\|")
            lines.append(f"| {flag_cell(action)} | {text} |")
        lines.append("")
    return "\n".join(lines)


def test_the_flags_page_is_current():
    expected = render()
    if os.environ.get("MTDAO_WRITE_FLAGS_DOC"):
        PAGE.write_text(expected)
    assert PAGE.read_text() == expected, (
        "docs/flags.md is out of date: MTDAO_WRITE_FLAGS_DOC=1 python -m pytest "
        "tests/test_flags_doc.py"
    )
