"""The options the ``routecore`` commands share, and the ``type=`` of every
numeric option.

Each type parses one value and refuses what the option cannot mean (a
negative count, a zero rate, NaN or infinity, a port outside 1..65535, a
token count above what the router accepts) with
``argparse.ArgumentTypeError``, which argparse reports as one line and exit
status 2. ``add_seed``, ``add_plot``, ``add_profile``, ``add_json``, ``add_quiet``
and ``add_slo`` declare the options several commands have, once, so they
mean the same in each.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from routecore._core import MAX_TOKENS
from routecore.profiles import DEFAULT_PRESET, PRESETS

#: Counts handed to Rust as signed 64-bit integers.
MAX_COUNT = (1 << 63) - 1


def _show(n: int) -> str:
    """``n``, written as a power of two when it is one (or one less)."""
    k = n.bit_length()
    if k > 16 and n == (1 << k) - 1:
        return f"2^{k} - 1"
    if k > 16 and n == 1 << (k - 1):
        return f"2^{k - 1}"
    return str(n)


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""
    expected = f"an integer in [{lo}, {_show(hi)}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def float_in(
    lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """A finite number between lo and hi (each bound excluded when open)."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > lo if lo_open else value >= lo
        below = value < hi if hi_open else value <= hi
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {left}{lo:g}, {hi:g}{right}, got {text!r}"
            )
        return value

    return parse


#: A count of things, at least one (requests, GPUs, pods, slots).
positive_int = int_in(1, MAX_COUNT)
#: A count that may be zero.
non_negative_int = int_in(0, MAX_COUNT)
#: A token count or a context length.
token_count = int_in(1, MAX_TOKENS)
#: A TCP port.
port = int_in(1, 65535)
#: A random seed (an unsigned 64-bit integer).
random_seed = int_in(0, (1 << 64) - 1)
#: A rate, a duration, a price, a ratio: finite and above zero.
positive_float = float_in(0.0, math.inf, lo_open=True, hi_open=True)
#: A duration or interval that may be zero: finite and >= 0.
non_negative_float = float_in(0.0, math.inf, hi_open=True)
#: A share or probability in [0, 1].
fraction = float_in(0.0, 1.0)
#: A share that must leave something: [0, 1).
proper_fraction = float_in(0.0, 1.0, hi_open=True)
#: A target or cap that must be above zero: (0, 1].
positive_fraction = float_in(0.0, 1.0, lo_open=True)
#: A compress-and-route band gamma >= 1.
band = float_in(1.0, math.inf, hi_open=True)


def new_file(text: str) -> str:
    """A file path to write, whose directory exists (checked before any work)."""
    parent = os.path.dirname(text) or "."
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} of {text!r} does not exist")
    return text


#: The seed of every command with a ``--seed`` (one default, so two commands
#: run on the same draw unless told otherwise).
DEFAULT_SEED = 0


def add_seed(p: argparse.ArgumentParser, what: str = "random seed") -> None:
    """``--seed``: an unsigned 64-bit integer, default ``DEFAULT_SEED``."""
    p.add_argument(
        "--seed", type=random_seed, default=DEFAULT_SEED, help=f"{what} (default {DEFAULT_SEED})"
    )


def add_plot(p: argparse.ArgumentParser, what: str) -> None:
    """``--plot FILE.png``: one PNG, its path checked before any work (and the
    'plot' extra too, by ``routecore.cli.main``)."""
    p.add_argument(
        "--plot",
        type=new_file,
        metavar="FILE.png",
        help=f"draw {what} to this PNG (its directory must exist; the 'plot' extra)",
    )


def add_profile(p: argparse.ArgumentParser) -> None:
    """``--profile``: a preset name or a TOML file (``routecore.profiles.resolve``)."""
    p.add_argument(
        "--profile",
        default=DEFAULT_PRESET,
        help=f"model + GPU profile: a preset ({', '.join(PRESETS)}) or a TOML file "
        f"(see routecore.profiles; default {DEFAULT_PRESET})",
    )


def add_json(p: argparse.ArgumentParser, what: str = "one JSON object") -> None:
    """``--json``: machine-readable output instead of the table."""
    p.add_argument("--json", action="store_true", help=f"print {what} instead of the table")


#: The SLO of ``plan`` and ``simulate``: P99 TTFT and TPOT targets, seconds
#: (the token-budget paper's 2 s TTFT; an 80 ms TPOT).
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.08


def add_slo(p: argparse.ArgumentParser) -> None:
    """``--slo-ttft`` and ``--slo-tpot``, in seconds, with one default each."""
    p.add_argument(
        "--slo-ttft",
        type=positive_float,
        default=DEFAULT_SLO_TTFT_S,
        metavar="SECONDS",
        help=f"P99 TTFT target, seconds (default {DEFAULT_SLO_TTFT_S:g}): the planner's target "
        "and each simulated request's SLO",
    )
    add_slo_tpot(p)
    for old, new in (("--slo-ms", "--slo-ttft"), ("--slo-tpot-ms", "--slo-tpot")):
        p.add_argument(old, action=_milliseconds_replaced(new), help=argparse.SUPPRESS)


def add_slo_tpot(p: argparse.ArgumentParser) -> None:
    """``--slo-tpot``, in seconds (every command that has an SLO)."""
    p.add_argument(
        "--slo-tpot",
        type=positive_float,
        default=DEFAULT_SLO_TPOT_S,
        metavar="SECONDS",
        help=f"TPOT target, seconds (default {DEFAULT_SLO_TPOT_S:g})",
    )


def _milliseconds_replaced(new: str) -> type[argparse.Action]:
    """An action refusing a former milliseconds option with a message naming
    ``new`` (seconds) and converting the value given."""

    class Replaced(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: object,
            option_string: str | None = None,
        ) -> None:
            try:
                seconds = f": {option_string} {values} is {new} {float(str(values)) / 1000:g}"
            except ValueError:
                seconds = ""
            parser.error(f"{option_string} was replaced by {new}, in seconds{seconds}")

    return Replaced


def add_quiet(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress on stderr."""
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
