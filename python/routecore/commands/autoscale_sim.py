"""``routecore autoscale-sim``: autoscaling policies compared in the simulator
(issue 26).

Two experiments by default, each a rate profile over time: a day-shaped
curve and a step from 500 to 2,000 req/s. For each, one pool of the
profile's engines (the Azure 2023 trace's requests, Poisson arrivals that
follow the rate) runs under four policies: a static fleet provisioned for the
peak, the fleet sized for each moment in hindsight (the reference),
the WVA-style saturation rule and routecore's model-based autoscaler (the
data plane's code: the planner's engine model on the live window, damped).
Endpoints take ``--startup`` seconds to start and drain before they stop.
Prints GPU-hours and SLO attainment per policy (or ``--json``) and draws
``--plot FILE.png``: endpoints and SLO attainment over time.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import sys
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from routecore import profiles
from routecore._core import AUTOSCALE_POLICIES as POLICIES
from routecore._core import RateProfile, Workload, autoscale_simulate
from routecore._json import dumps
from routecore.commands import _plot
from routecore.commands._args import (
    add_json,
    add_plot,
    add_profile,
    add_quiet,
    add_seed,
    add_slo,
    non_negative_float,
    positive_float,
    positive_int,
    token_count,
)
from routecore.commands.simulate import Progress, load_trace, trace_arrays

NAME = "autoscale-sim"
HELP = (
    "Compare autoscaling policies (static, hindsight, saturation rule, routecore's model) "
    "in the simulator on a day-shaped rate profile and a step from 500 to 2,000 req/s: "
    "GPU-hours and SLO attainment."
)

#: The experiments: a rate profile (its rates ``a`` and ``b`` times
#: ``--rate-scale``) and its duration, sized so that the default run takes
#: about a minute here. The day is compressed into 20 minutes: a trough of
#: 200 req/s at 0 and 20 minutes, a peak of 1,000 at 10. The step goes from
#: 500 to 2,000 req/s at 2 minutes and holds for 4.
EXPERIMENTS: dict[str, tuple[str, float, float, float]] = {
    "day": ("diurnal:low={a},high={b},period=1200", 200.0, 1000.0, 1200.0),
    "step": ("step:{a}@0,{b}@120", 500.0, 2000.0, 360.0),
}
#: Attainment is shown over bins of this many seconds in the plot.
PLOT_BIN_S = 30.0
#: The goal of issue 26: 99 % within the SLO, GPU-hours within 10 % of hindsight.
GOAL_ATTAINMENT = 0.99
GOAL_OVER_HINDSIGHT = 0.10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--experiment",
        action="append",
        choices=tuple(EXPERIMENTS),
        help="an experiment to run (repeat; default both): 'day', a day-shaped rate "
        "from 200 to 1,000 req/s and back in 20 minutes, or 'step', from 500 to 2,000 "
        "req/s at 2 minutes, for 6 minutes",
    )
    p.add_argument(
        "--rate-profile",
        metavar="SPEC",
        help="run this rate profile instead of the experiments: 'step:500@0,2000@600', "
        "'diurnal:low=500,high=2000,period=1200' or "
        "'burst:base=500,peak=2000,at=300,length=60[,every=600]' (with --duration)",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        help="seconds of arrivals of --rate-profile (default 600), or of each experiment "
        "(default: its own)",
    )
    p.add_argument(
        "--rate-scale",
        type=positive_float,
        default=1.0,
        help="multiply the experiments' rates (default 1)",
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="a policy to run (repeat; default all four)",
    )
    p.add_argument(
        "--trace",
        default="azure-2023",
        help="where request lengths (and with --arrivals trace, timestamps) come from: "
        "'azure-2023' (the shipped trace) or a CSV with ContextTokens and GeneratedTokens "
        "columns (default azure-2023)",
    )
    p.add_argument(
        "--arrival-column",
        default="TIMESTAMP",
        help="the CSV's timestamp column for --arrivals trace, seconds or "
        "YYYY-MM-DD HH:MM:SS, in file order (default TIMESTAMP)",
    )
    p.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="'poisson' (default): a Poisson process following the rate, requests drawn "
        "from the trace; 'trace': the trace's own timestamps scaled to the rate profile "
        "(its burstiness kept; timestamps that go backwards are refused)",
    )
    p.add_argument(
        "--context",
        type=token_count,
        default=16384,
        help="each endpoint's context window in tokens, which sets its slots; requests "
        "longer are left out of the workload (default 16384)",
    )
    p.add_argument(
        "--startup",
        type=non_negative_float,
        default=60.0,
        metavar="SECONDS",
        help="seconds from an endpoint's start to its first request (default 60)",
    )
    p.add_argument(
        "--period",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between two decisions of every policy (default 10)",
    )
    p.add_argument(
        "--window",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="routecore's live window (default 30: its trend follows a day's ramp)",
    )
    p.add_argument(
        "--scale-down-delay",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="the damping's scale-down delay of the saturation rule and routecore (default 30)",
    )
    p.add_argument(
        "--forecast",
        type=non_negative_float,
        metavar="SECONDS",
        help="routecore sizes for the rate its window's trend reaches this far ahead "
        "(default: --startup plus --period, what a decision must cover; 0: the window's "
        "rate as it is)",
    )
    p.add_argument(
        "--queue-drain",
        type=positive_float,
        metavar="SECONDS",
        help="routecore drains the requests waiting in the engines over this many seconds "
        "(default: the forecast's horizon, at least --period)",
    )
    p.add_argument(
        "--max-forecast-ratio",
        type=float,
        default=2.0,
        metavar="RATIO",
        help="routecore's forecast is at most this multiple of its window's newest "
        "sub-window rate (default 2; >= 1)",
    )
    p.add_argument(
        "--max-step-up-percent",
        type=non_negative_float,
        default=1000.0,
        metavar="PERCENT",
        help="routecore adds at most this percentage of its count (or 4) per decision "
        "(default 1000: a step's count in one decision, not a doubling a period)",
    )
    p.add_argument(
        "--max-endpoints",
        type=positive_int,
        default=1000,
        help="the pool's bound (default 1000)",
    )
    add_profile(p)
    add_slo(p)
    add_seed(p, "arrival and sampling seed")
    add_json(p)
    add_plot(p, "endpoints and SLO attainment over time per policy")
    add_quiet(p)


def read_timestamps(path: str, column: str) -> np.ndarray:
    """The CSV's ``column`` in file order: seconds, or ``YYYY-MM-DD HH:MM:SS``
    timestamps (UTC), as seconds."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = csv.DictReader(f)
        if column not in (rows.fieldnames or []):
            raise ValueError(f"{path}: no column {column!r} for --arrivals trace")
        out = []
        for line, row in enumerate(rows, start=2):
            text = (row[column] or "").strip()
            try:
                out.append(float(text))
            except ValueError:
                try:
                    stamp = datetime.fromisoformat(text).replace(tzinfo=timezone.utc)
                except ValueError:
                    raise ValueError(
                        f"{path} line {line}: {column} must be seconds or a timestamp, got {text!r}"
                    ) from None
                out.append(stamp.timestamp())
    return np.array(out, dtype=np.float64)


def autoscale_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``autoscale`` mapping of every policy: one pool, the SLO, the
    period, the window and the damping."""
    forecast = args.startup + args.period if args.forecast is None else args.forecast
    return {
        "period_s": args.period,
        "window_s": args.window,
        "scale_down_delay_s": args.scale_down_delay,
        "forecast_s": forecast or None,
        "queue_drain_s": args.queue_drain,
        "max_forecast_ratio": args.max_forecast_ratio,
        "max_step_up_percent": args.max_step_up_percent,
        "pools": [
            {
                "name": "pool",
                "context": args.context,
                "min_endpoints": 1,
                "max_endpoints": args.max_endpoints,
                "slo_ttft_s": args.slo_ttft,
                "slo_tpot_s": args.slo_tpot,
            }
        ],
    }


def experiments(args: argparse.Namespace) -> list[tuple[str, RateProfile, float]]:
    """(name, rate profile, duration) of each experiment to run."""
    if args.rate_profile:
        return [("custom", RateProfile(args.rate_profile), args.duration or 600.0)]
    out = []
    for name in args.experiment or EXPERIMENTS:
        spec, a, b, duration = EXPERIMENTS[name]
        a, b = a * args.rate_scale, b * args.rate_scale
        out.append(
            (name, RateProfile(spec.format(a=f"{a:g}", b=f"{b:g}")), args.duration or duration)
        )
    return out


def workload(
    w: Workload,
    rates: RateProfile,
    duration: float,
    stamps: np.ndarray | None,
    args: argparse.Namespace,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrival times and lengths of the requests of one experiment."""
    if args.arrivals == "trace":
        if stamps is None:
            raise ValueError(f"--arrivals trace: the trace {args.trace!r} has no timestamps")
        arrival = rates.arrivals(duration, trace_s=stamps)
        lengths = trace_arrays(w, len(arrival), "trace")
    else:
        arrival = rates.arrivals(duration, seed=args.seed)
        lengths = trace_arrays(w, len(arrival), "poisson", args.seed)
    return arrival, lengths.input_tokens, lengths.output_tokens


def goal(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Issue 26's goal for routecore's policy, when the three others ran."""
    if not {"routecore", "saturation", "hindsight"} <= rows.keys():
        return None
    rc, sat, hs = rows["routecore"], rows["saturation"], rows["hindsight"]
    over = rc["gpu_hours"] / hs["gpu_hours"] - 1
    return {
        "meets_slo": rc["attainment"] >= GOAL_ATTAINMENT,
        "fewer_gpu_hours_than_saturation": rc["gpu_hours"] < sat["gpu_hours"],
        "over_hindsight": over,
        "within_10_percent_of_hindsight": over <= GOAL_OVER_HINDSIGHT,
    }


def run_experiment(
    name: str,
    rates: RateProfile,
    duration: float,
    w: Workload,
    stamps: np.ndarray | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    arrival, inputs, outputs = workload(w, rates, duration, stamps, args)
    profile = profiles.resolve(args.profile)
    rows: dict[str, dict[str, Any]] = {}
    for policy in args.policy or POLICIES:
        started = time.perf_counter()
        r = autoscale_simulate(
            arrival, inputs, outputs, profile, autoscale_config(args), rate_profile=rates,
            policy=policy, horizon_s=duration, startup_s=args.startup,
            progress=Progress(f"{name} {policy}", not args.quiet),
        )  # fmt: skip
        r["wall_s"] = time.perf_counter() - started
        rows[policy] = r
    return {
        "name": name,
        "rate_profile": rates.spec,
        "duration_s": duration,
        "requests": len(arrival),
        "rises_s": rates.rises(duration),
        "arrival_s": arrival,
        "policies": rows,
        "goal": goal(rows),
    }


def public(e: dict[str, Any]) -> dict[str, Any]:
    """An experiment's figures for ``--json``: per policy the totals and its
    decisions over time (no per-request arrays)."""
    policies = []
    for name, r in e["policies"].items():
        ticks = {k: v.tolist() for k, v in r["ticks"].items()}
        policies.append({
            "policy": name,
            "gpu_hours": r["gpu_hours"],
            "attainment": r["attainment"],
            "initial_endpoints": r["initial_endpoints"],
            "peak_endpoints": r["peak_endpoints"],
            "started": r["started"],
            "stopped": r["stopped"],
            "excluded_requests": int(r["excluded"].sum()),
            "wall_s": r["wall_s"],
            "ticks": ticks,
        })  # fmt: skip
    keep = ("name", "rate_profile", "duration_s", "requests", "rises_s", "goal")
    return {**{k: e[k] for k in keep}, "policies": policies}


def yes(x: bool) -> str:
    return "yes" if x else "NO"


def print_table(result: dict[str, Any]) -> None:
    print(
        f"routecore autoscale-sim: {result['trace']} lengths, {result['arrivals']} arrivals, "
        f"{result['profile']}, start-up {result['startup_s']:g} s, period "
        f"{result['period_s']:g} s, SLO TTFT {result['slo_ttft_s']:g} s / TPOT "
        f"{1000 * result['slo_tpot_s']:g} ms"
    )
    for e in result["experiments"]:
        print()
        print(f"{e['name']}: {e['rate_profile']} over {e['duration_s']:g} s, "
              f"{e['requests']:,} requests")  # fmt: skip
        hs = next((p for p in e["policies"] if p["policy"] == "hindsight"), None)
        header = f"{'policy':<12} {'GPU-hours':>10} {'vs hindsight':>13} {'SLO met':>8} " \
                 f"{'peak endpoints':>15} {'starts':>7}"  # fmt: skip
        print(header)
        for p in e["policies"]:
            vs = f"{100 * (p['gpu_hours'] / hs['gpu_hours'] - 1):+.1f}%" if hs else "-"
            att = "n/a" if math.isnan(p["attainment"]) else f"{100 * p['attainment']:.2f}%"
            print(f"{p['policy']:<12} {p['gpu_hours']:>10.2f} {vs:>13} {att:>8} "
                  f"{p['peak_endpoints']:>15} {p['started']:>7}")  # fmt: skip
        g = e["goal"]
        if g:
            print(f"goal (routecore): SLO >= 99% {yes(g['meets_slo'])}; fewer GPU-hours than "
                  f"saturation {yes(g['fewer_gpu_hours_than_saturation'])}; within 10% of "
                  f"hindsight {yes(g['within_10_percent_of_hindsight'])} "
                  f"({100 * g['over_hindsight']:+.1f}%)")  # fmt: skip


def plot(result: dict[str, Any], runs: list[dict[str, Any]], path: str) -> None:
    """Per experiment two panels: the endpoints running (ready and starting)
    per policy over time with the rate on a second axis, and the share of
    the requests arriving in each bin that met the SLO (99% dashed)."""
    fig, axes = _plot.figure(
        f"routecore autoscale-sim: {result['profile']}, start-up {result['startup_s']:g} s",
        2 * len(runs),
        (11, 4.2 * len(runs)),
    )
    for k, e in enumerate(runs):
        fleet, slo = axes[2 * k], axes[2 * k + 1]
        rates = RateProfile(e["rate_profile"])
        for i, (name, r) in enumerate(e["policies"].items()):
            t = r["ticks"]
            running = t["ready"] + t["starting"]
            style = {**_plot.SERIES[i % len(_plot.SERIES)], "color": f"C{i}"}
            fleet.step(np.concatenate([[0.0], t["time"]]),
                       np.concatenate([[r["initial_endpoints"]], running]),
                       where="post", label=name, **style)  # fmt: skip
            bins = np.arange(0.0, e["duration_s"] + PLOT_BIN_S, PLOT_BIN_S)
            which = np.digitize(e["arrival_s"], bins) - 1
            met = np.bincount(which, weights=r["met"], minlength=len(bins))[: len(bins) - 1]
            n = np.bincount(which, minlength=len(bins))[: len(bins) - 1]
            share = np.divide(met, n, out=np.full(len(n), np.nan), where=n > 0)
            slo.plot(bins[:-1] + PLOT_BIN_S / 2, 100 * share, label=name, **style)
        x = np.linspace(0.0, e["duration_s"], 400)
        twin = fleet.twinx()
        twin.plot(x, [rates.rate(v) for v in x], color="0.6", linestyle=":", label="rate")
        twin.set_ylabel("rate (req/s, dotted)")
        fleet.set_title(f"{e['name']}: endpoints running (ready + starting)")
        fleet.set_xlabel("time (s)")
        fleet.set_ylabel("endpoints")
        fleet.grid(alpha=0.3)
        _plot.target_line(slo, 100 * GOAL_ATTAINMENT, "99% target", vertical=False)
        slo.set_title(f"{e['name']}: SLO attainment per {PLOT_BIN_S:g} s of arrivals")
        slo.set_xlabel("time (s)")
        slo.set_ylabel("requests within TTFT and TPOT (%)")
        slo.grid(alpha=0.3)
        for rise in e["rises_s"]:
            # Left out of the attainment: until the first decision after the
            # rise has its endpoints ready (ScaleConfig::excluded_until).
            first = (math.floor(rise / result["period_s"]) + 1) * result["period_s"]
            slo.axvspan(rise, first + result["startup_s"], color="0.9", zorder=0)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=9)
    _plot.save(fig, path)


def run(args: argparse.Namespace) -> int:
    w = load_trace(args.trace)
    stamps = None
    if args.arrivals == "trace":
        stamps = (
            w.arrival_s
            if args.trace == "azure-2023"
            else read_timestamps(args.trace, args.arrival_column)
        )
    fits = np.flatnonzero(w.input_tokens + np.maximum(w.output_tokens, 1) <= args.context)
    if fits.size == 0:
        raise ValueError(f"no request of the trace fits --context {args.context}")
    kept = Workload(
        w.input_tokens[fits], w.output_tokens[fits],
        None if w.arrival_s is None else w.arrival_s[fits],
    )  # fmt: skip
    runs = [run_experiment(n, r, d, kept, stamps, args) for n, r, d in experiments(args)]
    result = {
        "trace": args.trace,
        "arrivals": args.arrivals,
        "profile": profiles.resolve(args.profile).name,
        "context": args.context,
        "left_out_of_trace": len(w) - int(fits.size),
        "startup_s": args.startup,
        "period_s": args.period,
        "window_s": args.window,
        "scale_down_delay_s": args.scale_down_delay,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "seed": args.seed,
        "experiments": [public(e) for e in runs],
    }
    if args.json:
        print(dumps(result))
    else:
        print_table(result)
    if args.plot:
        plot(result, runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
