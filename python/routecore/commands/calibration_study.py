"""``routecore calibration-study``: the token-budget paper's Table 4."""

from __future__ import annotations

import argparse

from routecore.calibration import calibration_study, format_table
from routecore.commands._args import add_seed, positive_int

NAME = "calibration-study"
HELP = "Reproduce the calibration study (Table 4 of the token-budget paper)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_seed(p)
    p.add_argument("--requests", type=positive_int, default=5000, help="requests per category")


def run(args: argparse.Namespace) -> int:
    print(format_table(calibration_study(seed=args.seed, requests=args.requests)))
    return 0
