"""``routecore pick-eval``: endpoint-picker policies compared in the fleet
simulator on a workload with shared prefixes.

One pool of simulated vLLM endpoints (``routecore.SimPool``), each with its own
LRU prefix cache of its KV blocks, serves a seeded ``routecore.PrefixWorkload``
(multi-turn sessions and shared system prompts); inside the pool every request
is dispatched by the endpoint-picker pipeline of a policy, fed with each
endpoint's queue, running count and KV-cache use as a metrics scraper reads
them every ``--scrape-interval`` seconds (the picker adding its own
dispatches in between). The approximate ``prefix`` policies score endpoints
by what routecore routed to them; the ``precise-prefix`` ones by what each
engine's cache holds, from the KV-cache events the simulated caches publish
(``BlockStored``, ``BlockRemoved``) into the index ``serve`` feeds from real
engines. The default workload puts the caches under pressure: each endpoint
caches fewer blocks than the prefixes its sessions need, so engines evict
what the approximate index still counts on. Per policy:

- ``hit_rate``: prompt tokens served from the endpoints' prefix caches over
  prompt tokens, over the measured (post-warm-up) requests;
- ``ttft_p50_s`` / ``ttft_p99_s``: time to first token, seconds;
- ``imbalance``: dispatched work of the busiest endpoint over the mean
  endpoint's, work being the prompt plus output tokens of the measured
  requests sent to it (1.0 is perfectly even).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from routecore._core import EndpointPicker, PrefixWorkload, SimPool, SimReport, simulate
from routecore._extras import pyplot
from routecore.commands._args import (
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    proper_fraction,
    random_seed,
)
from routecore.commands.simulate import Progress

NAME = "pick-eval"
HELP = (
    "Compare endpoint-picker policies (random, least-request, queue+kv, approximate prefix, "
    "prefix+queue+kv, precise-prefix from the engines' KV events, precise-prefix+queue+kv) "
    "in the fleet simulator on a seeded shared-prefix workload under KV-cache pressure: "
    "prefix-cache hit rate, TTFT p50/p99 and load imbalance."
)

#: The policies compared: the EndpointPicker presets but round-robin (random's
#: twin here) and vtc (fairness, not locality): uniform random, fewest requests
#: in flight, the Gateway API Inference Extension's default scorers (queue depth
#: and KV-cache use), AIBrix's (approximate) prefix-cache routing, the three
#: scorers together (routecore's default), and the same two with the precise
#: prefix scorer (llm-d's, from the engines' KV events).
POLICIES = tuple(p for p in EndpointPicker.presets() if p not in ("round-robin", "vtc"))


@dataclass
class Row:
    policy: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=4000, help="requests (default 4000)")
    p.add_argument("--rate", type=positive_float, default=20.0, help="arrivals/s (default 20)")
    p.add_argument("--endpoints", type=positive_int, default=8, help="endpoints (default 8)")
    p.add_argument(
        "--sessions", type=positive_int, default=128, help="open sessions at a time (default 128)"
    )
    p.add_argument(
        "--system-prompts", type=positive_int, default=32, help="shared system prompts (default 32)"
    )
    p.add_argument(
        "--shared-fraction",
        type=fraction,
        default=0.9,
        help="share of sessions starting with a shared system prompt (default 0.9)",
    )
    p.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=1536,
        help="KV blocks of 16 tokens per endpoint, which bound its prefix cache (default 1536: "
        "KV-cache pressure; the 8 endpoints cache 12,288 blocks in all, while the default "
        "workload's 128 open sessions hold about 14,500 distinct blocks of context at any "
        "time, prompts averaging 138 blocks, and 106,262 distinct blocks over the run)",
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="slots per endpoint (default 64)"
    )
    p.add_argument(
        "--scrape-interval",
        type=non_negative_float,
        default=0.05,
        help="seconds between scrapes of the endpoints' metrics, the picker adding its own "
        "dispatches in between (default 0.05, the scraper's; 0: read at every decision)",
    )
    p.add_argument("--warmup", type=proper_fraction, default=0.2, help="warm-up fraction (0.2)")
    p.add_argument("--seed", type=random_seed, default=0, help="workload and picker seed (0)")
    p.add_argument(
        "--policy", action="append", choices=POLICIES, help="a policy to run (repeat; default all)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write a bar chart of the figures (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


#: The longest context the workload can build (system prompt, eight turns of
#: user message and reply) fits this window.
MAX_CONTEXT = 16384


def measure(policy: str, workload: PrefixWorkload, report: SimReport, endpoints: int) -> Row:
    """The figures of one policy's run (see the module docstring)."""
    served = report.measured & np.isfinite(report.e2e)
    prompt = workload.input_tokens[served].astype(np.float64)
    hit_rate = float(report.cached_tokens[served].sum() / prompt.sum()) if prompt.size else 0.0
    work = np.bincount(
        report.endpoint[served],
        weights=prompt + workload.output_tokens[served],
        minlength=endpoints,
    )
    ttft = report.summary()["ttft"]
    return Row(
        policy=policy,
        hit_rate=hit_rate,
        ttft_p50_s=ttft["p50"],
        ttft_p99_s=ttft["p99"],
        imbalance=float(work.max() / work.mean()) if work.sum() > 0 else 1.0,
    )


def evaluate(args: argparse.Namespace) -> list[Row]:
    """Runs the workload through every policy asked for."""
    workload = PrefixWorkload(
        requests=args.requests,
        rate=args.rate,
        sessions=args.sessions,
        system_prompts=args.system_prompts,
        shared_fraction=args.shared_fraction,
        seed=args.seed,
    )
    pool = SimPool("pool", args.endpoints, MAX_CONTEXT, args.max_num_seqs, kv_blocks=args.kv_blocks)
    rows = []
    for policy in args.policy or POLICIES:
        report = simulate(
            workload.arrival_s, workload.input_tokens, workload.output_tokens, [pool],
            router="homogeneous", dispatch=policy, blocks=workload.blocks,
            block_tokens=workload.block_tokens, seed=args.seed,
            warmup=args.warmup, scrape_interval=args.scrape_interval,
            progress=Progress(policy, not args.quiet),
        )  # fmt: skip
        rows.append(measure(policy, workload, report, args.endpoints))
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| policy | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | imbalance (max / mean work) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.ttft_p50_s:.3f} | {r.ttft_p99_s:.3f} "
            f"| {r.imbalance:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    """Three panels of bars, one bar per policy: hit rate, TTFT p50 and p99,
    imbalance."""
    plt = pyplot()
    names = [r.policy for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    bars = axes[0].bar(x, [100 * r.hit_rate for r in rows], color="C0")
    axes[0].bar_label(bars, fmt="%.1f", fontsize=8)
    axes[0].set_ylabel("prompt tokens from cache (%)")
    axes[0].set_title("prefix-cache hit rate")
    axes[0].set_ylim(0, 112)
    axes[0].set_yticks(range(0, 101, 20))
    width = 0.4
    for dx, name, color in [(-width / 2, "p50", "C1"), (width / 2, "p99", "C3")]:
        values = [getattr(r, f"ttft_{name}_s") for r in rows]
        bars = axes[1].bar(x + dx, values, width, label=name, color=color)
        axes[1].bar_label(bars, fmt="%.2f", fontsize=7)
    axes[1].set_ylabel("time to first token (s)")
    axes[1].set_title("TTFT")
    top = max(r.ttft_p99_s for r in rows)
    axes[1].set_ylim(0, top * 1.35 if top > 0 else 1.0)
    axes[1].legend(loc="upper right", ncols=2, fontsize=9)
    bars = axes[2].bar(x, [r.imbalance for r in rows], color="C2")
    axes[2].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[2].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[2].set_ylabel("busiest endpoint's work / mean")
    axes[2].set_title("load imbalance (1 = even)")
    axes[2].set_ylim(0, max(r.imbalance for r in rows) * 1.2)
    for ax in axes:
        ax.set_xticks(x, names, rotation=25, ha="right", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Endpoint-picker policies on a shared-prefix workload (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    rows = evaluate(args)
    if args.json:
        print(json.dumps({"policies": [asdict(r) for r in rows]}))
    else:
        print(table(rows))
        print(
            f"\n{args.requests} requests at {args.rate:g}/s, {args.endpoints} endpoints x "
            f"{args.kv_blocks} KV blocks, seed {args.seed}",
            file=sys.stderr,
        )
    if args.plot:
        plot(rows, args.plot)
    return 0
