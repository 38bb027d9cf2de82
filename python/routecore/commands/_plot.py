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


def plain_log_axis(axis: Any) -> None:
    """A log axis (of data already drawn) whose ticks read as plain numbers:
    at 1, 2, 3 and 5 of each decade over a short range, at 1, 2 and 5 over a
    few decades, at the powers of ten over more."""
    ticker = __import__("matplotlib.ticker").ticker
    axis.axes.set(**{f"{axis.axis_name}scale": "log"})
    lo, hi = sorted(axis.get_view_interval())
    decades = np.log10(hi / lo) if lo > 0 else np.inf
    subs = (1.0, 2.0, 3.0, 5.0) if decades < 1.5 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def cdf(ax: Any, values: np.ndarray, label: str) -> None:
    """The empirical CDF of the finite ``values`` as a line."""
    xs = np.sort(values[np.isfinite(values)])
    ax.plot(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), label=label)


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
