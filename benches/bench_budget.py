"""Token-budget routing: routecore beside its Python twins, same run.

``route`` beside the plain-Python router (one request: no vectorising);
``route_many`` beside the NumPy router (``_baselines.budget.NumpyRouter``: the
estimate of every request at once, one ``np.where`` per pool bound, the counts
by ``np.count_nonzero``), checked to decide and count like routecore, and,
for reference, the per-request Python loop.

Run: .venv/bin/python -m pytest benches/bench_budget.py
"""

import numpy as np
import pytest

from routecore._baselines.cases import CATEGORIES, budget_numpy_twin
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


def batch():
    """routecore's router, the NumPy twin with its ratios, and 1M requests
    (prompt bytes, category ids, max output tokens)."""
    r = routecore_router()
    ids = np.array([r.category_id(n) for n in CATEGORIES])
    b, c, o = workload(N_MANY)
    return r, budget_numpy_twin(r), (b, ids[c], o)


def test_the_numpy_twin_decides_and_counts_like_routecore():
    r, twin, args = batch()
    assert np.array_equal(twin.route_many(*args), r.route_many(*args))
    assert twin.in_flight.tolist() == [r.in_flight(0), r.in_flight(1)]
    assert 0 < r.in_flight(0) < N_MANY  # both pools chosen


@pytest.mark.benchmark(group="route_many: 1M requests")
def test_route_many_routecore(benchmark):
    r, _, args = batch()
    out = benchmark(r.route_many, *args)
    assert out.shape == (N_MANY,)


@pytest.mark.benchmark(group="route_many: 1M requests")
def test_route_many_numpy(benchmark):
    _, twin, args = batch()
    out = benchmark(twin.route_many, *args)
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
