"""``routecore bench``: per-call cost of each hot path on this machine, beside
its Python twin: the fastest way a Python user would compute the same answer
(NumPy where it vectorises, the same algorithm as routecore otherwise)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from routecore._extras import require
from routecore.commands._args import add_json, positive_float

NAME = "bench"
HELP = (
    "Time each hot path of the installed routecore (route, route_many, block_hashes, "
    "prefix pick, VTC, admission admit + complete, assign, erlang_c, one ext_proc "
    "conversation in process) beside its Python twin on the same input (NumPy where it "
    "vectorises, the same algorithm as routecore otherwise, checked to give the same "
    "answers): min and median per call and the ratio twin / routecore (above 1: "
    "routecore is faster). About 20 s by default."
)
#: One timing sample lasts at least this long (many calls of a fast path).
SAMPLE_S = 2e-3


def add_arguments(p: argparse.ArgumentParser) -> None:
    from routecore._baselines.cases import CASES

    p.add_argument(
        "--seconds",
        type=positive_float,
        default=1.0,
        help="time spent on each side of each case, seconds (default 1; 0.05 for a quick look)",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=[c.name for c in CASES],
        metavar="NAME",
        help=f"run only this case (repeat; one of {', '.join(c.name for c in CASES)})",
    )
    add_json(p, "the results as one JSON object")


def time_call(call, seconds: float) -> tuple[float, float]:
    """(min, median) nanoseconds per call over samples of ``SAMPLE_S`` or more,
    for about ``seconds`` (at least three samples)."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    number = max(1, int(SAMPLE_S / max(first, 1e-9)))
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(samples) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - t0) / number * 1e9)
    return min(samples), statistics.median(samples)


def measure(names: list[str] | None, seconds: float) -> list[dict[str, Any]]:
    """One result per case: routecore's and the Python twin's min / median ns per call."""
    from routecore._baselines.cases import CASES

    results = []
    for case in CASES:
        if names and case.name not in names:
            continue
        extra, modules = case.needs
        if modules:
            require(extra, *modules)
        with case.calls() as (rc, py):
            rc_min, rc_median = time_call(rc, seconds)
            py_min, py_median = time_call(py, seconds)
        results.append(
            {
                "name": case.name,
                "what": case.what,
                "routecore_ns": rc_median,
                "python_ns": py_median,
                "ratio": py_median / rc_median,
                "routecore_min_ns": rc_min,
                "python_min_ns": py_min,
            }
        )
    return results


def _ns(x: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} ns"


def format_table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'case':<22} {'routecore min / median':>24} {'Python twin min / median':>27} {'ratio':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        rc = f"{_ns(r['routecore_min_ns'])} / {_ns(r['routecore_ns'])}"
        py = f"{_ns(r['python_min_ns'])} / {_ns(r['python_ns'])}"
        lines.append(f"{r['name']:<22} {rc:>24} {py:>27} {r['ratio']:>7.1f}x")
    lines.append("ratio: Python-twin median / routecore median (above 1: routecore is faster)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results = measure(args.only, args.seconds)
    print(json.dumps({"results": results}) if args.json else format_table(results))
    return 0
