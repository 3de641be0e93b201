"""How every experiment states its numbers: mean ± std over seeds, the significance rule, units,
markdown tables and the methods' display names.

The summaries (each study's ``summary.py``) compute with :func:`stats` and :func:`compare_losses`; the reports
(its ``report.py``) write numbers only through the formatters here, so one figure reads the same in
every report.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Re-exported: the reports and the training summary share one byte format and one way of saying
# how traffic compares.
from mtdao.units import format_bytes as format_bytes
from mtdao.units import format_traffic as format_traffic

SIGNIFICANCE_RULE = (
    "a difference between two methods counts only if it exceeds the sum of their standard "
    "deviations over seeds; otherwise it is a tie within seed noise"
)
LABELS = {
    "ddp": "DDP",
    "qh-ddp": "QH-DDP",
    "local-adam": "Local Adam",
    "diloco": "DiLoCo",
    "desloc": "DES-LOC",
    "mtdao": "MT-DAO",
}
MISSING = "—"


def label(method: str, optimizer: str = "adam") -> str:
    """Display name of ``method`` ("Local ADOPT" when the base optimizer is ADOPT)."""
    name = LABELS.get(method, method)
    if optimizer == "adopt":
        name = name.replace("Adam", "ADOPT")
    return name


# -- statistics over seeds and the significance rule ----------------------------------------------


def stats(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Mean, sample std (ddof 1; 0 for one value), count and the values themselves, ignoring
    None; None if nothing is left. A non-finite value makes the mean inf and the std 0."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    finite = all(math.isfinite(v) for v in values)
    std = statistics.stdev(values) if len(values) > 1 and finite else 0.0
    mean = statistics.fmean(values) if finite else math.inf
    return {"mean": mean, "std": std, "n": len(values), "values": values}


def compare_losses(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The significance rule on two :func:`stats`: 'better' if a's mean loss is lower than b's by
    more than a.std + b.std, 'worse' if higher by as much, else 'tie'."""
    difference = a["mean"] - b["mean"]
    if math.isnan(difference):
        return "tie"
    if abs(difference) <= a["std"] + b["std"]:
        return "tie"
    return "better" if difference < 0 else "worse"


def verdict(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """:func:`compare_losses`, or 'one seed' while either side has a single seed (no spread to
    judge the difference by)."""
    return compare_losses(a, b) if min(a["n"], b["n"]) > 1 else "one seed"


# -- numbers as text -------------------------------------------------------------------------------


def plus_minus(mean: float, std: float, mean_format: str = ".4f", std_format: str = "") -> str:
    """``mean ± std``; the std takes the mean's format unless given its own."""
    return f"{mean:{mean_format}} ± {std:{std_format or mean_format}}"


def pm(value: Mapping[str, Any] | None, digits: int = 4) -> str:
    """A :func:`stats` dict as text: mean ± std, the mean alone for one seed, 'diverged' for a
    non-finite mean, a dash for no value."""
    if value is None:
        return MISSING
    if not math.isfinite(value["mean"]):
        return "diverged"
    if value["n"] == 1:
        return f"{value['mean']:.{digits}f}"
    return plus_minus(value["mean"], value["std"], f".{digits}f")


def signed(value: float, digits: int = 4) -> str:
    """A difference with its sign: +0.1165."""
    return f"{value:+.{digits}f}"


def format_lr(lr: float) -> str:
    return f"{lr:.3g}"


def format_relative(value: float, reference: float) -> str:
    """Change of ``value`` relative to ``reference`` in percent: -11.0%; n/a when it is 0."""
    if not reference:
        return "n/a"
    return f"{(value - reference) / reference * 100:+.1f}%"


def gap(mine: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> str:
    """``mine``'s mean loss relative to ``theirs`` with the :func:`verdict`: +3.3% (worse); empty
    when either is missing."""
    if mine is None or theirs is None:
        return ""
    return f"{format_relative(mine['mean'], theirs['mean'])} ({verdict(mine, theirs)})"


def format_seconds(seconds: float | None) -> str:
    """Seconds in the unit a reader wants: 12 ms, 41.1 s, 9.6 min, 2.5 h."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def megabytes(num_bytes: float) -> str:
    """A number for a column headed MB: 1071.0."""
    return f"{num_bytes / 1e6:.1f}"


def format_count(value: float | None) -> str:
    """Parameters or tokens, three significant digits: 111k, 4.1M; '?' when unknown."""
    if value is None:
        return "?"
    for suffix, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return str(value)


def join_numbers(values: Iterable[Any]) -> str:
    """Seeds and the like: 0, 1, 2."""
    return ", ".join(map(str, values))


# -- markdown ------------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table as lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


NOT_RUN = "not run (--no-train)"
"""The 'failure' of a run a report was asked for before it was trained."""


def failures_section(failures: Mapping[str, str] | None) -> list[str]:
    """'## Failed runs', one line per run that failed, then '## Not run yet', the runs a
    ``--no-train`` report found unfinished (a study still running is not a failure); nothing
    when all finished."""
    failures = failures or {}
    failed = {name: error for name, error in failures.items() if error != NOT_RUN}
    pending = [name for name, error in failures.items() if error == NOT_RUN]
    lines: list[str] = []
    if failed:
        lines += [
            "## Failed runs",
            "",
            *(f"- `{name}`: {error}" for name, error in failed.items()),
            "",
        ]
    if pending:
        names = ", ".join(f"`{name}`" for name in pending)
        lines += [
            "## Not run yet",
            "",
            f"Reported with `--no-train` before they finished: {names}.",
            "",
        ]
    return lines
