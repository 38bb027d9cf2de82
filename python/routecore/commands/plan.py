"""``routecore plan``: the cheapest fleet for a workload and a P99 TTFT target."""

from __future__ import annotations

import argparse
import math
from typing import Any

from routecore import disaggregation, profiles
from routecore._core import Candidate, Plan, Profile, Workload, plan
from routecore._extras import pyplot
from routecore._json import dumps
from routecore.commands import _plot
from routecore.commands._args import (
    add_json,
    add_plot,
    add_profile,
    add_seed,
    add_slo,
    fraction,
    positive_float,
    token_count,
)
from routecore.commands.simulate import percent
from routecore.planning import (
    fleetopt_profile,
    fleetopt_workload,
    plan_json,
    savings_note,
    table3_rows,
)

NAME = "plan"
HELP = (
    "Plan the cheapest two-pool fleet (FleetOpt): GPUs per pool, annual cost and savings "
    "against a homogeneous fleet. Without a trace, plans the Azure LLM trace 2023."
)


def parse_category_pc(spec: str) -> tuple[str, float]:
    """``NAME=P_C`` -> (name, p_c)."""
    name, sep, value = spec.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected CATEGORY=P_C") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="CSV trace (default: the embedded Azure 2023 trace)")
    p.add_argument("--input-column", default="ContextTokens", help="CSV input-token column")
    p.add_argument("--output-column", default="GeneratedTokens", help="CSV output-token column")
    p.add_argument("--category-column", help="CSV category column (for --p-c-category)")
    p.add_argument("--rate", type=positive_float, default=1000.0, help="arrival rate, req/s (1000)")
    add_slo(p)
    add_profile(p)
    p.add_argument("--price", type=positive_float, help="$/GPU-hour (default: the profile's)")
    p.add_argument(
        "--h-ref-tokens",
        type=token_count,
        help="scale the per-slot cost H by L_total / N (length-scaled slot model)",
    )
    p.add_argument(
        "--b-short",
        type=token_count,
        action="append",
        help="candidate short-pool boundary, tokens (repeat; default: 256 ... 49152)",
    )
    p.add_argument("--p-c", type=fraction, default=1.0, help="compressibility p_c (1.0)")
    p.add_argument(
        "--p-c-category",
        type=parse_category_pc,
        action="append",
        metavar="CATEGORY=P_C",
        help="per-category compressibility, e.g. code=0 (repeat)",
    )
    p.add_argument(
        "--phi", type=positive_float, default=1.0, help="long/short GPU cost ratio (1.0)"
    )
    p.add_argument(
        "--long-context", type=token_count, default=65536, help="long pool context (65536)"
    )
    p.add_argument(
        "--fleetopt-assumptions",
        action="store_true",
        help="plan the trace's CDF with an 80/20 split and H scaled at 8K tokens, "
        "the assumptions behind FleetOpt's published Azure rows",
    )
    p.add_argument(
        "--model",
        choices=("engine", "paper"),
        default="engine",
        help="service model: 'engine' (the simulator's engine; default) or 'paper' "
        "(FleetOpt Eq. 3-4, which reproduces the paper's tables)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check the homogeneous, pool-routing and best fleets in the simulator: per "
        "pool, bisection to the smallest GPU count meeting both SLOs for 99%% of its "
        "requests (see `routecore simulate`), printed beside the plan",
    )
    p.add_argument(
        "--verify-duration",
        type=positive_float,
        default=60.0,
        help="simulated seconds of arrivals per verification run (60)",
    )
    add_seed(p, "verification seed")
    add_json(p, "the plan as JSON")
    add_plot(p, "the savings of each B_short and gamma")
    disaggregation.add_transfer_arguments(p)


def load_inputs(args: argparse.Namespace) -> tuple[Workload, Profile]:
    if args.trace:
        workload = Workload.from_csv(
            args.trace,
            args.input_column,
            args.output_column,
            category_column=args.category_column,
        )
    else:
        workload = Workload.azure_2023()
    profile = profiles.resolve(args.profile)
    if args.price is not None:
        profile = profile.replace(price_per_gpu_hour=args.price)
    if args.h_ref_tokens is not None:
        profile = profile.replace(h_ref_tokens=args.h_ref_tokens)
    if args.fleetopt_assumptions:
        workload = fleetopt_workload(workload)
        profile = fleetopt_profile(profile)
    return workload, profile


def run_plan(args: argparse.Namespace) -> Plan:
    workload, profile = load_inputs(args)
    return plan(
        workload,
        args.rate,
        args.slo_ttft,
        profile,
        b_short=args.b_short,
        p_c=args.p_c,
        p_c_by_category=dict(args.p_c_category or []),
        phi=args.phi,
        long_context=args.long_context,
        model="paper" if args.fleetopt_assumptions else args.model,
        slo_tpot_s=args.slo_tpot,
    )


def format_table(rows: list[tuple[str, Candidate | None]]) -> str:
    head = (
        f"{'method':<22} {'B_short':>7} {'gamma':>5} {'n_s':>6} {'n_l':>6} {'total':>6} "
        f"{'cost K$/yr':>10} {'savings':>7} {'TTFT99 s/l ms':>15} {'binding s/l':>17}"
    )
    lines = [head, "-" * len(head)]
    for name, c in rows:
        if c is None:
            lines.append(f"{name:<22} {'no feasible fleet':>30}")
            continue
        b = str(c.b_short) if c.b_short else "-"
        ttft = "/".join(
            f"{t * 1e3:.0f}" if lam > 0 else "-"
            for t, lam in [
                (c.p99_ttft_short_s, c.arrival_rate_short),
                (c.p99_ttft_long_s, c.arrival_rate_long),
            ]
        )
        flag = "" if c.feasible else "  (misses the SLO)"
        binding = "/".join(
            bnd if lam > 0 else "-"
            for bnd, lam in [
                (c.binding_short, c.arrival_rate_short),
                (c.binding_long, c.arrival_rate_long),
            ]
        )
        lines.append(
            f"{name:<22} {b:>7} {c.gamma:>5.1f} {c.n_short:>6} {c.n_long:>6} {c.gpus:>6} "
            f"{c.annual_cost_usd / 1e3:>10,.0f} {percent(c.savings_vs_homogeneous):>7} {ttft:>15} "
            f"{binding:>17}{flag}"
        )
    return "\n".join(lines)


def _tokens(n: int) -> str:
    """A token count as a tick label: 512, 4K, 48K."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def savings_grid(result: Plan) -> tuple[list[int], list[float], list[list[float]]]:
    """The sweep as a grid: (B_short values, gammas, savings % [gamma][B_short]),
    NaN where the fleet misses the SLO."""
    bs = sorted({c.b_short for c in result.sweep if c.b_short})
    gammas = sorted({c.gamma for c in result.sweep})
    grid = [[math.nan] * len(bs) for _ in gammas]
    for c in result.sweep:
        if c.b_short and c.feasible and c.savings_vs_homogeneous is not None:
            grid[gammas.index(c.gamma)][bs.index(c.b_short)] = c.savings_vs_homogeneous * 100
    return bs, gammas, grid


def plot_savings(result: Plan, path: str, title: str) -> list[str]:
    """The (B_short, gamma) sweep to a PNG (after FleetOpt Figure 6): above, the
    savings of pool routing alone (gamma 1) and of the best gamma at each
    B_short, the optimum starred; below, every (B_short, gamma) as a heat map
    with its value. Returns the legend of the upper panel."""
    plt = pyplot()
    np = __import__("numpy")

    bs, gammas, grid = savings_grid(result)
    data = np.array(grid)
    fig, (top, heat) = plt.subplots(
        2, 1, figsize=(9, 8), gridspec_kw={"height_ratios": [1, 1.3]}, constrained_layout=True
    )
    fig.suptitle(title, fontsize=10)
    xs = np.arange(len(bs))
    labels = [_tokens(b) for b in bs]
    if 1.0 in gammas:
        top.plot(xs, data[gammas.index(1.0)], marker="o", color="tab:blue",
                 label="pool routing alone (gamma 1.0)")  # fmt: skip
    with np.errstate(all="ignore"):
        best = np.where(np.isnan(data).all(axis=0), np.nan, np.nanmax(
            np.where(np.isnan(data), -np.inf, data), axis=0))  # fmt: skip
    top.plot(xs, best, marker="s", color="tab:green",
             label="with compress-and-route, best gamma")  # fmt: skip
    opt = result.best
    if opt is not None and opt.b_short in bs and opt.savings_vs_homogeneous is not None:
        top.plot([bs.index(opt.b_short)], [opt.savings_vs_homogeneous * 100], marker="*",
                 markersize=15, color="tab:red", linestyle="none",
                 label=f"optimum: B_short {_tokens(opt.b_short)}, gamma {opt.gamma:g}, "
                 f"{opt.gpus} GPUs")  # fmt: skip
    top.axhline(0, color="grey", linewidth=0.8)
    top.set_xticks(xs, labels)
    top.set_xlim(-0.5, len(bs) - 0.5)
    top.set_ylabel("GPU cost savings vs\nhomogeneous fleet (%)")
    top.grid(True, alpha=0.3)
    legend = top.legend(fontsize=8, loc="upper right")

    finite = data[~np.isnan(data)]
    bound = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    image = heat.imshow(np.ma.masked_invalid(data), aspect="auto", origin="lower",
                        cmap="RdYlGn", vmin=-bound, vmax=bound)  # fmt: skip
    for (i, j), v in np.ndenumerate(data):
        heat.text(j, i, "-" if np.isnan(v) else f"{v:.0f}", ha="center", va="center",
                  fontsize=7, color="dimgrey" if np.isnan(v) else "black")  # fmt: skip
    heat.set_xticks(xs, labels)
    heat.set_yticks(np.arange(len(gammas)), [f"{g:g}" for g in gammas])
    heat.set_xlabel("short-pool boundary B_short (tokens)")
    heat.set_ylabel("compression band gamma")
    heat.set_title("savings (%) of each (B_short, gamma); '-': misses the SLO", fontsize=9)
    fig.colorbar(image, ax=heat, label="savings (%)")
    _plot.save(fig, path)
    return [t.get_text() for t in legend.get_texts()]


def verify_plan(result: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """The plan's three fleets verified in the simulator (``routecore
    simulate``'s bisection), on the planned workload at ``--rate`` with
    ``--verify-duration`` seconds of Poisson arrivals of requests drawn from it
    (the planner's assumption) and ``--seed``. Savings are against the
    verified homogeneous fleet when it meets the SLO (``savings_baseline``)."""
    from routecore.commands import simulate as sim

    workload, profile = load_inputs(args)
    if args.fleetopt_assumptions or profile.h_ref_tokens is not None:
        raise ValueError("--verify simulates W + H * n_active: drop --h-ref-tokens and "
                         "--fleetopt-assumptions")  # fmt: skip
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    sim_args = parser.parse_args(
        ["--rate", str(args.rate), "--slo-ttft", str(args.slo_ttft),
         "--slo-tpot", str(args.slo_tpot), "--seed", str(args.seed),
         "--duration", str(args.verify_duration), "--model", args.model]
        + (["--json"] if args.json else [])
    )  # fmt: skip
    n = math.ceil(args.rate * args.verify_duration)
    trace = sim.trace_arrays(workload, n, sim_args.arrivals, args.seed)
    fleets = sim.fleets_from_plan(result, sim_args)
    reports = {}
    for fleet in fleets:
        report = sim.run_fleet(fleet, trace, profile, sim_args)
        reports[fleet.name] = sim.verify_fleet(fleet, trace, profile, sim_args, report)
    baseline, why = sim.savings_baseline(fleets, reports, sim_args)
    out = [sim.fleet_result(f, reports[f.name], profile, baseline, sim_args) for f in fleets]
    return {
        "requests": n,
        "arrivals": sim_args.arrivals,
        "seed": args.seed,
        "savings_baseline": why,
        "fleets": out,
    }


def format_verification(v: dict[str, Any]) -> str:
    lines = [
        f"verified in the simulator ({v['requests']} requests, {v['arrivals']} arrivals, seed "
        f"{v['seed']}): smallest GPU count per pool meeting both SLOs for 99% of its requests",
        f"{'fleet':<14}{'pool':<12}{'binding':>9}{'planned':>8}{'verified':>9}{'SLO':>8}"
        f"{'TTFT p99':>10}{'TPOT p99':>10}",
    ]
    for f in v["fleets"]:
        for p in f["pools"]:
            lines.append(
                f"{f['name']:<14}{p['name']:<12}{p['binding']:>9}{p['gpus_planned']:>8}"
                f"{p['gpus_verified']:>9}{100 * p['slo_attainment']:>7.1f}%"
                f"{p['ttft_p99_s']:>9.3f}s{1000 * p['tpot_p99_s']:>8.1f}ms"
            )
    return "\n".join(lines)


def describe(args: argparse.Namespace, profile: Profile) -> str:
    """What was planned: the workload, the rate, the SLO, the profile and the model."""
    trace = args.trace or "Azure LLM inference trace 2023"
    model = "paper" if args.fleetopt_assumptions else args.model
    tpot = f", TPOT <= {1000 * args.slo_tpot:g} ms" if model == "engine" else ""
    return (
        f"{trace} at {args.rate:g} req/s, P99 TTFT <= {args.slo_ttft:g} s{tpot}, "
        f"{profile.name} (${profile.price_per_gpu_hour:g}/GPU-hour), {model} model"
    )


def run(args: argparse.Namespace) -> int:
    if args.disaggregated:
        return disaggregation.run_plan(args, *load_inputs(args))
    result = run_plan(args)
    verification = verify_plan(result, args) if args.verify else None
    if args.json:
        out = plan_json(result)
        if verification is not None:
            out["verification"] = verification
        print(dumps(out, indent=2))
    else:
        print(describe(args, load_inputs(args)[1]))
        print(format_table(table3_rows(result)))
        print(savings_note(result))
        if verification is not None:
            print()
            print(format_verification(verification))
    if args.plot:
        homogeneous = result.homogeneous
        title = (
            f"FleetOpt (B_short, gamma) sweep at {args.rate:g} req/s, "
            f"P99 TTFT {args.slo_ttft:g} s, {args.profile}"
            + (f"; homogeneous fleet: {homogeneous.gpus} GPUs" if homogeneous is not None else "")
        )
        plot_savings(result, args.plot, title)
    return 0
