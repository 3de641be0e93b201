"""What every experiment figure shares: one colour per method, the house style, axis formatters.

Each method keeps one colour in every figure (DDP black, MT-DAO red, Local Adam orange, ...);
curves are means over seeds with a min-max band.
"""

from __future__ import annotations

import math

from mtdao.train.plots import pyplot

__all__ = ["METHOD_COLORS", "STYLE", "color", "eng_formatter", "plain_log_ticks", "pyplot"]

METHOD_COLORS = {
    "ddp": "#222222",
    "qh-ddp": "#8c8c8c",
    "local-adam": "#ff7f0e",
    "diloco": "#2ca02c",
    "desloc": "#9467bd",
    "mtdao": "#d62728",
}
STYLE = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.titleweight": "bold",
    "legend.frameon": False,
    "font.size": 10,
}


def color(method: str) -> str:
    return METHOD_COLORS.get(method, "#1f77b4")


def eng_formatter(unit: str = ""):
    """Tick labels 1k, 2M, ... (with a unit: 10 MB)."""
    from matplotlib.ticker import EngFormatter

    return EngFormatter(unit=unit, sep="" if not unit else " ")


def plain_log_ticks(axis) -> None:
    """Log axis labelled 0.7, 1, 2, 3, 5 instead of 7x10^-1, 10^0, ..."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    def text(value, _):
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9) if value > 0 else 0
        return f"{value:g}" if round(mantissa, 6) in (1, 2, 3, 5) else ""

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(text))
    axis.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def save(fig, path) -> None:
    """Write ``fig`` to ``path`` and free it."""
    fig.savefig(path)
    pyplot().close(fig)
