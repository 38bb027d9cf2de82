"""The paper's two experiments, replayed on a simulated clock and backend.

Cunningham (2026), section 5: one quota of 16 "slots" (concurrent sequences) at
about 240 tokens/s. The simulated backend runs at most ``slots`` requests at
once (others wait in FIFO order), each for ``tokens / 15`` seconds (one slot's
share of 240 tokens/s), times a seeded factor in [0.75, 1.25]: decode speed
varies, and equal lengths would otherwise finish in lockstep. Clients are
closed loops (starting within a second of their tenant): each sends a
request, waits for it to finish and sends the next, or after a 429 waits the
Retry-After the controller computed and tries again. Everything is seeded, so a scenario's
timeline is the same on every run.

Experiment 1 (cross-class protection): guaranteed-a (6 slots), spot-b (10),
guaranteed-c (6, bound from 30 s to 60 s); 64-token prompts and outputs.
Experiment 2 (SLO-aware fair share): elastic copilot (500 ms SLO), synth
(30 s) and reports (5 s, bound from 210 s), 5 slots each and 6 clients each;
capacity halves to 8 slots from 30 s to 120 s; lengths 32 to 176 tokens.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

from routecore._core import AdmissionController, Entitlement, Quota
from routecore._extras import pyplot
from routecore.commands import _plot

SLOT_RATE = 15.0  # tokens/s per slot: 240 tokens/s over 16 slots
QUOTA = "qwen3-8b"


@dataclass
class Tenant:
    entitlement: Entitlement
    clients: int
    start: float
    end: float


@dataclass
class Scenario:
    name: str
    duration: float
    slots: int
    tenants: list[Tenant]
    lengths: tuple[int, int]  # uniform prompt and output length range
    # (time, slots): capacity changes of quota and backend
    capacity: list[tuple[float, int]] = field(default_factory=list)
    seed: int = 7


def _ent(name: str, cls: str, slo_ms: float, slots: int, state: str = "bound") -> Entitlement:
    # A token budget 20% above the slots' throughput: the slots bind, as in the paper.
    tokens_per_s = 1.2 * slots * SLOT_RATE
    return Entitlement(name, name, QUOTA, cls, slo_ms, tokens_per_s, 2**32, slots, state)


def experiment(number: int) -> Scenario:
    """Experiment 1 or 2 of the paper."""
    if number == 1:
        return Scenario(
            name="experiment 1: cross-class protection",
            duration=90.0,
            slots=16,
            tenants=[
                Tenant(_ent("guaranteed-a", "guaranteed", 1000.0, 6), 6, 0.0, 90.0),
                Tenant(_ent("spot-b", "spot", 1000.0, 10), 10, 0.0, 90.0),
                Tenant(_ent("guaranteed-c", "guaranteed", 1000.0, 6, "pending"), 6, 30.0, 60.0),
            ],
            lengths=(64, 64),
        )
    if number == 2:
        return Scenario(
            name="experiment 2: SLO-aware fair share",
            duration=300.0,
            slots=16,
            tenants=[
                Tenant(_ent("elastic-copilot", "elastic", 500.0, 5), 6, 0.0, 300.0),
                Tenant(_ent("elastic-synth", "elastic", 30_000.0, 5), 6, 0.0, 300.0),
                Tenant(_ent("elastic-reports", "elastic", 5_000.0, 5, "pending"), 6, 210.0, 300.0),
            ],
            lengths=(32, 176),
            capacity=[(30.0, 8), (120.0, 16)],
        )
    raise ValueError(f"experiment must be 1 or 2, got {number}")


@dataclass
class Second:
    """The state at the end of one simulated second."""

    t: int
    slots: int
    running: int
    queued: int
    in_flight: dict[str, int]
    admitted: dict[str, int]
    denied: Counter[tuple[str, str]]  # (entitlement, reason) -> count in this second
    debt: dict[str, float]
    priority: dict[str, float]


def run(scenario: Scenario) -> list[Second]:
    """Simulates ``scenario``; one ``Second`` per simulated second."""
    names = [t.entitlement.name for t in scenario.tenants]
    ctl = AdmissionController(
        [Quota(QUOTA, SLOT_RATE * scenario.slots, 2**40, scenario.slots)],
        [t.entitlement for t in scenario.tenants],
    )
    rng = random.Random(scenario.seed)
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def push(at: float, kind: str, data: tuple = ()) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, data))

    # State and capacity changes come first at their instant.
    for tenant in scenario.tenants:
        if tenant.entitlement.state != "bound":
            push(tenant.start, "state", (tenant.entitlement.name, "bound"))
            push(tenant.end, "state", (tenant.entitlement.name, "expired"))
    for at, slots in scenario.capacity:
        push(at, "capacity", (slots,))
    for t in range(1, int(scenario.duration) + 1):
        push(float(t), "sample")
    for tenant in scenario.tenants:
        for _ in range(tenant.clients):
            push(tenant.start + rng.uniform(0.0, 1.0), "send", (tenant,))

    slots = scenario.slots
    running: set[int] = set()
    queue: list[tuple[int, float, int]] = []  # ticket, submitted, tokens
    in_flight = Counter[str]()
    admitted = Counter[str]()
    denied = Counter[tuple[str, str]]()
    timeline: list[Second] = []
    lo, hi = scenario.lengths

    def start_waiting(now: float) -> None:
        while queue and len(running) < slots:
            ticket, submitted, tokens = queue.pop(0)
            running.add(ticket)
            jitter = rng.uniform(0.75, 1.25)
            push(now + jitter * tokens / SLOT_RATE, "finish", (ticket, submitted, tokens))

    owner: dict[int, tuple[Tenant, int, int]] = {}
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > scenario.duration:
            break
        if kind == "state":
            ctl.set_state(*data)
        elif kind == "capacity":
            slots = data[0]
            ctl.set_capacity(QUOTA, tokens_per_s=SLOT_RATE * slots, concurrency=slots)
            start_waiting(now)
        elif kind == "send":
            (tenant,) = data
            if now >= tenant.end:
                continue
            name = tenant.entitlement.name
            prompt, output = rng.randint(lo, hi), rng.randint(lo, hi)
            a = ctl.admit(name, prompt, output, now)
            if a.admitted:
                assert a.ticket is not None
                admitted[name] += 1
                in_flight[name] += 1
                owner[a.ticket] = (tenant, prompt, output)
                queue.append((a.ticket, now, prompt + output))
                start_waiting(now)
            else:
                denied[(name, a.reason)] += 1
                push(now + (a.retry_after_s or 1.0), "send", (tenant,))
        elif kind == "finish":
            ticket, submitted, _ = data
            running.discard(ticket)
            tenant, prompt, output = owner.pop(ticket)
            ctl.complete(ticket, prompt, output, now - submitted, now)
            in_flight[tenant.entitlement.name] -= 1
            push(now, "send", (tenant,))
            start_waiting(now)
        else:  # sample
            timeline.append(
                Second(
                    t=int(now),
                    slots=slots,
                    running=len(running),
                    queued=len(queue),
                    in_flight={n: in_flight[n] for n in names},
                    admitted={n: admitted[n] for n in names},
                    denied=denied.copy(),
                    debt={n: ctl.stats(n)["debt"] for n in names},
                    priority={n: ctl.priority(n) for n in names},
                )
            )
            admitted.clear()
            denied.clear()
    return timeline


def table(timeline: list[Second], every: int = 10) -> str:
    """The timeline every ``every`` seconds: per entitlement in flight, admitted
    and denied (all reasons, summed over the interval), debt and priority."""
    names = list(timeline[0].in_flight)
    head = f"{'t':>4} {'slots':>5} {'run':>3} {'wait':>4}"
    for n in names:
        head += f" | {n:>15} {'adm':>4} {'deny':>4} {'debt':>6} {'w':>7}"
    lines = [head, "-" * len(head)]
    for k in range(0, len(timeline), every):
        chunk = timeline[k : k + every]
        last = chunk[-1]
        row = f"{last.t:>4} {last.slots:>5} {last.running:>3} {last.queued:>4}"
        for n in names:
            adm = sum(s.admitted[n] for s in chunk)
            deny = sum(c for s in chunk for (e, _), c in s.denied.items() if e == n)
            row += (
                f" | {last.in_flight[n]:>15} {adm:>4} {deny:>4}"
                f" {last.debt[n]:>6.3f} {last.priority[n]:>7.2f}"
            )
        lines.append(row)
    return "\n".join(lines)


def summary(timeline: list[Second]) -> str:
    """Per entitlement over the whole run (the paper's Table 2): requests
    admitted, denials for low priority (quota contention) and for other
    reasons (concurrency, token budget), and the peak service debt."""
    lines = [
        f"{'entitlement':<16} {'admitted':>8} {'low-priority':>12} {'other':>6} {'peak debt':>9}"
    ]
    for n in timeline[0].in_flight:
        low = sum(s.denied[(n, "quota-contention")] for s in timeline)
        other = sum(c for s in timeline for (e, _), c in s.denied.items() if e == n) - low
        adm = sum(s.admitted[n] for s in timeline)
        peak = max(s.debt[n] for s in timeline)
        lines.append(f"{n:<16} {adm:>8} {low:>12} {other:>6} {peak:>9.3f}")
    return "\n".join(lines)


def plot(timeline: list[Second], title: str, path: str) -> None:
    """Writes a PNG: in flight per entitlement with the quota's slots, denials
    per second, service debt and priority weight over time."""
    plt = pyplot()

    names = list(timeline[0].in_flight)
    t = [s.t for s in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10.5), sharex=True, layout="constrained")
    for n in names:
        axes[0].plot(t, [s.in_flight[n] for s in timeline], label=n)
        axes[1].plot(t, [sum(c for (e, _), c in s.denied.items() if e == n) for s in timeline])
        axes[2].plot(t, [s.debt[n] for s in timeline])
        axes[3].plot(t, [s.priority[n] for s in timeline])
    axes[0].step(t, [s.slots for s in timeline], "k--", where="post", label="quota slots")
    labels = ["requests in flight", "denials per second", "service debt d_e", "priority w_e (log)"]
    for ax, label in zip(axes, labels):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for counts in axes[:2]:  # whole requests
        counts.yaxis.get_major_locator().set_params(integer=True)
    _plot.plain_log_axis(axes[3].yaxis)
    axes[3].set_xlabel("time (s)")
    fig.suptitle(title)
    fig.legend(loc="outside lower center", ncols=len(names) + 1, fontsize=8)
    _plot.save(fig, path)
