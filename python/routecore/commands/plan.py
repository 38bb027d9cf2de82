"""``routecore plan``: the cheapest fleet for a workload and a P99 TTFT target."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from routecore._core import Candidate, Plan, Profile, Workload, plan
from routecore._extras import pyplot
from routecore.commands._args import fraction, positive_float, random_seed, token_count
from routecore.planning import fleetopt_profile, fleetopt_workload, table3_rows
from routecore.profiles import PRESETS, load_profile

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
    p.add_argument("--slo-ms", type=positive_float, default=500.0, help="P99 TTFT target, ms (500)")
    p.add_argument(
        "--profile",
        default="llama3_70b_a100",
        help=f"preset ({', '.join(PRESETS)}) or a TOML file (default llama3_70b_a100)",
    )
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
        "--slo-tpot-ms",
        type=positive_float,
        default=80.0,
        help="TPOT target, ms (80; engine model and --verify)",
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
    p.add_argument("--seed", type=random_seed, default=42, help="verification seed (42)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw savings against B_short")


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
    if args.profile in PRESETS:
        profile = PRESETS[args.profile]()
    else:
        profile = load_profile(args.profile)
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
        args.slo_ms / 1000.0,
        profile,
        b_short=args.b_short,
        p_c=args.p_c,
        p_c_by_category=dict(args.p_c_category or []),
        phi=args.phi,
        long_context=args.long_context,
        model="paper" if args.fleetopt_assumptions else args.model,
        slo_tpot_s=args.slo_tpot_ms / 1000.0,
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
            f"{c.annual_cost_usd / 1e3:>10,.0f} {c.savings_vs_homogeneous:>7.1%} {ttft:>15} "
            f"{binding:>17}{flag}"
        )
    return "\n".join(lines)


def plan_json(result: Plan) -> dict[str, Any]:
    def d(c: Candidate | None) -> dict[str, Any] | None:
        return None if c is None else c.as_dict()

    return {
        "homogeneous": d(result.homogeneous),
        "pool_routing": d(result.pool_routing),
        "best": d(result.best),
        "table": {name: d(c) for name, c in table3_rows(result)},
        "sweep": [c.as_dict() for c in result.sweep],
    }


def plot_savings(result: Plan, path: str) -> None:
    """Savings against B_short per gamma (FleetOpt Figure 6), to a PNG."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gammas = sorted({c.gamma for c in result.sweep})
    colors = plt.get_cmap("viridis")
    for i, g in enumerate(gammas):
        pts = [(c.b_short, c.savings_vs_homogeneous * 100) for c in result.sweep if c.gamma == g]
        ok = [(c.b_short, c.feasible) for c in result.sweep if c.gamma == g]
        xs = [b for (b, _), (_, f) in zip(pts, ok) if f]
        ys = [s for (_, s), (_, f) in zip(pts, ok) if f]
        if xs:
            color = colors(i / max(1, len(gammas) - 1))
            ax.plot(xs, ys, marker="o", color=color, label=f"gamma {g:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B_short (tokens)")
    ax.set_ylabel("GPU cost savings vs homogeneous (%)")
    ax.set_title("Savings against B_short (feasible fleets)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verify_plan(result: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """The plan's three fleets verified in the simulator (``routecore
    simulate``'s bisection), on the planned workload at ``--rate`` with
    ``--verify-duration`` seconds of arrivals (the trace's own timestamps when
    it has them, else Poisson) and ``--seed``."""
    from routecore.commands import simulate as sim

    workload, profile = load_inputs(args)
    if args.fleetopt_assumptions or profile.h_ref_tokens is not None:
        raise ValueError("--verify simulates W + H * n_active: drop --h-ref-tokens and "
                         "--fleetopt-assumptions")  # fmt: skip
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    sim_args = parser.parse_args(
        ["--rate", str(args.rate), "--slo-ttft", str(args.slo_ms / 1000.0),
         "--slo-tpot", str(args.slo_tpot_ms / 1000.0), "--seed", str(args.seed),
         "--duration", str(args.verify_duration), "--model", args.model]
        + (["--json"] if args.json else [])
    )  # fmt: skip
    n = math.ceil(args.rate * args.verify_duration)
    trace = sim.trace_arrays(workload, n)
    fleets = sim.fleets_from_plan(result, sim_args)
    out = []
    for fleet in fleets:
        report = sim.run_fleet(fleet, trace, profile, sim_args)
        report = sim.verify_fleet(fleet, trace, profile, sim_args, report)
        out.append(sim.fleet_result(fleet, report, profile, None, sim_args))
    return {"requests": n, "seed": args.seed, "fleets": out}


def format_verification(v: dict[str, Any]) -> str:
    lines = [
        f"verified in the simulator ({v['requests']} requests, seed {v['seed']}): "
        "smallest GPU count per pool meeting both SLOs for 99% of its requests",
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


def run(args: argparse.Namespace) -> int:
    result = run_plan(args)
    verification = verify_plan(result, args) if args.verify else None
    if args.json:
        out = plan_json(result)
        if verification is not None:
            out["verification"] = verification
        print(json.dumps(out, indent=2))
    else:
        print(format_table(table3_rows(result)))
        if verification is not None:
            print()
            print(format_verification(verification))
    if args.plot:
        plot_savings(result, args.plot)
    return 0
