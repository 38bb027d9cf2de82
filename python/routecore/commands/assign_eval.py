"""``routecore assign-eval``: RouteBalance presets against decoupled routing,
round-robin and random on the paper's heterogeneous fleet, in routecore's own
discrete-event evaluation (``routecore.assign_eval``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from routecore._core import assign_eval
from routecore._extras import pyplot
from routecore.commands._args import positive_float, positive_int, random_seed

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
    p.add_argument("--seed", type=random_seed, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--max-batch", type=positive_int, default=16, help="decode slots per endpoint (default 16)"
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=0.05,
        help="seconds between scheduler firings (default 0.05)",
    )
    p.add_argument("--plot", metavar="FILE", help="write the frontier plot (PNG) to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object a line")


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


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Quality against mean latency and against cost, one line per sweep."""
    plt = pyplot()
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = {
        "scheduler sweep": dict(marker="o", color="C0", label="BatchScheduler (latency priced)"),
        "decoupled sweep": dict(
            marker="s", color="C1", label="decoupled: router, then shortest queue"
        ),
    }
    for ax, x, xlabel in [
        (axes[0], "mean_latency_s", "mean latency (s)"),
        (axes[1], "cost_per_request_usd", "cost per request (USD)"),
    ]:
        for family, style in styles.items():
            pts = sorted(
                ((r[x], r["quality"]) for r in rows if r["family"] == family),
                key=lambda p: p[1],
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        for r in rows:
            if r["family"] in ("preset", "dispatcher"):
                marker = "*" if r["family"] == "preset" else "x"
                ax.scatter(r[x], r["quality"], marker=marker, s=90, color="k", zorder=3)
                ax.annotate(
                    r["policy"],
                    (r[x], r["quality"]),
                    fontsize=8,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean quality")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("Batched model+endpoint assignment on the RouteBalance fleet")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        plot(rows, args.plot)
    return 0
