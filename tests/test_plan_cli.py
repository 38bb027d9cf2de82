"""``routecore plan``: the default table, --json, --plot, flags and errors."""

import json

import pytest

from routecore import Workload, plan
from routecore.cli import main
from routecore.planning import fleetopt_profile, fleetopt_workload


def test_default_table(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for row in ("Homogeneous", "Pool routing (PR)", "PR + C&R (gamma 1.5)", "FleetOpt optimum"):
        assert row in out
    # the homogeneous fleet of the paper's model on the trace's own split
    homo = plan(Workload.azure_2023(), 1000.0, 0.5).homogeneous
    assert f"{homo.gpus:>6}" in out.splitlines()[2]


def test_json_matches_the_api(capsys):
    args = ["plan", "--fleetopt-assumptions", "--b-short", "4096", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    r = plan(
        fleetopt_workload(Workload.azure_2023()), 1000.0, 0.5, fleetopt_profile(), b_short=[4096]
    )
    assert data["homogeneous"] == r.homogeneous.as_dict()
    assert data["pool_routing"]["n_short"] == r.pool_routing.n_short
    assert data["pool_routing"]["n_long"] == r.pool_routing.n_long
    assert len(data["sweep"]) == 11
    assert data["table"]["PR + C&R (gamma 1.5)"]["gamma"] == 1.5
    for key in ("b_short", "gamma", "n_short", "n_long", "gpus", "annual_cost_usd"):
        assert key in data["best"]


def test_flags_trace_profile_price_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rows = "\n".join(
        f"{100 + 37 * i % 5000},{10 + i % 300},{'code' if i % 3 else 'chat'}" for i in range(400)
    )
    trace.write_text("in,out,kind\n" + rows + "\n")
    prof = tmp_path / "p.toml"
    prof.write_text('name = "x"\npreset = "llama3_70b_a100"\nh_ref_tokens = 8192\n')
    png = tmp_path / "fig.png"
    args = [
        "plan", "--trace", str(trace), "--input-column", "in", "--output-column", "out",
        "--category-column", "kind", "--p-c-category", "code=0", "--rate", "50",
        "--slo-ms", "800", "--profile", str(prof), "--price", "4.0", "--json", "--plot", str(png),
    ]  # fmt: skip
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    h = data["homogeneous"]
    assert h["annual_cost_usd"] == pytest.approx(h["gpus"] * 4.0 * 8760)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--rate", "0"],
        ["plan", "--profile", "no_such_profile.toml"],
        ["plan", "--trace", "missing.csv"],
        ["plan", "--b-short", "70000"],
        ["plan", "--p-c-category", "prose=0.5"],
    ],
)
def test_errors_exit_2(args, capsys):
    assert main(args) == 2
    assert "routecore plan: error:" in capsys.readouterr().err


def test_bad_category_flag():
    assert main(["plan", "--p-c-category", "code"]) == 2
