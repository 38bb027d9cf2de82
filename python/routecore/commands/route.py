"""``routecore route``: route OpenAI request bodies (JSONL), one decision a line."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from importlib import resources

from routecore._core import Pool, TokenBudgetRouter, parse_openai_request

NAME = "route"
HELP = (
    "Route OpenAI request bodies (one JSON object a line) with token-budget pool "
    "routing; prints one JSON decision a line. Without FILE, routes the embedded sample."
)
DEFAULT_POOLS = ("short:8192", "long:65536")


def parse_pool(spec: str) -> Pool:
    """``NAME:MAX_CONTEXT[:BUDGET[:QUEUE_LIMIT]]`` -> Pool."""
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4 or not parts[0]:
        raise argparse.ArgumentTypeError(
            f"pool {spec!r}: expected NAME:MAX_CONTEXT[:BUDGET[:QUEUE_LIMIT]]"
        )
    try:
        numbers = [int(x) if x else None for x in parts[1:]]
        max_context, budget, queue_limit = (numbers + [None, None])[:3]
        return Pool(parts[0], max_context, budget, queue_limit)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"pool {spec!r}: {e}") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file",
        nargs="?",
        help="JSONL file of request bodies, '-' for stdin (default: the embedded sample)",
    )
    p.add_argument(
        "--pool",
        action="append",
        type=parse_pool,
        metavar="NAME:MAX_CONTEXT[:BUDGET[:QUEUE_LIMIT]]",
        help="a pool (repeat for each; default: short:8192 and long:65536)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=4096,
        help="output bound for requests that set none (default 4096)",
    )


def sample_lines() -> list[str]:
    """The embedded sample of request bodies (see routecore/data/README.md)."""
    text = resources.files("routecore").joinpath("data/sample_requests.jsonl").read_text("utf-8")
    return text.splitlines()


def route_lines(router: TokenBudgetRouter, lines: Iterable[str], default_max_tokens: int):
    """Yields one result dict per non-blank line: a decision, or an error."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            req = parse_openai_request(line, default_max_tokens)
            if req["prompt_tokens"] is not None:
                d = router.route_tokens(req["prompt_tokens"], req["max_output_tokens"])
            else:
                d = router.route(req["prompt_bytes"], req["category"], req["max_output_tokens"])
        except ValueError as e:
            yield {"line": n, "error": str(e)}
            continue
        yield {
            "line": n,
            "pool": d.pool,
            "rejected": d.rejected,
            "reason": d.reason,
            "category": req["category"],
            "prompt_bytes": req["prompt_bytes"],
            "est_input_tokens": d.est_input_tokens,
            "est_output_tokens": d.est_output_tokens,
            "est_total_tokens": d.est_total_tokens,
            "spilled": d.spilled,
        }


def run(args: argparse.Namespace) -> int:
    pools = args.pool or [parse_pool(s) for s in DEFAULT_POOLS]
    router = TokenBudgetRouter(pools)
    if args.file is None:
        lines: Iterable[str] = sample_lines()
    elif args.file == "-":
        lines = sys.stdin
    else:
        lines = open(args.file, encoding="utf-8")  # noqa: SIM115 - closed at exit
    counts: Counter[str] = Counter()
    for result in route_lines(router, lines, args.default_max_tokens):
        print(json.dumps(result))
        counts[result.get("pool") or ("error" if "error" in result else "rejected")] += 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"routed {sum(counts.values())} requests ({summary})", file=sys.stderr)
    return 1 if counts["error"] else 0
