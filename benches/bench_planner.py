"""Queueing and the FleetOpt planner: routecore beside the Python planner of
the same models (routecore/_baselines/planner.py: the trace's sort and prefix
sums in NumPy, the sweep in Python), same run: the engine model (the default)
and the paper's Eq. 3-4.

Two ways to time a plan, each on both sides:

- cold: the plan of a trace given as arrays (the Azure trace's token
  counts), the workload built on every call (routecore: ``Workload(inputs,
  outputs)``, whose prefix-sum table is built by the first plan; the twin:
  ``Trace(inputs, outputs)``);
- warm: the sweep alone over a workload built and planned once before
  (routecore keeps its table per workload; the twin keeps its ``Trace``).

Run: .venv/bin/python -m pytest benches/bench_planner.py
"""

import pytest

from routecore import Profile, Workload, erlang_c, plan, plan_disaggregated
from routecore._baselines import planner as baseline

AZURE = Workload.azure_2023()
B_SHORT = [
    256,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    32768,
    49152,
]
GAMMAS = [k / 10 for k in range(10, 21)]
PROFILE = Profile.llama3_70b_a100().replace(h_ref_tokens=8192)
INPUTS, OUTPUTS = AZURE.input_tokens, AZURE.output_tokens
C_CHUNK = 512  # the profile's prefill chunk, routecore's and the twin's default


def routecore_sweep(workload):
    return plan(workload, 1000.0, 0.5, PROFILE, b_short=B_SHORT, gammas=GAMMAS, model="paper")


def baseline_sweep(trace):
    return baseline.plan(trace, 1000.0, 0.5, b_short=B_SHORT, gammas=GAMMAS, h_ref=8192)


def routecore_engine_sweep(workload):
    return plan(workload, 1000.0, 2.0, b_short=B_SHORT, gammas=GAMMAS, slo_tpot_s=0.08)


def baseline_engine_sweep(trace):
    return baseline.plan_engine(trace, 1000.0, 2.0, 0.08, b_short=B_SHORT, gammas=GAMMAS)


def workload():
    """routecore's workload of the trace's arrays."""
    return Workload(INPUTS, OUTPUTS)


def trace():
    """The twin's trace of the same arrays."""
    return baseline.Trace(INPUTS, OUTPUTS, C_CHUNK)


def assert_same_fleets(r, baseline_result):
    """The Python twin plans the same homogeneous fleet and the same
    (n_short, n_long) for every (B_short, gamma) candidate."""
    homo, fleets = baseline_result
    assert homo == r.homogeneous.gpus
    assert len(fleets) == len(r.sweep) == 165
    for c in r.sweep:
        assert fleets[(c.b_short, c.gamma)] == (c.n_short, c.n_long)


def test_engine_baseline_agrees_with_routecore():
    assert_same_fleets(routecore_engine_sweep(workload()), baseline_engine_sweep(trace()))


def test_baseline_agrees_with_routecore():
    assert_same_fleets(routecore_sweep(workload()), baseline_sweep(trace()))
    for c, rho in [(32_768, 0.85), (1000, 0.95), (50, 0.5)]:
        assert baseline.erlang_c(c, rho * c) == pytest.approx(erlang_c(c, rho * c), rel=1e-12)


ENGINE = "plan, engine model: Azure trace, 15 B_short x 11 gamma"
DISAGG = "engine model, Azure trace at 1,000 req/s: a P/D plan beside the aggregated"


@pytest.mark.benchmark(group=DISAGG)
def test_plan_disaggregated_routecore(benchmark):
    """Prefill, decode and aggregated pools (issue 25), warm workload."""
    w = workload()
    d = benchmark(plan_disaggregated, w, 1000.0, 2.0, slo_tpot_s=0.08)
    assert d.gpus == d.n_prefill + d.n_decode


@pytest.mark.benchmark(group=DISAGG)
def test_plan_aggregated_one_candidate_routecore(benchmark):
    """``plan`` with one (B_short, gamma) candidate: its homogeneous pool and
    one two-pool fleet, warm workload."""
    w = workload()
    plan(w, 1000.0, 2.0, b_short=[4096], gammas=[1.0], slo_tpot_s=0.08)
    r = benchmark(plan, w, 1000.0, 2.0, b_short=[4096], gammas=[1.0], slo_tpot_s=0.08)
    assert r.homogeneous.gpus > 0


PAPER = "plan, paper model: Azure trace, 15 B_short x 11 gamma"


@pytest.mark.benchmark(group=f"{ENGINE}, cold (workload built from the arrays)")
def test_plan_engine_cold_routecore(benchmark):
    assert benchmark(lambda: routecore_engine_sweep(workload())).best is not None


@pytest.mark.benchmark(group=f"{ENGINE}, cold (workload built from the arrays)")
def test_plan_engine_cold_python(benchmark):
    homo, _ = benchmark.pedantic(lambda: baseline_engine_sweep(trace()), rounds=5)
    assert homo > 0


@pytest.mark.benchmark(group=f"{ENGINE}, warm (the workload's table built before)")
def test_plan_engine_warm_routecore(benchmark):
    w = workload()
    routecore_engine_sweep(w)
    assert benchmark(routecore_engine_sweep, w).best is not None


@pytest.mark.benchmark(group=f"{ENGINE}, warm (the workload's table built before)")
def test_plan_engine_warm_python(benchmark):
    t = trace()
    baseline_engine_sweep(t)
    homo, _ = benchmark.pedantic(baseline_engine_sweep, (t,), rounds=5)
    assert homo > 0


@pytest.mark.benchmark(group=f"{PAPER}, cold (workload built from the arrays)")
def test_plan_cold_routecore(benchmark):
    assert benchmark(lambda: routecore_sweep(workload())).best is not None


@pytest.mark.benchmark(group=f"{PAPER}, cold (workload built from the arrays)")
def test_plan_cold_python(benchmark):
    homo, _ = benchmark.pedantic(lambda: baseline_sweep(trace()), rounds=5)
    assert homo > 0


@pytest.mark.benchmark(group=f"{PAPER}, warm (the workload's table built before)")
def test_plan_warm_routecore(benchmark):
    w = workload()
    routecore_sweep(w)
    assert benchmark(routecore_sweep, w).best is not None


@pytest.mark.benchmark(group=f"{PAPER}, warm (the workload's table built before)")
def test_plan_warm_python(benchmark):
    t = trace()
    baseline_sweep(t)
    homo, _ = benchmark.pedantic(baseline_sweep, (t,), rounds=5)
    assert homo > 0


@pytest.mark.benchmark(group="erlang_c: c = 32,768, rho = 0.85")
def test_erlang_c_routecore(benchmark):
    assert 0 <= benchmark(erlang_c, 32_768, 0.85 * 32_768) < 1e-100


@pytest.mark.benchmark(group="erlang_c: c = 32,768, rho = 0.85")
def test_erlang_c_plain_python(benchmark):
    assert 0 <= benchmark(baseline.erlang_c, 32_768, 0.85 * 32_768) < 1e-100


@pytest.mark.benchmark(group="erlang_c: c = 32,768, rho = 0.99")
def test_erlang_c_near_saturation_routecore(benchmark):
    assert 0 < benchmark(erlang_c, 32_768, 0.99 * 32_768) < 1


@pytest.mark.benchmark(group="erlang_c: c = 32,768, rho = 0.99")
def test_erlang_c_near_saturation_plain_python(benchmark):
    assert 0 < benchmark(baseline.erlang_c, 32_768, 0.99 * 32_768) < 1
