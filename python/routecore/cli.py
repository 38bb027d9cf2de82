"""The ``routecore`` command: one subcommand per capability.

Each subcommand lives in its own module under ``routecore.commands`` with
``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``, and is
listed once in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from routecore import __version__
from routecore._extras import MissingExtra, pyplot
from routecore.commands import (
    admission_scenario,
    assign_eval,
    autoscale_sim,
    bench,
    calibration_study,
    client,
    compress,
    flow_eval,
    init_config,
    pick_eval,
    plan,
    plan_fidelity,
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
    pick_eval,
    assign_eval,
    admission_scenario,
]
COMMANDS.append(serve_command)
COMMANDS.append(client)
COMMANDS.append(init_config)
COMMANDS.append(bench)
# The planner's fidelity grid (issue 27).
COMMANDS.append(plan_fidelity)
# Autoscaling policies in the simulator (issue 26).
COMMANDS.append(autoscale_sim)
# Flow control in simulation (issue 32).
COMMANDS.append(flow_eval)


class UsageError(Exception):
    """A bad command line; ``main`` prints it as one line and returns 2."""


class Parser(argparse.ArgumentParser):
    """Raises ``UsageError`` on a bad command line instead of printing the
    usage. Options are spelled in full: no prefix of an option is taken for it
    (``allow_abbrev=False``: ``--conf`` is not ``--config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="routecore",
        description="The hot path of LLM request routing: route, plan, simulate, serve.",
    )
    parser.add_argument("--version", action="version", version=f"routecore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        command.add_arguments(p)
        p.set_defaults(run=command.run, parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # What the subcommand did not know, reported by the subcommand's parser.
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        if getattr(args, "plot", None):
            pyplot()  # the 'plot' extra of a --plot, checked before any work
        return args.run(args)
    except BrokenPipeError:
        return 0
    except (ValueError, KeyError, OverflowError, OSError, MissingExtra) as e:
        # A value argparse let through but the library refused: one line, no traceback.
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"routecore {args.command}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
