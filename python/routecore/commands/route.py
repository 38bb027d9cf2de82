"""``routecore route``: route OpenAI request bodies (JSONL), one decision a line."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from importlib import resources

from routecore._core import Compressor, Pool, TokenBudgetRouter
from routecore.commands._args import band, token_count

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
    except (TypeError, ValueError, OverflowError) as e:
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
        type=token_count,
        default=4096,
        help="output bound for requests that set none (default 4096)",
    )
    p.add_argument(
        "--compress-band",
        type=band,
        metavar="GAMMA",
        help="compress-and-route: compress prose requests whose L_total is in "
        "(B, GAMMA*B] of a smaller pool down to B - max_tokens and route them there",
    )
    p.add_argument(
        "--bodies-out",
        metavar="FILE",
        help="write the body each request is sent with (compressed or not), one a line",
    )


def sample_lines() -> list[str]:
    """The embedded sample of request bodies (see routecore/data/README.md)."""
    text = resources.files("routecore").joinpath("data/sample_requests.jsonl").read_text("utf-8")
    return text.splitlines()


def route_lines(
    router: TokenBudgetRouter,
    lines: Iterable[str],
    default_max_tokens: int,
    compressor: Compressor | None = None,
):
    """Yields (result dict, body to send) per non-blank line: a decision with the
    body it is sent with (compressed on a "compress" decision), or an error."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            routed = router.route_request(line, compressor, default_max_tokens)
        except ValueError as e:
            yield {"line": n, "error": str(e)}, None
            continue
        d = routed.decision
        result = {
            "line": n,
            "pool": d.pool,
            "rejected": d.rejected,
            "reason": d.reason,
            "category": routed.category,
            "prompt_bytes": routed.prompt_bytes,
            "est_input_tokens": d.est_input_tokens,
            "est_output_tokens": d.est_output_tokens,
            "est_total_tokens": d.est_total_tokens,
            "spilled": d.spilled,
            "action": d.action,
        }
        c = routed.compression
        if c is not None:
            result["compression"] = {
                "status": c.status,
                "target_tokens": d.compress_target_tokens,
                "tokens_before": c.tokens_before,
                "tokens_after": c.tokens_after,
                "compressed_messages": c.compressed_messages,
            }
        yield result, routed.body


def run(args: argparse.Namespace) -> int:
    pools = args.pool or [parse_pool(s) for s in DEFAULT_POOLS]
    router = TokenBudgetRouter(pools, compress_band=args.compress_band)
    if args.file is None:
        lines: Iterable[str] = sample_lines()
    elif args.file == "-":
        lines = sys.stdin
    else:
        lines = open(args.file, encoding="utf-8")  # noqa: SIM115 - closed at exit
    counts: Counter[str] = Counter()
    bodies = open(args.bodies_out, "wb") if args.bodies_out else None  # noqa: SIM115
    for result, body in route_lines(router, lines, args.default_max_tokens):
        print(json.dumps(result))
        counts[result.get("pool") or ("error" if "error" in result else "rejected")] += 1
        if result.get("action") == "compress":
            counts["compressed"] += 1
        if bodies is not None and body is not None:
            bodies.write(body.rstrip(b"\n") + b"\n")
    if bodies is not None:
        bodies.close()
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"routed {sum(counts.values())} requests ({summary})", file=sys.stderr)
    return 1 if counts["error"] else 0
