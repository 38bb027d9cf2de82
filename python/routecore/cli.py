"""The ``routecore`` command: one subcommand per capability.

Each subcommand lives in its own module under ``routecore.commands`` with
``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``, and is
listed once in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from routecore import __version__
from routecore._extras import MissingExtra
from routecore.commands import (
    admission_scenario,
    assign_eval,
    calibration_study,
    client,
    compress,
    plan,
    prefix_eval,
    route,
    simulate,
)
from routecore.commands import serve as serve_command

COMMANDS = [
    simulate,
    route,
    plan,
    compress,
    calibration_study,
    prefix_eval,
    assign_eval,
    admission_scenario,
]
COMMANDS.append(serve_command)
COMMANDS.append(client)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="routecore",
        description="The hot path of LLM request routing: route, plan, simulate, serve.",
    )
    parser.add_argument("--version", action="version", version=f"routecore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:
        return 0
    except (ValueError, KeyError, OSError, MissingExtra) as e:
        print(f"routecore {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
