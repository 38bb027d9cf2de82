"""``routecore init-config [DIR]``: write a working routecore.yaml and envoy.yaml."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

NAME = "init-config"
HELP = (
    "Write a working routecore.yaml (two pools on 127.0.0.1, tenant 'demo' with key "
    "'demo-key') and the matching envoy.yaml (Envoy 1.40) into DIR, ready for "
    "`routecore serve --config DIR/routecore.yaml`. Refuses to overwrite without --force."
)
#: The files written, shipped in the wheel (the same bytes as examples/ in the repository).
FILES = ("routecore.yaml", "envoy.yaml")
#: The shipped files: the fail-open Envoy configuration (written as envoy.yaml with
#: --fail-open), the full-duplex one (the endpoint-picker protocol's streaming mode)
#: the observing one (the response read without Envoy waiting: one replica) and the
#: Unix-socket one (routecore on the same host).
SHIPPED = (
    *FILES,
    "envoy-fail-open.yaml",
    "envoy-full-duplex.yaml",
    "envoy-observe.yaml",
    "envoy-uds.yaml",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        nargs="?",
        default=".",
        help="directory to write into, created if missing (default .)",
    )
    p.add_argument("--force", action="store_true", help="overwrite files that already exist")
    p.add_argument(
        "--no-scrape",
        action="store_true",
        help="no engines run yet: write scrape.enabled: false, so no endpoint is health-checked "
        "and every one counts as healthy (routing works before the engines do; set it back to "
        "true when they run). Default: the endpoints' metrics are scraped, and endpoints "
        "nothing answers at are never chosen",
    )
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="write the fail-open Envoy configuration as envoy.yaml: when routecore cannot be "
        "reached, Envoy sends the request to the engines round robin (no key check, no "
        "admission) instead of failing it with HTTP 500; routecore gets request bodies "
        "BUFFERED. Default: fail closed",
    )


def example(name: str) -> bytes:
    """The shipped example file ``name`` (one of ``SHIPPED``)."""
    return resources.files("routecore").joinpath("data/examples", name).read_bytes()


#: The line ``--no-scrape`` adds under ``scrape:`` in routecore.yaml.
NO_SCRAPE = b"  enabled: false        # no engines yet: every endpoint counts as healthy\n"
#: Flow control's detector line, and what ``--no-scrape`` makes it (nothing
#: scraped: routecore's own requests in flight per endpoint).
UTILIZATION = b"    detector: utilization"
CONCURRENCY = b"    detector: concurrency   # no scrape: own requests in flight (max_in_flight)"


def config_file(name: str, scrape: bool, fail_open: bool = False) -> bytes:
    """The file ``name`` to write: the example, with scraping off unless
    ``scrape``; envoy.yaml is the fail-open one when ``fail_open``."""
    if name == "envoy.yaml":
        return example("envoy-fail-open.yaml" if fail_open else name)
    data = example(name)
    if scrape:
        return data
    head, sep, tail = data.partition(b"\nscrape:\n")
    if not sep or UTILIZATION not in tail:
        raise ValueError("the shipped routecore.yaml has no scrape or flow_control section")
    detector_line = tail[tail.index(UTILIZATION) :].split(b"\n", 1)[0]
    return head + sep + NO_SCRAPE + tail.replace(detector_line, CONCURRENCY)


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    targets = [out / name for name in FILES]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not args.force:
        raise ValueError(f"{', '.join(existing)} already exist(s): pass --force to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for name, target in zip(FILES, targets):
        target.write_bytes(config_file(name, scrape=not args.no_scrape, fail_open=args.fail_open))
        print(f"wrote {target}")
    print(f"next: routecore serve --config {targets[0]}")
    return 0
