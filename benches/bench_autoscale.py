"""Autoscaling (issue 26): the live window's cost per observed request and
one sizing step for all pools, routecore (Rust from Python) beside its
plain-Python twin (``routecore._baselines.autoscale``: sums and Counters per
sub-window, the engine model of the planner's own twin), same run.

Run: .venv/bin/python -m pytest benches/bench_autoscale.py
"""

import numpy as np
import pytest

from routecore import Profile
from routecore._baselines import autoscale as twin
from routecore._core import Autoscaler

PROFILE = Profile.llama3_70b_a100()
POOLS = [
    {"name": f"pool-{i}", "context": c, "max_endpoints": 100_000, "slo_ttft_s": s,
     "slo_tpot_s": 0.08}
    for i, (c, s) in enumerate([(4096, 1.0), (8192, 1.5), (16384, 2.0), (65536, 4.0)] * 2)
]  # fmt: skip
N = 100_000
RNG = np.random.default_rng(0)
PROMPTS = (2 ** RNG.uniform(4, 12, N)).astype(np.int64)
OUTPUTS = RNG.integers(1, 1024, N)
NOW = np.linspace(0.0, 59.0, N)


def filled():
    """Both sides with the same 100,000 requests spread over the pools and
    60 s (about 200 req/s per pool)."""
    a = Autoscaler({"pools": POOLS}, [PROFILE] * len(POOLS), now=0.0)
    windows = [twin.Window(60.0, 6, PROFILE.c_chunk) for _ in POOLS]
    for i, pool in enumerate(POOLS):
        sl = slice(i, None, len(POOLS))
        a.observe_many(pool["name"], PROMPTS[sl], OUTPUTS[sl], NOW[sl])
        rows = zip(NOW[sl].tolist(), PROMPTS[sl].tolist(), OUTPUTS[sl].tolist(), strict=True)
        for t, p, o in rows:
            windows[i].observe(t, p, o)
    return a, windows


def test_the_twin_sizes_like_routecore():
    a, windows = filled()
    got = [d["model_endpoints"] for d in a.step(now=59.5)]
    assert got == twin.step(windows, POOLS, PROFILE, 59.5)
    assert all(n > 1 for n in got)


@pytest.mark.benchmark(group="autoscale-observe-100k")
def test_observe_many_routecore(benchmark):
    def run():
        a = Autoscaler({"pools": POOLS[:1]}, [PROFILE], now=0.0)
        a.observe_many("pool-0", PROMPTS, OUTPUTS, NOW)

    benchmark(run)


@pytest.mark.benchmark(group="autoscale-observe-100k")
def test_observe_many_twin(benchmark):
    rows = list(zip(NOW.tolist(), PROMPTS.tolist(), OUTPUTS.tolist(), strict=True))

    def run():
        w = twin.Window(60.0, 6, PROFILE.c_chunk)
        for t, p, o in rows:
            w.observe(t, p, o)

    benchmark(run)


@pytest.mark.benchmark(group="autoscale-observe-one")
def test_observe_one_routecore(benchmark):
    a = Autoscaler({"pools": POOLS[:1]}, [PROFILE], now=0.0)
    benchmark(a.observe, "pool-0", 2000, 200, now=1.0)


@pytest.mark.benchmark(group="autoscale-step-8-pools")
def test_step_routecore(benchmark):
    a, _ = filled()
    benchmark(a.step, now=59.5)


@pytest.mark.benchmark(group="autoscale-step-8-pools")
def test_step_twin(benchmark):
    _, windows = filled()
    benchmark(twin.step, windows, POOLS, PROFILE, 59.5)
