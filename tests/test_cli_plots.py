"""Every ``--plot`` of the commands: one PNG at the path given, a title, units
on the axes, the SLO as a line where there is one, and no text drawn over
other text (tick labels, bar values, legends). Each figure is kept as the
command saves it (``_plot.save``) and measured after layout."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("matplotlib")

from routecore.cli import main  # noqa: E402
from routecore.commands import _plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figures(monkeypatch):
    """The figures the commands save, in order, measured before they are freed."""
    saved = []
    save = _plot.save

    def keep(fig, path):
        fig.canvas.draw()
        saved.append(Figure(fig))
        save(fig, path)

    monkeypatch.setattr(_plot, "save", keep)
    return saved


def shown_ticks(ax) -> list:
    """The tick labels drawn: those inside the axes' limits."""
    lo_x, hi_x = sorted(ax.get_xlim())
    lo_y, hi_y = sorted(ax.get_ylim())
    return [t for t in ax.get_xticklabels() if lo_x <= t.get_position()[0] <= hi_x] + [
        t for t in ax.get_yticklabels() if lo_y <= t.get_position()[1] <= hi_y
    ]


class Figure:
    """What a reader sees of a drawn figure."""

    def __init__(self, fig) -> None:
        renderer = fig.canvas.get_renderer()
        self.renderer = renderer
        self.title = fig._suptitle.get_text() if fig._suptitle else ""
        self.axes = fig.axes
        texts = [
            t
            for ax in fig.axes
            for t in [*shown_ticks(ax), *ax.texts, ax.xaxis.label, ax.yaxis.label, ax.title]
            if t.get_visible() and t.get_text()
        ]
        self.boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        self.legends = [
            leg.get_window_extent(renderer)
            for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
            if leg is not None
        ]
        self.figure_legends = [[t.get_text() for t in leg.get_texts()] for leg in fig.legends]

    def overlapping_texts(self) -> list[tuple[str, str]]:
        return [
            (a, b)
            for (a, box_a), (b, box_b) in itertools.combinations(self.boxes, 2)
            if box_a.overlaps(box_b) and box_a.width > 0 and box_b.width > 0
        ]

    def texts_under_legends(self) -> list[str]:
        return [text for text, box in self.boxes for leg in self.legends if leg.overlaps(box)]

    def vertical_lines_at(self, ax) -> set[float]:
        return {
            round(float(line.get_xdata()[0]), 6)
            for line in ax.get_lines()
            if len(set(line.get_xdata())) == 1 and line.get_linestyle() == "--"
        }


def assert_readable(fig: Figure) -> None:
    assert fig.title
    assert fig.overlapping_texts() == []
    assert fig.texts_under_legends() == []
    for ax in fig.axes:
        # plain numbers on the ticks: no '1e-4' scale written beside the axis
        assert ax.xaxis.get_offset_text().get_text() == ""
        assert ax.yaxis.get_offset_text().get_text() == ""


def test_simulate_plot_is_one_png_with_the_slos_as_lines(tmp_path, figures, capsys):
    png = tmp_path / "sim.png"
    argv = ["simulate", "--rate", "40", "--duration", "20", "--no-verify", "--quiet"]
    assert main([*argv, "--slo-ttft", "1.5", "--slo-tpot", "0.07", "--plot", str(png)]) == 0
    assert png.is_file() and png.read_bytes().startswith(PNG_MAGIC)
    (fig,) = figures
    assert_readable(fig)
    assert "40 req/s" in fig.title
    ttft, tpot, e2e, util = fig.axes
    assert ttft.get_xlabel() == "TTFT (s, log scale)" and tpot.get_xlabel() == "TPOT (ms)"
    assert 1.5 in fig.vertical_lines_at(ttft)
    assert 70.0 in fig.vertical_lines_at(tpot)
    # the fleets and the SLO in one legend under the panels
    assert fig.figure_legends == [
        ["homogeneous", "pool-routing", "fleetopt", "SLO (TTFT 1.5 s, TPOT 70 ms)"]
    ]
    assert ttft.get_legend() is None and tpot.get_legend() is None
    assert "inf" not in [t.get_text() for t in util.texts]
    # curves that follow each other stay apart: each fleet its own dashes,
    # each drawn thinner than the one under it
    for ax in (ttft, tpot, e2e):
        curves = [line for line in ax.get_lines() if len(set(line.get_xdata())) > 1]
        assert [c.get_label() for c in curves] == ["homogeneous", "pool-routing", "fleetopt"]
        assert len({c.get_linestyle() for c in curves}) == 3
        widths = [c.get_linewidth() for c in curves]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3


def test_simulate_plot_into_a_missing_directory_is_refused_before_the_run(tmp_path, capsys):
    assert main(["simulate", "--quiet", "--plot", str(tmp_path / "no" / "sim.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "does not exist" in err and err.count("\n") == 1


def test_assign_eval_plot_prices_in_micro_usd_and_names_points_in_a_legend(tmp_path, figures):
    png = tmp_path / "assign.png"
    assert main(["assign-eval", "--requests", "300", "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    (fig,) = figures
    assert_readable(fig)
    latency, cost = fig.axes
    assert cost.get_xlabel() == "cost per request (micro-USD)"
    # costs of a few tens of micro-USD, written as such
    assert 1 < max(cost.get_xlim()) < 10_000
    # the named policies are in the legend, not written on the data
    assert list(latency.texts) == [] and list(cost.texts) == []


def test_pick_eval_plot_is_readable(tmp_path, figures):
    png = tmp_path / "pick.png"
    argv = ["pick-eval", "--requests", "300", "--quiet", "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    (fig,) = figures
    assert_readable(fig)
    assert [ax.get_title() for ax in fig.axes] == [
        "prefix-cache hit rate",
        "TTFT",
        "load imbalance (1 = even)",
    ]
    # p50 (tens of ms) and p99 (seconds) both visible: a log axis, every bar
    # several pixels long
    ttft = fig.axes[1]
    assert ttft.get_xscale() == "log" and ttft.get_xlabel() == "time to first token (s, log scale)"
    lengths = [bar.get_window_extent(fig.renderer).width for bar in ttft.patches]
    assert len(lengths) == 2 * 7 and min(lengths) > 10


@pytest.mark.parametrize("width", [3.0, 6.0])
def test_log_axis_tick_labels_never_overlap_however_narrow_the_panel(width):
    # the TTFT bars of the default pick-eval: 0.03 s to 8.7 s, on a panel as
    # narrow as one of its three
    fig, (ax,) = _plot.figure("TTFT", 1, (width, 2.0))
    ax.barh([0, 1], [0.03, 8.7])
    ax.set_xlim(0.015, 35.0)
    _plot.plain_log_axis(ax.xaxis)
    fig.canvas.draw()
    drawn = Figure(fig)
    _plot.save(fig, "/dev/null")
    assert drawn.overlapping_texts() == []
    labels = [t.get_text() for t in shown_ticks(ax)]
    assert {"0.1", "1", "10"} <= set(labels)


def test_plan_plot_is_readable(tmp_path, figures, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    (fig,) = figures
    assert_readable(fig)


@pytest.mark.parametrize("experiment", ["1", "2"])
def test_admission_scenario_plot_is_readable(experiment, tmp_path, figures, capsys):
    png = tmp_path / "timeline.png"
    assert main(["admission-scenario", experiment, "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    (fig,) = figures
    assert_readable(fig)
    assert fig.axes[-1].get_xlabel() == "time (s)"
