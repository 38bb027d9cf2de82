"""``routecore init-config [DIR]``: write a working routecore.yaml and envoy.yaml."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

NAME = "init-config"
HELP = (
    "Write a working routecore.yaml (two pools on 127.0.0.1, tenant 'demo' with key "
    "'demo-key') and the matching envoy.yaml into DIR, ready for "
    "`routecore serve --config DIR/routecore.yaml`. Refuses to overwrite without --force."
)
#: The files written, shipped in the wheel (the same bytes as examples/ in the repository).
FILES = ("routecore.yaml", "envoy.yaml")


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


def example(name: str) -> bytes:
    """The shipped example file ``name`` (one of ``FILES``)."""
    return resources.files("routecore").joinpath("data/examples", name).read_bytes()


#: The line ``--no-scrape`` adds under ``scrape:`` in routecore.yaml.
NO_SCRAPE = b"  enabled: false        # no engines yet: every endpoint counts as healthy\n"


def config_file(name: str, scrape: bool) -> bytes:
    """The file ``name`` to write: the example, with scraping off unless ``scrape``."""
    data = example(name)
    if scrape or name != "routecore.yaml":
        return data
    head, sep, tail = data.partition(b"\nscrape:\n")
    if not sep:
        raise ValueError("the shipped routecore.yaml has no scrape section")
    return head + sep + NO_SCRAPE + tail


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    targets = [out / name for name in FILES]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not args.force:
        raise ValueError(f"{', '.join(existing)} already exist(s): pass --force to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for name, target in zip(FILES, targets):
        target.write_bytes(config_file(name, scrape=not args.no_scrape))
        print(f"wrote {target}")
    print(f"next: routecore serve --config {targets[0]}")
    return 0
