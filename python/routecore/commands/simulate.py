"""``routecore simulate``: three fleets side by side in the fleet simulator.

With no arguments: the Azure LLM inference trace 2023 at 1,000 req/s on
Llama-3-70B / A100-80GB, as (1) a homogeneous 64K fleet, (2) token-budget pool
routing and (3) the FleetOpt optimum with compress-and-route, each sized by the
planner and then simulated request by request with routecore's own router in
the loop. Prints a table (or ``--json``), draws ``--plot FILE.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routecore import disaggregation, profiles
from routecore._core import (
    INCOMPRESSIBLE_CATEGORIES,
    EndpointPicker,
    Plan,
    Profile,
    SimPool,
    SimReport,
    Workload,
    plan,
    simulate,
)
from routecore._json import dumps
from routecore.commands import _plot
from routecore.commands._args import (
    add_json,
    add_plot,
    add_profile,
    add_quiet,
    add_seed,
    add_slo,
    band,
    non_negative_int,
    positive_float,
    positive_fraction,
    positive_int,
    proper_fraction,
    token_count,
)
from routecore.planning import fidelity_workload

NAME = "simulate"
HELP = (
    "Simulate a homogeneous fleet, token-budget pool routing and the FleetOpt optimum "
    "with compress-and-route on a trace (default: Azure 2023 at 1,000 req/s, "
    "Llama-3-70B on A100) and compare GPUs, cost, latency and utilization."
)

FLEETS = ("homogeneous", "pool-routing", "fleetopt")
#: The simulated horizon and the share of it left out as warm-up: the
#: planner sizes steady state, which pools of long requests reach only
#: after minutes (see the README's "Fleet verification").
DEFAULT_DURATION_S = 120.0
DEFAULT_WARMUP = 0.2
# True bytes per token of each trace category (token-budget paper, Table 4:
# English prose 4.48, source code 3.52; anything else "mixed", 3.81).
BYTES_PER_TOKEN = {"conversation": 4.48, "code": 3.52}
MIXED_BYTES_PER_TOKEN = 3.81
HOURS_PER_YEAR = 8760.0


@dataclass
class PoolSpec:
    """One pool: its planned size, the size simulated now (``gpus``), the
    resource the planner found binding and the utilization it planned."""

    name: str
    gpus: int
    max_context: int
    slots: int
    binding: str
    utilization_planned: float
    gpus_planned: int = 0

    def __post_init__(self) -> None:
        self.gpus_planned = self.gpus_planned or self.gpus


@dataclass
class FleetSpec:
    name: str
    router: str
    gamma: float
    b_short: int
    pools: list[PoolSpec] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def gpus_planned(self) -> int:
        return sum(p.gpus_planned for p in self.pools)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        default="azure-2023",
        help="'azure-2023' (the shipped trace), one of its categories ('azure-code', "
        "'azure-conversation') or a CSV with ContextTokens and GeneratedTokens columns "
        "(default azure-2023)",
    )
    p.add_argument("--rate", type=positive_float, default=1000.0, help="requests/s (default 1000)")
    p.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="'poisson' (default): a Poisson process at --rate of requests drawn independently "
        "from the trace, the planner's assumption (a fleet's load is the superposition of "
        "many independent users); 'trace': the trace's own timestamps scaled to --rate, its "
        "requests in their order (time-compressed bursts that the planner does not model)",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=DEFAULT_DURATION_S,
        help=f"simulated seconds of arrivals: rate x DURATION requests (default "
        f"{DEFAULT_DURATION_S:g}, with --warmup, long enough for the pools to reach their "
        "steady state)",
    )
    add_profile(p)
    p.add_argument(
        "--fleet",
        action="append",
        choices=FLEETS,
        help="a fleet to simulate (repeat; default all three)",
    )
    p.add_argument(
        "--router",
        choices=("token-budget", "compress-and-route"),
        help="router in front of the two-pool fleets (default: token-budget for "
        "pool-routing, compress-and-route for fleetopt)",
    )
    p.add_argument(
        "--dispatch",
        choices=EndpointPicker.presets(),
        default="least-request",
        help="the endpoint picker inside a pool, an EndpointPicker preset (default least-request)",
    )
    p.add_argument(
        "--b-short", type=token_count, help="short-pool boundary B (default: the planner's)"
    )
    p.add_argument("--gamma", type=band, help="compress-and-route band (default: the planner's)")
    p.add_argument(
        "--compress-code",
        action="store_true",
        help="let compress-and-route compress code too (plan with p_c = 1 for it); by default "
        "code is never compressed, as in FleetOpt section 5.2",
    )
    p.add_argument("--homogeneous-gpus", type=positive_int, help="override the homogeneous size")
    p.add_argument("--short-gpus", type=positive_int, help="override the short pools' size")
    p.add_argument("--long-gpus", type=positive_int, help="override the long pools' size")
    p.add_argument(
        "--rho-max",
        type=positive_fraction,
        help="the paper model's utilization cap (default FleetOpt's 0.85); refused with the "
        "engine model, which sizes by the SLO itself",
    )
    p.add_argument(
        "--model",
        choices=("engine", "paper"),
        default="engine",
        help="the planner's service model: 'engine' (the simulator's engine: iteration time "
        "at the predicted occupancy, shared prefill budget, TPOT constraint; default) or "
        "'paper' (FleetOpt Eq. 3-4)",
    )
    add_slo(p)
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fleet verification (on by default): per pool, bisection with the simulator "
        "to the smallest GPU count whose requests meet the SLO at least --verify-target of "
        "the time, shrinking a pool with room to spare and growing one that misses, up to "
        "--verify-rounds simulations per fleet; the table shows planned and verified GPUs. "
        "--no-verify simulates the planner's sizes as they are",
    )
    p.add_argument(
        "--verify-target", type=positive_fraction, default=0.99, help="per-pool SLO (0.99)"
    )
    p.add_argument(
        "--verify-rounds", type=non_negative_int, default=20, help="simulations at most (20)"
    )
    p.add_argument(
        "--warmup",
        type=proper_fraction,
        default=DEFAULT_WARMUP,
        help=f"leading fraction of the requests left out of the figures (default "
        f"{DEFAULT_WARMUP:g})",
    )
    add_seed(p, "arrival, dispatch and verification seed")
    add_json(p)
    add_plot(p, "the TTFT, TPOT and latency CDFs with the SLOs and the utilization per pool")
    add_quiet(p)
    disaggregation.add_transfer_arguments(p)
    disaggregation.add_simulate_arguments(p)


def load_trace(spec: str) -> Workload:
    if spec == "azure-2023":
        return Workload.azure_2023()
    if spec in ("azure-code", "azure-conversation"):
        return fidelity_workload(spec)
    return Workload.from_csv(spec)


def plan_fleets(w: Workload, profile: Profile, args: argparse.Namespace) -> list[FleetSpec]:
    """The three fleets, sized by the FleetOpt planner (``routecore.plan``) for
    the trace at the rate and the P99 TTFT target: its homogeneous fleet, its
    best pool-routing fleet (gamma = 1) and its optimum over (B_short, gamma)
    with compress-and-route. ``--b-short`` / ``--gamma`` restrict the sweep;
    the ``--*-gpus`` flags override sizes. Pools the plan gives 0 GPUs are left
    out."""
    p_c_by_category = (
        {c: 1.0 for c in w.category_names or [] if c in INCOMPRESSIBLE_CATEGORIES}
        if args.compress_code
        else None
    )
    result = plan(
        w, args.rate, args.slo_ttft, profile,
        b_short=[args.b_short] if args.b_short else None,
        gammas=sorted({1.0, args.gamma}) if args.gamma else None,
        p_c_by_category=p_c_by_category, rho_max=args.rho_max,
        model=args.model, slo_tpot_s=args.slo_tpot if args.model == "engine" else None,
    )  # fmt: skip
    return fleets_from_plan(result, args)


def fleets_from_plan(result: Plan, args: argparse.Namespace) -> list[FleetSpec]:
    """The fleets ``args.fleet`` (default all three) of a plan, with the
    ``--*-gpus`` overrides."""
    chosen = {
        "homogeneous": result.homogeneous,
        "pool-routing": result.pool_routing,
        "fleetopt": result.best,
    }
    fleets = []
    for name in args.fleet or FLEETS:
        c = chosen[name]
        if c is None:
            raise ValueError(f"the planner found no feasible {name} fleet; relax --slo-ttft")
        pools = [
            PoolSpec("short", args.short_gpus or c.n_short, c.context_short, c.slots_short,
                     c.binding_short, c.utilization_short, c.n_short),
            PoolSpec("long", args.long_gpus or c.n_long, c.context_long, c.slots_long,
                     c.binding_long, c.utilization_long, c.n_long),
        ]  # fmt: skip
        if name == "homogeneous":
            pools = [pools[1]]
            pools[0].name = "homogeneous"
            pools[0].gpus = args.homogeneous_gpus or pools[0].gpus
            router = "homogeneous"
        else:
            pools = [p for p in pools if p.gpus > 0]
            router = args.router or ("compress-and-route" if c.gamma > 1 else "token-budget")
        fleets.append(FleetSpec(name, router, c.gamma, c.b_short, pools))
    return fleets


class Progress:
    """Progress of one simulation on stderr: on a terminal a bar redrawn in
    place; otherwise (a log file, a pipe) a plain line at each quarter done."""

    #: The steps of the plain lines, in percent.
    STEP = 25

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.terminal = sys.stderr.isatty()
        self.shown = 0  # the last step written as a plain line

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = min(done / total, 1.0) if total else 1.0
        if self.terminal:
            bar = "#" * int(30 * frac)
            print(f"\r{self.label:<14} [{bar:<30}] {100 * frac:5.1f}%", end="", file=sys.stderr)
            if done >= total:
                print(file=sys.stderr)
            return
        step = int(100 * frac) // self.STEP * self.STEP
        if step > self.shown:
            self.shown = step
            print(f"{self.label:<14} {step:3d}% of {total} requests", file=sys.stderr)


@dataclass
class Trace:
    """The requests to simulate, as arrays: arrival times (None: Poisson), input
    and output tokens, category index per request, and the category names."""

    arrival_s: np.ndarray | None
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    category: np.ndarray
    names: list[str]


def trace_arrays(w: Workload, n: int, arrivals: str = "trace", seed: int = 0) -> Trace:
    """``n`` requests of the workload. ``arrivals="poisson"`` (or a workload
    without timestamps): drawn independently by weight (``Workload.sample``,
    seeded), to arrive as a Poisson process. ``"trace"``: the first ``n`` in
    the trace's order with its timestamps, the trace repeated end to end when
    ``n`` is larger (each copy shifted by the trace's span plus one mean gap,
    so the arrival pattern repeats). Outputs of 0 tokens count as 1."""
    if arrivals == "poisson" or w.arrival_s is None:
        w = w.sample(n, seed)
    copies = -(-n // len(w))
    names = w.category_names or ["default"]
    if w.categories is None:
        cat = np.zeros(len(w), dtype=np.int64)
    else:
        index = {c: i for i, c in enumerate(names)}
        cat = np.array([index[c] for c in w.categories], dtype=np.int64)
    arrival = w.arrival_s
    if arrival is not None:
        span = float(arrival[-1] - arrival[0])
        period = span + span / max(len(w) - 1, 1)
        arrival = np.concatenate([arrival + k * period for k in range(copies)])[:n]
    return Trace(
        arrival,
        np.tile(w.input_tokens, copies)[:n],
        np.maximum(np.tile(w.output_tokens, copies)[:n], 1),
        np.tile(cat, copies)[:n],
        names,
    )


def run_fleet(
    fleet: FleetSpec, trace: Trace, profile: Profile, args: argparse.Namespace
) -> SimReport:
    categories = [
        (
            c,
            BYTES_PER_TOKEN.get(c, MIXED_BYTES_PER_TOKEN),
            args.compress_code or c not in INCOMPRESSIBLE_CATEGORIES,
        )
        for c in trace.names
    ]
    arrivals = args.arrivals if trace.arrival_s is not None else "poisson"
    arrival = trace.arrival_s if trace.arrival_s is not None else np.zeros(trace.category.size)
    pools = [
        SimPool(
            p.name,
            p.gpus,
            p.max_context,
            p.slots,
            chunk=profile.c_chunk,
            w=profile.w_s,
            h=profile.h_s,
            budget=p.max_context,
        )  # fmt: skip
        for p in fleet.pools
    ]
    return simulate(
        arrival, trace.input_tokens, trace.output_tokens, pools, category=trace.category,
        categories=categories, router=fleet.router, gamma=fleet.gamma, dispatch=args.dispatch,
        arrivals=arrivals, rate=args.rate, seed=args.seed, warmup=args.warmup,
        progress=Progress(fleet.name, not args.quiet),
    )  # fmt: skip


def slo_met(report: SimReport, args: argparse.Namespace) -> np.ndarray:
    """Per request: served with TTFT and TPOT (if any) within the SLO."""
    return (report.ttft <= args.slo_ttft) & ~(report.tpot > args.slo_tpot)


def pool_attainment(report: SimReport, args: argparse.Namespace) -> list[float]:
    """Per pool: the share of its measured requests meeting both SLOs (1.0
    for a pool that served none)."""
    ok = slo_met(report, args)
    out = []
    for i in range(len(report.pools)):
        mine = report.measured & (report.pool == i)
        out.append(float(ok[mine].mean()) if mine.any() else 1.0)
    return out


@dataclass
class Bisection:
    """The search for one pool's smallest GPU count meeting the SLO: ``bad``
    is the largest count seen missing it (0 GPUs always miss), ``ok`` the
    smallest seen meeting it (None until one does). Probes gallop away from
    the planned size (steps of 3 %, at least one GPU, doubling) until the
    answer is bracketed, then bisect."""

    planned: int
    bad: int = 0
    ok: int | None = None
    step: int = 0

    def record(self, gpus: int, meets: bool) -> None:
        if meets:
            self.ok = gpus if self.ok is None else min(self.ok, gpus)
        else:
            self.bad = max(self.bad, gpus)
            if self.ok is not None and self.ok <= self.bad:
                # Seen meeting it beside the other pools' probes, missing it
                # now: the search goes on above (see ``verify_fleet``).
                self.ok, self.step = None, 0

    @property
    def done(self) -> bool:
        return self.ok is not None and self.ok - self.bad <= 1

    def next_probe(self) -> int:
        self.step = max(1, math.ceil(0.03 * self.planned)) if not self.step else 2 * self.step
        if self.ok is None:
            return self.bad + self.step
        if self.bad == 0 and self.ok - self.step > 0:
            return self.ok - self.step
        return (self.bad + self.ok) // 2


def verify_fleet(
    fleet: FleetSpec, trace: Trace, profile: Profile, args: argparse.Namespace, report: SimReport
) -> SimReport:
    """Fleet verification: per pool, the smallest GPU count whose measured
    requests meet both SLOs at least ``--verify-target`` of the time, by
    bisection with the simulator (``Bisection``), shrinking pools with room to
    spare and growing pools that miss. The pools of a fleet share no requests
    under its router (no spillover), so one simulation per round probes every
    pool still searching. But they are not quite independent: the router's
    calibrator learns from completions in both, so resizing one pool routes a
    few borderline requests differently and reshuffles the other's endpoints
    (issue 27: the LMSYS long pool at 36 GPUs met the SLO beside a short pool
    of 80, 98.97 % beside 82). So the verified sizes are run together once
    more, and a pool that misses there goes on searching above. Stops after
    ``--verify-rounds`` simulations; a pool never seen meeting the SLO keeps
    its last size. Returns the report at the verified sizes; ``gpus_planned``
    keeps the plan's."""
    searches = [Bisection(p.gpus) for p in fleet.pools]
    for round_ in range(1, args.verify_rounds + 1):
        for s, pool, att in zip(searches, fleet.pools, pool_attainment(report, args)):
            s.record(pool.gpus, att >= args.verify_target)
        if all(s.done for s in searches):
            if all(s.ok == pool.gpus for s, pool in zip(searches, fleet.pools)):
                break  # every pool met it at its verified size in this run
            for s, pool in zip(searches, fleet.pools):
                pool.gpus = s.ok if s.ok is not None else pool.gpus
        for s, pool in zip(searches, fleet.pools):
            if not s.done:
                pool.gpus = s.next_probe()
        if not args.quiet:
            sizes = ", ".join(f"{p.name} {p.gpus}" for p in fleet.pools)
            print(f"verify {fleet.name}: round {round_}: {sizes}", file=sys.stderr)
        report = run_fleet(fleet, trace, profile, args)
    final = [s.ok if s.ok is not None else p.gpus for s, p in zip(searches, fleet.pools)]
    if final != [p.gpus for p in fleet.pools]:
        for pool, gpus in zip(fleet.pools, final):
            pool.gpus = gpus
        report = run_fleet(fleet, trace, profile, args)
    return report


def pool_latency(report: SimReport, i: int, metric: str) -> float:
    """P99 of ``metric`` over pool ``i``'s measured requests (NaN if none)."""
    xs = getattr(report, metric)[report.measured & (report.pool == i)]
    xs = xs[np.isfinite(xs)]
    return float(np.percentile(xs, 99)) if xs.size else float("nan")


def savings_baseline(
    fleets: list[FleetSpec], reports: dict[str, SimReport], args: argparse.Namespace
) -> tuple[int | None, str]:
    """The homogeneous fleet's GPUs, the baseline of the savings, when it
    meets the SLO (every pool's requests within both SLOs at least
    ``--verify-target`` of the time); else None. With the reason either way."""
    homo = next((f for f in fleets if f.name == "homogeneous"), None)
    if homo is None:
        return None, "savings not computed: no homogeneous fleet simulated (--fleet homogeneous)"
    att = min(pool_attainment(reports[homo.name], args))
    if att < args.verify_target:
        return None, (
            f"savings not computed: the homogeneous fleet of {homo.gpus} GPUs misses the SLO "
            f"({100 * att:.1f}% of its requests within it, {100 * args.verify_target:g}% needed)"
        )
    return homo.gpus, f"savings against the homogeneous fleet of {homo.gpus} GPUs (meets the SLO)"


def fleet_result(
    fleet: FleetSpec,
    report: SimReport,
    profile: Profile,
    baseline_gpus: int | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One fleet's figures; ``savings_vs_homogeneous`` is None without a
    baseline (``savings_baseline``)."""
    s = report.summary()
    ok = slo_met(report, args)[report.measured]
    attainment = pool_attainment(report, args)
    pools = []
    for i, (spec, sim) in enumerate(zip(fleet.pools, report.pools)):
        pools.append(
            {
                "name": spec.name,
                "gpus": spec.gpus,
                "gpus_planned": spec.gpus_planned,
                "gpus_verified": spec.gpus,
                "binding": spec.binding,
                "max_context": spec.max_context,
                "slots": spec.slots,
                "requests": sim["requests"],
                "slo_attainment": attainment[i],
                "ttft_p99_s": pool_latency(report, i, "ttft"),
                "tpot_p99_s": pool_latency(report, i, "tpot"),
                "utilization_planned": spec.utilization_planned,
                "utilization_model": sim["utilization_model"],
                "utilization_simulated": sim["utilization_simulated"],
                "prefill_utilization_model": sim["prefill_utilization_model"],
                "prefill_utilization_simulated": sim["prefill_utilization_simulated"],
                "preemptions": sim["preemptions"],
                "rejections": sim["rejections"],
                "compressed": sim["compressed"],
            }
        )
    cost = fleet.gpus * profile.price_per_gpu_hour * HOURS_PER_YEAR
    savings = 1.0 - fleet.gpus / baseline_gpus if baseline_gpus else None
    return {
        "name": fleet.name,
        "router": fleet.router,
        "gamma": fleet.gamma,
        "b_short": fleet.b_short,
        "gpus": fleet.gpus,
        "gpus_planned": fleet.gpus_planned,
        "gpus_verified": fleet.gpus,
        "annual_cost_usd": cost,
        "savings_vs_homogeneous": savings,
        "ttft_p50_s": s["ttft"]["p50"],
        "ttft_p99_s": s["ttft"]["p99"],
        "tpot_p50_s": s["tpot"]["p50"],
        "tpot_p99_s": s["tpot"]["p99"],
        "slo_attainment": float(ok.mean()) if ok.size else float("nan"),
        "router_rejections": report.router_rejections,
        "pools": pools,
    }


def percent(x: float | None) -> str:
    """A share as a percentage, 'n/a' for None."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['trace']}: {result['requests']} requests at {result['rate']:g} req/s "
        f"({result['arrivals']} arrivals, {result['duration_s']:g} s, the first "
        f"{100 * result['warmup']:g}% left out), {result['profile']}, SLO TTFT <= "
        f"{result['slo_ttft_s']:g} s and TPOT <= {1000 * result['slo_tpot_s']:g} ms"
    )
    head = (
        f"{'fleet':<13}{'planned':>8}{'GPUs':>6}{'cost $/yr':>13}{'savings':>9}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'SLO':>8}{'preempt':>9}"
    )
    print(head)
    for f in result["fleets"]:
        print(
            f"{f['name']:<13}{f['gpus_planned']:>8}{f['gpus']:>6}{f['annual_cost_usd']:>13,.0f}"
            f"{percent(f['savings_vs_homogeneous']):>9}{f['ttft_p50_s']:>9.3f}s"
            f"{f['ttft_p99_s']:>9.3f}s{1000 * f['tpot_p50_s']:>8.1f}ms"
            f"{1000 * f['tpot_p99_s']:>8.1f}ms{100 * f['slo_attainment']:>7.1f}%"
            f"{sum(p['preemptions'] for p in f['pools']):>9}"
        )
    print(result["savings_baseline"])
    print()
    print(
        f"{'fleet':<13}{'pool':<12}{'planned':>8}{'verified':>9}{'binding':>9}{'SLO':>8}"
        f"{'TTFT p99':>10}{'TPOT p99':>10}{'util plan':>10}{'model':>7}{'sim':>7}"
        f"{'prefill model':>14}{'sim':>6}{'preempt':>8}"
    )
    for f in result["fleets"]:
        for p in f["pools"]:
            print(
                f"{f['name']:<13}{p['name']:<12}{p['gpus_planned']:>8}{p['gpus_verified']:>9}"
                f"{p['binding']:>9}{100 * p['slo_attainment']:>7.1f}%{p['ttft_p99_s']:>9.3f}s"
                f"{1000 * p['tpot_p99_s']:>8.1f}ms{p['utilization_planned']:>10.3f}"
                f"{p['utilization_model']:>7.3f}{p['utilization_simulated']:>7.3f}"
                f"{p['prefill_utilization_model']:>14.3f}{p['prefill_utilization_simulated']:>6.3f}"
                f"{p['preemptions']:>8}"
            )
    v = result["verification"]
    print(
        "\nutilization: share of slot-time held (sequences holding a slot / slots), one "
        "definition:\n'util plan' at the planned size, 'model' the planner's engine model "
        "at the simulated size and\nmeasured rate, 'sim' measured; 'prefill': prompt tokens "
        "over the prefill budget (C_chunk per iteration)."
    )
    if v["enabled"]:
        print(
            f"verified by bisection with the simulator: {v['requests']} requests, seed "
            f"{v['seed']}, target {100 * v['target']:g}% of a pool's requests within both SLOs"
        )


def plot(result: dict[str, Any], reports: dict[str, SimReport], path: str) -> None:
    """One PNG of four panels: the CDFs of TTFT, TPOT and end-to-end latency
    per fleet (the SLOs as lines) and each pool's utilization, engine model
    beside simulated. The fleets' legend is under the panels, off the data."""
    fig, (ttft, tpot, e2e, util) = _plot.figure(
        f"routecore simulate: {result['trace']} at {result['rate']:g} req/s, "
        f"{result['requests']:,} requests, {result['profile']}",
        4,
        (11, 8.4),
    )
    for i, (name, rep) in enumerate(reports.items()):
        _plot.cdf(ttft, rep.ttft[rep.measured], name, i)
        _plot.cdf(tpot, 1000 * rep.tpot[rep.measured], name, i)
        _plot.cdf(e2e, rep.e2e[rep.measured], name, i)
    slo_ttft_s, slo_tpot_ms = result["slo_ttft_s"], 1000 * result["slo_tpot_s"]
    _plot.target_line(ttft, slo_ttft_s, f"SLO (TTFT {slo_ttft_s:g} s, TPOT {slo_tpot_ms:g} ms)",
                      vertical=True)  # fmt: skip
    _plot.target_line(tpot, slo_tpot_ms, "", vertical=True)
    for ax, title, unit in [
        (ttft, "time to first token", "TTFT (s, log scale)"),
        (tpot, "time per output token", "TPOT (ms)"),
        (e2e, "end-to-end latency", "latency (s, log scale)"),
    ]:
        ax.set_title(title)
        ax.set_xlabel(unit)
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    _plot.plain_log_axis(ttft.xaxis)
    _plot.plain_log_axis(e2e.xaxis)
    handles, labels = ttft.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=9)
    pools = [(f["name"], p) for f in result["fleets"] for p in f["pools"]]
    _plot.bars(util, [p["utilization_model"] for _, p in pools], "%.2f", offset=-0.2,
               width=0.4, missing="∞", label="engine model (∞: saturated in the model)",
               color="tab:gray")  # fmt: skip
    _plot.bars(util, [p["utilization_simulated"] for _, p in pools], "%.2f", offset=0.2,
               width=0.4, label="simulated", color="tab:purple")  # fmt: skip
    _plot.categories(util, [f"{fleet} {p['name']}" if fleet != p["name"] else fleet
                            for fleet, p in pools])  # fmt: skip
    util.set_title("utilization per pool (slot-time held / slots)")
    util.set_xlabel("utilization")
    util.set_xlim(0, 1.25)
    util.set_xticks(np.arange(0, 1.01, 0.2))
    # Under the axis, off the bars and their labels (any bar may reach the
    # right side of the panel).
    util.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)
    _plot.save(fig, path)


def run(args: argparse.Namespace) -> int:
    w = load_trace(args.trace)
    profile = profiles.resolve(args.profile)
    if profile.h_ref_tokens is not None:
        raise ValueError(
            "the simulator's timing model is t_iter = W + H * n_active; profiles with "
            "h_ref_tokens (length-scaled H) are not supported"
        )
    if not (args.duration > 0 and args.rate > 0):
        raise ValueError("--duration and --rate must be > 0")
    n = math.ceil(args.rate * args.duration)
    trace = trace_arrays(w, n, args.arrivals, args.seed)
    if args.disaggregated:
        return disaggregation.compare(args, w, profile, trace)
    fleets = plan_fleets(w, profile, args)
    reports: dict[str, SimReport] = {}
    for fleet in fleets:
        reports[fleet.name] = run_fleet(fleet, trace, profile, args)
        if args.verify:
            reports[fleet.name] = verify_fleet(fleet, trace, profile, args, reports[fleet.name])
    baseline, why = savings_baseline(fleets, reports, args)
    results = [fleet_result(f, reports[f.name], profile, baseline, args) for f in fleets]
    result = {
        "trace": args.trace,
        "arrivals": args.arrivals,
        "requests": n,
        "duration_s": args.duration,
        "warmup": args.warmup,
        "rate": args.rate,
        "profile": profile.name,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "model": args.model,
        "verification": {
            "enabled": bool(args.verify),
            "requests": n,
            "seed": args.seed,
            "target": args.verify_target,
        },
        "savings_baseline": why,
        "fleets": results,
    }
    if args.json:
        print(dumps(result))
    else:
        print_table(result)
    if args.plot:
        plot(result, reports, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
