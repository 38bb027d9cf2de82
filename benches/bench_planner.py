"""Queueing and the FleetOpt planner: routecore beside the plain-Python
planner of the same models (routecore/_baselines/planner.py), same run: the
engine model (the default) and the paper's Eq. 3-4.

Run: .venv/bin/python -m pytest benches/bench_planner.py
"""

import pytest

from routecore import Profile, Workload, erlang_c, plan
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
INPUTS = AZURE.input_tokens.tolist()
OUTPUTS = AZURE.output_tokens.tolist()


def routecore_sweep():
    return plan(AZURE, 1000.0, 0.5, PROFILE, b_short=B_SHORT, gammas=GAMMAS, model="paper")


def baseline_sweep():
    return baseline.plan(INPUTS, OUTPUTS, 1000.0, 0.5, b_short=B_SHORT, gammas=GAMMAS, h_ref=8192)


def routecore_engine_sweep():
    return plan(AZURE, 1000.0, 2.0, b_short=B_SHORT, gammas=GAMMAS, slo_tpot_s=0.08)


def baseline_engine_sweep():
    return baseline.plan_engine(INPUTS, OUTPUTS, 1000.0, 2.0, 0.08, b_short=B_SHORT, gammas=GAMMAS)


def assert_same_fleets(r, baseline_result):
    """The plain-Python twin plans the same homogeneous fleet and the same
    (n_short, n_long) for every (B_short, gamma) candidate."""
    homo, fleets = baseline_result
    assert homo == r.homogeneous.gpus
    assert len(fleets) == len(r.sweep) == 165
    for c in r.sweep:
        assert fleets[(c.b_short, c.gamma)] == (c.n_short, c.n_long)


def test_engine_baseline_agrees_with_routecore():
    assert_same_fleets(routecore_engine_sweep(), baseline_engine_sweep())


@pytest.mark.benchmark(group="plan, engine model: Azure trace, 15 B_short x 11 gamma")
def test_plan_engine_sweep_routecore(benchmark):
    routecore_engine_sweep()  # the trace's prefix-sum table is built once per chunk size
    r = benchmark(routecore_engine_sweep)
    assert r.best is not None


@pytest.mark.benchmark(group="plan, engine model: Azure trace, 15 B_short x 11 gamma")
def test_plan_engine_sweep_plain_python(benchmark):
    homo, _ = benchmark.pedantic(baseline_engine_sweep, rounds=3, iterations=1)
    assert homo > 0


def test_baseline_agrees_with_routecore():
    assert_same_fleets(routecore_sweep(), baseline_sweep())
    for c, rho in [(32_768, 0.85), (1000, 0.95), (50, 0.5)]:
        assert baseline.erlang_c(c, rho * c) == pytest.approx(erlang_c(c, rho * c), rel=1e-12)


@pytest.mark.benchmark(group="plan, paper model: Azure trace, 15 B_short x 11 gamma")
def test_plan_sweep_routecore(benchmark):
    routecore_sweep()  # the trace's prefix-sum table is built once per chunk size
    r = benchmark(routecore_sweep)
    assert r.best is not None


@pytest.mark.benchmark(group="plan, paper model: Azure trace, 15 B_short x 11 gamma")
def test_plan_sweep_plain_python(benchmark):
    homo, _ = benchmark.pedantic(baseline_sweep, rounds=3, iterations=1)
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
