"""Quota admission (Cunningham 2026) in memory: the paper's numbers, the
checks in order with Retry-After from the state, batched = single, snapshots,
bad input, and both experiments as deterministic scenarios."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import (
    Admission,
    AdmissionController,
    Entitlement,
    InMemoryAdmission,
    NotInFlightError,
    Quota,
    admission_from_config,
    admission_scenarios,
    priority_weight,
)
from routecore.cli import main

QUOTA = Quota("p", 240.0, 2**30, 16)


def paper_controller() -> AdmissionController:
    ents = [
        Entitlement("copilot", "dev", "p", "elastic", 500.0, 75.0, 2**28, 5),
        Entitlement("synth", "data", "p", "elastic", 30_000.0, 75.0, 2**28, 5),
        Entitlement("reports", "bi", "p", "elastic", 5_000.0, 75.0, 2**28, 5, "pending"),
    ]
    return AdmissionController([QUOTA], ents)


def test_paper_priorities():
    # Quota-average SLO over the bound entitlements: (500 + 30000) / 2 = 15250 ms.
    ctl = paper_controller()
    copilot, synth = ctl.priority("copilot"), ctl.priority("synth")
    assert copilot == pytest.approx(100 / (1 + 2 * 500 / 15_250))
    assert copilot == pytest.approx(93.8, abs=0.05)
    assert synth == pytest.approx(20.3, abs=0.05)
    assert copilot / synth == pytest.approx(4.6, abs=0.05)
    # Synth at its peak debt 0.775: 20.3 * (1 + 4 * 0.775) ~= 83.2.
    at_debt = priority_weight("elastic", 30_000.0, 15_250.0, debt=0.775)
    assert at_debt == pytest.approx(83.2, abs=0.15)
    assert copilot / at_debt == pytest.approx(1.13, abs=0.01)
    # Class weights of Table 1 dominate; burst divides.
    assert priority_weight("guaranteed", 1.0, 1.0) == pytest.approx(1000 / 3)
    assert priority_weight("preemptible", 1.0, 1.0) == pytest.approx(0.1 / 3)
    assert priority_weight("spot", 1.0, 1.0, burst=1.0) == pytest.approx(1 / 6)
    ctl.set_state("reports", "bound")
    mean = (500 + 30_000 + 5_000) / 3
    assert ctl.priority("reports") == pytest.approx(100 / (1 + 2 * 5_000 / mean))


def test_checks_in_order_with_retry_after_from_state():
    ents = [
        Entitlement("g", "t", "p", "guaranteed", 1000.0, 10.0, 2**20, 2),
        Entitlement("x", "t", "p", "elastic", 1000.0, 10.0, 2**20, 2, "degraded"),
    ]
    ctl = AdmissionController([QUOTA], ents, default_max_tokens=50, window_s=10.0)
    a = ctl.admit("nobody", 1, 1, 0.0)
    assert (a.admitted, a.status, a.reason, a.ticket) == (False, 401, "unknown-entitlement", None)
    assert (ctl.admit("x", 1, 1, 0.0).status, ctl.admit("x", 1, 1, 0.0).reason) == (
        403,
        "degraded",
    )
    # Budget 10 tokens/s * 10 s = 100; 10 + default 50 = 60 fits once.
    first = ctl.admit("g", 10, None, 0.0)
    assert first.admitted and first.status == 200 and first.ticket is not None
    a = ctl.admit("g", 10, None, 4.0)
    assert (a.status, a.reason, a.retry_after_s) == (429, "token-budget", 6.0)
    assert ctl.admit("g", 101, 1, 4.0).status == 413
    assert ctl.stats("g")["window_tokens"] == 60
    # Two in flight at the observed 2 s latency: one ends every second.
    ctl.complete(first.ticket, 10, 10, 2.0, 4.0)
    assert ctl.stats("g")["window_tokens"] == 20
    assert ctl.admit("g", 10, 30, 4.0).admitted and ctl.admit("g", 0, 10, 4.0).admitted
    a = ctl.admit("g", 0, 1, 5.0)
    assert (a.status, a.reason, a.retry_after_s) == (429, "concurrency", 1.0)


def test_quota_contention_and_evictions():
    quota = Quota("p", 100.0, 2**30, 2)
    ents = [
        Entitlement("g", "t", "p", "guaranteed", 100.0, 1e6, 2**20, 4),
        Entitlement("pre", "t", "p", "preemptible", 100.0, 1e6, 2**20, 4),
    ]
    ctl = AdmissionController([quota], ents)
    p1 = ctl.admit("pre", 10, 40, 0.0).ticket
    p2 = ctl.admit("pre", 10, 40, 1.0).ticket
    # Full: preemptible cannot beat its own priority; retry when one of the
    # two 50-token requests at 50 tokens/s/slot is due: 1 / (2 / 1 s).
    a = ctl.admit("pre", 10, 40, 1.0)
    assert (a.reason, a.retry_after_s) == ("quota-contention", 0.5)
    assert ctl.evictions(1.0) == []
    assert ctl.admit("g", 10, 40, 2.0).admitted  # 1000/3 beats 0.1/3
    assert ctl.quota_in_flight("p") == 3
    assert ctl.evictions(2.0) == [p2]  # one over, youngest preemptible first
    ctl.complete(p2, 10, 5, 1.0, 2.5)
    assert ctl.evictions(2.5) == []
    with pytest.raises(NotInFlightError):
        ctl.complete(p2, 10, 5, 1.0, 2.5)
    ctl.complete(p1, 10, 5, 1.0, 2.5)


def test_capacity_changes_at_run_time():
    ctl = paper_controller()
    tickets = [ctl.admit("synth", 10, 10, 0.0).ticket for _ in range(6)]
    assert all(t is not None for t in tickets)
    ctl.set_capacity("p", tokens_per_s=120.0, concurrency=6)
    assert ctl.quotas[0].concurrency == 6 and ctl.quotas[0].tokens_per_s == 120.0
    # Synth (6 in flight, above its 5) may no longer burst; copilot outranks it.
    assert ctl.admit("synth", 1, 1, 1.0).reason == "concurrency"
    assert ctl.admit("copilot", 1, 1, 1.0).admitted
    ctl.set_capacity("p", concurrency=16)
    assert ctl.admit("synth", 1, 1, 2.0).admitted


ADMIT_CASES = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 500), st.integers(1, 500)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(ADMIT_CASES, st.booleans())
def test_admit_many_equals_admit_one_by_one(cases, default_max):
    one = paper_controller()
    one.set_state("reports", "bound")
    many = AdmissionController.from_bytes(one.to_bytes())
    names = ["copilot", "synth", "reports"]
    expected = []
    for e, i, m in cases:
        a = one.admit(names[e], i, None if default_max else m, 3.0)
        expected.append((a.status, -1 if a.ticket is None else a.ticket))
    ids = np.array([many.entitlement_id(names[e]) for e, _, _ in cases])
    inputs = np.array([i for _, i, _ in cases], dtype=np.int32)
    maxes = None if default_max else np.array([m for _, _, m in cases])
    status, tickets = many.admit_many(ids, inputs, maxes, 3.0)
    assert list(zip(status.tolist(), tickets.tolist())) == expected
    assert many.to_bytes() == one.to_bytes()


def test_bad_input_changes_nothing():
    ctl = paper_controller()
    t = ctl.admit("copilot", 5, 5, 1.0).ticket
    before = ctl.to_bytes()
    for call in [
        lambda: ctl.admit("copilot", -1, 5, 2.0),
        lambda: ctl.admit("copilot", 1, 0, 2.0),
        lambda: ctl.admit("copilot", 1, 2**40, 2.0),
        lambda: ctl.admit("copilot", 1, 5, float("nan")),
        lambda: ctl.complete(t, -1, 1, 1.0, 2.0),
        lambda: ctl.complete(t, 1, 1, float("nan"), 2.0),
        lambda: ctl.set_capacity("p", concurrency=0),
        lambda: ctl.set_capacity("p", tokens_per_s=float("inf")),
        lambda: ctl.set_state("copilot", "gone"),
        lambda: ctl.admit_many([0, 9], [1, 1], None, 2.0),
        lambda: ctl.admit_many([0, 1], [1, -1], None, 2.0),
        lambda: ctl.admit_many([0, 1], [1], None, 2.0),
        lambda: ctl.admit_many([0.5], [1], None, 2.0),
    ]:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(NotInFlightError, match="not in flight"):
        ctl.complete(t + 1, 1, 1, 1.0, 2.0)
    for call in [
        lambda: ctl.set_state("nobody", "bound"),
        lambda: ctl.set_capacity("q", concurrency=1),
        lambda: ctl.priority("nobody"),
        lambda: ctl.entitlement_id("nobody"),
    ]:
        with pytest.raises(KeyError):
            call()
    assert ctl.to_bytes() == before
    with pytest.raises(ValueError):
        Quota("p", 1.0, 0, 1)
    with pytest.raises(ValueError):
        Entitlement("e", "t", "p", "gold", 1.0, 1.0, 1, 1)
    with pytest.raises(ValueError):
        Entitlement("e", "t", "p", "spot", 1.0, 1.0, 1, 1, state="bogus")
    with pytest.raises(KeyError):
        AdmissionController([QUOTA], [Entitlement("e", "t", "q", "spot", 1.0, 1.0, 1, 1)])
    with pytest.raises(ValueError):
        AdmissionController([QUOTA, QUOTA], [])
    with pytest.raises(ValueError):
        priority_weight("elastic", 0.0, 1.0)


def test_snapshot_and_pickle_restore_exactly():
    ctl = paper_controller()
    t = ctl.admit("copilot", 5, 5, 1.0).ticket
    ctl.admit("synth", 7, None, 1.5)
    ctl.complete(t, 5, 3, 0.7, 2.0)
    data = ctl.to_bytes()
    for back in (AdmissionController.from_bytes(data), pickle.loads(pickle.dumps(ctl))):
        assert back.to_bytes() == data
        assert back.stats("copilot") == ctl.stats("copilot")
    a, b = back.admit("synth", 1, 1, 3.0), ctl.admit("synth", 1, 1, 3.0)
    assert (a.status, a.ticket) == (b.status, b.ticket)
    quota, ent = ctl.quotas[0], ctl.entitlements[2]
    assert repr(pickle.loads(pickle.dumps(quota))) == repr(quota)
    back_ent = pickle.loads(pickle.dumps(ent))
    assert (back_ent.name, back_ent.state, back_ent.slo_target_ms) == ("reports", "pending", 5e3)
    adm = pickle.loads(pickle.dumps(a))
    assert (adm.admitted, adm.status, adm.reason, adm.ticket) == (True, 200, "admitted", a.ticket)
    with pytest.raises(ValueError):
        AdmissionController.from_bytes(data[:-1])
    with pytest.raises(ValueError):
        AdmissionController.from_bytes(b"nope")


def test_in_memory_backend_and_config():
    backend = admission_from_config(
        {
            "quotas": [{"name": "p", "tokens_per_s": 240.0, "kv_bytes": 2**30, "concurrency": 2}],
            "entitlements": [
                {
                    "name": "e",
                    "tenant": "t",
                    "quota": "p",
                    "service_class": "guaranteed",
                    "slo_target_ms": 500.0,
                    "tokens_per_s": 100.0,
                    "kv_bytes": 2**20,
                    "concurrency": 1,
                }
            ],
        }
    )
    assert isinstance(backend, InMemoryAdmission)
    a = backend.admit("e", 10, 10)
    assert isinstance(a, Admission) and a.admitted
    assert backend.quota_in_flight("p") == 1
    assert backend.admit("e", 10, 10).reason == "concurrency"
    assert backend.complete(a.ticket, 10, 10, 0.1) is True
    before = backend.controller.to_bytes()
    for ticket in (a.ticket, None):  # completed already; admitted without a ticket
        with pytest.raises(NotInFlightError):
            backend.complete(ticket, 10, 10, 0.1)
    assert backend.controller.to_bytes() == before  # never twice
    assert backend.quota_in_flight("p") == 0
    with pytest.raises(ValueError):
        admission_from_config({"backend": "etcd", "quotas": [], "entitlements": []})


def _denials(timeline, name, reason, start=0, end=10**9):
    return sum(s.denied[(name, reason)] for s in timeline if start < s.t <= end)


def test_experiment_1_cross_class_protection():
    tl = admission_scenarios.run(admission_scenarios.experiment(1))
    assert tl == admission_scenarios.run(admission_scenarios.experiment(1))  # deterministic
    denied = Counter()
    for s in tl:
        denied.update(name for name, _ in s.denied.elements())
    # Guaranteed requests are never rejected (their clients stay within limits).
    assert denied["guaranteed-a"] == 0 and denied["guaranteed-c"] == 0
    # Spot absorbs the rejections while guaranteed-c is bound, squeezed to the
    # 16 - 12 slots left; the quota stays full and nothing waits after the join.
    assert _denials(tl, "spot-b", "quota-contention", 30, 60) > 100
    assert all(s.in_flight["spot-b"] <= 4 for s in tl if 40 <= s.t <= 60)
    busy = [s.running for s in tl if s.t >= 2]
    assert min(busy) >= 15 and sum(busy) / len(busy) > 15.9
    assert all(s.queued == 0 for s in tl if 40 <= s.t)
    # Spot recovers its 10 slots once guaranteed-c leaves.
    assert all(s.in_flight["spot-b"] == 10 for s in tl if s.t >= 75)
    assert _denials(tl, "spot-b", "quota-contention", 75) == 0


def test_experiment_2_slo_aware_fair_share():
    tl = admission_scenarios.run(admission_scenarios.experiment(2))
    at = {s.t: s for s in tl}
    copilot, synth = "elastic-copilot", "elastic-synth"
    # Copilot never loses on priority; synth absorbs the low-priority denials.
    assert _denials(tl, copilot, "quota-contention") == 0
    assert _denials(tl, synth, "quota-contention", 30, 120) > 100
    outage = [s for s in tl if 40 <= s.t < 120]
    assert all(s.slots == 8 and s.in_flight[copilot] >= 4 for s in outage)
    assert max(s.in_flight[synth] for s in outage) <= 3
    # Both accumulate debt during the outage, synth more; it decays after.
    for name in (copilot, synth):
        assert at[120].debt[name] - at[30].debt[name] > 0.1
    peak = {n: max(s.debt[n] for s in tl if s.t <= 150) for n in (copilot, synth)}
    assert peak[synth] > 2 * peak[copilot] > 0
    assert at[210].debt[synth] < 0.5 * peak[synth]
    assert at[210].debt[copilot] < 0.5 * peak[copilot]
    # The debt narrows the priority gap without reversing it.
    gap = [s.priority[copilot] / s.priority[synth] for s in outage]
    assert gap[-1] < gap[0] and min(gap) > 1
    # Reports joins at 210 and competes: everybody sees denials, copilot least.
    assert at[209].in_flight["elastic-reports"] == 0 and at[230].in_flight["elastic-reports"] > 0


def test_admission_scenario_command(tmp_path, capsys):
    png = tmp_path / "e2.png"
    assert main(["admission-scenario", "2", "--every", "30", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("experiment 2") and "copilot" in out and "synth" in out
    lines = out.strip().splitlines()
    assert len(lines) == 1 + 2 + 300 // 30 + 1 + 1 + 3 + 1
    assert lines[-1] == f"plot written to {png}"
    # The summary's copilot row: never denied for low priority.
    row = next(line for line in lines[::-1] if line.startswith("elastic-copilot"))
    assert row.split()[2] == "0"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["admission-scenario", "1", "--every", "0"]) == 2


@pytest.mark.parametrize("number", [1, 2])
def test_readme_tables_match_the_scenarios(number):
    page = (Path(__file__).resolve().parent.parent / "docs/admission.md").read_text("utf-8")
    timeline = admission_scenarios.run(admission_scenarios.experiment(number))
    for line in admission_scenarios.summary(timeline).splitlines()[1:]:
        name, admitted, low, other, peak = line.split()
        assert f"| {name} | {admitted} | {low} | {other} | {peak} |" in page
