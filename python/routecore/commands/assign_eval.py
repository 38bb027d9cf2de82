"""``routecore assign-eval``: RouteBalance presets against decoupled routing,
round-robin and random on the paper's heterogeneous fleet, in routecore's own
discrete-event evaluation (``routecore.assign_eval``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from routecore._core import assign_eval
from routecore.commands import _plot
from routecore.commands._args import add_json, add_plot, add_seed, positive_float, positive_int

NAME = "assign-eval"
HELP = (
    "Evaluate batched model+endpoint assignment (RouteBalance) on a Qwen2.5 "
    "3B/7B/14B/72B fleet (13 endpoints) with a synthetic workload of known quality "
    "and output length: prints a quality / latency / cost table; --plot draws the frontier."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rate", type=positive_float, default=8.0, help="arrivals per second (default 8)"
    )
    p.add_argument("--requests", type=positive_int, default=3000, help="requests (default 3000)")
    add_seed(p, "workload seed")
    p.add_argument(
        "--max-batch", type=positive_int, default=16, help="decode slots per endpoint (default 16)"
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=0.05,
        help="seconds between scheduler firings (default 0.05)",
    )
    add_plot(p, "quality against latency and cost, per policy")
    add_json(p, "one JSON object a line")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (cost in micro-USD per request)."""
    models = list(rows[0]["model_share"])
    head = ["policy", "quality", "mean latency (s)", "p95 (s)", "cost (uUSD/req)"]
    head += [f"{m.split('-')[-1]} share" for m in models]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["policy"],
            f"{r['quality']:.3f}",
            f"{r['mean_latency_s']:.2f}",
            f"{r['p95_latency_s']:.2f}",
            f"{r['cost_per_request_usd'] * 1e6:.1f}",
        ] + [f"{r['model_share'][m]:.2f}" for m in models]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Markers of the named policies (presets, then the plain dispatchers), one each.
MARKERS = "*PXDv^<>"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Quality against mean latency and against cost per request (micro-USD),
    a line per sweep and a marker per named policy, named in one legend below
    the panels (no label on the data)."""
    fig, (latency, cost) = _plot.figure(title, 2, (11, 5.4))
    sweeps = {
        "scheduler sweep": dict(marker="o", color="C0", label="BatchScheduler (latency priced)"),
        "decoupled sweep": dict(
            marker="s", color="C1", label="decoupled: router, then shortest queue"
        ),
    }
    named = [r for r in rows if r["family"] in ("preset", "dispatcher")]
    for ax, x, scale, xlabel in [
        (latency, "mean_latency_s", 1.0, "mean latency (s, log scale)"),
        (cost, "cost_per_request_usd", 1e6, "cost per request (micro-USD)"),
    ]:
        for family, style in sweeps.items():
            pts = sorted(
                ((scale * r[x], r["quality"]) for r in rows if r["family"] == family),
                key=lambda p: p[1],
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        for r, marker in zip(named, MARKERS):
            kind = "preset" if r["family"] == "preset" else "dispatcher"
            ax.scatter(scale * r[x], r["quality"], marker=marker, s=80, zorder=3,
                       color="k" if kind == "preset" else "dimgrey",
                       label=f"{r['policy']} ({kind})")  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean quality (0-1)")
        ax.grid(alpha=0.3)
    _plot.plain_log_axis(latency.xaxis)
    latency.set_title("quality against latency")
    cost.set_title("quality against cost")
    handles, labels = latency.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=8)
    _plot.save(fig, path)


def run(args: argparse.Namespace) -> int:
    rows = assign_eval(
        rate=args.rate,
        requests=args.requests,
        seed=args.seed,
        max_batch=args.max_batch,
        interval_s=args.interval,
    )
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(table(rows))
    if args.plot:
        title = (
            f"Batched model+endpoint assignment on the RouteBalance fleet: "
            f"{args.requests:,} requests at {args.rate:g}/s"
        )
        plot(rows, args.plot, title)
    return 0
