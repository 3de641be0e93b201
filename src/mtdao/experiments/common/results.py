"""What every study's results.json says of itself: its ``kind`` (the study that wrote it) and its
``schema`` (the version of its layout: raised when the layout changes in a way a reader of the
earlier one would misread). A report is rendered from its results.json alone (each study's
``report.render``), so these two tell a reader, and the test that re-renders every committed
report, which renderer reads it; :func:`write_report` writes the two files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mtdao.train.durable import write_text_atomic


def stamped(kind: str, schema: int, content: Mapping[str, Any]) -> dict[str, Any]:
    """``content`` as a results.json of ``kind`` and ``schema`` (those two keys first)."""
    return {"kind": kind, "schema": schema, **content}


def check_results(results: Any, kind: str, schema: int, source: object) -> dict[str, Any]:
    """``results`` if it is a results.json of ``kind`` and ``schema``; else a one-line error
    naming ``source`` (where it was read) and what it is instead."""
    found = (results.get("kind"), results.get("schema")) if isinstance(results, dict) else None
    if found != (kind, schema):
        what = f"kind {found[0]!r}, schema {found[1]!r}" if found else "no kind and no schema"
        raise ValueError(f"{source} is not a {kind} results.json of schema {schema} ({what})")
    return results


def read_results(path: Path, kind: str, schema: int) -> dict[str, Any]:
    """The results.json at ``path``, checked to be of ``kind`` and ``schema``."""
    return check_results(json.loads(Path(path).read_text()), kind, schema, path)


def json_text(results: Mapping[str, Any]) -> str:
    """results.json as the studies write it: indented, ending in a newline."""
    return json.dumps(results, indent=2) + "\n"


def write_report(
    out: Path,
    results: Mapping[str, Any],
    render: Callable[[dict[str, Any]], str],
    to_text: Callable[[Mapping[str, Any]], str] = json_text,
) -> Path:
    """``results.json`` (``results`` as ``to_text`` writes it) and ``report.md`` in ``out`` (made if
    missing), the report rendered from what results.json holds, read back: it re-renders from that
    file alone. Returns report.md's path."""
    text = to_text(results)
    Path(out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(out) / "results.json", text)
    report = Path(out) / "report.md"
    report.write_text(render(json.loads(text)))
    return report
