"""``routecore prefix-eval``: prefix-cache-aware routing against least-request,
random and consistent-hash routing on a seeded multi-turn workload, in a
per-pod LRU KV-cache model (see ``routecore.prefix_eval``)."""

from __future__ import annotations

import argparse
import time

from routecore.commands._args import positive_float, positive_int, random_seed
from routecore.prefix_eval import POLICIES, evaluate, generate_workload, markdown_table

NAME = "prefix-eval"
HELP = (
    "Compare prefix-cache-aware routing with least-request, random and consistent-hash "
    "routing: prefix hit rate and load balance in a per-pod LRU KV-cache model; prints "
    "a Markdown table."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=2000, help="requests (default 2000)")
    p.add_argument("--pods", type=positive_int, default=8, help="pods (default 8)")
    p.add_argument("--apps", type=positive_int, default=8, help="applications / system prompts (8)")
    p.add_argument("--users", type=positive_int, default=200, help="users (default 200)")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=64,
        help="open conversations at a time (default 64)",
    )
    p.add_argument(
        "--rate", type=positive_float, default=20.0, help="arrivals per second (default 20)"
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per block (default 16)"
    )
    p.add_argument(
        "--cache-blocks",
        type=positive_int,
        default=8192,
        help="KV blocks each pod caches (default 8192)",
    )
    p.add_argument(
        "--seed", type=random_seed, default=0, help="workload and random-policy seed (0)"
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="a policy to run (repeat; default: all)",
    )


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    workload = generate_workload(
        requests=args.requests,
        apps=args.apps,
        users=args.users,
        concurrency=args.concurrency,
        rate=args.rate,
        seed=args.seed,
    )
    results = [
        evaluate(
            workload,
            policy,
            pods=args.pods,
            block_size=args.block_size,
            cache_blocks=args.cache_blocks,
            seed=args.seed,
        )
        for policy in args.policy or POLICIES
    ]
    print(markdown_table(results))
    tokens = int(workload.prompt_tokens.sum())
    print(
        f"\n{len(workload)} requests, {tokens} prompt tokens, {args.pods} pods, "
        f"seed {args.seed}; {time.perf_counter() - start:.1f} s"
    )
    return 0
