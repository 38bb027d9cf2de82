"""``routecore flow-eval``: the token-pool paper's two experiments with the
router's queue in place, under three policies (``routecore._core.flow_eval``,
the simulator's ``sim::flow``)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from routecore import _json
from routecore._core import flow_eval
from routecore.commands import _plot
from routecore.commands._args import add_json, add_plot, add_quiet, add_seed, positive_float

NAME = "flow-eval"
HELP = (
    "Flow control in simulation: experiment 1 (guaranteed, elastic and spot under "
    "overload) and 2 (elastic tenants with different SLOs under scarcity) of the "
    "token-pool paper, refusing at once vs a FCFS queue vs the token-pool queue: "
    "goodput, p99 TTFT per class and tenant, share refused, time to fairness."
)

#: The policies compared, in table order.
POLICIES = ("refuse", "fcfs", "token-pool")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--experiment",
        choices=["1", "2", "both"],
        default="both",
        help="which experiment (default both)",
    )
    p.add_argument(
        "--scale",
        type=positive_float,
        default=1.0,
        help="run each experiment this many times as long, phases alike (default 1: "
        "90 s and 300 s)",
    )
    p.add_argument(
        "--ttl",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="longest wait in the queue before the refusal (default 30)",
    )
    add_seed(p, "workload seed")
    add_plot(p, "queue length and Jain's index over time, per policy")
    add_json(p)
    add_quiet(p)


def _s(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}"


def table(runs: list[dict[str, Any]]) -> str:
    """One experiment's runs (one per policy) as a Markdown table: goodput,
    refused share, time to fairness and the scarcity's mean Jain index, p99
    TTFT and refusals per tenant (class in brackets)."""
    tenants = [t["name"] for t in runs[0]["tenants"]]
    head = ["policy", "goodput (tok/s)", "refused", "time to fairness (s)", "Jain (scarcity)"]
    head += [f"{t} p99 TTFT (s) / refused" for t in tenants]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [
            r["policy"],
            f"{r['goodput_tokens_per_s']:.0f}",
            f"{100 * r['refused_share']:.1f}%",
            _s(r["time_to_fairness_s"]),
            _s(r["scarcity_jain"]),
        ]
        for t in r["tenants"]:
            share = t["refused"] / max(t["requests"], 1)
            cells.append(f"{_s(t['p99_ttft_s'])} / {100 * share:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    classes = ", ".join(
        f"{c['name']} p99 {_s(c['p99_ttft_s'])} s" for r in runs[-1:] for c in r["classes"]
    )
    return "\n".join(lines) + f"\n\ntoken-pool per class: {classes}"


def plot(experiments: list[list[dict[str, Any]]], path: str, title: str) -> None:
    """Per experiment: requests waiting in the queue over time, and Jain's
    index of the tenants' shares over time, a line per policy."""
    fig, axes = _plot.figure(title, 2 * len(experiments), (11, 4.2 * len(experiments)))
    for k, runs in enumerate(experiments):
        queue, jain = axes[2 * k], axes[2 * k + 1]
        for r in runs:
            t = [s["t"] for s in r["timeline"]]
            queue.plot(t, [s["queued"] for s in r["timeline"]], label=r["policy"])
            jain.plot(t, [s["jain"] for s in r["timeline"]], label=r["policy"])
        name = runs[0]["name"]
        queue.set_title(f"{name}: queue")
        queue.set_ylabel("requests waiting")
        jain.set_title(f"{name}: fairness")
        jain.set_ylabel("Jain's index since the phase began")
        jain.set_ylim(0.4, 1.02)
        for ax in (queue, jain):
            ax.set_xlabel("time (s)")
            ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(POLICIES), fontsize=8)
    _plot.save(fig, path)


def run(args: argparse.Namespace) -> int:
    numbers = [1, 2] if args.experiment == "both" else [int(args.experiment)]
    experiments: list[list[dict[str, Any]]] = []
    total, done = len(numbers) * len(POLICIES), 0
    for n in numbers:
        runs = []
        for policy in POLICIES:
            runs.append(flow_eval(n, policy, scale=args.scale, ttl_s=args.ttl, seed=args.seed))
            done += 1
            if not args.quiet:
                print(f"flow-eval: experiment {n}, {policy} ({done}/{total})", file=sys.stderr)
        experiments.append(runs)
    if args.json:
        out = {
            "scale": args.scale,
            "ttl_s": args.ttl,
            "seed": args.seed,
            "experiments": [
                {
                    "experiment": runs[0]["experiment"],
                    "name": runs[0]["name"],
                    "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in runs],
                }
                for runs in experiments
            ],
        }
        print(_json.dumps(out))
    else:
        for runs in experiments:
            print(runs[0]["name"])
            print(table(runs))
            print()
    if args.plot:
        title = (
            f"Flow control, token-pool paper's experiments (x{args.scale:g}, TTL {args.ttl:g} s, "
            f"seed {args.seed})"
        )
        plot(experiments, args.plot, title)
    return 0
