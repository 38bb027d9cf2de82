"""The figures of the ``routecore`` commands, drawn one way.

Every ``--plot FILE.png`` is one figure: a title saying what was run, panels
with units on their axes, a target (an SLO) as a dashed red line, legends
outside the data, plain tick labels (``0.5``, ``2``, ``20``; never ``2x10^-2``).
Needs the 'plot' extra (matplotlib, on the file-only Agg backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routecore._extras import pyplot

#: Resolution of every PNG the commands write.
DPI = 110
#: The colour of a target line (an SLO, an even load).
TARGET = "tab:red"


def figure(title: str, panels: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    """A figure of ``panels`` panels side by side (two rows when more than
    three) under ``title``, laid out so labels never overlap."""
    plt = pyplot()
    rows = 2 if panels > 3 else 1
    cols = -(-panels // rows)
    fig, axes = plt.subplots(rows, cols, figsize=size, layout="constrained", squeeze=False)
    fig.suptitle(title)
    return fig, list(axes.flat)


def save(fig: Any, path: str) -> None:
    """Writes ``fig`` to ``path`` (PNG) and frees it."""
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)


def target_line(ax: Any, value: float, label: str, *, vertical: bool) -> None:
    """A target (an SLO) as a dashed red line, named in the legend."""
    line = ax.axvline if vertical else ax.axhline
    line(value, color=TARGET, linestyle="--", linewidth=1.2, label=label)


#: The room a tick label of a log axis needs along it, in inches ("0.05").
TICK_ROOM_IN = 0.45


def plain_log_axis(axis: Any) -> None:
    """A log axis (of data already drawn) whose ticks read as plain numbers:
    at 1, 2, 3 and 5 of each decade over a short range, at 1, 2 and 5 over a
    few decades, at the powers of ten over more or where the axis is too
    short for the labels of the denser ticks side by side."""
    ticker = __import__("matplotlib.ticker").ticker
    axis.axes.set(**{f"{axis.axis_name}scale": "log"})
    lo, hi = sorted(axis.get_view_interval())
    decades = np.log10(hi / lo) if lo > 0 else np.inf
    box = axis.axes.get_position()
    size = axis.axes.figure.get_size_inches()
    length = box.width * size[0] if axis.axis_name == "x" else box.height * size[1]
    subs = (1.0, 2.0, 3.0, 5.0) if decades < 1.5 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
    if decades * len(subs) * TICK_ROOM_IN > length:
        subs = (1.0,)
    axis.set_major_locator(ticker.LogLocator(subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


#: The line of each series of a panel, in drawing order: each one thinner and
#: more broken than the one before, so a curve drawn over an earlier one that
#: it follows closely leaves that one visible around it and in its gaps.
SERIES = (
    {"linestyle": "-", "linewidth": 3.2},
    {"linestyle": "-.", "linewidth": 2.2},
    {"linestyle": ":", "linewidth": 1.6},
)


def cdf(ax: Any, values: np.ndarray, label: str, series: int = 0) -> None:
    """The empirical CDF of the finite ``values`` as a line, in the style of
    the ``series``-th series (``SERIES``, repeated past its end)."""
    xs = np.sort(values[np.isfinite(values)])
    style = SERIES[series % len(SERIES)]
    ax.plot(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), label=label, **style)


def bars(
    ax: Any, values: Sequence[float], fmt: str, *, offset: float = 0.0, width: float = 0.8,
    missing: str = "n/a", **style: Any,
) -> None:  # fmt: skip
    """One horizontal bar per category, its value written at its end
    (``missing`` for a value that is not finite, with no bar)."""
    finite = [float(v) if np.isfinite(v) else 0.0 for v in values]
    labels = [fmt % v if np.isfinite(v) else missing for v in values]
    container = ax.barh(np.arange(len(values)) + offset, finite, width, **style)
    ax.bar_label(container, labels=labels, fontsize=7, padding=2)


def categories(ax: Any, names: Sequence[str]) -> None:
    """Category names beside the bars, first at the top (horizontal text,
    which never overlaps), a vertical grid, and room after the longest bar
    for its value."""
    ax.set_yticks(np.arange(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
