"""``routecore plan-fidelity``: the planner's fidelity grid. Per scenario
(workload x rate x TTFT target) and per pool of each fleet, the planned GPUs
beside the smallest count the simulator accepts (``routecore.planning.
fidelity_scenario``); on stderr each simulation's progress and the
verification's rounds, and one line per scenario; the rows as
the README's markdown table (or ``--json``) and a closing summary line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from routecore._json import dumps
from routecore.commands._args import (
    MAX_COUNT,
    add_json,
    add_quiet,
    add_seed,
    add_slo_tpot,
    int_in,
    positive_float,
    positive_int,
)
from routecore.planning import (
    FIDELITY_DURATION_S,
    FIDELITY_FLEETS,
    FIDELITY_MAX_REQUESTS,
    FIDELITY_MIN_POOL_REQUESTS,
    FIDELITY_RATES,
    FIDELITY_SLOS,
    FIDELITY_WORKLOADS,
    FidelityRow,
    fidelity_markdown,
    fidelity_scenario,
    fidelity_summary,
)
from routecore.profiles import DEFAULT_PRESET, PRESETS

NAME = "plan-fidelity"
HELP = (
    "The planner's fidelity grid: per pool, planned GPUs against the smallest count the "
    "simulator accepts, over workloads x rates x TTFT targets (slow: minutes per scenario "
    "at 1,000 req/s and more; narrow it with the flags)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        action="append",
        choices=FIDELITY_WORKLOADS,
        help="a workload of the grid, repeatable (default: all; see the data README)",
    )
    p.add_argument(
        "--rate",
        action="append",
        type=positive_float,
        help="an arrival rate, req/s, repeatable (default: "
        f"{', '.join(f'{r:g}' for r in FIDELITY_RATES)})",
    )
    p.add_argument(
        "--slo-ttft",
        action="append",
        type=positive_float,
        metavar="SECONDS",
        help="a P99 TTFT target, seconds, repeatable (default: "
        f"{', '.join(f'{s:g}' for s in FIDELITY_SLOS)})",
    )
    add_slo_tpot(p)
    p.add_argument(
        "--fleet",
        action="append",
        choices=FIDELITY_FLEETS,
        help="a fleet type, repeatable (default: all)",
    )
    p.add_argument(
        "--profile",
        choices=tuple(PRESETS),
        default=DEFAULT_PRESET,
        help=f"a profile preset (default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=FIDELITY_DURATION_S,
        help=f"simulated seconds of Poisson arrivals per scenario (default "
        f"{FIDELITY_DURATION_S:g}: steady state for the pools near saturation, whose "
        "minimum 120 s biased low; at least 20,000 requests)",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=FIDELITY_MAX_REQUESTS,
        help=f"at most this many requests per scenario (default {FIDELITY_MAX_REQUESTS:,}: "
        "600 s at 3,000 req/s; at 10,000 req/s 200 s)",
    )
    p.add_argument(
        "--min-pool-requests",
        type=int_in(0, MAX_COUNT),
        default=FIDELITY_MIN_POOL_REQUESTS,
        help=f"verify each fleet over at least this many measured requests in its smallest "
        f"pool (default {FIDELITY_MIN_POOL_REQUESTS:,}: 99%% then allows 10 misses, not "
        "one), its horizon extended up to --max-requests; 0: --duration alone",
    )
    add_seed(p, "arrival and dispatch seed")
    add_json(p, "the rows as JSON")
    add_quiet(p)


def run(args: argparse.Namespace) -> int:
    scenarios = [
        (w, r, s)
        for w in args.workload or FIDELITY_WORKLOADS
        for r in args.rate or FIDELITY_RATES
        for s in args.slo_ttft or FIDELITY_SLOS
    ]
    rows: list[FidelityRow] = []
    skipped: list[str] = []
    start = time.monotonic()
    for i, (workload, rate, slo) in enumerate(scenarios, 1):
        t0 = time.monotonic()
        try:
            got = fidelity_scenario(
                workload,
                rate,
                slo,
                args.profile,
                slo_tpot_s=args.slo_tpot,
                seed=args.seed,
                duration_s=args.duration,
                max_requests=args.max_requests,
                min_pool_requests=args.min_pool_requests,
                fleets=tuple(args.fleet or FIDELITY_FLEETS),
                quiet=args.quiet,
            )
        except ValueError as e:
            # A plan the simulator cannot run (a pool above its endpoint
            # limit): the scenario is skipped and listed, the grid goes on.
            got = []
            skipped.append(f"{workload} {rate:g} req/s TTFT {slo:g} s: {e}")
        rows += got
        if not args.quiet:
            pools = ", ".join(
                f"{r.fleet} {r.pool} {r.planned}/{r.simulated} ({r.measured} measured)"
                f"{'' if r.within else ' MISS'}"
                for r in got
            )
            print(
                f"[{i}/{len(scenarios)}] {workload} {rate:g} req/s TTFT {slo:g} s "
                f"({time.monotonic() - t0:.0f} s, {time.monotonic() - start:.0f} s in all): "
                + (f"planned/simulated {pools}" if got else f"skipped: {skipped[-1]}"),
                file=sys.stderr,
                flush=True,
            )
    if args.json:
        print(
            dumps(
                {
                    "rows": [dataclasses.asdict(r) | {"within": r.within} for r in rows],
                    "summary": fidelity_summary(rows),
                    "skipped": skipped,
                }
            )
        )
    else:
        print(fidelity_markdown(rows))
        print()
        print(fidelity_summary(rows))
        for line in skipped:
            print(f"skipped: {line}")
    return 0
