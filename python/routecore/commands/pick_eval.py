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
from routecore.commands import _plot
from routecore.commands._args import (
    add_json,
    add_plot,
    add_quiet,
    add_seed,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    proper_fraction,
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
    add_seed(p, "workload and picker seed")
    p.add_argument(
        "--policy", action="append", choices=POLICIES, help="a policy to run (repeat; default all)"
    )
    add_json(p)
    add_plot(p, "the hit rate, TTFT and imbalance of each policy")
    add_quiet(p)


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


def plot(rows: list[Row], path: str, title: str) -> None:
    """Three panels of bars, one bar per policy: hit rate, TTFT p50 and p99,
    imbalance."""
    fig, (hits, ttft, imbalance) = _plot.figure(title, 3, (13, 1.6 + 0.5 * len(rows)))
    _plot.bars(hits, [100 * r.hit_rate for r in rows], "%.1f", color="C0")
    hits.set_xlabel("prompt tokens from cache (%)")
    hits.set_title("prefix-cache hit rate")
    hits.set_xlim(0, 110)
    hits.set_xticks(range(0, 101, 20))
    times = []
    for dy, name, color in [(-0.2, "p50", "C1"), (0.2, "p99", "C3")]:
        values = [getattr(r, f"ttft_{name}_s") for r in rows]
        _plot.bars(ttft, values, "%.3g", offset=dy, width=0.4, label=name, color=color)
        times += [v for v in values if np.isfinite(v) and v > 0]
    # p50 and p99 lie decades apart: a log axis shows both, from half the
    # shortest (each bar at least that long) to room after the longest's label
    ttft.set_xlabel("time to first token (s, log scale)")
    ttft.set_title("TTFT")
    ttft.set_xlim(min(times, default=0.01) / 2, max(times, default=1.0) * 4)
    _plot.plain_log_axis(ttft.xaxis)
    _plot.bars(imbalance, [r.imbalance for r in rows], "%.2f", color="C2")
    _plot.target_line(imbalance, 1.0, "even load", vertical=True)
    imbalance.set_xlabel("busiest endpoint's work / mean")
    imbalance.set_title("load imbalance (1 = even)")
    imbalance.set_xlim(0, max(1.0, *(r.imbalance for r in rows)) * 1.2)
    for ax in (hits, ttft, imbalance):
        _plot.categories(ax, [r.policy for r in rows])
    handles, labels = [], []
    for ax in (ttft, imbalance):
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8)
    _plot.save(fig, path)


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
        title = (
            f"Endpoint-picker policies on a shared-prefix workload (simulated): "
            f"{args.requests:,} requests at {args.rate:g}/s, {args.endpoints} endpoints"
        )
        plot(rows, args.plot, title)
    return 0
