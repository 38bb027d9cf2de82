"""The pure autoscaler through its binding: the live window's percentiles
within the histogram's stated error, the sizing step equal to the planner
twin's for the same window, and bad input refused with the key named."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import Profile
from routecore._baselines import autoscale as twin
from routecore._core import Autoscaler

PROFILE = Profile.llama3_70b_a100()
ERROR = 1 / 32


def config(**pool):
    base = {"name": "p", "context": 16384, "max_endpoints": 1 << 20, "slo_ttft_s": 2.0}
    return {"pools": [base | pool]}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 200_000), min_size=1, max_size=400),
    st.lists(st.integers(0, 5_000), min_size=1, max_size=400),
)
def test_percentiles_within_the_stated_error(prompts, outputs):
    n = min(len(prompts), len(outputs))
    prompts, outputs = np.array(prompts[:n]), np.array(outputs[:n])
    a = Autoscaler(config(), [PROFILE], now=0.0)
    a.observe_many("p", prompts, outputs, np.linspace(0.0, 50.0, n))
    live = a.live("p", now=50.0)
    assert live["requests"] == n
    for name, values in (("prompt", prompts), ("output", outputs)):
        for q in (50, 90, 99):
            exact = int(np.quantile(values, q / 100, method="inverted_cdf"))
            got = live[f"{name}_p{q}"]
            assert exact <= got <= exact * (1 + ERROR), (name, q, exact, got)
    assert live["prompt_mean"] == pytest.approx(prompts.mean())


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.floats(0.3, 4.0),
    st.floats(0.02, 0.2),
    st.integers(1, 4000),
)
def test_the_step_is_the_planner_twins(seed, ttft, tpot, n):
    rng = np.random.default_rng(seed)
    prompts = (2 ** rng.uniform(4, 13, n)).astype(np.int64)
    outputs = rng.integers(1, 1024, n)
    now = np.sort(rng.uniform(0.0, 59.0, n))
    pool = {"slo_ttft_s": ttft, "slo_tpot_s": tpot}
    a = Autoscaler(config(**pool), [PROFILE], now=0.0)
    a.observe_many("p", prompts, outputs, now)
    w = twin.Window(60.0, 6, PROFILE.c_chunk)
    for t, p, o in zip(now.tolist(), prompts.tolist(), outputs.tolist(), strict=True):
        w.observe(t, p, o)
    got = a.step(now=59.5)[0]
    want = twin.step([w], [{"context": 16384, **pool}], PROFILE, 59.5)[0]
    assert got["model_endpoints"] == want, got["explanation"]


def test_no_traffic_min_and_unreachable_max():
    a = Autoscaler(config(min_endpoints=2, max_endpoints=9, slo_tpot_s=0.004), [PROFILE], now=0.0)
    (d,) = a.step(now=10.0, promised={"p": 1e6})
    assert (d["endpoints"], d["reason"]) == (2, "no-traffic")
    for i in range(100):
        a.observe("p", 500, 50, now=i / 10)
    (d,) = a.step(now=10.0)
    assert (d["target"], d["reason"], d["binding"]) == (9, "slo-unreachable", "compute")
    assert "SLO unreachable: max 9 (binding compute)" in d["explanation"]


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (config(min_endpoints=5, max_endpoints=3), "autoscale.pools[0].min_endpoints"),
        ({"period_s": 0, "pools": []}, "autoscale.period_s must be > 0"),
        ({"window_s": -1, "pools": []}, "autoscale.window_s must be > 0"),
        ({"perod_s": 1}, "perod_s"),
        (config(slo_ttft_s=-1.0), "autoscale.pools[0].slo_ttft_s must be > 0"),
    ],
)
def test_bad_config_names_the_key(cfg, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Autoscaler(cfg, [PROFILE] * len(cfg.get("pools", [])), now=0.0)


def test_bad_input_changes_nothing():
    a = Autoscaler(config(entitlements=["team"]), [PROFILE], now=0.0)
    a.observe("p", 100, 10, entitlement="team", now=1.0)
    with pytest.raises(KeyError):
        a.observe("q", 100, 10, now=1.0)
    with pytest.raises(KeyError):
        a.observe("p", 100, 10, entitlement="nobody", now=1.0)
    with pytest.raises(ValueError):
        a.observe_many("p", [1, 2], [1, -2], [1.0, 2.0])
    with pytest.raises(ValueError):
        a.observe_many("p", [1, 2], [1, 2], [1.0, float("nan")])
    with pytest.raises(ValueError):
        a.step(now=2.0, queued={"p": -1.0})
    with pytest.raises(KeyError):
        a.step(now=2.0, promised={"nope": 1.0})
    assert a.live("p", now=2.0)["requests"] == 1
    assert a.live("p", entitlement="team", now=2.0)["requests"] == 1


def test_the_docstring_example_runs():
    import doctest

    test = doctest.DocTestParser().get_doctest(
        Autoscaler.__doc__, {"Autoscaler": Autoscaler, "Profile": Profile}, "Autoscaler", None, 0
    )
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.tries > 0 and runner.failures == 0
