"""Token-budget routing: routecore beside the plain-Python router, same run.

Run: .venv/bin/python -m pytest benches/bench_budget.py
"""

import numpy as np
import pytest

from benches.baselines import budget as baseline
from routecore import Pool, TokenBudgetRouter

N_MANY = 1_000_000
POOLS = [("short", 8192, 8192, None), ("long", 65536, 65536, None)]


def routecore_router():
    r = TokenBudgetRouter([Pool(n, c, b, q) for n, c, b, q in POOLS])
    for cat, b, t in [("prose", 4500, 1000), ("code", 3500, 1000), ("cjk", 2000, 1000)]:
        r.feedback(b, cat, t)
    return r


def baseline_router():
    r = baseline.TokenBudgetRouter(POOLS)
    for cat, b, t in [("prose", 4500, 1000), ("code", 3500, 1000), ("cjk", 2000, 1000)]:
        r.calibrator.observe(cat, b, t)
    return r


def workload(n, seed=0):
    rng = np.random.default_rng(seed)
    prompt_bytes = rng.integers(100, 60_000, n)
    categories = rng.integers(0, 3, n)
    max_out = rng.choice(np.array([256, 1024, 4096]), n)
    return prompt_bytes, categories, max_out


@pytest.mark.benchmark(group="route: one call from Python")
def test_route_routecore(benchmark):
    r = routecore_router()
    d = benchmark(r.route, 12_000, "prose", 1024)
    assert d.pool == "short"


@pytest.mark.benchmark(group="route: one call from Python")
def test_route_plain_python(benchmark):
    r = baseline_router()
    assert benchmark(r.route, 12_000, "prose", 1024) == 0


@pytest.mark.benchmark(group="route_many: 1M requests")
def test_route_many_routecore(benchmark):
    r = routecore_router()
    names = ["prose", "code", "cjk"]
    ids = np.array([r.category_id(n) for n in names])
    b, c, o = workload(N_MANY)
    out = benchmark(r.route_many, b, ids[c], o)
    assert out.shape == (N_MANY,)


@pytest.mark.benchmark(group="route_many: 1M requests")
def test_route_many_plain_python_loop(benchmark):
    r = baseline_router()
    names = ["prose", "code", "cjk"]
    b, c, o = workload(N_MANY)
    rows = list(zip(b.tolist(), [names[i] for i in c.tolist()], o.tolist()))

    def loop():
        route = r.route
        return [route(*row) for row in rows]

    out = benchmark.pedantic(loop, rounds=3, iterations=1)
    assert len(out) == N_MANY
