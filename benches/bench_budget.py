"""Token-budget routing: routecore beside the plain-Python router, same run.

Run: .venv/bin/python -m pytest benches/bench_budget.py
"""

import numpy as np
import pytest

from routecore._baselines.cases import CATEGORIES
from routecore._baselines.cases import budget_router as routecore_router
from routecore._baselines.cases import budget_twin as baseline_router
from routecore._baselines.cases import budget_workload as workload

N_MANY = 1_000_000


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
    names = CATEGORIES
    ids = np.array([r.category_id(n) for n in names])
    b, c, o = workload(N_MANY)
    out = benchmark(r.route_many, b, ids[c], o)
    assert out.shape == (N_MANY,)


@pytest.mark.benchmark(group="route_many: 1M requests")
def test_route_many_plain_python_loop(benchmark):
    r = baseline_router()
    names = CATEGORIES
    b, c, o = workload(N_MANY)
    rows = list(zip(b.tolist(), [names[i] for i in c.tolist()], o.tolist()))

    def loop():
        route = r.route
        return [route(*row) for row in rows]

    out = benchmark.pedantic(loop, rounds=3, iterations=1)
    assert len(out) == N_MANY
