"""Prefill/decode disaggregation in the planner and the simulator (issue 25,
planning): ``routecore plan --disaggregated`` and ``routecore simulate
--disaggregated``.

``plan_disaggregated`` sizes a fleet of ``prefill`` and ``decode`` endpoints
(the roles' words are the router's: ``prefill``, ``decode``, ``both``) beside
the aggregated fleet of ``both`` endpoints (docs/planner.md, "Disaggregated
fleets"). ``simulate_disaggregated`` runs prefill and decode endpoints as
separate resources with a decider (``always``, ``never``, ``conditional``)
and the KV transfer as a delay; this module sizes each pool of a planned
fleet by bisection with it (``verify``), as ``routecore simulate`` does for
aggregated fleets, and compares the aggregated, pool-routed, disaggregated
and conditional fleets on one trace (``compare``).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from routecore._core import (
    DisaggPlan,
    DisaggReport,
    Profile,
    SimPool,
    Workload,
    plan_disaggregated,
    simulate_disaggregated,
)
from routecore._json import dumps
from routecore.commands._args import non_negative_float, positive_float, token_count

if TYPE_CHECKING:
    from routecore.commands.simulate import Trace

#: The deciders of the simulator (and of the router's picker, pd-route).
DECIDERS = ("always", "never", "conditional")
#: The conditional decider's default: split prompts of more uncached tokens.
DEFAULT_THRESHOLD = 2048
#: Every endpoint's context window in a planned or simulated P/D fleet.
DEFAULT_CONTEXT = 65536
#: The default link per GPU: 25 GB/s (one 200 Gb/s NIC).
DEFAULT_BANDWIDTH_GBS = 25.0
DEFAULT_LATENCY_S = 0.002
#: A pool's verification search stops at this many times its planned size.
MAX_VERIFY_FACTOR = 4


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    """``--disaggregated`` and the KV transfer's flags (``plan`` and ``simulate``)."""
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--disaggregated",
        action="store_true",
        help="plan (or simulate) a fleet of prefill and decode endpoints beside the "
        "aggregated one (see docs/planner.md, 'Disaggregated fleets')",
    )
    g.add_argument(
        "--kv-bandwidth",
        type=positive_float,
        default=DEFAULT_BANDWIDTH_GBS,
        metavar="GB/S",
        help=f"KV transfer link per GPU, GB/s (default {DEFAULT_BANDWIDTH_GBS:g})",
    )
    g.add_argument(
        "--kv-latency",
        type=non_negative_float,
        default=DEFAULT_LATENCY_S,
        metavar="SECONDS",
        help=f"fixed cost of one KV transfer, seconds (default {DEFAULT_LATENCY_S:g})",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=non_negative_float,
        help="KV bytes sent per prompt token (default: the profile's per GPU)",
    )


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """``simulate --disaggregated``'s own flags, beside ``add_transfer_arguments``."""
    g = p.add_argument_group("simulated prefill/decode fleets (with --disaggregated)")
    g.add_argument(
        "--decider",
        action="append",
        choices=DECIDERS,
        help="the decider of a simulated P/D fleet (repeat; default all three: 'never' "
        "is the aggregated fleet)",
    )
    g.add_argument(
        "--threshold",
        type=token_count,
        default=DEFAULT_THRESHOLD,
        help=f"the conditional decider's uncached prompt tokens (default {DEFAULT_THRESHOLD})",
    )
    g.add_argument(
        "--prefill-gpus",
        type=int,
        help="override the planned prefill pool (0: none, refused unless the decider is never)",
    )
    g.add_argument("--decode-gpus", type=int, help="override the planned decode pool")


def transfer(args: argparse.Namespace, profile: Profile) -> dict[str, float]:
    """The transfer's keyword arguments from the flags."""
    return {
        "bytes_per_token": profile.kv_bytes_per_token_per_gpu
        if args.kv_bytes_per_token is None
        else args.kv_bytes_per_token,
        "bandwidth_bytes_s": args.kv_bandwidth * 1e9,
        "latency_s": args.kv_latency,
    }


def plan(w: Workload, profile: Profile, args: argparse.Namespace, context: int) -> DisaggPlan:
    """``plan_disaggregated`` with the command line's rate, SLO and link."""
    return plan_disaggregated(
        w, args.rate, args.slo_ttft, profile, slo_tpot_s=args.slo_tpot, context=context,
        **transfer(args, profile),
    )  # fmt: skip


def plan_rows(d: DisaggPlan) -> list[tuple[str, int, str, float, float, float, bool]]:
    """(pool, GPUs, binding, t_iter s, P99 TTFT s, utilization, feasible) per pool."""
    return [
        ("prefill", d.n_prefill, d.binding_prefill, d.t_iter_prefill_s, d.p99_ttft_prefill_s,
         d.prefill_utilization_prefill, d.feasible_prefill),
        ("decode", d.n_decode, d.binding_decode, d.t_iter_decode_s, d.p99_ttft_decode_s,
         d.utilization_decode, d.feasible_decode),
        ("aggregated (both)", d.n_aggregated, d.binding_aggregated, d.t_iter_aggregated_s,
         d.p99_ttft_aggregated_s, d.utilization_aggregated, d.feasible_aggregated),
    ]  # fmt: skip


def verdict(d: DisaggPlan) -> str:
    """Which fleet is cheaper, and by how much."""
    if not d.feasible and not d.feasible_aggregated:
        return "neither fleet meets the SLO"
    if d.choice == "aggregated":
        if not d.feasible:
            return f"aggregated: the disaggregated fleet misses the SLO ({d.n_aggregated} GPUs)"
        return f"aggregated is cheaper: {d.n_aggregated} GPUs against {d.gpus} disaggregated"
    if not d.feasible_aggregated:
        return f"disaggregated: the aggregated fleet misses the SLO ({d.gpus} GPUs)"
    return (
        f"disaggregated is cheaper: {d.gpus} GPUs ({d.n_prefill} prefill + {d.n_decode} "
        f"decode) against {d.n_aggregated} aggregated, {1 - d.gpus / d.n_aggregated:.1%} saved"
    )


def format_plan(d: DisaggPlan, header: str) -> str:
    head = f"{'pool':<18} {'GPUs':>6} {'binding':>8} {'t_iter ms':>9} {'TTFT99 ms':>9} {'util':>6}"
    lines = [header, head, "-" * len(head)]
    for name, gpus, binding, t, ttft, util, feasible in plan_rows(d):
        flag = "" if feasible else "  (misses the SLO)"
        lines.append(
            f"{name:<18} {gpus:>6} {binding:>8} {t * 1e3:>9.1f} {ttft * 1e3:>9.0f} {util:>6.1%}"
            f"{flag}"
        )
    lines.append(
        f"KV transfer of the P{50 * (1 + 0.99):g} prompt {d.transfer_q_s * 1e3:.1f} ms; "
        "prefill's TTFT99 is the whole request's (its waits and prefill, the transfer and "
        "the decode side), decode's its side (slot wait and first step)"
    )
    lines.append(verdict(d))
    return "\n".join(lines)


def run_plan(args: argparse.Namespace, w: Workload, profile: Profile) -> int:
    """``routecore plan --disaggregated``."""
    if args.verify:
        raise ValueError(
            "--verify does not apply to --disaggregated: `routecore simulate --disaggregated` "
            "sizes each pool by bisection"
        )
    d = plan(w, profile, args, args.long_context)
    if args.json:
        print(
            dumps(
                {
                    "trace": args.trace or "azure-2023",
                    "rate": args.rate,
                    "slo_ttft_s": args.slo_ttft,
                    "slo_tpot_s": args.slo_tpot,
                    "profile": profile.name,
                    "transfer": transfer(args, profile),
                    "plan": d.as_dict(),
                    "verdict": verdict(d),
                }
            )
        )
    else:
        header = (
            f"{args.trace or 'azure-2023'} at {args.rate:g} req/s, P99 TTFT <= "
            f"{args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s, {profile.name}, context "
            f"{args.long_context}, KV link {args.kv_bandwidth:g} GB/s + {args.kv_latency:g} s"
        )
        print(format_plan(d, header))
    return 0


@dataclass
class Fleet:
    """A simulated P/D fleet: its pools' GPUs (prefill 0: none), the decider."""

    name: str
    decider: str
    prefill: int
    decode: int
    prefill_planned: int
    decode_planned: int

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode


def simulate(
    fleet: Fleet, trace: Trace, profile: Profile, args: argparse.Namespace, slots: int
) -> DisaggReport:
    """One run of ``fleet`` on ``trace``."""

    def pool(name: str, n: int) -> SimPool:
        return SimPool(name, n, DEFAULT_CONTEXT, slots, chunk=profile.c_chunk, w=profile.w_s,
                       h=profile.h_s)  # fmt: skip

    prefill = pool("prefill", fleet.prefill) if fleet.prefill > 0 else None
    if fleet.prefill < 0:
        raise ValueError(f"--prefill-gpus must be >= 0, got {fleet.prefill}")
    arrival = trace.arrival_s if trace.arrival_s is not None else np.zeros(trace.input_tokens.size)
    return simulate_disaggregated(
        arrival, trace.input_tokens, trace.output_tokens, pool("decode", fleet.decode), prefill,
        decider=fleet.decider, threshold=args.threshold, **transfer(args, profile),
        arrivals="trace" if trace.arrival_s is not None else "poisson", rate=args.rate,
        seed=args.seed, warmup=args.warmup,
    )  # fmt: skip


def attainment(report: DisaggReport, args: argparse.Namespace) -> float:
    """The share of measured requests within both SLOs."""
    ok = (report.ttft <= args.slo_ttft) & ~(report.tpot > args.slo_tpot)
    m = report.measured
    return float(ok[m].mean()) if m.any() else 1.0


def verify(
    fleet: Fleet, trace: Trace, profile: Profile, args: argparse.Namespace, slots: int
) -> DisaggReport:
    """Per pool, the smallest GPU count with which the fleet's measured
    requests meet both SLOs at least ``--verify-target`` of the time: by
    bisection with the simulator (``routecore.commands.simulate.Bisection``:
    gallop from the plan by 3 %, then bisect), at most ``--verify-rounds``
    runs per pool, one pool at a time: decode first (prefill at its planned
    size), then prefill (decode at the size found), then decode again if it
    never met the SLO the first time. A search that reaches
    ``MAX_VERIFY_FACTOR`` times its plan stops there (the other pool binds).
    Returns the run at the sizes found."""
    from routecore.commands.simulate import Bisection

    order = ["decode", "prefill", "decode"] if fleet.prefill > 0 else ["decode"]
    met: dict[str, bool] = {}
    for name in order:
        if met.get(name):
            continue
        planned = getattr(fleet, name)
        search = Bisection(planned)
        gpus, cap = planned, MAX_VERIFY_FACTOR * planned + 1
        for round_ in range(args.verify_rounds + 1):
            setattr(fleet, name, gpus)
            meets = attainment(simulate(fleet, trace, profile, args, slots), args)
            search.record(gpus, meets >= args.verify_target)
            if search.done or round_ == args.verify_rounds:
                break
            gpus = search.next_probe()
            if gpus > cap:
                break
            if not args.quiet:
                print(f"verify {fleet.name}: {name} {gpus}", file=sys.stderr)
        met[name] = search.ok is not None
        setattr(fleet, name, search.ok if search.ok is not None else planned)
    return simulate(fleet, trace, profile, args, slots)


def fleet_row(fleet: Fleet, report: DisaggReport, args: argparse.Namespace) -> dict[str, Any]:
    s = report.summary()
    m = report.measured
    sizes = [(n, g, gp) for n, g, gp in (
        ("prefill", fleet.prefill, fleet.prefill_planned),
        ("decode" if fleet.decider != "never" else "both", fleet.decode, fleet.decode_planned),
    ) if g > 0]  # fmt: skip
    return {
        "name": fleet.name,
        "decider": fleet.decider,
        "gpus": fleet.gpus,
        "gpus_planned": fleet.prefill_planned + fleet.decode_planned,
        "ttft_p50_s": s["ttft"]["p50"],
        "ttft_p99_s": s["ttft"]["p99"],
        "tpot_p99_s": s["tpot"]["p99"],
        "slo_attainment": attainment(report, args),
        "disaggregated_share": float(report.disaggregated[m].mean()) if m.any() else 0.0,
        "pools": [
            {**sim, "name": n, "gpus": g, "gpus_planned": gp}
            for (n, g, gp), sim in zip(sizes, report.pools)
        ],
    }


def pool_routed(
    args: argparse.Namespace, w: Workload, profile: Profile, trace: Trace
) -> dict[str, Any]:
    """The planner's pool-routing fleet (token-budget router, every endpoint
    ``both``) run by ``routecore simulate``'s own machinery on the same trace,
    as a row of the comparison."""
    from routecore.commands import simulate as sim

    spec = argparse.Namespace(**{**vars(args), "fleet": ["pool-routing"]})
    (fleet,) = sim.plan_fleets(w, profile, spec)
    report = sim.run_fleet(fleet, trace, profile, spec)
    if args.verify:
        report = sim.verify_fleet(fleet, trace, profile, spec, report)
    s = report.summary()
    ok = sim.slo_met(report, spec)[report.measured]
    return {
        "name": f"pool-routed (B {fleet.b_short})",
        "decider": "-",
        "gpus": fleet.gpus,
        "gpus_planned": fleet.gpus_planned,
        "ttft_p50_s": s["ttft"]["p50"],
        "ttft_p99_s": s["ttft"]["p99"],
        "tpot_p99_s": s["tpot"]["p99"],
        "slo_attainment": float(ok.mean()) if ok.size else float("nan"),
        "disaggregated_share": 0.0,
        "pools": [
            {**r, "name": p.name, "gpus": p.gpus, "gpus_planned": p.gpus_planned}
            for p, r in zip(fleet.pools, report.pools)
        ],
    }


def fleets_of(d: DisaggPlan, args: argparse.Namespace) -> list[Fleet]:
    """The fleets of the deciders asked for: ``never`` on the aggregated
    plan's endpoints (all ``both``), ``always`` and ``conditional`` on the
    disaggregated plan's pools (``--prefill-gpus`` / ``--decode-gpus``
    override those)."""
    p = d.n_prefill if args.prefill_gpus is None else args.prefill_gpus
    q = d.n_decode if args.decode_gpus is None else args.decode_gpus
    out = []
    for decider in args.decider or DECIDERS:
        if decider == "never":
            out.append(Fleet("aggregated", "never", 0, d.n_aggregated, 0, d.n_aggregated))
        else:
            name = "disaggregated" if decider == "always" else f"conditional>{args.threshold}"
            out.append(Fleet(name, decider, p, q, d.n_prefill, d.n_decode))
    return out


def compare(args: argparse.Namespace, w: Workload, profile: Profile, trace: Trace) -> int:
    """``routecore simulate --disaggregated``: the P/D plan, then each
    decider's fleet simulated on one trace (verified by bisection per pool
    unless ``--no-verify``), beside the pool-routed fleet of ``routecore
    simulate`` when ``--fleet pool-routing`` is given."""
    d = plan(w, profile, args, DEFAULT_CONTEXT)
    rows = []
    for fleet in fleets_of(d, args):
        if args.verify:
            report = verify(fleet, trace, profile, args, d.slots)
        else:
            report = simulate(fleet, trace, profile, args, d.slots)
        rows.append(fleet_row(fleet, report, args))
    if args.fleet is None or "pool-routing" in args.fleet:
        rows.append(pool_routed(args, w, profile, trace))
    result = {
        "trace": args.trace,
        "requests": int(trace.input_tokens.size),
        "rate": args.rate,
        "duration_s": args.duration,
        "warmup": args.warmup,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "profile": profile.name,
        "transfer": transfer(args, profile),
        "verification": {"enabled": bool(args.verify), "target": args.verify_target},
        "plan": d.as_dict(),
        "fleets": rows,
    }
    return emit(result, args)


def emit(result: dict[str, Any], args: argparse.Namespace) -> int:
    if args.json:
        print(dumps(result))
        return 0
    print(
        f"{result['trace']}: {result['requests']} requests at {result['rate']:g} req/s, "
        f"P99 TTFT <= {result['slo_ttft_s']:g} s, TPOT <= {result['slo_tpot_s']:g} s; "
        + ("GPUs verified by bisection" if result["verification"]["enabled"] else "planned GPUs")
    )
    head = (
        f"{'fleet':<22} {'GPUs':>5} {'planned':>7} {'pools (GPUs)':<26} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p99':>9} {'SLO met':>8} {'split':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in result["fleets"]:
        pools = " + ".join(f"{p['name']} {p['gpus']}" for p in r["pools"])
        print(
            f"{r['name']:<22} {r['gpus']:>5} {r['gpus_planned']:>7} {pools:<26} "
            f"{ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} {ms(r['tpot_p99_s']):>9} "
            f"{r['slo_attainment']:>8.1%} {r['disaggregated_share']:>6.0%}"
        )
    return 0


def ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.0f} ms"
