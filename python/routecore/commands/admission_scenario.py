"""``routecore admission-scenario``: the token-management paper's experiments, simulated."""

from __future__ import annotations

import argparse

from routecore import admission_scenarios
from routecore.commands._args import add_plot, positive_int

NAME = "admission-scenario"
HELP = (
    "Replay experiment 1 (cross-class protection) or 2 (SLO-aware fair share) of the "
    "token-pool paper on a simulated clock and 16-slot backend; prints the timeline."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", type=int, choices=[1, 2], help="which experiment")
    p.add_argument("--every", type=positive_int, default=10, help="table row every N seconds (10)")
    add_plot(p, "the timeline too")


def run(args: argparse.Namespace) -> int:
    if args.every < 1:
        raise ValueError(f"--every must be >= 1, got {args.every}")
    scenario = admission_scenarios.experiment(args.experiment)
    timeline = admission_scenarios.run(scenario)
    print(scenario.name)
    print(admission_scenarios.table(timeline, args.every))
    print()
    print(admission_scenarios.summary(timeline))
    if args.plot:
        admission_scenarios.plot(timeline, scenario.name, args.plot)
        print(f"plot written to {args.plot}")
    return 0
