"""What every experiment figure shares: one colour per method, the house style, axis formatters.

Each method keeps one colour in every figure (DDP black, MT-DAO red, Local Adam orange, ...);
curves are means over seeds with a min-max band.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mtdao.train.plots import pyplot

__all__ = [
    "METHOD_COLORS",
    "STYLE",
    "color",
    "eng_formatter",
    "plain_log_ticks",
    "pyplot",
    "saved_figure",
]

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


# Mantissas labelled on a log axis, by how many decades it spans: a loss axis from 1.4 to 3 gets
# 1.4, 1.6, 1.8, 2, 2.5, 3 rather than only 2 and 3.
LOG_MANTISSAS = (
    (1.5, (1.0, 2.0, 5.0)),
    (0.6, (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)),
    (0.0, (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)),
)


def log_tick_values(low: float, high: float) -> list[float]:
    """Plain-number ticks between ``low`` and ``high`` (> 0) of a log axis, denser the narrower
    the range: at least three."""
    if not 0 < low < high:
        return []
    span = math.log10(high / low)
    mantissas = next(m for minimum, m in LOG_MANTISSAS if span >= minimum)
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    values = [round(m * 10.0**d, 12) for d in decades for m in mantissas]
    values = [v for v in values if low <= v <= high]
    if len(values) >= 3:
        return values
    # narrower than any mantissa grid (2.93 to 3.25): evenly spaced round numbers
    step = nice_step((high - low) / 4)
    first = math.ceil(low / step)
    return [round(k * step, 12) for k in range(first, math.floor(high / step) + 1)]


def nice_step(rough: float) -> float:
    """The 1, 2 or 5 times a power of ten nearest above ``rough``."""
    power = 10.0 ** math.floor(math.log10(rough))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= rough - 1e-12)


def plain_log_ticks(axis) -> None:
    """Log axis labelled 1.4, 1.6, 2, 3 instead of 10^0 or two lonely labels; the ticks follow the
    axis' range when the figure is drawn."""
    from matplotlib.ticker import FuncFormatter, Locator, NullLocator

    class PlainLogLocator(Locator):
        def __call__(self):
            return self.tick_values(*self.axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            return log_tick_values(min(vmin, vmax), max(vmin, vmax))

    axis.set_major_locator(PlainLogLocator())
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_locator(NullLocator())


def save(fig, path, dpi: float | None = None) -> None:
    """Write ``fig`` to ``path`` (at the figure's own dpi unless given) and free it."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


@contextmanager
def saved_figure(
    path,
    *grid: int,
    style: Mapping[str, Any] | None = STYLE,
    save_dpi: float | None = None,
    **subplots,
) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` of ``pyplot().subplots(*grid, **subplots)``, drawn under ``style`` (None:
    matplotlib's own) and saved to ``path`` (at ``save_dpi``, else the figure's) when the block
    ends; the layout is the block's."""
    plt = pyplot()
    with plt.rc_context(style or {}):
        fig, axes = plt.subplots(*grid, **subplots)
        yield fig, axes
        save(fig, path, save_dpi)
